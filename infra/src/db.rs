//! Connecting to PostgreSQL or SQLite with settings fit for a consumer (bounded waits on a
//! database that goes silent: [`DbTimeouts`], [`within`]), applying migrations,
//! what a database error means for a retry ([`DbFailure`]), whether the database answers,
//! asked outside the pool ([`Probe`]), and the schema checked instead of migrated by a role
//! that may not change it ([`SchemaPolicy`]). Also one column of a statement's rows, read the
//! same way for every backend (`column_of_rows`).

mod failure;
mod probe;
mod schema;

use std::time::Duration;

pub use failure::{DbErrorCode, DbFailure};
use futures::FutureExt;
use futures::future::Either;
use inventory_migrations::{Migrator, MigratorTrait};
pub use probe::{Probe, ProbeError};
pub use schema::{MissingPrivilege, SchemaError, SchemaPolicy};
use sea_orm::sqlx::sqlite::SqliteJournalMode;
use sea_orm::{
    ConnectOptions, ConnectionTrait, Statement, StatementBuilder, TransactionTrait, TryGetable,
};
pub use sea_orm::{DatabaseConnection, DbBackend, DbErr};

/// `column` of every row `query` returns.
pub(crate) async fn column_of_rows<T, C>(
    db: &impl ConnectionTrait,
    query: &impl StatementBuilder,
    column: &str,
) -> Result<C, DbErr>
where
    T: TryGetable,
    C: FromIterator<T>,
{
    db.query_all(query)
        .await?
        .iter()
        .map(|row| row.try_get::<T>("", column))
        .collect()
}

/// The embedded default: a SQLite file in the working directory.
pub const DEFAULT_DATABASE_URL: &str = "sqlite://inventory.db?mode=rwc";

/// How long a SQLite writer waits for another writer's transaction before giving up.
const SQLITE_BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the database may take before the client gives up on it. A server that stops
/// answering without closing the connection (a host gone, a link dropped silently) is noticed
/// only by the client's own clock: the server's `statement_timeout` never fires for a statement
/// it never received, or whose answer is lost on the way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DbTimeouts {
    /// Opening a connection: TCP, TLS, start-up and authentication.
    pub connect: Duration,
    /// One statement, as PostgreSQL's `statement_timeout` on every connection, and a session's
    /// time idle inside a transaction (`idle_in_transaction_session_timeout`); the client
    /// bounds a message's database work at this plus [`CLIENT_GRACE`] ([`Self::work`]).
    /// Zero: no bound (the server's default, and no client-side bound either).
    pub statement: Duration,
}

/// The margin the client's bound leaves the server's `statement_timeout`, so that while the
/// server answers, its cancel (a clean error on a connection that stays usable) comes first.
pub const CLIENT_GRACE: Duration = Duration::from_secs(1);

impl Default for DbTimeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(5),
            statement: Duration::from_secs(15),
        }
    }
}

impl DbTimeouts {
    /// No statement bound: for the migrations, whose DDL may rightly run long.
    pub fn unbounded_statements() -> Self {
        Self {
            statement: Duration::ZERO,
            ..Self::default()
        }
    }

    /// The client-side bound on one unit of database work (a message's transaction, a
    /// relay's statement); `None` when statements are unbounded.
    pub fn work(&self) -> Option<Duration> {
        (!self.statement.is_zero()).then_some(self.statement + CLIENT_GRACE)
    }

    /// A wait for a pooled connection: a connect, after the connections in use had the
    /// time of a connect to come back.
    fn acquire(&self) -> Duration {
        self.connect * 2
    }
}

/// `work` on the database, abandoned (dropped, with whatever connection it held) if `bound`
/// passes first; `None`: unbounded.
///
/// Not an `async fn`: that would keep `work` twice in its state, as its argument and inside
/// the timeout, and a handler's future is kilobytes, copied on every move of every message's.
pub fn within<F: Future>(
    bound: Option<Duration>,
    work: F,
) -> impl Future<Output = Result<F::Output, NoAnswer>> {
    match bound {
        Some(bound) => Either::Left(
            tokio::time::timeout(bound, work)
                .map(move |result| result.map_err(|_| NoAnswer(bound))),
        ),
        None => Either::Right(work.map(Ok)),
    }
}

/// The database did not answer within the client's bound: the work was abandoned, its
/// connection closed. Whether it committed is unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no answer from the database within {0:?}; abandoned")]
pub struct NoAnswer(pub Duration);

/// Opens a pool of at most `max_connections`.
///
/// Statements are logged at DEBUG, not sea-orm's default INFO, so a busy consumer's log stays
/// about messages. SQLite runs in WAL mode with a busy timeout, so concurrent writers queue
/// instead of failing at once.
///
/// PostgreSQL's TLS is as the URL says (`?sslmode=verify-full&sslrootcert=ca.pem`, or
/// `ssl-mode`), else as `PGSSLMODE` says, else the driver's `prefer`: the URL is never amended,
/// so nothing here weakens what it asks for.
///
/// A connection coming back to the pool is pinged by sqlx before it is reused, without a
/// bound: one whose work was abandoned on a silent network would hang that ping and hold its
/// pool slot for good. The pool pings it first within `timeouts.connect` and closes it,
/// without a word to the server, if no answer comes.
pub async fn connect_with(
    url: &str,
    max_connections: u32,
    timeouts: DbTimeouts,
) -> Result<DatabaseConnection, DbErr> {
    // TLS as the URL (or PGSSLMODE) says, in either of the driver's spellings (`sslmode`,
    // `ssl-mode`); unsaid, the driver's default, `prefer`: TLS whenever the server offers it.
    let postgres = is_postgres(url);
    let mut options = ConnectOptions::new(url);
    options
        .max_connections(max_connections)
        .min_connections(1)
        .acquire_timeout(timeouts.acquire())
        .sqlx_logging_level(tracing::log::LevelFilter::Debug)
        .map_sqlx_postgres_pool_opts(move |pool| {
            pool.after_release(move |connection, _| {
                Box::pin(async move {
                    use sea_orm::sqlx::Connection as _;
                    match tokio::time::timeout(timeouts.connect, connection.ping()).await {
                        Ok(answered) => answered.map(|()| true),
                        // Err closes it hard: no goodbye on a connection that does not answer.
                        Err(_) => Err(sea_orm::sqlx::Error::PoolTimedOut),
                    }
                })
            })
        })
        .map_sqlx_sqlite_opts(|sqlite| {
            sqlite
                .journal_mode(SqliteJournalMode::Wal)
                .busy_timeout(SQLITE_BUSY_TIMEOUT)
                .foreign_keys(true)
        });
    if postgres {
        // The placement statement is written for READ COMMITTED (docs/statement.md, "The
        // isolation level"): under REPEATABLE READ it would miss a cancellation that committed
        // while it waited for the order's lock. Asked for here, so a database or role whose
        // default is another level does not change it.
        let mut settings = vec![("default_transaction_isolation", "read committed".to_owned())];
        if !timeouts.statement.is_zero() {
            // The server's side of the same bound. A client gone silent inside a transaction
            // leaves its session idle in it, holding its row locks (a book's stock row: every
            // placement of that book then waits on it) until the server ends the session,
            // which nothing else makes it do while the TCP connection looks alive.
            let millis = timeouts.statement.as_millis().to_string();
            settings.push(("statement_timeout", millis.clone()));
            settings.push(("idle_in_transaction_session_timeout", millis));
        }
        options.map_sqlx_postgres_opts(move |postgres| postgres.options(settings.clone()));
    }
    sea_orm::Database::connect(options).await
}

/// Ok when the database answers and takes writes. On PostgreSQL a server that answers but
/// refuses writes (`transaction_read_only` on: a standby that a proxy leads to during a
/// failover, or a read-only default) is as good as down for a consumer, so it is an error
/// here rather than a ping that passes and a write that fails.
pub async fn check_writable(db: &DatabaseConnection) -> Result<(), NotWritable> {
    if db.get_database_backend() != DbBackend::Postgres {
        return Ok(db.ping().await?);
    }
    let row = db
        .query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT current_setting('transaction_read_only') = 'on' AS read_only",
        ))
        .await?
        .ok_or_else(|| DbErr::RecordNotFound("the read-only check's row".into()))?;
    if row.try_get::<bool>("", "read_only")? {
        return Err(NotWritable::ReadOnly);
    }
    Ok(())
}

/// Why [`check_writable`] found the database unfit to write to.
#[derive(Debug, thiserror::Error)]
pub enum NotWritable {
    #[error(transparent)]
    Database(#[from] DbErr),
    #[error(transparent)]
    NoAnswer(#[from] NoAnswer),
    #[error("the server is read-only (a standby?): writes would be refused")]
    ReadOnly,
}

/// The advisory lock the migrations run under on PostgreSQL: ("migr", 1), apart from the
/// purge's and the orders' locks.
const MIGRATION_LOCK: (i32, i32) = (0x6d69_6772, 1);

/// Applies every pending migration, one migrator at a time: on PostgreSQL in one transaction
/// that first takes an advisory lock, so instances starting together on an empty database
/// apply them once while the others wait, then find nothing to do; a migrator that dies
/// releases the lock with its session. A schema a newer release migrated is refused, naming
/// what this binary can do on it.
pub async fn migrate(db: &DatabaseConnection) -> Result<(), SchemaError> {
    if db.get_database_backend() != DbBackend::Postgres {
        refuse_newer_schema(db).await?;
        return Ok(Migrator::up(db, None).await?);
    }
    let txn = db.begin().await?;
    txn.execute_raw(Statement::from_sql_and_values(
        DbBackend::Postgres,
        "SELECT pg_advisory_xact_lock($1, $2)",
        [MIGRATION_LOCK.0.into(), MIGRATION_LOCK.1.into()],
    ))
    .await?;
    refuse_newer_schema(&txn).await?;
    // Each migration runs in a savepoint of this transaction; the lock is held to the commit.
    Migrator::up(&txn, None).await?;
    Ok(txn.commit().await?)
}

/// Refuses a schema with migrations this binary does not know: a newer release applied them,
/// and sea-orm's own refusal ("Migration file … is missing") says nothing of what to do.
async fn refuse_newer_schema(conn: &impl ConnectionTrait) -> Result<(), SchemaError> {
    let unknown = schema::unknown_migrations(conn).await?;
    if unknown.is_empty() {
        return Ok(());
    }
    Err(SchemaError::Newer { unknown })
}

/// [`connect_with`], then the schema as `policy` says: the migrations applied, or (run by a
/// role that changes no schema) checked current and the role's grants checked, changing
/// nothing. The migrations run on a connection of their own without the statement bound, which
/// is for serving, not for DDL.
pub async fn open(
    url: &str,
    max_connections: u32,
    policy: SchemaPolicy,
    timeouts: DbTimeouts,
) -> Result<DatabaseConnection, SchemaError> {
    if policy == SchemaPolicy::Migrate {
        let migrator = connect_with(url, 1, DbTimeouts::unbounded_statements()).await?;
        migrate(&migrator).await?;
        migrator.close().await?;
    }
    let db = connect_with(url, max_connections, timeouts).await?;
    if policy == SchemaPolicy::Check {
        schema::check_current(&db).await?;
        schema::check_privileges(&db).await?;
    }
    Ok(db)
}

pub fn is_postgres(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{NoAnswer, within};

    /// Work whose future holds 4 KiB across its await, as a handler's does.
    async fn heavy_work() -> Result<usize, sea_orm::DbErr> {
        let buffer = [1u8; 4096];
        tokio::task::yield_now().await;
        Ok(buffer.iter().map(|&byte| usize::from(byte)).sum())
    }

    /// Every message's handling moves its handler's future into the bound: held twice, as an
    /// `async fn` would hold it, it doubles what each move copies.
    #[tokio::test]
    async fn the_bound_holds_the_work_once() {
        use std::mem::size_of_val;
        let work = size_of_val(&heavy_work());
        let bound = Some(Duration::from_secs(1));
        let size = size_of_val(&within(bound, heavy_work()));
        assert!(size < work + 512, "{size} bytes around {work}");
        assert!(matches!(within(bound, heavy_work()).await, Ok(Ok(4096))));
        assert!(matches!(within(None, heavy_work()).await, Ok(Ok(4096))));
    }

    #[tokio::test]
    async fn work_past_its_bound_is_no_answer() {
        let bound = Duration::from_millis(10);
        let silent = async {
            tokio::time::sleep(Duration::from_secs(2)).await;
            Ok::<(), sea_orm::DbErr>(())
        };
        assert_eq!(within(Some(bound), silent).await, Err(NoAnswer(bound)));
    }
}
