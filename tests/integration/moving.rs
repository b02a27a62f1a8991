//! A partition's move, statement by statement, on two shards' databases (PostgreSQL): the fence
//! waits for what holds the partition's locks, the copy holds every decision the old shard made,
//! and what arrives at either shard around the move is decided once, by the shard whose owner
//! row is active, and never dead-lettered. The command's loop and the bucket are the binary
//! tests'; the order of the steps is the model's (`infra/src/shard_move/model.rs`).

use std::num::NonZeroU32;
use std::time::Duration;

use inventory_benches::faults::hold_once_at;
use inventory_benches::produce::Produce as _;
use inventory_domain::shard::{DEFAULT_PARTITIONS, partition_of};
use inventory_domain::{BookId, Effect, Message, OrderId, Outcome};
use inventory_infra::shard_move::{OwnerRow, OwnerState, RowsError, ShardRows};
use inventory_infra::{CrashPoint, DataError, HandleError, MessageHandler, NaturalKey};
use inventory_tests::{Backend, TestDb, placed_for};
use sea_orm::{ConnectionTrait, DbBackend, Statement, TransactionTrait};

const PARTITIONS: NonZeroU32 = DEFAULT_PARTITIONS;
const GRACE: Duration = Duration::from_secs(30);

/// Two shards: `a` owns the partition of the book it stocks, `b` holds nothing yet.
struct Shards {
    a: TestDb,
    b: TestDb,
    book: BookId,
    partition: u32,
}

impl Shards {
    async fn new() -> Self {
        let a = TestDb::labelled(Backend::Postgres, "move_a").await;
        let b = TestDb::labelled(Backend::Postgres, "move_b").await;
        let book = a.dune(10).await;
        let partition = partition_of(book, PARTITIONS);
        a.conn
            .execute_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "INSERT INTO partition_owner (partition_id, shard, epoch, state, changed_at) \
                 VALUES ($1, 'a', 1, 'active', now())",
                [i16::try_from(partition).unwrap().into()],
            ))
            .await
            .unwrap();
        Self {
            a,
            b,
            book,
            partition,
        }
    }

    fn rows(&self) -> (ShardRows, ShardRows) {
        (
            ShardRows::new(&self.a.conn, PARTITIONS),
            ShardRows::new(&self.b.conn, PARTITIONS),
        )
    }

    fn handlers(&self) -> (NaturalKey, NaturalKey) {
        (on_shard(&self.a), on_shard(&self.b))
    }

    /// Copy to `b` (the old shard fenced first), then activate there, as the hand-over would.
    async fn copy_and_activate(&self) {
        let (a, b) = self.rows();
        b.copy_from(&a, self.partition, (1, 2), "b").await.unwrap();
        b.activate(self.partition, 2).await.unwrap();
    }

    /// A book on `a` in the same partition, with `on_hand` copies.
    async fn another_book(&self, on_hand: i64) -> BookId {
        loop {
            let book = self.a.dune(on_hand).await;
            if partition_of(book, PARTITIONS) == self.partition {
                return book;
            }
            self.a
                .conn
                .execute_unprepared(&format!("DELETE FROM stock_items WHERE book_id = '{book}'"))
                .await
                .unwrap();
        }
    }
}

fn on_shard(db: &TestDb) -> NaturalKey {
    inventory_tests::on_shard(db, PARTITIONS)
}

fn not_owned(result: &Result<Outcome, HandleError>) -> bool {
    matches!(result, Err(HandleError::NotOwned { .. }))
}

fn reserved(result: &Result<Outcome, HandleError>) -> bool {
    matches!(result, Ok(Outcome::Processed(Effect::Reserved { .. })))
}

/// A transaction holding `book`'s stock row, as a statement in flight holds it.
async fn hold_stock_row(db: &TestDb, book: BookId) -> sea_orm::DatabaseTransaction {
    let holder = db.conn.begin().await.unwrap();
    holder
        .execute_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "SELECT 1 FROM stock_items WHERE book_id = $1 FOR UPDATE",
            [book.as_uuid().into()],
        ))
        .await
        .unwrap();
    holder
}

async fn count(db: &TestDb, sql: &str) -> i64 {
    db.scalar(sql).await
}

/// A placement queued at its stock row's lock before the fence: the fence waits for it, the
/// placement decides on the old shard, and the copy holds its reservation. Later copies of it
/// are duplicates on the new shard, and on the old one (fenced, then emptied) not owned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_waits_for_a_placement_ahead_of_it_and_the_copy_holds_its_decision() {
    let shards = Shards::new().await;
    let (rows_a, _) = shards.rows();
    let (on_a, on_b) = shards.handlers();
    let order = OrderId::new_v7();
    let placement = placed_for(order, shards.book, 2);

    let holder = hold_stock_row(&shards.a, shards.book).await;
    let in_flight = tokio::spawn({
        let (on_a, placement) = (on_a.clone(), placement.clone());
        async move { on_a.handle(&placement).await }
    });
    shards.a.wait_for_lock_waiters(1).await;
    let fence = tokio::spawn({
        let partition = shards.partition;
        async move { rows_a.fence(partition, 1, GRACE).await }
    });
    shards.a.wait_for_lock_waiters(2).await;
    assert!(!fence.is_finished(), "the fence went past a held stock row");
    holder.commit().await.unwrap();
    let decided = in_flight.await.unwrap();
    assert!(reserved(&decided), "{decided:?}");
    fence.await.unwrap().unwrap();

    // Fenced: the old shard decides nothing new, and a copy of the decided one is refused too
    // (not owned, never an unknown book): its key is the new shard's to answer from now.
    let newcomer = placed_for(OrderId::new_v7(), shards.book, 1);
    assert!(not_owned(&on_a.handle(&newcomer).await));
    // The new shard has nothing yet: not owned either.
    assert!(not_owned(&on_b.handle(&newcomer).await));

    let (rows_a, rows_b) = shards.rows();
    let copied = rows_b
        .copy_from(&rows_a, shards.partition, (1, 2), "b")
        .await
        .unwrap();
    assert_eq!((copied.books, copied.reservations), (1, 1));
    // Copied, not handed over: a copy of a decided placement meets its key, a new one is not
    // owned.
    assert_eq!(on_b.handle(&placement).await.unwrap(), Outcome::Duplicate);
    assert!(not_owned(&on_b.handle(&newcomer).await));
    rows_b.activate(shards.partition, 2).await.unwrap();
    assert_eq!(on_b.handle(&placement).await.unwrap(), Outcome::Duplicate);
    assert!(reserved(&on_b.handle(&newcomer).await));

    // The old shard before and after its rows are removed: not owned, both.
    assert!(not_owned(
        &on_a
            .handle(&placed_for(OrderId::new_v7(), shards.book, 1))
            .await
    ));
    let removed = rows_a.remove(shards.partition, 1, GRACE).await.unwrap();
    assert_eq!((removed.books, removed.reservations), (1, 1));
    assert!(not_owned(&on_a.handle(&placement).await));
    assert!(not_owned(&on_a.handle(&newcomer).await));
    assert_eq!(
        count(&shards.a, "SELECT count(*) FROM stock_items").await,
        0
    );
    assert_eq!(
        count(&shards.a, "SELECT count(*) FROM partition_owner").await,
        0
    );

    assert_eq!(shards.b.reserved(shards.book).await, 3);
    assert_eq!(
        count(&shards.b, "SELECT count(*) FROM stock_reservations").await,
        2
    );
}

/// A placement whose insert found its key taken by a copy that committed while it waited, and
/// whose partition then moved away before it read the key again (the old shard's rows removed
/// after the hand-over): not owned, for the new shard to answer, never a dead letter. With the
/// partition still owned, a key gone in between is one a person removed: unusable data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placement_whose_key_moved_away_after_its_insert_conflicted_is_not_owned() {
    let shards = Shards::new().await;
    let (on_a, _) = shards.handlers();

    let order = OrderId::new_v7();
    let removed_by_hand = format!("DELETE FROM stock_reservations WHERE order_id = '{order}'");
    let gone = key_taken_then(&shards, &on_a, order, &removed_by_hand).await;
    assert!(
        matches!(gone, Err(HandleError::Data(DataError::Vanished { .. }))),
        "{gone:?}"
    );

    let order = OrderId::new_v7();
    let moved_away = format!(
        "DELETE FROM stock_reservations WHERE order_id = '{order}'; \
         DELETE FROM partition_owner WHERE partition_id = {}",
        shards.partition
    );
    let moved = key_taken_then(&shards, &on_a, order, &moved_away).await;
    assert!(not_owned(&moved), "{moved:?}");
}

/// A placement of `order` on shard `a`, queued at its stock row while a copy of its key
/// commits, so that its insert conflicts; `meanwhile` runs as its statement ends, before it
/// reads the key again: queued for the reservations table behind the statement, it is granted
/// the table when the statement commits, ahead of the read that follows.
async fn key_taken_then(
    shards: &Shards,
    handler: &NaturalKey,
    order: OrderId,
    meanwhile: &str,
) -> Result<Outcome, HandleError> {
    let holder = hold_stock_row(&shards.a, shards.book).await;
    holder
        .execute_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "INSERT INTO stock_reservations (order_id, book_id, quantity, status, message_id, \
             created_at) VALUES ($1, $2, 1, 'reserved', 'a copy', now())",
            [order.as_uuid().into(), shards.book.as_uuid().into()],
        ))
        .await
        .unwrap();
    let in_flight = tokio::spawn({
        let (handler, placement) = (handler.clone(), placed_for(order, shards.book, 1));
        async move { handler.handle(&placement).await }
    });
    shards.a.wait_for_lock_waiters(1).await;
    let later = shards.a.conn.begin().await.unwrap();
    let meanwhile = tokio::spawn({
        let meanwhile = meanwhile.to_owned();
        async move {
            later
                .execute_unprepared("LOCK TABLE stock_reservations IN ACCESS EXCLUSIVE MODE")
                .await
                .unwrap();
            later.execute_unprepared(&meanwhile).await.unwrap();
            later.commit().await.unwrap();
        }
    });
    shards.a.wait_for_lock_waiters(2).await;
    holder.commit().await.unwrap();
    meanwhile.await.unwrap();
    in_flight.await.unwrap()
}

/// A batch queued behind the fence: granted its locks once the partition is fenced, it decides
/// nothing of the partition's books (not owned) and the rest of its batch as usual; on the new
/// shard, after the hand-over, each of its placements is decided once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_queued_behind_the_fence_is_not_owned_and_decided_once_on_the_new_shard() {
    let shards = Shards::new().await;
    let second = shards.another_book(10).await;
    let (rows_a, _) = shards.rows();
    let (on_a, on_b) = shards.handlers();
    let batch = [
        placed_for(OrderId::new_v7(), shards.book, 1),
        placed_for(OrderId::new_v7(), second, 2),
        placed_for(OrderId::new_v7(), shards.book, 3),
    ];

    let holder = hold_stock_row(&shards.a, shards.book).await;
    let fence = tokio::spawn({
        let partition = shards.partition;
        async move { rows_a.fence(partition, 1, GRACE).await }
    });
    shards.a.wait_for_lock_waiters(1).await;
    let in_flight = tokio::spawn({
        let (on_a, batch) = (on_a.clone(), batch.clone());
        async move { on_a.handle_batch(&batch).await }
    });
    shards.a.wait_for_lock_waiters(2).await;
    holder.commit().await.unwrap();
    fence.await.unwrap().unwrap();
    let results = in_flight.await.unwrap();
    assert!(results.iter().all(not_owned), "{results:?}");
    assert_eq!(
        count(&shards.a, "SELECT count(*) FROM stock_reservations").await,
        0
    );
    assert_eq!(count(&shards.a, "SELECT count(*) FROM outbox").await, 0);

    shards.copy_and_activate().await;
    let decided = on_b.handle_batch(&batch).await;
    assert!(decided.iter().all(reserved), "{decided:?}");
    let again = on_b.handle_batch(&batch).await;
    assert!(
        again
            .iter()
            .all(|result| matches!(result, Ok(Outcome::Duplicate))),
        "{again:?}"
    );
    assert_eq!(shards.b.reserved(shards.book).await, 4);
    assert_eq!(shards.b.reserved(second).await, 2);
    assert_eq!(count(&shards.b, "SELECT count(*) FROM outbox").await, 3);
}

/// A line cancellation that came first, on the old shard, still wins on the new one: one queued
/// at its stock row ahead of the fence (its line not placed yet), and one of a line reserved
/// and released before the move. After it, their placements are released; one `released`
/// event per released reservation across both shards, none reserved after a cancellation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancellation_that_came_first_on_the_old_shard_wins_on_the_new_one() {
    let shards = Shards::new().await;
    let (rows_a, _) = shards.rows();
    let (on_a, on_b) = shards.handlers();
    let early = OrderId::new_v7();
    let early_cancel = Message::cancelled_line(early, shards.book);
    let late = OrderId::new_v7();
    let late_placement = placed_for(late, shards.book, 2);
    assert!(reserved(&on_a.handle(&late_placement).await));
    assert!(matches!(
        on_a.handle(&Message::cancelled_line(late, shards.book))
            .await
            .unwrap(),
        Outcome::Processed(Effect::Released { copies: 2 })
    ));

    let holder = hold_stock_row(&shards.a, shards.book).await;
    let in_flight = tokio::spawn({
        let on_a = on_a.clone();
        let early_cancel = early_cancel.clone();
        async move { on_a.handle(&early_cancel).await }
    });
    shards.a.wait_for_lock_waiters(1).await;
    let fence = tokio::spawn({
        let partition = shards.partition;
        async move { rows_a.fence(partition, 1, GRACE).await }
    });
    shards.a.wait_for_lock_waiters(2).await;
    holder.commit().await.unwrap();
    assert!(matches!(
        in_flight.await.unwrap().unwrap(),
        Outcome::Processed(Effect::Released { copies: 0 })
    ));
    fence.await.unwrap().unwrap();
    shards.copy_and_activate().await;

    assert!(matches!(
        on_b.handle(&placed_for(early, shards.book, 1))
            .await
            .unwrap(),
        Outcome::Processed(Effect::ArrivedAfterCancellation)
    ));
    assert_eq!(
        on_b.handle(&late_placement).await.unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(
        on_b.handle(&early_cancel).await.unwrap(),
        Outcome::Duplicate
    );
    assert_eq!(shards.b.reserved(shards.book).await, 0);
    let released = "SELECT count(*) FROM outbox WHERE subject = 'stock.released'";
    assert_eq!(
        count(&shards.a, released).await + count(&shards.b, released).await,
        1
    );
    let reserved_events = "SELECT count(*) FROM outbox WHERE subject = 'stock.reserved'";
    assert_eq!(
        count(&shards.a, reserved_events).await + count(&shards.b, reserved_events).await,
        1,
        "the late line's reservation only"
    );
}

/// A line cancellation of a book with no stock row takes no stock lock: it share-locks the
/// partition's owner row, which the fence updates, so the fence waits for its mark to commit
/// and the copy holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_line_cancellation_of_a_book_without_stock_holds_the_fence_until_it_commits() {
    let shards = Shards::new().await;
    let (rows_a, rows_b) = shards.rows();
    let unstocked = std::iter::repeat_with(BookId::new_v7)
        .find(|book| partition_of(*book, PARTITIONS) == shards.partition)
        .unwrap();
    let (faults, mut hold) = hold_once_at(CrashPoint::AfterDedupCheck);
    let held = on_shard(&shards.a).with_faults(faults);
    let order = OrderId::new_v7();
    let cancel = Message::cancelled_line(order, unstocked);
    let in_flight = tokio::spawn(async move { held.handle(&cancel).await });
    hold.reached().await;

    let fence = tokio::spawn({
        let partition = shards.partition;
        async move { rows_a.fence(partition, 1, GRACE).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !fence.is_finished(),
        "the fence went past a line cancellation in flight"
    );
    hold.release();
    assert!(in_flight.await.unwrap().unwrap().processed());
    fence.await.unwrap().unwrap();

    let (rows_a, _) = shards.rows();
    let copied = rows_b
        .copy_from(&rows_a, shards.partition, (1, 2), "b")
        .await
        .unwrap();
    assert_eq!(copied.line_cancellations, 1);
    rows_b.activate(shards.partition, 2).await.unwrap();
    // Stock for the book arrives later, on the shard that now holds it: the cancellation wins.
    shards
        .b
        .stock
        .put(&inventory_domain::StockItem::new(unstocked, "Dune", 5).unwrap())
        .await
        .unwrap();
    assert!(matches!(
        on_shard(&shards.b)
            .handle(&placed_for(order, unstocked, 1))
            .await
            .unwrap(),
        Outcome::Processed(Effect::ArrivedAfterCancellation)
    ));
}

/// A session idle in a transaction that holds one of the partition's stock rows would hold
/// the fence for ever: past the grace it is terminated, and the fence goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_idle_in_a_transaction_that_blocks_the_fence_is_terminated() {
    let shards = Shards::new().await;
    let (rows_a, _) = shards.rows();
    let idle = hold_stock_row(&shards.a, shards.book).await;
    let started = std::time::Instant::now();
    tokio::time::timeout(
        Duration::from_secs(20),
        rows_a.fence(shards.partition, 1, Duration::from_secs(1)),
    )
    .await
    .expect("the fence waited on an idle session past its grace")
    .unwrap();
    assert!(started.elapsed() >= Duration::from_secs(1));
    assert!(
        idle.execute_unprepared("SELECT 1").await.is_err(),
        "the idle session is still there"
    );
    assert_eq!(
        rows_a.owner(shards.partition).await.unwrap(),
        Some(OwnerRow {
            epoch: 1,
            state: OwnerState::Fenced
        })
    );
}

/// The removal and an abort's drop of the copy delete stock rows, which an idle session can
/// hold as well as it can hold the fence's: each ends it past the grace, as the fence does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_idle_in_a_transaction_that_blocks_the_removal_or_the_drop_is_terminated() {
    let grace = Duration::from_secs(1);
    let bounded = Duration::from_secs(20);
    let shards = Shards::new().await;
    let (rows_a, rows_b) = shards.rows();
    rows_a.fence(shards.partition, 1, GRACE).await.unwrap();
    rows_b
        .copy_from(&rows_a, shards.partition, (1, 2), "b")
        .await
        .unwrap();

    let idle = hold_stock_row(&shards.b, shards.book).await;
    let dropped = tokio::time::timeout(bounded, rows_b.drop_copy(shards.partition, grace))
        .await
        .expect("the drop waited on an idle session past its grace")
        .unwrap();
    assert_eq!(dropped.books, 1);
    assert!(idle.execute_unprepared("SELECT 1").await.is_err());

    shards.copy_and_activate().await;
    let idle = hold_stock_row(&shards.a, shards.book).await;
    let removed = tokio::time::timeout(bounded, rows_a.remove(shards.partition, 1, grace))
        .await
        .expect("the removal waited on an idle session past its grace")
        .unwrap();
    assert_eq!(removed.books, 1);
    assert!(idle.execute_unprepared("SELECT 1").await.is_err());
}

/// The idle session can be out of the fence's sight: with a placement queued for the row it
/// holds, PostgreSQL names that placement, not the idle session, as what blocks the fence. The
/// fence follows the queue to the idle session and ends it, so the placement goes through,
/// rather than waiting for its statement timeout (or for ever) while the fence waits on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fence_ends_an_idle_session_it_is_blocked_by_through_a_queued_placement() {
    let shards = Shards::new().await;
    let (rows_a, _) = shards.rows();
    let (on_a, _) = shards.handlers();
    let idle = hold_stock_row(&shards.a, shards.book).await;
    let placement = placed_for(OrderId::new_v7(), shards.book, 1);
    let queued = tokio::spawn(async move { on_a.handle(&placement).await });
    shards.a.wait_for_lock_waiters(1).await;
    let fence = tokio::spawn({
        let partition = shards.partition;
        async move { rows_a.fence(partition, 1, Duration::from_secs(1)).await }
    });
    let decided = tokio::time::timeout(Duration::from_secs(60), queued)
        .await
        .expect("the queued placement never went through")
        .unwrap();
    assert!(
        reserved(&decided),
        "the placement queued behind the idle session: {decided:?}"
    );
    tokio::time::timeout(Duration::from_secs(60), fence)
        .await
        .expect("the fence never went through")
        .unwrap()
        .unwrap();
    assert!(
        idle.execute_unprepared("SELECT 1").await.is_err(),
        "the idle session is still there"
    );
}

/// Each action is conditional on what the move left: a copy is refused unless the old shard is
/// fenced at the move's epoch, and refused once the partition is active on the new shard; an
/// abort's unfence gives the old shard a new epoch, so a copy of the aborted move that comes
/// late is refused; a repeated action changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_step_is_refused_unless_the_move_left_what_it_expects_and_repeats_safely() {
    let shards = Shards::new().await;
    let (a, b) = shards.rows();
    let (on_a, _) = shards.handlers();
    assert!(reserved(
        &on_a
            .handle(&placed_for(OrderId::new_v7(), shards.book, 1))
            .await
    ));
    let p = shards.partition;

    let early = b.copy_from(&a, p, (1, 2), "b").await;
    assert!(matches!(early, Err(RowsError::Refused(_))), "{early:?}");
    assert_eq!(
        count(&shards.b, "SELECT count(*) FROM stock_items").await,
        0
    );

    a.fence(p, 1, GRACE).await.unwrap();
    a.fence(p, 1, GRACE).await.unwrap();
    b.copy_from(&a, p, (1, 2), "b").await.unwrap();
    // Again, as a mover that crashed after the copy's commit would: the same rows, once.
    let again = b.copy_from(&a, p, (1, 2), "b").await.unwrap();
    assert_eq!((again.books, again.reservations), (1, 1));
    assert_eq!(
        count(&shards.b, "SELECT count(*) FROM stock_reservations").await,
        1
    );

    // The abort: unfenced at the next epoch, the copy dropped; then a late copy is refused.
    a.unfence(p, (1, 2)).await.unwrap();
    a.unfence(p, (1, 2)).await.unwrap();
    b.drop_copy(p, GRACE).await.unwrap();
    let late = b.copy_from(&a, p, (1, 2), "b").await;
    assert!(matches!(late, Err(RowsError::Refused(_))), "{late:?}");
    assert_eq!(
        count(&shards.b, "SELECT count(*) FROM stock_items").await,
        0
    );
    assert_eq!(
        count(&shards.b, "SELECT count(*) FROM partition_owner").await,
        0
    );
    assert!(reserved(
        &on_a
            .handle(&placed_for(OrderId::new_v7(), shards.book, 1))
            .await
    ));
    // A late fence of the aborted move matches nothing either.
    let stale_fence = a.fence(p, 1, GRACE).await;
    assert!(
        matches!(stale_fence, Err(RowsError::Refused(_))),
        "{stale_fence:?}"
    );
    assert_eq!(
        a.owner(p).await.unwrap(),
        Some(OwnerRow {
            epoch: 2,
            state: OwnerState::Active
        })
    );

    // A second move, to its end: activation, then the copy is refused on the new shard.
    a.fence(p, 2, GRACE).await.unwrap();
    b.copy_from(&a, p, (2, 3), "b").await.unwrap();
    b.activate(p, 3).await.unwrap();
    b.activate(p, 3).await.unwrap();
    let after = b.copy_from(&a, p, (2, 3), "b").await;
    assert!(matches!(after, Err(RowsError::Refused(_))), "{after:?}");
    let dropped = b.drop_copy(p, GRACE).await;
    assert!(matches!(dropped, Err(RowsError::Refused(_))), "{dropped:?}");
    a.remove(p, 2, GRACE).await.unwrap();
    a.remove(p, 2, GRACE).await.unwrap();
    assert_eq!(shards.b.reserved(shards.book).await, 2);
    // The drain's count: the old shard's outbox still holds the two reservations' events (no
    // relay runs here).
    assert_eq!(a.unpublished(p).await.unwrap().rows, 2);
}
