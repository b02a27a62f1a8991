//! The orders producer, the safe one: `inventory orders place` and `inventory orders cancel`
//! write the order and its message (OrderPlaced, OrderCancelled) in one transaction of the
//! orders database, the message into the producer's outbox `orders_outbox`. A crash after the
//! commit loses nothing (the relay, `inventory relay --source orders`, publishes the row), and a
//! retry of the command finds the message already made and reports it, id and all: it never
//! makes a new one. The message id is the outbox row's event id, the relay's `Nats-Msg-Id`.
//!
//! Place and cancel of one order both lock the order's `orders` row before writing their
//! outbox rows, so an order's messages are numbered in the order their transactions commit.
//!
//! A cancel sends one OrderCancelled per line, on the line's book's subject with the book in
//! its body: a stream sharded by book routes each to the shard that holds the line's
//! reservation, where a cancellation of the whole order would reach none (docs/scaling.md).

use crate::produce::Produce as _;
use anyhow::Context as _;
use chrono::Utc;
use inventory_domain::{BookId, Message, MessageId, OrderId, Quantity};
use sea_orm::sea_query::OnConflict;
use sea_orm::{
    ActiveModelTrait, ColumnTrait, DatabaseConnection, DatabaseTransaction, DbErr, EntityTrait,
    QueryFilter, QueryOrder, QuerySelect, Set,
};
use uuid::Uuid;

use crate::db::begin_write;
use crate::entities::{order_lines, orders};
use inventory_infra::db;
use inventory_infra::outbox::{self, OutboxTable};
use inventory_infra::stock::{DataError, quantity_column, quantity_from};
use inventory_service::args::OrdersDatabaseArgs;
use inventory_service::cli::COMMAND_POOL;

/// What `place` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// Stored now, with its message waiting in the outbox.
    Placed { message_id: MessageId },
    /// This order held this book already, in the same quantity: nothing new was written. The
    /// message is the one made then.
    AlreadyPlaced { message_id: MessageId },
}

/// What `cancel` did, with its messages in book order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cancellation {
    Cancelled {
        messages: Vec<CancelMessage>,
    },
    /// Cancelled before: nothing new was written. The messages are those made then.
    AlreadyCancelled {
        messages: Vec<CancelMessage>,
    },
}

/// One OrderCancelled of a cancel: a line's, by its book. An order cancelled before its lines
/// had messages of their own has its one message for the whole order, with no book.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CancelMessage {
    pub book_id: Option<BookId>,
    pub message_id: MessageId,
}

#[derive(Debug, thiserror::Error)]
pub enum OrdersError {
    #[error("order {order_id} holds {existing} of book {book_id} already, not {requested}")]
    OtherQuantity {
        order_id: OrderId,
        book_id: BookId,
        existing: Quantity,
        requested: Quantity,
    },
    #[error("order {0} is cancelled")]
    Cancelled(OrderId),
    #[error("no order {0}")]
    UnknownOrder(OrderId),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Database(#[from] DbErr),
}

#[derive(Clone)]
pub struct OrdersRepository {
    db: DatabaseConnection,
}

impl OrdersRepository {
    pub fn new(db: DatabaseConnection) -> Self {
        Self { db }
    }

    /// Places `quantity` copies of `book_id` in `order_id` (a new order, or one more book of
    /// an open one).
    pub async fn place(
        &self,
        order_id: OrderId,
        book_id: BookId,
        quantity: Quantity,
    ) -> Result<Placement, OrdersError> {
        let txn = begin_write(&self.db).await?;
        let order = take_order(&txn, order_id).await?;
        if order.cancelled_at.is_some() {
            return Err(OrdersError::Cancelled(order_id));
        }
        let line = order_lines::Entity::find_by_id((order_id.as_uuid(), book_id.as_uuid()))
            .one(&txn)
            .await?;
        if let Some(line) = line {
            let existing = quantity_from(line.quantity)?;
            return if existing == quantity {
                Ok(Placement::AlreadyPlaced {
                    message_id: stored_message_id("message_id", line.message_id)?,
                })
            } else {
                Err(OrdersError::OtherQuantity {
                    order_id,
                    book_id,
                    existing,
                    requested: quantity,
                })
            };
        }
        let (event_id, message_id) = new_message_id();
        let message = Message::placed(order_id, book_id, quantity).resent_as(message_id.clone());
        order_lines::ActiveModel {
            order_id: Set(order_id.as_uuid()),
            book_id: Set(book_id.as_uuid()),
            quantity: Set(quantity_column(quantity.get())?),
            message_id: Set(message_id.as_str().to_owned()),
            cancel_message_id: Set(None),
        }
        .insert(&txn)
        .await?;
        write_message(&txn, event_id, &message).await?;
        txn.commit().await?;
        Ok(Placement::Placed { message_id })
    }

    /// Cancels `order_id`, once: each of its lines, under a message of its own.
    pub async fn cancel(&self, order_id: OrderId) -> Result<Cancellation, OrdersError> {
        let txn = begin_write(&self.db).await?;
        let order = orders::Entity::find_by_id(order_id.as_uuid())
            .lock_exclusive()
            .one(&txn)
            .await?
            .ok_or(OrdersError::UnknownOrder(order_id))?;
        let lines = order_lines::Entity::find()
            .filter(order_lines::Column::OrderId.eq(order_id.as_uuid()))
            .order_by_asc(order_lines::Column::BookId)
            .all(&txn)
            .await?;
        if order.cancelled_at.is_some() {
            let messages = match order.cancel_message_id {
                Some(whole_order) => vec![CancelMessage {
                    book_id: None,
                    message_id: stored_message_id("cancel_message_id", whole_order)?,
                }],
                None => lines
                    .into_iter()
                    .map(|line| {
                        Ok(CancelMessage {
                            book_id: Some(BookId::from(line.book_id)),
                            // None is unreadable: every line of a cancelled order has one.
                            message_id: stored_message_id(
                                "cancel_message_id",
                                line.cancel_message_id.unwrap_or_default(),
                            )?,
                        })
                    })
                    .collect::<Result<_, DataError>>()?,
            };
            return Ok(Cancellation::AlreadyCancelled { messages });
        }
        let mut messages = Vec::with_capacity(lines.len());
        for line in lines {
            let book_id = BookId::from(line.book_id);
            let (event_id, message_id) = new_message_id();
            let message = Message::cancelled_line(order_id, book_id).resent_as(message_id.clone());
            order_lines::ActiveModel {
                order_id: Set(line.order_id),
                book_id: Set(line.book_id),
                cancel_message_id: Set(Some(message_id.as_str().to_owned())),
                ..Default::default()
            }
            .update(&txn)
            .await?;
            write_message(&txn, event_id, &message).await?;
            messages.push(CancelMessage {
                book_id: Some(book_id),
                message_id,
            });
        }
        orders::ActiveModel {
            order_id: Set(order_id.as_uuid()),
            cancelled_at: Set(Some(Utc::now())),
            ..Default::default()
        }
        .update(&txn)
        .await?;
        txn.commit().await?;
        Ok(Cancellation::Cancelled { messages })
    }
}

/// The order's row, created if new, locked for this transaction (a no-op update rather than
/// DO NOTHING, for its row lock and its RETURNING).
async fn take_order(txn: &DatabaseTransaction, order_id: OrderId) -> Result<orders::Model, DbErr> {
    let row = orders::ActiveModel {
        order_id: Set(order_id.as_uuid()),
        placed_at: Set(Utc::now()),
        cancelled_at: Set(None),
        cancel_message_id: Set(None),
    };
    orders::Entity::insert(row)
        .on_conflict(
            OnConflict::column(orders::Column::OrderId)
                .update_column(orders::Column::OrderId)
                .to_owned(),
        )
        .exec_with_returning(txn)
        .await
}

/// A new message's id: the outbox row's event id, as text.
fn new_message_id() -> (Uuid, MessageId) {
    let event_id = Uuid::now_v7();
    let message_id = MessageId::parse(event_id.to_string()).expect("a UUID is a valid message id");
    (event_id, message_id)
}

async fn write_message(
    txn: &DatabaseTransaction,
    event_id: Uuid,
    message: &Message,
) -> Result<(), DbErr> {
    let body = message
        .to_plain_json()
        .expect("a message under a message id has a plain body");
    let body = String::from_utf8(body).expect("serde_json writes UTF-8");
    outbox::insert(
        txn,
        OutboxTable::Orders,
        event_id,
        message.event.order_id(),
        &message.event.subject_below_prefix(),
        body,
    )
    .await
}

fn stored_message_id(column: &'static str, stored: String) -> Result<MessageId, DataError> {
    MessageId::parse(stored.clone()).map_err(|_| DataError::Unreadable {
        column,
        value: stored,
    })
}

#[derive(Debug, clap::Subcommand)]
pub enum OrdersCommand {
    /// Places copies of a book in an order, with its OrderPlaced. After a failure, run it again
    /// with the order id it printed (or the one given): nothing is placed twice and the message
    /// keeps its id.
    Place {
        #[arg(long)]
        book_id: BookId,
        /// Copies, 1 to 10,000.
        #[arg(long)]
        quantity: i64,
        /// The order; a new one by default. An open order takes one line per book.
        #[arg(long)]
        order_id: Option<OrderId>,
        #[command(flatten)]
        database: OrdersDatabaseArgs,
    },
    /// Cancels an order, once: an OrderCancelled for each of its lines, on its book's subject.
    /// After a failure, run it again: nothing is cancelled twice and the messages keep their
    /// ids.
    Cancel {
        #[arg(long)]
        order_id: OrderId,
        #[command(flatten)]
        database: OrdersDatabaseArgs,
    },
}

/// `inventory orders place|cancel`.
pub async fn run(command: OrdersCommand) -> anyhow::Result<()> {
    let (OrdersCommand::Place { database, .. } | OrdersCommand::Cancel { database, .. }) = &command;
    let conn = db::open(
        database.url(),
        COMMAND_POOL,
        database.database.schema(),
        database.database.timeouts(),
    )
    .await
    .context("opening the orders database")?;
    let orders = OrdersRepository::new(conn);
    match command {
        OrdersCommand::Place {
            book_id,
            quantity,
            order_id,
            ..
        } => {
            let order_id = order_id.unwrap_or_else(OrderId::new_v7);
            let quantity = Quantity::new(quantity)?;
            let (verb, message_id) = match orders.place(order_id, book_id, quantity).await? {
                Placement::Placed { message_id } => ("placed", message_id),
                Placement::AlreadyPlaced { message_id } => ("already placed", message_id),
            };
            println!(
                "{verb}: order {order_id} book {book_id} quantity {quantity} message {message_id}"
            );
        }
        OrdersCommand::Cancel { order_id, .. } => {
            let (verb, messages) = match orders.cancel(order_id).await? {
                Cancellation::Cancelled { messages } => ("cancelled", messages),
                Cancellation::AlreadyCancelled { messages } => ("already cancelled", messages),
            };
            for CancelMessage {
                book_id,
                message_id,
            } in messages
            {
                match book_id {
                    Some(book_id) => {
                        println!("{verb}: order {order_id} book {book_id} message {message_id}");
                    }
                    None => println!("{verb}: order {order_id} message {message_id}"),
                }
            }
        }
    }
    Ok(())
}
