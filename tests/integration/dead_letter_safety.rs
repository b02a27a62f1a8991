//! A dead letter is never lost and never stored twice: the original is terminated only once the
//! dead-letter stream stored its copy, a process that died between the two stores no second
//! copy when the original comes back, a replay that died between its publish and its delete
//! is stored once, and a replay the orders stream did not store leaves its dead letter there.

use async_nats::jetstream::consumer::PullConsumer;
use futures::StreamExt;
use inventory_benches::consumers::{HandlerKind, NaturalKeyPath};
use inventory_domain::{BookId, DeadLetterReason, EventKind};
use inventory_infra::delivery;
use inventory_infra::jetstream::{self, dlq_headers};
use inventory_service::dlq::{self, ReplayOptions, Selection};
use inventory_tests::broker::{Broker, RunningService, eventually};
use inventory_tests::{Backend, TestDb, placed};

/// The natural key consuming the test's stream on one lane, `max_deliver` deliveries a message.
async fn natural_key_service(db: &TestDb, broker: &Broker, max_deliver: i64) -> RunningService {
    RunningService::start(
        broker,
        db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm)),
        db.conn.clone(),
        broker.settings(1, max_deliver),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_that_died_after_storing_the_dead_letter_stores_no_second_copy() {
    let db = TestDb::new(Backend::Postgres).await;
    let broker = Broker::new().await;
    broker
        .publish_raw("placed", &b"{not json"[..], Some("poison-1"))
        .await;
    broker.consumer(5).await;

    // What the loop does up to the crash: the dead letter stored, the original not terminated.
    let stream = broker.js.get_stream(&broker.topology.stream).await.unwrap();
    let consumer: PullConsumer = stream.get_consumer(&broker.consumer_name).await.unwrap();
    let mut batch = consumer.fetch().max_messages(1).messages().await.unwrap();
    let first = batch.next().await.unwrap().unwrap();
    let origin = delivery::origin(&first).unwrap();
    broker
        .dead_letter_publisher()
        .publish(
            &origin,
            first.headers.as_ref(),
            first.payload.clone(),
            DeadLetterReason::Malformed,
            "stored before the process died",
        )
        .await
        .unwrap();
    drop(first);

    // The next instance gets it again after the ack wait and dead-letters it as usual.
    let service = natural_key_service(&db, &broker, 5).await;
    eventually("the redelivery dead-lettered", || async {
        service.metrics.dead_lettered() == 1
    })
    .await;
    broker.settled().await;
    let letters = broker.dead_letters().await;
    assert_eq!(letters.len(), 1, "one copy in the dead-letter stream");
    assert_eq!(letters[0].header(dlq_headers::DELIVERIES), Some("1"));
    service.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_original_is_terminated_only_once_its_dead_letter_is_stored() {
    let db = TestDb::new(Backend::Postgres).await;
    let broker = Broker::new().await;
    let service = natural_key_service(&db, &broker, 50).await;
    // No dead-letter stream (the service made one at start): storing a dead letter fails until
    // it is back.
    broker
        .js
        .delete_stream(&broker.topology.dlq_stream)
        .await
        .unwrap();
    let unknown = BookId::new_v7();
    broker
        .publisher()
        .publish(&placed(unknown, 2))
        .await
        .unwrap();
    eventually("the refusal retried, not terminated", || async {
        service.metrics.retried() >= 2
    })
    .await;
    assert_eq!(service.metrics.dead_lettered(), 0);
    let state = broker.consumer_state().await;
    assert_eq!(
        state.pending + u64::try_from(state.ack_pending).unwrap(),
        1,
        "the original is still the consumer's"
    );

    jetstream::ensure_streams(&broker.js, &broker.topology)
        .await
        .unwrap();
    eventually("dead-lettered once the stream is back", || async {
        service.metrics.dead_lettered() == 1
    })
    .await;
    broker.settled().await;
    let letters = broker.dead_letters().await;
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].header(dlq_headers::REASON), Some("unknown-book"));
    service.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_that_died_between_its_publish_and_its_delete_is_stored_once() {
    let db = TestDb::new(Backend::Postgres).await;
    let broker = Broker::new().await;
    let unknown = BookId::new_v7();
    broker
        .publisher()
        .publish(&placed(unknown, 2))
        .await
        .unwrap();
    let service = natural_key_service(&db, &broker, 5).await;
    eventually("dead-lettered", || async {
        service.metrics.dead_lettered() == 1
    })
    .await;
    service.stop().await;
    let stored_before = broker.stream_messages(&broker.topology.stream).await;

    // The first replay published and died before deleting the dead letter: the replay's own
    // publish, done here, is what it had done.
    let letters = dlq::list(&broker.js, &broker.topology, None).await.unwrap();
    let mut headers = async_nats::HeaderMap::new();
    for (name, value) in letters[0].original_headers() {
        headers.insert(name, value);
    }
    let publish = async_nats::jetstream::message::PublishMessage::build()
        .headers(headers)
        .message_id(letters[0].replay_message_id())
        .payload(letters[0].body.clone());
    broker
        .js
        .send_publish(broker.topology.subject(EventKind::Placed), publish)
        .await
        .unwrap()
        .await
        .unwrap();

    let report = dlq::replay(
        &broker.js,
        &broker.topology,
        &Selection::Sequences(vec![letters[0].seq]),
        ReplayOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(report.replayed.len(), 1);
    assert!(
        report.replayed[0].duplicate,
        "the retried replay is the one stored"
    );
    assert_eq!(
        broker.stream_messages(&broker.topology.stream).await,
        stored_before + 1,
        "one replay in the orders stream"
    );
    assert!(
        dlq::list(&broker.js, &broker.topology, None)
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_the_orders_stream_cannot_store_keeps_its_dead_letter() {
    let db = TestDb::new(Backend::Postgres).await;
    let broker = Broker::new().await;
    broker
        .publisher()
        .publish(&placed(BookId::new_v7(), 2))
        .await
        .unwrap();
    let service = natural_key_service(&db, &broker, 5).await;
    eventually("dead-lettered", || async {
        service.metrics.dead_lettered() == 1
    })
    .await;
    service.stop().await;

    // No orders stream: the replay's publish is refused, so the dead letter must stay.
    broker
        .js
        .delete_stream(&broker.topology.stream)
        .await
        .unwrap();
    let letters = dlq::list(&broker.js, &broker.topology, None).await.unwrap();
    let selection = Selection::Sequences(vec![letters[0].seq]);
    assert!(
        dlq::replay(
            &broker.js,
            &broker.topology,
            &selection,
            ReplayOptions::default()
        )
        .await
        .is_err(),
        "a replay nothing stored"
    );
    assert_eq!(
        dlq::list(&broker.js, &broker.topology, None)
            .await
            .unwrap()
            .len(),
        1,
        "the dead letter is kept while its replay is not stored"
    );

    // Once the stream is back the same replay goes through and removes it.
    jetstream::ensure_streams(&broker.js, &broker.topology)
        .await
        .unwrap();
    let report = dlq::replay(
        &broker.js,
        &broker.topology,
        &selection,
        ReplayOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(report.replayed.len(), 1);
    assert_eq!(broker.stream_messages(&broker.topology.stream).await, 1);
    assert!(
        dlq::list(&broker.js, &broker.topology, None)
            .await
            .unwrap()
            .is_empty()
    );
}
