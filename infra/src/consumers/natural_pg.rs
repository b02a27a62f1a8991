//! The natural key on PostgreSQL as one statement per message or per batch, on a connection the
//! lane holds.
//!
//! The same rules as the study's sea-orm handler (reservation key first, a cancellation that
//! came first wins, a rejection is kept, an unknown book writes nothing), in one round trip:
//! [`RESERVE_SQL`] stops at a reservation already there; else it locks the stock rows, then the
//! orders (`lock_line`), decides, inserts the reservations unless their keys are taken
//! meanwhile, and moves stock only where that insert won. It takes its locks in the order every
//! path takes them: stock rows in book order, then orders. `RESERVE_SQL` commits on its own, so
//! no transaction stays open between the steps.
//!
//! A cancellation, of an order or of one line of it, rarer, is a few statements in one
//! transaction on the same connection ([`LOCK_BOOKS_SQL`] to [`RELEASE_SQL`]). Each clone opens its own connection, so a consumer
//! lane never borrows one from a pool (sqlx pings a pooled connection on every return) and
//! prepared statements stay cached.

use std::borrow::Cow;
use std::num::NonZeroU32;
use std::sync::Arc;

use chrono::Utc;
use inventory_domain::shard::partition_of;
use inventory_domain::{
    BookId, Effect, OrderCancelled, OrderPlaced, Outcome, Quantity, ReservationStatus, StockEvent,
    StockEventKind,
};
use sea_orm::DatabaseConnection;
use sea_orm::sqlx::postgres::{PgConnectOptions, PgConnection, PgRow};
use sea_orm::sqlx::{self, ConnectOptions, Connection, Row};
use tokio::sync::Mutex;

use inventory_domain::outbox::partition;
use inventory_domain::stock::second_request_for_reservation as second_request;
use uuid::Uuid;

use super::unknown_book;
use super::{HELD_LINE_SQL, HELD_SQL, HandleError, MARK_CANCELLED_SQL, MARK_LINE_CANCELLED_SQL};
use crate::faults::{CrashPoint, Faults};
use crate::stock::{DataError, int_column, quantity_column, quantity_from, status_from};

/// Placements in one statement, so one commit: one message's alone, a lane's batch together.
/// The steps of the study's sea-orm handler's `reserve` (`benches/src/consumers/natural.rs`), in
/// its order, with the rule of `StockItem::decide_reservation` in `decided`; `lock_line` is the
/// order's lock and says whether the order or the line is cancelled (its migration,
/// `m20261206_000012_create_line_cancellations.rs`, says how). Comments are `/* */`: the pgbench scripts
/// run this text as one line.
///
/// Why two copies cannot both move stock (docs/natural-key.md, docs/statement.md): the
/// connection runs at READ COMMITTED (`db::connect_with` asks for it), so every CTE here reads
/// one snapshot, taken when the statement began, and the data-modifying CTEs see one another
/// only through `RETURNING`. `ON CONFLICT` checks the unique index, not that snapshot: it sees
/// keys committed after the snapshot, and waits for a key another transaction inserted and has
/// not committed (a conflict if it commits, an insert if it rolls back). Stock moves only when
/// `inserted` returned a row, so at most one transaction per key moves it, whatever the message
/// ids. After a wait, `FOR UPDATE` reads the stock rows as last committed and `lock_line` the
/// order's and the line's state with a new snapshot; under REPEATABLE READ the first fails (40001) and the
/// second misses a cancellation committed while it waited.
///
/// A batch decides what one-by-one handling would: a book wanted by several placements that
/// its stock cannot all cover decides none of them here, and the caller decides each alone.
///
/// A lane's prepared statement may keep a generic plan made while the tables were small (a
/// fresh database, before the first ANALYZE), with one-row estimates everywhere; the shapes
/// below stay cheap under such a plan as the tables and the batch grow.
pub const RESERVE_SQL: &str = "\
WITH input AS (
    /* idx is a placement's place in the batch: its result's row, and which copy of a key
       counts. */
    SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::int4[], $4::text[], $5::int4[],
                         $6::uuid[], $7::int2[], $8::int2[])
        AS input(order_id, book_id, quantity, message_id, idx, event_id, relay_partition,
                 shard_partition)
), probed AS (
    /* Each placement's key, looked up before any lock, so that a copy of a decided placement
       ends here, having read one row and locked nothing. Probed per placement (LATERAL,
       LIMIT 1, one index lookup each), never joined: under a plan made on a small table the
       join hashes all of stock_reservations on every batch. */
    SELECT input.*, existing.quantity AS existing_quantity
    FROM input
    LEFT JOIN LATERAL (
        SELECT r.quantity FROM stock_reservations r
        WHERE r.order_id = input.order_id AND r.book_id = input.book_id
        LIMIT 1
    ) existing ON true
), books AS (
    /* Every placement of a book queues on its row's lock, taken in book order, as on every
       path, so that two batches sharing books never wait for each other in a cycle. Once
       granted, FOR UPDATE reads the row as last committed, so available counts what others
       reserved meanwhile. */
    SELECT book_id, on_hand - reserved AS available
    FROM stock_items
    WHERE book_id IN (SELECT book_id FROM probed WHERE existing_quantity IS NULL)
    ORDER BY book_id
    FOR UPDATE
), owned AS (
    /* On a shard (shard_partition set), whether this database owns each partition wanted,
       asked once the books' rows are locked (the one-time filter waits for books) and with a
       snapshot of owns_partition's own, so an ownership given up while this statement waited
       is seen. A placement of a partition not owned here decides nothing, whether or not its
       book has a row here: an instance whose view of the assignment lags is refused by the
       database. Unsharded (NULL), nothing is asked. */
    SELECT shard_partition, owns_partition(shard_partition) AS owned
    FROM (SELECT DISTINCT shard_partition FROM probed
          WHERE existing_quantity IS NULL AND shard_partition IS NOT NULL
          ORDER BY shard_partition OFFSET 0) wanted_partitions
    WHERE (SELECT count(*) FROM books) >= 0
), fresh AS (
    /* Each key's first placement, unless the key has a reservation already. */
    SELECT DISTINCT ON (probed.order_id, probed.book_id) probed.*
    FROM probed JOIN books USING (book_id)
    LEFT JOIN owned USING (shard_partition)
    WHERE probed.existing_quantity IS NULL AND owned.owned IS NOT FALSE
    ORDER BY probed.order_id, probed.book_id, probed.idx
), guard AS (
    /* lock_line is the order's lock, taken after its books' rows, in order_id order: a
       cancellation of the order or of the line in flight finishes first, or waits for this
       statement. It reads whether the order or this line is cancelled with a snapshot of its
       own, taken once the lock is granted, so a cancellation that committed while this
       statement waited still wins. It writes nothing (an advisory lock). */
    SELECT order_id, book_id, lock_line(order_id, book_id) AS cancelled
    FROM (SELECT order_id, book_id FROM fresh ORDER BY order_id, book_id OFFSET 0) lines
), wanted AS (
    SELECT fresh.book_id, sum(fresh.quantity) AS copies, count(*) AS placements
    FROM fresh JOIN guard USING (order_id, book_id)
    WHERE NOT guard.cancelled
    GROUP BY fresh.book_id
), decided AS (
    /* A cancelled order's placement is released whatever the stock. A book that covers all
       that is wanted of it reserves it; one wanted by one placement it cannot cover rejects
       it, as that placement alone would be; one that cannot cover several decides none. */
    SELECT fresh.*, books.available,
           CASE WHEN guard.cancelled THEN 'released'
                WHEN wanted.copies <= books.available THEN 'reserved'
                ELSE 'rejected' END AS status
    FROM fresh
    JOIN guard USING (order_id, book_id)
    JOIN books USING (book_id)
    LEFT JOIN wanted USING (book_id)
    WHERE guard.cancelled OR wanted.copies <= books.available OR wanted.placements = 1
), inserted AS (
    /* A copy that committed while this statement waited for a lock holds the key, and
       probed, read before the wait, cannot see it. Then nothing is inserted, nothing moves,
       and the caller reads the key again (EXISTING_SQL). */
    INSERT INTO stock_reservations (order_id, book_id, quantity, status, message_id, created_at)
    SELECT order_id, book_id, quantity, status, message_id, now() FROM decided
    ON CONFLICT (order_id, book_id) DO NOTHING
    RETURNING order_id, book_id, status
), moved AS (
    UPDATE stock_items SET reserved = stock_items.reserved + won.copies
    FROM (
        SELECT inserted.book_id, sum(decided.quantity) AS copies
        FROM inserted JOIN decided USING (order_id, book_id)
        WHERE inserted.status = 'reserved'
        GROUP BY inserted.book_id
    ) won
    WHERE stock_items.book_id = won.book_id
), event AS (
    /* Each decision's event, committed with it (the outbox), in batch order. Written after
       guard took the orders' locks, so the events of one order are numbered in commit order.
       A placement after the cancellation (released) decided nothing and writes none. The body
       is StockEvent::body's, built here; a test holds the two equal
       (the_statements_write_the_domains_body_for_every_kind). */
    INSERT INTO outbox (event_id, relay_partition, shard_partition, order_id, subject, payload,
                        created_at)
    SELECT decided.event_id, decided.relay_partition, decided.shard_partition, decided.order_id,
           'stock.' || inserted.status,
           jsonb_strip_nulls(jsonb_build_object(
               'event_id', decided.event_id, 'order_id', decided.order_id,
               'book_id', decided.book_id, 'quantity', decided.quantity,
               'occurred_at', now(), 'caused_by', decided.message_id,
               'available', CASE WHEN inserted.status = 'rejected' THEN decided.available END
           ))::text,
           now()
    FROM inserted JOIN decided USING (order_id, book_id)
    WHERE inserted.status IN ('reserved', 'rejected')
    ORDER BY decided.idx
), outcome AS MATERIALIZED (
    /* Computed once. Inlined, the planner may rerun this join for every input row, cheap by
       its one-row estimates and slow at a batch of 64. */
    SELECT decided.idx, inserted.status, decided.available
    FROM inserted JOIN decided USING (order_id, book_id)
)
SELECT probed.idx,
       books.book_id IS NOT NULL OR probed.existing_quantity IS NOT NULL AS book_found,
       owned.owned IS FALSE AS not_owned,
       outcome.status AS inserted_status,
       outcome.available,
       probed.existing_quantity
FROM probed
LEFT JOIN books USING (book_id)
LEFT JOIN owned USING (shard_partition)
LEFT JOIN outcome USING (idx)
ORDER BY probed.idx";

/// A statement sees only what was committed when it began, so when a copy committed while
/// [`RESERVE_SQL`] waited for a lock, that statement's insert finds the key taken but its
/// `probed` cannot read the row. A new statement can.
pub const EXISTING_SQL: &str =
    "SELECT quantity FROM stock_reservations WHERE order_id = $1 AND book_id = $2";

/// A cancellation's first lock: the stock rows of the books its order holds, in book order, as
/// every path locks them. Read without a lock first, so a placement of the order that commits
/// after this read shows up in `HELD_SQL`, read again under the order's lock, and the
/// cancellation starts over with that book among those it locks.
pub const LOCK_BOOKS_SQL: &str = "\
SELECT book_id FROM stock_items
WHERE book_id IN (
    SELECT book_id FROM stock_reservations WHERE order_id = $1 AND status = 'reserved'
)
ORDER BY book_id
FOR UPDATE";

/// Whether this database owns a partition ($1), outside any placement.
pub const OWNS_SQL: &str = "SELECT owns_partition($1)";

/// Whether this database owns a line's partition ($1), for the line's cancellation: its owner
/// row share-locked until the cancellation commits, so that a move's fence, which updates
/// that row, waits for it. A cancellation of a book with no stock row here takes no stock lock
/// the fence would wait on; without this one, its mark could commit after the move copied the
/// partition, and be lost.
pub const OWNS_LINE_SQL: &str = "\
SELECT EXISTS (
    SELECT 1 FROM partition_owner
    WHERE partition_id = $1 AND state = 'active'
    FOR SHARE
)";

/// A line's cancellation's first lock: its book's stock row, as the line's placement takes it,
/// whether or not the line holds stock yet.
pub const LOCK_LINE_BOOK_SQL: &str =
    "SELECT book_id FROM stock_items WHERE book_id = $1 FOR UPDATE";

/// The order's lock, taken after its books' (`lock_order`'s migration says what it reads).
pub const LOCK_ORDER_SQL: &str = "SELECT lock_order($1)";

/// One reservation released: its status, the copies given back to stock, and the release's
/// event ($3 its id, $4 its relay partition, $5 its body, $6 its book's partition on a shard),
/// only if the reservation still held them.
pub const RELEASE_SQL: &str = "\
WITH released AS (
    UPDATE stock_reservations SET status = 'released'
    WHERE order_id = $1 AND book_id = $2 AND status = 'reserved'
    RETURNING book_id, quantity
), moved AS (
    UPDATE stock_items SET reserved = stock_items.reserved - released.quantity
    FROM released WHERE stock_items.book_id = released.book_id
)
INSERT INTO outbox (event_id, relay_partition, shard_partition, order_id, subject, payload,
                    created_at)
SELECT $3, $4, $6, $1, 'stock.released', $5, now() FROM released";

pub struct PgNaturalKey {
    options: Arc<PgConnectOptions>,
    /// On a shard, the orders stream's partitions: each placement asks the database whether it
    /// owns its book's partition. `None`: unsharded, nothing asked.
    partitions: Option<NonZeroU32>,
    /// The pool's bound on getting a connection, which opening one here keeps too.
    connect_timeout: std::time::Duration,
    connection: Mutex<Option<PgConnection>>,
}

impl Clone for PgNaturalKey {
    /// A clone is another lane: same database, its own connection (opened on first use).
    fn clone(&self) -> Self {
        Self {
            options: self.options.clone(),
            partitions: self.partitions,
            connect_timeout: self.connect_timeout,
            connection: Mutex::new(None),
        }
    }
}

impl PgNaturalKey {
    /// The path on `db`, a PostgreSQL pool whose options its lanes' connections take.
    pub(super) fn new(db: &DatabaseConnection) -> Self {
        let pool = db.get_postgres_connection_pool();
        let connect_timeout = pool.options().get_acquire_timeout();
        let options = pool
            .connect_options()
            .as_ref()
            .clone()
            // Statements are the hot path here: sea-orm's pool logs them at DEBUG already.
            .log_statements(tracing::log::LevelFilter::Trace);
        Self {
            options: Arc::new(options),
            partitions: None,
            connect_timeout,
            connection: Mutex::new(None),
        }
    }

    /// The same path on a shard of `partitions` partitions.
    pub(super) fn on_shard(&self, partitions: NonZeroU32) -> Self {
        Self {
            partitions: Some(partitions),
            ..self.clone()
        }
    }

    /// Runs `work` on this lane's connection, opening it first if need be (within the pool's
    /// acquire timeout); a failure drops the connection, which may be broken, and the next
    /// call opens a new one. The connection is out of its slot while in use, so work
    /// abandoned mid-statement (the lane's bound expired) drops it too: a connection in an
    /// unknown state is never used again.
    async fn with_connection<T>(
        &self,
        work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, HandleError>,
    ) -> Result<T, HandleError> {
        let mut slot = self.connection.lock().await;
        let mut connection = match slot.take() {
            Some(connection) => connection,
            None => tokio::time::timeout(self.connect_timeout, self.options.connect())
                .await
                .map_err(|_| HandleError::TimedOut(self.connect_timeout))?
                .map_err(HandleError::from_sqlx)?,
        };
        let result = work(&mut connection).await;
        if result.is_ok() {
            *slot = Some(connection);
        }
        result
    }

    /// Whether this database owns `book`'s partition: always, unsharded.
    pub(super) async fn owns(&self, book: BookId) -> Result<bool, HandleError> {
        let partitions = self.partitions;
        self.with_connection(async |connection| owns(connection, partitions, book).await)
            .await
    }

    /// One placement, through the statement alone.
    pub(super) async fn place(
        &self,
        key: &str,
        placed: &OrderPlaced,
    ) -> Result<Outcome, HandleError> {
        let partitions = self.partitions;
        self.with_connection(async |connection| {
            decide_alone(connection, partitions, key, placed).await
        })
        .await
    }

    /// A cancellation, in a transaction of its own on this lane's connection.
    pub(super) async fn cancel(
        &self,
        key: &str,
        cancelled: &OrderCancelled,
        faults: &Faults,
    ) -> Result<Outcome, HandleError> {
        let partitions = self.partitions;
        self.with_connection(async |connection| {
            cancel(connection, partitions, key, cancelled, faults).await
        })
        .await
    }

    /// Placements through the statement together. `Err`: the statement failed and nothing of
    /// the batch committed. `Ok`: it committed, with one result per placement in order; a
    /// placement whose row cannot be read fails alone.
    pub(super) async fn place_together(
        &self,
        placements: &[(Cow<'_, str>, &OrderPlaced)],
    ) -> Result<Vec<Result<Outcome, HandleError>>, HandleError> {
        let partitions = self.partitions;
        self.with_connection(async |connection| {
            let rows = reserve(connection, partitions, placements).await?;
            let mut results: Vec<Result<Outcome, HandleError>> =
                Vec::with_capacity(placements.len());
            for ((key, placed), row) in placements.iter().zip(&rows) {
                let earlier_in_batch = placements
                    .iter()
                    .zip(&results)
                    .find(|((_, other), result)| {
                        other.order_id == placed.order_id
                            && other.book_id == placed.book_id
                            && result.as_ref().is_ok_and(Outcome::processed)
                    })
                    .map(|((_, other), _)| other.quantity);
                results.push(match decision(row, placed, earlier_in_batch) {
                    Ok(Some(outcome)) => Ok(outcome),
                    // Stock too short for all the batch wanted of the book, or a copy another
                    // lane committed meanwhile: decided alone, exactly as without batching.
                    Ok(None) => decide_alone(connection, partitions, key, placed).await,
                    Err(error) => Err(error),
                });
            }
            Ok(results)
        })
        .await
    }
}

/// [`RESERVE_SQL`] on `placements`: a row for each, in order. On a shard of `partitions`,
/// each placement names its book's partition, whose ownership the statement checks.
async fn reserve(
    connection: &mut PgConnection,
    partitions: Option<NonZeroU32>,
    placements: &[(Cow<'_, str>, &OrderPlaced)],
) -> Result<Vec<PgRow>, HandleError> {
    let mut orders = Vec::with_capacity(placements.len());
    let mut books = Vec::with_capacity(placements.len());
    let mut quantities = Vec::with_capacity(placements.len());
    let mut keys = Vec::with_capacity(placements.len());
    let mut indexes = Vec::with_capacity(placements.len());
    let mut event_ids = Vec::with_capacity(placements.len());
    let mut relay_partitions = Vec::with_capacity(placements.len());
    let mut shard_partitions = Vec::with_capacity(placements.len());
    for (index, (key, placed)) in placements.iter().enumerate() {
        orders.push(placed.order_id.as_uuid());
        books.push(placed.book_id.as_uuid());
        quantities.push(quantity_column(placed.quantity.get())?);
        keys.push(key.as_ref());
        indexes.push(int_column("batch index", index)?);
        event_ids.push(Uuid::now_v7());
        relay_partitions.push(partition(placed.order_id));
        shard_partitions.push(
            partitions
                .map(|partitions| shard_partition(placed.book_id, partitions))
                .transpose()?,
        );
    }
    sqlx::query(RESERVE_SQL)
        .bind(&orders)
        .bind(&books)
        .bind(&quantities)
        .bind(&keys)
        .bind(&indexes)
        .bind(&event_ids)
        .bind(&relay_partitions)
        .bind(&shard_partitions)
        .fetch_all(&mut *connection)
        .await
        .map_err(HandleError::from_sqlx)
}

/// `book`'s partition as the statement takes it: `partition_of` is below `partitions`, which
/// the stream's configuration keeps far below `i16::MAX`.
fn shard_partition(book: BookId, partitions: NonZeroU32) -> Result<i16, HandleError> {
    i16::try_from(partition_of(book, partitions))
        .map_err(|_| HandleError::Internal("a partition number past i16::MAX"))
}

/// What the statement's row says of one placement; `earlier_in_batch` is the quantity of a copy
/// of it earlier in the same batch that the statement decided. `None`: it decided nothing of
/// it.
fn decision(
    row: &PgRow,
    placed: &OrderPlaced,
    earlier_in_batch: Option<Quantity>,
) -> Result<Option<Outcome>, HandleError> {
    let not_owned: bool = row.try_get("not_owned").map_err(HandleError::from_sqlx)?;
    if not_owned {
        return Err(HandleError::NotOwned {
            book: placed.book_id,
        });
    }
    let book_found: bool = row.try_get("book_found").map_err(HandleError::from_sqlx)?;
    let inserted: Option<&str> = row
        .try_get("inserted_status")
        .map_err(HandleError::from_sqlx)?;
    let available: Option<i32> = row.try_get("available").map_err(HandleError::from_sqlx)?;
    let existing: Option<i32> = row
        .try_get("existing_quantity")
        .map_err(HandleError::from_sqlx)?;
    Ok(if !book_found {
        Some(unknown_book(placed.book_id))
    } else if let Some(status) = inserted {
        Some(placement_effect(status, placed, available)?)
    } else if let Some(existing) = existing {
        Some(second_request(quantity_from(existing)?, placed.quantity))
    } else {
        earlier_in_batch.map(|earlier| second_request(earlier, placed.quantity))
    })
}

fn placement_effect(
    status: &str,
    placed: &OrderPlaced,
    available: Option<i32>,
) -> Result<Outcome, HandleError> {
    let status = status_from(status)?;
    Ok(Outcome::Processed(match status {
        ReservationStatus::Reserved => Effect::Reserved {
            quantity: placed.quantity,
        },
        ReservationStatus::Released => Effect::ArrivedAfterCancellation,
        ReservationStatus::Rejected => Effect::Rejected {
            requested: placed.quantity,
            available: available.map_or(0, i64::from),
        },
    }))
}

/// One placement alone, which the statement always decides, unless a copy committed while it
/// waited for a lock: then the key is read again.
async fn decide_alone(
    connection: &mut PgConnection,
    partitions: Option<NonZeroU32>,
    key: &str,
    placed: &OrderPlaced,
) -> Result<Outcome, HandleError> {
    let rows = reserve(connection, partitions, &[(Cow::Borrowed(key), placed)]).await?;
    let row = rows
        .first()
        .ok_or(HandleError::Internal("the statement returned no row"))?;
    if let Some(outcome) = decision(row, placed, None)? {
        return Ok(outcome);
    }
    let existing: Option<i32> = sqlx::query_scalar(EXISTING_SQL)
        .bind(placed.order_id.as_uuid())
        .bind(placed.book_id.as_uuid())
        .fetch_optional(&mut *connection)
        .await
        .map_err(HandleError::from_sqlx)?;
    match existing {
        Some(existing) => Ok(second_request(quantity_from(existing)?, placed.quantity)),
        // The key was there when the insert conflicted. A move removes a partition's rows from
        // its old shard after the hand-over: the new owner holds the key now, and decides.
        None if !owns(connection, partitions, placed.book_id).await? => {
            Err(HandleError::NotOwned {
                book: placed.book_id,
            })
        }
        None => Err(DataError::Vanished {
            table: "stock_reservations",
        }
        .into()),
    }
}

/// Whether this database owns `book`'s partition: always, unsharded.
async fn owns(
    connection: &mut PgConnection,
    partitions: Option<NonZeroU32>,
    book: BookId,
) -> Result<bool, HandleError> {
    let Some(partitions) = partitions else {
        return Ok(true);
    };
    sqlx::query_scalar(OWNS_SQL)
        .bind(shard_partition(book, partitions)?)
        .fetch_one(&mut *connection)
        .await
        .map_err(HandleError::from_sqlx)
}

/// A cancellation in one transaction, its locks in the order of every path: the stock rows of
/// the books its order holds (a line's: its book's row), then the order's lock, then the mark;
/// then, unless the mark was there already, each reservation the order (or the line) holds
/// released with its event. Starts over when a placement of the order committed after its
/// books were read, so that book's row is locked before the order's too. On a shard, a line
/// whose book's partition this database does not own is not cancelled here.
async fn cancel(
    connection: &mut PgConnection,
    partitions: Option<NonZeroU32>,
    key: &str,
    cancelled: &OrderCancelled,
    faults: &Faults,
) -> Result<Outcome, HandleError> {
    let order = cancelled.order_id.as_uuid();
    loop {
        let mut txn = connection.begin().await.map_err(HandleError::from_sqlx)?;
        let locked: Vec<Uuid> = match cancelled.book_id {
            None => sqlx::query_scalar(LOCK_BOOKS_SQL).bind(order),
            Some(book) => sqlx::query_scalar(LOCK_LINE_BOOK_SQL).bind(book.as_uuid()),
        }
        .fetch_all(&mut *txn)
        .await
        .map_err(HandleError::from_sqlx)?;
        if let (Some(partitions), Some(book)) = (partitions, cancelled.book_id) {
            let owned: bool = sqlx::query_scalar(OWNS_LINE_SQL)
                .bind(shard_partition(book, partitions)?)
                .fetch_one(&mut *txn)
                .await
                .map_err(HandleError::from_sqlx)?;
            if !owned {
                txn.rollback().await.map_err(HandleError::from_sqlx)?;
                return Err(HandleError::NotOwned { book });
            }
        }
        sqlx::query(LOCK_ORDER_SQL)
            .bind(order)
            .execute(&mut *txn)
            .await
            .map_err(HandleError::from_sqlx)?;
        let now = Utc::now();
        let marked = match cancelled.book_id {
            None => sqlx::query(MARK_CANCELLED_SQL)
                .bind(order)
                .bind(now)
                .bind(key),
            Some(book) => sqlx::query(MARK_LINE_CANCELLED_SQL)
                .bind(order)
                .bind(book.as_uuid())
                .bind(now)
                .bind(key),
        }
        .execute(&mut *txn)
        .await
        .map_err(HandleError::from_sqlx)?;
        if marked.rows_affected() == 0 {
            txn.rollback().await.map_err(HandleError::from_sqlx)?;
            return Ok(Outcome::Duplicate);
        }
        // No placement of the order can commit from here on: the order's lock is taken.
        let held: Vec<(Uuid, i32)> = match cancelled.book_id {
            None => sqlx::query_as(HELD_SQL).bind(order),
            Some(book) => sqlx::query_as(HELD_LINE_SQL)
                .bind(order)
                .bind(book.as_uuid()),
        }
        .fetch_all(&mut *txn)
        .await
        .map_err(HandleError::from_sqlx)?;
        if held.iter().any(|(book, _)| !locked.contains(book)) {
            txn.rollback().await.map_err(HandleError::from_sqlx)?;
            continue;
        }
        faults.pass(CrashPoint::AfterDedupCheck).await?;
        let mut copies = 0;
        for (book, quantity) in held {
            let quantity = quantity_from(quantity)?;
            let event = StockEvent::new(
                StockEventKind::Released,
                cancelled.order_id,
                book.into(),
                quantity,
                key,
            );
            sqlx::query(RELEASE_SQL)
                .bind(order)
                .bind(book)
                .bind(event.event_id)
                .bind(partition(cancelled.order_id))
                .bind(event.body())
                .bind(
                    partitions
                        .map(|partitions| shard_partition(book.into(), partitions))
                        .transpose()?,
                )
                .execute(&mut *txn)
                .await
                .map_err(HandleError::from_sqlx)?;
            copies += i64::from(quantity.get());
        }
        faults.pass(CrashPoint::BeforeCommit).await?;
        txn.commit().await.map_err(HandleError::from_sqlx)?;
        return Ok(Outcome::Processed(Effect::Released { copies }));
    }
}
