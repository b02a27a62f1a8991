//! SQLite's one writer, shared by the lanes as the service's handler shares its own
//! (`natural_sqlite.rs`): one connection, opened with the service's writer options (WAL, busy
//! timeout, synchronous FULL), behind a mutex the lanes queue on. A lane holds it for one
//! message or one batch, in `BEGIN IMMEDIATE … COMMIT`, each placement through the service's
//! [`READ_SQL`] and [`WRITE_SQL`] with the values the service binds: the decision of
//! `StockItem::decide_reservation` and the event of `StockEvent` (the outbox row).

use std::sync::Arc;

use anyhow::{Result, bail, ensure};
use chrono::Utc;
use inventory_domain::outbox::partition;
use inventory_domain::{
    BookId, OrderId, Quantity, ReservationDecision, StockEvent, StockEventKind, StockItem,
};
use inventory_infra::consumers::natural_sqlite::{READ_SQL, WRITE_SQL, writer_options};
use inventory_infra::db::DatabaseConnection;
use sea_orm::sqlx::sqlite::SqliteConnection;
use sea_orm::sqlx::{self, ConnectOptions as _, Connection as _, Row as _};
use tokio::sync::Mutex;

use super::Placed;

/// The writer; clones share it.
#[derive(Clone)]
pub(super) struct Writer(Arc<Mutex<SqliteConnection>>);

impl Writer {
    /// Opens `db`'s file as the service opens its writer.
    pub(super) async fn open(db: &DatabaseConnection) -> Result<Self> {
        let connection = writer_options(db).connect().await?;
        Ok(Self(Arc::new(Mutex::new(connection))))
    }

    /// `placed` in one transaction once the writer is free: for each placement, whether it
    /// reserved.
    pub(super) async fn reserve(&self, placed: &[Placed]) -> Result<Vec<bool>> {
        let mut connection = self.0.lock().await;
        let mut transaction = connection.begin_with("BEGIN IMMEDIATE").await?;
        let mut reserved = Vec::with_capacity(placed.len());
        for placed in placed {
            reserved.push(reserve(&mut transaction, placed).await?);
        }
        transaction.commit().await?;
        Ok(reserved)
    }
}

/// One placement's statements in the caller's transaction: whether it reserved. A later copy
/// in the same transaction reads what an earlier one wrote.
async fn reserve(connection: &mut SqliteConnection, placed: &Placed) -> Result<bool> {
    let row = sqlx::query(READ_SQL)
        .bind(placed.order_id)
        .bind(placed.book_id)
        .fetch_one(&mut *connection)
        .await?;
    if row.try_get::<Option<i32>, _>("existing")?.is_some() {
        return Ok(false);
    }
    let (Some(on_hand), Some(reserved)) = (
        row.try_get::<Option<i32>, _>("on_hand")?,
        row.try_get::<Option<i32>, _>("reserved")?,
    ) else {
        bail!("no stock row for book {}", placed.book_id);
    };
    ensure!(
        !row.try_get::<bool, _>("cancelled")?,
        "order {} is cancelled: the workload has no cancellations",
        placed.order_id
    );
    let (order, book) = (OrderId::from(placed.order_id), BookId::from(placed.book_id));
    let quantity = Quantity::new(placed.quantity.into())?;
    let stock = StockItem {
        book_id: book,
        title: row.try_get("title")?,
        on_hand: on_hand.into(),
        reserved: reserved.into(),
    };
    let decision = stock.decide_reservation(quantity);
    let (kind, reserved_after) = match decision {
        ReservationDecision::Reserve { reserved_after } => (
            StockEventKind::Reserved,
            Some(i32::try_from(reserved_after)?),
        ),
        ReservationDecision::Reject { available, .. } => {
            (StockEventKind::Rejected { available }, None)
        }
    };
    let event = StockEvent::new(kind, order, book, quantity, &placed.message_id);
    let written = sqlx::query(WRITE_SQL)
        .bind(placed.order_id)
        .bind(placed.book_id)
        .bind(placed.quantity)
        .bind(decision.status().as_str())
        .bind(&placed.message_id)
        .bind(Utc::now())
        .bind(reserved_after)
        .bind(event.subject_token())
        .bind(event.event_id)
        .bind(partition(order))
        .bind(event.body())
        .execute(&mut *connection)
        .await?;
    // Under the write lock nothing takes the key after READ_SQL looked.
    ensure!(
        written.rows_affected() > 0,
        "the key of order {} was taken after it was read free",
        placed.order_id
    );
    Ok(true)
}
