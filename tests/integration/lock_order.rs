//! Every natural-key path takes its locks in the one order `natural.rs` sets down, so two
//! messages never wait for each other in a cycle (a deadlock, SQLSTATE 40P01).

use inventory_benches::consumers::{HandlerKind, NaturalKeyPath};
use inventory_benches::faults;
use inventory_benches::produce::Produce as _;
use inventory_domain::{Message, OrderId, Outcome};
use inventory_infra::CrashPoint;
use inventory_infra::MessageHandler;
use inventory_tests::{Backend, TestDb, placed, placed_for};
use sea_orm::ConnectionTrait;

const ROUNDS: usize = 40;

/// Other orders of ten books each, then fresh statistics: on such a table PostgreSQL reads an
/// order's reservations in the order they lie on disk (a bitmap heap scan), not by book, as
/// production would; on a small fresh table an index scan would sort them by book by chance.
const OTHER_ORDERS_SQL: &str = "\
INSERT INTO stock_reservations (order_id, book_id, quantity, status, message_id, created_at)
SELECT order_id, gen_random_uuid(), 1, 'reserved', 'other', now()
FROM (SELECT gen_random_uuid() AS order_id FROM generate_series(1, 1000)) orders,
     generate_series(1, 10);
ANALYZE stock_reservations";

/// Two orders over the same two books, placed book by book in opposite orders on two
/// connections at once, then both cancelled at once: through the sea-orm handler and the one
/// statement in every pairing, and the batch statement beside the sea-orm handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_over_two_books_in_opposite_order_never_deadlock() {
    let db = TestDb::new(Backend::Postgres).await;
    db.conn.execute_unprepared(OTHER_ORDERS_SQL).await.unwrap();
    let (dune, emma) = (db.dune(1_000_000).await, db.dune(1_000_000).await);
    let reference = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm));
    let statements = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Batch));
    let other_lane = statements.clone();
    let mut failures = Vec::new();
    for round in 0..ROUNDS {
        let (forward, backward) = (OrderId::new_v7(), OrderId::new_v7());
        let forward_placements = [placed_for(forward, dune, 1), placed_for(forward, emma, 2)];
        let backward_placements = [placed_for(backward, emma, 1), placed_for(backward, dune, 2)];
        let (cancel_forward, cancel_backward) = (
            [Message::cancelled(forward)],
            [Message::cancelled(backward)],
        );
        // The cancellations start together, once both orders are placed.
        let phases: [[&[Message]; 2]; 2] = [
            [&forward_placements, &backward_placements],
            [&cancel_forward, &cancel_backward],
        ];
        for [first, second] in phases {
            let (first, second) = match round % 5 {
                0 => tokio::join!(reference.handle_each(first), statements.handle_each(second)),
                1 => tokio::join!(statements.handle_each(first), reference.handle_each(second)),
                2 => tokio::join!(reference.handle_each(first), reference.handle_each(second)),
                3 => tokio::join!(
                    statements.handle_each(first),
                    other_lane.handle_each(second)
                ),
                _ => tokio::join!(
                    statements.handle_batch(first),
                    reference.handle_each(second)
                ),
            };
            failures.extend(
                (first.into_iter().chain(second))
                    .filter_map(Result::err)
                    .map(|error| format!("round {round}: {error}")),
            );
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert_eq!((db.reserved(dune).await, db.reserved(emma).await), (0, 0));
}

/// A copy through the one statement while the sea-orm handler is held right after inserting
/// the reservation: the copy waits for the first and is a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_on_the_one_statement_waits_for_the_reference_without_deadlock() {
    let db = TestDb::new(Backend::Postgres).await;
    let book = db.dune(10).await;
    let reference = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm));
    let statements = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Batch));
    let message = placed(book, 2);
    let (faults, mut hold) = faults::hold_once_at(CrashPoint::AfterDedupCheck);
    let first = tokio::spawn({
        let reference = reference.with_faults(faults);
        let message = message.clone();
        async move { reference.handle(&message).await }
    });
    hold.reached().await;
    let copy = tokio::spawn(async move { statements.handle(&message.resent_with_new_id()).await });
    db.wait_for_lock_waiter().await;
    hold.release();
    assert!(first.await.unwrap().unwrap().processed());
    assert_eq!(copy.await.unwrap().unwrap(), Outcome::Duplicate);
    assert_eq!(db.reserved(book).await, 2);
}
