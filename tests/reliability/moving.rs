//! `inventory shard move` under load, with faults. Two shards, each its own fresh database
//! served by two `serve --shard` instances (each running its shard's relay), on a stream
//! sharded onto four partitions on a nats-server 2.11+ of the test's own. Partitions 0 (shard
//! a) and 3 (shard b) stay put, so neither shard is ever left without a partition; partitions
//! 1 and 2 move between the shards, one move a round, while a producer publishes placements
//! over every partition's books (resends under new ids, copies under the same id, which the
//! stream keeps), line cancellations (some published before their placement) and, with the
//! consumers' ack wait cut to 2 s, redeliveries. The test is the instances' supervisor: one
//! that exits (`serve --shard` does when its partitions change) is started again.
//!
//! A round either kills the mover at each step in turn (SIGKILL 0 to 30 ms after the move's
//! record in the bucket shows the step, so the step's action may or may not have committed,
//! then the same command again), with a serving instance of the old shard SIGSTOPped while the
//! fence runs (SIGCONT 4 s later; `--idle-grace 2s`), and, in the first round, a session of the
//! test's own idle in a transaction that holds a stock row of the partition, which the fence
//! must end (bounded against a hang, not timed); or runs two movers at once and an `--abort`
//! against them, every other time with both movers SIGSTOPped until the abort is through.
//!
//! After the load drains: every (order, book) has one reservation row across both databases,
//! `reserved` unless its line was cancelled (then `released`), on the shard that holds its
//! partition; each book's `reserved` is the sum of its reserved rows there; each line's events
//! are stored once (`stock.reserved`, then `stock.released` if cancelled after; none if the
//! cancellation came first); nothing is dead-lettered; the partitions
//! are where the last moves put them, their owner rows active there only, and no database holds
//! a row of a partition it does not own.
//!
//! `MOVE_SOAK_ROUNDS` sets the number of rounds (8 by default: partition 1 goes there and back
//! twice, partition 2 as often unless an abort keeps it; every fourth round, from the second,
//! is contested).

use std::collections::{HashMap, HashSet};
use std::io::Read as _;
use std::num::NonZeroU32;
use std::process::{Child, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer;
use async_nats::jetstream::context::Context;
use async_nats::jetstream::kv::Store;
use futures::StreamExt as _;
use inventory_benches::produce::Produce as _;
use inventory_benches::workload::SplitMix64;
use inventory_domain::shard::partition_of;
use inventory_domain::{BookId, Message, OrderId};
use inventory_infra::db::DatabaseConnection;
use inventory_infra::jetstream::{self, Shards, Topology, partition_consumer, shards_bucket};
use inventory_infra::shard_move::{MoveRecord, Step};
use inventory_tests::nats::{NatsServer, binary_version};
use inventory_tests::workload::{self, Send, SendKind, Workload};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use sea_orm::{ConnectionTrait as _, DbBackend, Statement, TransactionTrait as _};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::support::{
    Instance, Scenario, fresh_with_books_where, seed, stock_books, wait_until_empty,
};

const PARTITIONS: NonZeroU32 = NonZeroU32::new(4).unwrap();
/// The partitions that move, alternately; 0 stays on a and 3 on b.
const MOVING: [u32; 2] = [1, 2];
const BOOKS_PER_PARTITION: usize = 3;
const INSTANCES_PER_SHARD: usize = 2;
/// The partition consumers' ack wait: a stopped or exiting instance's messages come back soon.
const ACK_WAIT: Duration = Duration::from_secs(2);
/// The producer: this many orders a batch, then this pause.
const BATCH_ORDERS: usize = 16;
const BATCH_PAUSE: Duration = Duration::from_millis(300);
/// How long an instance of the old shard stays SIGSTOPped around the fence.
const STOPPED_FOR: Duration = Duration::from_secs(4);
/// Any one mover run, and the drain at the end.
const MOVER_LIMIT: Duration = Duration::from_secs(60);
const SETTLE: Duration = Duration::from_secs(120);
/// The fence, with a session idle in a transaction in its way, and two mover starts: a bound
/// against waiting for ever, not a speed (this machine is noisy; a run under CI's load took
/// 10.2 s). That the fence ends the session through the placements queued behind it, rather
/// than after their statement timeout, `integration/moving.rs` shows without a clock.
const FENCE_LIMIT: Duration = Duration::from_secs(45);
/// The steps a mover is killed at, in order.
const KILL_STEPS: [Step; 8] = [
    Step::Pause,
    Step::Fence,
    Step::Copy,
    Step::Drain,
    Step::HandOver,
    Step::Activate,
    Step::Resume,
    Step::Remove,
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: run by scripts/test.sh"]
async fn partitions_move_back_and_forth_under_load_with_movers_killed_at_every_step() {
    let started = Instant::now();
    let rounds: usize = std::env::var("MOVE_SOAK_ROUNDS")
        .ok()
        .and_then(|rounds| rounds.parse().ok())
        .unwrap_or(8);
    let seed = seed("shard move under load");
    let mut random = SplitMix64::new(seed);

    // A server with consumer pauses (2.11+): the moves' first step does something.
    let bin = inventory_tests::nats::binary_since_2_10().unwrap_or_else(|why| panic!("{why}"));
    assert!(
        binary_version(&bin).is_some_and(|version| version >= (2, 11)),
        "{} is older than 2.11: the move's pause would be skipped",
        bin.display()
    );
    let server = NatsServer::start_binary(&bin).await;
    let pg = inventory_tests::postgres::server_url().await;
    let (a_db, _) = fresh_with_books_where(&pg, "inventory_move_a", 0, |_| false).await;
    let (b_db, _) = fresh_with_books_where(&pg, "inventory_move_b", 0, |_| false).await;
    let mut books: HashMap<u32, Vec<BookId>> = HashMap::new();
    for partition in 0..PARTITIONS.get() {
        let of_it: Vec<BookId> = std::iter::repeat_with(BookId::new_v7)
            .filter(|book| partition_of(*book, PARTITIONS) == partition)
            .take(BOOKS_PER_PARTITION)
            .collect();
        let db = if partition < 2 { &a_db } else { &b_db };
        stock_books(&db.conn, &of_it).await;
        books.insert(partition, of_it);
    }
    let all_books: Vec<BookId> = (0..PARTITIONS.get())
        .flat_map(|p| books[&p].clone())
        .collect();

    let mut scenario = Scenario::new("move_load", &a_db.url, &server.url(), 1);
    scenario
        .serve_args
        .extend(["--db-pool-size", "4"].map(str::to_owned));
    let (_client, js) = scenario.connect().await;
    let base = scenario.names.consumer.clone();
    let p = PARTITIONS.to_string();
    scenario.run(
        "init",
        &["shard", "init", "--partitions", &p, "--consumer", &base],
    );
    let shards: [(&'static str, &str); 2] = [("a", &a_db.url), ("b", &b_db.url)];
    for ((name, url), range) in shards.iter().zip(["0-1", "2-3"]) {
        scenario.run(
            &format!("assign-{name}"),
            &[
                "shard",
                "assign",
                "--partitions",
                range,
                "--to",
                name,
                "--database-url",
                url,
            ],
        );
    }
    shorten_ack_wait(&js, &scenario.topology, &base).await;
    let kv = js
        .get_key_value(shards_bucket(&scenario.topology))
        .await
        .unwrap();
    let mut holder: HashMap<u32, &'static str> = [(0, "a"), (1, "a"), (2, "b"), (3, "b")].into();

    let scenario = Arc::new(scenario);
    let slots: Arc<Mutex<Vec<Slot>>> = Arc::new(Mutex::new(
        shards
            .iter()
            .flat_map(|&(name, url)| {
                (1..=INSTANCES_PER_SHARD).map(move |n| (name, url.to_owned(), n))
            })
            .map(|(shard, url, n)| Slot::start(&scenario, shard, url, n))
            .collect(),
    ));
    let supervised = CancellationToken::new();
    let supervisor = supervise(
        Arc::downgrade(&scenario),
        Arc::clone(&slots),
        supervised.clone(),
    );
    let stop = CancellationToken::new();
    let producer = tokio::spawn(produce(
        js.clone(),
        scenario.topology.clone(),
        all_books.clone(),
        seed,
        stop.clone(),
    ));
    // Some load on every partition before the first move.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let urls: HashMap<&str, &str> = shards.into_iter().collect();
    let mut figures = Figures::default();
    for round in 0..rounds {
        let partition = MOVING[round % 2];
        let from = holder[&partition];
        let to = if from == "a" { "b" } else { "a" };
        let mover = Mover {
            scenario: &scenario,
            kv: &kv,
            partition,
            to,
            from_url: urls[from],
            to_url: urls[to],
            base: &base,
        };
        let began = Instant::now();
        let moved = if round % 4 == 1 {
            contested_round(&mover, round, &mut random, &mut figures).await
        } else {
            let held = if round == 0 {
                Some(hold_a_stock_row(urls[from], &books[&partition]).await)
            } else {
                None
            };
            let holding = held.is_some();
            killed_round(
                &mover,
                round,
                (&slots, from),
                holding,
                &mut random,
                &mut figures,
            )
            .await;
            if let Some(held) = held {
                // The fence went through, so the session holding its lock is gone.
                assert!(held.commit().await.is_err(), "the fence waited for nothing");
                figures.idle_session_ended = true;
            }
            true
        };
        if moved {
            holder.insert(partition, to);
            figures.moves += 1;
        } else {
            figures.aborts += 1;
        }
        eprintln!(
            "[shard move under load] round {round}: partition {partition} {from} -> {to}: {} in \
             {:.1?}",
            if moved { "moved" } else { "aborted" },
            began.elapsed()
        );
        // Let the load run on the new assignment for a moment.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let moves_done = started.elapsed();
    let moves_ended = Instant::now();

    // The load stops; everything published must be decided and its events out.
    stop.cancel();
    let load = producer.await.unwrap();
    let consumers: Vec<String> = (0..PARTITIONS.get())
        .map(|partition| partition_consumer(&base, partition, PARTITIONS))
        .collect();
    let state = workload::settle_all(
        &js,
        &scenario.topology,
        &consumers,
        load.sends as u64,
        SETTLE,
    )
    .await;
    for db in [&a_db.conn, &b_db.conn] {
        wait_until_empty(db, "outbox", &scenario, SETTLE).await;
    }
    // The instances the last hand-over stops (as soon as their watch sees it, then a drain) are
    // running again, and stay up.
    let steady = Instant::now() + Duration::from_secs(30);
    while moves_ended.elapsed() < Duration::from_secs(3)
        || !slots.lock().unwrap().iter_mut().all(|slot| {
            slot.instance.is_running() && slot.started.elapsed() > Duration::from_secs(2)
        })
    {
        assert!(Instant::now() < steady, "the instances never steadied");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    supervised.cancel();
    let restarts = supervisor.await.unwrap();
    let slots = std::mem::take(&mut *slots.lock().unwrap());
    crate::support::stop_all(
        &scenario,
        slots.into_iter().map(|slot| slot.instance).collect(),
    );
    let not_owned = scenario.log_lines_with("not owned here");
    // Messages delivered more than once: an ack wait that ran out (a stopped or exiting
    // instance), a nak (not owned, a statement timed out).
    let redelivered: HashSet<String> = scenario
        .lines_with(&["stream_seq=", "delivered="])
        .iter()
        .filter(|line| !line.contains("delivered=1 "))
        .filter_map(|line| {
            let at = line.find("stream_seq=")?;
            Some(line[at..].split_whitespace().next()?.to_owned())
        })
        .collect();
    let redelivered = redelivered.len();

    // Where each partition ended, in the bucket and the databases.
    let dbs: HashMap<&str, &DatabaseConnection> = [("a", &a_db.conn), ("b", &b_db.conn)].into();
    let assignment = Shards::open(&js, &scenario.topology)
        .await
        .unwrap()
        .unwrap()
        .assignment()
        .await
        .unwrap();
    for shard in ["a", "b"] {
        let expected: Vec<u32> = (0..PARTITIONS.get())
            .filter(|partition| holder[partition] == shard)
            .collect();
        assert_eq!(
            assignment.partitions_of(shard),
            expected,
            "shard {shard}'s partitions"
        );
        let owners = rows(
            dbs[shard],
            "SELECT partition_id::bigint AS p, shard, state FROM partition_owner ORDER BY 1",
        )
        .await;
        let owners: Vec<(u32, String, String)> = owners
            .iter()
            .map(|row| {
                (
                    u32::try_from(row.try_get::<i64>("", "p").unwrap()).unwrap(),
                    row.try_get("", "shard").unwrap(),
                    row.try_get("", "state").unwrap(),
                )
            })
            .collect();
        let wanted: Vec<(u32, String, String)> = expected
            .iter()
            .map(|&partition| (partition, shard.to_owned(), "active".to_owned()))
            .collect();
        assert_eq!(owners, wanted, "shard {shard}'s owner rows");
    }
    for &partition in &MOVING {
        let entry = kv.entry(jetstream::move_key(partition)).await.unwrap();
        if let Some(entry) = entry {
            let record: MoveRecord = serde_json::from_slice(&entry.value).unwrap();
            assert!(
                matches!(record.step, Step::Done | Step::Aborted),
                "partition {partition}'s move is not over: {record:?}"
            );
        }
    }

    // Each line decided once, across both databases, on the shard that holds its book.
    let mut reservations: HashMap<(Uuid, Uuid), (&str, i32, String)> = HashMap::new();
    let mut cancellations: HashSet<(Uuid, Uuid)> = HashSet::new();
    for (shard, db) in &dbs {
        for row in rows(
            db,
            "SELECT order_id, book_id, quantity, status FROM stock_reservations",
        )
        .await
        {
            let key = (
                row.try_get("", "order_id").unwrap(),
                row.try_get("", "book_id").unwrap(),
            );
            let value = (
                *shard,
                row.try_get("", "quantity").unwrap(),
                row.try_get("", "status").unwrap(),
            );
            if let Some(other) = reservations.insert(key, value.clone()) {
                panic!("{key:?} reserved on two shards: {other:?} and {value:?}");
            }
        }
        for row in rows(db, "SELECT order_id, book_id FROM line_cancellations").await {
            let key = (
                row.try_get("", "order_id").unwrap(),
                row.try_get("", "book_id").unwrap(),
            );
            assert!(cancellations.insert(key), "{key:?} cancelled on two shards");
            let book: Uuid = key.1;
            assert_eq!(
                holder[&partition_of(BookId::from(book), PARTITIONS)],
                *shard,
                "the cancellation of {key:?} on shard {shard}, which does not hold its book"
            );
        }
        for row in rows(db, "SELECT book_id FROM stock_items").await {
            let book: Uuid = row.try_get("", "book_id").unwrap();
            assert_eq!(
                holder[&partition_of(BookId::from(book), PARTITIONS)],
                *shard,
                "book {book}'s stock on shard {shard}, which does not hold it"
            );
        }
    }
    assert_eq!(
        reservations.len(),
        load.orders.len(),
        "reservation rows against distinct order lines"
    );
    let mut expected_reserved: HashMap<BookId, i64> =
        all_books.iter().map(|&book| (book, 0)).collect();
    for (order, &(book, quantity)) in &load.orders {
        let key = (order.as_uuid(), book.as_uuid());
        let (shard, held, status) = reservations
            .get(&key)
            .unwrap_or_else(|| panic!("order {order} of book {book} has no reservation row"));
        assert_eq!(
            *shard,
            holder[&partition_of(book, PARTITIONS)],
            "order {order}'s reservation is on a shard that does not hold book {book}"
        );
        assert_eq!(i64::from(*held), quantity, "order {order}'s quantity");
        let cancelled = load.cancelled.contains(order);
        assert_eq!(
            status,
            if cancelled { "released" } else { "reserved" },
            "order {order} (cancelled: {cancelled})"
        );
        assert_eq!(
            cancellations.contains(&key),
            cancelled,
            "order {order}'s line cancellation"
        );
        if !cancelled {
            *expected_reserved.get_mut(&book).unwrap() += quantity;
        }
    }
    for (shard, db) in &dbs {
        let stock = rows(
            db,
            "SELECT s.book_id, s.reserved::bigint AS reserved, \
                    coalesce((SELECT sum(r.quantity) FROM stock_reservations r \
                              WHERE r.book_id = s.book_id AND r.status = 'reserved'), 0)::bigint \
                      AS held \
             FROM stock_items s",
        )
        .await;
        for row in stock {
            let book = BookId::from(row.try_get::<Uuid>("", "book_id").unwrap());
            let reserved: i64 = row.try_get("", "reserved").unwrap();
            let held: i64 = row.try_get("", "held").unwrap();
            assert_eq!(
                reserved, held,
                "book {book} on shard {shard}: reserved against its rows"
            );
            assert_eq!(
                reserved, expected_reserved[&book],
                "book {book}: reserved against the load"
            );
        }
    }

    // Each decision's event stored once, in order per line; nothing dead-lettered.
    let topology = &scenario.topology;
    let events = inventory_tests::outbox::stored(&js, &topology.events_stream).await;
    let by_order =
        inventory_tests::outbox::subjects_by_order(&events, &topology.events_subject_prefix);
    let (mut reserved_then_released, mut cancelled_first) = (0, 0);
    for order in by_order.keys() {
        assert!(
            load.orders.contains_key(&OrderId::from(*order)),
            "events of order {order}, never placed"
        );
    }
    for order in load.orders.keys() {
        let subjects = by_order.get(&order.as_uuid()).map(Vec::as_slice);
        let subjects: Vec<&str> = subjects.unwrap_or(&[]).iter().map(String::as_str).collect();
        if !load.cancelled.contains(order) {
            assert_eq!(subjects, ["stock.reserved"], "events of order {order}");
        } else if subjects.is_empty() {
            // Cancelled first: the placement was recorded released and moved nothing.
            cancelled_first += 1;
        } else {
            assert_eq!(
                subjects,
                ["stock.reserved", "stock.released"],
                "events of cancelled order {order}"
            );
            reserved_then_released += 1;
        }
    }
    let dlq = workload::consumers_state(&js, topology, &[])
        .await
        .unwrap()
        .dead_letters;
    assert_eq!(
        dlq,
        0,
        "dead letters: {:#?}",
        inventory_tests::outbox::stored(&js, &topology.dlq_stream).await
    );
    assert!(state.settled(), "{state:?}");

    eprintln!(
        "[shard move under load] seed {seed}, {rounds} rounds in {:.1?} ({:.1?} in all): {} moves, \
         {} aborted; movers SIGKILLed {} times at each step ({} after the step's action and \
         record), {} mover runs; {} instances SIGSTOPped, \
         the fence {} (idle sessions ended by it: {}); a second mover and an abort: {}; \
         {} instance restarts; {} messages published ({} orders over {} books, {} new-id \
         resends, {} same-id copies, {} line cancellations, {} of them sent first), {} on the \
         moving partitions; {} deliveries not owned, {} messages delivered more than once; {} events \
         ({reserved_then_released} lines reserved then released, {cancelled_first} cancelled \
         first)",
        moves_done,
        started.elapsed(),
        figures.moves,
        figures.aborts,
        figures.kills,
        figures.killed_after_recording,
        figures.mover_runs,
        figures.stopped,
        figures.fence_waits.join(", "),
        figures.idle_session_ended,
        figures.contested.join("; "),
        restarts,
        load.sends,
        load.orders.len(),
        all_books.len(),
        load.new_ids,
        load.same_ids,
        load.cancelled.len(),
        load.cancelled_first,
        load.on_moving,
        not_owned,
        redelivered,
        events.len(),
    );
    // Kept after a failure, with the instances' logs, to be read.
    for db in [a_db, b_db] {
        db.remove().await.unwrap();
    }
}

/// What the rounds did, for the closing line.
#[derive(Default)]
struct Figures {
    moves: usize,
    aborts: usize,
    kills: usize,
    /// Kills that came after the mover had recorded the next step.
    killed_after_recording: usize,
    mover_runs: usize,
    stopped: usize,
    fence_waits: Vec<String>,
    idle_session_ended: bool,
    contested: Vec<String>,
}

/// The partition consumers' ack wait cut to [`ACK_WAIT`] (init gives them serve's 30 s), as the
/// instances' `--ack-wait` says.
async fn shorten_ack_wait(js: &Context, topology: &Topology, base: &str) {
    let stream = js.get_stream(&topology.stream).await.unwrap();
    for partition in 0..PARTITIONS.get() {
        let name = partition_consumer(base, partition, PARTITIONS);
        let info = stream.consumer_info(&name).await.unwrap();
        let config = consumer::Config {
            ack_wait: ACK_WAIT,
            ..info.config.clone()
        };
        stream.update_consumer(config).await.unwrap();
    }
}

/// A `serve --shard` instance slot, started again whenever its process exits.
struct Slot {
    shard: &'static str,
    url: String,
    label: String,
    instance: Instance,
    started: Instant,
}

impl Slot {
    fn start(scenario: &Scenario, shard: &'static str, url: String, n: usize) -> Self {
        let label = format!("{shard}{n}");
        let instance = scenario.spawn_with(&label, &["--shard", shard, "--database-url", &url]);
        Self {
            shard,
            url,
            label,
            instance,
            started: Instant::now(),
        }
    }
}

/// The supervisor: every 100 ms, an instance that exited is started again; how many were.
/// It holds the scenario weakly, so that a failing test's drop of it keeps the logs.
fn supervise(
    scenario: std::sync::Weak<Scenario>,
    slots: Arc<Mutex<Vec<Slot>>>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<usize> {
    tokio::spawn(async move {
        let mut restarts = 0;
        while !stop.is_cancelled() {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let Some(scenario) = scenario.upgrade() else {
                break;
            };
            for slot in slots.lock().unwrap().iter_mut() {
                if !slot.instance.is_running() {
                    restarts += 1;
                    slot.started = Instant::now();
                    slot.instance = scenario.spawn_with(
                        &slot.label,
                        &["--shard", slot.shard, "--database-url", &slot.url],
                    );
                }
            }
        }
        restarts
    })
}

/// What the producer published.
struct Load {
    sends: usize,
    orders: HashMap<OrderId, (BookId, i64)>,
    cancelled: HashSet<OrderId>,
    cancelled_first: usize,
    new_ids: usize,
    same_ids: usize,
    on_moving: usize,
}

/// Publishes batches until `stop`: [`BATCH_ORDERS`] orders round robin over `books` with the
/// producer's resends (a new id, or the same id kept by the stream), and a cancellation of
/// every sixth order's line, half of them before its placement; every third cancellation is
/// sent twice under its id.
async fn produce(
    js: Context,
    topology: Topology,
    books: Vec<BookId>,
    seed: u64,
    stop: CancellationToken,
) -> Load {
    let mut load = Load {
        sends: 0,
        orders: HashMap::new(),
        cancelled: HashSet::new(),
        cancelled_first: 0,
        new_ids: 0,
        same_ids: 0,
        on_moving: 0,
    };
    let mut batch = 0_u64;
    while !stop.is_cancelled() {
        let mut books = books.clone();
        let turn = usize::try_from(batch).unwrap() % books.len();
        books.rotate_left(turn);
        let placed = Workload::new(&books, BATCH_ORDERS, 3, 3, seed.wrapping_add(batch));
        let mut sends: Vec<Send> = Vec::with_capacity(placed.sends.len() * 2);
        let mut later: Vec<Send> = Vec::new();
        for (i, send) in placed.sends.iter().enumerate() {
            let order = send.message.event.order_id();
            let (book, _) = placed.orders[&order];
            if send.kind == SendKind::Original && i % 6 == 0 {
                let cancel = Send {
                    message: Message::cancelled_line(order, book),
                    kind: SendKind::Original,
                };
                if i % 12 == 0 {
                    sends.push(cancel.clone());
                    load.cancelled_first += 1;
                } else {
                    later.push(cancel.clone());
                }
                if i % 18 == 0 {
                    later.push(Send {
                        kind: SendKind::SameId,
                        ..cancel
                    });
                }
                load.cancelled.insert(order);
            }
            sends.push(send.clone());
            if i % 5 == 4 {
                sends.append(&mut later);
            }
        }
        sends.append(&mut later);
        load.new_ids += placed.count(SendKind::NewId);
        load.same_ids += placed.count(SendKind::SameId);
        load.on_moving += sends
            .iter()
            .filter(|send| {
                let book = match &send.message.event {
                    inventory_domain::Event::Placed(placed) => Some(placed.book_id),
                    inventory_domain::Event::Cancelled(cancelled) => cancelled.book_id,
                    inventory_domain::Event::StockReserved(_) => None,
                };
                book.is_some_and(|book| MOVING.contains(&partition_of(book, PARTITIONS)))
            })
            .count();
        load.sends += sends.len();
        load.orders.extend(placed.orders);
        // One at a time, in order: a cancellation sent first is stored first.
        workload::publish(&js, &topology, &sends, 1, sends.len(), Duration::ZERO).await;
        batch += 1;
        tokio::select! {
            () = stop.cancelled() => {}
            () = tokio::time::sleep(BATCH_PAUSE) => {}
        }
    }
    load
}

/// A session of the test's own on the old shard, idle in a transaction that holds a stock row
/// of the moving partition: the fence must end it after `--idle-grace`, which the transaction's
/// commit then shows by failing.
async fn hold_a_stock_row(url: &str, books: &[BookId]) -> sea_orm::DatabaseTransaction {
    let conn = sea_orm::Database::connect(url).await.unwrap();
    let txn = conn.begin().await.unwrap();
    txn.execute_unprepared(&format!(
        "SELECT 1 FROM stock_items WHERE book_id = '{}' FOR UPDATE",
        books[0]
    ))
    .await
    .unwrap();
    txn
}

/// `shard move` of one partition between two shards' databases.
struct Mover<'a> {
    scenario: &'a Scenario,
    kv: &'a Store,
    partition: u32,
    to: &'a str,
    from_url: &'a str,
    to_url: &'a str,
    base: &'a str,
}

impl Mover<'_> {
    fn command(&self, label: &str, abort: bool) -> std::process::Command {
        let mut args: Vec<String> = ["shard", "move", "--partition"].map(str::to_owned).into();
        args.push(self.partition.to_string());
        if abort {
            args.push("--abort".to_owned());
        } else {
            args.extend(["--to".to_owned(), self.to.to_owned()]);
        }
        args.extend(
            [
                "--consumer",
                self.base,
                "--from-database-url",
                self.from_url,
                "--to-database-url",
                self.to_url,
                "--idle-grace",
                "2s",
                "--pause-for",
                "30s",
            ]
            .map(str::to_owned),
        );
        self.scenario.command(label, &args)
    }

    fn spawn(&self, label: &str) -> Reaped {
        Reaped(self.command(label, false).spawn().unwrap())
    }

    /// Runs the move again and SIGKILLs it once its record shows `target` (or a later step),
    /// written by this run.
    /// The kill comes 0 to 30 ms after the record shows the step (from `random`), so the
    /// step's action is sometimes cut short, sometimes committed, sometimes recorded too.
    async fn run_and_kill(
        &self,
        label: &str,
        target: Step,
        random: &mut SplitMix64,
        figures: &mut Figures,
    ) {
        let after = self.record().await.map_or(0, |(revision, _)| revision);
        let mut child = self.spawn(label);
        figures.mover_runs += 1;
        let delay = Duration::from_millis(random.below(31));
        if let Some(step) = self.kill_at(&mut child, after, target, delay).await {
            figures.kills += 1;
            let now = self.record().await.map(|(_, record)| record.step);
            if now.is_some_and(|now| order(now) > order(step)) {
                figures.killed_after_recording += 1;
            }
        }
    }

    /// The move's record now, and its revision.
    async fn record(&self) -> Option<(u64, MoveRecord)> {
        let entry = self
            .kv
            .entry(jetstream::move_key(self.partition))
            .await
            .unwrap()?;
        Some((entry.revision, serde_json::from_slice(&entry.value).ok()?))
    }

    /// Waits until the record, written after revision `after`, is at `target` or past it, or
    /// until `child` exits; SIGKILLs `child` `delay` after that. The record's step seen, if it
    /// was killed.
    async fn kill_at(
        &self,
        child: &mut Reaped,
        after: u64,
        target: Step,
        delay: Duration,
    ) -> Option<Step> {
        let mut watch = self
            .kv
            .watch(jetstream::move_key(self.partition))
            .await
            .unwrap();
        let deadline = Instant::now() + MOVER_LIMIT;
        let reached = |revision: u64, step: Step| revision > after && order(step) >= order(target);
        let mut seen = self.record().await;
        loop {
            if let Some((revision, record)) = &seen
                && reached(*revision, record.step)
            {
                tokio::time::sleep(delay).await;
                let _ = child.kill();
                let _ = child.wait();
                return Some(record.step);
            }
            if let Some(status) = child.try_wait().unwrap() {
                return if status.success() {
                    None
                } else {
                    panic!(
                        "a mover waited on for {target} exited: {status}\n{}",
                        self.scenario.log_tails()
                    )
                };
            }
            assert!(Instant::now() < deadline, "the move never reached {target}");
            seen = tokio::select! {
                entry = watch.next() => match entry {
                    Some(Ok(entry)) => serde_json::from_slice(&entry.value)
                        .ok()
                        .map(|record| (entry.revision, record)),
                    _ => self.record().await,
                },
                () = tokio::time::sleep(Duration::from_millis(25)) => self.record().await,
            };
        }
    }
}

/// A mover's process, SIGKILLed and reaped when dropped: a failing test leaves none behind.
struct Reaped(Child);

impl std::ops::Deref for Reaped {
    type Target = Child;

    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Reaped {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Each step's place in a move; the abort's steps after them all.
fn order(step: Step) -> usize {
    KILL_STEPS
        .iter()
        .position(|&kill| kill == step)
        .unwrap_or(if step == Step::Done { 8 } else { 9 })
}

/// Waits for a mover to end within [`MOVER_LIMIT`]; its status.
fn ended(child: &mut Child, scenario: &Scenario) -> ExitStatus {
    let deadline = Instant::now() + MOVER_LIMIT;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("a mover ran past {MOVER_LIMIT:?}\n{}", scenario.log_tails());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The move run with its mover SIGKILLed at each step in turn and run again, an instance of
/// the old shard SIGSTOPped while the fence runs, then run to its end. With `holding`, a
/// session idle in a transaction holds a stock row of the partition: the fence must end it
/// (within [`FENCE_LIMIT`], against a hang).
async fn killed_round(
    mover: &Mover<'_>,
    round: usize,
    (slots, from): (&Mutex<Vec<Slot>>, &str),
    holding: bool,
    random: &mut SplitMix64,
    figures: &mut Figures,
) {
    let start = mover.record().await.map_or(0, |(revision, _)| revision);
    let label = format!("mover-r{round}");
    let mut killed_at = HashSet::new();
    for target in KILL_STEPS {
        let now = mover
            .record()
            .await
            .filter(|(revision, _)| *revision > start)
            .map(|(_, record)| record.step);
        if killed_at.contains(&target) || now.is_some_and(|step| order(step) > order(target)) {
            continue;
        }
        let stopped = if target == Step::Fence {
            let stopped = stop_an_instance(slots, from, random);
            figures.stopped += usize::from(stopped.is_some());
            stopped
        } else {
            None
        };
        let fence_began = Instant::now();
        mover.run_and_kill(&label, target, random, figures).await;
        if target == Step::Fence {
            // The fence runs in the next mover (this one was killed as it began it), with the
            // instance stopped.
            mover
                .run_and_kill(&label, Step::Copy, random, figures)
                .await;
            killed_at.insert(Step::Copy);
            let took = fence_began.elapsed();
            figures.fence_waits.push(format!("{took:.1?}"));
            assert!(
                !holding || took < FENCE_LIMIT,
                "the fence took {took:.1?} with a session idle in a transaction for longer \
                 than --idle-grace 2s in its way\n{}",
                mover.scenario.log_tails()
            );
            if let Some(pid) = stopped {
                tokio::spawn(async move {
                    tokio::time::sleep(STOPPED_FOR.saturating_sub(took)).await;
                    let _ = kill(pid, Signal::SIGCONT);
                });
            }
        }
    }
    if mover
        .record()
        .await
        .is_some_and(|(_, record)| record.step != Step::Done)
    {
        let mut child = mover.spawn(&label);
        figures.mover_runs += 1;
        let status = ended(&mut child, mover.scenario);
        assert!(
            status.success(),
            "the move's last run: {status}\n{}",
            mover.scenario.log_tails()
        );
    }
    let (_, record) = mover.record().await.unwrap();
    assert_eq!(record.step, Step::Done, "{record:?}");
}

/// SIGSTOPs a running instance of `shard`; its pid.
fn stop_an_instance(slots: &Mutex<Vec<Slot>>, shard: &str, random: &mut SplitMix64) -> Option<Pid> {
    let mut slots = slots.lock().unwrap();
    let running: Vec<&mut Slot> = slots
        .iter_mut()
        .filter(|slot| slot.shard == shard)
        .filter_map(|slot| slot.instance.is_running().then_some(slot))
        .collect();
    if running.is_empty() {
        return None;
    }
    let at = usize::try_from(random.below(running.len() as u64)).unwrap();
    let pid = Pid::from_raw(i32::try_from(running[at].instance.pid()).unwrap());
    kill(pid, Signal::SIGSTOP).unwrap();
    Some(pid)
}

/// Two movers at once and an abort started once the record shows the pause, the fence, the copy
/// or the drain. In every other contested round the two movers are SIGSTOPped then, whatever
/// their action, until the abort has ended or 4 s have passed (it may wait for their locks).
/// Whether the partition moved (the abort came too late) or stayed.
async fn contested_round(
    mover: &Mover<'_>,
    round: usize,
    random: &mut SplitMix64,
    figures: &mut Figures,
) -> bool {
    let start = mover.record().await.map_or(0, |(revision, _)| revision);
    let target = KILL_STEPS[usize::try_from(random.below(4)).unwrap()];
    let freeze = round % 8 == 1;
    let mut first = mover.spawn(&format!("mover-r{round}-1"));
    let mut second = mover.spawn(&format!("mover-r{round}-2"));
    figures.mover_runs += 2;
    let deadline = Instant::now() + MOVER_LIMIT;
    loop {
        if let Some((revision, record)) = mover.record().await
            && revision > start
            && order(record.step) >= order(target)
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the contested move never reached {target}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let movers = [&first, &second].map(|child| Pid::from_raw(i32::try_from(child.id()).unwrap()));
    if freeze {
        for pid in movers {
            let _ = kill(pid, Signal::SIGSTOP);
        }
    }
    let mut abort = mover
        .command(&format!("abort-r{round}"), true)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map(Reaped)
        .unwrap();
    if freeze {
        let thawed = Instant::now() + STOPPED_FOR;
        while Instant::now() < thawed && abort.try_wait().unwrap().is_none() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for pid in movers {
            let _ = kill(pid, Signal::SIGCONT);
        }
    }
    let status = ended(&mut abort, mover.scenario);
    let mut said = String::new();
    for out in [
        abort
            .stdout
            .take()
            .map(|out| Box::new(out) as Box<dyn std::io::Read>),
        abort
            .stderr
            .take()
            .map(|out| Box::new(out) as Box<dyn std::io::Read>),
    ]
    .into_iter()
    .flatten()
    {
        let mut out = out;
        let _ = out.read_to_string(&mut said);
    }
    for (which, child) in [("first", &mut first), ("second", &mut second)] {
        let status = ended(child, mover.scenario);
        assert!(
            status.success(),
            "the {which} mover of a contested move: {status}\n{}",
            mover.scenario.log_tails()
        );
    }
    let (_, record) = mover.record().await.unwrap();
    let aborted = record.step == Step::Aborted;
    assert!(aborted || record.step == Step::Done, "{record:?}");
    assert_eq!(
        status.success(),
        aborted,
        "the abort's exit against the move's end ({record:?}): {said}"
    );
    figures.contested.push(format!(
        "abort at {target}{}: {}",
        if freeze { ", the movers stopped" } else { "" },
        if aborted { "aborted" } else { "too late" }
    ));
    !aborted
}

async fn rows(db: &DatabaseConnection, sql: &str) -> Vec<sea_orm::QueryResult> {
    db.query_all_raw(Statement::from_string(DbBackend::Postgres, sql))
        .await
        .unwrap()
}
