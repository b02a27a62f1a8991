//! Reading and setting stock, and reading back what the consumers recorded.

use inventory_domain::{BookId, OrderId, Quantity, ReservationStatus, StockItem};
use sea_orm::sea_query::{ExprTrait, OnConflict};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DatabaseConnection, DbErr, EntityTrait, QueryFilter, QueryOrder,
    QuerySelect, Set,
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

pub(crate) fn stock_item_from(model: stock_items::Model) -> StockItem {
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

pub(crate) fn quantity_from(stored: i32) -> Result<Quantity, DataError> {
    Quantity::new(stored.into()).map_err(|_| DataError::Unreadable {
        column: "reservation quantity",
        value: stored.to_string(),
    })
}

pub(crate) fn status_from(stored: &str) -> Result<ReservationStatus, DataError> {
    ReservationStatus::parse(stored).ok_or_else(|| DataError::Unreadable {
        column: "reservation status",
        value: format!("{stored:?}"),
    })
}

/// `value` for an `int4` column.
pub(crate) fn int_column<T>(column: &'static str, value: T) -> Result<i32, DataError>
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

    /// Orders holding more than one reservation of the same book (status `reserved`), counted
    /// per (order, book). In `reservation_log` the strategies without a natural key can reserve
    /// an order twice; in `stock_reservations` the primary key `(order_id, book_id)` forbids it,
    /// and the count is read all the same rather than assumed.
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
        let keyed: Vec<(uuid::Uuid, uuid::Uuid)> = stock_reservations::Entity::find()
            .select_only()
            .column(stock_reservations::Column::OrderId)
            .column(stock_reservations::Column::BookId)
            .filter(stock_reservations::Column::Status.eq(reserved))
            .group_by(stock_reservations::Column::OrderId)
            .group_by(stock_reservations::Column::BookId)
            .having(stock_reservations::Column::OrderId.count().gt(1))
            .into_tuple()
            .all(&self.db)
            .await?;
        Ok((logged.len() + keyed.len()) as u64)
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

pub(crate) async fn find_inbox_entry(
    db: &impl ConnectionTrait,
    storage_key: &str,
    consumer: &str,
) -> Result<Option<inbox::Model>, DbErr> {
    inbox::Entity::find_by_id((storage_key.to_owned(), consumer.to_owned()))
        .one(db)
        .await
}
