use sea_orm_migration::prelude::*;

use crate::outbox_table;

#[derive(DeriveMigrationName)]
pub(crate) struct Migration;

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        outbox_table::create(manager, "outbox").await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        outbox_table::drop(manager, "outbox").await
    }
}
