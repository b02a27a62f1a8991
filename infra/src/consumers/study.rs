//! Designs that look idempotent and are not, kept so the demo can show each failure on a real
//! database. Wrong on purpose: never wire one of these into `serve`.

use std::future::Future;

use inventory_domain::{ConsumerName, Event, Message, Outcome};
use sea_orm::{DatabaseConnection, DatabaseTransaction, DbErr, EntityTrait, TransactionTrait};

use super::inbox::{claim_on_conflict, judge_lost_claim};
use super::{DetectMode, HandleError, HandlerKind, StockConsumer, Strategy, begin_write, work};
use crate::entities::stock_items;
use crate::faults::{CrashPoint, Faults};

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

/// The inbox strategy's consumer, with its steps rearranged into known mistakes.
pub struct MistakenConsumer {
    inner: StockConsumer,
}

impl MistakenConsumer {
    /// The inbox's consumer on `db` under `consumer`, failing as `faults` says.
    pub fn new(db: DatabaseConnection, consumer: ConsumerName, faults: Faults) -> Self {
        let kind = HandlerKind::Inbox(DetectMode::OnConflict);
        let inner = StockConsumer::new(db, kind, Strategy::Inbox(DetectMode::OnConflict), consumer);
        Self {
            inner: inner.with_faults(faults),
        }
    }

    /// The record is committed on its own, then the work in a second transaction: a crash in
    /// between loses the work (at-most-once).
    pub async fn record_first_in_separate_transactions(
        &self,
        message: &Message,
    ) -> Result<Outcome, HandleError> {
        let c = &self.inner;
        let key = message.key.storage_key();
        let hash = message.payload_hash();
        if !claim_on_conflict(&c.db, &key, &c.consumer, &hash, true).await? {
            return Ok(judge_lost_claim(&c.db, &key, &c.consumer, &hash).await?);
        }
        c.faults.pass(CrashPoint::AfterDedupCheck).await?;
        c.work_in_own_transaction(&key, message).await
    }

    /// The cache arbitrates: the key is claimed there, the work committed in the database. A
    /// crash before the commit leaves the key claimed and the work undone.
    pub async fn claim_in_cache(
        &self,
        cache: &impl CacheClaim,
        message: &Message,
    ) -> Result<Outcome, HandleError> {
        let c = &self.inner;
        let key = message.key.storage_key();
        if !cache.claim(message).await {
            return Ok(Outcome::Duplicate);
        }
        c.faults.pass(CrashPoint::AfterDedupCheck).await?;
        c.work_in_own_transaction(&key, message).await
    }

    /// The inbox transaction is open, but the work goes through another pooled connection and
    /// commits on its own: a crash before the claim commits keeps the work. (The work comes
    /// before the claim because on SQLite, with one writer, a second connection writing after
    /// the claim would wait for the claim's transaction forever; the lesson is the same.)
    pub async fn write_through_second_connection(
        &self,
        message: &Message,
    ) -> Result<Outcome, HandleError> {
        let c = &self.inner;
        let key = message.key.storage_key();
        let hash = message.payload_hash();
        // Deferred, as a plain `begin()` is: an immediate one would hold SQLite's write lock
        // and the second connection would wait for it forever.
        let txn = c.db.begin().await?;
        let worked = work::apply_logged(&c.db, &key, &message.event).await;
        let result = match worked {
            Ok(outcome) if outcome.processed() => {
                match claim_on_conflict(&txn, &key, &c.consumer, &hash, true).await {
                    Ok(true) => Ok(outcome),
                    Ok(false) => Ok(judge_lost_claim(&c.db, &key, &c.consumer, &hash).await?),
                    Err(error) => Err(error.into()),
                }
            }
            other => other,
        };
        c.finish(txn, result).await
    }

    /// The work first, the claim last, in one transaction: still correct, since the losing copy
    /// rolls back, but it locked and wrote the stock row before it lost.
    pub async fn claim_last(&self, message: &Message) -> Result<ClaimLastResult, HandleError> {
        let c = &self.inner;
        let key = message.key.storage_key();
        let hash = message.payload_hash();
        let txn = begin_write(&c.db).await?;
        let book = match &message.event {
            Event::Placed(placed) => Some(placed.book_id.as_uuid()),
            Event::Cancelled(_) | Event::StockReserved(_) => None,
        };
        let before = reserved_copies(&txn, book).await?;
        let worked = work::apply_logged(&txn, &key, &message.event).await;
        // The database's word, not the code path's: the row as this transaction sees it moved.
        let wrote_stock_before_claim = reserved_copies(&txn, book).await? != before;
        let result = match worked {
            Ok(outcome) if outcome.processed() => {
                match claim_on_conflict(&txn, &key, &c.consumer, &hash, true).await {
                    Ok(true) => Ok(outcome),
                    Ok(false) => Ok(Outcome::Duplicate),
                    Err(error) => Err(error.into()),
                }
            }
            other => other,
        };
        let outcome = c.finish(txn, result).await?;
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
    Ok(stock_items::Entity::find_by_id(book)
        .one(txn)
        .await?
        .map(|row| row.reserved))
}
