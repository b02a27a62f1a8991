//! The PostgreSQL lanes: each on a connection of its own, as the service's lanes are.
//!
//! - tokio-postgres: [`RESERVE_SQL`] prepared once, one message at a time.
//! - sqlx, the service's driver, connected with the options of the service's pool as its
//!   handler connects (TLS as the URL and the server say, READ COMMITTED, its timeouts): the
//!   lane's message or batch through `RESERVE_SQL`, one statement, so one commit. Of a batch,
//!   a placement whose row says neither what was inserted nor what was there, and that no
//!   earlier copy in the batch decided (a copy another lane committed meanwhile, or stock too
//!   short for all the batch wanted of its book), goes through `RESERVE_SQL` alone after it, as
//!   in the service's handler (`natural_pg.rs`). So does the handler's second look,
//!   [`EXISTING_SQL`], for a copy committed while the statement waited.

use std::sync::Arc;

use anyhow::{Context as _, Result, ensure};
use inventory_domain::OrderId;
use inventory_domain::outbox::partition;
use inventory_infra::consumers::natural_pg::{EXISTING_SQL, RESERVE_SQL};
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

/// `RESERVE_SQL`'s shard partition of a placement on an unsharded database, as the service
/// binds it there: none, so the statement asks no ownership.
pub(crate) const UNSHARDED: Option<i16> = None;

/// Runs [`RESERVE_SQL`], prepared as `statement` on `client`, for `placed` alone with a fresh
/// event id: the statement's one row.
pub(crate) async fn reserve(
    client: &tokio_postgres::Client,
    statement: &tokio_postgres::Statement,
    placed: &Placed,
) -> Result<tokio_postgres::Row> {
    Ok(client
        .query_one(
            statement,
            &[
                &[placed.order_id].as_slice(),
                &[placed.book_id].as_slice(),
                &[placed.quantity].as_slice(),
                &[placed.message_id.as_str()].as_slice(),
                &[0_i32].as_slice(),
                &[Uuid::now_v7()].as_slice(),
                &[partition(OrderId::from(placed.order_id))].as_slice(),
                &[UNSHARDED].as_slice(),
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
    /// `RESERVE_SQL` for the lane's message or batch, then alone for what it left undecided:
    /// whether each reserved.
    pub(super) async fn reserve(&mut self, batch: &[Placed]) -> Result<Vec<bool>> {
        let rows = self.run(batch).await?;
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
                BatchRow::Undecided => self.reserve_alone(placed).await?,
            };
            reserved.push(decided);
        }
        Ok(reserved)
    }

    /// `RESERVE_SQL` for `placed` alone, which it always decides unless a copy committed while
    /// it waited: whether it reserved.
    async fn reserve_alone(&mut self, placed: &Placed) -> Result<bool> {
        let rows = self.run(std::slice::from_ref(placed)).await?;
        match BatchRow::read(&rows[0])? {
            BatchRow::Inserted => Ok(true),
            BatchRow::Taken => Ok(false),
            BatchRow::Undecided => {
                // A copy committed while the statement waited: a new statement sees it.
                sqlx::query(EXISTING_SQL)
                    .bind(placed.order_id)
                    .bind(placed.book_id)
                    .fetch_optional(&mut self.0)
                    .await?
                    .context("the reservation's key was taken, and its row is not there")?;
                Ok(false)
            }
        }
    }

    /// `RESERVE_SQL` for `batch`: a row for each.
    async fn run(&mut self, batch: &[Placed]) -> Result<Vec<PgRow>> {
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
        let rows = sqlx::query(RESERVE_SQL)
            .bind(&orders)
            .bind(&books)
            .bind(&quantities)
            .bind(&keys)
            .bind(&indexes)
            .bind(&event_ids)
            .bind(&partitions)
            .bind(vec![UNSHARDED; batch.len()])
            .fetch_all(&mut self.0)
            .await?;
        ensure!(
            rows.len() == batch.len(),
            "{} rows for a batch of {}",
            rows.len(),
            batch.len()
        );
        Ok(rows)
    }
}

/// What the statement's row says of one placement.
enum BatchRow {
    /// The statement inserted its reservation.
    Inserted,
    /// Its key had a reservation already.
    Taken,
    /// Neither: an earlier copy in the batch, or left to `RESERVE_SQL` alone.
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
