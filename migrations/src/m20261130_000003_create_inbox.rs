use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub(crate) struct Migration;

const COMPLETED_AT_INDEX: &str = "idx_inbox_completed_at";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(
                Table::create()
                    .table(Inbox::Table)
                    .if_not_exists()
                    .col(string_len(Inbox::MessageId, 100))
                    .col(string_len(Inbox::Consumer, 100))
                    .col(timestamp_with_time_zone(Inbox::ReceivedAt))
                    // NULL while a two-phase side effect is in progress.
                    .col(timestamp_with_time_zone_null(Inbox::CompletedAt))
                    .col(string_len(Inbox::PayloadHash, 64))
                    .primary_key(
                        Index::create()
                            .name("pk_inbox")
                            .col(Inbox::MessageId)
                            .col(Inbox::Consumer),
                    )
                    .to_owned(),
            )
            .await?;
        // The retention purge deletes the oldest completed rows first, in batches.
        manager
            .create_index(
                Index::create()
                    .name(COMPLETED_AT_INDEX)
                    .table(Inbox::Table)
                    .if_not_exists()
                    .col(Inbox::CompletedAt)
                    .to_owned(),
            )
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .drop_table(Table::drop().table(Inbox::Table).to_owned())
            .await
    }
}

#[derive(DeriveIden)]
enum Inbox {
    Table,
    MessageId,
    Consumer,
    ReceivedAt,
    CompletedAt,
    PayloadHash,
}
