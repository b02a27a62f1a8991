//! The JetStream subscriber, in-process, against a real NATS server and a real database.

use inventory_benches::faults;
use inventory_benches::produce::Produce as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use inventory_benches::consumers::{DetectMode, Handler, HandlerKind, NaturalKeyPath};
use inventory_domain::{Message, Outcome};
use inventory_infra::CrashPoint;
use inventory_infra::jetstream::dlq_headers;
use inventory_infra::{HandleError, MessageHandler};
use inventory_service::consumer::Ending;
use inventory_tests::broker::{Broker, RunningService, eventually, one_order};
use inventory_tests::{Backend, TestDb, placed, placed_for};
use sea_orm::DbErr;
use tokio::sync::Barrier;

async fn reserved_reaches(db: &TestDb, book: inventory_domain::BookId, copies: i64) {
    eventually(&format!("{copies} copies reserved"), || async {
        db.reserved(book).await == copies
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_is_processed_and_acked_once() {
    let db = TestDb::new(Backend::Postgres).await;
    let broker = Broker::new().await;
    let book = db.dune(10).await;
    let message = placed(book, 2);
    let receipt = broker.publisher().publish(&message).await.unwrap();
    assert!(!receipt.duplicate);

    let service = RunningService::start(
        &broker,
        db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm)),
        db.conn.clone(),
        broker.settings(4, 5),
    )
    .await;
    reserved_reaches(&db, book, 2).await;
    broker.settled().await;
    let stats = service.metrics.clone();
    assert_eq!(service.stop().await, Ending::Drained);
    assert_eq!(stats.acked(), 1);
    assert_eq!(stats.retried(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_drops_a_resend_with_the_same_id() {
    let broker = Broker::new().await;
    let message = placed(inventory_domain::BookId::new_v7(), 2);
    let publisher = broker.publisher();
    assert!(!publisher.publish(&message).await.unwrap().duplicate);
    assert!(publisher.publish(&message).await.unwrap().duplicate);
    assert!(
        !publisher
            .publish(&message.resent_with_new_id())
            .await
            .unwrap()
            .duplicate
    );
    assert_eq!(broker.stream_messages(&broker.topology.stream).await, 2);
}

/// Commits, then fails as if the ack were lost: the service naks, JetStream redelivers.
#[derive(Clone)]
struct FailsAfterCommitOnce {
    inner: Handler,
    failed: Arc<AtomicBool>,
}

impl MessageHandler for FailsAfterCommitOnce {
    async fn handle(&self, message: &Message) -> Result<Outcome, HandleError> {
        let outcome = self.inner.handle(message).await?;
        if !self.failed.swap(true, Ordering::SeqCst) {
            return Err(HandleError::Database(DbErr::Custom(
                "lost after commit".into(),
            )));
        }
        Ok(outcome)
    }
}

/// One order through a handler that fails once after committing; the redelivery must be
/// acked as a duplicate and reserve nothing more. Returns the service's stats.
async fn redelivered_once<H: MessageHandler>(
    db: &TestDb,
    make_handler: impl FnOnce(&TestDb) -> H,
) -> inventory_service::metrics::ConsumerMetrics {
    let broker = Broker::new().await;
    let book = db.dune(10).await;
    broker.publisher().publish(&placed(book, 2)).await.unwrap();
    let service = RunningService::start(
        &broker,
        make_handler(db),
        db.conn.clone(),
        broker.settings(4, 5),
    )
    .await;
    eventually("the redelivery acked as a duplicate", || async {
        service.metrics.duplicates() == 1
    })
    .await;
    assert_eq!(db.reserved(book).await, 2);
    broker.settled().await;
    let stats = service.metrics.clone();
    service.stop().await;
    stats
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_after_a_nak_is_a_duplicate() {
    let db = TestDb::new(Backend::Postgres).await;
    let stats = redelivered_once(&db, |db| FailsAfterCommitOnce {
        inner: db.consumer(HandlerKind::Inbox(DetectMode::OnConflict)),
        failed: Arc::default(),
    })
    .await;
    assert_eq!(stats.retried(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_died_before_its_ack_gets_a_duplicate() {
    let db = TestDb::new(Backend::Postgres).await;
    // The handler commits and dies before the ack; JetStream redelivers after the ack wait.
    let stats = redelivered_once(&db, |db| {
        db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm))
            .with_faults(faults::crash_once_at(CrashPoint::AfterCommit))
    })
    .await;
    assert_eq!(stats.left_for_redelivery(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_are_dead_lettered_and_the_service_keeps_going() {
    let db = TestDb::new(Backend::Postgres).await;
    let broker = Broker::new().await;
    let book = db.dune(10).await;
    let publisher = broker.publisher();

    let order = placed(book, 2);
    publisher.publish(&order).await.unwrap();
    let service = RunningService::start(
        &broker,
        db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm)),
        db.conn.clone(),
        broker.settings(2, 5),
    )
    .await;
    // Decided before its conflicting copy comes: two lanes could otherwise take the copy first,
    // reserve its 3 and refuse the order.
    reserved_reaches(&db, book, 2).await;
    broker
        .publish_raw("placed", &b"{not json"[..], Some("poison-1"))
        .await;
    let too_many = format!(
        r#"{{"message_id":"poison-2","order_id":"{}","book_id":"{book}","quantity":0}}"#,
        inventory_domain::OrderId::new_v7()
    );
    broker
        .publish_raw("placed", too_many.into_bytes(), Some("poison-2"))
        .await;
    publisher
        .publish(&placed(inventory_domain::BookId::new_v7(), 1))
        .await
        .unwrap();
    // The same order and book for another quantity, under a new id: a conflict.
    publisher
        .publish(&placed_for(order.event.order_id(), book, 3))
        .await
        .unwrap();
    broker
        .publish_raw("placed", vec![b' '; 70 * 1024], Some("poison-big"))
        .await;
    broker
        .publish_raw("shipped", &b"{}"[..], Some("poison-subject"))
        .await;
    let healthy = placed(book, 1);
    publisher.publish(&healthy).await.unwrap();

    reserved_reaches(&db, book, 3).await;
    broker.settled().await;
    assert!(service.is_running());
    let letters = broker.dead_letters().await;
    let mut reasons: Vec<&str> = letters
        .iter()
        .map(|letter| letter.header(dlq_headers::REASON).unwrap())
        .collect();
    reasons.sort_unstable();
    assert_eq!(
        reasons,
        [
            "conflicting-reservation",
            "invalid",
            "invalid",
            "malformed",
            "malformed",
            "unknown-book"
        ]
    );
    for letter in &letters {
        assert_eq!(
            letter.subject,
            format!(
                "{}.{}",
                broker.topology.dlq_subject_prefix, broker.consumer_name
            )
        );
        assert_eq!(
            letter.header(dlq_headers::STREAM),
            Some(broker.topology.stream.as_str())
        );
        assert_eq!(letter.header(dlq_headers::DELIVERIES), Some("1"));
        assert!(letter.header(dlq_headers::STREAM_SEQUENCE).is_some());
        assert!(!letter.header(dlq_headers::DETAIL).unwrap_or("").is_empty());
    }
    let malformed = letters
        .iter()
        .find(|letter| letter.body.as_ref() == b"{not json")
        .expect("the original body is kept");
    assert_eq!(
        malformed.header(dlq_headers::ORIGINAL_MSG_ID),
        Some("poison-1")
    );
    assert_eq!(service.metrics.dead_lettered(), 6);
    service.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_mismatch_is_dead_lettered_by_the_inbox() {
    let db = TestDb::new(Backend::Postgres).await;
    let broker = Broker::new().await;
    let book = db.dune(10).await;
    let order = placed(book, 2);
    broker.publisher().publish(&order).await.unwrap();
    let mut altered = placed(book, 5);
    altered.key = order.key.clone();
    // Another Nats-Msg-Id, so the stream keeps it, but the same message id in the body.
    broker
        .publish_raw("placed", altered.to_plain_json().unwrap(), Some("other"))
        .await;
    let service = RunningService::start(
        &broker,
        db.consumer(HandlerKind::Inbox(DetectMode::OnConflict)),
        db.conn.clone(),
        broker.settings(1, 5),
    )
    .await;
    broker.settled().await;
    let letters = broker.dead_letters().await;
    assert_eq!(letters.len(), 1);
    assert_eq!(
        letters[0].header(dlq_headers::REASON),
        Some("payload-mismatch")
    );
    assert_eq!(db.reserved(book).await, 2);
    service.stop().await;
}

/// Fails every time, as a database error would.
#[derive(Clone)]
struct AlwaysFails;

impl MessageHandler for AlwaysFails {
    async fn handle(&self, _message: &Message) -> Result<Outcome, HandleError> {
        Err(HandleError::Database(DbErr::Custom("always".into())))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_allowed_delivery_failing_is_a_max_deliveries_dead_letter() {
    let (db, broker) = one_order().await;
    let service =
        RunningService::start(&broker, AlwaysFails, db.conn.clone(), broker.settings(1, 3)).await;
    eventually("a max-deliveries dead letter", || async {
        broker.stream_messages(&broker.topology.dlq_stream).await == 1
    })
    .await;
    broker.settled().await;
    let letters = broker.dead_letters().await;
    assert_eq!(
        letters[0].header(dlq_headers::REASON),
        Some("max-deliveries")
    );
    assert_eq!(letters[0].header(dlq_headers::DELIVERIES), Some("3"));
    assert_eq!(service.metrics.retried(), 2);
    service.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_the_message_in_flight_finish_and_ack() {
    let db = TestDb::new(Backend::Postgres).await;
    let broker = Broker::new().await;
    let book = db.dune(10).await;
    broker.publisher().publish(&placed(book, 2)).await.unwrap();
    let (faults, mut hold) = faults::hold_once_at(CrashPoint::BeforeCommit);
    let service = RunningService::start(
        &broker,
        db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm))
            .with_faults(faults),
        db.conn.clone(),
        broker.settings(4, 5),
    )
    .await;
    hold.reached().await;
    service.shutdown().graceful.cancel();
    // The idle lanes saw the stop and ended; the one holding the message goes on.
    eventually("the idle lanes stopped", || async { service.lanes() == 1 }).await;
    assert!(
        service.is_running(),
        "shutdown waits for the message in flight"
    );
    hold.release();
    assert_eq!(service.stop().await, Ending::Drained);
    assert_eq!(db.reserved(book).await, 2);
    broker.settled().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloud_events_and_cancellations_flow_through() {
    let db = TestDb::new(Backend::Postgres).await;
    let broker = Broker::new().await;
    let book = db.dune(10).await;
    let order = inventory_domain::OrderId::new_v7();
    let event = format!(
        r#"{{"specversion":"1.0","id":"ce-1","source":"/shop","type":"bookstore.order.placed","data":{{"order_id":"{order}","book_id":"{book}","quantity":4}}}}"#
    );
    broker
        .publish_raw("placed", event.clone().into_bytes(), Some("ce-a"))
        .await;
    // The same event again under another Nats-Msg-Id: the inbox's (source, id) key catches it.
    broker
        .publish_raw("placed", event.into_bytes(), Some("ce-b"))
        .await;
    let service = RunningService::start(
        &broker,
        db.consumer(HandlerKind::Inbox(DetectMode::OnConflict)),
        db.conn.clone(),
        broker.settings(1, 5),
    )
    .await;
    reserved_reaches(&db, book, 4).await;
    broker
        .publisher()
        .publish(&Message::cancelled(order))
        .await
        .unwrap();
    reserved_reaches(&db, book, 0).await;
    broker.settled().await;
    assert_eq!(service.metrics.duplicates(), 1);
    service.stop().await;
}

/// Holds each instance's first message until the other instance is handling one too: proof
/// that the two instances handled messages at the same time, not one after the other.
#[derive(Clone)]
struct MeetsTheOther {
    inner: Handler,
    first: Arc<AtomicBool>,
    both: Arc<Barrier>,
    met: Arc<AtomicBool>,
}

impl MeetsTheOther {
    fn new(inner: Handler, both: &Arc<Barrier>) -> Self {
        Self {
            inner,
            first: Arc::default(),
            both: Arc::clone(both),
            met: Arc::default(),
        }
    }
}

impl MessageHandler for MeetsTheOther {
    async fn handle(&self, message: &Message) -> Result<Outcome, HandleError> {
        if !self.first.swap(true, Ordering::SeqCst) {
            // Bounded, so a run where the other instance never handles anything fails on the
            // assertion below instead of hanging its drain.
            let met = tokio::time::timeout(Duration::from_secs(30), self.both.wait()).await;
            self.met.store(met.is_ok(), Ordering::SeqCst);
        }
        self.inner.handle(message).await
    }
}

/// Two instances share one durable consumer; every kind of duplicate is in the stream.
async fn competing_instances(db: TestDb) {
    let broker = Broker::new().await;
    let book = db.dune(10_000).await;
    let publisher = broker.publisher();
    let orders: Vec<Message> = (0..60).map(|i| placed(book, 1 + i % 3)).collect();
    let expected: i64 = (0..60).map(|i| 1 + i % 3).sum();
    for (i, order) in orders.iter().enumerate() {
        publisher.publish(order).await.unwrap();
        if i % 3 == 0 {
            publisher
                .publish(&order.resent_with_new_id())
                .await
                .unwrap();
        }
        if i % 5 == 0 {
            publisher.publish(order).await.unwrap();
        }
    }
    // Both instances share one consumer: made before either starts.
    broker.consumer(10).await;
    let handler = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm));
    let crashing = handler.with_faults(faults::crash_once_at(CrashPoint::AfterCommit));
    let both = Arc::new(Barrier::new(2));
    let (handler, crashing) = (
        MeetsTheOther::new(handler, &both),
        MeetsTheOther::new(crashing, &both),
    );
    let met = [Arc::clone(&handler.met), Arc::clone(&crashing.met)];
    let first =
        RunningService::start(&broker, handler, db.conn.clone(), broker.settings(4, 10)).await;
    let second =
        RunningService::start(&broker, crashing, db.conn.clone(), broker.settings(4, 10)).await;
    reserved_reaches(&db, book, expected).await;
    broker.settled().await;
    let total = |pick: fn(&inventory_service::metrics::ConsumerMetrics) -> u64| {
        pick(&first.metrics) + pick(&second.metrics)
    };
    // 60 orders, each processed once; one of them committed by the instance that then died
    // before its ack, so it was acked later as a duplicate.
    let crashed = total(|stats| stats.left_for_redelivery());
    assert_eq!(crashed, 1);
    assert_eq!(total(|stats| stats.acked()) + crashed, 60);
    // At least the 20 resends under new ids (the natural key's catch) and the one redelivery;
    // more if a message outwaited the 1 s ack wait in a queue for the database and came again.
    // The 12 resends under the same id never reached the consumer: the stream dropped them.
    assert!(total(|stats| stats.duplicates()) >= 21);
    assert_eq!(broker.stream_messages(&broker.topology.stream).await, 80);
    assert!(first.metrics.acked() > 0);
    assert!(second.metrics.acked() > 0);
    first.stop().await;
    second.stop().await;
    assert!(
        met.iter().all(|met| met.load(Ordering::SeqCst)),
        "the instances never handled messages at the same time"
    );
    assert_eq!(db.reserved(book).await, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn competing_instances_on_postgres_reserve_exactly_once() {
    competing_instances(TestDb::new(Backend::Postgres).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn competing_instances_on_embedded_sqlite_reserve_exactly_once() {
    competing_instances(TestDb::new(Backend::Sqlite).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_stream_and_consumer_are_kept_and_their_differences_reported() {
    let broker = Broker::new().await;
    broker.consumer(5).await;
    let mut topology = broker.topology.clone();
    topology.duplicate_window = std::time::Duration::from_secs(30);
    let (mut stream, drifts) = inventory_infra::jetstream::ensure_streams(&broker.js, &topology)
        .await
        .unwrap();
    let settings: Vec<&str> = drifts.iter().map(|drift| drift.setting).collect();
    assert_eq!(settings, ["duplicate_window", "duplicate_window"]);
    assert!(drifts[0].to_string().contains("keeping the existing value"));
    let kept = stream.info().await.unwrap().config.duplicate_window;
    assert_eq!(kept, std::time::Duration::from_secs(120));

    let mut wanted = inventory_infra::jetstream::ConsumerSettings {
        durable_name: broker.consumer_name.clone(),
        filters: vec![format!("{}.>", broker.topology.subject_prefix)],
        ack_wait: std::time::Duration::from_secs(1),
        max_deliver: -1,
        backoff: Vec::new(),
        max_ack_pending: 1_000,
    };
    wanted.max_deliver = 7;
    let ensure =
        |update| inventory_infra::jetstream::ensure_consumer(&broker.js, &stream, &wanted, update);
    let (mut consumer, drifts) = ensure(false).await.unwrap();
    assert_eq!(drifts.len(), 1);
    assert_eq!(drifts[0].setting, "max_deliver");
    assert!(drifts[0].kept, "{}", drifts[0]);
    assert_eq!(consumer.info().await.unwrap().config.max_deliver, -1);
    // Told to, it sets its own.
    let (mut consumer, drifts) = ensure(true).await.unwrap();
    assert_eq!(drifts.len(), 1);
    assert!(!drifts[0].kept, "{}", drifts[0]);
    assert_eq!(consumer.info().await.unwrap().config.max_deliver, 7);
}

/// A lane whose handler panics takes no more messages and must not leave the process idling
/// with fewer lanes, or none, and a healthy look: the loop reports it (`/livez` reads the
/// liveness), stops the other lanes and ends with an error, for the supervisor to restart the
/// process. The message is left unacked, and is reserved once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_whose_handler_panics_stops_the_loop_with_an_error() {
    let db = TestDb::new(Backend::Postgres).await;
    let broker = Broker::new().await;
    let book = db.dune(10).await;
    let natural = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::OneStatement));
    let panicking = natural.with_faults(faults::panic_once_at(CrashPoint::BeforeStatement));
    let service =
        RunningService::start(&broker, panicking, db.conn.clone(), broker.settings(4, 5)).await;
    let liveness = service.liveness.clone();
    broker.publisher().publish(&placed(book, 2)).await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(30), service.wait())
        .await
        .expect("the loop ended")
        .expect_err("the loop failed");
    assert!(
        ended
            .to_string()
            .contains("panicked: injected panic at before-statement"),
        "{ended}"
    );
    assert!(
        liveness
            .failure()
            .is_some_and(|why| why.contains("panicked")),
        "{:?}",
        liveness.failure()
    );
    // The message was left unacked; whichever loop gets it next (a lane of this one, draining,
    // once its ack wait ran out, or the restarted loop) reserves it once.
    let restarted =
        RunningService::start(&broker, natural, db.conn.clone(), broker.settings(4, 5)).await;
    reserved_reaches(&db, book, 2).await;
    assert_eq!(restarted.stop().await, Ending::Drained);
}
