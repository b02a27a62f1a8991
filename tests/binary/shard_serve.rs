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

fn serve_on(run: &BinaryRun, url: &str, args: &[&str]) -> Child {
    run.command(&[&["serve"], args].concat())
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

async fn count(db: &TestDb, sql: &str) -> i64 {
    db.conn
        .query_one_raw(Statement::from_string(DbBackend::Postgres, sql))
        .await
        .unwrap()
        .unwrap()
        .try_get_by_index(0)
        .unwrap()
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
    let Ok(stream) = js.get_stream(&run.names.dlq_stream).await else {
        return Vec::new();
    };
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config::default())
        .await
        .unwrap();
    let mut reasons = Vec::new();
    let mut batch = consumer
        .fetch()
        .max_messages(100)
        .expires(Duration::from_secs(1))
        .messages()
        .await
        .unwrap();
    while let Some(Ok(message)) = batch.next().await {
        let reason = message
            .headers
            .as_ref()
            .and_then(|headers| headers.get("Dlq-Reason"));
        reasons.push(reason.map_or_else(String::new, |reason| reason.to_string()));
    }
    reasons
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
        count(&run.db, "SELECT count(*) FROM stock_reservations").await == per_shard
            && count(&other, "SELECT count(*) FROM stock_reservations").await == per_shard
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
            count(
                db,
                "SELECT coalesce(sum(reserved), 0)::int8 FROM stock_items"
            )
            .await,
            per_shard,
            "each order once"
        );
    }
    assert_eq!(dead_letter_reasons(&js, &run).await, ["unroutable"]);
}

/// An instance that pulls partitions its database does not own (its view of the assignment
/// lags the database's), with a cap of 3 deliveries: every placement comes again and again,
/// past the cap, and it decides none and dead-letters none.
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
    eventually("every placement redelivered", || async {
        let mut redelivered = 0;
        for name in &consumers {
            redelivered += stream.consumer_info(name).await.unwrap().num_redelivered;
        }
        redelivered == books.len()
    })
    .await;
    // Given back 100 ms after each delivery: about 20 deliveries each by now, far past the cap.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (status, log) = binary::stop(instance);
    assert!(status.success(), "{log}");
    assert_eq!(
        count(&stale, "SELECT count(*) FROM stock_reservations").await,
        0,
        "{log}"
    );
    assert_eq!(count(&stale, "SELECT count(*) FROM outbox").await, 0);
    assert!(dead_letter_reasons(&js, &run).await.is_empty(), "{log}");
    assert!(log.contains("not owned"), "{log}");
}
