use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub(crate) struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(OrderStates::Table)
                    .if_not_exists()
                    .col(uuid(OrderStates::OrderId).primary_key())
                    .col(timestamp_with_time_zone_null(OrderStates::CancelledAt))
                    .col(string_len_null(OrderStates::CancelMessageId, 100))
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(OrderStates::Table).to_owned())
            .await
    }
}

#[derive(DeriveIden)]
enum OrderStates {
    Table,
    OrderId,
    CancelledAt,
    CancelMessageId,
}
