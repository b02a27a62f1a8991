use sea_orm_migration::prelude::*;
use sea_orm_migration::sea_orm::DbBackend;

#[derive(DeriveMigrationName)]
pub(crate) struct Migration;

/// `lock_order(order_id)`: the order's lock, then whether the order is cancelled, read after
/// the lock was granted. A transaction-scoped advisory lock, so a placement writes nothing to
/// serialize with a cancellation of its order: no row, no WAL, no dead tuple. PL/pgSQL and
/// VOLATILE on purpose: each of its statements takes a new snapshot (read committed), so it
/// sees a cancellation that committed while it waited, which the calling statement, whose
/// snapshot was taken before, cannot. The first key (x'6f726472', "ordr") names the lock's
/// kind, apart from the purge's one-key lock; the second is the order's hash: two orders sharing
/// one only wait for each other.
///
/// SQLite needs none: a write transaction there holds the database's one writer lock.
const CREATE_SQL: &str = "\
CREATE OR REPLACE FUNCTION lock_order(order_id uuid) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(1869767794, uuid_hash(lock_order.order_id));
    RETURN EXISTS (
        SELECT 1 FROM order_states s
        WHERE s.order_id = lock_order.order_id AND s.cancelled_at IS NOT NULL
    );
END
$$";

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        if manager.get_database_backend() != DbBackend::Postgres {
            return Ok(());
        }
        manager
            .get_connection()
            .execute_unprepared(CREATE_SQL)
            .await
            .map(drop)
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        if manager.get_database_backend() != DbBackend::Postgres {
            return Ok(());
        }
        manager
            .get_connection()
            .execute_unprepared("DROP FUNCTION IF EXISTS lock_order(uuid)")
            .await
            .map(drop)
    }
}
