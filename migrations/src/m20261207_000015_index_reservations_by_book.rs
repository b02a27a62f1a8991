use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub(crate) struct Migration;

const INDEX: &str = "idx_stock_reservations_book";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    /// A partition moving between shards takes its books' reservations with it: the move reads,
    /// copies and deletes them by book (docs/scaling.md, "Moving a partition"). The natural key
    /// leads with the order, so without this index each of those is a scan of every
    /// reservation the shard holds. The order follows the book: a planner that picks this index
    /// to probe a placement's key (as it may on a small table) still finds it in one lookup,
    /// not among every reservation of a hot book.
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_index(
                Index::create()
                    .if_not_exists()
                    .name(INDEX)
                    .table(Alias::new("stock_reservations"))
                    .col(Alias::new("book_id"))
                    .col(Alias::new("order_id"))
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_index(
                Index::drop()
                    .name(INDEX)
                    .table(Alias::new("stock_reservations"))
                    .to_owned(),
            )
            .await
    }
}
