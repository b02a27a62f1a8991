use sea_orm_migration::prelude::*;

#[derive(DeriveMigrationName)]
pub(crate) struct Migration;

/// The outbox tables (`outbox_table.rs`), after both exist.
const TABLES: [&str; 2] = ["outbox", "orders_outbox"];

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    /// Orders with a parked row: the relay holds their later rows back, so it looks parked
    /// rows up by order. Partial, so only parked rows are in it and the writers' inserts never
    /// touch it. The same text on PostgreSQL and SQLite; sea-query builds no partial index.
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for table in TABLES {
            manager
                .get_connection()
                .execute_unprepared(&format!(
                    "CREATE INDEX IF NOT EXISTS idx_{table}_parked_order \
                     ON {table} (order_id, seq) WHERE parked_at IS NOT NULL"
                ))
                .await?;
        }
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        for table in TABLES {
            manager
                .get_connection()
                .execute_unprepared(&format!("DROP INDEX IF EXISTS idx_{table}_parked_order"))
                .await?;
        }
        Ok(())
    }
}
