//! `inventory publish`: the producer. Each message's id is made once and kept across every
//! retry of its publish, as `Nats-Msg-Id`, so the stream drops a retry it already stored.
//! `--resend-with-new-id` plays the faulty producer that the inbox cannot see through.
//! [`OrderPublisher`], that producer's publish, is what the study, the benchmarks and the tests
//! publish orders with.

use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use async_nats::jetstream::context::PublishError;
use async_nats::jetstream::message::PublishMessage;
use backon::{ExponentialBuilder, Retryable as _};
use bytes::Bytes;
use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use inventory_domain::{
    BookId, DedupKey, Event, Message, MessageId, OrderCancelled, OrderId, OrderPlaced, Quantity,
    StockEvent,
};
use inventory_infra::jetstream::{self, Context, PublishReceipt, Topology};

use inventory_service::args::{NatsArgs, TopologyArgs};

/// Publishes in flight at once in a bulk run.
const IN_FLIGHT: usize = 64;

/// Five tries of a publish: 100 ms, doubling up to 2 s, between them.
const PUBLISH_PAUSES: ExponentialBuilder = ExponentialBuilder::new()
    .with_min_delay(Duration::from_millis(100))
    .with_max_delay(Duration::from_secs(2))
    .with_max_times(4);

/// A publish that failed: the message has no body a producer publishes, or the stream did not
/// store it within the retries (`source`'s kind says why: no stream holds the subject, a
/// timeout, …).
#[derive(Debug, thiserror::Error)]
pub enum PublishFailed {
    #[error("publishing {0}: a CloudEvent key has no plain JSON body")]
    NoPlainBody(String),
    #[error("publishing {message_id} to {subject}: {source}")]
    Nats {
        message_id: String,
        subject: String,
        #[source]
        source: PublishError,
    },
}

/// The producer: publishes a message under its own id as `Nats-Msg-Id`, and retries with that
/// same id, so a retry after a lost acknowledgement is dropped by the stream.
#[derive(Clone)]
pub struct OrderPublisher {
    js: Context,
    topology: Topology,
}

impl OrderPublisher {
    pub fn new(js: Context, topology: Topology) -> Self {
        Self { js, topology }
    }

    pub async fn publish(&self, message: &Message) -> Result<PublishReceipt, PublishFailed> {
        let key = message.key.storage_key();
        let body = message
            .to_plain_json()
            .ok_or_else(|| PublishFailed::NoPlainBody(key.to_string()))?;
        let subject = self.topology.subject_of(&message.event);
        self.publish_raw(&subject, &key, Bytes::from(body)).await
    }

    /// Publishes Inventory's `event` to the events stream, its id as `Nats-Msg-Id`: what the
    /// relay does with an outbox row, for tests and the study that feed the email notifier
    /// without a relay.
    pub async fn publish_event(&self, event: &StockEvent) -> Result<PublishReceipt, PublishFailed> {
        let subject = format!(
            "{}.{}",
            self.topology.events_subject_prefix,
            event.subject_token()
        );
        let id = event.event_id.to_string();
        self.publish_raw(&subject, &id, Bytes::from(event.body()))
            .await
    }

    /// Publishes `body` to `subject` with `message_id`, retrying with the same id.
    pub async fn publish_raw(
        &self,
        subject: &str,
        message_id: &str,
        body: Bytes,
    ) -> Result<PublishReceipt, PublishFailed> {
        let publish = || async {
            let publish = PublishMessage::build()
                .message_id(message_id)
                .payload(body.clone());
            self.js
                .send_publish(subject.to_owned(), publish)
                .await?
                .await
        };
        let ack = publish
            .retry(PUBLISH_PAUSES)
            .notify(|error, _| {
                tracing::warn!(%error, message_id, "publish failed; retrying with the same message id");
            })
            .await
            .map_err(|source| PublishFailed::Nats {
                message_id: message_id.to_owned(),
                subject: subject.to_owned(),
                source,
            })?;
        Ok(PublishReceipt {
            sequence: ack.sequence,
            duplicate: ack.duplicate,
        })
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct PublishArgs {
    #[command(flatten)]
    pub nats: NatsArgs,
    #[command(flatten)]
    pub topology: TopologyArgs,
    #[command(subcommand)]
    pub event: PublishEvent,
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum PublishEvent {
    /// OrderPlaced: reserve copies of a book for an order.
    Placed {
        #[arg(long)]
        book_id: BookId,
        /// Copies, 1 to 10,000.
        #[arg(long)]
        quantity: i64,
        /// The order; a new one by default (and for each message of a --count run).
        #[arg(long)]
        order_id: Option<OrderId>,
        /// The message id; a new UUID v7 by default.
        #[arg(long)]
        message_id: Option<String>,
        #[arg(long)]
        correlation_id: Option<String>,
        /// Publishes this many orders, each with its own order and message id.
        #[arg(long, default_value_t = 1)]
        count: u64,
        /// After each message, publishes it again under a NEW message id, as a faulty
        /// producer's retry does.
        #[arg(long)]
        resend_with_new_id: bool,
    },
    /// OrderCancelled: release an order's reservations.
    Cancelled {
        #[arg(long)]
        order_id: OrderId,
        /// Cancels this one line of the order, on `orders.cancelled.<book_id>`: the cancellation
        /// a stream sharded by book routes to the book's shard. The whole order by default,
        /// which a sharded stream dead-letters as `unroutable`.
        #[arg(long)]
        book_id: Option<BookId>,
        /// The message id; a new UUID v7 by default.
        #[arg(long)]
        message_id: Option<String>,
        #[arg(long)]
        correlation_id: Option<String>,
        /// Publishes it again under a NEW message id.
        #[arg(long)]
        resend_with_new_id: bool,
    },
}

fn message_id(given: Option<String>) -> Result<DedupKey> {
    Ok(DedupKey::MessageId(match given {
        Some(id) => MessageId::parse(id)?,
        None => MessageId::generate(),
    }))
}

/// The messages a command asks for, each with its id fixed before the first attempt.
fn messages(event: &PublishEvent) -> Result<(Vec<Message>, bool)> {
    match event.clone() {
        PublishEvent::Placed {
            book_id,
            quantity,
            order_id,
            message_id: given_id,
            correlation_id,
            count,
            resend_with_new_id,
        } => {
            if count > 1 && (order_id.is_some() || given_id.is_some()) {
                bail!(
                    "--count makes a new order and message id per message: drop --order-id and --message-id"
                );
            }
            let quantity = Quantity::new(quantity)?;
            let mut given_id = given_id;
            let built = (0..count.max(1))
                .map(|_| {
                    Ok(Message {
                        key: message_id(given_id.take())?,
                        correlation_id: correlation_id.clone(),
                        occurred_at: Some(chrono_now()),
                        event: Event::Placed(OrderPlaced {
                            order_id: order_id.unwrap_or_else(OrderId::new_v7),
                            book_id,
                            quantity,
                        }),
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Ok((built, resend_with_new_id))
        }
        PublishEvent::Cancelled {
            order_id,
            book_id,
            message_id: given_id,
            correlation_id,
            resend_with_new_id,
        } => Ok((
            vec![Message {
                key: message_id(given_id)?,
                correlation_id,
                occurred_at: Some(chrono_now()),
                event: Event::Cancelled(OrderCancelled { order_id, book_id }),
            }],
            resend_with_new_id,
        )),
    }
}

fn chrono_now() -> String {
    humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string()
}

fn describe(message: &Message, receipt: &PublishReceipt) -> String {
    let event = match &message.event {
        Event::Placed(placed) => format!(
            "OrderPlaced order_id={} book_id={} quantity={}",
            placed.order_id, placed.book_id, placed.quantity
        ),
        Event::Cancelled(cancelled) => match cancelled.book_id {
            Some(book_id) => format!(
                "OrderCancelled order_id={} book_id={book_id}",
                cancelled.order_id
            ),
            None => format!("OrderCancelled order_id={}", cancelled.order_id),
        },
        Event::StockReserved(reserved) => format!(
            "StockReserved order_id={} book_id={} quantity={}",
            reserved.order_id, reserved.book_id, reserved.quantity
        ),
    };
    let stored = if receipt.duplicate {
        format!(
            "duplicate: the stream already had this message id (sequence {})",
            receipt.sequence
        )
    } else {
        format!("stored as sequence {}", receipt.sequence)
    };
    format!("{event} message_id={} -> {stored}", message.key)
}

#[derive(Default)]
struct Tally {
    stored: u64,
    duplicates: u64,
    resent: u64,
}

pub async fn run(args: PublishArgs) -> Result<()> {
    let (messages, resend) = messages(&args.event)?;
    let client = args.nats.connect("inventory publish").await?;
    let js = jetstream::context(client.clone());
    let topology = args.topology.topology();
    jetstream::ensure_streams(&js, &topology)
        .await
        .context("setting up the streams")?;
    let publisher = OrderPublisher::new(js, topology);

    let single = messages.len() == 1;
    let progress = if single {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(messages.len() as u64)
    };
    progress.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} {per_sec} {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut results = futures::stream::iter(messages)
        .map(|message| {
            let publisher = publisher.clone();
            async move {
                let receipt = publisher.publish(&message).await?;
                let resent = if resend {
                    let copy = Message {
                        key: DedupKey::MessageId(MessageId::generate()),
                        ..message.clone()
                    };
                    let receipt = publisher.publish(&copy).await?;
                    Some((copy, receipt))
                } else {
                    None
                };
                anyhow::Ok((message, receipt, resent))
            }
        })
        .buffer_unordered(IN_FLIGHT);
    let mut tally = Tally::default();
    while let Some(result) = results.next().await {
        let (message, receipt, resent) = result?;
        progress.inc(1);
        if single {
            println!("{}", describe(&message, &receipt));
        }
        tally.stored += u64::from(!receipt.duplicate);
        tally.duplicates += u64::from(receipt.duplicate);
        if let Some((copy, receipt)) = resent {
            if single {
                println!("resent with a new id: {}", describe(&copy, &receipt));
            }
            tally.resent += 1;
        }
    }
    progress.finish_and_clear();
    if !single {
        println!(
            "published {} messages: {} stored, {} dropped by the stream as duplicates; {} resent with new ids",
            tally.stored + tally.duplicates,
            tally.stored,
            tally.duplicates,
            tally.resent
        );
    }
    client.flush().await?;
    Ok(())
}
