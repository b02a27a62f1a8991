use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub(crate) struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(StockReservations::Table)
                    .if_not_exists()
                    .col(uuid(StockReservations::OrderId))
                    .col(uuid(StockReservations::BookId))
                    .col(integer(StockReservations::Quantity))
                    .col(string_len(StockReservations::Status, 16))
                    .col(string_len(StockReservations::MessageId, 100))
                    .col(timestamp_with_time_zone(StockReservations::CreatedAt))
                    // The natural key: the business itself refuses a second reservation.
                    .primary_key(
                        Index::create()
                            .name("pk_stock_reservations")
                            .col(StockReservations::OrderId)
                            .col(StockReservations::BookId),
                    )
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(StockReservations::Table).to_owned())
            .await
    }
}

#[derive(DeriveIden)]
enum StockReservations {
    Table,
    OrderId,
    BookId,
    Quantity,
    Status,
    MessageId,
    CreatedAt,
}
