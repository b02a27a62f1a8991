//! `inventory serve`: the JetStream subscriber, wired from its flags. The consumer itself is
//! [`crate::consumer`]; this module turns the command line into its settings, adds what only a
//! long-running service needs (signals, the relay, metrics, health) and waits. What the lanes
//! run is a [`Served`]: the natural key here; the study's handlers in the study binary, whose
//! `serve` is this one with its own.

use std::num::NonZeroU32;
use std::time::Duration;

use anyhow::Context as _;
use inventory_domain::{ConsumerName, DeadLetterReason, Outcome};
use inventory_infra::db::{self, DatabaseConnection, DbBackend};
use inventory_infra::jetstream::{self, ConsumerSettings, Topology};
use inventory_infra::outbox::{OutboxSource, RelaySettings};
use inventory_infra::periodic::Every;
use inventory_infra::redact::redact_url;
use inventory_infra::{MessageHandler, NaturalKey};
use tokio_util::sync::CancellationToken;

use crate::args::{
    DatabaseArgs, MetricsAddr, MetricsArgs, NatsArgs, StopArgs, TopologyArgs, shown,
};
use crate::consumer::{ConsumerRuntime, Ending, Reads, Running, RuntimeSettings};
use crate::health::{self, Liveness, Readiness};
use crate::metrics::Metrics;
use crate::relay::{RELAY, RelayArgs};
use crate::retention::HorizonArgs;
use crate::shutdown::{Background, Shutdown};

/// How often the consumer's lag is read for `/metrics`.
const LAG_INTERVAL: Duration = Duration::from_secs(10);

/// How often the dead letters waiting are counted for `/metrics`.
const DEAD_LETTER_INTERVAL: Duration = Duration::from_secs(30);

/// How far past its bound (the database work's, else the ack wait) a delivery may stay in
/// flight before `/livez` calls the lane stuck: the ack or the dead letter after the work
/// needs NATS, whose own requests are bounded well inside it.
const STUCK_MARGIN: Duration = Duration::from_secs(30);

/// The strategy `serve` runs: the natural key. The study's (`inbox`, `email`) run in the
/// study binary, which `inventory serve --strategy inbox|email` starts in this one's place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StrategyArg {
    /// The natural key `(order_id, book_id)`: consumer `inventory-reserve-stock`.
    Natural,
}

/// `inventory serve`'s command line.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeCommand {
    /// Which handler runs: the natural key. `inbox` and `email` are the study's: given, they
    /// start the study binary (inventory-study) in this one's place, with the same arguments.
    #[arg(long, value_enum, default_value = "natural")]
    pub strategy: StrategyArg,
    #[command(flatten)]
    pub args: ServeArgs,
}

/// The flags of `serve`, whichever handler it runs.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Prints the settings in effect, each with where it came from (default, file, environment,
    /// command line) and secrets masked, then exits.
    #[arg(long)]
    pub print_config: bool,
    /// Durable consumer name; the contract's name for the strategy by default.
    #[arg(long, help_heading = "Consumer")]
    pub consumer: Option<String>,
    /// Serves this shard of a sharded orders stream (`inventory shard init`): the durable
    /// consumer of each partition assigned to it (`<consumer>-pNN`), all served by the
    /// instance's --concurrency lanes, and the consumer of what no partition takes, from this
    /// shard's database. Once the stream is sharded, an instance without it does not start.
    #[arg(long, help_heading = "Consumer")]
    pub shard: Option<String>,
    /// Messages a lane hands the handler at once, of those already fetched (a batch never
    /// waits for more). The natural key commits each run of placements in a batch together (a
    /// cancellation between them is handled in its place) and acks each message after the
    /// commit; the study's other handlers take them one by one. 1 to 1000.
    #[arg(long, default_value_t = BATCH_SIZE, value_parser = clap::value_parser!(u16).range(1..=1000), help_heading = "Consumer")]
    pub batch_size: u16,
    /// Messages (or batches) handled at once; by default the pool size on PostgreSQL, 2 on
    /// SQLite. The instance's lanes: on a shard, shared by its partitions' consumers, so it
    /// holds this many lanes, and a database connection each, however many partitions it has.
    #[arg(long, help_heading = "Consumer")]
    pub concurrency: Option<usize>,
    /// How long JetStream waits for an ack before redelivering (when it creates the consumer,
    /// or with --update-consumer).
    #[arg(long, default_value = shown(RuntimeSettings::ACK_WAIT), value_parser = humantime::parse_duration, help_heading = "Consumer")]
    pub ack_wait: Duration,
    /// JetStream redelivery backoff after ack-wait timeouts, comma separated (e.g. 5s,30s,2m);
    /// none by default (when it creates the consumer, or with --update-consumer).
    #[arg(long, value_delimiter = ',', value_parser = humantime::parse_duration, help_heading = "Consumer")]
    pub backoff: Vec<Duration>,
    /// Unacked messages the server lets the consumer hand out, over all instances (when it
    /// creates the consumer, or with --update-consumer). Each instance holds at most
    /// --concurrency × --batch-size (on a shard, of a partition's, one batch more): keep this
    /// at least that times the instances.
    #[arg(long, default_value_t = RuntimeSettings::MAX_ACK_PENDING, help_heading = "Consumer")]
    pub max_ack_pending: i64,
    /// Sets an existing consumer's ack wait, backoff, max ack pending and delivery cap to this
    /// service's where they differ, instead of keeping the server's (each difference is logged
    /// either way).
    #[arg(long, help_heading = "Consumer")]
    pub update_consumer: bool,
    /// Delay before retrying a message that failed transiently; doubles per delivery up to
    /// --max-retry-delay.
    #[arg(long, default_value = shown(RuntimeSettings::RETRY_DELAY), value_parser = humantime::parse_duration, help_heading = "Consumer")]
    pub retry_delay: Duration,
    /// Bodies larger than this are dead letters, never parsed.
    #[arg(long, default_value_t = RuntimeSettings::MAX_BODY_BYTES, help_heading = "Consumer")]
    pub max_body_bytes: usize,
    #[command(flatten)]
    pub stop: StopArgs,
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// Database connections in the pool.
    #[arg(long, default_value_t = 10, help_heading = "Database")]
    pub db_pool_size: u32,
    #[command(flatten)]
    pub nats: NatsArgs,
    #[command(flatten)]
    pub topology: TopologyArgs,
    /// The outbox relay the natural key runs beside its lanes.
    #[command(flatten)]
    pub relay: RelayArgs,
    #[command(flatten)]
    pub horizon: HorizonArgs,
    #[command(flatten)]
    pub metrics: MetricsArgs,
}

/// Batches of 64 on both backends. A batch is only what is already fetched, so at a low rate
/// the batches are of one and add no wait; under load one commit serves many messages (on
/// SQLite the commit's fsync is most of a message's cost). Measured on PostgreSQL by
/// `scripts/bench-batch-default.sh` (docs/benchmarks.md): about 5 times the messages per
/// second of one message per transaction, the same p50 at 1% and 10% of the per-message peak,
/// a lower p99 from 10% up.
const BATCH_SIZE: u16 = 64;
/// SQLite's lanes, shaped for its one writer: one in the writer while the other acks its last
/// messages and takes the next, so the writer never waits on NATS, and more would only queue
/// for it.
const SQLITE_LANES: usize = 2;

/// What `serve`'s lanes run, and what it needs beside them.
pub trait Served {
    type Handler: MessageHandler;

    /// Its name in the log.
    fn label(&self) -> &'static str;

    /// The contract's durable consumer of the handler.
    fn default_consumer(&self) -> &'static str;

    fn reads(&self) -> Reads {
        Reads::Orders
    }

    /// Whether it commits several messages together: the lanes then hand it `--batch-size`
    /// at once.
    fn takes_batches(&self) -> bool;

    /// Whether it writes Inventory's events into the outbox, for the relay `serve` runs.
    fn writes_events(&self) -> bool;

    /// Whether it runs on a shard (`--shard`), its handler prepared for one when
    /// [`Setup::shard_partitions`] says so.
    fn serves_shards(&self) -> bool {
        false
    }

    /// The handler, once the consumer is set up; what must run beside the lanes is adopted
    /// into `setup.background`. An error here stops the start.
    fn prepare(self, setup: Setup<'_>) -> impl Future<Output = anyhow::Result<Self::Handler>>;
}

/// What a [`Served`] is prepared with.
pub struct Setup<'a> {
    pub args: &'a ServeArgs,
    pub db: &'a DatabaseConnection,
    /// The consumer it runs on; on a shard, the first partition's.
    pub runtime: &'a ConsumerRuntime,
    pub consumer: ConsumerName,
    /// On a shard, the orders stream's partitions: the handler decides only those of its
    /// books' partitions its database owns.
    pub shard_partitions: Option<NonZeroU32>,
    pub metrics: &'a Metrics,
    /// Where what runs beside the lanes is spawned.
    pub background: &'a mut Background,
}

/// The natural key on the database's own path: what `inventory serve` runs.
pub struct NaturalKeyServed;

impl Served for NaturalKeyServed {
    type Handler = NaturalKey;

    fn label(&self) -> &'static str {
        "natural-key"
    }

    fn default_consumer(&self) -> &'static str {
        "inventory-reserve-stock"
    }

    fn takes_batches(&self) -> bool {
        true
    }

    fn writes_events(&self) -> bool {
        true
    }

    fn serves_shards(&self) -> bool {
        true
    }

    async fn prepare(self, setup: Setup<'_>) -> anyhow::Result<NaturalKey> {
        let handler = NaturalKey::new(setup.db, setup.consumer);
        match setup.shard_partitions {
            None => Ok(handler),
            Some(partitions) => handler
                .on_shard(partitions)
                .context("--shard: a shard is a PostgreSQL database; this DATABASE_URL is SQLite"),
        }
    }
}

impl ServeArgs {
    /// The consumer runtime's settings from these flags, for `served`.
    pub fn runtime_settings(&self, backend: DbBackend, served: &impl Served) -> RuntimeSettings {
        let durable_name = self
            .consumer
            .as_deref()
            .unwrap_or(served.default_consumer());
        let defaults =
            RuntimeSettings::new(self.topology.topology(), durable_name, served.reads(), 1);
        RuntimeSettings {
            consumer: ConsumerSettings {
                ack_wait: self.ack_wait,
                backoff: self.backoff.clone(),
                max_ack_pending: self.max_ack_pending,
                ..defaults.consumer
            },
            concurrency: self.concurrency.unwrap_or(match backend {
                DbBackend::Sqlite => SQLITE_LANES,
                _ => usize::try_from(self.db_pool_size).unwrap_or(1),
            }),
            update_consumer: self.update_consumer,
            max_deliver: self.horizon.max_deliver,
            batch_size: if served.takes_batches() {
                usize::from(self.batch_size)
            } else {
                1
            },
            max_body_bytes: self.max_body_bytes,
            retry_delay: self.retry_delay,
            max_retry_delay: self.horizon.max_retry_delay,
            // SQLite has no network to go silent, and its writer is shared by the lanes: no
            // lane abandons its work there.
            work_timeout: match backend {
                DbBackend::Postgres => self.database.timeouts().work(),
                _ => None,
            },
            ..defaults
        }
    }
}

/// Reads what waits in the dead-letter stream for `consumer` every [`DEAD_LETTER_INTERVAL`] into
/// `metrics` until `stop`: what a dead letter's alarm stays on for until someone replays or
/// deletes it. Two requests a look, however many wait. A failed look keeps the last figures.
async fn watch_dead_letters(
    letters: jetstream::DeadLetterStream,
    consumer: String,
    replay_allowance: Duration,
    metrics: Metrics,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let mut ticks = Every::new(DEAD_LETTER_INTERVAL, stop);
    while ticks.tick().await {
        let Some(read) = ticks.unless_stopped(letters.waiting(&consumer)).await else {
            break;
        };
        match read {
            Ok(waiting) => {
                let oldest = waiting
                    .oldest_stored_at
                    .map_or(Duration::ZERO, |stored_at| {
                        let age = chrono::Utc::now().timestamp().saturating_sub(stored_at);
                        Duration::from_secs(u64::try_from(age).unwrap_or(0))
                    });
                metrics.record_dead_letters(
                    &consumer,
                    waiting.count,
                    oldest,
                    oldest > replay_allowance,
                );
            }
            Err(error) => tracing::debug!(%error, "reading the dead letters"),
        }
    }
    Ok(())
}

/// `inventory serve`: the natural key until a signal. Ok(true) when it drained cleanly.
pub async fn start(command: ServeCommand) -> anyhow::Result<bool> {
    let StrategyArg::Natural = command.strategy;
    start_with(command.args, NaturalKeyServed).await
}

/// The shard an instance serves: the stream's partitions and those assigned to it.
struct ServedShard {
    name: String,
    partitions: NonZeroU32,
    assigned: Vec<u32>,
    shards: jetstream::Shards,
}

/// What `--shard` and the stream say this `serve` runs. An unsharded `serve` on a sharded
/// stream would decide every partition's messages beside their shards (and recreate the
/// unsharded consumer `shard init` retired): once the assignment bucket exists it does not
/// start; nor does `--shard` on a stream that is not sharded, or one that owns no partition.
async fn shard_to_serve(
    js: &jetstream::Context,
    topology: &Topology,
    shard: Option<&str>,
) -> anyhow::Result<Option<ServedShard>> {
    let shards = jetstream::Shards::open(js, topology)
        .await
        .context("looking up whether the orders stream is sharded")?;
    let bucket = jetstream::shards_bucket(topology);
    let (name, shards) = match (shard, shards) {
        (None, None) => return Ok(None),
        (None, Some(_)) => anyhow::bail!(
            "stream {} is sharded (bucket {bucket} exists): an unsharded `inventory serve` would \
             decide every shard's partitions; run `inventory serve --shard NAME` for each shard \
             instead",
            topology.stream
        ),
        (Some(name), None) => anyhow::bail!(
            "--shard {name}: stream {} is not sharded (no bucket {bucket}); run `inventory \
             shard init` first",
            topology.stream
        ),
        (Some(name), Some(shards)) => (name, shards),
    };
    let assigned = shards.assignment().await?.partitions_of(name);
    if assigned.is_empty() {
        anyhow::bail!(
            "shard {name} owns no partition of stream {}: assign it some first (`inventory \
             shard assign --partitions A-B --to {name}`)",
            topology.stream
        );
    }
    Ok(Some(ServedShard {
        name: name.to_owned(),
        partitions: shards.partitions(),
        assigned,
        shards,
    }))
}

/// Ends once the partitions assigned to `shard` differ from those it serves, with an error
/// that says so: the process stops, for its supervisor to start it again on the new
/// assignment. A watch that fails (a missed heartbeat after a pause, NATS reconnecting) is
/// opened again, with a warning, rather than restarting the process: a new watch's first
/// assignment is the bucket's now, so a change made meanwhile is still seen, and the
/// database's ownership check decides in between.
async fn watch_assignment(shard: ServedShard, stop: CancellationToken) -> anyhow::Result<()> {
    use backon::Retryable as _;
    use futures::StreamExt as _;
    loop {
        let opened = (|| shard.shards.watch())
            .retry(WATCH_REOPENS)
            .notify(|error, _| tracing::warn!(%error, "watching the shard assignment"));
        let mut changes = tokio::select! {
            () = stop.cancelled() => return Ok(()),
            opened = opened => Box::pin(opened?),
        };
        let why = loop {
            let next = tokio::select! {
                () = stop.cancelled() => return Ok(()),
                next = changes.next() => next,
            };
            match next {
                Some(Ok(assignment)) => {
                    let now = assignment.partitions_of(&shard.name);
                    if now != shard.assigned {
                        anyhow::bail!(
                            "the partitions of shard {} changed from {:?} to {now:?}: restart to \
                             serve them",
                            shard.name,
                            shard.assigned
                        );
                    }
                }
                Some(Err(error)) => break error.to_string(),
                None => break "it ended".to_owned(),
            }
        };
        tracing::warn!(%why, "the watch of the shard assignment stopped; watching it again");
    }
}

/// How often a failed watch of the shard assignment is opened again: after 200 ms, doubling up
/// to 5 s, until it opens.
const WATCH_REOPENS: backon::ExponentialBuilder = backon::ExponentialBuilder::new()
    .with_min_delay(Duration::from_millis(200))
    .with_max_delay(Duration::from_secs(5))
    .without_max_times();

/// The settings of the consumer of `partition`, one of a shard's `assigned`: the strategy's
/// settings, its durable name suffixed, its filter the partition's.
fn partition_settings(
    base: &RuntimeSettings,
    shard: &ServedShard,
    partition: u32,
) -> RuntimeSettings {
    RuntimeSettings {
        consumer: ConsumerSettings {
            durable_name: jetstream::partition_consumer(
                &base.consumer.durable_name,
                partition,
                shard.partitions,
            ),
            filters: vec![jetstream::partition_filter(&base.topology, partition)],
            ..base.consumer.clone()
        },
        ..base.clone()
    }
}

/// The settings of a shard's consumer of what no partition takes: one lane, one at a time.
fn unroutable_settings(base: &RuntimeSettings) -> RuntimeSettings {
    RuntimeSettings {
        consumer: ConsumerSettings {
            durable_name: jetstream::unroutable_consumer(&base.consumer.durable_name),
            filters: jetstream::unroutable_filters(&base.topology),
            ..base.consumer.clone()
        },
        concurrency: 1,
        batch_size: 1,
        ..base.clone()
    }
}

/// The handler of what no partition of a sharded stream takes: an event that names no book,
/// which no shard can decide (docs/scaling.md).
#[derive(Clone)]
struct Unroutable;

impl MessageHandler for Unroutable {
    async fn handle(
        &self,
        message: &inventory_domain::Message,
    ) -> Result<Outcome, inventory_infra::HandleError> {
        Ok(Outcome::refused(
            DeadLetterReason::Unroutable,
            format!(
                "the stream is sharded by book and this {}'s subject names no book: publish \
                 an order's lines on their books' subjects",
                match message.event.kind() {
                    inventory_domain::EventKind::Cancelled => "cancellation",
                    _ => "placement",
                }
            ),
        ))
    }
}

/// What every consumer of one `serve` shares: where its metrics, failures and dead letters go,
/// and when it stops.
struct ServeContext<'a> {
    js: &'a jetstream::Context,
    args: &'a ServeArgs,
    metrics: &'a Metrics,
    liveness: &'a Liveness,
    shutdown: &'a Shutdown,
}

impl<'a> ServeContext<'a> {
    fn new(
        js: &'a jetstream::Context,
        args: &'a ServeArgs,
        metrics: &'a Metrics,
        liveness: &'a Liveness,
        shutdown: &'a Shutdown,
    ) -> Self {
        Self {
            js,
            args,
            metrics,
            liveness,
            shutdown,
        }
    }
}

/// Starts `lanes` lanes with `handler`, shared by `runtimes` (counted as `lanes_of`'s lanes),
/// with what runs beside each consumer: its metrics, its lag and its dead letters watched; a
/// lane that fails is reported to `/livez`.
fn start_consumers<H: MessageHandler>(
    runtimes: Vec<ConsumerRuntime>,
    (handler, label): (H, &'static str),
    (lanes, lanes_of): (usize, &str),
    context: &ServeContext<'_>,
    background: &mut Background,
) -> anyhow::Result<Running> {
    let mut consumers = Vec::with_capacity(runtimes.len());
    for mut runtime in runtimes {
        runtime.report_failures_to(context.liveness.clone());
        let consumer = runtime.settings().consumer.durable_name.clone();
        tracing::info!(
            handler = label,
            consumer = %consumer,
            stream = %runtime.settings().topology.stream,
            "consuming"
        );
        let metrics = context.metrics.consumer(&consumer);
        context
            .metrics
            .max_ack_pending(&consumer, runtime.server_consumer().max_ack_pending);
        background.spawn(
            "lag-watcher",
            runtime.report_lag(
                metrics.clone(),
                LAG_INTERVAL,
                context.shutdown.graceful.clone(),
            ),
        );
        background.spawn(
            "dead-letters-watcher",
            watch_dead_letters(
                jetstream::DeadLetterStream::new(
                    context.js.clone(),
                    context.args.topology.topology(),
                ),
                consumer,
                context.args.horizon.replay_allowance,
                context.metrics.clone(),
                context.shutdown.graceful.clone(),
            ),
        );
        consumers.push((runtime, metrics));
    }
    context.metrics.lanes(lanes_of, lanes);
    tracing::info!(lanes, consumers = consumers.len(), "starting the lanes");
    let mut consumers = consumers.into_iter();
    let (first, metrics) = consumers.next().context("no consumer to start")?;
    Ok(first.start_sharing(
        metrics,
        consumers.collect(),
        handler,
        lanes,
        context.shutdown.clone(),
    ))
}

/// `serve` running `served`: wiring, then the runtime until a signal. Ok(true) when it drained
/// cleanly.
pub async fn start_with<S: Served>(args: ServeArgs, served: S) -> anyhow::Result<bool> {
    let shutdown = Shutdown::on_signals(args.stop.shutdown_timeout)?;
    // The health server, the relay, the purge and the watchers; the purge and the watchers stop
    // with the first signal (the purge must not hold the database while the lanes drain), the
    // relay and the health server after the lanes.
    let mut background = Background::new(&shutdown);
    // The health endpoints are up before the set-up: /livez answers at once, /readyz says
    // "starting" until the database, NATS and the relay are set up.
    let (metrics, liveness, readiness) =
        (Metrics::new()?, Liveness::default(), Readiness::default());
    if let MetricsAddr(Some(addr)) = args.metrics.metrics_addr {
        let stuck_after = args.database.timeouts().work().unwrap_or(args.ack_wait) + STUCK_MARGIN;
        let health = (metrics.clone(), liveness.clone(), readiness.clone());
        let (_, server) = health::serve(
            addr,
            health.0,
            health.1,
            health.2,
            stuck_after,
            background.after_main(),
        )
        .await?;
        background.spawn("health", server);
    }

    args.database.url.warn_if_implicit();
    let db = db::open(
        args.database.url(),
        args.db_pool_size,
        args.database.schema(),
        args.database.timeouts(),
    )
    .await
    .with_context(|| {
        format!(
            "opening the database at {}",
            redact_url(args.database.url())
        )
    })?;
    let client = args.nats.connect("inventory serve").await?;
    let js = jetstream::context(client.clone());
    let topology = args.topology.topology();
    let shard = shard_to_serve(&js, &topology, args.shard.as_deref()).await?;
    if shard.is_some() && !served.serves_shards() {
        anyhow::bail!(
            "--shard: the {} handler does not run on a shard; only the natural key does",
            served.label()
        );
    }
    let settings = args.runtime_settings(db.get_database_backend(), &served);
    let consumer = ConsumerName::parse(settings.consumer.durable_name.clone())?;
    // The strategy's one consumer; on a shard, one per partition assigned to it (the
    // strategy's own consumer is the one `shard init` retired), then the unroutable one.
    let mut runtimes = Vec::new();
    match &shard {
        None => runtimes.push(ConsumerRuntime::prepare(&js, db.clone(), settings.clone()).await?),
        Some(shard) => {
            for partition in &shard.assigned {
                let settings = partition_settings(&settings, shard, *partition);
                runtimes.push(ConsumerRuntime::prepare(&js, db.clone(), settings).await?);
            }
        }
    }
    let unroutable = match &shard {
        None => None,
        Some(_) => {
            Some(ConsumerRuntime::prepare(&js, db.clone(), unroutable_settings(&settings)).await?)
        }
    };

    let label = served.label();
    let writes_events = served.writes_events();
    let handler = served
        .prepare(Setup {
            args: &args,
            db: &db,
            runtime: &runtimes[0],
            consumer,
            shard_partitions: shard.as_ref().map(|shard| shard.partitions),
            metrics: &metrics,
            background: &mut background,
        })
        .await?;
    // A handler that writes an event per decision into the outbox has its relay here, woken
    // by the lanes after each commit that wrote one. Set up after the handler, so a refused
    // start (the study's retention guard) leaves no heartbeat behind. A shard's database has
    // its own outbox, and its relay is this one.
    let relay = if writes_events {
        let relay = crate::relay::prepare(
            &js,
            db.clone(),
            OutboxSource::inventory(&topology),
            &topology.events_stream(),
            RelaySettings {
                db_timeout: args.database.timeouts().work(),
                ..args.relay.settings()
            },
        )
        .await?;
        for runtime in &mut runtimes {
            runtime.wake_relay_on_events(relay.wake());
        }
        metrics.watch_relay(relay.status(), args.relay.relay_unhealthy_after)?;
        Some(relay)
    } else {
        None
    };
    if let Some(relay) = relay {
        crate::relay::spawn(relay, &mut background);
    }
    let context = ServeContext::new(&js, &args, &metrics, &liveness, &shutdown);
    // The instance's lanes, shared by its consumers: one, or each partition's of a shard.
    let mut running = vec![start_consumers(
        runtimes,
        (handler, label),
        (settings.concurrency, &settings.consumer.durable_name),
        &context,
        &mut background,
    )?];
    if let Some(runtime) = unroutable {
        let name = runtime.settings().consumer.durable_name.clone();
        running.push(start_consumers(
            vec![runtime],
            (Unroutable, "unroutable"),
            (1, &name),
            &context,
            &mut background,
        )?);
    }
    if let Some(shard) = shard {
        tracing::info!(shard = %shard.name, partitions = ?shard.assigned, "serving a shard");
        let stop = background.graceful();
        background.spawn("shard-watcher", watch_assignment(shard, stop));
    }
    readiness.ready(client.clone(), &db);
    // The relay and the background tasks must run as long as the lanes: one that ends stops
    // them, and the process. After the lanes, the relay's last pass publishes what their last
    // messages committed; then the acks of the last messages are flushed.
    let all_ended = async {
        let mut ending = Ending::Drained;
        for running in running {
            if running.wait().await? == Ending::Abandoned {
                ending = Ending::Abandoned;
            }
        }
        anyhow::Ok(ending)
    };
    let finished = background
        .finish(all_ended, &client, &metrics, &liveness)
        .await;
    let lanes_ended = finished.main?;
    if !finished.failures.is_empty() {
        anyhow::bail!("{}", finished.failures.join("; "));
    }
    if lanes_ended == Ending::Abandoned {
        eprintln!(
            "error: stopped before in-flight messages finished; they were not acked and will be \
             redelivered"
        );
        return Ok(false);
    }
    if finished.abandoned.contains(&RELAY) {
        eprintln!(
            "error: the outbox relay was stopped at once; its rows published and not yet removed \
             will be republished by the next relay (the stream drops them as duplicates)"
        );
        return Ok(false);
    }
    if !finished.drained {
        eprintln!(
            "error: the NATS connection did not drain before the shutdown timeout; messages whose \
             acks were not sent will be redelivered"
        );
        return Ok(false);
    }
    tracing::info!("drained; bye");
    Ok(true)
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;
    use inventory_infra::db::DbBackend;

    use super::NaturalKeyServed;
    use crate::cli::{Cli, Command};

    /// `(lanes, batch size)` the flags come to on `backend`.
    fn shape(flags: &[&str], backend: DbBackend) -> (usize, usize) {
        let args = ["inventory", "serve", "--strategy", "natural"];
        let serve = match Cli::try_parse_from(args.iter().chain(flags)).map(|cli| cli.command) {
            Ok(Command::Serve(serve)) => serve.args,
            other => panic!("not serve: {other:?}"),
        };
        let settings = serve.runtime_settings(backend, &NaturalKeyServed);
        (settings.concurrency, settings.batch_size)
    }

    #[test]
    fn the_natural_key_is_served_in_batches_on_both_backends() {
        assert_eq!(shape(&[], DbBackend::Sqlite), (2, 64));
        assert_eq!(shape(&["--batch-size", "1"], DbBackend::Sqlite), (2, 1));
        assert_eq!(shape(&["--concurrency", "10"], DbBackend::Sqlite), (10, 64));
        // PostgreSQL: a lane per pooled connection, batches of 64 too.
        assert_eq!(shape(&[], DbBackend::Postgres), (10, 64));
        assert_eq!(shape(&["--batch-size", "1"], DbBackend::Postgres), (10, 1));
    }
}
