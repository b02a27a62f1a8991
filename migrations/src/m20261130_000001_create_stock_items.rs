use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub(crate) struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(StockItems::Table)
                    .if_not_exists()
                    .col(uuid(StockItems::BookId).primary_key())
                    .col(string_len(StockItems::Title, 500))
                    .col(integer(StockItems::OnHand).check(Expr::col(StockItems::OnHand).gte(0)))
                    .col(
                        integer(StockItems::Reserved)
                            .default(0)
                            .check(Expr::col(StockItems::Reserved).gte(0)),
                    )
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(StockItems::Table).to_owned())
            .await
    }
}

#[derive(DeriveIden)]
pub(crate) enum StockItems {
    Table,
    BookId,
    Title,
    OnHand,
    Reserved,
}
