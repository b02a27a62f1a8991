//! The transactional outbox of Inventory: the event of each reservation decision, written in
//! the decision's own transaction, so that a decision is never committed without its event nor
//! an event published for a decision that rolled back. The relay publishes the rows later and
//! removes them.
//!
//! The ORM handler writes through `record`; the PostgreSQL statements in
//! `consumers/natural_pg.rs` write the same row in SQL (`jsonb_build_object`), whose body a
//! test holds equal to [`StockEvent::body`]'s. The study's orders producer
//! (`inventory_benches::orders`) writes its own outbox table of the same shape through
//! [`insert`].
//!
//! # Layout
//! - [`relay`]: the relay, which publishes an outbox's rows to their stream and deletes them
//!   after the PubAck; why several relays, a stale one included, neither reorder nor double
//!   an order's events.
//! - `lease`: the partition leases and heartbeats through which relays share an outbox; a
//!   round's decisions apart from its statements.
//! - `pass`: a pass's publication decisions apart from the publishing: the chains, what goes
//!   out next, what a PubAck or a failure does.
//! - `model` (tests only): the protocol as a model, run on `lease`'s and `pass`'s decisions.
//! - [`source`]: an outbox as the relay sees it, any table of the outbox's columns with its
//!   stream and subject prefix (Inventory's `outbox`, the orders producer's
//!   `orders_outbox`): reading, deleting, parking, listing and retrying parked rows.

use chrono::Utc;
use inventory_domain::outbox::partition;
use inventory_domain::{OrderId, StockEvent};
use sea_orm::sea_query::{Alias, Query};
use sea_orm::{ConnectionTrait, DbErr};
use uuid::Uuid;

mod lease;
#[cfg(test)]
mod model;
mod pass;
pub mod relay;
pub mod source;

pub use relay::{
    LeaseTooLong, PassReport, Published, Relay, RelayError, RelaySettings, RelayStatus, RelayWake,
};
pub use source::{Backlog, OutboxSource, ParkedRow, Retry};

/// An outbox table. Both have the columns of the migrations' `outbox_table.rs`, so one relay
/// publishes either.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutboxTable {
    /// `outbox`: Inventory's events, for the `INVENTORY` stream.
    Inventory,
    /// `orders_outbox`: the orders producer's OrderPlaced and OrderCancelled, for `ORDERS`.
    Orders,
}

impl OutboxTable {
    pub fn name(self) -> &'static str {
        match self {
            Self::Inventory => "outbox",
            Self::Orders => "orders_outbox",
        }
    }
}

/// The columns a writer fills; `seq` and the parking's are the database's and the relay's.
const WRITTEN: [&str; 6] = [
    "event_id",
    "relay_partition",
    "order_id",
    "subject",
    "payload",
    "created_at",
];

/// Writes one row into `table` through `conn`, the transaction that made the event's
/// decision. `below_prefix` is its subject below the stream's prefix (`placed.<book_id>`).
pub async fn insert(
    conn: &impl ConnectionTrait,
    table: OutboxTable,
    event_id: Uuid,
    order_id: OrderId,
    below_prefix: &str,
    payload: String,
) -> Result<(), DbErr> {
    let statement = Query::insert()
        .into_table(Alias::new(table.name()))
        .columns(WRITTEN)
        .values_panic([
            event_id.into(),
            partition(order_id).into(),
            order_id.as_uuid().into(),
            below_prefix.into(),
            payload.into(),
            Utc::now().into(),
        ])
        .to_owned();
    conn.execute(&statement).await?;
    Ok(())
}

/// Writes `event` into Inventory's outbox through `conn`, the transaction that decided it.
pub async fn record(conn: &impl ConnectionTrait, event: &StockEvent) -> Result<(), DbErr> {
    insert(
        conn,
        OutboxTable::Inventory,
        event.event_id,
        event.order_id,
        event.subject_token(),
        event.body(),
    )
    .await
}
