//! The transactional outbox of Inventory: the event of each reservation decision, written in
//! the decision's own transaction, so that a decision is never committed without its event nor
//! an event published for a decision that rolled back. The relay publishes the rows later and
//! removes them.
//!
//! The ORM handler writes through [`record`]; the PostgreSQL statements in
//! `consumers/natural_pg.rs` write the same row in SQL (`jsonb_build_object`), and
//! [`pending`] reads both back the same way.
//!
//! # Layout
//! - [`relay`]: the relay, which publishes an outbox's rows to their stream and deletes them
//!   after the PubAck; why several relays, a stale one included, neither reorder nor double
//!   an order's events.
//! - `lease`: the partition leases and heartbeats through which relays share an outbox.
//! - [`source`]: an outbox as the relay sees it, any table of the outbox's columns with its
//!   stream and subject prefix (Inventory's `outbox`, the orders producer's
//!   `orders_outbox`): reading, deleting, parking, listing and retrying parked rows.

use chrono::Utc;
use inventory_domain::outbox::partition;
use inventory_domain::{DecodeError, StockEvent};
use sea_orm::{ConnectionTrait, DbErr, EntityTrait, QueryOrder, Set};

use crate::entities::outbox;

mod lease;
pub mod relay;
pub mod source;

pub use lease::fair_share;
pub use relay::{
    LeaseTooLong, PassReport, Published, Relay, RelayError, RelaySettings, RelayStatus, RelayWake,
};
pub use source::{Backlog, OutboxSource, ParkedRow, Retry};

/// Writes `event` into the outbox through `conn`, the transaction that made its decision.
pub(crate) async fn record(conn: &impl ConnectionTrait, event: &StockEvent) -> Result<(), DbErr> {
    let row = outbox::ActiveModel {
        event_id: Set(event.event_id),
        relay_partition: Set(partition(event.order_id)),
        order_id: Set(event.order_id.as_uuid()),
        subject: Set(event.subject_token().to_owned()),
        payload: Set(event.body()),
        created_at: Set(Utc::now()),
        ..Default::default()
    };
    outbox::Entity::insert(row)
        .exec_without_returning(conn)
        .await?;
    Ok(())
}

/// The events waiting in the outbox, in write order, decoded as a consumer of `INVENTORY`
/// would decode them.
pub async fn pending(conn: &impl ConnectionTrait) -> Result<Vec<StockEvent>, OutboxReadError> {
    outbox::Entity::find()
        .order_by_asc(outbox::Column::Seq)
        .all(conn)
        .await?
        .into_iter()
        .map(|row| Ok(StockEvent::decode(&row.subject, row.payload.as_bytes())?))
        .collect()
}

#[derive(Debug, thiserror::Error)]
pub enum OutboxReadError {
    #[error(transparent)]
    Database(#[from] DbErr),
    #[error("an outbox row does not decode: {0}")]
    Decode(#[from] DecodeError),
}
