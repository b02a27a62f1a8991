//! The PostgreSQL lanes: each on a connection of its own, as the service's lanes are.
//!
//! - tokio-postgres: [`RESERVE_SQL`] prepared once, one message at a time.
//! - sqlx, the service's driver, connected with the options of the service's pool as its
//!   handler connects (TLS as the URL and the server say, READ COMMITTED, its timeouts): one
//!   message through `RESERVE_SQL`, several through [`RESERVE_BATCH_SQL`], one statement, so
//!   one commit. Of a batch, a placement whose row says neither what was inserted nor what
//!   was there, and that no earlier copy in the batch decided (a copy another lane committed
//!   meanwhile, or stock too short for the whole batch), goes through `RESERVE_SQL` after it,
//!   as in the service's handler (`natural_pg.rs`). So does the handler's second look,
//!   [`EXISTING_SQL`], for a copy committed while `RESERVE_SQL` waited.

use std::sync::Arc;

use anyhow::{Context as _, Result, ensure};
use inventory_domain::OrderId;
use inventory_domain::outbox::partition;
use inventory_infra::consumers::natural_pg::{EXISTING_SQL, RESERVE_BATCH_SQL, RESERVE_SQL};
use inventory_infra::db::DatabaseConnection;
use sea_orm::sqlx::postgres::{PgConnectOptions, PgConnection, PgRow};
use sea_orm::sqlx::{self, ConnectOptions as _, Row as _};
use uuid::Uuid;

use super::Placed;

/// A tokio-postgres connection without TLS, its connection task spawned (it ends when the
/// client is dropped).
pub(crate) async fn connect(database_url: &str) -> Result<tokio_postgres::Client> {
    let (client, connection) = tokio_postgres::connect(database_url, tokio_postgres::NoTls)
        .await
        .context("connecting")?;
    tokio::spawn(connection);
    Ok(client)
}

/// Runs [`RESERVE_SQL`], prepared as `statement` on `client`, for `placed` with a fresh event
/// id: the statement's one row.
pub(crate) async fn reserve(
    client: &tokio_postgres::Client,
    statement: &tokio_postgres::Statement,
    placed: &Placed,
) -> Result<tokio_postgres::Row> {
    Ok(client
        .query_one(
            statement,
            &[
                &placed.order_id,
                &placed.book_id,
                &placed.quantity,
                &placed.message_id,
                &Uuid::now_v7(),
                &partition(OrderId::from(placed.order_id)),
            ],
        )
        .await?)
}

/// A tokio-postgres lane: its connection and `RESERVE_SQL` prepared on it.
pub(super) struct TokioLane {
    client: tokio_postgres::Client,
    statement: tokio_postgres::Statement,
}

impl TokioLane {
    pub(super) async fn open(database_url: &str) -> Result<Self> {
        let client = connect(database_url).await?;
        let statement = client.prepare(RESERVE_SQL).await?;
        Ok(Self { client, statement })
    }

    /// One placement at a time (`check` refuses batches on this driver).
    pub(super) async fn reserve(&mut self, placed: &[Placed]) -> Result<Vec<bool>> {
        let mut reserved = Vec::with_capacity(placed.len());
        for placed in placed {
            let row = reserve(&self.client, &self.statement, placed).await?;
            reserved.push(row.try_get::<_, Option<&str>>("inserted_status")?.is_some());
        }
        Ok(reserved)
    }
}

/// How the sqlx lanes connect: as the service's handler does, with its pool's options.
pub(super) struct SqlxOptions(Arc<PgConnectOptions>);

impl SqlxOptions {
    /// The options of `db`'s pool, statements logged at TRACE, as `natural_pg.rs` takes them.
    pub(super) fn of(db: &DatabaseConnection) -> Self {
        let options = db
            .get_postgres_connection_pool()
            .connect_options()
            .as_ref()
            .clone()
            .log_statements(tracing::log::LevelFilter::Trace);
        Self(Arc::new(options))
    }

    pub(super) async fn open(&self) -> Result<SqlxLane> {
        Ok(SqlxLane(self.0.connect().await?))
    }
}

/// A sqlx lane's connection; sqlx prepares each statement on first use and keeps it.
pub(super) struct SqlxLane(PgConnection);

impl SqlxLane {
    /// One placement through `RESERVE_SQL`, several through `RESERVE_BATCH_SQL`, as the
    /// service's lanes hand one message to `handle` and several to `handle_batch`.
    pub(super) async fn reserve(&mut self, placed: &[Placed]) -> Result<Vec<bool>> {
        match placed {
            [one] => Ok(vec![self.reserve_one(one).await?]),
            batch => self.reserve_batch(batch).await,
        }
    }

    /// `RESERVE_SQL` for `placed`: whether it reserved.
    async fn reserve_one(&mut self, placed: &Placed) -> Result<bool> {
        let row = sqlx::query(RESERVE_SQL)
            .bind(placed.order_id)
            .bind(placed.book_id)
            .bind(placed.quantity)
            .bind(&placed.message_id)
            .bind(Uuid::now_v7())
            .bind(partition(OrderId::from(placed.order_id)))
            .fetch_one(&mut self.0)
            .await?;
        ensure!(
            row.try_get::<bool, _>("book_found")?,
            "no stock row for book {}",
            placed.book_id
        );
        if row.try_get::<Option<&str>, _>("inserted_status")?.is_some() {
            return Ok(true);
        }
        if row
            .try_get::<Option<i32>, _>("existing_quantity")?
            .is_none()
        {
            // A copy committed while the statement waited: a new statement sees it.
            sqlx::query(EXISTING_SQL)
                .bind(placed.order_id)
                .bind(placed.book_id)
                .fetch_optional(&mut self.0)
                .await?
                .context("the reservation's key was taken, and its row is not there")?;
        }
        Ok(false)
    }

    /// `RESERVE_BATCH_SQL` for `batch`, then `RESERVE_SQL` for what it left undecided.
    async fn reserve_batch(&mut self, batch: &[Placed]) -> Result<Vec<bool>> {
        let mut orders = Vec::with_capacity(batch.len());
        let mut books = Vec::with_capacity(batch.len());
        let mut quantities = Vec::with_capacity(batch.len());
        let mut keys = Vec::with_capacity(batch.len());
        let mut indexes = Vec::with_capacity(batch.len());
        let mut event_ids = Vec::with_capacity(batch.len());
        let mut partitions = Vec::with_capacity(batch.len());
        for (index, placed) in batch.iter().enumerate() {
            orders.push(placed.order_id);
            books.push(placed.book_id);
            quantities.push(placed.quantity);
            keys.push(placed.message_id.as_str());
            indexes.push(i32::try_from(index)?);
            event_ids.push(Uuid::now_v7());
            partitions.push(partition(OrderId::from(placed.order_id)));
        }
        let rows = sqlx::query(RESERVE_BATCH_SQL)
            .bind(&orders)
            .bind(&books)
            .bind(&quantities)
            .bind(&keys)
            .bind(&indexes)
            .bind(&event_ids)
            .bind(&partitions)
            .fetch_all(&mut self.0)
            .await?;
        ensure!(
            rows.len() == batch.len(),
            "{} rows for a batch of {}",
            rows.len(),
            batch.len()
        );
        let mut reserved = Vec::with_capacity(batch.len());
        for (placed, row) in batch.iter().zip(&rows) {
            let decided = match BatchRow::read(row)? {
                BatchRow::Inserted => true,
                BatchRow::Taken => false,
                BatchRow::Undecided
                    if batch
                        .iter()
                        .zip(&reserved)
                        .any(|(earlier, reserved)| *reserved && earlier.same_key(placed)) =>
                {
                    false
                }
                BatchRow::Undecided => self.reserve_one(placed).await?,
            };
            reserved.push(decided);
        }
        Ok(reserved)
    }
}

/// What the batch statement's row says of one placement.
enum BatchRow {
    /// The statement inserted its reservation.
    Inserted,
    /// Its key had a reservation already.
    Taken,
    /// Neither: an earlier copy in the batch, or left to `RESERVE_SQL`.
    Undecided,
}

impl BatchRow {
    fn read(row: &PgRow) -> Result<Self> {
        ensure!(
            row.try_get::<bool, _>("book_found")?,
            "no stock row for a book"
        );
        Ok(
            if row.try_get::<Option<&str>, _>("inserted_status")?.is_some() {
                Self::Inserted
            } else if row
                .try_get::<Option<i32>, _>("existing_quantity")?
                .is_some()
            {
                Self::Taken
            } else {
                Self::Undecided
            },
        )
    }
}
