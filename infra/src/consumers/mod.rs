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
//! With the `harness` feature (the study and the tests), [`StockConsumer`] also runs naive (no
//! dedup: every delivery reserves again) and check-then-process (look in the inbox, do the
//! work in its own transaction, then write the inbox row: a crash between the two reopens the
//! window), and `study` holds the deliberately wrong designs the demo contrasts with these.

pub mod email;
mod error;
pub mod handler;
mod inbox;
mod natural;
pub mod natural_pg;
pub mod natural_sqlite;
#[cfg(feature = "harness")]
pub mod study;
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
    #[cfg(feature = "harness")]
    Naive,
    #[cfg(feature = "harness")]
    CheckThenProcess,
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
            #[cfg(feature = "harness")]
            Strategy::Naive => self.handle_naive(message).await,
            #[cfg(feature = "harness")]
            Strategy::CheckThenProcess => self.handle_check_then_process(message).await,
            Strategy::Inbox(mode) => self.handle_inbox(message, mode).await,
            Strategy::NaturalKey => self.handle_natural(message).await,
        }?;
        tracing::Span::current().record("outcome", outcome.label());
        Ok(outcome)
    }
}

/// The study's strategies, which no service runs.
#[cfg(feature = "harness")]
impl StockConsumer {
    async fn handle_naive(&self, message: &Message) -> Result<Outcome, HandleError> {
        // Naive checks nothing: its "dedup check" point is simply its start.
        self.faults.pass(CrashPoint::AfterDedupCheck).await?;
        self.work_in_own_transaction(&message.key.storage_key(), message)
            .await
    }

    /// The logged work in a transaction of its own, with no dedup record inside it.
    async fn work_in_own_transaction(
        &self,
        key: &str,
        message: &Message,
    ) -> Result<Outcome, HandleError> {
        let txn = begin_write(&self.db).await?;
        let result = work::apply_logged(&txn, key, &message.event).await;
        self.finish(txn, result).await
    }

    async fn handle_check_then_process(&self, message: &Message) -> Result<Outcome, HandleError> {
        let key = message.key.storage_key();
        let hash = message.payload_hash();
        if let Some(existing) =
            crate::stock::find_inbox_entry(&self.db, &key, self.consumer.as_str()).await?
        {
            return Ok(compare_payload(&existing.payload_hash, &hash));
        }
        self.faults.pass(CrashPoint::AfterDedupCheck).await?;
        let outcome = self.work_in_own_transaction(&key, message).await?;
        if outcome.processed() {
            // The window: the work is committed, the record is not written yet.
            inbox::record_completed(&self.db, &key, &self.consumer, &hash).await?;
        }
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
pub(crate) async fn begin_write(db: &DatabaseConnection) -> Result<DatabaseTransaction, DbErr> {
    db.begin_with_options(TransactionOptions {
        sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
        ..TransactionOptions::default()
    })
    .await
}

impl StockConsumer {
    /// Ends a transaction: commits processed work, rolls back anything else, so a refusal or an
    /// error leaves no partial write.
    pub(crate) async fn finish(
        &self,
        txn: DatabaseTransaction,
        result: Result<Outcome, HandleError>,
    ) -> Result<Outcome, HandleError> {
        match result {
            Ok(outcome) if outcome.processed() => {
                if let Err(crash) = self.faults.pass(CrashPoint::BeforeCommit).await {
                    txn.rollback().await?;
                    return Err(crash);
                }
                txn.commit().await?;
                self.faults.pass(CrashPoint::AfterCommit).await?;
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
}
