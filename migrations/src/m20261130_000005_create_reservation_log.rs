use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub(crate) struct Migration;

const ORDER_INDEX: &str = "idx_reservation_log_order_id";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(ReservationLog::Table)
                    .if_not_exists()
                    .col(uuid(ReservationLog::Id).primary_key())
                    .col(uuid(ReservationLog::OrderId))
                    .col(uuid(ReservationLog::BookId))
                    .col(integer(ReservationLog::Quantity))
                    .col(string_len(ReservationLog::Status, 16))
                    .col(string_len(ReservationLog::MessageId, 100))
                    .col(timestamp_with_time_zone(ReservationLog::CreatedAt))
                    .to_owned(),
            )
            .await?;
        manager
            .create_index(
                Index::create()
                    .name(ORDER_INDEX)
                    .table(ReservationLog::Table)
                    .if_not_exists()
                    .col(ReservationLog::OrderId)
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(ReservationLog::Table).to_owned())
            .await
    }
}

#[derive(DeriveIden)]
enum ReservationLog {
    Table,
    Id,
    OrderId,
    BookId,
    Quantity,
    Status,
    MessageId,
    CreatedAt,
}
