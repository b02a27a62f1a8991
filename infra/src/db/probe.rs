//! Whether the database answers, asked on a connection of the probe's own.
//!
//! A health check that pings through the shared pool waits for a free pool connection first,
//! so it reports the pool (every connection taken by lanes, or held by a lane hung on a
//! connection a failing network left half-open) as the database being unreachable, and keeps
//! reporting it after the database is back. The probe opens one connection with the pool's
//! own settings, outside the pool, and replaces it whenever it fails.

use std::sync::Arc;
use std::time::Duration;

use sea_orm::sqlx::postgres::PgConnection;
use sea_orm::sqlx::sqlite::SqliteConnection;
use sea_orm::sqlx::{self, ConnectOptions as _, Connection};
use sea_orm::{DatabaseConnection, DbBackend, DbErr};
use tokio::sync::Mutex;

/// Why a [`Probe::check`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("the database did not answer within {0:?}")]
    TimedOut(Duration),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Pool(#[from] DbErr),
}

/// Checks the database on a connection of its own, kept from one check to the next.
pub struct Probe {
    target: Target,
}

enum Target {
    Postgres(Dedicated<PgConnection>),
    Sqlite(Dedicated<SqliteConnection>),
    /// A backend this build has no connection type for: asked through its pool.
    Pool(DatabaseConnection),
}

impl Probe {
    /// A probe of `db`'s database, connecting as `db`'s pool does. Connects on the first check.
    pub fn new(db: &DatabaseConnection) -> Self {
        let target = match db.get_database_backend() {
            DbBackend::Postgres => Target::Postgres(Dedicated::new(
                db.get_postgres_connection_pool().connect_options(),
            )),
            DbBackend::Sqlite => Target::Sqlite(Dedicated::new(
                db.get_sqlite_connection_pool().connect_options(),
            )),
            _ => Target::Pool(db.clone()),
        };
        Self { target }
    }

    /// Ok when the database answers a ping within `budget`, connection included. Checks at
    /// the same time wait for each other, within their own budgets.
    pub async fn check(&self, budget: Duration) -> Result<(), ProbeError> {
        let checked = async {
            match &self.target {
                Target::Postgres(dedicated) => dedicated.check(budget).await,
                Target::Sqlite(dedicated) => dedicated.check(budget).await,
                Target::Pool(db) => Ok(db.ping().await?),
            }
        };
        tokio::time::timeout(budget, checked)
            .await
            .map_err(|_| ProbeError::TimedOut(budget))?
    }
}

/// One connection outside the pool, opened on demand.
struct Dedicated<C: Connection> {
    options: Arc<<C as Connection>::Options>,
    connection: Mutex<Option<C>>,
}

impl<C: Connection> Dedicated<C> {
    fn new(options: Arc<<C as Connection>::Options>) -> Self {
        Self {
            options,
            connection: Mutex::new(None),
        }
    }

    async fn check(&self, budget: Duration) -> Result<(), ProbeError> {
        let mut slot = self.connection.lock().await;
        // Taken out while in use: a check cut short by its timeout drops the connection with
        // it rather than leave one in an unknown state for the next.
        if let Some(mut kept) = slot.take() {
            // The kept connection may have died since the last check (server restarted,
            // network cut) without the database being gone: it gets half the budget, a new
            // connection the rest, so a stale one alone never fails the check.
            if let Ok(Ok(())) = tokio::time::timeout(budget / 2, kept.ping()).await {
                *slot = Some(kept);
                return Ok(());
            }
        }
        let mut fresh = self.options.connect().await?;
        fresh.ping().await?;
        *slot = Some(fresh);
        Ok(())
    }
}
