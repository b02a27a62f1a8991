//! The natural key on PostgreSQL as one statement per message, on a connection the lane holds.
//!
//! The same rules as the reference handler in `natural.rs` (reservation key first, a
//! cancellation that came first wins, a rejection is kept, an unknown book writes nothing), in
//! one round trip: the statement locks the stock row, touches the order's state row, decides,
//! inserts the reservation unless its key is taken, and moves stock only if that insert won.
//! It commits on its own, so there is no open transaction between the steps. Each clone opens
//! its own connection, so a consumer lane never borrows one from a pool (sqlx pings a pooled
//! connection on every return) and prepared statements stay cached.

use std::sync::Arc;

use inventory_domain::{
    CrashPoint, Effect, Event, Message, OrderPlaced, Outcome, Quantity, ReservationStatus,
};
use sea_orm::sqlx::postgres::{PgConnectOptions, PgConnection};
use sea_orm::sqlx::{self, ConnectOptions, Row};
use sea_orm::{DbErr, RuntimeErr};
use tokio::sync::Mutex;

use super::work::unknown_book;
use super::{HandleError, MessageHandler, StockConsumer};
use crate::faults::Faults;
use crate::stock::stored;

/// Locks the stock row (all copies of one book's orders queue there), then decides.
pub const RESERVE_SQL: &str = "\
WITH stock AS (
    SELECT on_hand - reserved AS available
    FROM stock_items WHERE book_id = $2
    FOR UPDATE
), guard AS (
    INSERT INTO order_states (order_id)
    SELECT $1 FROM stock
    ON CONFLICT (order_id) DO UPDATE SET order_id = EXCLUDED.order_id
    RETURNING cancelled_at IS NOT NULL AS cancelled
), decided AS (
    SELECT CASE WHEN guard.cancelled THEN 'released'
                WHEN stock.available >= $3 THEN 'reserved'
                ELSE 'rejected' END AS status,
           stock.available
    FROM stock CROSS JOIN guard
), inserted AS (
    INSERT INTO stock_reservations (order_id, book_id, quantity, status, message_id, created_at)
    SELECT $1, $2, $3, decided.status, $4, now() FROM decided
    ON CONFLICT (order_id, book_id) DO NOTHING
    RETURNING status
), moved AS (
    UPDATE stock_items SET reserved = reserved + $3
    WHERE book_id = $2 AND EXISTS (SELECT 1 FROM inserted WHERE status = 'reserved')
)
SELECT EXISTS (SELECT 1 FROM stock) AS book_found,
       (SELECT status FROM inserted) AS inserted_status,
       (SELECT available FROM decided) AS available,
       (SELECT quantity FROM stock_reservations WHERE order_id = $1 AND book_id = $2)
           AS existing_quantity";

/// The statement's snapshot predates a concurrent copy that committed while this one waited
/// for the stock row; this fresh read finds the reservation that copy wrote.
const EXISTING_SQL: &str =
    "SELECT quantity FROM stock_reservations WHERE order_id = $1 AND book_id = $2";

pub struct PgNaturalKey {
    options: Arc<PgConnectOptions>,
    connection: Mutex<Option<PgConnection>>,
    /// Cancellations are rare: they go through the reference handler.
    reference: StockConsumer,
    faults: Faults,
}

impl Clone for PgNaturalKey {
    /// A clone is another lane: same database, its own connection (opened on first use).
    fn clone(&self) -> Self {
        Self {
            options: self.options.clone(),
            connection: Mutex::new(None),
            reference: self.reference.clone(),
            faults: self.faults.clone(),
        }
    }
}

fn database_error(error: sqlx::Error) -> HandleError {
    HandleError::Database(DbErr::Exec(RuntimeErr::SqlxError(Arc::new(error))))
}

impl PgNaturalKey {
    /// `reference` must be a natural-key [`StockConsumer`] on a PostgreSQL connection; `None`
    /// for any other backend.
    pub fn new(reference: StockConsumer) -> Option<Self> {
        if reference.db.get_database_backend() != sea_orm::DbBackend::Postgres {
            return None;
        }
        let options = reference
            .db
            .get_postgres_connection_pool()
            .connect_options()
            .as_ref()
            .clone()
            // Statements are the hot path here: sea-orm's pool logs them at DEBUG already.
            .log_statements(tracing::log::LevelFilter::Trace);
        Some(Self {
            options: Arc::new(options),
            connection: Mutex::new(None),
            faults: reference.faults.clone(),
            reference,
        })
    }

    /// The same handler, failing as `faults` says; only `AfterCommit` applies to a placement.
    pub fn with_faults(&self, faults: Faults) -> Self {
        Self {
            reference: self.reference.with_faults(faults.clone()),
            faults,
            ..self.clone()
        }
    }

    async fn reserve(&self, key: &str, placed: &OrderPlaced) -> Result<Outcome, HandleError> {
        let mut slot = self.connection.lock().await;
        if slot.is_none() {
            *slot = Some(self.options.connect().await.map_err(database_error)?);
        }
        let Some(connection) = slot.as_mut() else {
            return Err(HandleError::Database(DbErr::Custom("no connection".into())));
        };
        let result = decide(connection, key, placed).await;
        if result.is_err() {
            // The connection may be broken; the next message opens a new one.
            *slot = None;
        }
        result
    }
}

async fn decide(
    connection: &mut PgConnection,
    key: &str,
    placed: &OrderPlaced,
) -> Result<Outcome, HandleError> {
    let order = placed.order_id.as_uuid();
    let book = placed.book_id.as_uuid();
    let quantity = stored(i32::try_from(placed.quantity.get()).ok(), "quantity")?;
    let row = sqlx::query(RESERVE_SQL)
        .bind(order)
        .bind(book)
        .bind(quantity)
        .bind(key)
        .fetch_one(&mut *connection)
        .await
        .map_err(database_error)?;
    let book_found: bool = row.try_get("book_found").map_err(database_error)?;
    let inserted: Option<String> = row.try_get("inserted_status").map_err(database_error)?;
    let available: Option<i32> = row.try_get("available").map_err(database_error)?;
    let mut existing: Option<i32> = row.try_get("existing_quantity").map_err(database_error)?;
    if !book_found {
        return Ok(unknown_book(placed.book_id));
    }
    if let Some(status) = inserted {
        let status = stored(ReservationStatus::parse(&status), "reservation status")?;
        return Ok(Outcome::Processed(match status {
            ReservationStatus::Reserved => Effect::Reserved {
                quantity: placed.quantity,
            },
            ReservationStatus::Released => Effect::ArrivedAfterCancellation,
            ReservationStatus::Rejected => Effect::Rejected {
                requested: placed.quantity,
                available: available.map_or(0, i64::from),
            },
        }));
    }
    if existing.is_none() {
        existing = sqlx::query(EXISTING_SQL)
            .bind(order)
            .bind(book)
            .fetch_optional(&mut *connection)
            .await
            .map_err(database_error)?
            .map(|row| row.try_get("quantity"))
            .transpose()
            .map_err(database_error)?;
    }
    let existing = stored(existing, "reservation after a conflict")?;
    let existing = stored(Quantity::new(existing.into()).ok(), "quantity")?;
    Ok(inventory_domain::stock::second_request_for_reservation(
        existing,
        placed.quantity,
    ))
}

impl MessageHandler for PgNaturalKey {
    async fn handle(&self, message: &Message) -> Result<Outcome, HandleError> {
        match &message.event {
            Event::Placed(placed) => {
                let outcome = self.reserve(&message.key.storage_key(), placed).await?;
                self.faults.pass(CrashPoint::AfterCommit).await?;
                Ok(outcome)
            }
            Event::Cancelled(_) => self.reference.handle(message).await,
        }
    }
}
