use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub(crate) struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    /// The orders producer cancels an order line by line, one OrderCancelled per line on its
    /// book's subject, so that each reaches the shard of its book. Each line keeps its message's
    /// id, made once: a retried cancel reports it. `orders.cancel_message_id` stays for the
    /// orders cancelled before, under one message for the whole order.
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(OrderLines::Table)
                    .add_column(string_len_null(OrderLines::CancelMessageId, 100))
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .alter_table(
                Table::alter()
                    .table(OrderLines::Table)
                    .drop_column(OrderLines::CancelMessageId)
                    .to_owned(),
            )
            .await
    }
}

#[derive(DeriveIden)]
enum OrderLines {
    Table,
    CancelMessageId,
}
