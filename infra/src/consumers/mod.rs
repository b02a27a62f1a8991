//! The natural key, the handler `inventory serve` runs: the reservation's own key
//! `(order_id, book_id)` refuses a second reservation, whatever the message id. Each backend has
//! its own path: PostgreSQL's statements on a connection each lane holds ([`natural_pg`]), and
//! SQLite's one writer connection every lane shares ([`natural_sqlite`]). [`NaturalKey`] runs
//! the one the database calls for, and decides for both what a message or a batch comes to:
//! placements and cancellations in their order, the one-by-one retry of a batch the database
//! refused for good, a placement's crash points (a cancellation's are in its transaction, in
//! each backend's file). PostgreSQL's statement may also leave a placement of a batch
//! undecided, which its path then decides alone (`natural_pg.rs`). Why a handler failed, and
//! whether that is worth a retry, is in [`HandleError`].
//!
//! The study's handlers (the inbox, the natural key through sea-orm, the email consumer and the
//! mistaken designs) are in `inventory_benches::consumers`; they run in the same consumer loop
//! through [`MessageHandler`].

mod error;
pub mod natural_pg;
pub mod natural_sqlite;

use std::borrow::Cow;
use std::future::Future;
use std::num::NonZeroU32;

use inventory_domain::{
    BookId, ConsumerName, DeadLetterReason, ErrorKind, Event, EventKind, Message, OrderCancelled,
    OrderPlaced, Outcome, keyed_placements,
};
use sea_orm::{DatabaseConnection, DbBackend};

pub use error::HandleError;
use natural_pg::PgNaturalKey;
use natural_sqlite::SqliteNaturalKey;

use crate::faults::{CrashPoint, Faults};

/// A cancellation's mark, on both backends' fast paths: the order's one `order_states` row,
/// written once. A second cancellation, under any message id, changes no row: a duplicate.
pub const MARK_CANCELLED_SQL: &str = "\
INSERT INTO order_states (order_id, cancelled_at, cancel_message_id) VALUES ($1, $2, $3)
ON CONFLICT (order_id) DO UPDATE
SET cancelled_at = excluded.cancelled_at, cancel_message_id = excluded.cancel_message_id
WHERE order_states.cancelled_at IS NULL";

/// A line's cancellation's mark: the line's one `line_cancellations` row, written once. A second
/// cancellation of the line, under any message id, writes no row: a duplicate.
pub const MARK_LINE_CANCELLED_SQL: &str = "\
INSERT INTO line_cancellations (order_id, book_id, cancelled_at, cancel_message_id)
VALUES ($1, $2, $3, $4)
ON CONFLICT (order_id, book_id) DO NOTHING";

/// The reservation a line's cancellation releases: the line's ($1, $2), if it holds stock.
pub const HELD_LINE_SQL: &str = "\
SELECT book_id, quantity FROM stock_reservations
WHERE order_id = $1 AND book_id = $2 AND status = 'reserved'";

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

    /// Whether this handler's database decides `message`: on a shard, whether it owns the
    /// partition of the book of a placement or a line's cancellation (the messages it can find
    /// "not owned"). Asked before a delivery past the cap is dead-lettered unhandled (another
    /// shard's message is theirs), and by a consumer that stopped pulling a partition it found
    /// not owned, to learn when it is owned again. By default, always.
    fn decides(&self, message: &Message) -> impl Future<Output = Result<bool, HandleError>> + Send {
        let _ = message;
        std::future::ready(Ok(true))
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

/// The natural key on the database's own path: what one message or a lane's batch comes to,
/// and the crash points it passes, whichever backend's statements run.
#[derive(Clone)]
pub struct NaturalKey {
    path: Path,
    consumer: ConsumerName,
    faults: Faults,
}

/// Each backend's statements.
#[derive(Clone)]
enum Path {
    Postgres(PgNaturalKey),
    Sqlite(SqliteNaturalKey),
}

impl NaturalKey {
    /// The handler for `db`'s backend, keeping its reservations under `consumer`.
    pub fn new(db: &DatabaseConnection, consumer: ConsumerName) -> Self {
        let path = match db.get_database_backend() {
            DbBackend::Sqlite => Path::Sqlite(SqliteNaturalKey::new(db)),
            _ => Path::Postgres(PgNaturalKey::new(db)),
        };
        Self {
            path,
            consumer,
            faults: Faults::none(),
        }
    }

    /// The same handler on a shard whose orders stream has `partitions` partitions: a placement
    /// of a book whose partition this database does not own decides nothing
    /// ([`HandleError::NotOwned`]). `None` on SQLite: a shard is a PostgreSQL database.
    pub fn on_shard(&self, partitions: NonZeroU32) -> Option<Self> {
        match &self.path {
            Path::Postgres(path) => Some(Self {
                path: Path::Postgres(path.on_shard(partitions)),
                ..self.clone()
            }),
            Path::Sqlite(_) => None,
        }
    }

    pub fn consumer(&self) -> &ConsumerName {
        &self.consumer
    }

    /// The same handler, failing as `faults` says (the tests and the study only): a placement
    /// passes `BeforeStatement` and `AfterCommit`; a cancellation `AfterDedupCheck`,
    /// `BeforeCommit` and `AfterCommit`.
    pub fn with_faults(&self, faults: Faults) -> Self {
        Self {
            faults,
            ..self.clone()
        }
    }

    async fn place(&self, key: &str, placed: &OrderPlaced) -> Result<Outcome, HandleError> {
        match &self.path {
            Path::Postgres(path) => path.place(key, placed).await,
            Path::Sqlite(path) => path.place(key, placed).await,
        }
    }

    async fn place_together(
        &self,
        placements: &[(Cow<'_, str>, &OrderPlaced)],
    ) -> Result<Vec<Result<Outcome, HandleError>>, HandleError> {
        match &self.path {
            Path::Postgres(path) => path.place_together(placements).await,
            Path::Sqlite(path) => path.place_together(placements).await,
        }
    }

    async fn cancel(&self, key: &str, cancelled: &OrderCancelled) -> Result<Outcome, HandleError> {
        match &self.path {
            Path::Postgres(path) => path.cancel(key, cancelled, &self.faults).await,
            Path::Sqlite(path) => path.cancel(key, cancelled, &self.faults).await,
        }
    }

    /// Placements committed together, one result each, in order.
    async fn handle_placements(&self, messages: &[Message]) -> Vec<Result<Outcome, HandleError>> {
        let placements = keyed_placements(messages);
        let all = |error: &HandleError| placements.iter().map(|_| Err(error.clone())).collect();
        if let Err(crash) = self.faults.pass(CrashPoint::BeforeStatement).await {
            return all(&crash.into());
        }
        let results = match self.place_together(&placements).await {
            Ok(results) => results,
            // Nothing committed, and the statements were refused for good: possibly for one
            // placement's sake, so each is decided alone and only its own refusal dead-letters it.
            Err(error) if matches!(error.kind(), ErrorKind::Permanent(_)) => {
                let mut results = Vec::with_capacity(placements.len());
                for (key, placed) in &placements {
                    results.push(self.place(key, placed).await);
                }
                results
            }
            // Nothing committed: every placement is retried.
            Err(error) => return all(&error),
        };
        // A crash after the commit loses every result.
        if let Err(crash) = self.faults.pass(CrashPoint::AfterCommit).await {
            return all(&crash.into());
        }
        let mut results = results.into_iter();
        placements
            .iter()
            .map(|_| {
                results.next().unwrap_or(Err(HandleError::Internal(
                    "the statement returned fewer rows than placements",
                )))
            })
            .collect()
    }
}

impl MessageHandler for NaturalKey {
    async fn decides(&self, message: &Message) -> Result<bool, HandleError> {
        match (&self.path, &message.event) {
            (Path::Postgres(path), Event::Placed(placed)) => path.owns(placed.book_id).await,
            (Path::Postgres(path), Event::Cancelled(cancelled)) => match cancelled.book_id {
                Some(book) => path.owns(book).await,
                // An order's cancellation names no book, so no partition to own.
                None => Ok(true),
            },
            _ => Ok(true),
        }
    }

    async fn handle(&self, message: &Message) -> Result<Outcome, HandleError> {
        let key = message.key.storage_key();
        let outcome = match &message.event {
            Event::Placed(placed) => {
                self.faults.pass(CrashPoint::BeforeStatement).await?;
                self.place(&key, placed).await?
            }
            Event::Cancelled(cancelled) => self.cancel(&key, cancelled).await?,
            Event::StockReserved(_) => return Ok(not_an_order_event()),
        };
        self.faults.pass(CrashPoint::AfterCommit).await?;
        Ok(outcome)
    }

    /// Each run of placements committed together, each cancellation in its place between
    /// them: a cancellation decides what a later placement of its order comes to, and frees
    /// copies a later placement of another order may take, so nothing moves past one.
    async fn handle_batch(&self, messages: &[Message]) -> Vec<Result<Outcome, HandleError>> {
        let mut results = Vec::with_capacity(messages.len());
        for run in messages.chunk_by(|a, b| a.event.kind() == b.event.kind()) {
            if run[0].event.kind() == EventKind::Placed {
                results.extend(self.handle_placements(run).await);
            } else {
                for message in run {
                    results.push(self.handle(message).await);
                }
            }
        }
        results
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
