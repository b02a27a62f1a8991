//! Infrastructure of the inventory service: the database (sea-orm over PostgreSQL or SQLite),
//! the natural key that runs against it, and JetStream. The repositories speak in domain types;
//! the stock's sea-orm model is public for the study's handlers, whose other models are theirs.
//!
//! # Layout
//! - [`db`]: connecting with consumer-friendly settings, applying migrations; what a database
//!   error's code means for a retry (`DbFailure`); `Probe`, whether the database answers, asked
//!   on a connection outside the pool.
//! - [`stock`]: `StockRepository`, setting and reading stock;
//!   `DataError`, a value that does not fit between a column and its domain type.
//! - [`consumers`]: the natural key, the handler `serve` runs, on PostgreSQL and on SQLite;
//!   [`MessageHandler`], what the consumer loop needs of any handler; and `HandleError`, whose
//!   kind says whether a failed delivery is retried or dead-lettered.
//! - [`jetstream`]: the streams and durable consumers, which failed set-up request is worth
//!   asking again, and the dead-letter format: its headers and ids, the publisher,
//!   and `DeadLetter`, one read back from the dead-letter stream.
//! - [`partition_owner`]: `PartitionOwners`, the partitions a shard's database owns, as
//!   `shard assign` records them.
//! - [`shard_move`]: moving a partition to another shard, as decisions without I/O: the move's
//!   record, each step's action, an abort; checked as a model (tests only).
//! - [`delivery`]: a message as a consumer receives it: pulling, its origin, ack, nak, term.
//! - [`outbox`]: the events of reservation decisions, written in the decision's transaction.
//! - [`periodic`]: the loop of the watchers that read a figure now and then.
//! - [`redact`]: masking credentials in URLs before they reach a log.
//! - [`entities`]: the sea-orm model of the stock table.
//! - [`faults`]: the handlers' crash points, and `FaultPlan`, what happens there, which only
//!   the study and the tests provide.

pub mod consumers;
pub mod db;
pub mod delivery;
pub mod entities;
pub mod faults;
pub mod jetstream;
pub mod outbox;
pub mod partition_owner;
pub mod periodic;
pub mod redact;
pub mod shard_move;
pub mod stock;

pub use consumers::{HandleError, MessageHandler, NaturalKey};
pub use faults::{CrashPoint, FaultPlan, Faults};
pub use stock::{DataError, StockRepository};
