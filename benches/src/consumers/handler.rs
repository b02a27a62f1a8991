//! Which handler runs: [`HandlerKind`] is the one list of the handlers the study can run (the
//! study's `serve` flags, `compare`, the benchmarks and the tests all choose through it), and
//! [`Handler`] is the chosen one, built and ready for the consumer loop.

use inventory_domain::{ConsumerName, Message, Outcome};
use inventory_infra::{Faults, HandleError, MessageHandler, NaturalKey};
use sea_orm::DatabaseConnection;

use super::email::EmailConsumer;
use super::{DetectMode, StockConsumer, Strategy};
use crate::mailbox::FileMailbox;

/// Every handler a user can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HandlerKind {
    /// Claims `(message_id, consumer)` first, in the work's transaction.
    Inbox(DetectMode),
    /// The reservation's own key `(order_id, book_id)` refuses a second reservation.
    NaturalKey(NaturalKeyPath),
    /// The two-phase record around an email, which no transaction can hold.
    Email,
}

/// How the natural key reaches the database. All three keep the same rule and the same
/// promises; they differ in round trips. The two fast paths are the service's own
/// (`inventory_infra::NaturalKey`); the sea-orm one is the study's reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NaturalKeyPath {
    /// The sea-orm entity transaction on a pool: the reference.
    Orm,
    /// One transaction per message: on PostgreSQL one statement on a connection each lane
    /// holds; on SQLite the statements on the one writer connection all lanes share.
    OneStatement,
    /// The placements a lane already holds in one commit: the same statement on all of them on
    /// PostgreSQL, one `BEGIN IMMEDIATE` transaction on SQLite's writer.
    Batch,
}

impl NaturalKeyPath {
    /// The path that runs when lanes take up to `batch_size` messages: the one-statement
    /// path commits a batch at once.
    pub fn with_batch_size(self, batch_size: usize) -> Self {
        match self {
            Self::OneStatement if batch_size > 1 => Self::Batch,
            path => path,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Orm => "orm",
            Self::OneStatement => "one-statement",
            Self::Batch => "batch",
        }
    }
}

impl HandlerKind {
    /// The study's name of the strategy, as the demo's and the comparison's tables print it.
    pub fn strategy_name(self) -> &'static str {
        match self {
            Self::Inbox(_) => "inbox",
            Self::NaturalKey(_) => "natural key",
            Self::Email => "email",
        }
    }

    /// The contract's durable consumer of the handler.
    pub fn default_consumer(self) -> &'static str {
        match self {
            Self::NaturalKey(_) => "inventory-reserve-stock",
            Self::Inbox(_) => "inventory-reserve-stock-inbox",
            Self::Email => super::email::EMAIL_CONSUMER,
        }
    }

    /// A name for this handler alone, fit for a benchmark id, a directory or a flag.
    pub fn label(self) -> &'static str {
        match self {
            Self::Inbox(DetectMode::CatchViolation) => "inbox-catch-violation",
            Self::Inbox(DetectMode::PreCheck) => "inbox-pre-check",
            Self::Inbox(DetectMode::OnConflict) => "inbox-on-conflict",
            Self::NaturalKey(NaturalKeyPath::Orm) => "natural-key",
            Self::NaturalKey(NaturalKeyPath::OneStatement) => "natural-key-one-statement",
            Self::NaturalKey(NaturalKeyPath::Batch) => "natural-key-batch",
            Self::Email => "email",
        }
    }

    /// The natural key through `path`, where the one-statement path commits batches when lanes
    /// hand over more than one message at a time.
    pub fn natural_key(path: NaturalKeyPath, batch_size: usize) -> Self {
        Self::NaturalKey(path.with_batch_size(batch_size))
    }

    /// Whether it keeps a row per message in the inbox, which retention purges past the
    /// redelivery horizon. The natural key keeps none: its rows are the business record.
    pub fn writes_inbox_rows(self) -> bool {
        match self {
            Self::Inbox(_) | Self::Email => true,
            Self::NaturalKey(_) => false,
        }
    }

    /// Whether a lane hands it several fetched messages at once, to commit together.
    pub fn takes_batches(self) -> bool {
        self == Self::NaturalKey(NaturalKeyPath::Batch)
    }

    /// Builds the handler on `db`, recording its dedup rows under `consumer`. The email
    /// handler needs the `mailbox` its sent mail goes to.
    pub fn build(
        self,
        db: &DatabaseConnection,
        consumer: ConsumerName,
        mailbox: Option<FileMailbox>,
    ) -> Result<Handler, BuildError> {
        let stock = |strategy| StockConsumer::new(db.clone(), self, strategy, consumer.clone());
        Ok(match self {
            Self::Inbox(detect) => Handler::Stock(stock(Strategy::Inbox(detect))),
            Self::NaturalKey(NaturalKeyPath::Orm) => Handler::Stock(stock(Strategy::NaturalKey)),
            Self::NaturalKey(NaturalKeyPath::OneStatement | NaturalKeyPath::Batch) => {
                Handler::Natural(NaturalKey::new(db, consumer))
            }
            Self::Email => Handler::Email(EmailConsumer::new(
                db.clone(),
                consumer,
                mailbox.ok_or(BuildError::NeedsMailbox)?,
            )),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BuildError {
    #[error("the email handler needs a mailbox for the mail it sends")]
    NeedsMailbox,
}

/// A built handler of any kind.
#[derive(Clone)]
pub enum Handler {
    /// Through sea-orm: the inbox and the natural key's reference.
    Stock(StockConsumer),
    /// The service's own natural key: on PostgreSQL its statements, on SQLite its one writer.
    Natural(NaturalKey),
    Email(EmailConsumer<FileMailbox>),
}

impl Handler {
    /// The name its dedup rows are kept under.
    pub fn consumer(&self) -> &ConsumerName {
        match self {
            Self::Stock(consumer) => consumer.consumer(),
            Self::Natural(handler) => handler.consumer(),
            Self::Email(consumer) => consumer.consumer(),
        }
    }

    /// The same handler, failing as `faults` says (the tests and the study only).
    pub fn with_faults(&self, faults: Faults) -> Self {
        match self {
            Self::Stock(consumer) => Self::Stock(consumer.with_faults(faults)),
            Self::Natural(handler) => Self::Natural(handler.with_faults(faults)),
            Self::Email(consumer) => Self::Email(consumer.with_faults(faults)),
        }
    }

    /// Handles one delivery. `Ok` is final for it (ack, or dead-letter a refusal); `Err` means
    /// nothing was acknowledged and the message will come again or be dead-lettered.
    pub async fn handle(&self, message: &Message) -> Result<Outcome, HandleError> {
        match self {
            Self::Stock(consumer) => consumer.handle(message).await,
            Self::Natural(handler) => handler.handle(message).await,
            Self::Email(consumer) => consumer.handle(message).await,
        }
    }
}

impl MessageHandler for Handler {
    async fn handle(&self, message: &Message) -> Result<Outcome, HandleError> {
        Handler::handle(self, message).await
    }

    async fn handle_batch(&self, messages: &[Message]) -> Vec<Result<Outcome, HandleError>> {
        match self {
            Self::Natural(handler) => handler.handle_batch(messages).await,
            _ => self.handle_each(messages).await,
        }
    }
}
