//! The handlers: each takes one decoded message and returns a typed [`Outcome`]. Which one runs
//! is a [`HandlerKind`] (in [`handler`], the one list a user chooses from):
//!
//! - the inbox: claim `(message_id, consumer)` first, in the same transaction as the work; the
//!   unique key is the arbiter between concurrent copies.
//! - the natural key: the reservation's own key `(order_id, book_id)` refuses a second
//!   reservation, whatever the message id; through sea-orm (`natural.rs`, the
//!   reference), as one statement on PostgreSQL ([`natural_pg`]), or on SQLite's one writer
//!   connection ([`natural_sqlite`]).
//!
//! Both run in [`StockConsumer`]; the two-phase email consumer is in [`email`]. Why a handler
//! failed, and whether that is worth a retry, is in [`HandleError`].
//!
//! The study (`inventory_benches`) builds its naive, check-then-process and mistaken designs
//! from the sea-orm steps the inbox is made of: [`begin_write`], [`apply_logged`],
//! [`claim_on_conflict`], [`recorded_outcome`] and [`judge_lost_claim`], and [`finish`].

pub mod email;
mod error;
pub mod handler;
mod inbox;
mod natural;
pub mod natural_pg;
pub mod natural_sqlite;
mod work;

use std::future::Future;

use inventory_domain::{
    ConsumerName, DeadLetterReason, EmailProvider, Message, Outcome, PayloadHash,
};
use sea_orm::{
    DatabaseConnection, DatabaseTransaction, DbErr, SqliteTransactionMode, TransactionOptions,
    TransactionTrait,
};

use crate::faults::{CrashPoint, Faults};
pub use handler::{BuildError, Handler, HandlerKind, NaturalKeyPath};

pub use error::HandleError;
pub use inbox::{claim_on_conflict, judge_lost_claim, recorded_outcome};
pub use work::apply_logged;

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

impl MessageHandler for StockConsumer {
    fn handle(
        &self,
        message: &Message,
    ) -> impl Future<Output = Result<Outcome, HandleError>> + Send {
        StockConsumer::handle(self, message)
    }
}

impl<P: EmailProvider + Clone + 'static> MessageHandler for email::EmailConsumer<P> {
    fn handle(
        &self,
        message: &Message,
    ) -> impl Future<Output = Result<Outcome, HandleError>> + Send {
        email::EmailConsumer::handle(self, message)
    }
}

/// How the inbox detects that a copy was already claimed. All three are correct under
/// concurrency; they differ in cost (see the benchmarks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DetectMode {
    /// Insert the claim and catch the unique violation (which aborts a PostgreSQL transaction).
    CatchViolation,
    /// Look the key up before the transaction; insert (and still catch) only when absent.
    PreCheck,
    /// `INSERT … ON CONFLICT DO NOTHING` and count the rows.
    OnConflict,
}

impl DetectMode {
    pub const ALL: [Self; 3] = [Self::CatchViolation, Self::PreCheck, Self::OnConflict];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::CatchViolation => "catch-violation",
            Self::PreCheck => "pre-check",
            Self::OnConflict => "on-conflict",
        }
    }
}

/// How a [`StockConsumer`] dedups; which one [`HandlerKind::build`] picks for the kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Strategy {
    Inbox(DetectMode),
    NaturalKey,
}

/// A stock-reserving consumer through sea-orm: one strategy, one consumer name, one database.
/// Built by [`HandlerKind::build`].
#[derive(Clone)]
pub struct StockConsumer {
    db: DatabaseConnection,
    kind: HandlerKind,
    strategy: Strategy,
    consumer: ConsumerName,
    faults: Faults,
}

impl StockConsumer {
    pub(crate) fn new(
        db: DatabaseConnection,
        kind: HandlerKind,
        strategy: Strategy,
        consumer: ConsumerName,
    ) -> Self {
        Self {
            db,
            kind,
            strategy,
            consumer,
            faults: Faults::none(),
        }
    }

    /// The same consumer, failing as `faults` says (tests and the demo only).
    pub fn with_faults(&self, faults: Faults) -> Self {
        Self {
            faults,
            ..self.clone()
        }
    }

    pub fn consumer(&self) -> &ConsumerName {
        &self.consumer
    }

    /// Handles one delivery. `Ok` is final for it (ack, or dead-letter a refusal); `Err` means
    /// nothing was acknowledged and the message will come again.
    #[tracing::instrument(skip_all, fields(handler = self.kind.label(), key = %message.key, outcome))]
    pub async fn handle(&self, message: &Message) -> Result<Outcome, HandleError> {
        let outcome = match self.strategy {
            Strategy::Inbox(mode) => self.handle_inbox(message, mode).await,
            Strategy::NaturalKey => self.handle_natural(message).await,
        }?;
        tracing::Span::current().record("outcome", outcome.label());
        Ok(outcome)
    }
}

/// The same key seen again: the same content is a duplicate, other content a refusal.
pub(crate) fn compare_payload(stored: &str, incoming: &PayloadHash) -> Outcome {
    if stored == incoming.as_str() {
        Outcome::Duplicate
    } else {
        Outcome::refused(
            DeadLetterReason::PayloadMismatch,
            format!(
                "message id already used for other content (stored hash {stored}, this one {})",
                incoming.as_str()
            ),
        )
    }
}

/// Begins a transaction that will write. On SQLite it takes the write lock at `BEGIN`
/// (`IMMEDIATE`): a deferred transaction that reads first cannot upgrade once another writer
/// committed, and fails with "database is locked" instead of waiting its turn.
pub async fn begin_write(db: &DatabaseConnection) -> Result<DatabaseTransaction, DbErr> {
    db.begin_with_options(TransactionOptions {
        sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
        ..TransactionOptions::default()
    })
    .await
}

/// Ends a transaction: commits processed work (past the crash points before and after the
/// commit), rolls back anything else, so a refusal or an error leaves no partial write.
pub async fn finish(
    txn: DatabaseTransaction,
    result: Result<Outcome, HandleError>,
    faults: &Faults,
) -> Result<Outcome, HandleError> {
    match result {
        Ok(outcome) if outcome.processed() => {
            if let Err(crash) = faults.pass(CrashPoint::BeforeCommit).await {
                txn.rollback().await?;
                return Err(crash.into());
            }
            txn.commit().await?;
            faults.pass(CrashPoint::AfterCommit).await?;
            Ok(outcome)
        }
        Ok(outcome) => {
            txn.rollback().await?;
            Ok(outcome)
        }
        Err(error) => {
            // The error is what matters; a failed rollback is undone by the connection's
            // release.
            let _ = txn.rollback().await;
            Err(error)
        }
    }
}
