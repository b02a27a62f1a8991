//! The service survives its database and its broker going away mid-stream.

use inventory_benches::produce::Produce as _;
use std::time::Duration;

use inventory_benches::consumers::{HandlerKind, NaturalKeyPath};
use inventory_benches::publish::OrderPublisher;
use inventory_domain::{BookId, Message};
use inventory_infra::db::DatabaseConnection;
use inventory_infra::jetstream;
use inventory_tests::broker::{Broker, RunningService, eventually};
use inventory_tests::nats::NatsServer;
use inventory_tests::{Backend, TestDb, placed};
use sea_orm::{ConnectionTrait, DbBackend, Statement};

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

/// Longer than the whole retry budget of [`MAX_DELIVER`] deliveries (a 50 ms nak, a 1 s ack
/// wait): a loop that went on fetching while the database is down would dead-letter messages
/// as `max-deliveries`.
const OUTAGE: Duration = Duration::from_secs(4);
const MAX_DELIVER: i64 = 2;

/// A test database cut off as a failing network or a restarting server does: its sessions
/// closed and new ones refused at once. (A stopped server is not enough: sqlx retries a
/// refused TCP connection for the whole acquire timeout, so every attempt outlasts the retry
/// budget whether or not the loop keeps fetching.)
struct Cut {
    admin: DatabaseConnection,
    name: String,
}

impl Cut {
    async fn new(db: &TestDb) -> Self {
        let row = db
            .conn
            .query_one_raw(Statement::from_string(
                DbBackend::Postgres,
                "SELECT current_database() AS name",
            ))
            .await
            .unwrap()
            .unwrap();
        let admin =
            inventory_benches::db::connect(&inventory_tests::postgres::server_url().await, 1)
                .await
                .unwrap();
        Self {
            admin,
            name: row.try_get("", "name").unwrap(),
        }
    }

    async fn allow_connections(&self, allow: bool) {
        let name = &self.name;
        self.admin
            .execute_unprepared(&format!(
                "ALTER DATABASE \"{name}\" WITH ALLOW_CONNECTIONS {allow}"
            ))
            .await
            .unwrap();
        if !allow {
            self.admin
                .execute_unprepared(&format!(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'"
                ))
                .await
                .unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_cut_off_longer_than_the_retry_budget_loses_and_dead_letters_nothing() {
    let db = TestDb::new(Backend::Postgres).await;
    let book = db.dune(100_000).await;
    let broker = Broker::new().await;
    let (messages, expected) = workload(book, 300);
    publish_all(&broker.publisher(), &messages).await;

    let service = RunningService::start(
        &broker,
        db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm)),
        db.conn.clone(),
        broker.settings(10, MAX_DELIVER),
    )
    .await;
    eventually("some messages processed", || async {
        service.metrics.acked() >= 40
    })
    .await;
    let cut = Cut::new(&db).await;
    cut.allow_connections(false).await;
    // The outage itself, not a wait for something to happen.
    tokio::time::sleep(OUTAGE).await;
    assert!(
        service.is_running(),
        "the service stays up while the database is down"
    );
    cut.allow_connections(true).await;

    eventually("every order reserved", || async {
        db.reserved(book).await == expected
    })
    .await;
    broker.settled().await;
    let dead_letters = broker.dead_letters().await;
    assert!(
        dead_letters.is_empty(),
        "dead-lettered during the outage: {:?}",
        dead_letters
            .iter()
            .map(|letter| letter.header("Dlq-Reason"))
            .collect::<Vec<_>>()
    );
    assert!(service.metrics.retried() > 0, "the outage was felt");
    service.stop().await;
    assert_eq!(db.reserved(book).await, expected);
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
        service.metrics.acked() >= 40
    })
    .await;
    server.stop().await;
    eventually("the service's client sees NATS gone", || async {
        !jetstream::is_connected(&broker.client)
    })
    .await;
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
    broker.settled().await;
    assert_eq!(service.metrics.dead_lettered(), 0);
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
    eventually("the client sees NATS gone", || async {
        !jetstream::is_connected(&broker.client)
    })
    .await;
    let (started, publish_started) = tokio::sync::oneshot::channel();
    let publishing = tokio::spawn({
        let message = message.clone();
        async move {
            let _ = started.send(());
            publisher.publish(&message).await
        }
    });
    // The publish is under way against a server that is down before it comes back.
    publish_started.await.unwrap();
    server.start_again().await;
    publishing.await.unwrap().unwrap();
    // Whatever attempts reached the server, they all carried the same Nats-Msg-Id.
    broker.publisher().publish(&message).await.unwrap();
    assert_eq!(broker.stream_messages(&broker.topology.stream).await, 1);
}
