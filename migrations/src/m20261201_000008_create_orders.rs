use sea_orm_migration::{prelude::*, schema::*};

use crate::outbox_table;

#[derive(DeriveMigrationName)]
pub(crate) struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Orders::Table)
                    .if_not_exists()
                    .col(uuid(Orders::OrderId).primary_key())
                    .col(timestamp_with_time_zone(Orders::PlacedAt))
                    .col(timestamp_with_time_zone_null(Orders::CancelledAt))
                    // The OrderCancelled's message id, made once: a retried cancel reports it.
                    .col(string_len_null(Orders::CancelMessageId, 100))
                    .to_owned(),
            )
            .await?;
        manager
            .create_table(
                Table::create()
                    .table(OrderLines::Table)
                    .if_not_exists()
                    .col(uuid(OrderLines::OrderId))
                    .col(uuid(OrderLines::BookId))
                    .col(integer(OrderLines::Quantity))
                    // The OrderPlaced's message id, made once: a retried place reports it.
                    .col(string_len(OrderLines::MessageId, 100))
                    .primary_key(
                        Index::create()
                            .name("pk_order_lines")
                            .col(OrderLines::OrderId)
                            .col(OrderLines::BookId),
                    )
                    .to_owned(),
            )
            .await?;
        outbox_table::create(manager, "orders_outbox").await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        outbox_table::drop(manager, "orders_outbox").await?;
        manager
            .drop_table(Table::drop().table(OrderLines::Table).to_owned())
            .await?;
        manager
            .drop_table(Table::drop().table(Orders::Table).to_owned())
            .await
    }
}

#[derive(DeriveIden)]
enum Orders {
    Table,
    OrderId,
    PlacedAt,
    CancelledAt,
    CancelMessageId,
}

#[derive(DeriveIden)]
enum OrderLines {
    Table,
    OrderId,
    BookId,
    Quantity,
    MessageId,
}
