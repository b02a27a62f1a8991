//! The strategies without an inbox transaction: naive and check-then-process.

use inventory_benches::mistakes::Strategy;
use inventory_benches::readback::Readback as _;
use inventory_domain::Outcome;
use inventory_infra::CrashPoint;
use inventory_infra::MessageHandler;
use inventory_tests::{TestDb, crash_at, on_both_backends, placed};

use crate::two_copies;

async fn naive_reserves_again_on_every_delivery(db: TestDb) {
    let book = db.dune(10).await;
    let consumer = db.study_consumer(Strategy::Naive);
    let message = placed(book, 2);
    assert!(consumer.handle(&message).await.unwrap().processed());
    assert!(consumer.handle(&message).await.unwrap().processed());
    assert_eq!(db.reserved(book).await, 4);
    let logged = db
        .stock
        .logged_reservations(message.event.order_id())
        .await
        .unwrap();
    assert_eq!(logged.len(), 2);
}

async fn naive_two_copies_at_once_both_reserve(db: TestDb) {
    let book = db.dune(10).await;
    let consumer = db.study_consumer(Strategy::Naive);
    let (first, second) = two_copies(&db, consumer.clone(), &placed(book, 2), None, false).await;
    assert!(first.unwrap().processed() && second.processed());
    assert_eq!(db.reserved(book).await, 4);
}

async fn check_then_process_skips_a_plain_redelivery(db: TestDb) {
    let book = db.dune(10).await;
    let consumer = db.study_consumer(Strategy::CheckThenProcess);
    let message = placed(book, 2);
    assert!(consumer.handle(&message).await.unwrap().processed());
    assert_eq!(consumer.handle(&message).await.unwrap(), Outcome::Duplicate);
    assert_eq!(db.reserved(book).await, 2);
}

async fn check_then_process_crash_after_commit_reserves_twice(db: TestDb) {
    let book = db.dune(10).await;
    let consumer = db.study_consumer(Strategy::CheckThenProcess);
    let message = placed(book, 2);
    crash_at(&message, CrashPoint::AfterCommit, |faults| {
        consumer.with_faults(faults)
    })
    .await;
    let key = message.key.storage_key();
    let record = db
        .stock
        .inbox_entry(&key, consumer.consumer().as_str())
        .await
        .unwrap();
    assert_eq!(record, None, "the crash came before the record");
    assert!(consumer.handle(&message).await.unwrap().processed());
    assert_eq!(db.reserved(book).await, 4);
}

async fn check_then_process_two_copies_at_once_both_reserve(db: TestDb) {
    let book = db.dune(10).await;
    let consumer = db.study_consumer(Strategy::CheckThenProcess);
    let (first, second) = two_copies(&db, consumer.clone(), &placed(book, 2), None, false).await;
    assert!(first.unwrap().processed() && second.processed());
    assert_eq!(db.reserved(book).await, 4);
}

on_both_backends!(
    naive_reserves_again_on_every_delivery,
    naive_two_copies_at_once_both_reserve,
    check_then_process_skips_a_plain_redelivery,
    check_then_process_crash_after_commit_reserves_twice,
    check_then_process_two_copies_at_once_both_reserve,
);
