//! Test support: a database of its own for every test, on SQLite or PostgreSQL, and real
//! servers a test can stop and start again.
//!
//! # Layout
//! - [`postgres`]: where the shared PostgreSQL server comes from (`DATABASE_URL`, the local
//!   server, or a testcontainers container where a Docker engine runs).
//! - [`pg_server`]: a PostgreSQL server of the test's own, to stop and restart mid-stream, or a
//!   primary and its synchronous standby to fail over.
//! - [`haproxy`]: HAProxy in front of such servers, switched to another over its admin socket,
//!   or following Patroni's primary by health checks.
//! - [`patroni`]: a PostgreSQL HA pair under Patroni (etcd, two nodes, synchronous
//!   replication) behind HAProxy, whose leader a test kills.
//! - [`nats`]: NATS servers of the test's own (one, or a cluster of three) to stop, kill and
//!   restart; the shared NATS server; per-test stream and subject names.
//! - [`binary`]: the `inventory` binary run as a process on a test's database and streams.
//! - [`fault_proxy`]: a TCP proxy between the service and a server that adds latency, cuts
//!   connections (all at once, or right after a commit) and blackholes them.
//! - [`broker`]: a test's own streams on a shared NATS server, and the service loop running
//!   in-process on them.
//! - [`tls`]: a throwaway CA and server certificates for TLS tests.
//! - [`workload`]: orders with the producer's duplicates mixed in, published at a pace, and
//!   the check of the promise after a fault scenario.
//! - [`corpus`]: the hostile-input corpus under `tests/corpus/`, files and generated bodies.
//! - [`outbox`]: outbox rows and the events in a stream, and the check that each event was
//!   stored once and in its order's order.
//! - [`TestDb`]: a fresh database per test, with the fixtures the tests share.
#![expect(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test or benchmark fails by panicking"
)]

pub mod binary;
pub mod broker;
pub mod corpus;
pub mod fault_proxy;
pub mod haproxy;
pub mod nats;
pub mod outbox;
pub mod patroni;
pub mod pg_server;
pub mod postgres;
mod process;
pub mod tls;
pub mod workload;

use inventory_benches::faults;
use inventory_benches::produce::Produce as _;
use inventory_benches::readback::Readback as _;
use std::time::Duration;

use inventory_benches::consumers::{Handler, HandlerKind};
use inventory_benches::fresh::FreshDatabase;
use inventory_benches::mistakes::{Strategy, StudyHandler};
use inventory_domain::{
    BookId, ConsumerName, Message, OrderId, Quantity, StockEvent, StockEventKind, StockItem,
};
use inventory_infra::CrashPoint;
use inventory_infra::db::DatabaseConnection;
use inventory_infra::{Faults, HandleError, MessageHandler, StockRepository};
use sea_orm::{ConnectionTrait, DbBackend, Statement};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// The Redis of `REDIS_URL`, else the local one (`scripts/test.sh` starts it): the demo's cache
/// scenarios run on it.
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| inventory_benches::demo::DEFAULT_REDIS_URL.into())
}

/// A fresh database for one test, removed when the test ends (even by a panic).
pub struct TestDb {
    pub backend: Backend,
    pub conn: DatabaseConnection,
    pub url: String,
    pub stock: StockRepository,
    fresh: Option<FreshDatabase>,
}

/// The consumer name test handlers keep their dedup rows under.
pub const TEST_CONSUMER: &str = "inventory-reserve-stock-test";

fn test_consumer() -> ConsumerName {
    ConsumerName::parse(TEST_CONSUMER).unwrap()
}

impl TestDb {
    pub async fn new(backend: Backend) -> Self {
        Self::labelled(backend, "inventory_test").await
    }

    /// A fresh database whose name starts with `label`, to tell whose it is.
    pub async fn labelled(backend: Backend, label: &str) -> Self {
        let server = match backend {
            Backend::Sqlite => None,
            Backend::Postgres => Some(postgres::server_url().await),
        };
        let fresh = FreshDatabase::create(server.as_deref(), label, 10)
            .await
            .expect("a fresh test database");
        Self {
            backend,
            conn: fresh.conn.clone(),
            url: fresh.url.clone(),
            stock: StockRepository::new(fresh.conn.clone()),
            fresh: Some(fresh),
        }
    }

    /// The events waiting in the outbox, in write order, decoded as a consumer of `INVENTORY`
    /// would decode them.
    pub async fn pending_events(&self) -> Vec<StockEvent> {
        let sql = "SELECT subject, payload FROM outbox ORDER BY seq";
        let rows = self
            .conn
            .query_all_raw(Statement::from_string(
                self.conn.get_database_backend(),
                sql,
            ))
            .await
            .unwrap();
        rows.iter()
            .map(|row| {
                let subject: String = row.try_get("", "subject").unwrap();
                let payload: String = row.try_get("", "payload").unwrap();
                StockEvent::decode(&subject, payload.as_bytes()).unwrap()
            })
            .collect()
    }

    /// A new book titled Dune with `on_hand` copies.
    pub async fn dune(&self, on_hand: i64) -> BookId {
        let book_id = BookId::new_v7();
        self.stock
            .put(&StockItem::new(book_id, "Dune", on_hand).unwrap())
            .await
            .unwrap();
        book_id
    }

    /// The one `int8` `sql` reads from this database (PostgreSQL).
    pub async fn scalar(&self, sql: &str) -> i64 {
        let row = self
            .conn
            .query_one_raw(Statement::from_string(DbBackend::Postgres, sql))
            .await
            .unwrap()
            .unwrap();
        row.try_get_by_index::<i64>(0).unwrap()
    }

    pub async fn reserved(&self, book_id: BookId) -> i64 {
        self.stock.get(book_id).await.unwrap().unwrap().reserved
    }

    /// `kind` on this database, its dedup rows under [`TEST_CONSUMER`].
    pub fn consumer(&self, kind: HandlerKind) -> Handler {
        kind.build(&self.conn, test_consumer(), None).unwrap()
    }

    /// A strategy of the study's (naive, check-then-process) or of the service's on this
    /// database, its dedup rows under [`TEST_CONSUMER`].
    pub fn study_consumer(&self, strategy: impl Into<Strategy>) -> StudyHandler {
        strategy.into().build(&self.conn, test_consumer()).unwrap()
    }

    /// Waits until some session of this database waits for a lock held by another: proof on
    /// PostgreSQL that a concurrent copy is blocked rather than merely slow.
    pub async fn wait_for_lock_waiter(&self) {
        self.wait_for_lock_waiters(1).await;
    }

    /// Waits until `sessions` sessions of this database wait for locks at once: that many
    /// handlers are inside their statements together.
    pub async fn wait_for_lock_waiters(&self, sessions: i64) {
        assert_eq!(self.backend, Backend::Postgres);
        for _ in 0..200 {
            let waiting = self.stock.sessions_waiting_for_a_lock().await.unwrap();
            if waiting >= Some(sessions) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("never {sessions} sessions waiting for a lock at once");
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if let Some(fresh) = self.fresh.take() {
            run_to_end_from_drop(async move {
                let _ = fresh.remove().await;
            });
        }
    }
}

/// Runs async clean-up from a `Drop`, which has no runtime to await on: on a thread of its
/// own with a runtime of its own, waiting for it to finish.
pub(crate) fn run_to_end_from_drop(work: impl Future<Output = ()> + Send + 'static) {
    let _ = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map(|runtime| runtime.block_on(work))
    })
    .join();
}

/// The natural key on `db` as a shard of an orders stream of `partitions` partitions: it decides
/// only the partitions `db`'s `partition_owner` holds active.
pub fn on_shard(db: &TestDb, partitions: std::num::NonZeroU32) -> inventory_infra::NaturalKey {
    inventory_infra::NaturalKey::new(&db.conn, ConsumerName::parse("shard-test").unwrap())
        .on_shard(partitions)
        .expect("PostgreSQL can be a shard")
}

/// Handles `message` with the handler `with_faults` makes to die once at `point`, and checks
/// that the crash came back as the error: where the redelivery tests start.
pub async fn crash_at<H: MessageHandler>(
    message: &Message,
    point: CrashPoint,
    with_faults: impl FnOnce(Faults) -> H,
) {
    let result = with_faults(faults::crash_once_at(point))
        .handle(message)
        .await;
    assert!(
        matches!(result, Err(HandleError::Crashed(at)) if at == point),
        "expected a crash at {point:?}, got {result:?}"
    );
}

pub fn placed(book_id: BookId, quantity: i64) -> Message {
    placed_for(OrderId::new_v7(), book_id, quantity)
}

pub fn placed_for(order_id: OrderId, book_id: BookId, quantity: i64) -> Message {
    Message::placed(order_id, book_id, Quantity::new(quantity).unwrap())
}

/// Inventory's StockReserved event for a new order of `quantity` copies of `book_id`, as the
/// email notifier receives it.
pub fn stock_reserved(book_id: BookId, quantity: i64) -> Message {
    Message::stock_reserved(&StockEvent::new(
        StockEventKind::Reserved,
        OrderId::new_v7(),
        book_id,
        Quantity::new(quantity).unwrap(),
        "a placement",
    ))
}

/// Runs a test body once on SQLite and once on PostgreSQL, each with a fresh database.
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn sqlite() {
                    super::$name($crate::TestDb::new($crate::Backend::Sqlite).await).await
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn postgres() {
                    super::$name($crate::TestDb::new($crate::Backend::Postgres).await).await
                }
            }
        )*
    };
}
