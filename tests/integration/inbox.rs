//! The inbox, in each of its three duplicate-detection modes.

use inventory_benches::consumers::{DetectMode, Handler, HandlerKind};
use inventory_benches::payload_hash::PayloadHash;
use inventory_benches::produce::Produce as _;
use inventory_benches::readback::Readback as _;
use inventory_domain::Message;
use inventory_domain::{DeadLetterReason, Effect, Event, Outcome, Quantity};
use inventory_infra::CrashPoint;
use inventory_infra::HandleError;
use inventory_tests::{TestDb, crash_at, on_both_backends, placed};

use crate::two_copies;

fn consumers(db: &TestDb) -> impl Iterator<Item = (DetectMode, Handler)> + '_ {
    DetectMode::ALL
        .into_iter()
        .map(|mode| (mode, db.consumer(HandlerKind::Inbox(mode))))
}

fn refusal_reason(outcome: &Outcome) -> Option<DeadLetterReason> {
    match outcome {
        Outcome::Refused(refusal) => Some(refusal.reason),
        _ => None,
    }
}

async fn inbox_skips_a_redelivery(db: TestDb) {
    for (mode, consumer) in consumers(&db) {
        let book = db.dune(10).await;
        let message = placed(book, 2);
        assert!(
            consumer.handle(&message).await.unwrap().processed(),
            "{mode:?}"
        );
        assert_eq!(consumer.handle(&message).await.unwrap(), Outcome::Duplicate);
        assert_eq!(db.reserved(book).await, 2, "{mode:?}");
        let record = db
            .stock
            .inbox_entry(&message.key.storage_key(), consumer.consumer().as_str())
            .await
            .unwrap()
            .unwrap();
        assert!(record.completed);
        assert_eq!(record.payload_hash, PayloadHash::of(&message).as_str());
    }
}

async fn inbox_crash_at_any_point_then_redelivery_reserves_once(db: TestDb) {
    for (mode, consumer) in consumers(&db) {
        for point in [
            CrashPoint::AfterDedupCheck,
            CrashPoint::BeforeCommit,
            CrashPoint::AfterCommit,
        ] {
            let book = db.dune(10).await;
            let message = placed(book, 2);
            crash_at(&message, point, |faults| consumer.with_faults(faults)).await;
            let committed = point == CrashPoint::AfterCommit;
            assert_eq!(db.reserved(book).await, if committed { 2 } else { 0 });
            let redelivered = consumer.handle(&message).await.unwrap();
            assert_eq!(redelivered.processed(), !committed, "{mode:?} {point:?}");
            assert_eq!(db.reserved(book).await, 2, "{mode:?} {point:?}");
        }
    }
}

async fn inbox_second_copy_waits_for_the_first_and_is_a_duplicate(db: TestDb) {
    for (mode, consumer) in consumers(&db) {
        let book = db.dune(10).await;
        let (first, second) = two_copies(&db, consumer.clone(), &placed(book, 2), None, true).await;
        assert!(first.unwrap().processed(), "{mode:?}");
        assert_eq!(second, Outcome::Duplicate, "{mode:?}");
        assert_eq!(db.reserved(book).await, 2, "{mode:?}");
    }
}

async fn inbox_second_copy_processes_when_the_first_rolls_back(db: TestDb) {
    for (mode, consumer) in consumers(&db) {
        let book = db.dune(10).await;
        let message = placed(book, 2);
        let (first, second) = two_copies(
            &db,
            consumer.clone(),
            &message,
            Some(CrashPoint::BeforeCommit),
            true,
        )
        .await;
        assert!(matches!(first, Err(HandleError::Crashed(_))), "{mode:?}");
        assert!(second.processed(), "{mode:?}");
        assert_eq!(db.reserved(book).await, 2, "{mode:?}");
    }
}

async fn inbox_same_id_with_other_content_is_a_payload_mismatch(db: TestDb) {
    for (mode, consumer) in consumers(&db) {
        let book = db.dune(10).await;
        let message = placed(book, 2);
        let mut altered = message.clone();
        if let Event::Placed(order) = &mut altered.event {
            order.quantity = Quantity::new(3).unwrap();
        }
        consumer.handle(&message).await.unwrap();
        let outcome = consumer.handle(&altered).await.unwrap();
        assert_eq!(
            refusal_reason(&outcome),
            Some(DeadLetterReason::PayloadMismatch),
            "{mode:?}"
        );
        assert_eq!(db.reserved(book).await, 2);
    }
}

async fn inbox_cannot_see_a_producer_duplicate_with_a_new_id(db: TestDb) {
    for (mode, consumer) in consumers(&db) {
        let book = db.dune(10).await;
        let message = placed(book, 2);
        consumer.handle(&message).await.unwrap();
        assert!(
            consumer
                .handle(&message.resent_with_new_id())
                .await
                .unwrap()
                .processed(),
            "{mode:?}"
        );
        assert_eq!(db.reserved(book).await, 4, "{mode:?}");
    }
}

async fn inbox_unknown_book_is_refused_and_leaves_no_row(db: TestDb) {
    for (mode, consumer) in consumers(&db) {
        let message = placed(inventory_domain::BookId::new_v7(), 2);
        let outcome = consumer.handle(&message).await.unwrap();
        assert_eq!(
            refusal_reason(&outcome),
            Some(DeadLetterReason::UnknownBook),
            "{mode:?}"
        );
        let record = db
            .stock
            .inbox_entry(&message.key.storage_key(), consumer.consumer().as_str())
            .await
            .unwrap();
        assert_eq!(record, None, "a refusal writes nothing ({mode:?})");
    }
}

async fn inbox_rejection_is_kept_on_redelivery(db: TestDb) {
    let consumer = db.consumer(HandlerKind::Inbox(DetectMode::OnConflict));
    let book = db.dune(1).await;
    let message = placed(book, 2);
    let outcome = consumer.handle(&message).await.unwrap();
    assert!(matches!(
        outcome,
        Outcome::Processed(Effect::Rejected { available: 1, .. })
    ));
    db.stock
        .put(&inventory_domain::StockItem::new(book, "Dune", 10).unwrap())
        .await
        .unwrap();
    assert_eq!(consumer.handle(&message).await.unwrap(), Outcome::Duplicate);
    assert_eq!(db.reserved(book).await, 0);
}

async fn inbox_cancellation_releases_once(db: TestDb) {
    let consumer = db.consumer(HandlerKind::Inbox(DetectMode::OnConflict));
    let book = db.dune(10).await;
    let order = placed(book, 2);
    consumer.handle(&order).await.unwrap();
    let cancel = Message::cancelled(order.event.order_id());
    assert_eq!(
        consumer.handle(&cancel).await.unwrap(),
        Outcome::Processed(Effect::Released { copies: 2 })
    );
    assert_eq!(consumer.handle(&cancel).await.unwrap(), Outcome::Duplicate);
    assert_eq!(db.reserved(book).await, 0);
}

on_both_backends!(
    inbox_skips_a_redelivery,
    inbox_crash_at_any_point_then_redelivery_reserves_once,
    inbox_second_copy_waits_for_the_first_and_is_a_duplicate,
    inbox_second_copy_processes_when_the_first_rolls_back,
    inbox_same_id_with_other_content_is_a_payload_mismatch,
    inbox_cannot_see_a_producer_duplicate_with_a_new_id,
    inbox_unknown_book_is_refused_and_leaves_no_row,
    inbox_rejection_is_kept_on_redelivery,
    inbox_cancellation_releases_once,
);
