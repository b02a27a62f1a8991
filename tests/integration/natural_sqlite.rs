//! The natural key on SQLite's one writer (`natural_sqlite.rs`): what a batch in one transaction
//! must keep. The rule itself, against the model, is in `differential.rs`; its crash points in
//! `crash_points.rs`; hostile input in `corpus.rs`.

use inventory_benches::consumers::{HandlerKind, NaturalKeyPath};
use inventory_benches::produce::Produce as _;
use inventory_benches::readback::Readback as _;
use inventory_domain::{Effect, Message, OrderId, Outcome, Quantity, ReservationStatus};
use inventory_infra::MessageHandler;
use inventory_tests::{Backend, TestDb, placed, placed_for};

fn reserved(quantity: i64) -> Outcome {
    Outcome::Processed(Effect::Reserved {
        quantity: Quantity::new(quantity).unwrap(),
    })
}

/// One batch: an order's placement with an exact copy and a resend under a new id, its
/// cancellation, then the order's placement of another book, then another order taking the
/// copies the cancellation gave back. Each in its place, as one by one: the copies are
/// duplicates, the cancellation releases what the first placement reserved, the placement
/// after it arrives after the cancellation, and the other order finds the copies free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_keeps_copies_resends_and_a_cancellation_between_placements_of_its_order() {
    let db = TestDb::new(Backend::Sqlite).await;
    let handler = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Batch));
    let dune = db.dune(2).await;
    let emma = db.dune(5).await;
    let first = placed(dune, 2);
    let order = first.event.order_id();
    let second_book = placed_for(order, emma, 1);
    let other = placed_for(OrderId::new_v7(), dune, 2);
    let batch = [
        first.clone(),
        first.clone(),
        first.resent_with_new_id(),
        Message::cancelled(order),
        second_book.clone(),
        other.clone(),
    ];

    let results: Vec<Outcome> = handler
        .handle_batch(&batch)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();

    assert_eq!(
        results,
        [
            reserved(2),
            Outcome::Duplicate,
            Outcome::Duplicate,
            Outcome::Processed(Effect::Released { copies: 2 }),
            Outcome::Processed(Effect::ArrivedAfterCancellation),
            reserved(2),
        ]
    );
    assert_eq!(
        db.reserved(dune).await,
        2,
        "only the other order holds Dune"
    );
    assert_eq!(db.reserved(emma).await, 0);
    for (message, book, status) in [
        (&first, dune, ReservationStatus::Released),
        (&second_book, emma, ReservationStatus::Released),
        (&other, dune, ReservationStatus::Reserved),
    ] {
        let row = db
            .stock
            .reservation(message.event.order_id(), book)
            .await
            .unwrap()
            .expect("a reservation row");
        assert_eq!(row.status, status);
        assert_eq!(
            row.message_id,
            message.key.storage_key(),
            "the first copy's key"
        );
    }
    // One event per decision, in the batch's order: none for a copy, a resend or the
    // placement after the cancellation.
    let events: Vec<(&str, OrderId)> = db
        .pending_events()
        .await
        .iter()
        .map(|event| (event.subject_token(), event.order_id))
        .collect();
    assert_eq!(
        events,
        [
            ("stock.reserved", order),
            ("stock.released", order),
            ("stock.reserved", other.event.order_id()),
        ]
    );
}
