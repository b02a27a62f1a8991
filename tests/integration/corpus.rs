//! The hostile-input corpus through the real consumer loop, real NATS and PostgreSQL: each
//! message gets its dead-letter reason, the service keeps running, and the database is
//! unchanged by all of them.
//!
//! NATS refuses bodies over its `max_payload` (1 MB by default) at publish time, so on a
//! default server a multi-megabyte body never reaches a consumer. The corpus runs on a server
//! of its own with `max_payload: 8MB`, so the service's own limit (64 KiB, checked before
//! parsing) is what stops it.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use inventory_domain::{BookId, OrderId, StockItem};
use inventory_infra::jetstream::dlq_headers;
use inventory_infra::{DetectMode, HandlerKind, NaturalKeyPath};
use inventory_tests::broker::{Broker, RunningService, eventually};
use inventory_tests::corpus::{self, Entry};
use inventory_tests::nats::NatsServer;
use inventory_tests::workload::{settle, stream_state};
use inventory_tests::{Backend, TestDb, placed_for};
use sea_orm::{ConnectionTrait, DbBackend, Statement};

/// Every row of the tables a message can touch, as JSON text, in a stable order.
async fn snapshot(db: &TestDb) -> BTreeMap<&'static str, String> {
    let mut tables = BTreeMap::new();
    for table in [
        "stock_items",
        "stock_reservations",
        "inbox",
        "order_states",
        "reservation_log",
    ] {
        let row = db
            .conn
            .query_one_raw(Statement::from_string(
                DbBackend::Postgres,
                format!(
                    "SELECT coalesce(json_agg(t ORDER BY t::text), '[]')::text AS rows FROM {table} t"
                ),
            ))
            .await
            .unwrap()
            .unwrap();
        tables.insert(table, row.try_get::<String>("", "rows").unwrap());
    }
    tables
}

async fn corpus_through_the_service(strategy: HandlerKind) {
    let entries = corpus::load();
    assert!(entries.len() >= 40, "the corpus has {}", entries.len());
    let server = NatsServer::start_with_config("max_payload: 8MB\n").await;
    let broker = Broker::on(&server.url()).await;
    let db = TestDb::new(Backend::Postgres).await;
    let book: BookId = corpus::KNOWN_BOOK.parse().unwrap();
    db.stock
        .put(&StockItem::new(book, "Dune", 10).unwrap())
        .await
        .unwrap();
    let service = RunningService::start(
        &broker,
        db.consumer(strategy),
        db.conn.clone(),
        broker.settings(4, 5),
    )
    .await;
    broker
        .publish_raw("placed", corpus::baseline(), Some("corpus:baseline"))
        .await;
    eventually("the baseline reserved", || async {
        db.reserved(book).await == corpus::BASE_QUANTITY
    })
    .await;
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
        "the corpus changed the database"
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
            HandlerKind::NaturalKey(NaturalKeyPath::Orm) => &entry.natural_reason,
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
    assert!(wrong.is_empty(), "wrong reasons:\n{}", wrong.join("\n"));
    let missing: Vec<&str> = by_name
        .keys()
        .filter(|name| !seen.contains_key(*name))
        .copied()
        .collect();
    assert!(missing.is_empty(), "no dead letter for {missing:?}");
    assert!(
        seen.values().all(|&n| n == 1),
        "one dead letter each: {seen:?}"
    );
    // Each dead letter was stored once before its original was terminated: first try.
    assert_eq!(service.stats.retried.load(Ordering::Relaxed), 0);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_corpus_is_dead_lettered_under_the_natural_key_and_changes_nothing() {
    corpus_through_the_service(HandlerKind::NaturalKey(NaturalKeyPath::Orm)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_corpus_is_dead_lettered_under_the_inbox_and_changes_nothing() {
    corpus_through_the_service(HandlerKind::Inbox(DetectMode::OnConflict)).await;
}
