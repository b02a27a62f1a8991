//! Retention in `inventory serve`: the guard that refuses a retention shorter than the
//! redelivery horizon, and the background purge of completed inbox rows.

use std::time::Duration;

use anyhow::Context as _;
use humantime::format_duration;
use inventory_domain::{FirstDelivery, Horizon, RedeliveryPolicy, RetentionTooShort};
use inventory_infra::db::DatabaseConnection;
use inventory_infra::delivery::ConsumerConfig;
use inventory_infra::retention::purge_completed;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::args::shown;
use crate::metrics::Metrics;
use crate::policy::RetryPolicy;
use crate::runtime::RuntimeSettings;

/// What the redelivery horizon takes beside the server's settings: shared by `serve` and
/// `inbox purge`, so that both check the same horizon from the same settings (one file, the
/// same environment).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Retention and the redelivery horizon")]
pub struct HorizonArgs {
    /// Deliveries of one message this service handles: the last failing is a max-deliveries
    /// dead letter, a later one is dead-lettered unhandled; -1 for unlimited. The consumer it
    /// creates has no cap of its own, so the server never drops a message; an existing
    /// consumer's lower cap lowers this one. Part of the horizon.
    #[arg(long, default_value_t = RuntimeSettings::MAX_DELIVER, allow_negative_numbers = true, help_heading = "Consumer")]
    pub max_deliver: i64,
    /// The longest delay between retries of a message that failed transiently (serve's nak
    /// delay doubles per delivery up to this); part of the horizon.
    #[arg(long, default_value = shown(RuntimeSettings::MAX_RETRY_DELAY), value_parser = humantime::parse_duration)]
    pub max_retry_delay: Duration,
    /// How long after a dead letter operators may still replay it; part of the horizon.
    #[arg(long, default_value = crate::args::REPLAY_ALLOWANCE, value_parser = humantime::parse_duration)]
    pub replay_allowance: Duration,
    /// How far the consumer may fall behind its stream, when the stream has no max_age: a copy
    /// stored meanwhile waits that long for its first delivery. Part of the horizon; a stream's
    /// max_age takes its place.
    #[arg(long, default_value = "1day", value_parser = humantime::parse_duration)]
    pub lag_allowance: Duration,
}

/// Rows per purge batch, each batch one short transaction: `serve`'s background purge and
/// `inbox purge` alike.
pub const PURGE_BATCH_SIZE: u64 = 1_000;

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

fn first_delivery(first: FirstDelivery) -> String {
    match first {
        FirstDelivery::MaxAge(wait) => format!("max_age {}", format_duration(wait)),
        FirstDelivery::LagAllowance(wait) => format!("lag allowance {}", format_duration(wait)),
    }
}

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

/// Runs a purge of `consumer`'s rows now and then every `interval` until `stop` (only its own:
/// the guard checked the retention against its horizon alone); each purge's counts are logged, and
/// rows still "processing" older than the retention are reported at warn. A purge cut short by
/// `stop` rolls back only its current batch.
pub fn spawn_purge(
    db: DatabaseConnection,
    consumer: String,
    settings: PurgeSettings,
    metrics: Option<Metrics>,
    stop: CancellationToken,
) -> anyhow::Result<JoinHandle<()>> {
    let retention =
        chrono::Duration::from_std(settings.retention).context("--inbox-retention is too large")?;
    Ok(tokio::spawn(async move {
        let mut ticks = tokio::time::interval(settings.interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = ticks.tick() => {}
            }
            let cutoff = chrono::Utc::now() - retention;
            let started = std::time::Instant::now();
            let purged = tokio::select! {
                () = stop.cancelled() => return,
                purged = purge_completed(&db, &consumer, cutoff, settings.batch_size.max(1), false) => purged,
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
                        metrics.record_purge(
                            &consumer,
                            Some((report.deleted, report.processing_older)),
                        );
                    }
                }
                Err(error) => {
                    tracing::warn!(%error, "inbox purge failed; trying again next time");
                    if let Some(metrics) = &metrics {
                        metrics.record_purge(&consumer, None);
                    }
                }
            }
        }
    }))
}
