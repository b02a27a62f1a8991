//! What an orchestrator asks of `inventory serve` and `inventory relay`, on `--metrics-addr`
//! beside `GET /metrics`. The listener is up before the set-up begins.
//!
//! - `GET /livez`: whether the process can make progress. 200 while every task it runs (the
//!   lanes, the relay) is alive and no delivery has been in flight longer than its bound; 503
//!   otherwise. It never asks the database or NATS: an outage is not cured by a restart, and
//!   restarting every instance at once for it only delays the recovery.
//! - `GET /readyz`: whether its dependencies answer. 200 with
//!   `{"nats":"connected","database":"reachable"}` (and `"relay":"publishing"` where a relay
//!   runs), else 503 with the failing part marked; `{"status":"starting"}` (503) until the
//!   set-up is done. The database is asked on a connection of the check's own ([`Probe`]), not
//!   through the pool: a pool whose connections are all taken says nothing of whether the
//!   database answers. The relay counts as failing once it has failed for longer than its
//!   `--relay-unhealthy-after` to publish rows that wait.
//! - `GET /healthz`: `/readyz`, under the name it had first.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use anyhow::Context as _;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use inventory_infra::db::{DatabaseConnection, Probe};
use inventory_infra::jetstream;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// How long the readiness check waits for the database.
const DATABASE_BUDGET: Duration = Duration::from_secs(2);

/// Whether the process's own tasks are alive. A task that ended while the service ran (a lane
/// whose handler panicked, the relay) is recorded here, and `/livez` says so until the process
/// has stopped.
#[derive(Clone, Default)]
pub struct Liveness(Arc<Mutex<Option<String>>>);

impl Liveness {
    /// Records that `task` ended while the service ran; the first failure is the one kept.
    pub fn task_failed(&self, task: &str, why: &str) {
        let mut failure = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        failure.get_or_insert_with(|| format!("{task} {why}"));
    }

    pub fn failure(&self) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }
}

/// What `/readyz` checks, known once the set-up has connected to them.
#[derive(Clone, Default)]
pub struct Readiness(Arc<OnceLock<Dependencies>>);

struct Dependencies {
    nats: jetstream::Client,
    database: Probe,
}

impl Readiness {
    /// The set-up is done: from now on `/readyz` asks these.
    pub fn ready(&self, nats: jetstream::Client, db: &DatabaseConnection) {
        let _ = self.0.set(Dependencies {
            nats,
            database: Probe::new(db),
        });
    }
}

/// The health endpoints' state.
#[derive(Clone)]
struct Health {
    metrics: Metrics,
    liveness: Liveness,
    readiness: Readiness,
    /// A delivery in flight longer than this means a lane no longer makes progress.
    stuck_after: Duration,
}

/// Binds `addr`: the bound address (useful with port 0), and the server of `/metrics`, `/livez`,
/// `/readyz` and `/healthz` until `stop` fires, for the caller to spawn.
pub async fn serve(
    addr: SocketAddr,
    metrics: Metrics,
    liveness: Liveness,
    readiness: Readiness,
    stuck_after: Duration,
    stop: CancellationToken,
) -> anyhow::Result<(
    SocketAddr,
    impl Future<Output = anyhow::Result<()>> + Send + 'static,
)> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the metrics address {addr}"))?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/metrics", get(render_metrics))
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .route("/healthz", get(readyz))
        .with_state(Health {
            metrics,
            liveness,
            readiness,
            stuck_after,
        });
    let server = async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(stop.cancelled_owned())
            .await
            .context("serving /metrics")
    };
    tracing::info!(addr = %bound, "serving /metrics, /livez, /readyz and /healthz");
    Ok((bound, server))
}

async fn render_metrics(State(health): State<Health>) -> impl IntoResponse {
    // The dependencies' gauges are as fresh as the scrape.
    check_dependencies(&health).await;
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

async fn livez(State(health): State<Health>) -> impl IntoResponse {
    let oldest = health.metrics.oldest_in_flight();
    let mut body = serde_json::json!({ "oldest_in_flight_seconds": oldest.as_secs_f64() });
    let status = match health.liveness.failure() {
        Some(failure) => {
            body["tasks"] = "failed".into();
            body["failure"] = failure.into();
            StatusCode::SERVICE_UNAVAILABLE
        }
        None if oldest > health.stuck_after => {
            body["tasks"] = "stuck".into();
            StatusCode::SERVICE_UNAVAILABLE
        }
        None => {
            body["tasks"] = "running".into();
            StatusCode::OK
        }
    };
    (status, Json(body))
}

/// What the readiness check found.
struct Checked {
    nats: bool,
    database: bool,
    /// Where a relay runs: whether it publishes.
    relay: Option<bool>,
}

/// Asks the dependencies, once the set-up is done (`None` before), and records the answers in
/// `inventory_dependency_up`.
async fn check_dependencies(health: &Health) -> Option<Checked> {
    let dependencies = health.readiness.0.get()?;
    let nats = jetstream::is_connected(&dependencies.nats);
    // Bounded: a database that hangs must not hang the probe too.
    let database = match dependencies.database.check(DATABASE_BUDGET).await {
        Ok(()) => true,
        Err(error) => {
            // Every poll during an outage fails: the 503 says it; DEBUG says why.
            tracing::debug!(%error, "readiness: database unreachable");
            false
        }
    };
    let relay = health.metrics.watched_relay().map(|relay| !relay.failing());
    let mut up = vec![("database", database), ("nats", nats)];
    up.extend(relay.map(|publishing| ("relay", publishing)));
    health.metrics.record_dependencies(&up);
    Some(Checked {
        nats,
        database,
        relay,
    })
}

async fn readyz(State(health): State<Health>) -> impl IntoResponse {
    let Some(checked) = check_dependencies(&health).await else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({ "status": "starting" })),
        );
    };
    let status = if checked.nats && checked.database && checked.relay != Some(false) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let mut body = serde_json::json!({
        "nats": if checked.nats { "connected" } else { "disconnected" },
        "database": if checked.database { "reachable" } else { "unreachable" },
    });
    if let Some(publishing) = checked.relay {
        body["relay"] = if publishing { "publishing" } else { "failing" }.into();
    }
    (status, Json(body))
}
