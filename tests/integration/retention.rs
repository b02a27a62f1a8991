//! Retention of inbox rows: bounded batches, processing rows kept.

use chrono::{Duration, Utc};
use inventory_domain::{ConsumerName, CrashPoint};
use inventory_infra::retention::purge_completed;
use inventory_infra::{DetectMode, EmailConsumer, Faults, HandlerKind, InMemoryEmailProvider};
use inventory_tests::{TestDb, on_both_backends, placed};

async fn purge_deletes_completed_rows_in_batches_and_keeps_processing_ones(db: TestDb) {
    let book = db.dune(1_000).await;
    let consumer = db.consumer(HandlerKind::Inbox(DetectMode::OnConflict));
    let mut keys = Vec::new();
    for _ in 0..25 {
        let message = placed(book, 1);
        consumer.handle(&message).await.unwrap();
        keys.push(message.key.storage_key());
    }
    let email = EmailConsumer::new(
        db.conn.clone(),
        ConsumerName::parse("emails").unwrap(),
        InMemoryEmailProvider::default(),
    );
    let stuck = placed(book, 1);
    let _ = email
        .with_faults(Faults::crash_once_at(CrashPoint::AfterSend))
        .handle(&stuck)
        .await;

    let nothing_is_old = purge_completed(&db.conn, Utc::now() - Duration::hours(1), 10, false)
        .await
        .unwrap();
    assert_eq!(
        (nothing_is_old.deleted, nothing_is_old.processing_older),
        (0, 0)
    );

    let later = Utc::now() + Duration::hours(1);
    let dry = purge_completed(&db.conn, later, 10, true).await.unwrap();
    assert_eq!((dry.deleted, dry.processing_older), (25, 1));
    let name = consumer.consumer().as_str();
    assert!(
        db.stock
            .inbox_entry(&keys[0], name)
            .await
            .unwrap()
            .is_some()
    );

    let report = purge_completed(&db.conn, later, 10, false).await.unwrap();
    assert_eq!(report.deleted, 25);
    assert_eq!(report.batches, 3);
    assert_eq!(report.processing_older, 1);
    for key in &keys {
        assert_eq!(db.stock.inbox_entry(key, name).await.unwrap(), None);
    }
    let kept = db
        .stock
        .inbox_entry(&stuck.key.storage_key(), "emails")
        .await
        .unwrap()
        .expect("the processing row is kept");
    assert!(!kept.completed);
}

on_both_backends!(purge_deletes_completed_rows_in_batches_and_keeps_processing_ones);
