//! The service survives its database and its broker going away mid-stream.

use std::sync::atomic::Ordering;
use std::time::Duration;

use inventory_domain::{BookId, Message, StockItem};
use inventory_infra::HandlerKind;
use inventory_infra::db::FreshDatabase;
use inventory_infra::jetstream::OrderPublisher;
use inventory_infra::{NaturalKeyPath, StockRepository};
use inventory_tests::broker::{Broker, RunningService, eventually};
use inventory_tests::nats::NatsServer;
use inventory_tests::pg_server::PostgresServer;
use inventory_tests::{Backend, TestDb, placed};

fn workload(book: BookId, orders: usize) -> (Vec<Message>, i64) {
    let messages: Vec<Message> = (0..orders)
        .map(|i| placed(book, 1 + (i % 4) as i64))
        .collect();
    let expected = (0..orders).map(|i| 1 + (i % 4) as i64).sum();
    (messages, expected)
}

async fn publish_all(publisher: &OrderPublisher, messages: &[Message]) {
    for (i, message) in messages.iter().enumerate() {
        publisher.publish(message).await.unwrap();
        if i % 4 == 0 {
            publisher
                .publish(&message.resent_with_new_id())
                .await
                .unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_stopped_and_restarted_mid_stream_loses_nothing() {
    let mut server = PostgresServer::start().await;
    let fresh = FreshDatabase::create(Some(&server.url()), "inventory_outage", 4)
        .await
        .unwrap();
    let stock = StockRepository::new(fresh.conn.clone());
    let book = BookId::new_v7();
    stock
        .put(&StockItem::new(book, "Dune", 100_000).unwrap())
        .await
        .unwrap();
    let broker = Broker::new().await;
    let (messages, expected) = workload(book, 300);
    publish_all(&broker.publisher(), &messages).await;

    let handler = HandlerKind::NaturalKey(NaturalKeyPath::Orm)
        .build(
            &fresh.conn,
            inventory_domain::ConsumerName::parse("outage").unwrap(),
            None,
        )
        .unwrap();
    let service =
        RunningService::start(&broker, handler, fresh.conn.clone(), broker.settings(4, 50)).await;
    eventually("some messages processed", || async {
        service.stats.acked.load(Ordering::Relaxed) >= 40
    })
    .await;
    server.stop().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        service.is_running(),
        "the service stays up while the database is down"
    );
    server.start_again().await;

    eventually("every order reserved", || async {
        matches!(stock.get(book).await, Ok(Some(item)) if item.reserved == expected)
    })
    .await;
    eventually("nothing pending", || async {
        let state = broker.consumer_state().await;
        state.pending == 0 && state.ack_pending == 0
    })
    .await;
    assert_eq!(service.stats.dead_lettered.load(Ordering::Relaxed), 0);
    assert!(
        service.stats.retried.load(Ordering::Relaxed) > 0,
        "the outage was felt"
    );
    service.stop().await;
    assert_eq!(stock.get(book).await.unwrap().unwrap().reserved, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_stopped_and_restarted_mid_stream_loses_nothing() {
    let mut server = NatsServer::start().await;
    let db = TestDb::new(Backend::Postgres).await;
    let book = db.dune(100_000).await;
    let broker = Broker::on(&server.url()).await;
    let (messages, expected) = workload(book, 300);
    let (first_half, second_half) = messages.split_at(150);
    publish_all(&broker.publisher(), first_half).await;

    let service = RunningService::start(
        &broker,
        db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm)),
        db.conn.clone(),
        broker.settings(4, 50),
    )
    .await;
    eventually("some messages processed", || async {
        service.stats.acked.load(Ordering::Relaxed) >= 40
    })
    .await;
    server.stop().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        service.is_running(),
        "the service stays up while NATS is down"
    );
    server.start_again().await;
    publish_all(&broker.publisher(), second_half).await;

    eventually("every order reserved", || async {
        db.reserved(book).await == expected
    })
    .await;
    eventually("nothing pending", || async {
        let state = broker.consumer_state().await;
        state.pending == 0 && state.ack_pending == 0
    })
    .await;
    assert_eq!(service.stats.dead_lettered.load(Ordering::Relaxed), 0);
    service.stop().await;
    assert_eq!(db.reserved(book).await, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_retried_across_a_broker_restart_is_stored_once() {
    let mut server = NatsServer::start().await;
    let broker = Broker::on(&server.url()).await;
    let publisher = broker.publisher();
    let message = placed(BookId::new_v7(), 2);
    server.stop().await;
    let publishing = tokio::spawn({
        let message = message.clone();
        async move { publisher.publish(&message).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.start_again().await;
    publishing.await.unwrap().unwrap();
    // Whatever attempts reached the server, they all carried the same Nats-Msg-Id.
    broker.publisher().publish(&message).await.unwrap();
    assert_eq!(broker.stream_messages(&broker.topology.stream).await, 1);
}
