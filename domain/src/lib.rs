//! The domain of the idempotent inventory consumer: what an `OrderPlaced` or `OrderCancelled`
//! message is, what makes two copies "the same message", and how stock is reserved. No I/O,
//! no database, no broker: every rule here is a plain function with its tests beside it.
//!
//! # Layout
//! - [`ids`]: newtypes that can only be built valid (`MessageId`, `Quantity`, `OrderId`,
//!   `BookId`, `ConsumerName`) and the `DedupKey` derived from a message.
//! - [`message`]: decoding plain JSON and CloudEvents bodies into a `Message`.
//! - [`stock`]: `StockItem` and the reservation decision; the natural key's second-request rule.
//! - [`outcome`]: what handling a message came to, what a failure means for its delivery
//!   (retry or dead-letter), and the contract's dead-letter reasons.
//! - [`outbox`]: the events out of Inventory, one per reservation decision, and the outbox
//!   partition of an order.
//! - [`shard`]: the partition of a book when stock is sharded by book, as NATS computes it.

pub mod ids;
pub mod message;
pub mod outbox;
pub mod outcome;
pub mod shard;
pub mod stock;

pub use ids::{BookId, ConsumerName, DedupKey, FieldError, MessageId, OrderId, Quantity};
pub use message::{
    DecodeError, Event, EventKind, Message, OrderCancelled, OrderPlaced, Subject, keyed_placements,
};
pub use outbox::{StockEvent, StockEventKind};
pub use outcome::{Acked, DeadLetterReason, Effect, ErrorKind, Outcome, Refusal};
pub use stock::{ReservationDecision, ReservationStatus, StockItem};
