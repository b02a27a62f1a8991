//! The outbox relay in the service: `inventory relay` on its own, the relay `serve --strategy
//! natural` runs beside its lanes, and `inventory outbox parked|retry` for the rows it set
//! aside. The relay itself is infra's [`Relay`]; this module turns flags into its settings,
//! starts and stops it, and prints.

use std::io::Write as _;
use std::time::Duration;

use anyhow::Context as _;
use inventory_infra::db::{self, DatabaseConnection};
use inventory_infra::jetstream::{self, Context, PrefixStream, Topology};
use inventory_infra::outbox::{OutboxSource, ParkedRow, Relay, RelaySettings, Retry};
use inventory_infra::redact::redact_url;

use crate::args::{
    MetricsAddr, MetricsArgs, NatsArgs, OrdersDatabaseArgs, StopArgs, TopologyArgs, shown,
};
use crate::health::{Liveness, Readiness};
use crate::metrics::Metrics;
use crate::shutdown::{Background, Shutdown};

/// Which outbox a command works on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SourceArg {
    /// Inventory's events (`outbox` in DATABASE_URL) to the events stream.
    Inventory,
    /// The orders producer's events (`orders_outbox` in ORDERS_DATABASE_URL) to the orders
    /// stream.
    Orders,
}

impl SourceArg {
    /// The table, stream and subject prefix of this outbox under `topology`, and the stream
    /// as the relay creates it if absent.
    pub fn source(self, topology: &Topology) -> (OutboxSource, PrefixStream) {
        match self {
            Self::Inventory => (OutboxSource::inventory(topology), topology.events_stream()),
            Self::Orders => (OutboxSource::orders(topology), topology.orders_stream()),
        }
    }
}

/// The database that holds `source`'s outbox: the orders database for `orders`.
pub fn database_url(source: SourceArg, databases: &OrdersDatabaseArgs) -> &str {
    match source {
        SourceArg::Inventory => databases.database.url(),
        SourceArg::Orders => databases.url(),
    }
}

/// How the relay runs; shared by `relay` and `serve`.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Outbox relay")]
pub struct RelayArgs {
    /// How long a relay's lease on a partition of the outbox lasts without renewal; renewed
    /// every fifth of it. A relay that dies leaves its partitions to the others after this.
    /// With the publish timeout, at most a quarter of the stream's duplicate window.
    #[arg(long, default_value = shown(RelaySettings::default().lease), value_parser = humantime::parse_duration)]
    pub relay_lease: Duration,
    /// The backup poll for rows the relay was not woken for (another process wrote them).
    #[arg(long, default_value = shown(RelaySettings::default().poll_interval), value_parser = humantime::parse_duration)]
    pub relay_poll_interval: Duration,
    /// Outbox rows read per pass.
    #[arg(long, default_value_t = RelaySettings::default().batch_size)]
    pub relay_batch_size: usize,
    /// Orders with a publish in flight at once (one publish per order at a time).
    #[arg(long, default_value_t = RelaySettings::default().max_in_flight)]
    pub relay_max_in_flight: usize,
    /// How long a publish waits for its PubAck.
    #[arg(long, default_value = shown(RelaySettings::default().publish_timeout), value_parser = humantime::parse_duration)]
    pub relay_publish_timeout: Duration,
    /// Delay after a failed pass (broker unreachable); doubles per failed pass.
    #[arg(long, default_value = shown(RelaySettings::default().retry_delay), value_parser = humantime::parse_duration)]
    pub relay_retry_delay: Duration,
    /// Longest delay between failed passes.
    #[arg(long, default_value = shown(RelaySettings::default().max_retry_delay), value_parser = humantime::parse_duration)]
    pub relay_max_retry_delay: Duration,
    /// /readyz reports the relay "failing" (503) once it has failed this long to publish rows
    /// that wait.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub relay_unhealthy_after: Duration,
}

impl RelayArgs {
    pub fn settings(&self) -> RelaySettings {
        RelaySettings {
            lease: self.relay_lease,
            poll_interval: self.relay_poll_interval,
            batch_size: self.relay_batch_size.max(1),
            max_in_flight: self.relay_max_in_flight.max(1),
            publish_timeout: self.relay_publish_timeout,
            retry_delay: self.relay_retry_delay,
            max_retry_delay: self.relay_max_retry_delay,
            ..RelaySettings::default()
        }
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct RelayCommandArgs {
    /// The outbox to publish.
    #[arg(long, value_enum, default_value = "inventory")]
    pub source: SourceArg,
    /// Prints the settings in effect, each with where it came from (default, file, environment,
    /// command line) and secrets masked, then exits.
    #[arg(long)]
    pub print_config: bool,
    /// `DATABASE_URL` for `inventory`, `ORDERS_DATABASE_URL` (by default the same) for
    /// `orders`.
    #[command(flatten)]
    pub databases: OrdersDatabaseArgs,
    /// Database connections in the pool.
    #[arg(long, default_value_t = 4, help_heading = "Database")]
    pub db_pool_size: u32,
    #[command(flatten)]
    pub nats: NatsArgs,
    #[command(flatten)]
    pub topology: TopologyArgs,
    #[command(flatten)]
    pub relay: RelayArgs,
    #[command(flatten)]
    pub metrics: MetricsArgs,
    #[command(flatten)]
    pub stop: StopArgs,
}

/// Sets the relay up: its stream created if absent (differences of an existing one logged),
/// the lease checked against the stream's duplicate window, its heartbeat registered.
pub async fn prepare(
    js: &Context,
    db: DatabaseConnection,
    source: OutboxSource,
    stream: &PrefixStream,
    settings: RelaySettings,
) -> anyhow::Result<Relay> {
    let (relay, drifts) = Relay::prepare(js, db, source, stream, settings).await?;
    for drift in drifts {
        tracing::warn!("{drift}");
    }
    Ok(relay)
}

/// What the logs and `inventory_task_failures_total` call the relay's task.
pub(crate) const RELAY: &str = "relay";

/// Runs `relay` in a task of `background` until the main work ends: the pass in flight
/// finishes, one last pass publishes what was just committed, and its partitions are given
/// back. Aborted instead (an immediate stop), it leaves published rows that were not yet
/// removed for the next relay to republish (the stream drops them as duplicates).
pub(crate) fn spawn(relay: Relay, background: &mut Background) {
    tracing::info!(
        outbox = relay.source().table(),
        stream = relay.source().stream(),
        holder = relay.holder(),
        "relaying the outbox"
    );
    let stop = background.after_main();
    background.spawn(RELAY, async move {
        relay.run(stop).await;
        Ok(())
    });
}

/// `inventory relay`: publishes the outbox until SIGINT or SIGTERM. Ok(true) when it stopped
/// cleanly.
pub async fn run(args: RelayCommandArgs) -> anyhow::Result<bool> {
    let shutdown = Shutdown::on_signals(args.stop.shutdown_timeout)?;
    let mut background = Background::new(&shutdown);
    let (metrics, liveness, readiness) =
        (Metrics::new()?, Liveness::default(), Readiness::default());
    if let MetricsAddr(Some(addr)) = args.metrics.metrics_addr {
        // Up before the set-up. Nothing is in flight here, so nothing is ever stuck.
        let health = (metrics.clone(), liveness.clone(), readiness.clone());
        let (_, server) = crate::health::serve(
            addr,
            health.0,
            health.1,
            health.2,
            Duration::MAX,
            background.after_main(),
        )
        .await?;
        background.spawn("health", server);
    }
    if args.source == SourceArg::Inventory || args.databases.orders_database_url.is_none() {
        args.databases.database.url.warn_if_implicit();
    }
    let url = database_url(args.source, &args.databases);
    let db = db::open(
        url,
        args.db_pool_size,
        args.databases.database.schema(),
        args.databases.database.timeouts(),
    )
    .await
    .with_context(|| format!("opening the database at {}", redact_url(url)))?;
    let client = args.nats.connect("inventory relay").await?;
    let js = jetstream::context(client.clone());
    let (source, stream) = args.source.source(&args.topology.topology());
    let settings = RelaySettings {
        db_timeout: args.databases.database.timeouts().work(),
        ..args.relay.settings()
    };
    let relay = prepare(&js, db.clone(), source, &stream, settings).await?;
    metrics.watch_relay(relay.status(), args.relay.relay_unhealthy_after)?;
    readiness.ready(client.clone(), &db);
    spawn(relay, &mut background);
    // The relay's own work is its task: the main work here is only waiting for the signal.
    let finished = background
        .finish(shutdown.graceful.cancelled(), &client, &metrics, &liveness)
        .await;
    if !finished.failures.is_empty() {
        anyhow::bail!("{}", finished.failures.join("; "));
    }
    if finished.abandoned.contains(&RELAY) || !finished.drained {
        eprintln!(
            "error: stopped at once; rows published and not yet removed will be republished by \
             the next relay (the stream drops them as duplicates)"
        );
        return Ok(false);
    }
    tracing::info!("relay stopped; bye");
    Ok(true)
}

/// `inventory outbox …`
#[derive(Debug, clap::Subcommand)]
pub enum OutboxCommand {
    /// Lists the rows the relay parked (too large, no stream for their subject) with their
    /// reasons; their orders' later rows wait behind them.
    Parked {
        /// Prints JSON instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        target: OutboxTarget,
    },
    /// Puts parked rows back in line: the relay tries them on its next pass, before their
    /// orders' later rows. A row that still cannot be published is parked again.
    Retry {
        /// The row's seq, as `outbox parked` shows it; repeatable.
        #[arg(long, required_unless_present = "all", conflicts_with = "all")]
        seq: Vec<i64>,
        /// Every parked row.
        #[arg(long)]
        all: bool,
        #[command(flatten)]
        target: OutboxTarget,
    },
}

/// Which outbox, in which database.
#[derive(Debug, Clone, clap::Args)]
pub struct OutboxTarget {
    #[arg(long, value_enum, default_value = "inventory")]
    pub source: SourceArg,
    #[command(flatten)]
    pub databases: OrdersDatabaseArgs,
}

impl OutboxTarget {
    async fn open(&self) -> anyhow::Result<(DatabaseConnection, OutboxSource)> {
        let url = database_url(self.source, &self.databases);
        let conn = db::open(
            url,
            2,
            self.databases.database.schema(),
            self.databases.database.timeouts(),
        )
        .await
        .with_context(|| format!("opening the database at {}", redact_url(url)))?;
        // Only the table matters here; the stream names do not.
        let (source, _) = self.source.source(&Topology::default());
        Ok((conn, source))
    }
}

pub async fn run_outbox(command: OutboxCommand) -> anyhow::Result<()> {
    match command {
        OutboxCommand::Parked { json, target } => {
            let (conn, source) = target.open().await?;
            let rows = source.parked(&conn).await?;
            let mut out = std::io::stdout().lock();
            if json {
                serde_json::to_writer_pretty(&mut out, &rows)?;
                writeln!(out)?;
            } else {
                print_parked(&mut out, &rows)?;
            }
        }
        OutboxCommand::Retry { seq, all, target } => {
            let (conn, source) = target.open().await?;
            let which = if all {
                Retry::All
            } else {
                Retry::Seqs(seq.clone())
            };
            let released = source.retry(&conn, &which).await?;
            for row in &released {
                println!("outbox row {row} back in line");
            }
            let missing: Vec<i64> = seq
                .iter()
                .copied()
                .filter(|wanted| !released.contains(wanted))
                .collect();
            if !all && !missing.is_empty() {
                anyhow::bail!("no parked outbox row with seq {missing:?}");
            }
            if released.is_empty() {
                println!("no parked row");
            }
        }
    }
    Ok(())
}

fn print_parked(out: &mut impl std::io::Write, rows: &[ParkedRow]) -> std::io::Result<()> {
    writeln!(
        out,
        "{:>8}  {:<36}  {:<36}  {:<20}  {:>9}  {:>5}  reason",
        "seq", "event_id", "order_id", "subject", "chars", "age"
    )?;
    let now = chrono::Utc::now();
    for row in rows {
        let age = (now - row.parked_at).num_seconds();
        writeln!(
            out,
            "{:>8}  {:<36}  {:<36}  {:<20}  {:>9}  {:>5}  {}",
            row.seq,
            row.event_id,
            row.order_id,
            row.subject,
            row.payload_chars,
            crate::dlq::short_age(age),
            row.parked_reason.as_deref().unwrap_or("")
        )?;
    }
    Ok(())
}
