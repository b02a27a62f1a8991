//! Connecting as the study, the benchmarks and the tests do: a pool whose statements are not
//! bounded, a database of their own migrated, and a transaction that will write, for the
//! study's sea-orm handlers. The service's own connections are `inventory_infra::db`'s, their
//! bounds from its flags.

use inventory_infra::db::{DbTimeouts, SchemaError, connect_with, migrate};
use sea_orm::{
    DatabaseConnection, DatabaseTransaction, DbErr, SqliteTransactionMode, TransactionOptions,
    TransactionTrait as _,
};

/// Begins a transaction that will write. On SQLite it takes the write lock at `BEGIN`
/// (`IMMEDIATE`): a deferred transaction that reads first cannot upgrade once another writer
/// committed, and fails with "database is locked" instead of waiting its turn.
pub async fn begin_write(db: &DatabaseConnection) -> Result<DatabaseTransaction, DbErr> {
    db.begin_with_options(TransactionOptions {
        sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
        ..TransactionOptions::default()
    })
    .await
}

/// Opens a pool of at most `max_connections` whose statements are not bounded: for the tools,
/// benchmarks and tests. The commands take their [`DbTimeouts`] from their flags.
pub async fn connect(url: &str, max_connections: u32) -> Result<DatabaseConnection, DbErr> {
    connect_with(url, max_connections, DbTimeouts::unbounded_statements()).await
}

/// [`connect_with`] then [`migrate`], statements unbounded: for the tools and tests that make
/// a database of their own.
pub async fn connect_and_migrate(
    url: &str,
    max_connections: u32,
) -> Result<DatabaseConnection, SchemaError> {
    let db = connect_with(url, max_connections, DbTimeouts::unbounded_statements()).await?;
    migrate(&db).await?;
    Ok(db)
}
