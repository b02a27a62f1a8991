//! The partitions a shard's database owns (`partition_owner`): what `shard assign` records there
//! before it claims the partition in the assignment bucket, so that the database never lags the
//! bucket in what it owns.

use chrono::Utc;
use sea_orm::{
    ColumnTrait as _, DatabaseConnection, DbErr, EntityTrait, QueryFilter as _, QueryOrder, Set,
    TryInsertResult,
};

use crate::entities::partition_owner;
use crate::stock::DataError;

/// The state of a partition this database decides.
pub const ACTIVE: &str = "active";

/// The epoch of a partition's first owner; each later change of owner counts up from it.
pub const FIRST_EPOCH: i64 = 1;

/// What [`PartitionOwners::record`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recorded {
    /// No row: this database now owns the partition as the shard named.
    Inserted,
    /// A row of the same shard was there already.
    Kept,
    /// A row says another shard name owns it here: nothing changed.
    OtherShard(String),
}

/// One row of `partition_owner`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionRow {
    pub partition: u32,
    pub shard: String,
    pub epoch: i64,
    pub state: String,
}

#[derive(Clone)]
pub struct PartitionOwners {
    db: DatabaseConnection,
}

impl PartitionOwners {
    pub fn new(db: DatabaseConnection) -> Self {
        Self { db }
    }

    /// Records that this database owns `partition` as `shard` (state `active`, the first
    /// epoch), unless a row for it exists: that one is kept as it is.
    pub async fn record(&self, partition: u32, shard: &str) -> Result<Recorded, DbErr> {
        let row = partition_owner::ActiveModel {
            partition_id: Set(partition_column(partition)?),
            shard: Set(shard.to_owned()),
            epoch: Set(FIRST_EPOCH),
            state: Set(ACTIVE.to_owned()),
            changed_at: Set(Utc::now().fixed_offset()),
        };
        let inserted = partition_owner::Entity::insert(row)
            .on_conflict_do_nothing()
            .exec_without_returning(&self.db)
            .await?;
        if matches!(inserted, TryInsertResult::Inserted(rows) if rows > 0) {
            return Ok(Recorded::Inserted);
        }
        let existing = partition_owner::Entity::find_by_id(partition_column(partition)?)
            .one(&self.db)
            .await?
            .ok_or(DataError::Vanished {
                table: "partition_owner",
            })?;
        Ok(if existing.shard == shard {
            Recorded::Kept
        } else {
            Recorded::OtherShard(existing.shard)
        })
    }

    /// Removes the row [`record`](Self::record) inserted for `partition` when its claim in the
    /// bucket was lost: only a row of `shard` at the first epoch, so nothing another command
    /// wrote since is touched.
    pub async fn forget(&self, partition: u32, shard: &str) -> Result<(), DbErr> {
        partition_owner::Entity::delete_many()
            .filter(partition_owner::Column::PartitionId.eq(partition_column(partition)?))
            .filter(partition_owner::Column::Shard.eq(shard))
            .filter(partition_owner::Column::Epoch.eq(FIRST_EPOCH))
            .exec(&self.db)
            .await?;
        Ok(())
    }

    /// Every row, by partition.
    pub async fn list(&self) -> Result<Vec<PartitionRow>, DbErr> {
        partition_owner::Entity::find()
            .order_by_asc(partition_owner::Column::PartitionId)
            .all(&self.db)
            .await?
            .into_iter()
            .map(|row| {
                Ok(PartitionRow {
                    partition: u32::try_from(row.partition_id).map_err(|_| {
                        DataError::Unreadable {
                            column: "partition_id",
                            value: row.partition_id.to_string(),
                        }
                    })?,
                    shard: row.shard,
                    epoch: row.epoch,
                    state: row.state,
                })
            })
            .collect()
    }
}

/// A partition as its `smallint` column holds it.
fn partition_column(partition: u32) -> Result<i16, DataError> {
    i16::try_from(partition).map_err(|_| DataError::TooLarge {
        column: "partition_id",
        value: partition.to_string(),
    })
}
