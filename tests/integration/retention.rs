//! Retention of inbox rows: bounded batches, processing rows kept.

use chrono::{Duration, Utc};
use inventory_benches::consumers::{DetectMode, EmailConsumer, HandlerKind};
use inventory_benches::faults;
use inventory_benches::mail::InMemoryEmailProvider;
use inventory_benches::purge::purge_completed;
use inventory_benches::readback::Readback as _;
use inventory_domain::ConsumerName;
use inventory_infra::CrashPoint;
use inventory_tests::broker::eventually;
use inventory_tests::{Backend, TestDb, on_both_backends, placed, stock_reserved};
use sea_orm::{ConnectionTrait, TransactionTrait};

async fn purge_deletes_completed_rows_in_batches_and_keeps_processing_ones(db: TestDb) {
    let book = db.dune(1_000).await;
    let consumer = db.consumer(HandlerKind::Inbox(DetectMode::OnConflict));
    let mut keys = Vec::new();
    for _ in 0..25 {
        let message = placed(book, 1);
        consumer.handle(&message).await.unwrap();
        keys.push(message.key.storage_key().into_owned());
    }
    let email = EmailConsumer::new(
        db.conn.clone(),
        ConsumerName::parse("emails").unwrap(),
        InMemoryEmailProvider::default(),
    );
    let stuck = stock_reserved(book, 1);
    let _ = email
        .with_faults(faults::crash_once_at(CrashPoint::AfterSend))
        .handle(&stuck)
        .await;
    let sent = stock_reserved(book, 2);
    assert!(email.handle(&sent).await.unwrap().processed());
    let name = consumer.consumer().as_str();

    let nothing_is_old =
        purge_completed(&db.conn, name, Utc::now() - Duration::hours(1), 10, false)
            .await
            .unwrap();
    assert_eq!(
        (nothing_is_old.deleted, nothing_is_old.processing_older),
        (0, 0)
    );

    let later = Utc::now() + Duration::hours(1);
    let dry = purge_completed(&db.conn, name, later, 10, true)
        .await
        .unwrap();
    assert_eq!((dry.deleted, dry.processing_older), (25, 0));
    assert!(
        db.stock
            .inbox_entry(&keys[0], name)
            .await
            .unwrap()
            .is_some()
    );

    let report = purge_completed(&db.conn, name, later, 10, false)
        .await
        .unwrap();
    assert_eq!(report.deleted, 25);
    assert_eq!(report.batches, 3);
    assert_eq!(report.processing_older, 0);
    for key in &keys {
        assert_eq!(db.stock.inbox_entry(key, name).await.unwrap(), None);
    }
    // One consumer's purge leaves another's rows, whose horizon it did not check.
    let other = db
        .stock
        .inbox_entry(&sent.key.storage_key(), "emails")
        .await
        .unwrap();
    assert!(other.is_some_and(|entry| entry.completed));
    let emails = purge_completed(&db.conn, "emails", later, 10, false)
        .await
        .unwrap();
    assert_eq!((emails.deleted, emails.processing_older), (1, 1));
    let kept = db
        .stock
        .inbox_entry(&stuck.key.storage_key(), "emails")
        .await
        .unwrap()
        .expect("the processing row is kept");
    assert!(!kept.completed);
}

on_both_backends!(purge_deletes_completed_rows_in_batches_and_keeps_processing_ones);

const SEEDED_CONSUMER: &str = "inventory-reserve-stock-inbox";

/// Completed inbox rows a month old, as many purges would find them.
async fn seed_completed(db: &TestDb, rows: u64) {
    db.conn
        .execute_unprepared(&format!(
            "INSERT INTO inbox (message_id, consumer, received_at, completed_at, payload_hash) \
             SELECT 'seed-' || g, '{SEEDED_CONSUMER}', \
                    now() - interval '31 days', \
                    now() - interval '30 days' + g * interval '1 millisecond', \
                    repeat('0', 64) \
             FROM generate_series(1, {rows}) AS g"
        ))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_purging_at_once_leave_it_to_one_and_the_others_skip() {
    let db = TestDb::new(Backend::Postgres).await;
    seed_completed(&db, 30).await;
    // The oldest row locked from elsewhere: the first purger stops inside its first batch,
    // holding whatever it holds, while the others start.
    let holder = db.conn.begin().await.unwrap();
    holder
        .execute_unprepared("SELECT 1 FROM inbox ORDER BY completed_at LIMIT 1 FOR UPDATE")
        .await
        .unwrap();
    let cutoff = Utc::now() - Duration::days(1);
    let purge = |conn: sea_orm::DatabaseConnection| {
        tokio::spawn(async move {
            purge_completed(&conn, SEEDED_CONSUMER, cutoff, 10, false)
                .await
                .unwrap()
        })
    };
    let first = purge(db.conn.clone());
    db.wait_for_lock_waiter().await;
    let others = [purge(db.conn.clone()), purge(db.conn.clone())];
    eventually("the other purges over while the first is held", || async {
        others.iter().all(tokio::task::JoinHandle::is_finished)
    })
    .await;
    for other in others {
        let report = other.await.unwrap();
        assert!(report.skipped_locked, "{report:?}");
        assert_eq!(report.deleted, 0);
    }
    assert!(!first.is_finished());
    holder.rollback().await.unwrap();
    let report = first.await.unwrap();
    assert!(!report.skipped_locked);
    assert_eq!((report.deleted, report.batches), (30, 4));
}
