//! The retention purge under load on PostgreSQL: completed inbox rows deleted in batches while
//! the consumer handles messages. Each batch is its own short transaction, so no message waits
//! for the whole purge, and nothing inside the retention is deleted. How fast it purges and
//! what it costs the consumer is measured in docs/benchmarks.md, not asserted here.

use inventory_benches::consumers::{DetectMode, HandlerKind};
use inventory_benches::purge::purge_completed;
use inventory_tests::broker::{Broker, RunningService, eventually};
use inventory_tests::{Backend, TestDb, placed};
use sea_orm::{ConnectionTrait, DbBackend, Statement, TransactionTrait};

const SEEDED: u64 = 20_000;
const BATCH: u64 = 1_000;
const RECENT: i64 = 500;
const FLOWING: i64 = 20;

async fn count(db: &TestDb, filter: &str) -> i64 {
    let row = db
        .conn
        .query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            format!("SELECT count(*) FROM inbox WHERE {filter}"),
        ))
        .await
        .unwrap()
        .unwrap();
    row.try_get_by_index(0).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_purge_commits_batch_by_batch_while_messages_flow_and_keeps_the_retention() {
    let db = TestDb::new(Backend::Postgres).await;
    // Completed a month ago, one millisecond apart; and rows completed an hour ago, inside the
    // one-day retention.
    db.conn
        .execute_unprepared(&format!(
            "INSERT INTO inbox (message_id, consumer, received_at, completed_at, payload_hash) \
             SELECT 'old-' || g, 'inventory-reserve-stock-inbox', \
                    now() - interval '31 days', \
                    now() - interval '30 days' + g * interval '1 millisecond', \
                    repeat('0', 64) \
             FROM generate_series(1, {SEEDED}) AS g; \
             INSERT INTO inbox (message_id, consumer, received_at, completed_at, payload_hash) \
             SELECT 'recent-' || g, 'inventory-reserve-stock-inbox', \
                    now() - interval '2 hours', now() - interval '1 hour', repeat('0', 64) \
             FROM generate_series(1, {RECENT}) AS g; ANALYZE inbox"
        ))
        .await
        .unwrap();
    let broker = Broker::new().await;
    let book = db.dune(1_000).await;
    let handler = db.consumer(HandlerKind::Inbox(DetectMode::OnConflict));
    let service =
        RunningService::start(&broker, handler, db.conn.clone(), broker.settings(4, 5)).await;

    // The first row of the third batch (the oldest first) locked from elsewhere: the purge
    // stops there, after two batches. (By its id: FOR UPDATE would lock rows an OFFSET skips.)
    let holder = db.conn.begin().await.unwrap();
    holder
        .execute_unprepared(&format!(
            "SELECT 1 FROM inbox WHERE message_id = 'old-{}' FOR UPDATE",
            2 * BATCH + 1
        ))
        .await
        .unwrap();
    let cutoff = chrono::Utc::now() - chrono::Duration::days(1);
    let purge = tokio::spawn({
        let conn = db.conn.clone();
        async move {
            purge_completed(&conn, "inventory-reserve-stock-inbox", cutoff, BATCH, false)
                .await
                .unwrap()
        }
    });
    db.wait_for_lock_waiter().await;

    // The two batches before it are committed, seen from another session: one transaction per
    // batch, not one for the whole purge.
    let left = i64::try_from(SEEDED - 2 * BATCH).unwrap();
    assert_eq!(count(&db, "message_id LIKE 'old-%'").await, left);
    // Messages flow while the purge is under way: handled, their inbox rows written.
    let publisher = broker.publisher();
    for _ in 0..FLOWING {
        publisher.publish(&placed(book, 1)).await.unwrap();
    }
    eventually("every message handled during the purge", || async {
        db.reserved(book).await == FLOWING
    })
    .await;
    assert!(!purge.is_finished(), "the purge ended while held");

    holder.rollback().await.unwrap();
    let report = purge.await.unwrap();
    service.stop().await;
    assert_eq!(report.deleted, SEEDED);
    assert_eq!(report.batches, SEEDED / BATCH + 1);
    assert!(!report.skipped_locked);
    // Nothing inside the retention purged: the recent rows and the flowing messages' own.
    assert_eq!(count(&db, "message_id LIKE 'old-%'").await, 0);
    assert_eq!(count(&db, "message_id LIKE 'recent-%'").await, RECENT);
    assert_eq!(
        count(
            &db,
            "message_id NOT LIKE 'old-%' AND message_id NOT LIKE 'recent-%'"
        )
        .await,
        FLOWING
    );
}
