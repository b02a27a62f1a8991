//! Natural idempotency: the reservation's key (order_id, book_id) refuses a second reservation.

use inventory_benches::consumers::{HandlerKind, NaturalKeyPath};
use inventory_benches::faults;
use inventory_benches::produce::Produce as _;
use inventory_benches::readback::Readback as _;
use inventory_domain::Message;
use inventory_domain::{
    BookId, DeadLetterReason, Effect, OrderId, Outcome, ReservationStatus, StockItem,
};
use inventory_infra::CrashPoint;
use inventory_infra::HandleError;
use inventory_tests::{Backend, TestDb, crash_at, on_both_backends, placed, placed_for};

use crate::two_copies;

async fn status(db: &TestDb, order: OrderId, book: BookId) -> ReservationStatus {
    db.stock
        .reservation(order, book)
        .await
        .unwrap()
        .expect("a reservation row")
        .status
}

async fn natural_key_refuses_redelivery_and_new_ids(db: TestDb) {
    let consumer = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm));
    let book = db.dune(10).await;
    let message = placed(book, 2);
    assert_eq!(
        consumer.handle(&message).await.unwrap(),
        Outcome::Processed(Effect::Reserved {
            quantity: inventory_domain::Quantity::new(2).unwrap()
        })
    );
    assert_eq!(consumer.handle(&message).await.unwrap(), Outcome::Duplicate);
    assert_eq!(
        consumer
            .handle(&message.resent_with_new_id())
            .await
            .unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(db.reserved(book).await, 2);
    let order = message.event.order_id();
    assert_eq!(status(&db, order, book).await, ReservationStatus::Reserved);
}

async fn natural_key_other_quantity_is_a_conflict(db: TestDb) {
    let consumer = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm));
    let book = db.dune(10).await;
    let message = placed(book, 2);
    consumer.handle(&message).await.unwrap();
    let other = placed_for(message.event.order_id(), book, 3);
    let Outcome::Refused(refusal) = consumer.handle(&other).await.unwrap() else {
        panic!("expected a refusal");
    };
    assert_eq!(refusal.reason, DeadLetterReason::ConflictingReservation);
    assert_eq!(db.reserved(book).await, 2);
}

async fn natural_key_keeps_a_rejection(db: TestDb) {
    let consumer = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm));
    let book = db.dune(1).await;
    let message = placed(book, 2);
    assert!(matches!(
        consumer.handle(&message).await.unwrap(),
        Outcome::Processed(Effect::Rejected { available: 1, .. })
    ));
    db.stock
        .put(&StockItem::new(book, "Dune", 10).unwrap())
        .await
        .unwrap();
    assert_eq!(consumer.handle(&message).await.unwrap(), Outcome::Duplicate);
    assert_eq!(
        consumer
            .handle(&message.resent_with_new_id())
            .await
            .unwrap(),
        Outcome::Duplicate
    );
    let order = message.event.order_id();
    assert_eq!(status(&db, order, book).await, ReservationStatus::Rejected);
    assert_eq!(db.reserved(book).await, 0);
}

async fn natural_key_releases_a_cancelled_order_exactly_once(db: TestDb) {
    let consumer = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm));
    let dune = db.dune(10).await;
    let other_book = db.dune(10).await;
    let order = OrderId::new_v7();
    consumer.handle(&placed_for(order, dune, 2)).await.unwrap();
    consumer
        .handle(&placed_for(order, other_book, 3))
        .await
        .unwrap();
    let cancel = Message::cancelled(order);
    assert_eq!(
        consumer.handle(&cancel).await.unwrap(),
        Outcome::Processed(Effect::Released { copies: 5 })
    );
    assert_eq!(consumer.handle(&cancel).await.unwrap(), Outcome::Duplicate);
    assert_eq!(
        consumer.handle(&cancel.resent_with_new_id()).await.unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(db.reserved(dune).await, 0);
    assert_eq!(db.reserved(other_book).await, 0);
    assert_eq!(status(&db, order, dune).await, ReservationStatus::Released);
}

async fn natural_key_cancellation_before_placement_wins(db: TestDb) {
    let consumer = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm));
    let book = db.dune(10).await;
    let message = placed(book, 2);
    let order = message.event.order_id();
    assert_eq!(
        consumer.handle(&Message::cancelled(order)).await.unwrap(),
        Outcome::Processed(Effect::Released { copies: 0 })
    );
    assert_eq!(
        consumer.handle(&message).await.unwrap(),
        Outcome::Processed(Effect::ArrivedAfterCancellation)
    );
    assert_eq!(consumer.handle(&message).await.unwrap(), Outcome::Duplicate);
    assert_eq!(db.reserved(book).await, 0);
    assert_eq!(status(&db, order, book).await, ReservationStatus::Released);
}

async fn natural_key_unknown_book_is_refused_and_writes_nothing(db: TestDb) {
    let consumer = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm));
    let book = BookId::new_v7();
    let message = placed(book, 2);
    let Outcome::Refused(refusal) = consumer.handle(&message).await.unwrap() else {
        panic!("expected a refusal");
    };
    assert_eq!(refusal.reason, DeadLetterReason::UnknownBook);
    let order = message.event.order_id();
    assert_eq!(db.stock.reservation(order, book).await.unwrap(), None);
}

async fn natural_key_crash_at_any_point_then_redelivery_reserves_once(db: TestDb) {
    let consumer = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm));
    for point in [
        CrashPoint::AfterDedupCheck,
        CrashPoint::BeforeCommit,
        CrashPoint::AfterCommit,
    ] {
        let book = db.dune(10).await;
        let message = placed(book, 2);
        crash_at(&message, point, |faults| consumer.with_faults(faults)).await;
        consumer.handle(&message).await.unwrap();
        assert_eq!(db.reserved(book).await, 2, "{point:?}");
    }
}

async fn natural_key_second_copy_waits_and_is_a_duplicate(db: TestDb) {
    let consumer = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm));
    let book = db.dune(10).await;
    let message = placed(book, 2).resent_with_new_id();
    let (first, second) = two_copies(&db, consumer.clone(), &message, None, true).await;
    assert!(first.unwrap().processed());
    assert_eq!(second, Outcome::Duplicate);
    assert_eq!(db.reserved(book).await, 2);
}

async fn natural_key_second_copy_processes_when_the_first_rolls_back(db: TestDb) {
    let consumer = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm));
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
    assert!(matches!(first, Err(HandleError::Crashed(_))));
    assert!(second.processed());
    assert_eq!(db.reserved(book).await, 2);
}

/// A cancellation and its placement in flight together, in both orders of their claims: the
/// cancellation wins either way and nothing stays reserved.
async fn natural_key_concurrent_cancel_and_place_cancel_wins(db: TestDb) {
    let consumer = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm));
    for placement_first in [true, false] {
        let book = db.dune(10).await;
        let order = placed(book, 2);
        let cancel = Message::cancelled(order.event.order_id());
        let (held, other) = if placement_first {
            (order.clone(), cancel.clone())
        } else {
            (cancel.clone(), order.clone())
        };
        let (faults, mut hold) = faults::hold_once_at(CrashPoint::AfterDedupCheck);
        let first = tokio::spawn({
            let consumer = consumer.with_faults(faults);
            async move { consumer.handle(&held).await }
        });
        hold.reached().await;
        let second = tokio::spawn({
            let consumer = consumer.clone();
            async move { consumer.handle(&other).await }
        });
        if db.backend == Backend::Postgres {
            // Either way the second waits for the order's lock the held one took.
            db.wait_for_lock_waiter().await;
        } else {
            // SQLite shows no waiting writer (it retries inside its busy handler): the second
            // is given time to reach the writer lock, and must not have finished.
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            assert!(
                !second.is_finished(),
                "the second did not wait for the writer lock"
            );
        }
        hold.release();
        first.await.unwrap().unwrap();
        second.await.unwrap().unwrap();
        assert_eq!(
            db.reserved(book).await,
            0,
            "placement first: {placement_first}"
        );
        let state = status(&db, order.event.order_id(), book).await;
        assert_eq!(state, ReservationStatus::Released);
    }
}

on_both_backends!(
    natural_key_refuses_redelivery_and_new_ids,
    natural_key_other_quantity_is_a_conflict,
    natural_key_keeps_a_rejection,
    natural_key_releases_a_cancelled_order_exactly_once,
    natural_key_cancellation_before_placement_wins,
    natural_key_unknown_book_is_refused_and_writes_nothing,
    natural_key_crash_at_any_point_then_redelivery_reserves_once,
    natural_key_second_copy_waits_and_is_a_duplicate,
    natural_key_second_copy_processes_when_the_first_rolls_back,
    natural_key_concurrent_cancel_and_place_cancel_wins,
);
