//! The JetStream boundary: a lane fetches only what it handles at once, the service caps
//! deliveries itself (the consumer it creates has no cap, so the server never drops a
//! message), the backstop dead-letters what a consumer with a cap of its own gave up on, and a
//! lane that breaks an invariant or panics, even after the stop, fails the loop.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use inventory_domain::{Message, Outcome};
use inventory_infra::jetstream::{self, ConsumerSettings, dlq_headers};
use inventory_infra::{CrashPoint, HandleError, MessageHandler};
use inventory_tests::broker::{Broker, RunningService, eventually, one_order};
use inventory_tests::{Backend, TestDb, placed};
use tokio::sync::{Notify, Semaphore};

/// Holds every handling until a permit is given; each one then counts as a duplicate.
#[derive(Clone)]
struct Gated(Arc<Semaphore>);

impl MessageHandler for Gated {
    async fn handle(&self, _message: &Message) -> Result<Outcome, HandleError> {
        let permit = self.0.acquire().await.expect("the gate stays open");
        permit.forget();
        Ok(Outcome::Duplicate)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lanes_fetch_only_what_they_handle_at_once() {
    let db = TestDb::new(Backend::Postgres).await;
    let broker = Broker::new().await;
    let book = db.dune(100).await;
    for _ in 0..20 {
        broker.publisher().publish(&placed(book, 1)).await.unwrap();
    }
    let gate = Arc::new(Semaphore::new(0));
    let service = RunningService::start(
        &broker,
        Gated(gate.clone()),
        db.conn.clone(),
        broker.settings(2, 5),
    )
    .await;
    eventually("each lane holding one", || async {
        broker.consumer_state().await.ack_pending == 2
    })
    .await;
    // Past the ack wait (1 s) too: nothing else was fetched, nor handed out again.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let state = broker.consumer_state().await;
    assert_eq!((state.ack_pending, state.pending), (2, 18), "{state:?}");
    gate.add_permits(1_000);
    broker.settled().await;
    service.stop().await;
}

/// Leaves every delivery unacked, as a process that died holding it; counts them.
#[derive(Clone)]
struct DiesHoldingIt(Arc<AtomicUsize>);

impl MessageHandler for DiesHoldingIt {
    async fn handle(&self, _message: &Message) -> Result<Outcome, HandleError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Err(HandleError::Crashed(CrashPoint::BeforeCommit))
    }
}

/// The consumer this service creates has no cap of its own: the server would deliver the
/// message for ever. The service's cap dead-letters the delivery after the last it handles,
/// unhandled, so it ends in the DLQ rather than nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_past_the_services_cap_is_dead_lettered_unhandled() {
    let (db, broker) = one_order().await;
    let handled = Arc::new(AtomicUsize::new(0));
    let service = RunningService::start(
        &broker,
        DiesHoldingIt(handled.clone()),
        db.conn.clone(),
        broker.settings(1, 2),
    )
    .await;
    eventually("a max-deliveries dead letter", || async {
        broker.stream_messages(&broker.topology.dlq_stream).await == 1
    })
    .await;
    broker.settled().await;
    service.stop().await;
    let letters = broker.dead_letters().await;
    assert_eq!(
        letters[0].header(dlq_headers::REASON),
        Some("max-deliveries")
    );
    assert_eq!(letters[0].header(dlq_headers::DELIVERIES), Some("3"));
    assert_eq!(handled.load(Ordering::SeqCst), 2, "the third not handled");
}

/// A consumer made with a cap of its own (before the service owned it, or by hand): the server
/// delivers the message no more after its last delivery, which the process died holding. Its
/// MAX_DELIVERIES advisory brings it to the DLQ through the backstop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_the_server_gave_up_on_is_dead_lettered_by_the_backstop() {
    let (db, broker) = one_order().await;
    let settings = broker.settings(1, 10);
    let stream = broker.js.get_stream(&broker.topology.stream).await.unwrap();
    let capped = ConsumerSettings {
        max_deliver: 2,
        ..settings.consumer.clone()
    };
    jetstream::ensure_consumer(&broker.js, &stream, &capped, false)
        .await
        .unwrap();
    let handled = Arc::new(AtomicUsize::new(0));
    let service = RunningService::start(
        &broker,
        DiesHoldingIt(handled.clone()),
        db.conn.clone(),
        settings,
    )
    .await;
    eventually("the backstop's dead letter", || async {
        broker.stream_messages(&broker.topology.dlq_stream).await == 1
    })
    .await;
    service.stop().await;
    let letters = broker.dead_letters().await;
    assert_eq!(
        letters[0].header(dlq_headers::REASON),
        Some("max-deliveries")
    );
    assert!(
        letters[0]
            .header(dlq_headers::DETAIL)
            .is_some_and(|detail| detail.contains("MAX_DELIVERIES advisory")),
        "{:?}",
        letters[0].header(dlq_headers::DETAIL)
    );
    assert_eq!(handled.load(Ordering::SeqCst), 2);
}

/// Says a batch statement came back short: a bug of this program.
#[derive(Clone)]
struct BreaksAnInvariant;

impl MessageHandler for BreaksAnInvariant {
    async fn handle(&self, _message: &Message) -> Result<Outcome, HandleError> {
        Err(HandleError::Internal("fewer rows than placements"))
    }
}

/// A broken invariant is not the weather: no retry, no dead letter. The lane stops, and the
/// loop with an error (`/livez` 503), for the process to exit and be restarted; the message is
/// left for its ack wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_invariant_fails_the_loop_and_sends_nothing() {
    let (db, broker) = one_order().await;
    let service = RunningService::start(
        &broker,
        BreaksAnInvariant,
        db.conn.clone(),
        broker.settings(2, 5),
    )
    .await;
    let (liveness, stats) = (service.liveness.clone(), service.metrics.clone());
    let ended = tokio::time::timeout(Duration::from_secs(30), service.wait())
        .await
        .expect("the loop ended")
        .expect_err("the loop failed");
    assert!(ended.to_string().contains("broken invariant"), "{ended:#}");
    assert!(liveness.failure().is_some());
    assert_eq!(stats.retried(), 0, "never nak'ed");
    assert_eq!(stats.dead_lettered(), 0);
    assert_eq!(stats.left_for_redelivery(), 1);
    assert_eq!(broker.stream_messages(&broker.topology.dlq_stream).await, 0);
}

/// Panics on its first message, once let go.
#[derive(Clone)]
struct PanicsWhenReleased {
    reached: Arc<Notify>,
    release: Arc<Notify>,
}

impl MessageHandler for PanicsWhenReleased {
    async fn handle(&self, _message: &Message) -> Result<Outcome, HandleError> {
        self.reached.notify_one();
        self.release.notified().await;
        panic!("a bug met while draining");
    }
}

/// The stop looks at every lane's end: a panic while draining fails the loop as one before
/// the stop does, so the process exits with an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_panicking_after_the_stop_fails_the_loop() {
    let (db, broker) = one_order().await;
    let handler = PanicsWhenReleased {
        reached: Arc::new(Notify::new()),
        release: Arc::new(Notify::new()),
    };
    let service = RunningService::start(
        &broker,
        handler.clone(),
        db.conn.clone(),
        broker.settings(2, 5),
    )
    .await;
    handler.reached.notified().await;
    service.shutdown().graceful.cancel();
    handler.release.notify_one();
    let ended = tokio::time::timeout(Duration::from_secs(30), service.wait())
        .await
        .expect("the loop ended")
        .expect_err("the loop failed");
    assert!(ended.to_string().contains("panicked"), "{ended:#}");
}
