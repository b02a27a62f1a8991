use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub(crate) struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // One row per (outbox, partition): who publishes it, until when. `outbox` names the
        // table the relay reads (`outbox`, `orders_outbox`), so relays of several outboxes share
        // these tables. Times are milliseconds since the epoch by the database's clock, so the
        // relays' own clocks never have to agree.
        manager
            .create_table(
                Table::create()
                    .table(OutboxLeases::Table)
                    .if_not_exists()
                    .col(string_len(OutboxLeases::Outbox, 64))
                    .col(small_integer(OutboxLeases::RelayPartition))
                    .col(string_len_null(OutboxLeases::Holder, 100))
                    .col(big_integer(OutboxLeases::ExpiresAt))
                    .primary_key(
                        Index::create()
                            .name("pk_outbox_leases")
                            .col(OutboxLeases::Outbox)
                            .col(OutboxLeases::RelayPartition),
                    )
                    .to_owned(),
            )
            .await?;
        // The heartbeats: each running relay's row, renewed with its leases. The live rows
        // say how many relays share the partitions, so each takes its fair share.
        manager
            .create_table(
                Table::create()
                    .table(OutboxRelays::Table)
                    .if_not_exists()
                    .col(string_len(OutboxRelays::Outbox, 64))
                    .col(string_len(OutboxRelays::Holder, 100))
                    .col(big_integer(OutboxRelays::ExpiresAt))
                    .primary_key(
                        Index::create()
                            .name("pk_outbox_relays")
                            .col(OutboxRelays::Outbox)
                            .col(OutboxRelays::Holder),
                    )
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(OutboxRelays::Table).to_owned())
            .await?;
        manager
            .drop_table(Table::drop().table(OutboxLeases::Table).to_owned())
            .await
    }
}

#[derive(DeriveIden)]
enum OutboxLeases {
    Table,
    Outbox,
    RelayPartition,
    Holder,
    ExpiresAt,
}

#[derive(DeriveIden)]
enum OutboxRelays {
    Table,
    Outbox,
    Holder,
    ExpiresAt,
}
