//! The whole chain as processes under kill -9: orders written with their
//! OrderPlaced and OrderCancelled into `orders_outbox`, two `inventory relay --source orders`
//! publishing them, two `inventory serve --strategy natural` (each with its relay in-process),
//! one `inventory relay` for Inventory's outbox, and one `inventory serve --strategy email`
//! mailing each StockReserved. Every one of those processes is SIGKILLed and restarted at
//! random moments while 5,000 orders flow, some over books that run out (rejected) and a few
//! hundred cancelled. After: one mail per reserved order and none for anything else, each
//! event stored once and each order's events in commit order on both streams, both outboxes
//! empty, nothing dead-lettered, both consumers settled.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use inventory_benches::orders::{Cancellation, OrdersRepository, Placement};
use inventory_benches::workload::SplitMix64;
use inventory_domain::{BookId, OrderId, Quantity};
use inventory_infra::jetstream::{self, Topology};
use inventory_tests::outbox::{self, Stored};
use inventory_tests::workload::{self, StreamState};
use inventory_tests::{Backend, TestDb};
use sea_orm::{ConnectionTrait, DbBackend, Statement};
use uuid::Uuid;

use crate::support::{Instance, Scenario, seed, serve_fault_args, wait_until_empty};

const ORDERS: usize = 5_000;
const CANCELLED: usize = 400;
/// Orders are written `CHUNK` at a time with a pause between, so the writing lasts about a
/// minute and the kills land while messages flow at every hop.
const CHUNK: usize = 125;
const PAUSE: Duration = Duration::from_millis(700);
/// Books that run out: 15% of the orders ask for 1 to 3 copies of one of them.
const SCARCE_BOOKS: usize = 4;
const SCARCE_STOCK: i64 = 250;
/// Rounds of kills: each round kills every process once, in a random order.
const MIN_ROUNDS: usize = 4;
const SETTLE: Duration = Duration::from_secs(120);

/// One order of the plan: placed in chunk `chunk`, cancelled after chunk `cancel_after` if set.
#[derive(Debug, Clone, Copy)]
struct Planned {
    order: OrderId,
    book: BookId,
    quantity: i64,
    chunk: usize,
    cancel_after: Option<usize>,
}

/// The seeded plan: which book and quantity each order asks for, which orders are cancelled
/// and when (half right after their chunk is written, racing their placement down the chain;
/// half up to five chunks later, usually after the decision).
fn plan(random: &mut SplitMix64, plenty: BookId, scarce: &[BookId]) -> Vec<Planned> {
    let chunks = ORDERS.div_ceil(CHUNK);
    let mut orders: Vec<Planned> = (0..ORDERS)
        .map(|i| {
            let book = if random.below(100) < 15 {
                scarce[usize::try_from(random.below(scarce.len() as u64)).unwrap()]
            } else {
                plenty
            };
            Planned {
                order: OrderId::from(random.uuid()),
                book,
                quantity: 1 + i64::try_from(random.below(3)).unwrap(),
                chunk: i / CHUNK,
                cancel_after: None,
            }
        })
        .collect();
    let mut indices: Vec<usize> = (0..ORDERS).collect();
    random.shuffle(&mut indices);
    for &i in &indices[..CANCELLED] {
        let later = if random.below(2) == 0 {
            0
        } else {
            1 + usize::try_from(random.below(5)).unwrap()
        };
        orders[i].cancel_after = Some((orders[i].chunk + later).min(chunks - 1));
    }
    orders
}

/// Writes the plan as `inventory orders place` / `cancel` do, chunk by chunk.
async fn produce(orders: OrdersRepository, planned: Vec<Planned>) {
    let chunks = ORDERS.div_ceil(CHUNK);
    for chunk in 0..chunks {
        futures::stream::iter(planned.iter().filter(|p| p.chunk == chunk))
            .for_each_concurrent(8, |p| {
                let orders = orders.clone();
                async move {
                    let placed = orders
                        .place(p.order, p.book, Quantity::new(p.quantity).unwrap())
                        .await
                        .unwrap();
                    assert!(matches!(placed, Placement::Placed { .. }), "{placed:?}");
                }
            })
            .await;
        for p in planned.iter().filter(|p| p.cancel_after == Some(chunk)) {
            let cancelled = orders.cancel(p.order).await.unwrap();
            assert!(
                matches!(cancelled, Cancellation::Cancelled { .. }),
                "{cancelled:?}"
            );
        }
        tokio::time::sleep(PAUSE).await;
    }
}

/// One process of the chain: how to start it again after a kill.
struct Role {
    name: &'static str,
    args: Vec<String>,
    consumer: String,
    instance: Instance,
    kills: usize,
}

impl Role {
    fn new(scenario: &Scenario, name: &'static str, args: Vec<String>, consumer: &str) -> Self {
        let instance = scenario.start(&format!("{name}.0"), &args, consumer);
        Self {
            name,
            args,
            consumer: consumer.to_owned(),
            instance,
            kills: 0,
        }
    }

    fn restart(&mut self, scenario: &Scenario) {
        let label = format!("{}.{}", self.name, self.kills);
        self.instance = scenario.start(&label, &self.args, &self.consumer);
    }
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|&arg| arg.to_owned()).collect()
}

/// The mailbox's lines: (book, quantity) per order.
fn mails(path: &std::path::Path) -> HashMap<Uuid, Vec<(Uuid, i64)>> {
    let mut mails: HashMap<Uuid, Vec<(Uuid, i64)>> = HashMap::new();
    let text = std::fs::read_to_string(path).unwrap_or_default();
    for line in text.lines() {
        let mail: serde_json::Value = serde_json::from_str(line).unwrap();
        let order: Uuid = mail["order_id"].as_str().unwrap().parse().unwrap();
        let book: Uuid = mail["book_id"].as_str().unwrap().parse().unwrap();
        let quantity = mail["quantity"].as_i64().unwrap();
        mails.entry(order).or_default().push((book, quantity));
    }
    mails
}

/// Waits until the notifier has acked every StockReserved of `events` (the whole events
/// stream, read after Inventory's outbox emptied) with nothing pending. Its consumer takes
/// only `<prefix>.stock.reserved`, so its ack floor need not reach the stream's last message.
async fn settle_email(
    js: &async_nats::jetstream::Context,
    topology: &Topology,
    email: &str,
    events: &[Stored],
) -> StreamState {
    let topology = Topology {
        stream: topology.events_stream.clone(),
        ..topology.clone()
    };
    let reserved = format!("{}.stock.reserved", topology.events_subject_prefix);
    let last_reserved = events
        .iter()
        .filter(|m| m.subject == reserved)
        .map(|m| m.stream_sequence)
        .max()
        .unwrap_or(0);
    let last = events.last().map_or(0, |m| m.stream_sequence);
    let deadline = Instant::now() + SETTLE;
    let mut seen = None;
    loop {
        if let Some(state) = workload::stream_state(js, &topology, email).await {
            assert_eq!(
                state.stream_last_seq, last,
                "events after the outbox emptied"
            );
            if state.pending == 0 && state.ack_pending == 0 && state.ack_floor >= last_reserved {
                return state;
            }
            seen = Some(state);
        }
        assert!(
            Instant::now() < deadline,
            "the notifier did not settle within {SETTLE:?}; last state: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn query(db: &TestDb, sql: &str, values: Vec<sea_orm::Value>) -> Vec<sea_orm::QueryResult> {
    db.conn
        .query_all_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            sql,
            values,
        ))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: run by scripts/test.sh"]
async fn kill_9_across_the_chain_mails_each_reserved_order_once() {
    let seed = seed("chain");
    let mut random = SplitMix64::new(seed);
    let db = TestDb::labelled(Backend::Postgres, "chain").await;
    let plenty = db.dune(1_000_000).await;
    let mut scarce = Vec::new();
    for _ in 0..SCARCE_BOOKS {
        scarce.push(db.dune(SCARCE_STOCK).await);
    }
    let planned = plan(&mut random, plenty, &scarce);
    let nats = inventory_tests::nats::shared_url().await;
    let scenario = Scenario::new("chain", &db.url, &nats, 1);
    let (_client, js) = scenario.connect().await;
    jetstream::ensure_prefix_stream(&js, &scenario.topology.events_stream())
        .await
        .unwrap();
    let natural = scenario.names.consumer.clone();
    let email = format!(
        "notifications-stock-reserved-email-{}",
        scenario.names.suffix
    );
    let mailbox = scenario.mailbox("email");

    // A short lease: a killed relay's partitions pass to another within 2 s.
    let relay_args = strings(&[
        "--relay-lease",
        "2s",
        "--relay-publish-timeout",
        "1s",
        "--relay-max-retry-delay",
        "1s",
    ]);
    let orders_relay = [
        strings(&["relay", "--source", "orders"]),
        relay_args.clone(),
    ]
    .concat();
    let inventory_relay = [
        strings(&["relay", "--source", "inventory"]),
        relay_args.clone(),
    ]
    .concat();
    let natural_serve = [
        strings(&["serve", "--strategy", "natural", "--consumer", &natural]),
        serve_fault_args(),
        relay_args,
    ]
    .concat();
    let email_serve = [
        strings(&["serve", "--strategy", "email", "--consumer", &email]),
        strings(&["--mailbox", mailbox.to_str().unwrap()]),
        serve_fault_args(),
    ]
    .concat();
    let mut roles = vec![
        Role::new(&scenario, "orders-relay-a", orders_relay.clone(), ""),
        Role::new(&scenario, "orders-relay-b", orders_relay, ""),
        Role::new(&scenario, "natural-a", natural_serve.clone(), &natural),
        Role::new(&scenario, "natural-b", natural_serve, &natural),
        Role::new(&scenario, "inventory-relay", inventory_relay, ""),
        Role::new(&scenario, "email", email_serve, &email),
    ];

    let started = Instant::now();
    let producer = tokio::spawn(produce(
        OrdersRepository::new(db.conn.clone()),
        planned.clone(),
    ));
    let mut rounds = 0;
    let mut busy = 0;
    while !producer.is_finished() || rounds < MIN_ROUNDS {
        let mut order: Vec<usize> = (0..roles.len()).collect();
        random.shuffle(&mut order);
        for victim in order {
            tokio::time::sleep(Duration::from_millis(300 + random.below(700))).await;
            let role = &mut roles[victim];
            // A consumer's own gauge, read just before the kill: evidence that kills land on
            // work, not on idle processes.
            if !role.consumer.is_empty() && role.instance.in_flight().unwrap_or(0.0) > 0.0 {
                busy += 1;
            }
            role.instance.kill9();
            role.kills += 1;
            // Down for a moment, so its peer (or nobody) carries on without it.
            tokio::time::sleep(Duration::from_millis(random.below(400))).await;
            role.restart(&scenario);
        }
        rounds += 1;
        assert!(rounds < 100, "the producer never finished");
    }
    producer.await.unwrap();
    let produced = started.elapsed();

    let cancelled = planned.iter().filter(|p| p.cancel_after.is_some()).count();
    let order_messages = (ORDERS + cancelled) as u64;
    // Hop by hop: everything out of the orders outbox; every order message decided and acked;
    // every decision out of Inventory's outbox; every event handled by the notifier.
    wait_until_empty(&db.conn, "orders_outbox", &scenario, SETTLE).await;
    let natural_state =
        workload::settle(&js, &scenario.topology, &natural, order_messages, SETTLE).await;
    wait_until_empty(&db.conn, "outbox", &scenario, SETTLE).await;
    let events = outbox::stored(&js, &scenario.topology.events_stream).await;
    let email_state = settle_email(&js, &scenario.topology, &email, &events).await;
    let elapsed = started.elapsed();
    for role in &mut roles {
        assert!(
            role.instance.is_running(),
            "{} exited\n{}",
            role.name,
            scenario.log_tails()
        );
    }
    let kills: Vec<String> = roles
        .iter()
        .map(|role| format!("{} {}", role.name, role.kills))
        .collect();
    let total_kills: usize = roles.iter().map(|role| role.kills).sum();
    for role in roles {
        let status = role.instance.terminate();
        assert!(
            status.success(),
            "{}: {status}\n{}",
            role.name,
            scenario.log_tails()
        );
    }

    let check = Check {
        db: &db,
        scenario: &scenario,
        planned: &planned,
        orders_stream: outbox::stored(&js, &scenario.topology.stream).await,
        events_stream: events,
        mails: mails(&mailbox),
        email: &email,
    };
    let counts = check.run(natural_state, email_state).await;
    eprintln!(
        "[chain] {ORDERS} orders ({cancelled} cancelled): {counts}; {total_kills} SIGKILLs \
         ({}; {busy} on a consumer with messages in its handlers); written in \
         {produced:.1?}, settled in {elapsed:.1?}",
        kills.join(", ")
    );
    for stream in [
        &scenario.topology.stream,
        &scenario.topology.events_stream,
        &scenario.topology.dlq_stream,
    ] {
        let _ = js.delete_stream(stream).await;
    }
}

/// What the chain left behind, against the plan.
struct Check<'a> {
    db: &'a TestDb,
    scenario: &'a Scenario,
    planned: &'a [Planned],
    orders_stream: Vec<Stored>,
    events_stream: Vec<Stored>,
    mails: HashMap<Uuid, Vec<(Uuid, i64)>>,
    email: &'a str,
}

impl Check<'_> {
    /// Asserts the chain's promises; the counts for the summary.
    async fn run(&self, natural: StreamState, email: StreamState) -> String {
        let topology = &self.scenario.topology;
        assert!(natural.settled(), "natural consumer: {natural:?}");
        assert_eq!(
            (email.pending, email.ack_pending),
            (0, 0),
            "email: {email:?}"
        );
        assert_eq!(natural.dead_letters, 0, "dead letters: {natural:?}");
        for table in ["orders_outbox", "outbox"] {
            assert_eq!(outbox::rows(&self.db.conn, table).await, [], "{table}");
        }

        // The orders stream: each placement and cancellation once, on its book's subject, the
        // cancellation after.
        let orders = outbox::subjects_by_order(&self.orders_stream, &topology.subject_prefix);
        assert_eq!(
            orders.len(),
            self.planned.len(),
            "orders on the orders stream"
        );
        for p in self.planned {
            let mut expected = vec![format!("placed.{}", p.book)];
            if p.cancel_after.is_some() {
                expected.push(format!("cancelled.{}", p.book));
            }
            assert_eq!(orders[&p.order.as_uuid()], expected, "order {}", p.order);
        }

        // Inventory's decisions, one row per order, and its events in their commit order.
        let rows = query(
            self.db,
            "SELECT order_id, book_id, quantity, status FROM stock_reservations",
            vec![],
        )
        .await;
        let mut decided: HashMap<Uuid, (Uuid, i64, String)> = HashMap::new();
        for row in &rows {
            let order: Uuid = row.try_get("", "order_id").unwrap();
            let book: Uuid = row.try_get("", "book_id").unwrap();
            let quantity: i32 = row.try_get("", "quantity").unwrap();
            let status: String = row.try_get("", "status").unwrap();
            assert!(
                decided
                    .insert(order, (book, i64::from(quantity), status))
                    .is_none(),
                "order {order} decided twice"
            );
        }
        assert_eq!(decided.len(), self.planned.len(), "orders decided");
        let events =
            outbox::subjects_by_order(&self.events_stream, &topology.events_subject_prefix);
        for stored in &self.events_stream {
            let body: serde_json::Value = serde_json::from_slice(&stored.body).unwrap();
            assert_eq!(body["event_id"], stored.message_id.as_str(), "{stored:?}");
        }
        let (mut reserved, mut rejected, mut released, mut released_held) = (0, 0, 0, 0);
        let mut mailed_orders = 0;
        for p in self.planned {
            let order = p.order.as_uuid();
            let (book, quantity, status) = &decided[&order];
            assert_eq!(
                (*book, *quantity),
                (p.book.as_uuid(), p.quantity),
                "{order}"
            );
            let seen: Vec<&str> = events
                .get(&order)
                .map(|subjects| subjects.iter().map(String::as_str).collect())
                .unwrap_or_default();
            match status.as_str() {
                "reserved" => {
                    assert!(p.cancel_after.is_none(), "cancelled order {order} held");
                    assert_eq!(seen, ["stock.reserved"], "order {order}");
                    reserved += 1;
                }
                "rejected" => {
                    assert_eq!(seen, ["stock.rejected"], "order {order}");
                    rejected += 1;
                }
                "released" => {
                    assert!(
                        p.cancel_after.is_some(),
                        "order {order} released uncancelled"
                    );
                    // Reserved then released, or cancelled before its placement was decided.
                    assert!(
                        seen == ["stock.reserved", "stock.released"] || seen.is_empty(),
                        "order {order}: {seen:?}"
                    );
                    released += 1;
                    if !seen.is_empty() {
                        released_held += 1;
                    }
                }
                other => panic!("order {order}: status {other}"),
            }
            // The notifier's promise: a mail for each StockReserved, nothing else.
            let expected_mails: &[(Uuid, i64)] = if seen.first() == Some(&"stock.reserved") {
                mailed_orders += 1;
                &[(p.book.as_uuid(), p.quantity)]
            } else {
                &[]
            };
            assert_eq!(
                self.mails.get(&order).map_or(&[][..], Vec::as_slice),
                expected_mails,
                "mails of order {order} ({status}, events {seen:?})"
            );
        }
        assert_eq!(
            events.len(),
            reserved + rejected + released_held,
            "orders with events"
        );
        let mails: usize = self.mails.values().map(Vec::len).sum();
        assert_eq!(mails, mailed_orders, "mails for orders outside the plan");
        assert!(
            rejected > 0 && released_held > 0,
            "the plan exercised too little"
        );

        // The stock moved by exactly the copies still reserved.
        let stock = query(
            self.db,
            "SELECT s.book_id, s.reserved::int8 AS reserved, coalesce(sum(r.quantity) FILTER \
             (WHERE r.status = 'reserved'), 0)::int8 AS held \
             FROM stock_items s LEFT JOIN stock_reservations r USING (book_id) \
             GROUP BY s.book_id, s.reserved",
            vec![],
        )
        .await;
        for row in &stock {
            let book: Uuid = row.try_get("", "book_id").unwrap();
            let moved: i64 = row.try_get("", "reserved").unwrap();
            let held: i64 = row.try_get("", "held").unwrap();
            assert_eq!(moved, held, "book {book}");
        }

        // The notifier's records: one per event it was given, each completed.
        let records = query(
            self.db,
            "SELECT count(*) AS records, count(*) FILTER (WHERE completed_at IS NULL) AS open \
             FROM inbox WHERE consumer = $1",
            vec![self.email.into()],
        )
        .await;
        let all: i64 = records[0].try_get("", "records").unwrap();
        let open: i64 = records[0].try_get("", "open").unwrap();
        assert_eq!((all, open), (mailed_orders as i64, 0), "email records");

        format!(
            "{reserved} reserved, {rejected} rejected, {released} released ({released_held} \
             after a reservation, {} before the decision), {mails} mails, {} order messages, \
             {} events",
            released - released_held,
            self.orders_stream.len(),
            self.events_stream.len()
        )
    }
}
