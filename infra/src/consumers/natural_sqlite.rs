//! The natural key on SQLite through the one writer SQLite has: one connection for every lane
//! of the process, each placement's statements in `BEGIN IMMEDIATE … COMMIT`, and a batch of
//! placements in one such transaction, so one commit.
//!
//! SQLite lets one transaction write at a time. Lanes that each began one on a pool queued in
//! SQLite's busy handler, which sleeps between tries, and the writer stood idle while they
//! slept. Here every clone shares one connection behind a mutex: the lanes queue on the mutex,
//! and a commit hands the writer straight to the next lane. A cancellation runs on it too.
//!
//! The rule is the reference handler's (`natural.rs`): the reservation key first (a copy or a
//! new-id resend of a decided placement reads one row and writes nothing), an unknown book
//! writes nothing, a cancellation that came first wins (the placement finds
//! `order_states.cancelled_at` set and records a `released` reservation, moving no stock), the
//! reservation is inserted unless its key is taken, and stock moves only if that insert won.
//! A placement only reads `order_states`: the writer lock `BEGIN IMMEDIATE` takes orders it
//! with every cancellation of its order, and with the events of that order in the outbox.
//!
//! `writer_options`, `in_transaction`, `reserve` and `reserve_each` are public so that
//! `inventory bench sqlite-bound` runs these very statements, on a connection made the same
//! way, in a loop without NATS: the bound the service is measured against. [`READ_SQL`] and [`WRITE_SQL`] are public for `inventory bench hand-written`, which
//! runs them in a consumer written by hand.

use std::borrow::Cow;
use std::sync::Arc;

use chrono::Utc;
use inventory_domain::outbox::partition;
use inventory_domain::stock::second_request_for_reservation as second_request;
use inventory_domain::{
    Effect, OrderCancelled, OrderPlaced, Outcome, ReservationDecision, ReservationStatus,
    StockEvent, StockEventKind, StockItem,
};
use sea_orm::DatabaseConnection;
use sea_orm::sqlx::sqlite::{SqliteConnectOptions, SqliteConnection};
use sea_orm::sqlx::{self, ConnectOptions, Connection, Row};
use tokio::sync::Mutex;

use uuid::Uuid;

use super::unknown_book;
use super::{HELD_LINE_SQL, HELD_SQL, HandleError, MARK_CANCELLED_SQL, MARK_LINE_CANCELLED_SQL};
use crate::faults::{CrashPoint, Faults};
use crate::stock::{DataError, int_column, quantity_column, quantity_from};

/// What a placement reads before it writes: its reservation, the stock row, and whether its
/// order, or its line, is cancelled, in one statement.
pub const READ_SQL: &str = "\
SELECT (SELECT quantity FROM stock_reservations WHERE order_id = $1 AND book_id = $2) AS existing,
       stock_items.title, stock_items.on_hand, stock_items.reserved,
       EXISTS (SELECT 1 FROM order_states WHERE order_id = $1 AND cancelled_at IS NOT NULL)
       OR EXISTS (SELECT 1 FROM line_cancellations WHERE order_id = $1 AND book_id = $2)
           AS cancelled
FROM (SELECT 1) LEFT JOIN stock_items ON stock_items.book_id = $2";

/// What a placement writes, in one call (each statement a round trip to sqlx's worker thread
/// otherwise): the reservation unless its key is taken; the decision's event ($8: its subject,
/// NULL when there is none) only if that insert won; the stock row ($7: `reserved` after, NULL
/// when no stock moves) only if the event was written. `changes()` is the rows the statement
/// before wrote, so each step runs only if the one before wrote its row, and the rows affected
/// add up to 0 exactly when the key was taken.
pub const WRITE_SQL: &str = "\
INSERT INTO stock_reservations (order_id, book_id, quantity, status, message_id, created_at)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (order_id, book_id) DO NOTHING;
INSERT INTO outbox (event_id, relay_partition, order_id, subject, payload, created_at)
SELECT $9, $10, $1, $8, $11, $6 WHERE $8 IS NOT NULL AND changes() = 1;
UPDATE stock_items SET reserved = $7 WHERE book_id = $2 AND $7 IS NOT NULL AND changes() = 1";

/// One reservation released, under the writer lock: its status; the copies ($3) given back to
/// stock and the release's event ($4 its id, $5 its partition, $6 its subject, $7 its body),
/// each only if the statement before wrote its row.
pub const RELEASE_SQL: &str = "\
UPDATE stock_reservations SET status = 'released'
WHERE order_id = $1 AND book_id = $2 AND status = 'reserved';
UPDATE stock_items SET reserved = reserved - $3 WHERE book_id = $2 AND changes() = 1;
INSERT INTO outbox (event_id, relay_partition, order_id, subject, payload, created_at)
SELECT $4, $5, $1, $6, $7, $8 WHERE changes() = 1";

/// The natural key's path on SQLite. Clones share the writer.
#[derive(Clone)]
pub struct SqliteNaturalKey {
    writer: Arc<Writer>,
}

/// The one writer connection, opened on first use.
struct Writer {
    options: SqliteConnectOptions,
    connection: Mutex<Option<SqliteConnection>>,
}

impl SqliteNaturalKey {
    /// The path on `db`, a SQLite pool: the writer opens the pool's file with the pool's
    /// options (WAL, busy timeout, synchronous FULL).
    pub(super) fn new(db: &DatabaseConnection) -> Self {
        Self {
            writer: Arc::new(Writer {
                options: writer_options(db),
                connection: Mutex::new(None),
            }),
        }
    }

    /// Runs `work` in one `BEGIN IMMEDIATE` transaction on the writer, opening it first if need
    /// be; commits when `work` succeeds. A failure rolls back and drops the connection, which
    /// may be broken; the next call opens a new one.
    async fn write<T>(
        &self,
        work: impl AsyncFnOnce(&mut SqliteConnection) -> Result<T, HandleError>,
    ) -> Result<T, HandleError> {
        let mut slot = self.writer.connection.lock().await;
        let connection = match slot.as_mut() {
            Some(connection) => connection,
            None => slot.insert(
                self.writer
                    .options
                    .connect()
                    .await
                    .map_err(HandleError::from_sqlx)?,
            ),
        };
        let result = in_transaction(connection, work).await;
        if result.is_err() {
            *slot = None;
        }
        result
    }

    /// One placement, in a transaction of its own.
    pub(super) async fn place(
        &self,
        key: &str,
        placed: &OrderPlaced,
    ) -> Result<Outcome, HandleError> {
        self.write(async |connection| reserve(connection, key, placed).await)
            .await
    }

    /// Placements in one transaction; `Err`: nothing of them committed.
    pub(super) async fn place_together(
        &self,
        placements: &[(Cow<'_, str>, &OrderPlaced)],
    ) -> Result<Vec<Result<Outcome, HandleError>>, HandleError> {
        let outcomes = self
            .write(async |connection| reserve_each(connection, placements).await)
            .await?;
        Ok(outcomes.into_iter().map(Ok).collect())
    }

    /// A cancellation, in a transaction of its own.
    pub(super) async fn cancel(
        &self,
        key: &str,
        cancelled: &OrderCancelled,
        faults: &Faults,
    ) -> Result<Outcome, HandleError> {
        self.write(async |connection| cancel(connection, key, cancelled, faults).await)
            .await
    }
}

/// How the writer connects: with the options of `db`'s pool (WAL, busy timeout, synchronous
/// FULL), its statements logged at TRACE since they are the hot path (sea-orm's pool logs
/// them at DEBUG already).
pub fn writer_options(db: &DatabaseConnection) -> SqliteConnectOptions {
    db.get_sqlite_connection_pool()
        .connect_options()
        .as_ref()
        .clone()
        .log_statements(tracing::log::LevelFilter::Trace)
}

/// `work` between `BEGIN IMMEDIATE` and `COMMIT`; rolled back if it fails.
pub async fn in_transaction<T>(
    connection: &mut SqliteConnection,
    work: impl AsyncFnOnce(&mut SqliteConnection) -> Result<T, HandleError>,
) -> Result<T, HandleError> {
    let mut transaction = connection
        .begin_with("BEGIN IMMEDIATE")
        .await
        .map_err(HandleError::from_sqlx)?;
    // Dropped on an error, the transaction rolls back.
    let value = work(&mut transaction).await?;
    transaction.commit().await.map_err(HandleError::from_sqlx)?;
    Ok(value)
}

/// One placement's statements, inside the caller's `BEGIN IMMEDIATE` transaction; they write
/// only what the placement decides (a copy, a resend or an unknown book writes nothing).
pub async fn reserve(
    connection: &mut SqliteConnection,
    key: &str,
    placed: &OrderPlaced,
) -> Result<Outcome, HandleError> {
    let order = placed.order_id.as_uuid();
    let book = placed.book_id.as_uuid();
    let row = sqlx::query(READ_SQL)
        .bind(order)
        .bind(book)
        .fetch_one(&mut *connection)
        .await
        .map_err(HandleError::from_sqlx)?;
    let column = |name: &str| {
        row.try_get::<Option<i32>, _>(name)
            .map_err(HandleError::from_sqlx)
    };
    if let Some(existing) = column("existing")? {
        return Ok(second_request(quantity_from(existing)?, placed.quantity));
    }
    let (Some(on_hand), Some(reserved)) = (column("on_hand")?, column("reserved")?) else {
        return Ok(unknown_book(placed.book_id));
    };
    let stock = StockItem {
        book_id: placed.book_id,
        title: row.try_get("title").map_err(HandleError::from_sqlx)?,
        on_hand: on_hand.into(),
        reserved: reserved.into(),
    };
    let cancelled: bool = row.try_get("cancelled").map_err(HandleError::from_sqlx)?;
    let decision = (!cancelled).then(|| stock.decide_reservation(placed.quantity));
    let status = decision
        .as_ref()
        .map_or(ReservationStatus::Released, ReservationDecision::status);
    // The event as `outbox::record` writes it, and the stock row as it will be.
    let (event, reserved_after) = match &decision {
        None => (None, None),
        Some(ReservationDecision::Reserve { reserved_after }) => (
            Some(StockEventKind::Reserved),
            Some(int_column("reserved", *reserved_after)?),
        ),
        Some(ReservationDecision::Reject { available, .. }) => (
            Some(StockEventKind::Rejected {
                available: *available,
            }),
            None,
        ),
    };
    let event = event
        .map(|kind| StockEvent::new(kind, placed.order_id, placed.book_id, placed.quantity, key));
    let written = sqlx::query(WRITE_SQL)
        .bind(order)
        .bind(book)
        .bind(quantity_column(placed.quantity.get())?)
        .bind(status.as_str())
        .bind(key)
        .bind(Utc::now())
        .bind(reserved_after)
        .bind(event.as_ref().map(StockEvent::subject_token))
        .bind(event.as_ref().map(|event| event.event_id))
        .bind(partition(placed.order_id))
        .bind(event.as_ref().map(StockEvent::body))
        .execute(&mut *connection)
        .await
        .map_err(HandleError::from_sqlx)?;
    if written.rows_affected() == 0 {
        // Under the write lock nothing can take the key after READ_SQL looked; the reference
        // handler's answer all the same, should the table hold what that read missed.
        let existing: Option<i32> = sqlx::query(READ_SQL)
            .bind(order)
            .bind(book)
            .fetch_one(&mut *connection)
            .await
            .and_then(|row| row.try_get("existing"))
            .map_err(HandleError::from_sqlx)?;
        let existing = existing.ok_or(DataError::Vanished {
            table: "stock_reservations",
        })?;
        return Ok(second_request(quantity_from(existing)?, placed.quantity));
    }
    Ok(Outcome::Processed(match decision {
        Some(decision) => decision.effect(placed.quantity),
        None => Effect::ArrivedAfterCancellation,
    }))
}

/// Placements one after another in the caller's transaction, so a copy of a key later in the
/// batch reads what an earlier one wrote and is a second request. The first error ends it:
/// the caller rolls back, and nothing of the batch is written.
pub async fn reserve_each(
    connection: &mut SqliteConnection,
    placements: &[(Cow<'_, str>, &OrderPlaced)],
) -> Result<Vec<Outcome>, HandleError> {
    let mut outcomes = Vec::with_capacity(placements.len());
    for (key, placed) in placements {
        outcomes.push(reserve(connection, key, placed).await?);
    }
    Ok(outcomes)
}

/// A cancellation, inside the caller's `BEGIN IMMEDIATE` transaction: the mark (the order's, or
/// its line's), then, unless it was there already, each reservation the order (or the line)
/// holds released with its event. The writer lock keeps every placement of the order out
/// meanwhile.
async fn cancel(
    connection: &mut SqliteConnection,
    key: &str,
    cancelled: &OrderCancelled,
    faults: &Faults,
) -> Result<Outcome, HandleError> {
    let order = cancelled.order_id.as_uuid();
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
    .execute(&mut *connection)
    .await
    .map_err(HandleError::from_sqlx)?;
    if marked.rows_affected() == 0 {
        return Ok(Outcome::Duplicate);
    }
    let held: Vec<(Uuid, i32)> = match cancelled.book_id {
        None => sqlx::query_as(HELD_SQL).bind(order),
        Some(book) => sqlx::query_as(HELD_LINE_SQL)
            .bind(order)
            .bind(book.as_uuid()),
    }
    .fetch_all(&mut *connection)
    .await
    .map_err(HandleError::from_sqlx)?;
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
            .bind(quantity_column(quantity.get())?)
            .bind(event.event_id)
            .bind(partition(cancelled.order_id))
            .bind(event.subject_token())
            .bind(event.body())
            .bind(now)
            .execute(&mut *connection)
            .await
            .map_err(HandleError::from_sqlx)?;
        copies += i64::from(quantity.get());
    }
    faults.pass(CrashPoint::BeforeCommit).await?;
    Ok(Outcome::Processed(Effect::Released { copies }))
}
