//! `inventory bench end-to-end`: OrderPlaced published to JetStream and consumed by the real
//! service loop into PostgreSQL or SQLite, acked after commit; messages per second from the
//! first fetch to the last ack.

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, ensure};
use futures::StreamExt;
use inventory_domain::{BookId, Message, OrderId, Quantity, StockItem};
use inventory_infra::db::FreshDatabase;
use inventory_infra::jetstream::{self, Context, OrderPublisher, Topology};
use inventory_infra::{HandlerKind, NaturalKeyPath, StockRepository};
use serde::Serialize;

use inventory_service::args::{NatsArgs, natural_key_path};
use inventory_service::runtime::{ConsumerRuntime, RuntimeSettings, Shutdown};

#[derive(Debug, Clone, clap::Args)]
pub struct EndToEndArgs {
    /// Orders published (each once, plus the duplicates).
    #[arg(long, default_value_t = 20_000)]
    pub messages: usize,
    /// Messages in flight: consumer lanes, each with its own connection on PostgreSQL, sharing
    /// the one writer on SQLite.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Messages committed together per lane (1: one statement per message).
    #[arg(long, default_value_t = 1)]
    pub batch_size: usize,
    /// Fraction of orders the producer resends under a new message id.
    #[arg(long, default_value_t = 0.1)]
    pub duplicates: f64,
    /// Books the orders spread over (fewer books: more waiting on hot stock rows).
    #[arg(long, default_value_t = 1_000)]
    pub books: usize,
    /// The natural-key handler: one-statement (the batch statement with --batch-size above 1)
    /// or orm.
    #[arg(long, default_value = "one-statement", value_parser = natural_key_path())]
    pub handler: NaturalKeyPath,
    /// PostgreSQL server for the fresh database; sqlite:// for a fresh SQLite file.
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub database_url: String,
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Prints JSON instead of a line of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct EndToEndReport {
    pub handler: String,
    pub concurrency: usize,
    pub batch_size: usize,
    pub messages: u64,
    pub processed: u64,
    pub duplicates: u64,
    pub seconds: f64,
    pub messages_per_second: f64,
}

pub async fn run(args: &EndToEndArgs) -> Result<EndToEndReport> {
    let lanes = args.concurrency.max(1);
    let fresh = FreshDatabase::create(
        Some(&args.database_url),
        "inventory_bench",
        u32::try_from(lanes + 2).unwrap_or(u32::MAX),
    )
    .await
    .context("creating the benchmark database")?;
    let result = measure(args, lanes, &fresh).await;
    fresh.remove().await?;
    result
}

async fn measure(
    args: &EndToEndArgs,
    lanes: usize,
    fresh: &FreshDatabase,
) -> Result<EndToEndReport> {
    let stock = StockRepository::new(fresh.conn.clone());
    let mut books = Vec::with_capacity(args.books.max(1));
    for index in 0..args.books.max(1) {
        let book = BookId::new_v7();
        stock
            .put(&StockItem::new(
                book,
                &format!("Book {index}"),
                1_000_000_000,
            )?)
            .await?;
        books.push(book);
    }

    let suffix = uuid::Uuid::new_v4().simple().to_string()[..12].to_uppercase();
    let topology = Topology {
        stream: format!("BENCH_{suffix}"),
        subject_prefix: format!("bench{suffix}.orders"),
        dlq_stream: format!("BENCH_DLQ_{suffix}"),
        dlq_subject_prefix: format!("bench{suffix}.dlq"),
        events_stream: format!("BENCH_EVENTS_{suffix}"),
        events_subject_prefix: format!("bench{suffix}.inventory"),
        ..Topology::default()
    };
    let client = jetstream::connect(&args.nats.nats_url, "inventory bench").await?;
    let js = jetstream::context(client.clone());
    jetstream::ensure_streams(&js, &topology).await?;
    let outcome = publish_and_consume(args, lanes, fresh, &books, &js, &topology).await;
    for name in [&topology.stream, &topology.dlq_stream] {
        let _ = js.delete_stream(name).await;
    }
    outcome
}

async fn publish_and_consume(
    args: &EndToEndArgs,
    lanes: usize,
    fresh: &FreshDatabase,
    books: &[BookId],
    js: &Context,
    topology: &Topology,
) -> Result<EndToEndReport> {
    let (messages, expected_reserved) = placements(args.messages, args.duplicates, books)?;
    let publisher = OrderPublisher::new(js.clone(), topology.clone());
    let mut published = futures::stream::iter(&messages)
        .map(|message| publisher.publish(message))
        .buffer_unordered(256);
    while let Some(receipt) = published.next().await {
        receipt?;
    }
    let total = messages.len() as u64;

    let handler = HandlerKind::natural_key(args.handler, args.batch_size);
    let mut settings = RuntimeSettings::new(topology.clone(), handler, lanes);
    settings.consumer.durable_name = "inventory-bench".into();
    settings.consumer.max_ack_pending = 20_000;
    settings.batch_size = args.batch_size.max(1);
    settings.retry_delay = Duration::from_millis(100);
    settings.max_retry_delay = Duration::from_secs(5);
    let runtime = ConsumerRuntime::prepare(js, fresh.conn.clone(), settings).await?;
    let handler = runtime.handler(None)?;
    let started = Instant::now();
    let running = runtime.start(handler, None, Shutdown::default());
    // Done when every message was acked: counted by the loop, confirmed by the server.
    let stats = running.stats.clone();
    loop {
        let handled = stats.acked.load(Relaxed) + stats.duplicates.load(Relaxed);
        if handled >= total {
            let state = running.consumer_state().await?;
            if state.pending == 0 && state.ack_pending == 0 {
                break;
            }
        }
        ensure!(!running.is_finished(), "the consumer loop stopped early");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    running.stop().await?;
    let reserved: i64 = StockRepository::new(fresh.conn.clone())
        .list()
        .await?
        .iter()
        .map(|item| item.reserved)
        .sum();
    ensure!(
        reserved == expected_reserved,
        "reserved {reserved} copies where {expected_reserved} were ordered"
    );
    Ok(EndToEndReport {
        handler: format!("{:?}", args.handler),
        concurrency: lanes,
        batch_size: args.batch_size.max(1),
        messages: total,
        processed: stats.acked.load(Relaxed),
        duplicates: stats.duplicates.load(Relaxed),
        seconds,
        messages_per_second: total as f64 / seconds,
    })
}

/// `count` fresh orders spread over `books`, a `duplicates` fraction of them resent under a new
/// message id just before the original, and the copies they reserve between them.
pub fn placements(count: usize, duplicates: f64, books: &[BookId]) -> Result<(Vec<Message>, i64)> {
    // Every tenth order (by default) resent under a new id: duplicates spread evenly.
    let resend_every = if duplicates > 0.0 {
        (1.0 / duplicates).round().max(1.0) as usize
    } else {
        usize::MAX
    };
    let mut messages = Vec::with_capacity(count + count / resend_every.max(1));
    let mut expected_reserved = 0_i64;
    for index in 0..count {
        let quantity = 1 + (index % 3) as i64;
        expected_reserved += quantity;
        let message = Message::placed(
            OrderId::new_v7(),
            books[index % books.len()],
            Quantity::new(quantity)?,
        );
        if index % resend_every == resend_every - 1 {
            messages.push(message.resent_with_new_id());
        }
        messages.push(message);
    }
    Ok((messages, expected_reserved))
}

/// The pgbench script that runs the one-statement handler's own SQL (`RESERVE_SQL`) with fresh
/// orders over `books` books, seeded by [`pgbench_seed_sql`]. pgbench variables stand in for
/// the statement's parameters, so the database does the same work per message as the service.
pub fn pgbench_script(books: usize) -> String {
    let statement = inventory_infra::consumers::natural_pg::RESERVE_SQL
        .replace("$1", "md5('o' || :n::text)::uuid")
        .replace("$2", "md5('b' || :b::text)::uuid")
        .replace("$3", "(1 + :n::bigint % 3)::int4")
        .replace("$4", "('pgbench-' || :n::text)")
        .replace("$5", "md5('e' || :n::text)::uuid")
        .replace("$6", "(:n % 16)::int2");
    format!(
        "\\set n random(1, 1000000000000)\n\\set b random(1, {books})\n{};\n",
        statement.replace('\n', " ")
    )
}

/// The books the pgbench script orders from, with stock that never runs out.
pub fn pgbench_seed_sql(books: usize) -> String {
    format!(
        "INSERT INTO stock_items (book_id, title, on_hand, reserved) \
         SELECT md5('b' || g)::uuid, 'Book ' || g, 1000000000, 0 FROM generate_series(1, {books}) g;"
    )
}
