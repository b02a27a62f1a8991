use sea_orm_migration::sea_orm::DbBackend;
use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub(crate) struct Migration;

/// `owns_partition(partition_id)`: whether this database owns the partition, read after the
/// caller's locks were granted. PL/pgSQL and VOLATILE for the reason `lock_order` is: each of its
/// statements takes a new snapshot, so a change of ownership that committed while the calling
/// statement waited for a stock row's lock is seen, where that statement's own snapshot, taken
/// before the wait, would miss it.
const CREATE_SQL: &str = "\
CREATE OR REPLACE FUNCTION owns_partition(partition_id smallint) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN EXISTS (
        SELECT 1 FROM partition_owner o
        WHERE o.partition_id = owns_partition.partition_id AND o.state = 'active'
    );
END
$$";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // One row per partition of the orders stream this database holds, on a shard only; an
        // unsharded database has none and is asked about none. `state` is `active` for a
        // partition this database decides; `epoch` counts its changes of owner, so a row says
        // which assignment it belongs to. `shard` is the name the assignment gives this
        // database, for the operator reading it.
        manager
            .create_table(
                Table::create()
                    .table(PartitionOwner::Table)
                    .if_not_exists()
                    .col(small_integer(PartitionOwner::PartitionId).primary_key())
                    .col(string_len(PartitionOwner::Shard, 100))
                    .col(big_integer(PartitionOwner::Epoch))
                    .col(string_len(PartitionOwner::State, 16))
                    .col(timestamp_with_time_zone(PartitionOwner::ChangedAt))
                    .to_owned(),
            )
            .await?;
        if manager.get_database_backend() == DbBackend::Postgres {
            manager
                .get_connection()
                .execute_unprepared(CREATE_SQL)
                .await?;
        }
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        if manager.get_database_backend() == DbBackend::Postgres {
            manager
                .get_connection()
                .execute_unprepared("DROP FUNCTION IF EXISTS owns_partition(smallint)")
                .await?;
        }
        manager
            .drop_table(Table::drop().table(PartitionOwner::Table).to_owned())
            .await
    }
}

#[derive(DeriveIden)]
enum PartitionOwner {
    Table,
    PartitionId,
    Shard,
    Epoch,
    State,
    ChangedAt,
}
