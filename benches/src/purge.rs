//! Retention of dedup records: completed inbox rows older than a horizon are deleted in
//! bounded batches, each its own short statement driven by the `completed_at` index, so a
//! large purge never holds the consumer up for more than one batch. Rows still "processing"
//! are never purged by age: an unfinished side effect is something to reconcile, not forget.

use chrono::{DateTime, Utc};
use sea_orm::sea_query::{Expr, ExprTrait, Query};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DatabaseConnection, DbBackend, DbErr, EntityTrait,
    PaginatorTrait, QueryFilter, QueryOrder, QuerySelect, Statement,
};

use crate::entities::inbox;

/// What a purge did (or, dry, would do).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PurgeReport {
    /// Completed rows deleted (dry run: that would be deleted).
    pub deleted: u64,
    pub batches: u64,
    /// Rows still "processing" that are older than the cutoff: kept, and worth a look.
    pub processing_older: u64,
    /// Another instance held the purge lock: this one did nothing.
    pub skipped_locked: bool,
}

/// Any number: it only has to be the same in every instance of the service.
const PURGE_LOCK_KEY: i64 = 0x696e_626f_7870; // "inboxp"

/// Deletes `consumer`'s completed inbox rows with `completed_at` before `cutoff`, `batch_size`
/// at a time: one consumer's rows only, since the cutoff must cover that consumer's own
/// redelivery horizon. On PostgreSQL each batch first takes a transaction-scoped advisory lock,
/// so with several instances only one purges at a time; on SQLite the single writer already
/// serializes them.
pub async fn purge_completed(
    db: &DatabaseConnection,
    consumer: &str,
    cutoff: DateTime<Utc>,
    batch_size: u64,
    dry_run: bool,
) -> Result<PurgeReport, DbErr> {
    let processing_older = inbox::Entity::find()
        .filter(inbox::Column::Consumer.eq(consumer))
        .filter(inbox::Column::CompletedAt.is_null())
        .filter(inbox::Column::ReceivedAt.lt(cutoff))
        .count(db)
        .await?;
    let mut report = PurgeReport {
        processing_older,
        ..PurgeReport::default()
    };
    if dry_run {
        report.deleted = inbox::Entity::find()
            .filter(inbox::Column::Consumer.eq(consumer))
            .filter(inbox::Column::CompletedAt.lt(cutoff))
            .count(db)
            .await?;
        return Ok(report);
    }
    loop {
        let Some(deleted) = delete_batch(db, consumer, cutoff, batch_size).await? else {
            report.skipped_locked = true;
            return Ok(report);
        };
        report.deleted += deleted;
        report.batches += 1;
        if deleted < batch_size {
            return Ok(report);
        }
    }
}

/// One batch in its own transaction; `None` if another purger holds the lock.
async fn delete_batch(
    db: &DatabaseConnection,
    consumer: &str,
    cutoff: DateTime<Utc>,
    batch_size: u64,
) -> Result<Option<u64>, DbErr> {
    let txn = sea_orm::TransactionTrait::begin(db).await?;
    if db.get_database_backend() == DbBackend::Postgres {
        let locked = txn
            .query_one_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "SELECT pg_try_advisory_xact_lock($1) AS locked",
                [PURGE_LOCK_KEY.into()],
            ))
            .await?
            .map(|row| row.try_get::<bool>("", "locked"))
            .transpose()?
            .unwrap_or(false);
        if !locked {
            txn.rollback().await?;
            return Ok(None);
        }
    }
    // The oldest completed rows first, through the completed_at index.
    let deleted = if db.get_database_backend() == DbBackend::Postgres {
        // By physical row id: PostgreSQL plans the portable form below as a hash join over a
        // scan of the whole table (1.6 s per batch at a million rows); this is a TID scan
        // (10 ms). Completed rows are never updated, so their ids hold for the statement.
        txn.execute_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "DELETE FROM inbox WHERE ctid = ANY(ARRAY(\
               SELECT ctid FROM inbox WHERE completed_at < $1 AND consumer = $3 \
               ORDER BY completed_at LIMIT $2))",
            [
                cutoff.into(),
                i64::try_from(batch_size).unwrap_or(i64::MAX).into(),
                consumer.into(),
            ],
        ))
        .await?
        .rows_affected()
    } else {
        let oldest = Query::select()
            .columns([inbox::Column::MessageId, inbox::Column::Consumer])
            .from(inbox::Entity)
            .and_where(Expr::col(inbox::Column::CompletedAt).lt(cutoff))
            .and_where(Expr::col(inbox::Column::Consumer).eq(consumer))
            .order_by(inbox::Column::CompletedAt, sea_orm::Order::Asc)
            .limit(batch_size)
            .to_owned();
        inbox::Entity::delete_many()
            .filter(
                Expr::tuple([
                    Expr::col(inbox::Column::MessageId),
                    Expr::col(inbox::Column::Consumer),
                ])
                .in_subquery(oldest),
            )
            .exec(&txn)
            .await?
            .rows_affected
    };
    txn.commit().await?;
    Ok(Some(deleted))
}

/// The consumers that have rows in the inbox, in name order.
pub async fn inbox_consumers(db: &DatabaseConnection) -> Result<Vec<String>, DbErr> {
    inbox::Entity::find()
        .select_only()
        .column(inbox::Column::Consumer)
        .distinct()
        .order_by_asc(inbox::Column::Consumer)
        .into_tuple()
        .all(db)
        .await
}
