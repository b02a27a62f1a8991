//! The study's handlers, which run in the service's consumer loop through
//! [`MessageHandler`]. Which one runs is a [`HandlerKind`] (in [`handler`], the one list the
//! study's `serve`, `compare`, the benchmarks and the tests choose from):
//!
//! - the inbox: claim `(message_id, consumer)` first, in the same transaction as the work; the
//!   unique key is the arbiter between concurrent copies.
//! - the natural key through sea-orm's entities (`natural.rs`): the reference the service's
//!   own statements (`inventory_infra::consumers`) are held to, and the comparison it is.
//!
//! Both run in [`StockConsumer`]; the two-phase email consumer is in [`email`], and its provider
//! in [`crate::mailbox`].
//!
//! The mistaken designs (`crate::mistakes`) are built from the sea-orm steps the inbox is made
//! of: [`apply_logged`], [`claim_on_conflict`], [`recorded_outcome`] and [`judge_lost_claim`],
//! and [`finish`].

pub mod email;
mod email_provider;
pub mod handler;
mod inbox;
mod natural;
mod work;

use std::future::Future;

use inventory_domain::{ConsumerName, DeadLetterReason, Message, Outcome};
use inventory_infra::{CrashPoint, Faults, HandleError, MessageHandler};
use sea_orm::{DatabaseConnection, DatabaseTransaction};

use crate::payload_hash::PayloadHash;

pub use email::{EMAIL_CONSUMER, EmailConsumer};
pub use email_provider::{EmailProvider, ProviderError, SentLookup, StockReservedEmail};
pub use handler::{BuildError, Handler, HandlerKind, NaturalKeyPath};
pub use inbox::{claim_on_conflict, judge_lost_claim, recorded_outcome};
pub use work::apply_logged;

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
