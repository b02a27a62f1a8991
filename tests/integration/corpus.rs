//! The hostile-input corpus through the real consumer loop and real NATS, under every handler
//! a user can choose for the stock on each backend: on PostgreSQL the one statement (`serve`'s
//! default there), the batch statement (`--batch-size`), the ORM natural key and the inbox; on
//! SQLite the ORM natural key and the inbox (the statements are PostgreSQL's only). Each message
//! gets its dead-letter reason, the service keeps running, and the database is unchanged by
//! all of them.
//!
//! NATS refuses bodies over its `max_payload` (1 MB by default) at publish time, so on a
//! default server a multi-megabyte body never reaches a consumer. The corpus runs on a server
//! of its own with `max_payload: 8MB`, so the service's own limit (64 KiB, checked before
//! parsing) is what stops it. One such server per test; each handler runs on streams of its own.

use std::collections::BTreeMap;

use inventory_benches::consumers::{DetectMode, HandlerKind, NaturalKeyPath};
use inventory_domain::{BookId, OrderId, StockItem};
use inventory_infra::jetstream::dlq_headers;
use inventory_tests::broker::{Broker, RunningService, eventually};
use inventory_tests::corpus::{self, Entry};
use inventory_tests::nats::NatsServer;
use inventory_tests::workload::{settle, stream_state};
use inventory_tests::{Backend, TestDb, placed_for};
use sea_orm::{ConnectionTrait, DbBackend, Statement};

/// Every row of the tables a message can touch, each as text, sorted.
async fn snapshot(db: &TestDb) -> BTreeMap<&'static str, Vec<String>> {
    let backend = db.conn.get_database_backend();
    let mut tables = BTreeMap::new();
    for table in [
        "stock_items",
        "stock_reservations",
        "inbox",
        "order_states",
        "reservation_log",
    ] {
        let row_text = match backend {
            DbBackend::Postgres => format!("{table}::text"),
            // SQLite has no row-to-text cast: quote() every column, joined.
            _ => {
                let columns = db
                    .conn
                    .query_all_raw(Statement::from_string(
                        backend,
                        format!("SELECT name FROM pragma_table_info('{table}')"),
                    ))
                    .await
                    .unwrap();
                columns
                    .iter()
                    .map(|column| {
                        format!("quote({})", column.try_get::<String>("", "name").unwrap())
                    })
                    .collect::<Vec<_>>()
                    .join(" || ',' || ")
            }
        };
        let rows = db
            .conn
            .query_all_raw(Statement::from_string(
                backend,
                format!("SELECT {row_text} AS row_text FROM {table}"),
            ))
            .await
            .unwrap();
        let mut rows: Vec<String> = rows
            .iter()
            .map(|row| row.try_get::<String>("", "row_text").unwrap())
            .collect();
        rows.sort();
        tables.insert(table, rows);
    }
    tables
}

/// Runs the corpus through `strategy` on a fresh database of `backend`, on streams of its own
/// on `server`.
async fn corpus_through_the_service(server: &NatsServer, backend: Backend, strategy: HandlerKind) {
    let entries = corpus::load();
    assert!(entries.len() >= 40, "the corpus has {}", entries.len());
    let broker = Broker::on(&server.url()).await;
    let db = TestDb::new(backend).await;
    let book: BookId = corpus::KNOWN_BOOK.parse().unwrap();
    db.stock
        .put(&StockItem::new(book, "Dune", 10).unwrap())
        .await
        .unwrap();
    let mut settings = broker.settings(4, 5);
    // What `serve --batch-size 16` runs; the other handlers take one message at a time.
    if strategy.takes_batches() {
        settings.batch_size = 16;
    }
    let baseline = RunningService::start(
        &broker,
        db.consumer(strategy),
        db.conn.clone(),
        settings.clone(),
    )
    .await;
    broker
        .publish_raw("placed", corpus::baseline(), Some("corpus:baseline"))
        .await;
    eventually("the baseline reserved", || async {
        db.reserved(book).await == corpus::BASE_QUANTITY
    })
    .await;
    baseline.stop().await;
    let before = snapshot(&db).await;

    for entry in &entries {
        broker
            .publish_raw(
                &entry.subject_token,
                entry.body.clone(),
                Some(&format!("corpus:{}", entry.name)),
            )
            .await;
    }
    // Started on a full stream, so the lanes hand the batch handler whole batches of it.
    let service =
        RunningService::start(&broker, db.consumer(strategy), db.conn.clone(), settings).await;
    let total = 1 + entries.len() as u64;
    let state = settle(
        &broker.js,
        &broker.topology,
        &broker.consumer_name,
        total,
        std::time::Duration::from_secs(60),
    )
    .await;
    assert_eq!(state.stream_messages, total, "every body was stored");
    assert!(service.is_running(), "the service survived the corpus");
    assert_eq!(
        snapshot(&db).await,
        before,
        "{}: the corpus changed the database",
        strategy.label()
    );

    let letters = broker.dead_letters().await;
    let by_name: BTreeMap<&str, &Entry> = entries.iter().map(|e| (e.name.as_str(), e)).collect();
    let mut wrong = Vec::new();
    let mut seen = BTreeMap::new();
    for letter in &letters {
        let id = letter.header(dlq_headers::ORIGINAL_MSG_ID).unwrap();
        let name = id.strip_prefix("corpus:").unwrap();
        let entry = by_name
            .get(name)
            .unwrap_or_else(|| panic!("a dead letter for {id}, which is not in the corpus"));
        *seen.entry(name).or_insert(0) += 1;
        let expected = match strategy {
            HandlerKind::NaturalKey(_) => &entry.natural_reason,
            _ => &entry.inbox_reason,
        };
        let reason = letter.header(dlq_headers::REASON).unwrap();
        if reason != expected {
            wrong.push(format!(
                "{name} ({}): {reason} ({}), expected {expected}",
                entry.what,
                letter.header(dlq_headers::DETAIL).unwrap_or("")
            ));
        }
        assert_eq!(letter.body, entry.body, "{name}: the original body is kept");
    }
    assert!(
        wrong.is_empty(),
        "{}: wrong reasons:\n{}",
        strategy.label(),
        wrong.join("\n")
    );
    let missing: Vec<&str> = by_name
        .keys()
        .filter(|name| !seen.contains_key(*name))
        .copied()
        .collect();
    assert!(
        missing.is_empty(),
        "{}: no dead letter for {missing:?}",
        strategy.label()
    );
    assert!(
        seen.values().all(|&n| n == 1),
        "one dead letter each: {seen:?}"
    );
    // Each dead letter was stored once before its original was terminated: first try.
    assert_eq!(service.metrics.retried(), 0);
    assert_eq!(
        service.metrics.left_for_redelivery(),
        0,
        "{}: every message settled on its first delivery",
        strategy.label()
    );
    assert_eq!(
        stream_state(&broker.js, &broker.topology, &broker.consumer_name)
            .await
            .unwrap()
            .redelivered,
        0
    );

    // And it goes on consuming.
    broker
        .publisher()
        .publish(&placed_for(OrderId::new_v7(), book, 1))
        .await
        .unwrap();
    eventually("an order after the corpus reserved", || async {
        db.reserved(book).await == corpus::BASE_QUANTITY + 1
    })
    .await;
    service.stop().await;
}

/// The handlers of `backend` one after another on one server: a run is a few seconds, and
/// running them at once only makes them compete for the same two cores.
async fn corpus_under(backend: Backend, strategies: &[HandlerKind]) {
    let server = NatsServer::start_with_config("max_payload: 8MB\n").await;
    for &strategy in strategies {
        corpus_through_the_service(&server, backend, strategy).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_corpus_is_dead_lettered_under_every_postgres_handler_and_changes_nothing() {
    corpus_under(
        Backend::Postgres,
        &[
            HandlerKind::NaturalKey(NaturalKeyPath::OneStatement),
            HandlerKind::NaturalKey(NaturalKeyPath::Batch),
            HandlerKind::NaturalKey(NaturalKeyPath::Orm),
            HandlerKind::Inbox(DetectMode::OnConflict),
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_corpus_is_dead_lettered_under_every_sqlite_handler_and_changes_nothing() {
    corpus_under(
        Backend::Sqlite,
        &[
            HandlerKind::NaturalKey(NaturalKeyPath::OneStatement),
            HandlerKind::NaturalKey(NaturalKeyPath::Batch),
            HandlerKind::NaturalKey(NaturalKeyPath::Orm),
            HandlerKind::Inbox(DetectMode::OnConflict),
        ],
    )
    .await;
}
