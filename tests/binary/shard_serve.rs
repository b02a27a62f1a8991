//! `inventory serve --shard NAME` as processes, on a nats-server 2.10+ of the test's own (stream
//! subject transforms): two shards, each its own database, each deciding only its partitions'
//! books, the order-level cancellation dead-lettered as `unroutable`; and an instance whose
//! database does not own the partitions it pulls, which decides and dead-letters nothing however
//! often a message comes. With no such server here the tests say so and return.

use std::collections::BTreeSet;
use std::num::NonZeroU32;
use std::process::Child;
use std::time::Duration;

use async_nats::HeaderMap;
use futures::StreamExt as _;
use inventory_domain::shard::partition_of;
use inventory_domain::{BookId, OrderId};
use inventory_infra::jetstream;
use inventory_tests::binary::{self, BinaryRun};
use inventory_tests::broker::eventually;
use inventory_tests::nats::NatsServer;
use inventory_tests::{Backend, TestDb};
use sea_orm::{ConnectionTrait, DbBackend, Statement};

const P: NonZeroU32 = NonZeroU32::new(8).unwrap();

/// The durable consumer `serve` and `shard init` name the partitions' after.
const SERVE_CONSUMER: &str = "inventory-reserve-stock";

async fn sharded(test: &str, log_filter: &'static str) -> Option<(NatsServer, BinaryRun)> {
    BinaryRun::sharded(test, log_filter, P).await
}

/// `inventory <args>` with `DATABASE_URL` set to `url`, to its end; it must succeed.
fn run_on(run: &BinaryRun, url: &str, args: &[&str]) {
    let output = run.command(args).env("DATABASE_URL", url).output().unwrap();
    assert!(output.status.success(), "{args:?}: {output:?}");
}

/// A small pool, and more lanes than a shard of the differential has partitions, so that its
/// lanes serve several partitions at once: each lane holds a connection, and the tests beside
/// these share PostgreSQL's.
const SMALL: [&str; 5] = ["serve", "--concurrency", "4", "--db-pool-size", "2"];

/// `serve` with [`SMALL`]'s lanes and `args`, on the database at `url`.
fn serve_on(run: &BinaryRun, url: &str, args: &[&str]) -> Child {
    run.command(&[&SMALL[..], args].concat())
        .env("DATABASE_URL", url)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// `count` books whose partitions `wanted` takes, with 100 copies each on the database at `url`.
fn books_in(run: &BinaryRun, url: &str, count: usize, wanted: impl Fn(u32) -> bool) -> Vec<BookId> {
    let books: Vec<BookId> = std::iter::repeat_with(BookId::new_v7)
        .filter(|book| wanted(partition_of(*book, P)))
        .take(count)
        .collect();
    for book in &books {
        run_on(
            run,
            url,
            &[
                "stock",
                "put",
                "--book-id",
                &book.to_string(),
                "--title",
                "Dune",
                "--on-hand",
                "100",
            ],
        );
    }
    books
}

/// Publishes a placement of `book` for `order` on the book's subject, under `message_id`.
async fn place(
    js: &jetstream::Context,
    run: &BinaryRun,
    order: OrderId,
    book: BookId,
    message_id: &str,
) {
    let body = format!(
        r#"{{"message_id":"{message_id}","order_id":"{order}","book_id":"{book}","quantity":1}}"#
    );
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", message_id);
    let subject = format!("{}.placed.{book}", run.names.subject_prefix);
    js.publish_with_headers(subject, headers, body.into())
        .await
        .unwrap()
        .await
        .unwrap();
}

/// The books of the reservations on `db`.
async fn reserved_books(db: &TestDb) -> BTreeSet<String> {
    db.conn
        .query_all_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT DISTINCT book_id::text FROM stock_reservations",
        ))
        .await
        .unwrap()
        .iter()
        .map(|row| row.try_get_by_index::<String>(0).unwrap())
        .collect()
}

/// The `Dlq-Reason` of every dead letter stored.
async fn dead_letter_reasons(js: &jetstream::Context, run: &BinaryRun) -> Vec<String> {
    inventory_tests::outbox::stored(js, &run.names.dlq_stream)
        .await
        .into_iter()
        .map(|letter| {
            letter
                .headers
                .get("Dlq-Reason")
                .cloned()
                .unwrap_or_default()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_shard_decides_only_its_partitions_books_and_the_order_level_cancellation_is_unroutable()
 {
    let Some((server, run)) = sharded("each_shard_decides_only_its_partitions_books", "warn").await
    else {
        return;
    };
    let other = TestDb::labelled(Backend::Postgres, "shard_b").await;
    let (a_url, b_url) = (run.database_url.clone(), other.url.clone());
    run_on(
        &run,
        &a_url,
        &["shard", "assign", "--partitions", "0-3", "--to", "a"],
    );
    run_on(
        &run,
        &b_url,
        &["shard", "assign", "--partitions", "4-7", "--to", "b"],
    );
    let a_books = books_in(&run, &a_url, 4, |partition| partition < 4);
    let b_books = books_in(&run, &b_url, 4, |partition| partition >= 4);
    let a = serve_on(&run, &a_url, &["--shard", "a"]);
    let b = serve_on(&run, &b_url, &["--shard", "b"]);

    let js = jetstream::context(async_nats::connect(server.url()).await.unwrap());
    let books: Vec<BookId> = a_books.iter().chain(&b_books).copied().collect();
    let mut orders = 0;
    for round in 0..5 {
        for book in &books {
            let order = OrderId::new_v7();
            place(&js, &run, order, *book, &format!("o-{order}")).await;
            // A resend under a new message id: the natural key refuses it on its shard.
            if round % 2 == 0 {
                place(&js, &run, order, *book, &format!("resent-{order}")).await;
            }
            orders += 1;
        }
    }
    let order_level = format!(
        r#"{{"message_id":"c-1","order_id":"{}"}}"#,
        OrderId::new_v7()
    );
    js.publish(
        format!("{}.cancelled", run.names.subject_prefix),
        order_level.into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();

    let per_shard = orders / 2;
    eventually("every order reserved on its shard", || async {
        run.db
            .scalar("SELECT count(*) FROM stock_reservations")
            .await
            == per_shard
            && other
                .scalar("SELECT count(*) FROM stock_reservations")
                .await
                == per_shard
    })
    .await;
    eventually("the order-level cancellation dead-lettered", || async {
        !dead_letter_reasons(&js, &run).await.is_empty()
    })
    .await;
    let (a_status, a_log) = binary::stop(a);
    let (b_status, b_log) = binary::stop(b);
    assert!(a_status.success(), "{a_log}");
    assert!(b_status.success(), "{b_log}");

    let names = |books: &[BookId]| {
        books
            .iter()
            .map(ToString::to_string)
            .collect::<BTreeSet<_>>()
    };
    assert_eq!(reserved_books(&run.db).await, names(&a_books), "shard a");
    assert_eq!(reserved_books(&other).await, names(&b_books), "shard b");
    for db in [&run.db, &other] {
        assert_eq!(
            db.scalar("SELECT coalesce(sum(reserved), 0)::int8 FROM stock_items")
                .await,
            per_shard,
            "each order once"
        );
    }
    assert_eq!(dead_letter_reasons(&js, &run).await, ["unroutable"]);
}

/// An instance that pulls partitions its database does not own (its view of the assignment
/// lags the database's), with a cap of 3 deliveries, handed placements already delivered 3 times
/// (by the test): past the cap, it decides none and dead-letters none, and stops pulling each
/// partition at its first "not owned" outcome instead of taking its messages again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_whose_database_does_not_own_its_partitions_decides_and_dead_letters_nothing() {
    let Some((server, run)) = sharded("an_instance_whose_database_does_not_own", "info").await
    else {
        return;
    };
    let stale = TestDb::labelled(Backend::Postgres, "stale").await;
    let (owner_url, stale_url) = (run.database_url.clone(), stale.url.clone());
    run_on(
        &run,
        &owner_url,
        &["shard", "assign", "--partitions", "0-7", "--to", "a"],
    );
    run_on(&run, &stale_url, &["migrate"]);
    // Stock rows on the stale database too: what refuses is the ownership, not a missing book.
    let books = books_in(&run, &stale_url, 4, |_| true);
    let js = jetstream::context(async_nats::connect(server.url()).await.unwrap());
    for book in &books {
        let order = OrderId::new_v7();
        place(&js, &run, order, *book, &format!("o-{order}")).await;
    }
    let stream = js.get_stream(&run.names.stream).await.unwrap();
    let consumers: BTreeSet<String> = books
        .iter()
        .map(|book| jetstream::partition_consumer(SERVE_CONSUMER, partition_of(*book, P), P))
        .collect();
    for name in &consumers {
        deliver_and_nak(&stream, name, placements_of(&books, name), 3).await;
    }
    let delivered = || async {
        let mut delivered = 0;
        for name in &consumers {
            delivered += delivery_count(&stream, name).await;
        }
        delivered
    };
    let before = delivered().await;
    assert_eq!(before, 3 * books.len() as u64);

    let instance = serve_on(
        &run,
        &stale_url,
        &[
            "--shard",
            "a",
            "--max-deliver",
            "3",
            "--retry-delay",
            "100ms",
        ],
    );
    eventually(
        "a placement of each partition handed to the instance",
        || async {
            let mut handed = 0;
            for name in &consumers {
                handed += u64::from(
                    delivery_count(&stream, name).await > 3 * placements_of(&books, name),
                );
            }
            handed == consumers.len() as u64
        },
    )
    .await;
    // Given back 100 ms after each delivery: had it pulled on, about 20 deliveries each by now.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let by_the_instance = delivered().await - before;
    eprintln!(
        "[not owned, past the cap] {by_the_instance} deliveries of {} placements in 3 s",
        books.len()
    );
    let (status, log) = binary::stop(instance);
    assert!(status.success(), "{log}");
    assert_eq!(
        stale
            .scalar("SELECT count(*) FROM stock_reservations")
            .await,
        0,
        "{log}"
    );
    assert_eq!(stale.scalar("SELECT count(*) FROM outbox").await, 0);
    assert!(dead_letter_reasons(&js, &run).await.is_empty(), "{log}");
    assert!(log.contains("not owned"), "{log}");
    assert!(
        by_the_instance <= 2 * books.len() as u64,
        "{by_the_instance} deliveries of {} placements: it pulled on\n{log}",
        books.len()
    );
}

/// How many of `books`' placements (one each) the partition consumer `name` takes.
fn placements_of(books: &[BookId], name: &str) -> u64 {
    books
        .iter()
        .filter(|book| {
            jetstream::partition_consumer(SERVE_CONSUMER, partition_of(**book, P), P) == name
        })
        .count() as u64
}

/// Deliveries the durable consumer `name` made so far, redeliveries included.
async fn delivery_count(stream: &async_nats::jetstream::stream::Stream, name: &str) -> u64 {
    stream
        .consumer_info(name)
        .await
        .unwrap()
        .delivered
        .consumer_sequence
}

/// Has the durable consumer `name` deliver each of its `count` messages exactly `times` times,
/// nak'ing each below `times` at once (as instances that could not decide them would) and the
/// rest at the end. The server handles a nak and the next pull request on separate queues, so a
/// pull can find a nak'ed message not yet back: rounds of one pull each would miss deliveries.
/// Holding a message that reached `times` until the end is what keeps it from a further one.
async fn deliver_and_nak(
    stream: &async_nats::jetstream::stream::Stream,
    name: &str,
    count: u64,
    times: i64,
) {
    use async_nats::jetstream::AckKind;
    let consumer: async_nats::jetstream::consumer::PullConsumer =
        stream.get_consumer(name).await.unwrap();
    let mut held = Vec::new();
    let deliveries = async {
        while (held.len() as u64) < count {
            let mut batch = consumer
                .fetch()
                .max_messages(100)
                .expires(Duration::from_secs(1))
                .messages()
                .await
                .unwrap();
            while let Some(message) = batch.next().await {
                let message = message.unwrap();
                if message.info().unwrap().delivered < times {
                    message.ack_with(AckKind::Nak(None)).await.unwrap();
                } else {
                    held.push(message);
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), deliveries)
        .await
        .unwrap_or_else(|_| panic!("{name}: {count} messages not delivered {times} times"));
    for message in held {
        message.ack_with(AckKind::Nak(None)).await.unwrap();
    }
}

/// An instance serving two partitions, one of them fenced in its database (as a move fences it):
/// it stops pulling the fenced one at its first "not owned" outcome, while the other's
/// placements are reserved on the same lanes; the fenced one's placements are delivered about
/// once each and nothing of them decided or dead-lettered. Once the owner row is active again
/// (the move aborted), it pulls the partition again and reserves each held placement once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_stops_pulling_a_partition_found_not_owned_and_pulls_it_again_once_owned() {
    let Some((server, run)) = sharded("an_instance_stops_pulling", "info").await else {
        return;
    };
    let url = run.database_url.clone();
    run_on(
        &run,
        &url,
        &["shard", "assign", "--partitions", "0-1", "--to", "a"],
    );
    let fenced_books = books_in(&run, &url, 2, |partition| partition == 0);
    let served_books = books_in(&run, &url, 2, |partition| partition == 1);
    let set_owner = |state: &'static str| {
        let db = &run.db;
        async move {
            db.conn
                .execute_unprepared(&format!(
                    "UPDATE partition_owner SET state = '{state}' WHERE partition_id = 0"
                ))
                .await
                .unwrap();
        }
    };
    set_owner("fenced").await;
    // A short retry delay: pulling on, it would take each fenced placement every 100 ms.
    let instance = serve_on(&run, &url, &["--shard", "a", "--retry-delay", "100ms"]);
    let js = jetstream::context(async_nats::connect(server.url()).await.unwrap());
    let stream = js.get_stream(&run.names.stream).await.unwrap();
    let fenced_consumer = jetstream::partition_consumer(SERVE_CONSUMER, 0, P);
    let rounds = 3;
    for _ in 0..rounds {
        for book in fenced_books.iter().chain(&served_books) {
            let order = OrderId::new_v7();
            place(&js, &run, order, *book, &format!("o-{order}")).await;
        }
    }
    let held = (rounds * fenced_books.len()) as i64;
    let served = (rounds * served_books.len()) as i64;
    let reservations_of = |books: &[BookId]| {
        let list = books
            .iter()
            .map(|book| format!("'{book}'"))
            .collect::<Vec<_>>()
            .join(", ");
        format!("SELECT count(*) FROM stock_reservations WHERE book_id::text IN ({list})")
    };
    let (fenced_sql, served_sql) = (
        reservations_of(&fenced_books),
        reservations_of(&served_books),
    );
    eventually("the other partition's placements reserved", || async {
        run.db.scalar(&served_sql).await == served
    })
    .await;
    eventually("a fenced placement handed to the instance", || async {
        delivery_count(&stream, &fenced_consumer).await > 0
    })
    .await;
    // Had it pulled on, each fenced placement would have come some 20 times by now.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let while_fenced = delivery_count(&stream, &fenced_consumer).await;
    eprintln!("[not owned] {while_fenced} deliveries of {held} fenced placements in 3 s");
    assert_eq!(run.db.scalar(&fenced_sql).await, 0, "decided while fenced");
    assert!(
        while_fenced <= 2 * held as u64,
        "{while_fenced} deliveries of {held} fenced placements: it pulled on"
    );

    set_owner("active").await;
    eventually(
        "the held placements reserved once the partition is owned again",
        || async { run.db.scalar(&fenced_sql).await == held },
    )
    .await;
    // Settled, and nothing more comes of them.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (status, log) = binary::stop(instance);
    assert!(status.success(), "{log}");
    assert_eq!(run.db.scalar(&fenced_sql).await, held, "each once\n{log}");
    assert_eq!(
        run.db
            .scalar("SELECT coalesce(sum(reserved), 0)::int8 FROM stock_items")
            .await,
        held + served,
        "each order once"
    );
    assert!(dead_letter_reasons(&js, &run).await.is_empty(), "{log}");
    let lines = |text: &str| log.lines().filter(|line| line.contains(text)).count();
    assert_eq!(lines("stopped pulling it"), 1, "{log}");
    assert_eq!(lines("owned here again: pulling it"), 1, "{log}");
}

/// An instance serving many partitions holds its `--concurrency` lanes, and a connection each,
/// however many partitions it has; each partition's message is served all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_holds_its_lanes_connections_whatever_its_partitions() {
    const MANY: NonZeroU32 = NonZeroU32::new(32).unwrap();
    let Some((server, run)) = BinaryRun::sharded("an_instance_holds_its_lanes", "warn", MANY).await
    else {
        return;
    };
    let url = run.database_url.clone();
    run_on(
        &run,
        &url,
        &["shard", "assign", "--partitions", "0-31", "--to", "a"],
    );
    // A book of each partition.
    let mut books: Vec<BookId> = Vec::new();
    for book in std::iter::repeat_with(BookId::new_v7) {
        if books.len() == 32 {
            break;
        }
        if books
            .iter()
            .all(|had| partition_of(*had, MANY) != partition_of(book, MANY))
        {
            books.push(book);
        }
    }
    for book in &books {
        run.put_stock(&book.to_string(), "Dune", 100);
    }
    let app = format!("lanes-{}", std::process::id());
    let instance = run
        .command(&[
            "serve",
            "--shard",
            "a",
            "--concurrency",
            "3",
            "--db-pool-size",
            "2",
        ])
        .env("PGAPPNAME", &app)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let js = jetstream::context(async_nats::connect(server.url()).await.unwrap());
    for book in &books {
        let order = OrderId::new_v7();
        place(&js, &run, order, *book, &format!("o-{order}")).await;
    }
    eventually("a placement reserved on every partition", || async {
        run.db
            .scalar("SELECT count(*) FROM stock_reservations")
            .await
            == 32
    })
    .await;
    let connections = run
        .db
        .scalar(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = '{app}'"
        ))
        .await;
    let (status, log) = binary::stop(instance);
    assert!(status.success(), "{log}");
    eprintln!("[shared lanes] 32 partitions, 3 lanes, a pool of 2: {connections} connections");
    // The 3 lanes' own, and the pool's 2 (no readiness check was asked for).
    assert!(
        connections <= 3 + 2,
        "{connections} connections for 3 lanes and a pool of 2"
    );
}

/// One message of the differential workload: its subject below the prefix, its body, and its
/// `Nats-Msg-Id` (none: the stream keeps a copy, as it keeps a redelivery's duplicate).
#[derive(Clone)]
struct Send {
    subject: String,
    body: String,
    msg_id: Option<String>,
}

/// The workload of both runs, in two phases (the second published once the first settled, so
/// that a cancellation after its placement, and a conflicting resend, come after what they
/// follow in either run): orders of one to three lines over `books`, each line placed, some
/// delivered twice (an exact copy), some resent under a new message id, some cancelled before
/// their placement and some after, some resent with another quantity; and one order-level
/// cancellation, which a sharded stream cannot route.
fn differential_workload(books: &[BookId]) -> (Vec<Send>, Vec<Send>) {
    let placement = |order: OrderId, book: BookId, quantity: u32, id: &str| Send {
        subject: format!("placed.{book}"),
        body: format!(
            r#"{{"message_id":"{id}","order_id":"{order}","book_id":"{book}","quantity":{quantity}}}"#
        ),
        msg_id: Some(id.to_owned()),
    };
    let line_cancellation = |order: OrderId, book: BookId, id: &str| Send {
        subject: format!("cancelled.{book}"),
        body: format!(r#"{{"message_id":"{id}","order_id":"{order}","book_id":"{book}"}}"#),
        msg_id: Some(id.to_owned()),
    };
    let (mut first, mut second) = (Vec::new(), Vec::new());
    let mut line = 0_usize;
    for n in 0..120_usize {
        let order = OrderId::new_v7();
        for k in 0..=(n % 3) {
            let book = books[(n * 5 + k * 7) % books.len()];
            let quantity = 1 + u32::try_from(line % 3).unwrap();
            let original = placement(order, book, quantity, &format!("p-{order}-{book}"));
            if line.is_multiple_of(9) {
                first.push(line_cancellation(
                    order,
                    book,
                    &format!("cb-{order}-{book}"),
                ));
            }
            first.push(original.clone());
            if line.is_multiple_of(5) {
                first.push(Send {
                    msg_id: None,
                    ..original.clone()
                });
            }
            if line.is_multiple_of(7) {
                first.push(placement(
                    order,
                    book,
                    quantity,
                    &format!("r-{order}-{book}"),
                ));
            }
            if line.is_multiple_of(6) {
                second.push(line_cancellation(
                    order,
                    book,
                    &format!("ca-{order}-{book}"),
                ));
            }
            if line.is_multiple_of(13) {
                second.push(placement(
                    order,
                    book,
                    quantity + 1,
                    &format!("x-{order}-{book}"),
                ));
            }
            line += 1;
        }
    }
    first.push(Send {
        subject: "cancelled".to_owned(),
        body: format!(
            r#"{{"message_id":"oc-1","order_id":"{}"}}"#,
            OrderId::new_v7()
        ),
        msg_id: Some("oc-1".to_owned()),
    });
    (first, second)
}

async fn publish_all(js: &jetstream::Context, run: &BinaryRun, sends: &[Send]) {
    for send in sends {
        let subject = format!("{}.{}", run.names.subject_prefix, send.subject);
        let mut headers = HeaderMap::new();
        if let Some(id) = &send.msg_id {
            headers.insert("Nats-Msg-Id", id.as_str());
        }
        js.publish_with_headers(subject, headers, send.body.clone().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
}

/// Waits until none of `consumers` has a message to deliver or one unacked, twice in a row.
async fn settle(js: &jetstream::Context, run: &BinaryRun, consumers: &[String]) {
    let stream = js.get_stream(&run.names.stream).await.unwrap();
    let mut quiet = 0;
    for _ in 0..240 {
        let mut busy = false;
        for name in consumers {
            let info = stream.consumer_info(name).await.unwrap();
            busy |= info.num_pending > 0 || info.num_ack_pending > 0;
        }
        quiet = if busy { 0 } else { quiet + 1 };
        if quiet == 2 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!("the consumers never settled");
}

/// What a run decided, over all its databases: every reservation, every line's cancellation,
/// each book's reserved count, and the dead letters' reasons.
#[derive(Debug, PartialEq, Eq)]
struct Decided {
    reservations: BTreeSet<String>,
    lines_cancelled: BTreeSet<String>,
    reserved: BTreeSet<String>,
    dead_letters: Vec<String>,
}

async fn rows(db: &TestDb, sql: &str) -> BTreeSet<String> {
    db.conn
        .query_all_raw(Statement::from_string(DbBackend::Postgres, sql))
        .await
        .unwrap()
        .iter()
        .map(|row| row.try_get_by_index::<String>(0).unwrap())
        .collect()
}

async fn decided(js: &jetstream::Context, run: &BinaryRun, dbs: &[&TestDb]) -> Decided {
    let mut decided = Decided {
        reservations: BTreeSet::new(),
        lines_cancelled: BTreeSet::new(),
        reserved: BTreeSet::new(),
        dead_letters: dead_letter_reasons(js, run).await,
    };
    for db in dbs {
        decided.reservations.extend(
            rows(
                db,
                "SELECT order_id || ' ' || book_id || ' ' || quantity || ' ' || status \
                 FROM stock_reservations",
            )
            .await,
        );
        decided.lines_cancelled.extend(
            rows(
                db,
                "SELECT order_id || ' ' || book_id FROM line_cancellations",
            )
            .await,
        );
        decided
            .reserved
            .extend(rows(db, "SELECT book_id || ' ' || reserved FROM stock_items").await);
    }
    decided.dead_letters.sort();
    decided
}

/// The sharded differential: the same workload through one database and through three shards
/// (K = 3, P = 8) decides the same, each book's rows on its own shard only; the order-level
/// cancellation, which the one database takes, is the shards' one `unroutable` dead letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_shards_decide_what_one_database_decides() {
    let Some((server, sharded)) =
        BinaryRun::sharded("three_shards_decide_what_one_database_decides", "warn", P).await
    else {
        return;
    };
    let js = jetstream::context(async_nats::connect(server.url()).await.unwrap());
    let shard_dbs = [
        TestDb::labelled(Backend::Postgres, "shard_2").await,
        TestDb::labelled(Backend::Postgres, "shard_3").await,
    ];
    let urls = [
        sharded.database_url.clone(),
        shard_dbs[0].url.clone(),
        shard_dbs[1].url.clone(),
    ];
    let ranges = [("s1", 0..3), ("s2", 3..6), ("s3", 6..8)];
    let mut books = Vec::new();
    let mut books_of = Vec::new();
    for ((name, range), url) in ranges.iter().zip(&urls) {
        let partitions = format!("{}-{}", range.start, range.end - 1);
        run_on(
            &sharded,
            url,
            &["shard", "assign", "--partitions", &partitions, "--to", name],
        );
        let mine = books_in(&sharded, url, 4, |partition| range.contains(&partition));
        books.extend(mine.iter().copied());
        books_of.push(mine);
    }
    let (first, second) = differential_workload(&books);

    // One database, unsharded, on a stream of its own on the same server.
    let mut single = BinaryRun::new("unsharded", "warn").await;
    single.nats_url = server.url();
    for book in &books {
        single.put_stock(&book.to_string(), "Dune", 100);
    }
    let one = single.spawn(&SMALL);
    let serving: Vec<Child> = ranges
        .iter()
        .zip(&urls)
        .map(|((name, _), url)| serve_on(&sharded, url, &["--shard", name]))
        .collect();
    let mut shard_consumers: Vec<String> = (0..P.get())
        .map(|p| jetstream::partition_consumer(SERVE_CONSUMER, p, P))
        .collect();
    shard_consumers.push(jetstream::unroutable_consumer(SERVE_CONSUMER));
    let single_consumers = [SERVE_CONSUMER.to_owned()];
    eventually("the unsharded serve's consumer set up", || async {
        match js.get_stream(&single.names.stream).await {
            Ok(stream) => stream.consumer_info(SERVE_CONSUMER).await.is_ok(),
            Err(_) => false,
        }
    })
    .await;
    for phase in [&first, &second] {
        publish_all(&js, &single, phase).await;
        publish_all(&js, &sharded, phase).await;
        settle(&js, &single, &single_consumers).await;
        settle(&js, &sharded, &shard_consumers).await;
    }
    let (status, log) = binary::stop(one);
    assert!(status.success(), "{log}");
    for instance in serving {
        let (status, log) = binary::stop(instance);
        assert!(status.success(), "{log}");
    }

    let once = decided(&js, &single, &[&single.db]).await;
    let mut shards = decided(&js, &sharded, &[&sharded.db, &shard_dbs[0], &shard_dbs[1]]).await;
    let unroutable = shards
        .dead_letters
        .iter()
        .position(|reason| reason == "unroutable");
    shards
        .dead_letters
        .remove(unroutable.expect("the order-level cancellation, unroutable"));
    assert_eq!(
        shards, once,
        "three shards decided otherwise than one database"
    );
    assert!(
        once.dead_letters
            .iter()
            .all(|reason| reason == "conflicting-reservation"),
        "{:?}",
        once.dead_letters
    );
    let released = once
        .reservations
        .iter()
        .filter(|row| row.ends_with(" released"))
        .count();
    assert_eq!(
        released,
        once.lines_cancelled.len(),
        "one release per cancelled line"
    );
    eprintln!(
        "[shard differential] {} messages; on one database and on three shards alike: {} \
         reservations, {released} released, {} lines cancelled, dead letters {:?}",
        first.len() + second.len(),
        once.reservations.len(),
        once.lines_cancelled.len(),
        once.dead_letters
    );
    for (db, mine) in [&sharded.db, &shard_dbs[0], &shard_dbs[1]]
        .into_iter()
        .zip(&books_of)
    {
        let theirs: BTreeSet<String> = mine.iter().map(ToString::to_string).collect();
        assert!(
            reserved_books(db).await.is_subset(&theirs),
            "a row outside its shard"
        );
    }
}

/// An instance whose shard's partitions change stops (exit 1) for its supervisor to start it
/// again on the new assignment, and says why in its error line, not only in the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_whose_shards_partitions_change_exits_1_saying_so() {
    let Some((_server, run)) = sharded("an_instance_whose_partitions_change", "info").await else {
        return;
    };
    let url = run.database_url.clone();
    run_on(
        &run,
        &url,
        &["shard", "assign", "--partitions", "0-3", "--to", "a"],
    );
    // Its log in a file, read while it runs: the assignment changes once it serves.
    let log_path = std::env::temp_dir().join(format!(
        "inventory-reassigned-{}.log",
        uuid::Uuid::new_v4().simple()
    ));
    let instance = run
        .command(&[&SMALL[..], &["--shard", "a"]].concat())
        .env("DATABASE_URL", &url)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    eventually("the instance serving its shard", || async {
        log().contains("serving a shard")
    })
    .await;
    run_on(
        &run,
        &url,
        &["shard", "assign", "--partitions", "4", "--to", "a"],
    );
    let (status, _) = binary::ended(instance);
    let log = log();
    let _ = std::fs::remove_file(&log_path);
    assert_eq!(status.code(), Some(1), "{log}");
    // The process's error line, after the log's.
    assert!(
        log.lines().any(|line| line
            == "error: shard-watcher failed: the partitions of shard a changed from [0, 1, 2, 3] \
                to [0, 1, 2, 3, 4]: restart to serve them"),
        "{log}"
    );
}

/// An instance whose watch of the assignment breaks (no heartbeat for twice its interval: the
/// server stalled, or the instance's own host) opens it again and serves on: a broken watch is
/// no reason to restart the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_whose_watch_of_the_assignment_breaks_watches_again_and_serves_on() {
    let Some((server, run)) = sharded("an_instance_whose_watch_breaks", "info").await else {
        return;
    };
    let url = run.database_url.clone();
    run_on(
        &run,
        &url,
        &["shard", "assign", "--partitions", "0-7", "--to", "a"],
    );
    let book = books_in(&run, &url, 1, |_| true)[0];
    // Its log in a file, read while it runs.
    let log_path = std::env::temp_dir().join(format!(
        "inventory-watch-{}.log",
        uuid::Uuid::new_v4().simple()
    ));
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let mut instance = run
        .command(&[&SMALL[..], &["--shard", "a"]].concat())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    let js = jetstream::context(async_nats::connect(server.url()).await.unwrap());
    let reservations = || async {
        run.db
            .scalar("SELECT count(*) FROM stock_reservations")
            .await
    };
    place(&js, &run, OrderId::new_v7(), book, "before").await;
    eventually("the first order reserved", || async {
        reservations().await == 1
    })
    .await;

    // The server silent for longer than twice the watch's idle heartbeat (5 s): its client
    // gives the watch up.
    server.pause(Duration::from_secs(15)).await;
    place(&js, &run, OrderId::new_v7(), book, "after").await;
    eventually("the order after reserved", || async {
        reservations().await == 2
    })
    .await;
    assert!(
        instance.try_wait().unwrap().is_none(),
        "the instance stopped: {}",
        log()
    );
    // Else this test saw nothing of a broken watch.
    assert!(log().contains("watching it again"), "{}", log());
    let (status, _) = binary::stop(instance);
    assert!(status.success(), "{}", log());
    let _ = std::fs::remove_file(&log_path);
}
