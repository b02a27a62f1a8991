//! The outbox relay against real NATS, on PostgreSQL and SQLite: every event reaches the
//! stream once and in its order's order, and leaves the outbox; through crashes on either side
//! of the publish, two relays at once, transactions committing out of seq order, a row that
//! cannot be published, and NATS going away.

use inventory_benches::faults;
use std::time::Duration;

use inventory_benches::consumers::{Handler, HandlerKind, NaturalKeyPath};
use inventory_domain::OrderId;
use inventory_infra::CrashPoint;
use inventory_infra::jetstream;
use inventory_infra::outbox::{OutboxSource, Relay, RelayError, RelaySettings, Retry};
use inventory_service::health::{self, Liveness, Readiness};
use inventory_service::metrics::Metrics;
use inventory_tests::broker::{Broker, RunningService, eventually};
use inventory_tests::nats::NatsServer;
use inventory_tests::outbox::{
    self, Row, assert_each_order_in_order, assert_published_once_in_order, decide, fast_settings,
};
use inventory_tests::{Backend, TestDb, crash_at, placed, placed_for};
use sea_orm::{ConnectionTrait, Statement, TransactionTrait};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::health::healthz;

const TABLE: &str = "outbox";

async fn relay(db: &TestDb, broker: &Broker, settings: RelaySettings) -> Relay {
    Relay::prepare(
        &broker.js,
        db.conn.clone(),
        OutboxSource::inventory(&broker.topology),
        &broker.topology.events_stream(),
        settings,
    )
    .await
    .unwrap()
    .0
}

fn orm(db: &TestDb) -> Handler {
    db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm))
}

/// Passes until one reads nothing.
async fn drain(relay: &mut Relay) {
    for _ in 0..1_000 {
        if relay.pass().await.unwrap().read == 0 {
            return;
        }
    }
    panic!("the outbox never emptied");
}

async fn outbox_is_empty(db: &TestDb) {
    eventually("the outbox empty", || async {
        outbox::rows(&db.conn, TABLE).await.is_empty()
    })
    .await;
}

/// A crash after commit and before any publish: the decisions are in the outbox and nothing
/// is on the stream; a message whose handling died after its commit comes again as a
/// duplicate and writes no second event. The relay that starts next publishes every event
/// once, in order, and empties the outbox.
async fn every_event_is_published_once_and_removed(db: TestDb) {
    let broker = Broker::new().await;
    let handler = orm(&db);
    let (plenty, scarce) = (db.dune(1_000).await, db.dune(2).await);
    let crashed = placed_for(OrderId::new_v7(), plenty, 1);
    crash_at(&crashed, CrashPoint::AfterCommit, |faults| {
        handler.with_faults(faults)
    })
    .await;
    handler.handle(&crashed).await.unwrap();
    decide(&handler, plenty, scarce, 24).await;
    let expected = outbox::rows(&db.conn, TABLE).await;
    // The crashed order, then 24 reserved, 8 rejected and 6 released.
    assert_eq!(expected.len(), 1 + 24 + 8 + 6, "{expected:?}");
    assert!(
        outbox::stored(&broker.js, &broker.topology.events_stream)
            .await
            .is_empty()
    );

    let mut relay = relay(&db, &broker, fast_settings()).await;
    drain(&mut relay).await;

    let stored = outbox::stored(&broker.js, &broker.topology.events_stream).await;
    assert_published_once_in_order(&expected, &stored, &broker.topology.events_subject_prefix);
    assert!(outbox::rows(&db.conn, TABLE).await.is_empty());
    let status = relay.status();
    assert_eq!(
        (status.published(), status.duplicates()),
        (expected.len() as u64, 0)
    );
}

/// A relay that dies after its PubAcks and before its delete leaves published rows behind.
/// The next one (after the dead one's lease ran out) publishes them again under the same
/// `Nats-Msg-Id`: the stream acknowledges each as a duplicate and stores none twice, and the
/// rows are removed.
async fn a_crash_after_publish_before_delete_stores_each_event_once(db: TestDb) {
    let broker = Broker::new().await;
    let handler = orm(&db);
    let (plenty, scarce) = (db.dune(1_000).await, db.dune(2).await);
    decide(&handler, plenty, scarce, 12).await;
    let expected = outbox::rows(&db.conn, TABLE).await;

    let mut first = relay(&db, &broker, fast_settings()).await;
    let published = first.publish_pending().await.unwrap();
    assert_eq!(published.report.published, expected.len());
    // Dies here: nothing deleted, its partitions still leased until they expire.
    drop(first);
    assert_eq!(outbox::rows(&db.conn, TABLE).await, expected);

    let second = relay(&db, &broker, fast_settings()).await;
    let status = second.status();
    let stop = CancellationToken::new();
    let running = tokio::spawn(second.run(stop.clone()));
    outbox_is_empty(&db).await;
    stop.cancel();
    running.await.unwrap();

    let stored = outbox::stored(&broker.js, &broker.topology.events_stream).await;
    assert_published_once_in_order(&expected, &stored, &broker.topology.events_subject_prefix);
    assert_eq!(status.duplicates(), expected.len() as u64);
    assert_eq!(status.published(), 0);
}

/// Two relays on one database at once share the partitions (each publishes some), publish
/// no event twice (every PubAck of the two is a new one), and keep each order's events in
/// order.
async fn two_relays_share_the_outbox_without_double_work(db: TestDb) {
    let broker = Broker::new().await;
    let handler = orm(&db);
    let (plenty, scarce) = (db.dune(10_000).await, db.dune(2).await);
    decide(&handler, plenty, scarce, 120).await;
    let expected = outbox::rows(&db.conn, TABLE).await;

    // Both registered before either takes a partition: each aims at half from the start.
    let settings = RelaySettings {
        batch_size: 16,
        ..fast_settings()
    };
    let first = relay(&db, &broker, settings.clone()).await;
    let second = relay(&db, &broker, settings).await;
    let statuses = [first.status(), second.status()];
    let stop = CancellationToken::new();
    let running = [
        tokio::spawn(first.run(stop.clone())),
        tokio::spawn(second.run(stop.clone())),
    ];
    outbox_is_empty(&db).await;
    stop.cancel();
    for task in running {
        task.await.unwrap();
    }

    let stored = outbox::stored(&broker.js, &broker.topology.events_stream).await;
    assert_published_once_in_order(&expected, &stored, &broker.topology.events_subject_prefix);
    let published: Vec<u64> = statuses.iter().map(|s| s.published()).collect();
    assert!(
        published.iter().all(|n| *n > 0),
        "both worked: {published:?}"
    );
    assert_eq!(published.iter().sum::<u64>(), expected.len() as u64);
    assert_eq!(statuses.iter().map(|s| s.duplicates()).sum::<u64>(), 0);
}

/// A row too large for the server's max_payload is parked with its reason; the later row of
/// its order waits behind it (neither published nor parked), and every other order's events
/// flow. The relay is not failing for it.
async fn a_poison_row_is_parked_and_blocks_only_its_order(db: TestDb) {
    let broker = Broker::new().await;
    let handler = orm(&db);
    let (plenty, scarce) = (db.dune(1_000).await, db.dune(2).await);
    decide(&handler, plenty, scarce, 6).await;
    let poisoned = Uuid::now_v7();
    let big = format!("{{\"pad\":\"{}\"}}", "x".repeat(2 * 1024 * 1024));
    let poison = outbox::insert(&db.conn, TABLE, poisoned, "stock.reserved", big).await;
    let behind = outbox::insert(&db.conn, TABLE, poisoned, "stock.released", "{}".to_owned()).await;
    decide(&handler, plenty, scarce, 6).await;
    let others: Vec<Row> = outbox::rows(&db.conn, TABLE)
        .await
        .into_iter()
        .filter(|row| row.order_id != poisoned)
        .collect();

    let mut relay = relay(&db, &broker, fast_settings()).await;
    let first = relay.pass().await.unwrap();
    assert_eq!((first.parked, first.failed), (1, 0), "{first:?}");
    drain(&mut relay).await;

    let stored = outbox::stored(&broker.js, &broker.topology.events_stream).await;
    assert_published_once_in_order(&others, &stored, &broker.topology.events_subject_prefix);
    let left = outbox::rows(&db.conn, TABLE).await;
    assert_eq!(
        left.iter().map(|row| row.seq).collect::<Vec<_>>(),
        [poison.seq, behind.seq]
    );
    let reason = left[0].parked_reason.as_deref().unwrap();
    assert!(reason.contains("too large"), "{reason}");
    assert_eq!(left[1].parked_reason, None, "waits, not parked");
    assert_eq!(relay.status().failing_for(), None);
    let source = OutboxSource::inventory(&broker.topology);
    let parked = source.parked(&db.conn).await.unwrap();
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].seq, poison.seq);
}

inventory_tests::on_both_backends!(
    every_event_is_published_once_and_removed,
    a_crash_after_publish_before_delete_stores_each_event_once,
    two_relays_share_the_outbox_without_double_work,
    a_poison_row_is_parked_and_blocks_only_its_order,
);

/// Sequence order is not commit order: a transaction holding seq n open while one with a
/// higher seq commits. The relay publishes the committed one (nothing waits for the open
/// one), and once the open one commits, publishes it too: it reads every row still there,
/// not "after the last seq seen". PostgreSQL only: SQLite has one writer, so there the second
/// transaction cannot commit before the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_committed_out_of_seq_order_is_not_skipped() {
    let db = TestDb::new(Backend::Postgres).await;
    let broker = Broker::new().await;
    let handler = orm(&db);
    let (early_book, late_book) = (db.dune(10).await, db.dune(10).await);
    let early = placed_for(OrderId::new_v7(), early_book, 1);
    let (faults, mut hold) = faults::hold_once_at(CrashPoint::BeforeCommit);
    let held = tokio::spawn({
        let handler = handler.with_faults(faults);
        async move { handler.handle(&early).await }
    });
    // Its reservation and its outbox row are written, its transaction open.
    hold.reached().await;
    let late = placed_for(OrderId::new_v7(), late_book, 1);
    handler.handle(&late).await.unwrap();
    let committed = outbox::rows(&db.conn, TABLE).await;
    assert_eq!(committed.len(), 1, "only the later seq is visible");

    let mut relay = relay(&db, &broker, fast_settings()).await;
    let pass = relay.pass().await.unwrap();
    assert_eq!((pass.read, pass.published), (1, 1));
    hold.release();
    held.await.unwrap().unwrap();
    let late_row = outbox::rows(&db.conn, TABLE).await;
    assert_eq!(late_row.len(), 1);
    assert!(
        late_row[0].seq < committed[0].seq,
        "the row that committed last has the lower seq"
    );
    drain(&mut relay).await;

    let stored = outbox::stored(&broker.js, &broker.topology.events_stream).await;
    let expected = [committed[0].clone(), late_row[0].clone()];
    assert_published_once_in_order(&expected, &stored, &broker.topology.events_subject_prefix);
    assert!(outbox::rows(&db.conn, TABLE).await.is_empty());
}

/// A row whose subject no stream holds (the events stream exists, with narrower subjects) is
/// parked, and the later rows of its order wait. Once the stream takes the subject, the
/// operator's retry sends it, and then the rows behind it, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_without_a_stream_is_parked_then_retried_in_order() {
    let db = TestDb::new(Backend::Postgres).await;
    let broker = Broker::new().await;
    let prefix = broker.topology.events_subject_prefix.clone();
    let mut config = async_nats::jetstream::stream::Config {
        name: broker.topology.events_stream.clone(),
        subjects: vec![format!("{prefix}.stock.*")],
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    };
    // In place of the broker's events stream, which holds every subject below the prefix.
    broker
        .js
        .delete_stream(&broker.topology.events_stream)
        .await
        .unwrap();
    broker.js.create_stream(config.clone()).await.unwrap();
    let order = Uuid::now_v7();
    let first = outbox::insert(&db.conn, TABLE, order, "stock.reserved", "{}".into()).await;
    let unheld = outbox::insert(&db.conn, TABLE, order, "audit.noted", "{}".into()).await;
    let behind = outbox::insert(&db.conn, TABLE, order, "stock.released", "{}".into()).await;
    let other = outbox::insert(
        &db.conn,
        TABLE,
        Uuid::now_v7(),
        "stock.reserved",
        "{}".into(),
    )
    .await;

    let mut relay = relay(&db, &broker, fast_settings()).await;
    drain(&mut relay).await;
    let stored = outbox::stored(&broker.js, &broker.topology.events_stream).await;
    assert_published_once_in_order(&[first.clone(), other.clone()], &stored, &prefix);
    let left = outbox::rows(&db.conn, TABLE).await;
    assert_eq!(
        left.iter().map(|row| row.seq).collect::<Vec<_>>(),
        [unheld.seq, behind.seq]
    );
    let reason = left[0].parked_reason.as_deref().unwrap();
    assert!(reason.contains("no stream holds"), "{reason}");
    assert_eq!(relay.status().failing_for(), None);

    config.subjects.push(format!("{prefix}.audit.*"));
    broker.js.update_stream(&config).await.unwrap();
    let source = OutboxSource::inventory(&broker.topology);
    let retried = source.retry(&db.conn, &Retry::All).await.unwrap();
    assert_eq!(retried, [unheld.seq]);
    drain(&mut relay).await;
    let stored = outbox::stored(&broker.js, &broker.topology.events_stream).await;
    assert_published_once_in_order(&[first, unheld, behind, other], &stored, &prefix);
    assert!(outbox::rows(&db.conn, TABLE).await.is_empty());
}

/// The orders producer's outbox has the same columns; the relay takes it with its own stream
/// and prefix: `orders_outbox` to the orders stream under `<orders prefix>.placed`, leaving
/// Inventory's outbox alone.
async fn the_relay_publishes_another_outbox_table_to_its_own_stream(db: TestDb) {
    let broker = Broker::new().await;
    let order = Uuid::now_v7();
    let expected = vec![
        outbox::insert(
            &db.conn,
            "orders_outbox",
            order,
            "placed",
            "{\"n\":1}".into(),
        )
        .await,
        outbox::insert(
            &db.conn,
            "orders_outbox",
            order,
            "cancelled",
            "{\"n\":2}".into(),
        )
        .await,
    ];
    // Inventory's own outbox is not touched by the orders relay.
    let inventory_row = outbox::insert(&db.conn, TABLE, order, "stock.reserved", "{}".into()).await;

    let (mut relay, _) = Relay::prepare(
        &broker.js,
        db.conn.clone(),
        OutboxSource::orders(&broker.topology),
        &broker.topology.orders_stream(),
        fast_settings(),
    )
    .await
    .unwrap();
    drain(&mut relay).await;

    let stored = outbox::stored(&broker.js, &broker.topology.stream).await;
    assert_published_once_in_order(&expected, &stored, &broker.topology.subject_prefix);
    assert_eq!(stored[0].body.as_ref(), b"{\"n\":1}");
    assert!(outbox::rows(&db.conn, "orders_outbox").await.is_empty());
    assert_eq!(outbox::rows(&db.conn, TABLE).await, [inventory_row]);
}

inventory_tests::on_both_backends!(the_relay_publishes_another_outbox_table_to_its_own_stream);

/// A relay whose outbox table does not exist refuses to start, naming the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_without_its_table_refuses_to_start() {
    let db = TestDb::new(Backend::Sqlite).await;
    let broker = Broker::new().await;
    // The orders producer's outbox, gone from this database.
    db.conn
        .execute_unprepared("DROP TABLE orders_outbox")
        .await
        .unwrap();
    let refused = Relay::prepare(
        &broker.js,
        db.conn.clone(),
        OutboxSource::orders(&broker.topology),
        &broker.topology.orders_stream(),
        fast_settings(),
    )
    .await
    .err()
    .expect("no such table");
    assert!(
        matches!(refused, RelayError::MissingTable { .. }),
        "{refused}"
    );
    assert!(refused.to_string().contains("orders_outbox"), "{refused}");
}

/// A lease as long as the duplicate window is refused: a takeover could republish an event
/// after the window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_too_long_for_the_duplicate_window_is_refused() {
    let db = TestDb::new(Backend::Sqlite).await;
    let broker = Broker::new().await;
    let settings = RelaySettings {
        lease: Duration::from_secs(60),
        ..fast_settings()
    };
    let refused = Relay::prepare(
        &broker.js,
        db.conn.clone(),
        OutboxSource::inventory(&broker.topology),
        &broker.topology.events_stream(),
        settings,
    )
    .await
    .err()
    .expect("60 s + 1 s is more than a quarter of 2 minutes");
    assert!(
        refused.to_string().contains("duplicate window"),
        "{refused}"
    );
}

/// Passes of each relay until `done` holds for their held partitions.
async fn lease_rounds_until(relays: &mut [Relay], what: &str, done: impl Fn(&[usize]) -> bool) {
    for _ in 0..200 {
        for relay in relays.iter_mut() {
            relay.pass().await.unwrap();
        }
        let held: Vec<usize> = relays
            .iter()
            .map(|relay| relay.status().held_partitions())
            .collect();
        if done(&held) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("never {what}");
}

/// Three relays take 6, 6 and 4 of the 16 partitions; when one dies, the other two take its
/// partitions once its lease and heartbeat expired (8 each); when one of those stops
/// cleanly, it gives its partitions back and the last takes all 16 without waiting for an
/// expiry.
async fn relays_share_the_partitions_fairly_and_take_over(db: TestDb) {
    let broker = Broker::new().await;
    let mut relays = Vec::new();
    for _ in 0..3 {
        relays.push(relay(&db, &broker, fast_settings()).await);
    }
    lease_rounds_until(&mut relays, "6, 6 and 4", |held| {
        let mut sorted = held.to_vec();
        sorted.sort_unstable();
        sorted == [4, 6, 6]
    })
    .await;

    drop(relays.pop());
    lease_rounds_until(&mut relays, "8 and 8", |held| held == [8, 8]).await;

    let leaving = relays.pop().unwrap();
    let stop = CancellationToken::new();
    stop.cancel();
    leaving.run(stop).await;
    let started = std::time::Instant::now();
    lease_rounds_until(&mut relays, "all 16", |held| held == [16]).await;
    assert!(
        started.elapsed() < fast_settings().lease,
        "taken over before the released leases could have expired: {:?}",
        started.elapsed()
    );
}

inventory_tests::on_both_backends!(relays_share_the_partitions_fairly_and_take_over);

/// The leases are kept on a timer of their own, not between passes: a pass held up for three
/// leases (its DELETE waits for a row another transaction locked) keeps all 16 partitions,
/// their expiry moving on ahead of the database's clock; renewed only between passes, they
/// lapsed within the first lease. Once the lock goes, the row is removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_longer_than_the_lease_keeps_its_partitions() {
    let db = TestDb::new(Backend::Postgres).await;
    let broker = Broker::new().await;
    let plenty = db.dune(1_000).await;
    orm(&db)
        .handle(&placed_for(OrderId::new_v7(), plenty, 1))
        .await
        .unwrap();
    assert_eq!(outbox::rows(&db.conn, TABLE).await.len(), 1);
    let lock = db.conn.begin().await.unwrap();
    lock.execute_unprepared("SELECT seq FROM outbox FOR UPDATE")
        .await
        .unwrap();

    let settings = RelaySettings {
        db_timeout: None,
        ..fast_settings()
    };
    let relay = relay(&db, &broker, settings.clone()).await;
    let holder = relay.holder().to_owned();
    let stop = CancellationToken::new();
    let running = tokio::spawn(relay.run(stop.clone()));
    eventually("the event on the stream", || async {
        outbox::stored(&broker.js, &broker.topology.events_stream)
            .await
            .len()
            == 1
    })
    .await;
    db.wait_for_lock_waiter().await;
    tokio::time::sleep(settings.lease * 3).await;
    let unexpired = db
        .conn
        .query_one_raw(Statement::from_sql_and_values(
            db.conn.get_database_backend(),
            "SELECT COUNT(*) AS held FROM outbox_leases WHERE outbox = $1 AND holder = $2 \
               AND expires_at > CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
            [TABLE.into(), holder.into()],
        ))
        .await
        .unwrap()
        .unwrap()
        .try_get::<i64>("", "held")
        .unwrap();
    assert_eq!(unexpired, 16, "partitions still leased after three leases");
    assert_eq!(
        outbox::rows(&db.conn, TABLE).await.len(),
        1,
        "the pass still waits"
    );

    lock.rollback().await.unwrap();
    outbox_is_empty(&db).await;
    stop.cancel();
    running.await.unwrap();
}

/// With a backup poll of an hour, only the lanes' wake-up can get an event out: the service
/// handles an order, commits its event and wakes the relay, which publishes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lanes_wake_the_relay_after_a_commit() {
    let db = TestDb::new(Backend::Postgres).await;
    let broker = Broker::new().await;
    let book = db.dune(100).await;
    let settings = RelaySettings {
        poll_interval: Duration::from_secs(3_600),
        ..fast_settings()
    };
    let relay = relay(&db, &broker, settings).await;
    let status = relay.status();
    let wake = relay.wake();
    let stop = CancellationToken::new();
    let running = tokio::spawn(relay.run(stop.clone()));
    // Its first pass found nothing; from here only a wake sends it publishing.
    eventually("the relay holding its partitions", || async {
        status.held_partitions() == 16
    })
    .await;

    let service = RunningService::start_waking(
        &broker,
        orm(&db),
        db.conn.clone(),
        broker.settings(2, 5),
        Some(wake),
    )
    .await;
    for _ in 0..3 {
        broker.publisher().publish(&placed(book, 1)).await.unwrap();
    }
    eventually("three events published", || async {
        status.published() == 3
    })
    .await;
    outbox_is_empty(&db).await;
    service.stop().await;
    stop.cancel();
    running.await.unwrap();
}

/// NATS stopped while decisions keep being committed: the relay holds every row (nothing
/// published, nothing lost), reports itself failing, backs off, and once NATS is back
/// drains the outbox, each event once and in its order's order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_down_while_events_keep_coming_loses_nothing() {
    let mut server = NatsServer::start().await;
    let db = TestDb::new(Backend::Postgres).await;
    let broker = Broker::on(&server.url()).await;
    let (plenty, scarce) = (db.dune(100_000).await, db.dune(2).await);
    let relay = relay(&db, &broker, fast_settings()).await;
    let (status, wake) = (relay.status(), relay.wake());
    let stop = CancellationToken::new();
    let running = tokio::spawn(relay.run(stop.clone()));

    let producing = CancellationToken::new();
    let producer = tokio::spawn({
        let handler = orm(&db);
        let producing = producing.clone();
        async move {
            let mut decided = Vec::new();
            while !producing.is_cancelled() {
                decided.extend(decide(&handler, plenty, scarce, 3).await);
                wake.notify();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            decided
        }
    });
    eventually("some events published", || async { status.published() > 0 }).await;
    server.stop().await;
    eventually("the relay failing", || async {
        status.failing_for().is_some()
    })
    .await;
    let during = status.published();
    // Rows pile up while NATS is away.
    eventually("rows waiting", || async {
        outbox::rows(&db.conn, TABLE).await.len() > 50
    })
    .await;
    assert_eq!(
        status.published(),
        during,
        "nothing published while NATS was away"
    );
    server.start_again().await;
    eventually("publishing again", || async {
        status.failing_for().is_none()
    })
    .await;
    producing.cancel();
    let decided = producer.await.unwrap();
    outbox_is_empty(&db).await;
    stop.cancel();
    running.await.unwrap();

    let stored = outbox::stored(&broker.js, &broker.topology.events_stream).await;
    assert_each_order_in_order(&stored, &decided, &broker.topology.events_subject_prefix);
}

/// The relay's own stream deleted: no row is parked (it is the broker's fault, not the
/// rows'), the relay reports failing and /healthz says so with 503; once the stream is back,
/// the rows go out and the health check is 200 again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_stream_fails_the_relay_without_parking_and_health_says_so() {
    let db = TestDb::new(Backend::Postgres).await;
    let broker = Broker::new().await;
    let handler = orm(&db);
    let (plenty, scarce) = (db.dune(100).await, db.dune(2).await);
    let relay = relay(&db, &broker, fast_settings()).await;
    let status = relay.status();
    let metrics = Metrics::new().unwrap();
    metrics
        .watch_relay(status.clone(), Duration::from_millis(300))
        .unwrap();
    let stop = CancellationToken::new();
    let readiness = Readiness::default();
    readiness.ready(broker.client.clone(), &db.conn);
    let addr = health::serve(
        "127.0.0.1:0".parse().unwrap(),
        metrics.clone(),
        Liveness::default(),
        readiness,
        Duration::from_secs(60),
        stop.clone(),
    )
    .await
    .map(|(addr, server)| {
        tokio::spawn(server);
        addr
    })
    .unwrap();
    let running = tokio::spawn(relay.run(stop.clone()));
    assert_eq!(healthz(addr).await.1["relay"], "publishing");

    broker
        .js
        .delete_stream(&broker.topology.events_stream)
        .await
        .unwrap();
    decide(&handler, plenty, scarce, 4).await;
    let waiting = outbox::rows(&db.conn, TABLE).await;
    eventually("/healthz 503, relay failing", || async {
        let (code, body) = healthz(addr).await;
        code == 503 && body["relay"] == "failing"
    })
    .await;
    assert!(
        outbox::rows(&db.conn, TABLE)
            .await
            .iter()
            .all(|row| row.parked_reason.is_none()),
        "nothing parked"
    );
    // The backlog is looked at by a task of its own.
    let pending = format!(
        "inventory_outbox_pending_rows{{outbox=\"{TABLE}\"}} {}",
        waiting.len()
    );
    eventually("the pending rows counted", || async {
        metrics.render().unwrap().contains(&pending)
    })
    .await;

    jetstream::ensure_prefix_stream(&broker.js, &broker.topology.events_stream())
        .await
        .unwrap();
    outbox_is_empty(&db).await;
    eventually("/healthz 200, relay publishing", || async {
        let (code, body) = healthz(addr).await;
        code == 200 && body["relay"] == "publishing"
    })
    .await;
    let stored = outbox::stored(&broker.js, &broker.topology.events_stream).await;
    assert_published_once_in_order(&waiting, &stored, &broker.topology.events_subject_prefix);
    let scrape = metrics.render().unwrap();
    assert!(
        scrape.contains(&format!(
            "inventory_outbox_published_total{{outbox=\"{TABLE}\"}} {}",
            waiting.len()
        )),
        "{scrape}"
    );
    stop.cancel();
    running.await.unwrap();
}

/// Shared blocks a statement's plan touched, as `EXPLAIN (ANALYZE, BUFFERS)` counts them.
async fn blocks_touched(db: &TestDb, statement: Statement) -> i64 {
    let explain = Statement {
        sql: format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {}", statement.sql),
        ..statement
    };
    let row = db.conn.query_one_raw(explain).await.unwrap().unwrap();
    let plan: serde_json::Value = row.try_get_by_index(0).unwrap();
    let plan = &plan[0]["Plan"];
    ["Shared Hit Blocks", "Shared Read Blocks"]
        .iter()
        .map(|key| plan[key].as_i64().unwrap_or(0))
        .sum()
}

/// The backlog's figures (every 30 s, on every instance) are read through indexes: their
/// statements touch as few blocks at 100,000 rows waiting as at ten. A count of the rows, as
/// they once were, read the whole outbox each time, most when an outage had grown it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backlog_figures_touch_as_few_blocks_at_a_hundred_thousand_rows_as_at_ten() {
    let db = TestDb::new(Backend::Postgres).await;
    let source = OutboxSource::inventory(&jetstream::Topology::default());
    let mut stored = 0;
    let mut touched = Vec::new();
    for rows in [10, 100_000] {
        db.conn
            .execute_unprepared(&format!(
                "INSERT INTO {TABLE} (event_id, relay_partition, order_id, subject, payload, \
                 created_at) SELECT gen_random_uuid(), i % 16, gen_random_uuid(), \
                 'stock.reserved', '{{}}', now() FROM generate_series({}, {rows}) AS i; \
                 ANALYZE {TABLE}",
                stored + 1
            ))
            .await
            .unwrap();
        stored = rows;
        let mut blocks = 0;
        for statement in source.backlog_statements(sea_orm::DbBackend::Postgres) {
            blocks += blocks_touched(&db, statement).await;
        }
        touched.push(blocks);
    }
    assert!(
        touched[1] <= touched[0] + 6,
        "blocks touched at 10 and at 100,000 rows: {touched:?}"
    );
}
