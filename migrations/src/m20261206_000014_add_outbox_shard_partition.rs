use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub(crate) struct Migration;

/// The outbox tables (`outbox_table.rs`), one shape for both, so one relay publishes either.
const TABLES: [&str; 2] = ["outbox", "orders_outbox"];

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    /// On a shard, each event's row carries the partition of the orders stream its book is in
    /// (NULL unsharded), so that the events of a partition leaving the shard can be told from
    /// the rest and drained before it goes (docs/scaling.md).
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for table in TABLES {
            manager
                .alter_table(
                    Table::alter()
                        .table(Alias::new(table))
                        .add_column(small_integer_null(Alias::new("shard_partition")))
                        .to_owned(),
                )
                .await?;
        }
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for table in TABLES {
            manager
                .alter_table(
                    Table::alter()
                        .table(Alias::new(table))
                        .drop_column(Alias::new("shard_partition"))
                        .to_owned(),
                )
                .await?;
        }
        Ok(())
    }
}
