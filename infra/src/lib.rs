//! Infrastructure of the inventory service: the database (sea-orm over PostgreSQL or SQLite)
//! and the consumer strategies that run against it. sea-orm models stay inside this crate;
//! everything public speaks in domain types.
//!
//! # Layout
//! - [`db`]: connecting with consumer-friendly settings, applying migrations; what a database
//!   error's code means for a retry (`DbFailure`); `Probe`, whether the database answers, asked
//!   on a connection outside the pool.
//! - [`stock`]: `StockRepository`, setting stock and reading back reservations and inbox rows;
//!   `DataError`, a value that does not fit between a column and its domain type.
//! - [`consumers`]: the handlers (the inbox, the natural key), the two-phase email consumer,
//!   and `HandleError`, whose kind says whether a failed delivery is retried or dead-lettered.
//! - [`retention`]: purging completed inbox rows in bounded batches.
//! - [`jetstream`]: the streams and durable consumers, the producer, what kind of failure a NATS
//!   call met (`NatsErrorKind`), and the dead-letter format: its headers and ids, the publisher,
//!   and `DeadLetter`, one read back from the dead-letter stream.
//! - [`delivery`]: a message as a consumer receives it: pulling, its origin, ack, nak, term.
//! - [`mailbox`]: `FileMailbox`, the durable email provider for serve mode (sent mail as JSON
//!   lines in a local file, looked up by idempotency key).
//! - [`orders`]: the orders producer, writing an order and its message in one transaction.
//! - [`outbox`]: the events of reservation decisions, written in the decision's transaction.
//! - [`redact`]: masking credentials in URLs before they reach a log.
//! - `entities`: the sea-orm models (private).
//! - [`faults`]: the handlers' crash points, and `FaultPlan`, what happens there, which only
//!   the study and the tests provide.

pub mod consumers;
pub mod db;
pub mod delivery;
mod entities;
pub mod faults;
pub mod jetstream;
pub mod mailbox;
pub mod orders;
pub mod outbox;
pub mod redact;
pub mod retention;
pub mod stock;

pub use consumers::email::{EMAIL_CONSUMER, EmailConsumer};
pub use consumers::{
    BuildError, DetectMode, HandleError, Handler, HandlerKind, MessageHandler, NaturalKeyPath,
    StockConsumer,
};
pub use faults::{CrashPoint, FaultPlan, Faults};
pub use mailbox::{FileMailbox, MailboxError};
pub use stock::{DataError, InboxEntry, RecordedReservation, StockRepository};
