//! The natural key, the handler `inventory serve` runs: the reservation's own key
//! `(order_id, book_id)` refuses a second reservation, whatever the message id. Each backend has
//! its own path: PostgreSQL's statements on a connection each lane holds ([`natural_pg`]), and
//! SQLite's one writer connection every lane shares ([`natural_sqlite`]); [`NaturalKey`] is the
//! one the database calls for. Why a handler failed, and whether that is worth a retry, is in
//! [`HandleError`].
//!
//! The study's handlers (the inbox, the natural key through sea-orm, the email consumer and the
//! mistaken designs) are in `inventory_benches::consumers`; they run in the same consumer loop
//! through [`MessageHandler`].

mod error;
pub mod natural_pg;
pub mod natural_sqlite;

use std::future::Future;

use inventory_domain::{BookId, ConsumerName, DeadLetterReason, Message, Outcome};
use sea_orm::{DatabaseConnection, DbBackend};

pub use error::HandleError;
use natural_pg::PgNaturalKey;
use natural_sqlite::SqliteNaturalKey;

use crate::faults::Faults;

/// A cancellation's mark, on both backends' fast paths: the order's one `order_states` row,
/// written once. A second cancellation, under any message id, changes no row: a duplicate.
pub const MARK_CANCELLED_SQL: &str = "\
INSERT INTO order_states (order_id, cancelled_at, cancel_message_id) VALUES ($1, $2, $3)
ON CONFLICT (order_id) DO UPDATE
SET cancelled_at = excluded.cancelled_at, cancel_message_id = excluded.cancel_message_id
WHERE order_states.cancelled_at IS NULL";

/// The reservations a cancellation releases, by book: those of its order that hold stock.
pub const HELD_SQL: &str = "\
SELECT book_id, quantity FROM stock_reservations
WHERE order_id = $1 AND status = 'reserved'
ORDER BY book_id";

/// What the consumer loop needs of a handler: one message in, one outcome out.
pub trait MessageHandler: Clone + Send + Sync + 'static {
    fn handle(
        &self,
        message: &Message,
    ) -> impl Future<Output = Result<Outcome, HandleError>> + Send;

    /// Several messages at once, one result each, in order. By default one after another; a
    /// handler that can commit them together overrides it.
    fn handle_batch(
        &self,
        messages: &[Message],
    ) -> impl Future<Output = Vec<Result<Outcome, HandleError>>> + Send {
        self.handle_each(messages)
    }

    /// Each message on its own, one after another: what a handler without a batch path does
    /// with a batch.
    fn handle_each(
        &self,
        messages: &[Message],
    ) -> impl Future<Output = Vec<Result<Outcome, HandleError>>> + Send {
        async move {
            let mut results = Vec::with_capacity(messages.len());
            for message in messages {
                results.push(self.handle(message).await);
            }
            results
        }
    }
}

/// The natural key on the database's own path.
#[derive(Clone)]
pub enum NaturalKey {
    Postgres(PgNaturalKey),
    Sqlite(SqliteNaturalKey),
}

impl NaturalKey {
    /// The handler for `db`'s backend, keeping its reservations under `consumer`.
    pub fn new(db: &DatabaseConnection, consumer: ConsumerName) -> Self {
        match db.get_database_backend() {
            DbBackend::Sqlite => Self::Sqlite(SqliteNaturalKey::new(db, consumer)),
            _ => Self::Postgres(PgNaturalKey::new(db, consumer)),
        }
    }

    pub fn consumer(&self) -> &ConsumerName {
        match self {
            Self::Postgres(handler) => handler.consumer(),
            Self::Sqlite(handler) => handler.consumer(),
        }
    }

    /// The same handler, failing as `faults` says (the tests and the study only).
    pub fn with_faults(&self, faults: Faults) -> Self {
        match self {
            Self::Postgres(handler) => Self::Postgres(handler.with_faults(faults)),
            Self::Sqlite(handler) => Self::Sqlite(handler.with_faults(faults)),
        }
    }
}

impl MessageHandler for NaturalKey {
    async fn handle(&self, message: &Message) -> Result<Outcome, HandleError> {
        match self {
            Self::Postgres(handler) => handler.handle(message).await,
            Self::Sqlite(handler) => handler.handle(message).await,
        }
    }

    async fn handle_batch(&self, messages: &[Message]) -> Vec<Result<Outcome, HandleError>> {
        match self {
            Self::Postgres(handler) => handler.handle_batch(messages).await,
            Self::Sqlite(handler) => handler.handle_batch(messages).await,
        }
    }
}

/// A stock consumer's answer to an event it does not take (Inventory's own StockReserved).
pub fn not_an_order_event() -> Outcome {
    Outcome::refused(
        DeadLetterReason::Invalid,
        "a stock consumer takes OrderPlaced and OrderCancelled only",
    )
}

/// A placement of a book no stock row holds.
pub fn unknown_book(book_id: BookId) -> Outcome {
    Outcome::refused(
        DeadLetterReason::UnknownBook,
        format!("no stock item for book {book_id}"),
    )
}
