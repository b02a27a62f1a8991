//! Natural idempotency: the reservation's business key `(order_id, book_id)` is the arbiter.
//!
//! Placement and cancellation of one order both take the order's lock, which serializes them:
//! a cancellation that commits first is seen by the placement, and one that commits second sees
//! the placement's reservation, so a cancellation always wins. On PostgreSQL the lock is
//! `lock_order` (`m20261201_000010_create_lock_order.rs`), a transaction-scoped advisory lock
//! that reads the order's state after it is granted: a placement writes no row for it. Only a cancellation writes the
//! order's `order_states` row. On SQLite every write transaction holds the database's one
//! writer lock from its `BEGIN IMMEDIATE`, so reading the row is enough.
//!
//! # Lock order
//!
//! Every path of the natural key (this handler, both statements in `natural_pg.rs`, placement
//! and cancellation) takes its locks in one order, so two messages never wait for each other
//! in a cycle (a deadlock, which PostgreSQL breaks by failing one of them):
//!
//! 1. `stock_items` rows, by `book_id`;
//! 2. orders (`lock_order`), by `order_id`;
//! 3. `stock_reservations` keys.
//!
//! Reads that lock nothing come first: a placement looks for its reservation, a cancellation
//! for the books its order holds. A cancellation locks those books, then its order, and starts
//! over if a placement of the order committed in between.
//!
//! # Events
//!
//! Each decision writes its event into the outbox in its own transaction: a reservation
//! reserved or rejected, and each reservation a cancellation releases. A copy, a new-id resend
//! or a placement after the cancellation decides nothing and writes none. The event row is
//! written after the order's lock is taken, so the events of one order get their outbox `seq`
//! in the order their transactions commit: the relay publishes them in that order. Whoever
//! stops a path from taking the order's lock must keep that true some other way.

use chrono::Utc;
use inventory_domain::stock::second_request_for_reservation as second_request;
use inventory_domain::{
    BookId, Effect, Event, Message, OrderCancelled, OrderId, OrderPlaced, Outcome, Quantity,
    ReservationDecision, ReservationStatus, StockEvent, StockEventKind,
};
use sea_orm::sea_query::{Expr, ExprTrait, OnConflict};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DatabaseTransaction, DbBackend, DbErr, EntityTrait, QueryFilter,
    QueryOrder, QuerySelect, QueryTrait as _, Set, Statement, TryInsertResult,
};
use uuid::Uuid;

use crate::db::begin_write;
use crate::entities::{order_states, stock_reservations};
use inventory_infra::consumers::{MARK_LINE_CANCELLED_SQL, not_an_order_event, unknown_book};
use inventory_infra::entities::stock_items;
use inventory_infra::outbox;
use inventory_infra::stock::{DataError, quantity_column, quantity_from};
use inventory_infra::{CrashPoint, HandleError};

use super::work::{lock_stock, release_stock, set_reserved};
use super::{StockConsumer, finish};

impl StockConsumer {
    pub(super) async fn handle_natural(&self, message: &Message) -> Result<Outcome, HandleError> {
        let key = message.key.storage_key();
        loop {
            let txn = begin_write(&self.db).await?;
            let result = match &message.event {
                Event::Placed(placed) => self.reserve(&txn, &key, placed).await.map(Some),
                Event::Cancelled(cancelled) => self.cancel(&txn, &key, cancelled).await,
                Event::StockReserved(_) => Ok(Some(not_an_order_event())),
            };
            match result.transpose() {
                Some(result) => return finish(txn, result, &self.faults).await,
                None => txn.rollback().await?,
            }
        }
    }

    /// The steps of `RESERVE_SQL` (natural_pg.rs), in its order: the reservation, the stock
    /// row, the order, then the reservation inserted with what was decided.
    async fn reserve(
        &self,
        txn: &DatabaseTransaction,
        key: &str,
        placed: &OrderPlaced,
    ) -> Result<Outcome, HandleError> {
        if let Some(existing) = reserved_quantity(txn, placed).await? {
            return Ok(second_request(existing, placed.quantity));
        }
        let Some(stock) = lock_stock(txn, placed.book_id).await? else {
            return Ok(unknown_book(placed.book_id));
        };
        let cancelled = lock_order(txn, placed.order_id).await?
            || line_cancelled(txn, placed.order_id, placed.book_id).await?;
        let decision = if cancelled {
            None
        } else {
            Some(stock.decide_reservation(placed.quantity))
        };
        let status = decision
            .as_ref()
            .map_or(ReservationStatus::Released, ReservationDecision::status);
        let row = stock_reservations::ActiveModel {
            order_id: Set(placed.order_id.as_uuid()),
            book_id: Set(placed.book_id.as_uuid()),
            quantity: Set(quantity_column(placed.quantity.get())?),
            status: Set(status.as_str().to_owned()),
            message_id: Set(key.to_owned()),
            created_at: Set(Utc::now()),
        };
        let inserted = stock_reservations::Entity::insert(row)
            .on_conflict_do_nothing()
            .exec_without_returning(txn)
            .await?;
        if !matches!(inserted, TryInsertResult::Inserted(rows) if rows > 0) {
            // A copy committed while this one waited for the stock row: this statement sees it.
            let existing = reserved_quantity(txn, placed)
                .await?
                .ok_or(DataError::Vanished {
                    table: "stock_reservations",
                })?;
            return Ok(second_request(existing, placed.quantity));
        }
        self.faults.pass(CrashPoint::AfterDedupCheck).await?;

        let Some(decision) = decision else {
            return Ok(Outcome::Processed(Effect::ArrivedAfterCancellation));
        };
        let kind = match &decision {
            ReservationDecision::Reserve { reserved_after } => {
                set_reserved(txn, placed.book_id, *reserved_after).await?;
                StockEventKind::Reserved
            }
            ReservationDecision::Reject { available, .. } => StockEventKind::Rejected {
                available: *available,
            },
        };
        let event = StockEvent::new(kind, placed.order_id, placed.book_id, placed.quantity, key);
        outbox::record(txn, &event).await?;
        Ok(Outcome::Processed(decision.effect(placed.quantity)))
    }

    /// `None`: a placement of the order committed after the books to lock were read; the
    /// caller starts over.
    async fn cancel(
        &self,
        txn: &DatabaseTransaction,
        key: &str,
        cancelled: &OrderCancelled,
    ) -> Result<Option<Outcome>, HandleError> {
        let order = cancelled.order_id.as_uuid();
        // A line's cancellation locks its book's row whether or not the line holds stock, as
        // the line's placement does.
        let books: Vec<Uuid> = match cancelled.book_id {
            None => held(txn, order, None)
                .await?
                .iter()
                .map(|r| r.book_id)
                .collect(),
            Some(book) => vec![book.as_uuid()],
        };
        if !books.is_empty() {
            stock_items::Entity::find()
                .filter(stock_items::Column::BookId.is_in(books.iter().copied()))
                .order_by_asc(stock_items::Column::BookId)
                .lock_exclusive()
                .all(txn)
                .await?;
        }
        lock_order(txn, cancelled.order_id).await?;
        if let Some(book) = cancelled.book_id {
            if !mark_line(txn, cancelled.order_id, book, key).await? {
                return Ok(Some(Outcome::Duplicate));
            }
            return self.release(txn, key, cancelled, books).await;
        }
        let row = order_states::ActiveModel {
            order_id: Set(order),
            cancelled_at: Set(Some(Utc::now())),
            cancel_message_id: Set(Some(key.to_owned())),
        };
        // Cancelled once: a second cancellation, under any message id, changes nothing.
        let won = order_states::Entity::insert(row)
            .on_conflict(
                OnConflict::column(order_states::Column::OrderId)
                    .update_columns([
                        order_states::Column::CancelledAt,
                        order_states::Column::CancelMessageId,
                    ])
                    .action_and_where(
                        Expr::col((order_states::Entity, order_states::Column::CancelledAt))
                            .is_null(),
                    )
                    .to_owned(),
            )
            .try_insert()
            .exec_without_returning(txn)
            .await?;
        if !matches!(won, TryInsertResult::Inserted(rows) if rows > 0) {
            return Ok(Some(Outcome::Duplicate));
        }
        self.release(txn, key, cancelled, books).await
    }

    /// What a cancellation marked releases: each reservation of the order (or of its line)
    /// that holds stock, with its event. `None`: one of them is of a book not among `locked`
    /// (a placement committed after the books were read); the caller starts over.
    async fn release(
        &self,
        txn: &DatabaseTransaction,
        key: &str,
        cancelled: &OrderCancelled,
        locked: Vec<Uuid>,
    ) -> Result<Option<Outcome>, HandleError> {
        // No placement of the order can commit from here on: the order's lock is taken.
        let held = held(txn, cancelled.order_id.as_uuid(), cancelled.book_id).await?;
        if held.iter().any(|r| !locked.contains(&r.book_id)) {
            return Ok(None);
        }
        self.faults.pass(CrashPoint::AfterDedupCheck).await?;

        let mut copies = 0;
        for reservation in held {
            let quantity = quantity_from(reservation.quantity)?;
            stock_reservations::Entity::update_many()
                .col_expr(
                    stock_reservations::Column::Status,
                    Expr::value(ReservationStatus::Released.as_str()),
                )
                .filter(stock_reservations::Column::OrderId.eq(reservation.order_id))
                .filter(stock_reservations::Column::BookId.eq(reservation.book_id))
                .exec(txn)
                .await?;
            let book = reservation.book_id.into();
            release_stock(txn, book, quantity.get()).await?;
            let released = StockEvent::new(
                StockEventKind::Released,
                cancelled.order_id,
                book,
                quantity,
                key,
            );
            outbox::record(txn, &released).await?;
            copies += i64::from(quantity.get());
        }
        Ok(Some(Outcome::Processed(Effect::Released { copies })))
    }
}

/// The order's reservations that hold stock, by book; only `book`'s, for a line.
async fn held(
    conn: &impl ConnectionTrait,
    order: Uuid,
    book: Option<BookId>,
) -> Result<Vec<stock_reservations::Model>, DbErr> {
    stock_reservations::Entity::find()
        .filter(stock_reservations::Column::OrderId.eq(order))
        .apply_if(book, |query, book| {
            query.filter(stock_reservations::Column::BookId.eq(book.as_uuid()))
        })
        .filter(stock_reservations::Column::Status.eq(ReservationStatus::Reserved.as_str()))
        .order_by_asc(stock_reservations::Column::BookId)
        .all(conn)
        .await
}

/// Takes the order's lock (see the module's comment) and reads whether it is cancelled, as
/// committed once the lock was granted.
async fn lock_order(conn: &impl ConnectionTrait, order: OrderId) -> Result<bool, DbErr> {
    if conn.get_database_backend() == DbBackend::Postgres {
        let row = conn
            .query_one_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "SELECT lock_order($1) AS cancelled",
                [order.as_uuid().into()],
            ))
            .await?
            .ok_or_else(|| DbErr::RecordNotFound("lock_order returned no row".into()))?;
        return row.try_get("", "cancelled");
    }
    let state = order_states::Entity::find_by_id(order.as_uuid())
        .one(conn)
        .await?;
    Ok(state.is_some_and(|state| state.cancelled_at.is_some()))
}

/// Whether the line of `order` for `book` is cancelled; asked after the order's lock, so on
/// PostgreSQL this statement's snapshot sees a cancellation committed while the lock was
/// awaited.
async fn line_cancelled(
    conn: &impl ConnectionTrait,
    order: OrderId,
    book: BookId,
) -> Result<bool, DbErr> {
    let backend = conn.get_database_backend();
    let row = conn
        .query_one_raw(Statement::from_sql_and_values(
            backend,
            "SELECT count(*) AS cancelled FROM line_cancellations WHERE order_id = $1 AND book_id = $2",
            [order.as_uuid().into(), book.as_uuid().into()],
        ))
        .await?
        .ok_or_else(|| DbErr::RecordNotFound("count returned no row".into()))?;
    Ok(row.try_get::<i64>("", "cancelled")? > 0)
}

/// The line's mark ([`MARK_LINE_CANCELLED_SQL`]): false when it was there already.
async fn mark_line(
    conn: &impl ConnectionTrait,
    order: OrderId,
    book: BookId,
    key: &str,
) -> Result<bool, DbErr> {
    let backend = conn.get_database_backend();
    let marked = conn
        .execute_raw(Statement::from_sql_and_values(
            backend,
            MARK_LINE_CANCELLED_SQL,
            [
                order.as_uuid().into(),
                book.as_uuid().into(),
                Utc::now().into(),
                key.into(),
            ],
        ))
        .await?;
    Ok(marked.rows_affected() > 0)
}

/// The quantity of the order's reservation of this book, if it has one.
async fn reserved_quantity(
    conn: &impl ConnectionTrait,
    placed: &OrderPlaced,
) -> Result<Option<Quantity>, HandleError> {
    let row = stock_reservations::Entity::find_by_id((
        placed.order_id.as_uuid(),
        placed.book_id.as_uuid(),
    ))
    .one(conn)
    .await?;
    Ok(row.map(|row| quantity_from(row.quantity)).transpose()?)
}
