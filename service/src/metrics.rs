//! Prometheus metrics and the health check of `inventory serve`, on `--metrics-addr`.
//!
//! `GET /metrics`: the text exposition of the `prometheus` crate's registry. `GET /healthz`:
//! 200 with `{"nats":"connected","database":"reachable"}` when both hold, else 503 with what
//! failed, so an orchestrator restarts or stops routing to an instance that cannot work. The
//! database is asked on a connection of the check's own ([`Probe`]), not through the pool: a
//! pool whose connections are all taken says nothing of whether the database answers.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use inventory_infra::db::{DatabaseConnection, Probe};
use inventory_infra::jetstream;
use prometheus::{
    Encoder as _, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
use tokio_util::sync::CancellationToken;

use crate::runtime::Disposition;

/// The service's metrics, registered in a registry of their own (no process-global state, so
/// tests in one process do not share counters).
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    messages: IntCounterVec,
    dead_letters: IntCounterVec,
    handling: HistogramVec,
    in_flight: IntGaugeVec,
    purged: IntCounter,
    processing_older: IntGauge,
}

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let messages = IntCounterVec::new(
            Opts::new(
                "inventory_messages_total",
                "Deliveries handled, by consumer and outcome (processed, duplicate, rejected, \
                 reconciled, dead_lettered, retried, left_for_redelivery).",
            ),
            &["consumer", "outcome"],
        )?;
        let dead_letters = IntCounterVec::new(
            Opts::new(
                "inventory_dead_letters_total",
                "Messages dead-lettered, by consumer and Dlq-Reason.",
            ),
            &["consumer", "reason"],
        )?;
        let handling = HistogramVec::new(
            HistogramOpts::new(
                "inventory_message_handling_seconds",
                "Time from a delivery's arrival to its ack, nak or dead letter.",
            )
            .buckets(vec![
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
            &["consumer"],
        )?;
        let in_flight = IntGaugeVec::new(
            Opts::new(
                "inventory_messages_in_flight",
                "Deliveries being handled now.",
            ),
            &["consumer"],
        )?;
        let purged = IntCounter::new(
            "inventory_inbox_rows_purged_total",
            "Completed inbox rows deleted by the retention purge.",
        )?;
        let processing_older = IntGauge::new(
            "inventory_inbox_processing_older_than_retention",
            "Inbox rows still \"processing\" older than the retention at the last purge: kept, \
             to be reconciled.",
        )?;
        registry.register(Box::new(messages.clone()))?;
        registry.register(Box::new(dead_letters.clone()))?;
        registry.register(Box::new(handling.clone()))?;
        registry.register(Box::new(in_flight.clone()))?;
        registry.register(Box::new(purged.clone()))?;
        registry.register(Box::new(processing_older.clone()))?;
        Ok(Self {
            registry,
            messages,
            dead_letters,
            handling,
            in_flight,
            purged,
            processing_older,
        })
    }

    /// The handles one consumer's worker records into.
    pub fn consumer(&self, consumer: &str) -> ConsumerMetrics {
        ConsumerMetrics {
            consumer: consumer.to_owned(),
            messages: self.messages.clone(),
            dead_letters: self.dead_letters.clone(),
            handling: self.handling.with_label_values(&[consumer]),
            in_flight: self.in_flight.with_label_values(&[consumer]),
        }
    }

    /// After each purge.
    pub fn record_purge(&self, deleted: u64, processing_older: u64) {
        self.purged.inc_by(deleted);
        self.processing_older
            .set(i64::try_from(processing_older).unwrap_or(i64::MAX));
    }

    /// The text exposition format.
    pub fn render(&self) -> Result<String, prometheus::Error> {
        let mut text = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut text)?;
        Ok(String::from_utf8_lossy(&text).into_owned())
    }
}

/// One consumer's metrics, cloned into every message's task.
#[derive(Clone)]
pub struct ConsumerMetrics {
    consumer: String,
    messages: IntCounterVec,
    dead_letters: IntCounterVec,
    handling: Histogram,
    in_flight: IntGauge,
}

/// Counts a delivery in flight until dropped, so a handler that panics is not counted forever.
pub struct InFlight(IntGauge);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl ConsumerMetrics {
    pub fn start(&self) -> InFlight {
        self.in_flight.inc();
        InFlight(self.in_flight.clone())
    }

    pub fn record(&self, disposition: &Disposition, elapsed: Duration) {
        let outcome = match disposition {
            Disposition::Acked(acked) => acked.label(),
            Disposition::DeadLettered(reason) => {
                self.dead_letters
                    .with_label_values(&[self.consumer.as_str(), reason.as_str()])
                    .inc();
                "dead_lettered"
            }
            Disposition::Retried(_) => "retried",
            Disposition::LeftForRedelivery => "left_for_redelivery",
        };
        self.messages
            .with_label_values(&[self.consumer.as_str(), outcome])
            .inc();
        self.handling.observe(elapsed.as_secs_f64());
    }
}

/// What `/healthz` checks.
#[derive(Clone)]
struct Health {
    metrics: Metrics,
    nats: jetstream::Client,
    database: Arc<Probe>,
}

/// Binds `addr` and serves `/metrics` and `/healthz` until `stop` fires. Returns the bound
/// address (useful with port 0) once it listens.
pub async fn serve(
    addr: SocketAddr,
    metrics: Metrics,
    nats: jetstream::Client,
    db: DatabaseConnection,
    stop: CancellationToken,
) -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the metrics address {addr}"))?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(healthz))
        .with_state(Health {
            metrics,
            nats,
            database: Arc::new(Probe::new(&db)),
        });
    tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(stop.cancelled_owned())
            .await;
        if let Err(error) = served {
            tracing::error!(%error, "metrics server stopped");
        }
    });
    tracing::info!(addr = %bound, "serving /metrics and /healthz");
    Ok(bound)
}

async fn render_metrics(State(health): State<Health>) -> impl IntoResponse {
    match health.metrics.render() {
        Ok(text) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            text,
        ),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain")],
            error.to_string(),
        ),
    }
}

async fn healthz(State(health): State<Health>) -> impl IntoResponse {
    let nats_ok = jetstream::is_connected(&health.nats);
    // Bounded: a database that hangs must not hang the probe too.
    let db_ok = match health.database.check(Duration::from_secs(2)).await {
        Ok(()) => true,
        Err(error) => {
            // Every poll during an outage fails: the 503 says it; DEBUG says why.
            tracing::debug!(%error, "health check: database unreachable");
            false
        }
    };
    let status = if nats_ok && db_ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::json!({
        "nats": if nats_ok { "connected" } else { "disconnected" },
        "database": if db_ok { "reachable" } else { "unreachable" },
    });
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
}
