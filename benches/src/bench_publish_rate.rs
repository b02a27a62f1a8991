//! `inventory bench publish-rate`: OrderPlaced on its book's subject (`orders.placed.<book_id>`)
//! at a set rate, or as fast as the stream stores them, with many publishes in flight and their
//! PubAcks awaited asynchronously: a steady load for a sharded deployment, and what one stream
//! stores a second. Each message has the producer's shape (`inventory publish`): a new order and
//! message id (`Nats-Msg-Id`), quantity 1, its book taken in turn from the books given, so
//! the load is uniform over them. No retry: a publish that fails ends the run.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use async_nats::jetstream::message::PublishMessage;
use bytes::Bytes;
use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use inventory_domain::{
    BookId, DedupKey, Event, Message, MessageId, OrderId, OrderPlaced, Quantity,
};
use inventory_infra::jetstream;
use inventory_service::args::{NatsArgs, TopologyArgs};
use serde::Serialize;

use crate::system_cpu::CpuSnapshot;

/// A publish whose PubAck is awaited.
type Pending = std::pin::Pin<
    Box<
        dyn std::future::Future<
                Output = Result<
                    async_nats::jetstream::publish::PublishAck,
                    async_nats::jetstream::context::PublishError,
                >,
            > + Send,
    >,
>;

#[derive(Debug, Clone, clap::Args)]
pub struct PublishRateArgs {
    /// A file of book ids, one a line; the orders go to them in turn.
    #[arg(long, conflicts_with = "book_id")]
    pub books_file: Option<PathBuf>,
    /// One book id (repeat it for several): every order goes to these.
    #[arg(long)]
    pub book_id: Vec<BookId>,
    /// Orders to publish.
    #[arg(long, default_value_t = 100_000)]
    pub messages: u64,
    /// Orders a second; 0: as fast as the stream acknowledges them.
    #[arg(long, default_value_t = 0.0)]
    pub rate: f64,
    /// Publishes whose PubAck is awaited at once.
    #[arg(long, default_value_t = 256)]
    pub in_flight: usize,
    /// Creates the streams if they do not exist (as `inventory publish` does).
    #[arg(long)]
    pub ensure_streams: bool,
    /// Sets the orders stream's subject transform onto this many partitions first, as `inventory
    /// shard init` sets it, without the consumers and the bucket `init` adds: the transform's
    /// own cost.
    #[arg(long, requires = "ensure_streams")]
    pub set_transform: Option<std::num::NonZeroU32>,
    #[command(flatten)]
    pub nats: NatsArgs,
    #[command(flatten)]
    pub topology: TopologyArgs,
}

#[derive(Debug, Serialize)]
struct Report {
    messages: u64,
    seconds: f64,
    messages_per_second: f64,
    /// Publishes the stream answered as duplicates (none expected: every id is new).
    duplicates: u64,
    /// This process's CPU, µs per message (user + system).
    publisher_cpu_micros_per_message: f64,
    target_rate: f64,
    in_flight: usize,
    books: usize,
    body_bytes: usize,
}

fn books(args: &PublishRateArgs) -> Result<Vec<BookId>> {
    let books = match &args.books_file {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("reading {}", path.display()))?
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty())
            .map(|line| BookId::parse(line).with_context(|| format!("book id {line:?}")))
            .collect::<Result<Vec<_>>>()?,
        None => args.book_id.clone(),
    };
    if books.is_empty() {
        bail!("name the books: --books-file or --book-id");
    }
    Ok(books)
}

/// One order's subject, message id and body, made before its publish is timed.
fn order(topology: &jetstream::Topology, book_id: BookId) -> Result<(String, String, Bytes)> {
    let message = Message {
        key: DedupKey::MessageId(MessageId::generate()),
        correlation_id: None,
        occurred_at: Some(
            humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string(),
        ),
        event: Event::Placed(OrderPlaced {
            order_id: OrderId::new_v7(),
            book_id,
            quantity: Quantity::new(1)?,
        }),
    };
    let body = message
        .to_plain_json()
        .context("an OrderPlaced has a plain JSON body")?;
    Ok((
        topology.subject_of(&message.event),
        message.key.storage_key().to_string(),
        Bytes::from(body),
    ))
}

pub async fn run(args: &PublishRateArgs) -> Result<()> {
    let books = books(args)?;
    let client = args.nats.connect("inventory bench publish-rate").await?;
    let js = jetstream::context(client.clone());
    let topology = args.topology.topology();
    if args.ensure_streams {
        jetstream::ensure_streams(&js, &topology)
            .await
            .context("setting up the streams")?;
    }
    if let Some(partitions) = args.set_transform {
        let mut config = js
            .get_stream(&topology.stream)
            .await
            .context("reading the orders stream")?
            .cached_info()
            .config
            .clone();
        config.subject_transform = Some(jetstream::partition_transform(&topology, partitions));
        js.update_stream(config)
            .await
            .context("setting the partition transform")?;
    }
    let in_flight = args.in_flight.max(1);
    let mut pending: FuturesUnordered<Pending> = FuturesUnordered::new();
    let (mut acked, mut duplicates) = (0u64, 0u64);
    let mut body_bytes = 0;
    let cpu_before = CpuSnapshot::before()?;
    let started = Instant::now();
    for i in 0..args.messages {
        if args.rate > 0.0 {
            let due = started + Duration::from_secs_f64(i as f64 / args.rate);
            // Acks that came meanwhile are taken while waiting for the next one's time.
            loop {
                tokio::select! {
                    () = tokio::time::sleep_until(due.into()) => break,
                    Some(ack) = pending.next(), if !pending.is_empty() => {
                        let ack = ack.context("a PubAck")?;
                        acked += 1;
                        duplicates += u64::from(ack.duplicate);
                    }
                }
            }
        }
        while pending.len() >= in_flight {
            let ack = pending
                .next()
                .await
                .context("a publish in flight")?
                .context("a PubAck")?;
            acked += 1;
            duplicates += u64::from(ack.duplicate);
        }
        let book = books[usize::try_from(i % books.len() as u64)?];
        let (subject, id, body) = order(&topology, book)?;
        body_bytes = body.len();
        let ack = js
            .send_publish(
                subject,
                PublishMessage::build().message_id(id).payload(body),
            )
            .await
            .context("publishing")?;
        pending.push(Box::pin(ack.into_future()));
    }
    while let Some(ack) = pending.next().await {
        let ack = ack.context("a PubAck")?;
        acked += 1;
        duplicates += u64::from(ack.duplicate);
    }
    let seconds = started.elapsed().as_secs_f64();
    let (user, system) = CpuSnapshot::after()?.this_process_since(&cpu_before);
    client.flush().await?;
    let report = Report {
        messages: acked,
        seconds,
        messages_per_second: acked as f64 / seconds,
        duplicates,
        publisher_cpu_micros_per_message: (user + system) * 1e6 / acked.max(1) as f64,
        target_rate: args.rate,
        in_flight,
        books: books.len(),
        body_bytes,
    };
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}
