//! The designs that look idempotent and are not, kept so the demo, the comparison and the
//! tests can show each failure on a real database. Wrong on purpose: `serve` runs none of them,
//! and the serving crates hold none of their code. They are the inbox's own sea-orm steps
//! (`inventory_infra::consumers`), rearranged.

use std::future::Future;

use crate::consumers::{BuildError, DetectMode, Handler, HandlerKind};
use crate::consumers::{
    apply_logged, claim_on_conflict, finish, judge_lost_claim, recorded_outcome,
};
use crate::db::begin_write;
use crate::payload_hash::PayloadHash;
use inventory_domain::{ConsumerName, Event, Message, Outcome};
use inventory_infra::{CrashPoint, Faults, HandleError, MessageHandler};
use sea_orm::sea_query::{Alias, Expr, ExprTrait, Query};
use sea_orm::{ConnectionTrait, DatabaseConnection, DatabaseTransaction, DbErr, TransactionTrait};

/// A strategy the study runs: one of the service's handlers, or one the study shows failing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Strategy {
    /// No dedup: every delivery reserves again.
    Naive,
    /// Looks in the inbox, does the work in a transaction of its own, then records the message:
    /// a crash in between reserves twice.
    CheckThenProcess,
    /// One of the service's handlers.
    Served(HandlerKind),
}

impl From<HandlerKind> for Strategy {
    fn from(kind: HandlerKind) -> Self {
        Self::Served(kind)
    }
}

impl Strategy {
    /// The study's name of the strategy, as the demo's and the comparison's tables print it.
    pub fn strategy_name(self) -> &'static str {
        match self {
            Self::Naive => "naive",
            Self::CheckThenProcess => "check-then-process",
            Self::Served(kind) => kind.strategy_name(),
        }
    }

    /// A name for this strategy alone, fit for a benchmark id or a directory.
    pub fn label(self) -> &'static str {
        match self {
            Self::Naive => "naive",
            Self::CheckThenProcess => "check-then-process",
            Self::Served(kind) => kind.label(),
        }
    }

    /// The durable consumer it runs as.
    pub fn default_consumer(self) -> &'static str {
        match self {
            Self::Naive => "inventory-reserve-stock-naive",
            Self::CheckThenProcess => "inventory-reserve-stock-check-then-process",
            Self::Served(kind) => kind.default_consumer(),
        }
    }

    /// The service handler whose consumer settings it runs under in the service's runtime:
    /// naive and check-then-process consume what the stock handlers consume, one at a time.
    pub fn runs_as(self) -> HandlerKind {
        match self {
            Self::Naive | Self::CheckThenProcess => HandlerKind::Inbox(DetectMode::OnConflict),
            Self::Served(kind) => kind,
        }
    }

    /// Builds the handler on `db`, recording its dedup rows (if any) under `consumer`.
    pub fn build(
        self,
        db: &DatabaseConnection,
        consumer: ConsumerName,
    ) -> Result<StudyHandler, BuildError> {
        let own_transaction = |inbox_around| {
            StudyHandler::OwnTransaction(OwnTransaction {
                db: db.clone(),
                consumer: consumer.clone(),
                faults: Faults::none(),
                inbox_around,
            })
        };
        Ok(match self {
            Self::Naive => own_transaction(false),
            Self::CheckThenProcess => own_transaction(true),
            Self::Served(kind) => StudyHandler::Served(kind.build(db, consumer.clone(), None)?),
        })
    }
}

/// A built [`Strategy`].
#[derive(Clone)]
pub enum StudyHandler {
    OwnTransaction(OwnTransaction),
    Served(Handler),
}

impl From<Handler> for StudyHandler {
    fn from(handler: Handler) -> Self {
        Self::Served(handler)
    }
}

impl StudyHandler {
    /// The name its dedup rows are kept under.
    pub fn consumer(&self) -> &ConsumerName {
        match self {
            Self::OwnTransaction(handler) => &handler.consumer,
            Self::Served(handler) => handler.consumer(),
        }
    }

    /// The same handler, failing as `faults` says.
    pub fn with_faults(&self, faults: Faults) -> Self {
        match self {
            Self::OwnTransaction(handler) => Self::OwnTransaction(OwnTransaction {
                faults,
                ..handler.clone()
            }),
            Self::Served(handler) => Self::Served(handler.with_faults(faults)),
        }
    }
}

impl MessageHandler for StudyHandler {
    async fn handle(&self, message: &Message) -> Result<Outcome, HandleError> {
        match self {
            Self::OwnTransaction(handler) => handler.handle(message).await,
            Self::Served(handler) => handler.handle(message).await,
        }
    }

    async fn handle_batch(&self, messages: &[Message]) -> Vec<Result<Outcome, HandleError>> {
        match self {
            Self::OwnTransaction(_) => self.handle_each(messages).await,
            Self::Served(handler) => handler.handle_batch(messages).await,
        }
    }
}

/// Naive and check-then-process: the work in a transaction of its own, with no dedup record
/// inside it.
#[derive(Clone)]
pub struct OwnTransaction {
    db: DatabaseConnection,
    consumer: ConsumerName,
    faults: Faults,
    /// Check-then-process: look in the inbox before the work, record the message after it.
    inbox_around: bool,
}

impl OwnTransaction {
    async fn handle(&self, message: &Message) -> Result<Outcome, HandleError> {
        let key = message.key.storage_key();
        let hash = PayloadHash::of(message);
        if self.inbox_around
            && let Some(outcome) = recorded_outcome(&self.db, &key, &self.consumer, &hash).await?
        {
            return Ok(outcome);
        }
        // Naive checks nothing: its "dedup check" point is simply its start.
        self.faults.pass(CrashPoint::AfterDedupCheck).await?;
        let outcome = work_in_own_transaction(&self.db, &key, message, &self.faults).await?;
        if self.inbox_around && outcome.processed() {
            // The window: the work is committed, the record is not written yet.
            claim_on_conflict(&self.db, &key, &self.consumer, &hash, true).await?;
        }
        Ok(outcome)
    }
}

/// The logged work in a transaction of its own, with no dedup record inside it.
async fn work_in_own_transaction(
    db: &DatabaseConnection,
    key: &str,
    message: &Message,
    faults: &Faults,
) -> Result<Outcome, HandleError> {
    let txn = begin_write(db).await?;
    let result = apply_logged(&txn, key, &message.event).await;
    finish(txn, result, faults).await
}

/// A cache's set-if-absent (`SET key NX` in Redis): the claim of the cache-arbiter design. True
/// if this call set the key.
pub trait CacheClaim {
    fn claim(&self, message: &Message) -> impl Future<Output = bool> + Send;
}

/// What a copy handled by [`MistakenConsumer::claim_last`] did to the stock row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimLastResult {
    pub outcome: Outcome,
    /// The copy updated the stock row before it found out it was a duplicate: read from the
    /// row inside its transaction, before and after the work (then rolled back).
    pub wrote_stock_before_claim: bool,
}

/// The inbox's steps rearranged into known mistakes.
pub struct MistakenConsumer {
    db: DatabaseConnection,
    consumer: ConsumerName,
    faults: Faults,
}

impl MistakenConsumer {
    /// On `db` under `consumer`, failing as `faults` says.
    pub fn new(db: DatabaseConnection, consumer: ConsumerName, faults: Faults) -> Self {
        Self {
            db,
            consumer,
            faults,
        }
    }

    /// The record is committed on its own, then the work in a second transaction: a crash in
    /// between loses the work (at-most-once).
    pub async fn record_first_in_separate_transactions(
        &self,
        message: &Message,
    ) -> Result<Outcome, HandleError> {
        let key = message.key.storage_key();
        let hash = PayloadHash::of(message);
        if !claim_on_conflict(&self.db, &key, &self.consumer, &hash, true).await? {
            return Ok(judge_lost_claim(&self.db, &key, &self.consumer, &hash).await?);
        }
        self.faults.pass(CrashPoint::AfterDedupCheck).await?;
        work_in_own_transaction(&self.db, &key, message, &self.faults).await
    }

    /// The cache arbitrates: the key is claimed there, the work committed in the database. A
    /// crash before the commit leaves the key claimed and the work undone.
    pub async fn claim_in_cache(
        &self,
        cache: &impl CacheClaim,
        message: &Message,
    ) -> Result<Outcome, HandleError> {
        let key = message.key.storage_key();
        if !cache.claim(message).await {
            return Ok(Outcome::Duplicate);
        }
        self.faults.pass(CrashPoint::AfterDedupCheck).await?;
        work_in_own_transaction(&self.db, &key, message, &self.faults).await
    }

    /// The inbox transaction is open, but the work goes through another pooled connection and
    /// commits on its own: a crash before the claim commits keeps the work. (The work comes
    /// before the claim because on SQLite, with one writer, a second connection writing after
    /// the claim would wait for the claim's transaction forever; the lesson is the same.)
    pub async fn write_through_second_connection(
        &self,
        message: &Message,
    ) -> Result<Outcome, HandleError> {
        let key = message.key.storage_key();
        let hash = PayloadHash::of(message);
        // Deferred, as a plain `begin()` is: an immediate one would hold SQLite's write lock
        // and the second connection would wait for it forever.
        let txn = self.db.begin().await?;
        let worked = apply_logged(&self.db, &key, &message.event).await;
        let result = match worked {
            Ok(outcome) if outcome.processed() => {
                match claim_on_conflict(&txn, &key, &self.consumer, &hash, true).await {
                    Ok(true) => Ok(outcome),
                    Ok(false) => Ok(judge_lost_claim(&self.db, &key, &self.consumer, &hash).await?),
                    Err(error) => Err(error.into()),
                }
            }
            other => other,
        };
        finish(txn, result, &self.faults).await
    }

    /// The work first, the claim last, in one transaction: still correct, since the losing copy
    /// rolls back, but it locked and wrote the stock row before it lost.
    pub async fn claim_last(&self, message: &Message) -> Result<ClaimLastResult, HandleError> {
        let key = message.key.storage_key();
        let hash = PayloadHash::of(message);
        let txn = begin_write(&self.db).await?;
        let book = match &message.event {
            Event::Placed(placed) => Some(placed.book_id.as_uuid()),
            Event::Cancelled(_) | Event::StockReserved(_) => None,
        };
        let before = reserved_copies(&txn, book).await?;
        let worked = apply_logged(&txn, &key, &message.event).await;
        // The database's word, not the code path's: the row as this transaction sees it moved.
        let wrote_stock_before_claim = reserved_copies(&txn, book).await? != before;
        let result = match worked {
            Ok(outcome) if outcome.processed() => {
                match claim_on_conflict(&txn, &key, &self.consumer, &hash, true).await {
                    Ok(true) => Ok(outcome),
                    Ok(false) => Ok(Outcome::Duplicate),
                    Err(error) => Err(error.into()),
                }
            }
            other => other,
        };
        let outcome = finish(txn, result, &self.faults).await?;
        Ok(ClaimLastResult {
            outcome,
            wrote_stock_before_claim,
        })
    }
}

/// The reserved copies of `book`'s stock row as `txn` sees it.
async fn reserved_copies(
    txn: &DatabaseTransaction,
    book: Option<uuid::Uuid>,
) -> Result<Option<i32>, DbErr> {
    let Some(book) = book else {
        return Ok(None);
    };
    let query = Query::select()
        .column(Alias::new("reserved"))
        .from(Alias::new("stock_items"))
        .and_where(Expr::col(Alias::new("book_id")).eq(book))
        .to_owned();
    let row = txn
        .query_one_raw(txn.get_database_backend().build(&query))
        .await?;
    row.map(|row| row.try_get("", "reserved")).transpose()
}
