//! The inbox's retention: its completed rows are purged once no copy of their message can come
//! any more, past the redelivery horizon ([`horizon`], from the service's flags). The study's
//! `serve` purges in the background and
//! refuses a retention shorter than the horizon; `inventory inbox purge` purges by hand. The
//! natural key keeps no inbox rows: its rows are the business record.

use std::time::Duration;

use anyhow::{Context as _, Result};
use humantime::format_duration;
use inventory_infra::db::{self, DatabaseConnection};
use inventory_infra::delivery::ConsumerConfig;
use inventory_infra::jetstream;
use inventory_infra::periodic::Every;
use inventory_service::args::{DatabaseArgs, NatsArgs, TopologyArgs};
use inventory_service::cli::COMMAND_POOL;
use inventory_service::consumer::policy::RetryPolicy;
use inventory_service::metrics::Metrics;
use inventory_service::retention::HorizonArgs;
use prometheus::{IntCounter, IntGaugeVec, Opts};
use tokio_util::sync::CancellationToken;

use crate::horizon::{FirstDelivery, Horizon, RedeliveryPolicy, RetentionTooShort};
use crate::purge::{self, PurgeReport, purge_completed};

/// Rows per purge batch, each batch one short transaction: `serve`'s background purge and
/// `inbox purge` alike.
pub const PURGE_BATCH_SIZE: u64 = 1_000;

/// How the background purge runs.
#[derive(Debug, Clone, Copy)]
pub struct PurgeSettings {
    /// Completed rows older than this are deleted.
    pub retention: Duration,
    /// Time between purges.
    pub interval: Duration,
    pub batch_size: u64,
}

/// The flags a refusal names: the retention's and the one that overrides the refusal.
#[derive(Debug, Clone, Copy)]
pub struct GuardFlags {
    pub retention: &'static str,
    pub overriding: &'static str,
}

/// `serve`'s: its background purge's retention.
pub const SERVE_FLAGS: GuardFlags = GuardFlags {
    retention: "--inbox-retention",
    overriding: "--accept-short-retention",
};

/// `inbox purge`'s.
pub const PURGE_FLAGS: GuardFlags = GuardFlags {
    retention: "--older-than",
    overriding: "--force",
};

/// The horizon of `consumer` as the server has it and its stream (`duplicate_window`,
/// `max_age`, zero for none), with the consuming service's cap, retry and allowances.
pub fn horizon(
    consumer: &ConsumerConfig,
    duplicate_window: Duration,
    max_age: Duration,
    settings: &HorizonArgs,
) -> Horizon {
    Horizon::new(
        &RedeliveryPolicy {
            ack_wait: consumer.ack_wait,
            backoff: consumer.backoff.clone(),
            max_deliver: RetryPolicy::effective_cap(settings.max_deliver, consumer.max_deliver),
            longest_nak_delay: settings.max_retry_delay,
        },
        duplicate_window,
        FirstDelivery::new(max_age, settings.lag_allowance),
        settings.replay_allowance,
    )
}

/// The guard's answer to a retention shorter than the horizon, naming both durations.
pub fn refusal_message(
    consumer: &str,
    horizon: &Horizon,
    refusal: RetentionTooShort,
    flags: GuardFlags,
) -> String {
    let retention = format_duration(refusal.retention);
    let GuardFlags {
        retention: flag,
        overriding,
    } = flags;
    match (refusal.horizon, horizon.redelivery) {
        (Some(total), Some(redelivery)) => format!(
            "{flag} {retention} is shorter than the redelivery horizon {} of consumer \
             {consumer} (redeliveries {}, duplicate window {}, {}, replay allowance {}): a copy \
             arriving later would find its inbox row purged and be applied twice. Raise \
             {flag} to at least {}, or pass {overriding}",
            format_duration(total),
            format_duration(redelivery),
            format_duration(horizon.duplicate_window),
            first_delivery(horizon.first_delivery),
            format_duration(horizon.replay_allowance),
            format_duration(total),
        ),
        _ => format!(
            "{flag} {retention} is shorter than the redelivery horizon of consumer \
             {consumer}, which is unbounded: --max-deliver is unlimited, so a message may be \
             delivered again at any time. Set --max-deliver, or pass \
             {overriding}"
        ),
    }
}

/// Checks `retention` against the horizon: an error, or with `accept_short` a warning.
pub fn guard(
    consumer: &str,
    horizon: &Horizon,
    retention: Duration,
    accept_short: bool,
) -> anyhow::Result<()> {
    match horizon.check(retention) {
        Ok(()) => {
            tracing::info!(
                retention = %format_duration(retention),
                horizon = %horizon.total().map(format_duration).map_or_else(|| "unbounded".into(), |h| h.to_string()),
                "inbox retention covers the redelivery horizon"
            );
            Ok(())
        }
        Err(refusal) if accept_short => {
            tracing::warn!(
                "{}; going on as --accept-short-retention says",
                refusal_message(consumer, horizon, refusal, SERVE_FLAGS)
            );
            Ok(())
        }
        Err(refusal) => Err(anyhow::anyhow!(refusal_message(
            consumer,
            horizon,
            refusal,
            SERVE_FLAGS
        ))),
    }
}

/// A purge of `consumer`'s rows now and then every `interval` until `stop`, for the caller to
/// spawn (only its own: the guard checked the retention against its horizon alone); each
/// purge's counts are logged, and rows still "processing" older than the retention are reported
/// at warn. A purge cut short by `stop` rolls back only its current batch.
pub fn purge_every(
    db: DatabaseConnection,
    consumer: String,
    settings: PurgeSettings,
    metrics: Option<PurgeMetrics>,
    stop: CancellationToken,
) -> anyhow::Result<impl Future<Output = anyhow::Result<()>> + Send + 'static> {
    let retention =
        chrono::Duration::from_std(settings.retention).context("--inbox-retention is too large")?;
    Ok(async move {
        let mut ticks = Every::new(settings.interval, stop);
        while ticks.tick().await {
            let cutoff = chrono::Utc::now() - retention;
            let started = std::time::Instant::now();
            let batch = settings.batch_size.max(1);
            let purge = purge_completed(&db, &consumer, cutoff, batch, false);
            let Some(purged) = ticks.unless_stopped(purge).await else {
                break;
            };
            match purged {
                Ok(report) if report.skipped_locked => {
                    tracing::info!("inbox purge: another instance is purging; skipped");
                }
                Ok(report) => {
                    // An empty purge every interval is not news.
                    if report.deleted > 0 {
                        tracing::info!(
                            deleted = report.deleted,
                            batches = report.batches,
                            took = ?started.elapsed(),
                            "inbox purge"
                        );
                    } else {
                        tracing::debug!("inbox purge: nothing older than the retention");
                    }
                    if report.processing_older > 0 {
                        tracing::warn!(
                            rows = report.processing_older,
                            older_than = %format_duration(settings.retention),
                            "inbox rows still processing past the retention: kept; reconcile them"
                        );
                    }
                    if let Some(metrics) = &metrics {
                        metrics.record(&consumer, Some((report.deleted, report.processing_older)));
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "inbox purge failed; trying again next time");
                    if let Some(metrics) = &metrics {
                        metrics.record(&consumer, None);
                    }
                }
            }
        }
        Ok(())
    })
}

fn first_delivery(first: FirstDelivery) -> String {
    match first {
        FirstDelivery::MaxAge(wait) => format!("max_age {}", format_duration(wait)),
        FirstDelivery::LagAllowance(wait) => format!("lag allowance {}", format_duration(wait)),
    }
}

/// The purge's series, registered among `serve`'s metrics.
#[derive(Clone)]
pub struct PurgeMetrics {
    purged: IntCounter,
    processing_older: IntGaugeVec,
    failing: IntGaugeVec,
}

impl PurgeMetrics {
    /// The series, registered into `metrics`, each of `consumer` at 0 from here on.
    pub fn register(metrics: &Metrics, consumer: &str) -> Result<Self, prometheus::Error> {
        let purged = IntCounter::new(
            "inventory_inbox_rows_purged_total",
            "Completed inbox rows deleted by the retention purge.",
        )?;
        let processing_older = IntGaugeVec::new(
            Opts::new(
                "inventory_inbox_processing_older_than_retention",
                "Inbox rows still \"processing\" older than the retention at the last purge: \
                 kept, to be reconciled.",
            ),
            &["consumer"],
        )?;
        let failing = IntGaugeVec::new(
            Opts::new(
                "inventory_inbox_purge_failing",
                "1 when the last background purge of the consumer's inbox rows failed, else 0.",
            ),
            &["consumer"],
        )?;
        metrics.register([
            Box::new(purged.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(processing_older.clone()),
            Box::new(failing.clone()),
        ])?;
        processing_older.with_label_values(&[consumer]);
        failing.with_label_values(&[consumer]);
        Ok(Self {
            purged,
            processing_older,
            failing,
        })
    }

    /// After each purge of `consumer`'s rows: what it did, or that it failed.
    fn record(&self, consumer: &str, purged: Option<(u64, u64)>) {
        let labels = [consumer];
        self.failing
            .with_label_values(&labels)
            .set(i64::from(purged.is_none()));
        if let Some((deleted, processing_older)) = purged {
            self.purged.inc_by(deleted);
            self.processing_older
                .with_label_values(&labels)
                .set(i64::try_from(processing_older).unwrap_or(i64::MAX));
        }
    }
}

#[derive(Debug, clap::Subcommand)]
pub enum InboxCommand {
    /// Deletes completed inbox rows older than DURATION, in bounded batches, consumer by
    /// consumer, each only once DURATION covers that consumer's redelivery horizon (read from
    /// the server, as serve does). Rows still "processing" are kept and counted.
    Purge(Box<PurgeArgs>),
}

#[derive(Debug, clap::Args)]
pub struct PurgeArgs {
    /// Age of the rows to delete, by their completion time (e.g. 7d, 36h).
    #[arg(long, value_parser = humantime::parse_duration)]
    older_than: std::time::Duration,
    /// Only this consumer's rows (repeatable); by default every consumer that has rows.
    #[arg(long)]
    consumer: Vec<String>,
    /// Purges without looking up the consumers' horizons (no NATS needed): for an operator
    /// who knows no copy of these messages can come any more.
    #[arg(long)]
    force: bool,
    /// The settings of the horizon: give `inbox purge` the service's (its configuration file,
    /// its environment) so that both check the same horizon.
    #[command(flatten)]
    horizon: HorizonArgs,
    /// Rows per batch; each batch is one short transaction.
    #[arg(long, alias = "batch-size", default_value_t = PURGE_BATCH_SIZE)]
    purge_batch_size: u64,
    /// Counts what would be deleted, deletes nothing.
    #[arg(long)]
    dry_run: bool,
    #[command(flatten)]
    database: DatabaseArgs,
    #[command(flatten)]
    nats: NatsArgs,
    #[command(flatten)]
    topology: TopologyArgs,
}

/// `inventory inbox purge`: each consumer's rows, each after its horizon check (unless
/// `--force`), one line for the whole and one per consumer.
pub async fn purge_inbox(args: PurgeArgs) -> Result<()> {
    let conn = db::open(
        args.database.url(),
        COMMAND_POOL,
        args.database.schema(),
        args.database.timeouts(),
    )
    .await
    .context("opening the database")?;
    let consumers = if args.consumer.is_empty() {
        purge::inbox_consumers(&conn).await?
    } else {
        args.consumer.clone()
    };
    if !args.force && !consumers.is_empty() {
        let client = args.nats.connect("inventory inbox purge").await?;
        let js = jetstream::context(client);
        let topology = args.topology.topology();
        // The stock consumers read the orders, the email notifier Inventory's events.
        let streams = [topology.stream.clone(), topology.events_stream.clone()];
        for consumer in &consumers {
            let (config, stream) = jetstream::find_consumer(&js, &streams, consumer)
                .await?
                .with_context(|| {
                    format!(
                        "consumer {consumer} is on neither {} nor {}, so its redelivery horizon \
                         is unknown: name the streams (--stream, --events-stream), or pass \
                         --force",
                        streams[0], streams[1]
                    )
                })?;
            let horizon = horizon(
                &config,
                stream.duplicate_window,
                stream.max_age,
                &args.horizon,
            );
            if let Err(refusal) = horizon.check(args.older_than) {
                anyhow::bail!(refusal_message(consumer, &horizon, refusal, PURGE_FLAGS));
            }
        }
    }
    let cutoff = chrono::Utc::now()
        - chrono::Duration::from_std(args.older_than).context("--older-than is too large")?;
    let mut reports = Vec::with_capacity(consumers.len());
    for consumer in &consumers {
        let report = purge_completed(
            &conn,
            consumer,
            cutoff,
            args.purge_batch_size.max(1),
            args.dry_run,
        )
        .await?;
        reports.push((consumer, report));
    }
    let sum = |count: fn(&PurgeReport) -> u64| {
        reports.iter().map(|(_, report)| count(report)).sum::<u64>()
    };
    let verb = if args.dry_run {
        "would delete"
    } else {
        "deleted"
    };
    println!(
        "{verb} {} completed inbox rows older than {} in {} batches; {} rows still processing are older and were kept",
        sum(|report| report.deleted),
        humantime::format_duration(args.older_than),
        sum(|report| report.batches),
        sum(|report| report.processing_older)
    );
    for (consumer, report) in &reports {
        println!(
            "  {consumer}: {verb} {}, {} still processing",
            report.deleted, report.processing_older
        );
        if report.skipped_locked {
            println!("  {consumer}: another instance is purging: nothing done");
        }
    }
    Ok(())
}
