//! Reading and setting stock.

use inventory_domain::{BookId, Quantity, ReservationStatus, StockItem};
use sea_orm::sea_query::OnConflict;
use sea_orm::{DatabaseConnection, DbErr, EntityTrait, QueryOrder, Set};

use crate::entities::stock_items;

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
    /// Used only for rows nothing in this crate deletes while they are its database's to decide
    /// (a move removes a partition's rows once another database owns it): only a person can
    /// have removed it.
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

    /// The database it reads and writes.
    pub fn connection(&self) -> &DatabaseConnection {
        &self.db
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
}
