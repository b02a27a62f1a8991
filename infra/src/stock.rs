//! Reading and setting stock, and reading back what the consumers recorded.

use std::collections::HashMap;

use inventory_domain::{BookId, OrderId, Quantity, ReservationStatus, StockItem};
use sea_orm::sea_query::{ExprTrait, OnConflict};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DatabaseConnection, DbBackend, DbErr, EntityTrait, QueryFilter,
    QueryOrder, QuerySelect, Set, Statement,
};

use crate::entities::{inbox, reservation_log, stock_items, stock_reservations};

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

pub fn stock_item_from(model: stock_items::Model) -> StockItem {
    StockItem {
        book_id: model.book_id.into(),
        title: model.title,
        on_hand: model.on_hand.into(),
        reserved: model.reserved.into(),
    }
}

/// A value that does not fit between a column and its domain type: a row this crate wrote that
/// no longer reads back as valid, a row a key conflict reported that a read then did not find,
/// a value too large for its column. The same read or write fails the same way every time.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DataError {
    #[error("stored {column} {value} is not valid")]
    Unreadable { column: &'static str, value: String },
    /// Used only for rows nothing in this crate deletes: only a person can have removed it.
    #[error("no {table} row, although inserting it conflicted on its key")]
    Vanished { table: &'static str },
    #[error("{column} {value} does not fit its column")]
    TooLarge { column: &'static str, value: String },
}

impl From<DataError> for DbErr {
    /// For the repository, which reports it as sea-orm reports a column that does not decode.
    fn from(error: DataError) -> Self {
        DbErr::Type(error.to_string())
    }
}

/// A quantity as its `int` column holds it.
pub fn quantity_column(quantity: u32) -> Result<i32, DataError> {
    int_column("quantity", quantity)
}

pub fn quantity_from(stored: i32) -> Result<Quantity, DataError> {
    Quantity::new(stored.into()).map_err(|_| DataError::Unreadable {
        column: "reservation quantity",
        value: stored.to_string(),
    })
}

pub fn status_from(stored: &str) -> Result<ReservationStatus, DataError> {
    ReservationStatus::parse(stored).ok_or_else(|| DataError::Unreadable {
        column: "reservation status",
        value: format!("{stored:?}"),
    })
}

/// `value` for an `int4` column.
pub fn int_column<T>(column: &'static str, value: T) -> Result<i32, DataError>
where
    T: TryInto<i32> + Copy + std::fmt::Display,
{
    value.try_into().map_err(|_| DataError::TooLarge {
        column,
        value: value.to_string(),
    })
}

#[derive(Clone)]
pub struct StockRepository {
    db: DatabaseConnection,
}

impl StockRepository {
    pub fn new(db: DatabaseConnection) -> Self {
        Self { db }
    }

    /// Sets a book's title and copies on hand; what is reserved stays as it is.
    pub async fn put(&self, item: &StockItem) -> Result<(), DbErr> {
        let on_hand = int_column("on_hand", item.on_hand)?;
        let row = stock_items::ActiveModel {
            book_id: Set(item.book_id.as_uuid()),
            title: Set(item.title.clone()),
            on_hand: Set(on_hand),
            reserved: Set(0),
        };
        stock_items::Entity::insert(row)
            .on_conflict(
                OnConflict::column(stock_items::Column::BookId)
                    .update_columns([stock_items::Column::Title, stock_items::Column::OnHand])
                    .to_owned(),
            )
            .exec_without_returning(&self.db)
            .await?;
        Ok(())
    }

    pub async fn get(&self, book_id: BookId) -> Result<Option<StockItem>, DbErr> {
        Ok(stock_items::Entity::find_by_id(book_id.as_uuid())
            .one(&self.db)
            .await?
            .map(stock_item_from))
    }

    pub async fn list(&self) -> Result<Vec<StockItem>, DbErr> {
        Ok(stock_items::Entity::find()
            .order_by_asc(stock_items::Column::Title)
            .order_by_asc(stock_items::Column::BookId)
            .all(&self.db)
            .await?
            .into_iter()
            .map(stock_item_from)
            .collect())
    }

    /// The natural key's reservation of `book_id` for `order_id`, if any.
    pub async fn reservation(
        &self,
        order_id: OrderId,
        book_id: BookId,
    ) -> Result<Option<RecordedReservation>, DbErr> {
        stock_reservations::Entity::find_by_id((order_id.as_uuid(), book_id.as_uuid()))
            .one(&self.db)
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

    /// The reservations logged for an order by the strategies without a natural key.
    pub async fn logged_reservations(
        &self,
        order_id: OrderId,
    ) -> Result<Vec<RecordedReservation>, DbErr> {
        reservation_log::Entity::find()
            .filter(reservation_log::Column::OrderId.eq(order_id.as_uuid()))
            .order_by_asc(reservation_log::Column::Id)
            .all(&self.db)
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

    /// Copies reserved over all books: what the stock rows say, whichever strategy wrote them.
    pub async fn total_reserved(&self) -> Result<i64, DbErr> {
        let total: Option<Option<i64>> = stock_items::Entity::find()
            .select_only()
            .column_as(stock_items::Column::Reserved.sum(), "total")
            .into_tuple()
            .one(&self.db)
            .await?;
        // SUM over no rows is NULL.
        Ok(total.flatten().unwrap_or(0))
    }

    /// Orders reserved more than once, as far as the database can show it. The strategies
    /// without a natural key log every reservation, so an (order, book) with two `reserved` log
    /// rows is one. The natural key keeps one row per (order, book), so a second reservation
    /// leaves no row: it shows as stock moved for nothing. Every reservation of any strategy
    /// moves `stock_items.reserved` by its row's quantity in the same transaction, so a book
    /// whose reserved copies exceed the sum of its `reserved` rows (both tables) holds at least
    /// one order reserved again, and is counted once.
    pub async fn orders_reserved_more_than_once(&self) -> Result<u64, DbErr> {
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
            .all(&self.db)
            .await?;
        let mut recorded: HashMap<uuid::Uuid, i64> = HashMap::new();
        let log_rows: Vec<(uuid::Uuid, Option<i64>)> = reservation_log::Entity::find()
            .select_only()
            .column(reservation_log::Column::BookId)
            .column_as(reservation_log::Column::Quantity.sum(), "copies")
            .filter(reservation_log::Column::Status.eq(reserved))
            .group_by(reservation_log::Column::BookId)
            .into_tuple()
            .all(&self.db)
            .await?;
        let keyed_rows: Vec<(uuid::Uuid, Option<i64>)> = stock_reservations::Entity::find()
            .select_only()
            .column(stock_reservations::Column::BookId)
            .column_as(stock_reservations::Column::Quantity.sum(), "copies")
            .filter(stock_reservations::Column::Status.eq(reserved))
            .group_by(stock_reservations::Column::BookId)
            .into_tuple()
            .all(&self.db)
            .await?;
        for (book, copies) in log_rows.into_iter().chain(keyed_rows) {
            *recorded.entry(book).or_default() += copies.unwrap_or(0);
        }
        let stock: Vec<(uuid::Uuid, i32)> = stock_items::Entity::find()
            .select_only()
            .column(stock_items::Column::BookId)
            .column(stock_items::Column::Reserved)
            .into_tuple()
            .all(&self.db)
            .await?;
        let moved_for_nothing = stock
            .into_iter()
            .filter(|(book, moved)| i64::from(*moved) > recorded.get(book).copied().unwrap_or(0))
            .count();
        Ok((logged.len() + moved_for_nothing) as u64)
    }

    /// Sessions of this database waiting for a lock that another holds, from PostgreSQL's
    /// `pg_stat_activity`: proof that a concurrent copy is blocked rather than merely slow.
    /// `None` on SQLite, which shows no lock waits.
    pub async fn sessions_waiting_for_a_lock(&self) -> Result<Option<i64>, DbErr> {
        if self.db.get_database_backend() != DbBackend::Postgres {
            return Ok(None);
        }
        let row = self
            .db
            .query_one_raw(Statement::from_string(
                DbBackend::Postgres,
                "SELECT count(*) AS waiting FROM pg_stat_activity \
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
            ))
            .await?
            .ok_or_else(|| DbErr::RecordNotFound("count(*) returned no row".into()))?;
        Ok(Some(row.try_get("", "waiting")?))
    }

    pub async fn inbox_entry(
        &self,
        storage_key: &str,
        consumer: &str,
    ) -> Result<Option<InboxEntry>, DbErr> {
        Ok(find_inbox_entry(&self.db, storage_key, consumer)
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
