//! The work of the strategies without a natural key: reserve into `reservation_log`, where
//! nothing stops an order being reserved twice, and release what the log holds.

use chrono::Utc;
use inventory_domain::{
    BookId, Effect, Event, OrderPlaced, Outcome, ReservationDecision, ReservationStatus, StockItem,
};
use sea_orm::sea_query::{Expr, ExprTrait};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DbErr, EntityTrait, QueryFilter, QuerySelect, QueryTrait as _,
    Set,
};
use uuid::Uuid;

use crate::entities::reservation_log;
use inventory_infra::HandleError;
use inventory_infra::consumers::{not_an_order_event, unknown_book};
use inventory_infra::entities::stock_items;
use inventory_infra::stock::{int_column, quantity_column, quantity_from, stock_item_from};

/// Applies `event` through `conn`: inside the caller's transaction, or (in the study of a
/// mistake) through another connection.
pub async fn apply_logged(
    conn: &impl ConnectionTrait,
    message_key: &str,
    event: &Event,
) -> Result<Outcome, HandleError> {
    match event {
        Event::Placed(placed) => reserve_logged(conn, message_key, placed).await,
        Event::Cancelled(cancelled) => {
            // A line's cancellation releases only its book's rows.
            let rows = reservation_log::Entity::find()
                .filter(reservation_log::Column::OrderId.eq(cancelled.order_id.as_uuid()))
                .apply_if(cancelled.book_id, |query, book| {
                    query.filter(reservation_log::Column::BookId.eq(book.as_uuid()))
                })
                .filter(reservation_log::Column::Status.eq(ReservationStatus::Reserved.as_str()))
                .lock_exclusive()
                .all(conn)
                .await?;
            let mut copies = 0;
            for row in rows {
                reservation_log::Entity::update_many()
                    .col_expr(
                        reservation_log::Column::Status,
                        Expr::value(ReservationStatus::Released.as_str()),
                    )
                    .filter(reservation_log::Column::Id.eq(row.id))
                    .exec(conn)
                    .await?;
                release_stock(conn, row.book_id.into(), quantity_from(row.quantity)?.get()).await?;
                copies += i64::from(row.quantity);
            }
            Ok(Outcome::Processed(Effect::Released { copies }))
        }
        Event::StockReserved(_) => Ok(not_an_order_event()),
    }
}

async fn reserve_logged(
    conn: &impl ConnectionTrait,
    message_key: &str,
    placed: &OrderPlaced,
) -> Result<Outcome, HandleError> {
    let Some(stock) = lock_stock(conn, placed.book_id).await? else {
        return Ok(unknown_book(placed.book_id));
    };
    let decision = stock.decide_reservation(placed.quantity);
    if let ReservationDecision::Reserve { reserved_after } = decision {
        set_reserved(conn, placed.book_id, reserved_after).await?;
    }
    let row = reservation_log::ActiveModel {
        id: Set(Uuid::now_v7()),
        order_id: Set(placed.order_id.as_uuid()),
        book_id: Set(placed.book_id.as_uuid()),
        quantity: Set(quantity_column(placed.quantity.get())?),
        status: Set(decision.status().as_str().to_owned()),
        message_id: Set(message_key.to_owned()),
        created_at: Set(Utc::now()),
    };
    reservation_log::Entity::insert(row)
        .exec_without_returning(conn)
        .await?;
    Ok(Outcome::Processed(decision.effect(placed.quantity)))
}

/// The stock row, locked for this transaction on PostgreSQL (SQLite has one writer anyway).
pub(crate) async fn lock_stock(
    conn: &impl ConnectionTrait,
    book_id: BookId,
) -> Result<Option<StockItem>, DbErr> {
    Ok(stock_items::Entity::find_by_id(book_id.as_uuid())
        .lock_exclusive()
        .one(conn)
        .await?
        .map(stock_item_from))
}

pub(crate) async fn set_reserved(
    conn: &impl ConnectionTrait,
    book_id: BookId,
    reserved: i64,
) -> Result<(), HandleError> {
    let reserved = int_column("reserved", reserved)?;
    stock_items::Entity::update_many()
        .col_expr(stock_items::Column::Reserved, Expr::value(reserved))
        .filter(stock_items::Column::BookId.eq(book_id.as_uuid()))
        .exec(conn)
        .await?;
    Ok(())
}

pub(crate) async fn release_stock(
    conn: &impl ConnectionTrait,
    book_id: BookId,
    quantity: u32,
) -> Result<(), HandleError> {
    stock_items::Entity::update_many()
        .col_expr(
            stock_items::Column::Reserved,
            Expr::col(stock_items::Column::Reserved).sub(quantity_column(quantity)?),
        )
        .filter(stock_items::Column::BookId.eq(book_id.as_uuid()))
        .exec(conn)
        .await?;
    Ok(())
}
