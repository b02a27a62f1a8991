use sea_orm_migration::sea_orm::DbBackend;
use sea_orm_migration::{prelude::*, schema::*};

#[derive(DeriveMigrationName)]
pub(crate) struct Migration;

/// `lock_line(order_id, book_id)`: the order's lock, as `lock_order` takes it (the same key, so
/// a line's placement and its order's cancellation wait for each other), then whether the order
/// or this line of it is cancelled, read after the lock was granted, with a snapshot of its own
/// (PL/pgSQL, VOLATILE: see `lock_order`).
const CREATE_SQL: &str = "\
CREATE OR REPLACE FUNCTION lock_line(order_id uuid, book_id uuid) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(1869767794, uuid_hash(lock_line.order_id));
    RETURN EXISTS (
        SELECT 1 FROM order_states s
        WHERE s.order_id = lock_line.order_id AND s.cancelled_at IS NOT NULL
    ) OR EXISTS (
        SELECT 1 FROM line_cancellations c
        WHERE c.order_id = lock_line.order_id AND c.book_id = lock_line.book_id
    );
END
$$";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        // One row per cancelled order line, written once by its first cancellation: a
        // cancellation that arrives before the line's placement still wins. Keyed by the line,
        // so it lives with the line's book, on the book's shard.
        manager
            .create_table(
                Table::create()
                    .table(LineCancellations::Table)
                    .if_not_exists()
                    .col(uuid(LineCancellations::OrderId))
                    .col(uuid(LineCancellations::BookId))
                    .col(timestamp_with_time_zone(LineCancellations::CancelledAt))
                    .col(string_len(LineCancellations::CancelMessageId, 100))
                    .primary_key(
                        Index::create()
                            .name("pk_line_cancellations")
                            .col(LineCancellations::OrderId)
                            .col(LineCancellations::BookId),
                    )
                    .to_owned(),
            )
            .await?;
        if manager.get_database_backend() == DbBackend::Postgres {
            manager
                .get_connection()
                .execute_unprepared(CREATE_SQL)
                .await?;
        }
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        if manager.get_database_backend() == DbBackend::Postgres {
            manager
                .get_connection()
                .execute_unprepared("DROP FUNCTION IF EXISTS lock_line(uuid, uuid)")
                .await?;
        }
        manager
            .drop_table(Table::drop().table(LineCancellations::Table).to_owned())
            .await
    }
}

#[derive(DeriveIden)]
enum LineCancellations {
    Table,
    OrderId,
    BookId,
    CancelledAt,
    CancelMessageId,
}
