//! On a shard, the database decides which partitions it owns: a placement of a book whose
//! partition it does not own decides nothing, whatever its instance believes, and is neither an
//! unknown book nor a decision. The check is made under the stock row's lock, so an ownership
//! given up while a placement waited for that lock is seen (PostgreSQL: a shard is one).

use std::num::NonZeroU32;

use inventory_benches::produce::Produce as _;
use inventory_domain::shard::{DEFAULT_PARTITIONS, partition_of};
use inventory_domain::{BookId, ConsumerName, DeadLetterReason, Effect, Message, Outcome};
use inventory_infra::{HandleError, MessageHandler, NaturalKey};
use inventory_tests::{Backend, TestDb, placed, placed_for};
use sea_orm::{ConnectionTrait, DbBackend, Statement, TransactionTrait};

const PARTITIONS: NonZeroU32 = DEFAULT_PARTITIONS;

fn partition(book: BookId) -> i16 {
    i16::try_from(partition_of(book, PARTITIONS)).unwrap()
}

/// A book on `db` with plenty of stock, in a partition other than each of `avoid`'s.
async fn book_outside(db: &TestDb, avoid: &[BookId]) -> BookId {
    loop {
        let book = db.dune(100).await;
        if avoid
            .iter()
            .all(|other| partition(*other) != partition(book))
        {
            return book;
        }
    }
}

/// An id of a book no stock row holds, in the partition `wanted` says.
fn unknown_book(wanted: impl Fn(i16) -> bool) -> BookId {
    std::iter::repeat_with(BookId::new_v7)
        .find(|book| wanted(partition(*book)))
        .unwrap()
}

async fn own(db: &TestDb, book: BookId, state: &str) {
    db.conn
        .execute_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "INSERT INTO partition_owner (partition_id, shard, epoch, state, changed_at)
             VALUES ($1, 'a', 1, $2, now())
             ON CONFLICT (partition_id) DO UPDATE SET state = excluded.state",
            [partition(book).into(), state.into()],
        ))
        .await
        .unwrap();
}

fn on_shard(db: &TestDb) -> NaturalKey {
    inventory_tests::on_shard(db, PARTITIONS)
}

fn not_owned(result: &Result<Outcome, HandleError>) -> bool {
    matches!(result, Err(HandleError::NotOwned { .. }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placement_in_a_partition_the_database_does_not_own_decides_nothing() {
    let db = TestDb::new(Backend::Postgres).await;
    let owned = db.dune(100).await;
    let other = book_outside(&db, &[owned]).await;
    own(&db, owned, "active").await;
    let handler = on_shard(&db);

    let mine = placed(owned, 2);
    assert!(matches!(
        handler.handle(&mine).await.unwrap(),
        Outcome::Processed(Effect::Reserved { .. })
    ));
    assert!(not_owned(&handler.handle(&placed(other, 2)).await));
    // A book with no row here is another shard's while its partition is, never an unknown book.
    let elsewhere = unknown_book(|p| p != partition(owned));
    assert!(not_owned(&handler.handle(&placed(elsewhere, 1)).await));
    let missing = unknown_book(|p| p == partition(owned));
    assert!(matches!(
        handler.handle(&placed(missing, 1)).await.unwrap(),
        Outcome::Refused(refusal) if refusal.reason == DeadLetterReason::UnknownBook
    ));

    // A batch: each placement on its own partition's answer.
    let batch = [placed(owned, 1), placed(other, 1), placed(owned, 1)];
    let results = handler.handle_batch(&batch).await;
    assert!(results[0].as_ref().is_ok_and(Outcome::processed));
    assert!(not_owned(&results[1]));
    assert!(results[2].as_ref().is_ok_and(Outcome::processed));

    assert_eq!(db.reserved(owned).await, 4);
    assert_eq!(db.reserved(other).await, 0);
    let other_rows = db
        .scalar(&format!(
            "SELECT count(*) FROM stock_reservations WHERE book_id = '{other}'"
        ))
        .await;
    assert_eq!(
        other_rows, 0,
        "a reservation written outside the partitions owned"
    );
    // Each event's row carries its book's partition, for a move to drain it by.
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) FROM outbox WHERE shard_partition = {}",
            partition(owned)
        ))
        .await,
        3
    );

    // Ownership given up: a new order is refused; a copy of a decided one is still a
    // duplicate, which the key it left behind decides.
    own(&db, owned, "fenced").await;
    assert!(not_owned(&handler.handle(&placed(owned, 1)).await));
    assert_eq!(handler.handle(&mine).await.unwrap(), Outcome::Duplicate);

    // The unsharded handler asks nothing of partition_owner.
    let unsharded = NaturalKey::new(&db.conn, ConsumerName::parse("plain").unwrap());
    assert!(
        unsharded
            .handle(&placed(other, 1))
            .await
            .unwrap()
            .processed()
    );
}

/// The ownership is read after the stock row's lock is granted, with a snapshot taken then: a
/// placement that waited for the lock while another transaction gave the partition up, holding
/// that lock, decides nothing. Read with the statement's own snapshot, it would reserve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placement_that_waited_for_its_stock_row_sees_the_ownership_given_up_meanwhile() {
    let db = TestDb::new(Backend::Postgres).await;
    let book = db.dune(100).await;
    own(&db, book, "active").await;
    let handler = on_shard(&db);

    let fence = db.conn.begin().await.unwrap();
    fence
        .execute_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "SELECT 1 FROM stock_items WHERE book_id = $1 FOR UPDATE",
            [book.as_uuid().into()],
        ))
        .await
        .unwrap();
    let message = placed_for(inventory_domain::OrderId::new_v7(), book, 1);
    let waiting = tokio::spawn({
        let handler = handler.clone();
        async move { handler.handle(&message).await }
    });
    db.wait_for_lock_waiter().await;
    fence
        .execute_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "UPDATE partition_owner SET state = 'fenced' WHERE partition_id = $1",
            [partition(book).into()],
        ))
        .await
        .unwrap();
    fence.commit().await.unwrap();

    let result = waiting.await.unwrap();
    assert!(
        not_owned(&result),
        "decided on a partition given up: {result:?}"
    );
    assert_eq!(db.reserved(book).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_cannot_be_a_shard() {
    let db = TestDb::new(Backend::Sqlite).await;
    let handler = NaturalKey::new(&db.conn, ConsumerName::parse("shard-test").unwrap());
    assert!(handler.on_shard(PARTITIONS).is_none());
}

/// A line's cancellation lives on its book's shard: one whose partition the database does not
/// own is not recorded there, and leaves the line's reservation alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_line_cancellation_in_a_partition_not_owned_changes_nothing() {
    let db = TestDb::new(Backend::Postgres).await;
    let owned = db.dune(100).await;
    let other = book_outside(&db, &[owned]).await;
    own(&db, owned, "active").await;
    let handler = on_shard(&db);
    let unsharded = NaturalKey::new(&db.conn, ConsumerName::parse("plain").unwrap());
    let placement = placed(other, 2);
    assert!(unsharded.handle(&placement).await.unwrap().processed());

    let order = placement.event.order_id();
    let line = |book| Message::cancelled_line(order, book);
    assert!(not_owned(&handler.handle(&line(other)).await));
    // Asked as a placement is (a consumer stopped on it asks when its partition is owned again).
    assert!(!handler.decides(&line(other)).await.unwrap());
    assert!(handler.decides(&line(owned)).await.unwrap());
    assert!(unsharded.decides(&line(other)).await.unwrap());
    assert_eq!(db.reserved(other).await, 2);
    assert_eq!(
        db.scalar("SELECT count(*) FROM line_cancellations").await,
        0
    );
    assert!(matches!(
        handler.handle(&line(owned)).await.unwrap(),
        Outcome::Processed(Effect::Released { copies: 0 })
    ));
    assert_eq!(
        db.scalar("SELECT count(*) FROM line_cancellations").await,
        1
    );

    // A release on a shard: its event carries the book's partition; unsharded, none.
    let mine = placed(owned, 3);
    assert!(handler.handle(&mine).await.unwrap().processed());
    let release = Message::cancelled_line(mine.event.order_id(), owned);
    assert!(matches!(
        handler.handle(&release).await.unwrap(),
        Outcome::Processed(Effect::Released { copies: 3 })
    ));
    assert_eq!(
        db.scalar(&format!(
            "SELECT count(*) FROM outbox WHERE subject = 'stock.released' \
             AND shard_partition = {}",
            partition(owned)
        ))
        .await,
        1
    );
    assert_eq!(
        db.scalar("SELECT count(*) FROM outbox WHERE shard_partition IS NULL")
            .await,
        1,
        "the unsharded handler's reservation"
    );
}
