//! Connecting to PostgreSQL or SQLite with settings fit for a consumer, and applying migrations.

use std::time::Duration;

use inventory_migrations::{Migrator, MigratorTrait};
use sea_orm::sqlx::sqlite::SqliteJournalMode;
use sea_orm::{ConnectOptions, DatabaseConnection, DbErr};

/// The embedded default: a SQLite file in the working directory.
pub const DEFAULT_DATABASE_URL: &str = "sqlite://inventory.db?mode=rwc";

/// How long a SQLite writer waits for another writer's transaction before giving up.
const SQLITE_BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Opens a pool of at most `max_connections`.
///
/// Statements are logged at DEBUG, not sea-orm's default INFO, so a busy consumer's log stays
/// about messages. SQLite runs in WAL mode with a busy timeout, so concurrent writers queue
/// instead of failing at once.
pub async fn connect(url: &str, max_connections: u32) -> Result<DatabaseConnection, DbErr> {
    let mut options = ConnectOptions::new(url);
    options
        .max_connections(max_connections)
        .min_connections(1)
        .connect_timeout(Duration::from_secs(5))
        .acquire_timeout(Duration::from_secs(10))
        .sqlx_logging_level(tracing::log::LevelFilter::Debug)
        .map_sqlx_sqlite_opts(|sqlite| {
            sqlite
                .journal_mode(SqliteJournalMode::Wal)
                .busy_timeout(SQLITE_BUSY_TIMEOUT)
                .foreign_keys(true)
        });
    sea_orm::Database::connect(options).await
}

/// Applies every pending migration.
pub async fn migrate(db: &DatabaseConnection) -> Result<(), DbErr> {
    Migrator::up(db, None).await
}

/// [`connect`] then [`migrate`]: what every command that needs the schema does first.
pub async fn connect_and_migrate(
    url: &str,
    max_connections: u32,
) -> Result<DatabaseConnection, DbErr> {
    let db = connect(url, max_connections).await?;
    migrate(&db).await?;
    Ok(db)
}
