//! `inventory bench end-to-end`: OrderPlaced published to JetStream and consumed by the real
//! service loop into PostgreSQL or SQLite, acked after commit; messages per second from the
//! first fetch to the last ack.

use crate::produce::Produce as _;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use crate::consumers::{HandlerKind, NaturalKeyPath};
use crate::fresh::FreshDatabase;
use crate::publish::OrderPublisher;
use crate::system_cpu::{CpuSnapshot, CpuSplit};
use anyhow::{Context as _, Result, ensure};
use futures::StreamExt;
use inventory_domain::{BookId, Message, OrderId, Outcome, Quantity, StockItem};
use inventory_infra::db::DatabaseConnection;
use inventory_infra::jetstream::{self, Context, Topology};
use inventory_infra::{HandleError, MessageHandler, StockRepository};
use sea_orm::{ConnectionTrait as _, Statement};
use serde::Serialize;

use crate::bench_hand::{self, Driver, HandWritten};
use crate::latency::{Latency, PublishClock};
use inventory_infra::delivery::PullConsumer;
use inventory_service::args::NatsArgs;

use crate::serve::natural_key_path;
use inventory_service::consumer::{ConsumerRuntime, Reads, Running, RuntimeSettings};
use inventory_service::metrics::ConsumerMetrics;
use inventory_service::shutdown::Shutdown;

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
    /// The natural-key handler: one-statement (on a batch with --batch-size above 1) or orm.
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
    /// Publishes at this many messages per second while consuming, instead of everything
    /// before, and reports the latency from each publish to its handling.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub rate: Option<u64>,
    /// Samples this process's resident memory (VmRSS) every N messages handled.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub rss_every: Option<u64>,
    /// Prints JSON instead of a line of text.
    #[arg(long)]
    pub json: bool,
    // Last: its heading would stick to the flags after it.
    #[command(flatten)]
    pub nats: NatsArgs,
}

#[derive(Debug, Clone, Serialize)]
pub struct EndToEndReport {
    /// `service` (the real consumer loop), `hand-written` (`bench_hand`, on tokio-postgres) or
    /// `hand-written-sqlx`.
    pub consumer: &'static str,
    /// The natural-key path that ran: `batch` when batches were asked of `one-statement`.
    pub handler: &'static str,
    pub concurrency: usize,
    pub batch_size: usize,
    pub messages: u64,
    pub processed: u64,
    pub duplicates: u64,
    pub seconds: f64,
    pub messages_per_second: f64,
    /// CPU time of this whole process from the consumer's start to the last ack, user and
    /// system: the consumer, its NATS client and, with `--rate`, the publisher as well.
    pub cpu_user_seconds: f64,
    pub cpu_system_seconds: f64,
    pub cpu_micros_per_message: f64,
    /// The whole machine's CPU per message over the same time, by process.
    pub cpu_split: CpuSplit,
    /// With `--rate`: from each message's publish to its handling's end (its commit; the ack
    /// follows at once).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency: Option<Latency>,
    /// With `--rss-every`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rss: Option<RssReport>,
}

/// The process's resident memory (VmRSS) while consuming, in KiB.
#[derive(Debug, Clone, Serialize)]
pub struct RssReport {
    pub min_kib: u64,
    pub max_kib: u64,
    pub last_kib: u64,
    /// VmHWM at the end: the peak over the process's life, publishing included.
    pub peak_kib: u64,
    /// `[messages handled, VmRSS KiB]`, from before the first message on.
    pub samples: Vec<(u64, u64)>,
}

/// Who consumes the workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Consumer {
    /// The service's runtime, as `serve` runs it.
    Service,
    /// `bench_hand`: the loop one would write by hand around the same statements.
    HandWritten(Driver),
}

pub async fn run(args: &EndToEndArgs) -> Result<EndToEndReport> {
    run_with(args, Consumer::Service).await
}

pub async fn run_with(args: &EndToEndArgs, consumer: Consumer) -> Result<EndToEndReport> {
    if let Consumer::HandWritten(driver) = consumer {
        ensure!(
            args.handler == NaturalKeyPath::OneStatement,
            "the hand-written consumer runs the one-statement handler's statements"
        );
        bench_hand::check(driver, &args.database_url, args.batch_size)?;
    }
    let lanes = args.concurrency.max(1);
    let fresh = FreshDatabase::create(
        Some(&args.database_url),
        "inventory_bench",
        u32::try_from(lanes + 2).unwrap_or(u32::MAX),
    )
    .await
    .context("creating the benchmark database")?;
    let result = measure(args, consumer, lanes, &fresh).await;
    fresh.remove().await?;
    result
}

async fn measure(
    args: &EndToEndArgs,
    consumer: Consumer,
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
    let client = jetstream::connect(args.nats.url(), "inventory bench").await?;
    let js = jetstream::context(client.clone());
    jetstream::ensure_streams(&js, &topology).await?;
    let outcome = publish_and_consume(args, consumer, lanes, fresh, &books, &js, &topology).await;
    for name in [&topology.stream, &topology.dlq_stream] {
        let _ = js.delete_stream(name).await;
    }
    outcome
}

/// The orders of a run, in publishing order, made as they are published, so that a run of a
/// million orders holds none of them in memory: `messages` orders spread over `books`, every
/// `resend_every`-th resent under a new id first (duplicates spread evenly).
struct Orders<'a> {
    books: &'a [BookId],
    messages: usize,
    resend_every: usize,
}

impl<'a> Orders<'a> {
    /// `messages` fresh orders over `books`, a `duplicates` fraction of them (every tenth, by
    /// default, spread evenly) resent under a new message id just before the original.
    fn new(books: &'a [BookId], messages: usize, duplicates: f64) -> Self {
        let resend_every = if duplicates > 0.0 {
            (1.0 / duplicates).round().max(1.0) as usize
        } else {
            usize::MAX
        };
        Self {
            books,
            messages,
            resend_every,
        }
    }

    fn quantity(index: usize) -> i64 {
        1 + (index % 3) as i64
    }

    /// Every message delivered and acked, copies included.
    fn total(&self) -> u64 {
        (self.messages + self.messages / self.resend_every) as u64
    }

    /// The copies the run must reserve in all.
    fn reserved(&self) -> i64 {
        (0..self.messages).map(Self::quantity).sum()
    }

    fn iter(&self) -> impl Iterator<Item = Result<Message>> + '_ {
        (0..self.messages).flat_map(move |index| {
            let message = Quantity::new(Self::quantity(index)).map(|quantity| {
                Message::placed(
                    OrderId::new_v7(),
                    self.books[index % self.books.len()],
                    quantity,
                )
            });
            let resent = (index % self.resend_every == self.resend_every - 1)
                .then(|| message.as_ref().ok().map(Message::resent_with_new_id))
                .flatten();
            resent
                .into_iter()
                .map(Ok)
                .chain(std::iter::once(message.map_err(anyhow::Error::from)))
        })
    }
}

/// The end-to-end workload all at once, for SQLite's bound: `count` orders over `books` as
/// `Orders` makes them, and the copies they reserve between them.
pub fn placements(count: usize, duplicates: f64, books: &[BookId]) -> Result<(Vec<Message>, i64)> {
    let orders = Orders::new(books, count, duplicates);
    Ok((orders.iter().collect::<Result<_>>()?, orders.reserved()))
}

/// Fails unless the books of `db` have `expected` copies reserved in all: what the run's orders
/// asked for, each once, whatever the copies.
pub async fn ensure_reserved(db: &DatabaseConnection, expected: i64) -> Result<()> {
    let reserved: i64 = StockRepository::new(db.clone())
        .list()
        .await?
        .iter()
        .map(|item| item.reserved)
        .sum();
    ensure!(
        reserved == expected,
        "reserved {reserved} copies where {expected} were ordered"
    );
    Ok(())
}

/// Fails unless `db` holds one reservation and one outbox event for each of the run's `orders`
/// (every order is reserved, and its resent copy writes nothing): what any consumer of the run,
/// the service's or one written by hand, must have written.
async fn ensure_rows(db: &DatabaseConnection, orders: usize) -> Result<()> {
    let row = db
        .query_one_raw(Statement::from_string(
            db.get_database_backend(),
            "SELECT (SELECT count(*) FROM stock_reservations) AS reservations, \
                    (SELECT count(*) FROM outbox) AS events",
        ))
        .await?
        .context("no answer to the count")?;
    let (reservations, events): (i64, i64) =
        (row.try_get("", "reservations")?, row.try_get("", "events")?);
    let orders = i64::try_from(orders)?;
    ensure!(
        reservations == orders && events == orders,
        "{reservations} reservations and {events} outbox events for {orders} orders"
    );
    Ok(())
}

/// The service's handler, telling the clock when each message's handling ended.
#[derive(Clone)]
struct Timed<H> {
    handler: H,
    clock: Arc<PublishClock>,
}

impl<H: MessageHandler> MessageHandler for Timed<H> {
    async fn handle(&self, message: &Message) -> Result<Outcome, HandleError> {
        let result = self.handler.handle(message).await;
        self.clock
            .handled(&message.key.storage_key(), Instant::now());
        result
    }

    async fn handle_batch(&self, messages: &[Message]) -> Vec<Result<Outcome, HandleError>> {
        let results = self.handler.handle_batch(messages).await;
        let now = Instant::now();
        for message in messages {
            self.clock.handled(&message.key.storage_key(), now);
        }
        results
    }
}

/// A consumer of either kind, set up on the server, not yet consuming.
enum Prepared {
    Service(Box<ConsumerRuntime>, HandlerKind),
    HandWritten(Box<PullConsumer>, Driver),
}

impl Prepared {
    async fn new(
        args: &EndToEndArgs,
        consumer: Consumer,
        lanes: usize,
        fresh: &FreshDatabase,
        js: &Context,
        topology: &Topology,
    ) -> Result<Self> {
        if let Consumer::HandWritten(driver) = consumer {
            let consumer = bench_hand::prepare(js, topology).await?;
            return Ok(Self::HandWritten(Box::new(consumer), driver));
        }
        let handler = HandlerKind::natural_key(args.handler, args.batch_size);
        let mut settings =
            RuntimeSettings::new(topology.clone(), "inventory-bench", Reads::Orders, lanes);
        settings.consumer.max_ack_pending = 20_000;
        if handler.takes_batches() {
            settings.batch_size = args.batch_size.max(1);
        }
        settings.retry_delay = Duration::from_millis(100);
        settings.max_retry_delay = Duration::from_secs(5);
        let runtime = ConsumerRuntime::prepare(js, fresh.conn.clone(), settings).await?;
        Ok(Self::Service(Box::new(runtime), handler))
    }

    /// Starts consuming; `clock` is told when each message's handling ends.
    async fn start(
        self,
        lanes: usize,
        batch_size: usize,
        fresh: &FreshDatabase,
        clock: Option<Arc<PublishClock>>,
    ) -> Result<Consuming> {
        Ok(match self {
            Self::Service(runtime, kind) => {
                let handler = kind.build(&fresh.conn, runtime.consumer_name()?, None)?;
                let metrics =
                    crate::workload::unexported_metrics(&runtime.settings().consumer.durable_name)?;
                let counted = metrics.clone();
                let shutdown = Shutdown::new(Shutdown::TIMEOUT);
                let running = match clock {
                    Some(clock) => runtime.start(Timed { handler, clock }, metrics, shutdown),
                    None => runtime.start(handler, metrics, shutdown),
                };
                Consuming::Service(running, counted)
            }
            Self::HandWritten(consumer, driver) => Consuming::HandWritten(Box::new(
                HandWritten::start(fresh, driver, *consumer, lanes, batch_size, clock).await?,
            )),
        })
    }
}

/// A consumer of either kind, running.
enum Consuming {
    /// The service's lanes, and what became of their deliveries.
    Service(Running, ConsumerMetrics),
    HandWritten(Box<HandWritten>),
}

impl Consuming {
    /// Acked so far, not as duplicates, and as duplicates.
    fn counts(&self) -> (u64, u64) {
        match self {
            Self::Service(_, metrics) => (metrics.acked(), metrics.duplicates()),
            Self::HandWritten(lanes) => (
                lanes.counts.acked.load(Relaxed),
                lanes.counts.duplicates.load(Relaxed),
            ),
        }
    }

    /// The server confirms: nothing pending, nothing unacked.
    async fn drained(&self) -> Result<bool> {
        let state = match self {
            Self::Service(running, _) => running.consumer_state().await?,
            Self::HandWritten(lanes) => {
                jetstream::consumer_state(&mut lanes.consumer.clone()).await?
            }
        };
        Ok(state.pending == 0 && state.ack_pending == 0)
    }

    fn is_finished(&self) -> bool {
        match self {
            Self::Service(running, _) => running.is_finished(),
            Self::HandWritten(lanes) => lanes.is_finished(),
        }
    }

    async fn stop(self) -> Result<()> {
        match self {
            Self::Service(running, _) => running.stop().await.map(drop),
            Self::HandWritten(lanes) => lanes.stop().await,
        }
    }
}

/// Publishes `orders`, at `rate` per second if given, telling `clock` when each left.
async fn publish(
    js: &Context,
    topology: &Topology,
    orders: &Orders<'_>,
    rate: Option<u64>,
    clock: Option<&PublishClock>,
) -> Result<()> {
    let publisher = OrderPublisher::new(js.clone(), topology.clone());
    let ticks = rate.map(|rate| {
        let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(1) as f64));
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        ticks
    });
    let paced = futures::stream::unfold(
        (orders.iter(), ticks),
        |(mut messages, mut ticks)| async move {
            let message = messages.next()?;
            if let Some(ticks) = ticks.as_mut() {
                ticks.tick().await;
            }
            Some((message, (messages, ticks)))
        },
    );
    let publisher = &publisher;
    let published = paced
        .map(|message| async move {
            let message = message?;
            if let Some(clock) = clock {
                clock.sent(message.key.storage_key().into_owned());
            }
            publisher.publish(&message).await?;
            anyhow::Ok(())
        })
        .buffer_unordered(256);
    let mut published = std::pin::pin!(published);
    while let Some(receipt) = published.next().await {
        receipt?;
    }
    Ok(())
}

async fn publish_and_consume(
    args: &EndToEndArgs,
    consumer: Consumer,
    lanes: usize,
    fresh: &FreshDatabase,
    books: &[BookId],
    js: &Context,
    topology: &Topology,
) -> Result<EndToEndReport> {
    let orders = Orders::new(books, args.messages, args.duplicates);
    let total = orders.total();
    let clock = args.rate.map(|_| Arc::new(PublishClock::default()));
    if args.rate.is_none() {
        publish(js, topology, &orders, None, None).await?;
    }

    let prepared = Prepared::new(args, consumer, lanes, fresh, js, topology).await?;
    let cpu_before = CpuSnapshot::before()?;
    let started = Instant::now();
    let consuming = prepared
        .start(lanes, args.batch_size, fresh, clock.clone())
        .await?;
    let mut rss = Vec::new();
    // Done when every message was acked: counted by the loop, confirmed by the server.
    let consumed = async {
        let mut next_sample = 0;
        loop {
            let (acked, duplicates) = consuming.counts();
            let handled = acked + duplicates;
            if let Some(every) = args.rss_every {
                while handled >= next_sample {
                    rss.push((handled, status_kib("VmRSS")?));
                    next_sample += every.max(1);
                }
            }
            if handled >= total && consuming.drained().await? {
                return anyhow::Ok(());
            }
            ensure!(!consuming.is_finished(), "the consumer stopped early");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    match args.rate {
        Some(rate) => {
            let published = publish(js, topology, &orders, Some(rate), clock.as_deref());
            tokio::try_join!(published, consumed)?;
        }
        None => consumed.await?,
    }
    let seconds = started.elapsed().as_secs_f64();
    let cpu = CpuSnapshot::after()?;
    let (acked, duplicates) = consuming.counts();
    consuming.stop().await?;
    ensure_reserved(&fresh.conn, orders.reserved()).await?;
    ensure_rows(&fresh.conn, args.messages).await?;
    // Each order processed once, whichever of it and its resent copy came first.
    ensure!(
        acked == args.messages as u64 && acked + duplicates == total,
        "{acked} processed and {duplicates} duplicates of {total} messages, {} orders",
        args.messages
    );
    let (user, system) = cpu.this_process_since(&cpu_before);
    let rss = match rss.as_slice() {
        [] => None,
        samples => Some(RssReport {
            min_kib: samples
                .iter()
                .map(|(_, kib)| *kib)
                .min()
                .unwrap_or_default(),
            max_kib: samples
                .iter()
                .map(|(_, kib)| *kib)
                .max()
                .unwrap_or_default(),
            last_kib: samples.last().map(|(_, kib)| *kib).unwrap_or_default(),
            peak_kib: status_kib("VmHWM")?,
            samples: rss,
        }),
    };
    Ok(EndToEndReport {
        consumer: match consumer {
            Consumer::Service => "service",
            Consumer::HandWritten(Driver::TokioPostgres) => "hand-written",
            Consumer::HandWritten(Driver::Sqlx) => "hand-written-sqlx",
        },
        handler: args.handler.with_batch_size(args.batch_size).as_str(),
        concurrency: lanes,
        batch_size: args.batch_size.max(1),
        messages: total,
        processed: acked,
        duplicates,
        seconds,
        messages_per_second: total as f64 / seconds,
        cpu_user_seconds: user,
        cpu_system_seconds: system,
        cpu_micros_per_message: (user + system) * 1e6 / total as f64,
        cpu_split: cpu.since(&cpu_before, total),
        latency: clock.and_then(|clock| clock.latency()),
        rss,
    })
}

/// A `kB` line of /proc/self/status (`VmRSS`, `VmHWM`), in KiB.
fn status_kib(field: &str) -> Result<u64> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let value = status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .with_context(|| format!("no {field} in /proc/self/status"))?;
    Ok(value.trim().trim_end_matches("kB").trim().parse()?)
}

/// `sql` on one line, without its `/* … */` comments: as pgbench and a single-user backend
/// read a statement.
pub fn one_line(sql: &str) -> String {
    without_comments(sql).replace('\n', " ")
}

/// `sql` without its `/* … */` comments.
fn without_comments(sql: &str) -> String {
    let mut rest = sql;
    let mut kept = String::with_capacity(sql.len());
    while let Some(start) = rest.find("/*") {
        kept.push_str(&rest[..start]);
        rest = rest[start..]
            .find("*/")
            .map_or("", |end| &rest[start + end + 2..]);
    }
    kept.push_str(rest);
    kept
}

/// The pgbench script that runs `statement` (the handler's own `RESERVE_SQL`, or a bound of it
/// with the same parameters) on `batch` fresh placements at a time over `books` books, seeded
/// by [`pgbench_seed_sql`]. Each array is built in the statement from pgbench's variables, so
/// the text around the parameters is the handler's own and the database does the same work per
/// message as the service; comments are dropped first, as pgbench would make a parameter of a
/// variable named in one and fail on its unknown type. A pgbench transaction is a batch. One
/// placement at a time takes any book; a batch, as the lanes of the end-to-end run take
/// consecutive messages, so consecutive books, and never lock each other's books, orders
/// consecutive books, from a random one, in a slice of the books of the client's own
/// (`books / 16`: for up to 16 clients).
pub fn pgbench_script(statement: &str, books: usize, batch: u64) -> String {
    let (first, slice) = if batch == 1 {
        ("0".to_owned(), books.max(1))
    } else {
        let slice = (books / 16).max(1);
        (format!(":client_id * {slice}"), slice)
    };
    let array = |element: &str| {
        format!("(SELECT array_agg({element} ORDER BY i) FROM generate_series(1, {batch}) i)")
    };
    let statement = one_line(statement)
        .replace("$1", &array("md5('o' || :n::text || '-' || i)::uuid"))
        .replace(
            "$2",
            &array(&format!(
                "md5('b' || (1 + {first} + (:b::bigint + i) % {slice})::text)::uuid"
            )),
        )
        .replace("$3", &array("(1 + (:n::bigint + i) % 3)::int4"))
        .replace("$4", &array("'pgbench-' || :n::text || '-' || i"))
        .replace("$5", &array("(i - 1)::int4"))
        .replace("$6", &array("md5('e' || :n::text || '-' || i)::uuid"))
        .replace("$7", &array("((:n::bigint + i) % 16)::int2"))
        .replace("$8", &array("NULL::int2"));
    format!("\\set n random(1, 1000000000000)\n\\set b random(0, {slice} - 1)\n{statement};\n")
}

/// The books the pgbench script orders from, with stock that never runs out.
pub fn pgbench_seed_sql(books: usize) -> String {
    format!(
        "INSERT INTO stock_items (book_id, title, on_hand, reserved) \
         SELECT md5('b' || g)::uuid, 'Book ' || g, 1000000000, 0 FROM generate_series(1, {books}) g;"
    )
}

#[cfg(test)]
mod tests {
    #![expect(clippy::unwrap_used, reason = "a test fails by panicking")]

    use super::{Orders, one_line, pgbench_script};
    use inventory_domain::{BookId, Event};

    #[test]
    fn the_orders_are_each_sent_once_and_every_tenth_resent_under_a_new_id_first() {
        let books = [BookId::new_v7(), BookId::new_v7()];
        let orders = Orders {
            books: &books,
            messages: 25,
            resend_every: 10,
        };
        let messages: Vec<_> = orders.iter().map(Result::unwrap).collect();
        assert_eq!(messages.len() as u64, orders.total());
        assert_eq!(messages.len(), 27);
        // Index 9 is the tenth order: its resend comes first, then the order, same event.
        assert_eq!(messages[9].event, messages[10].event);
        assert_ne!(messages[9].key, messages[10].key);
        let reserved: i64 = messages
            .iter()
            .enumerate()
            .filter(|(at, _)| ![9, 20].contains(at))
            .map(|(_, message)| match &message.event {
                Event::Placed(placed) => i64::from(placed.quantity.get()),
                other => panic!("not a placement: {other:?}"),
            })
            .sum();
        assert_eq!(reserved, orders.reserved());
    }

    #[test]
    fn the_script_binds_every_parameter_of_each_statement_to_an_array() {
        for name in crate::guard_cost::STATEMENTS {
            let sql = crate::guard_cost::statement(name).unwrap();
            for batch in [1, 16] {
                let script = pgbench_script(&sql, 1_000, batch);
                let statement = script.lines().nth(2).unwrap();
                assert!(
                    !statement
                        .as_bytes()
                        .windows(2)
                        .any(|pair| pair[0] == b'$' && pair[1].is_ascii_digit()),
                    "{name}: a parameter left: {statement}"
                );
                assert_eq!(
                    statement
                        .matches(&format!("FROM generate_series(1, {batch}) i)"))
                        .count(),
                    8,
                    "{name}"
                );
            }
        }
    }

    #[test]
    fn a_statement_on_one_line_keeps_its_parameters_and_loses_its_comments() {
        let sql = inventory_infra::consumers::natural_pg::RESERVE_SQL;
        let line = one_line(sql);
        assert!(!line.contains('\n') && !line.contains("/*") && !line.contains("*/"));
        for parameter in ["$1", "$2", "$3", "$4", "$5", "$6", "$7", "$8"] {
            assert!(line.contains(parameter), "{parameter} lost");
        }
    }
}
