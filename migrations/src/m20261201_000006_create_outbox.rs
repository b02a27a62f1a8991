use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub(crate) struct Migration;

const PENDING_INDEX: &str = "idx_outbox_partition_seq";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Outbox::Table)
                    .if_not_exists()
                    // Write order. Not commit order across orders: the relay reads every row
                    // left, never "after the last seen", so a row that commits late is not
                    // skipped. Within one order it is commit order (natural.rs says why).
                    .col(big_pk_auto(Outbox::Seq))
                    .col(uuid_uniq(Outbox::EventId))
                    .col(small_integer(Outbox::RelayPartition))
                    .col(uuid(Outbox::OrderId))
                    // Below the stream's prefix: `stock.reserved` goes to `inventory.stock.reserved`.
                    .col(string_len(Outbox::Subject, 200))
                    .col(text(Outbox::Payload))
                    .col(timestamp_with_time_zone(Outbox::CreatedAt))
                    // Set when the relay gave up on the row (too large, no stream for its
                    // subject): it waits for an operator, and blocks only its own order.
                    .col(timestamp_with_time_zone_null(Outbox::ParkedAt))
                    .col(text_null(Outbox::ParkedReason))
                    .to_owned(),
            )
            .await?;
        // A relay reads the partitions it holds, oldest first.
        manager
            .create_index(
                Index::create()
                    .name(PENDING_INDEX)
                    .table(Outbox::Table)
                    .if_not_exists()
                    .col(Outbox::RelayPartition)
                    .col(Outbox::Seq)
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(Outbox::Table).to_owned())
            .await
    }
}

#[derive(DeriveIden)]
enum Outbox {
    Table,
    Seq,
    EventId,
    RelayPartition,
    OrderId,
    Subject,
    Payload,
    CreatedAt,
    ParkedAt,
    ParkedReason,
}
