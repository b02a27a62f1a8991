//! Retention in `inventory serve`: the guard that refuses a retention shorter than the
//! redelivery horizon, and the background purge of completed inbox rows.

use std::time::Duration;

use anyhow::Context as _;
use humantime::format_duration;
use inventory_domain::{Horizon, RetentionTooShort};
use inventory_infra::db::DatabaseConnection;
use inventory_infra::retention::purge_completed;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// How the background purge runs.
#[derive(Debug, Clone, Copy)]
pub struct PurgeSettings {
    /// Completed rows older than this are deleted.
    pub retention: Duration,
    /// Time between purges.
    pub interval: Duration,
    pub batch_size: u64,
}

/// The guard's answer to a retention shorter than the horizon, naming both durations.
pub fn refusal_message(consumer: &str, horizon: &Horizon, refusal: RetentionTooShort) -> String {
    let retention = format_duration(refusal.retention);
    match (refusal.horizon, horizon.redelivery) {
        (Some(total), Some(redelivery)) => format!(
            "--inbox-retention {retention} is shorter than the redelivery horizon {} of consumer \
             {consumer} (redeliveries {}, duplicate window {}, replay allowance {}): a copy \
             arriving later would find its inbox row purged and be applied twice. Raise \
             --inbox-retention to at least {}, or pass --accept-short-retention",
            format_duration(total),
            format_duration(redelivery),
            format_duration(horizon.duplicate_window),
            format_duration(horizon.replay_allowance),
            format_duration(total),
        ),
        _ => format!(
            "--inbox-retention {retention} is shorter than the redelivery horizon of consumer \
             {consumer}, which is unbounded: its max_deliver is unlimited, so JetStream may \
             redeliver a message at any time. Give the consumer a max_deliver, or pass \
             --accept-short-retention"
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
                refusal_message(consumer, horizon, refusal)
            );
            Ok(())
        }
        Err(refusal) => Err(anyhow::anyhow!(refusal_message(consumer, horizon, refusal))),
    }
}

/// Runs a purge now and then every `interval` until `stop`; each purge's counts are logged, and
/// rows still "processing" older than the retention are reported at warn. A purge cut short by
/// `stop` rolls back only its current batch.
pub fn spawn_purge(
    db: DatabaseConnection,
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
                purged = purge_completed(&db, cutoff, settings.batch_size.max(1), false) => purged,
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
                        metrics.record_purge(report.deleted, report.processing_older);
                    }
                }
                Err(error) => tracing::warn!(%error, "inbox purge failed; trying again next time"),
            }
        }
    }))
}
