//! Reading back what the consumers recorded, for the study's tables and the tests' checks:
//! the reservations of either table, the inbox's rows, whether an order was reserved twice,
//! and who waits for a lock. [`Readback`] adds them to the service's `StockRepository`.

use std::collections::HashMap;
use std::future::Future;

use crate::entities::{inbox, reservation_log, stock_reservations};
use inventory_domain::{BookId, OrderId, Quantity, ReservationStatus};
use inventory_infra::StockRepository;
use inventory_infra::entities::stock_items;
use inventory_infra::stock::{quantity_from, status_from};
use sea_orm::sea_query::ExprTrait;
use sea_orm::{
    ColumnTrait, ConnectionTrait, DbBackend, DbErr, EntityTrait, QueryFilter, QueryOrder,
    QuerySelect, Statement,
};

/// A reservation as recorded, in either table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedReservation {
    pub book_id: BookId,
    pub quantity: Quantity,
    pub status: ReservationStatus,
    pub message_id: String,
}

impl RecordedReservation {
    /// The columns both reservation tables share.
    fn from_row(
        book_id: uuid::Uuid,
        quantity: i32,
        status: &str,
        message_id: String,
    ) -> Result<Self, DbErr> {
        Ok(Self {
            book_id: book_id.into(),
            quantity: quantity_from(quantity)?,
            status: status_from(status)?,
            message_id,
        })
    }
}

/// An inbox row: `completed` is false while a two-phase side effect is in progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxEntry {
    pub payload_hash: String,
    pub completed: bool,
}

/// What a [`StockRepository`] reads back beside stock.
pub trait Readback {
    /// The natural key's reservation of `book_id` for `order_id`, if any.
    fn reservation(
        &self,
        order_id: OrderId,
        book_id: BookId,
    ) -> impl Future<Output = Result<Option<RecordedReservation>, DbErr>> + Send;

    /// The reservations logged for an order by the strategies without a natural key.
    fn logged_reservations(
        &self,
        order_id: OrderId,
    ) -> impl Future<Output = Result<Vec<RecordedReservation>, DbErr>> + Send;

    /// Copies reserved over all books: what the stock rows say, whichever strategy wrote them.
    fn total_reserved(&self) -> impl Future<Output = Result<i64, DbErr>> + Send;

    /// Orders reserved more than once, as far as the database can show it. The strategies
    /// without a natural key log every reservation, so an (order, book) with two `reserved` log
    /// rows is one. The natural key keeps one row per (order, book), so a second reservation
    /// leaves no row: it shows as stock moved for nothing. Every reservation of any strategy
    /// moves `stock_items.reserved` by its row's quantity in the same transaction, so a book
    /// whose reserved copies exceed the sum of its `reserved` rows (both tables) holds at least
    /// one order reserved again, and is counted once.
    fn orders_reserved_more_than_once(&self) -> impl Future<Output = Result<u64, DbErr>> + Send;

    /// Sessions of this database waiting for a lock that another holds, from PostgreSQL's
    /// `pg_stat_activity`: proof that a concurrent copy is blocked rather than merely slow.
    /// `None` on SQLite, which shows no lock waits.
    fn sessions_waiting_for_a_lock(
        &self,
    ) -> impl Future<Output = Result<Option<i64>, DbErr>> + Send;

    fn inbox_entry(
        &self,
        storage_key: &str,
        consumer: &str,
    ) -> impl Future<Output = Result<Option<InboxEntry>, DbErr>> + Send;
}

impl Readback for StockRepository {
    async fn reservation(
        &self,
        order_id: OrderId,
        book_id: BookId,
    ) -> Result<Option<RecordedReservation>, DbErr> {
        stock_reservations::Entity::find_by_id((order_id.as_uuid(), book_id.as_uuid()))
            .one(self.connection())
            .await?
            .map(|row| {
                RecordedReservation::from_row(
                    row.book_id,
                    row.quantity,
                    &row.status,
                    row.message_id,
                )
            })
            .transpose()
    }

    async fn logged_reservations(
        &self,
        order_id: OrderId,
    ) -> Result<Vec<RecordedReservation>, DbErr> {
        reservation_log::Entity::find()
            .filter(reservation_log::Column::OrderId.eq(order_id.as_uuid()))
            .order_by_asc(reservation_log::Column::Id)
            .all(self.connection())
            .await?
            .into_iter()
            .map(|row| {
                RecordedReservation::from_row(
                    row.book_id,
                    row.quantity,
                    &row.status,
                    row.message_id,
                )
            })
            .collect()
    }

    async fn total_reserved(&self) -> Result<i64, DbErr> {
        let total: Option<Option<i64>> = stock_items::Entity::find()
            .select_only()
            .column_as(stock_items::Column::Reserved.sum(), "total")
            .into_tuple()
            .one(self.connection())
            .await?;
        // SUM over no rows is NULL.
        Ok(total.flatten().unwrap_or(0))
    }

    async fn orders_reserved_more_than_once(&self) -> Result<u64, DbErr> {
        let reserved = ReservationStatus::Reserved.as_str();
        let logged: Vec<(uuid::Uuid, uuid::Uuid)> = reservation_log::Entity::find()
            .select_only()
            .column(reservation_log::Column::OrderId)
            .column(reservation_log::Column::BookId)
            .filter(reservation_log::Column::Status.eq(reserved))
            .group_by(reservation_log::Column::OrderId)
            .group_by(reservation_log::Column::BookId)
            .having(reservation_log::Column::Id.count().gt(1))
            .into_tuple()
            .all(self.connection())
            .await?;
        let mut recorded: HashMap<uuid::Uuid, i64> = HashMap::new();
        let log_rows: Vec<(uuid::Uuid, Option<i64>)> = reservation_log::Entity::find()
            .select_only()
            .column(reservation_log::Column::BookId)
            .column_as(reservation_log::Column::Quantity.sum(), "copies")
            .filter(reservation_log::Column::Status.eq(reserved))
            .group_by(reservation_log::Column::BookId)
            .into_tuple()
            .all(self.connection())
            .await?;
        let keyed_rows: Vec<(uuid::Uuid, Option<i64>)> = stock_reservations::Entity::find()
            .select_only()
            .column(stock_reservations::Column::BookId)
            .column_as(stock_reservations::Column::Quantity.sum(), "copies")
            .filter(stock_reservations::Column::Status.eq(reserved))
            .group_by(stock_reservations::Column::BookId)
            .into_tuple()
            .all(self.connection())
            .await?;
        for (book, copies) in log_rows.into_iter().chain(keyed_rows) {
            *recorded.entry(book).or_default() += copies.unwrap_or(0);
        }
        let stock: Vec<(uuid::Uuid, i32)> = stock_items::Entity::find()
            .select_only()
            .column(stock_items::Column::BookId)
            .column(stock_items::Column::Reserved)
            .into_tuple()
            .all(self.connection())
            .await?;
        let moved_for_nothing = stock
            .into_iter()
            .filter(|(book, moved)| i64::from(*moved) > recorded.get(book).copied().unwrap_or(0))
            .count();
        Ok((logged.len() + moved_for_nothing) as u64)
    }

    async fn sessions_waiting_for_a_lock(&self) -> Result<Option<i64>, DbErr> {
        if self.connection().get_database_backend() != DbBackend::Postgres {
            return Ok(None);
        }
        let row = self
            .connection()
            .query_one_raw(Statement::from_string(
                DbBackend::Postgres,
                "SELECT count(*) AS waiting FROM pg_stat_activity \
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
            ))
            .await?
            .ok_or_else(|| DbErr::RecordNotFound("count(*) returned no row".into()))?;
        Ok(Some(row.try_get("", "waiting")?))
    }

    async fn inbox_entry(
        &self,
        storage_key: &str,
        consumer: &str,
    ) -> Result<Option<InboxEntry>, DbErr> {
        Ok(find_inbox_entry(self.connection(), storage_key, consumer)
            .await?
            .map(|row| InboxEntry {
                payload_hash: row.payload_hash,
                completed: row.completed_at.is_some(),
            }))
    }
}

pub async fn find_inbox_entry(
    db: &impl ConnectionTrait,
    storage_key: &str,
    consumer: &str,
) -> Result<Option<inbox::Model>, DbErr> {
    inbox::Entity::find_by_id((storage_key.to_owned(), consumer.to_owned()))
        .one(db)
        .await
}
