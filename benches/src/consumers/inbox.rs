//! The inbox: a `(message_id, consumer)` row claimed first, in the work's own transaction.

use chrono::Utc;
use inventory_domain::{ConsumerName, Message, Outcome};
use sea_orm::{ConnectionTrait, DbErr, EntityTrait, Set, SqlErr, TryInsertResult};

use crate::db::begin_write;
use crate::entities::inbox;
use crate::payload_hash::PayloadHash;
use crate::readback::find_inbox_entry;
use inventory_infra::{CrashPoint, HandleError};

use super::{DetectMode, StockConsumer, compare_payload, finish, work};

fn inbox_row(
    key: &str,
    consumer: &ConsumerName,
    hash: &PayloadHash,
    completed: bool,
) -> inbox::ActiveModel {
    let now = Utc::now();
    inbox::ActiveModel {
        message_id: Set(key.to_owned()),
        consumer: Set(consumer.as_str().to_owned()),
        received_at: Set(now),
        completed_at: Set(completed.then_some(now)),
        payload_hash: Set(hash.as_str().to_owned()),
    }
}

/// Claims the key with `INSERT … ON CONFLICT DO NOTHING`; true if this copy won.
pub async fn claim_on_conflict(
    conn: &impl ConnectionTrait,
    key: &str,
    consumer: &ConsumerName,
    hash: &PayloadHash,
    completed: bool,
) -> Result<bool, DbErr> {
    let result = inbox::Entity::insert(inbox_row(key, consumer, hash, completed))
        .on_conflict_do_nothing()
        .exec_without_returning(conn)
        .await?;
    // sea-orm reports a skipped row as `Inserted(0)` here, not `Conflicted`: count the rows.
    Ok(matches!(result, TryInsertResult::Inserted(rows) if rows > 0))
}

/// Claims the key with a plain insert and turns the unique violation into `false`. On PostgreSQL
/// the violation has aborted the transaction: the caller must roll it back, not go on.
async fn claim_catching_violation(
    conn: &impl ConnectionTrait,
    key: &str,
    consumer: &ConsumerName,
    hash: &PayloadHash,
) -> Result<bool, DbErr> {
    match inbox::Entity::insert(inbox_row(key, consumer, hash, true))
        .exec_without_returning(conn)
        .await
    {
        Ok(_) => Ok(true),
        Err(error) if matches!(error.sql_err(), Some(SqlErr::UniqueConstraintViolation(_))) => {
            Ok(false)
        }
        Err(error) => Err(error),
    }
}

/// What the inbox already says of the key, if it holds it: the same content is a duplicate,
/// other content a refusal.
pub async fn recorded_outcome(
    conn: &impl ConnectionTrait,
    key: &str,
    consumer: &ConsumerName,
    hash: &PayloadHash,
) -> Result<Option<Outcome>, DbErr> {
    Ok(find_inbox_entry(conn, key, consumer.as_str())
        .await?
        .map(|existing| compare_payload(&existing.payload_hash, hash)))
}

/// What a lost claim means: compare with the row that won.
pub async fn judge_lost_claim(
    conn: &impl ConnectionTrait,
    key: &str,
    consumer: &ConsumerName,
    hash: &PayloadHash,
) -> Result<Outcome, DbErr> {
    recorded_outcome(conn, key, consumer, hash)
        .await?
        // Purged between the conflict and this read: let the redelivery decide afresh.
        .ok_or_else(|| {
            DbErr::RecordNotFound(format!(
                "inbox row {key} for {consumer} vanished after a conflict"
            ))
        })
}

impl StockConsumer {
    pub(super) async fn handle_inbox(
        &self,
        message: &Message,
        mode: DetectMode,
    ) -> Result<Outcome, HandleError> {
        let key = message.key.storage_key();
        let hash = PayloadHash::of(message);
        if mode == DetectMode::PreCheck
            && let Some(outcome) = recorded_outcome(&self.db, &key, &self.consumer, &hash).await?
        {
            return Ok(outcome);
        }
        let txn = begin_write(&self.db).await?;
        let claimed = match mode {
            DetectMode::OnConflict => {
                claim_on_conflict(&txn, &key, &self.consumer, &hash, true).await
            }
            DetectMode::CatchViolation | DetectMode::PreCheck => {
                claim_catching_violation(&txn, &key, &self.consumer, &hash).await
            }
        };
        let claimed = match claimed {
            Ok(claimed) => claimed,
            Err(error) => return finish(txn, Err(error.into()), &self.faults).await,
        };
        if !claimed {
            txn.rollback().await?;
            return Ok(judge_lost_claim(&self.db, &key, &self.consumer, &hash).await?);
        }
        if let Err(crash) = self.faults.pass(CrashPoint::AfterDedupCheck).await {
            return finish(txn, Err(crash.into()), &self.faults).await;
        }
        let result = work::apply_logged(&txn, &key, &message.event).await;
        finish(txn, result, &self.faults).await
    }
}
