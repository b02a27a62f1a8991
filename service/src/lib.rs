//! The Inventory service: the `inventory` binary and its serving path. It depends on `domain`,
//! `infra` and general-purpose crates only; the study and the measurements (`inventory demo`,
//! `compare`, `bench`) live in `inventory-benches`, whose binary [`study`] hands them to.
//!
//! # Layout
//! - [`consumer`]: one [`consumer::RuntimeSettings`] value, the streams and the durable consumer
//!   set up, the lanes, and the path of one message from fetch to ack; [`consumer::policy`]:
//!   what becomes of a delivery (ack, nak after a delay, dead letter), as a pure function, and
//!   what became of it ([`consumer::policy::Disposition`]).
//! - [`serve`]: `inventory serve`: flags to runtime settings, signals, what the lanes run (a
//!   [`serve::Served`]), Prometheus metrics ([`metrics`]) and the health endpoints
//!   an orchestrator probes, `/livez` and `/readyz` ([`health`]); [`shutdown`]: how `serve` and
//!   `relay` stop (the signals' tokens, the tasks beside their main work, one exit path).
//! - [`cli`]: the clap commands and what each one runs; [`args`]: flags shared by commands;
//!   [`config`]: the settings' layers (defaults, a TOML file, the environment, the flags) and
//!   `--print-config`.
//! - [`relay`]: the outbox relay: `inventory relay`, the one `serve --strategy natural` runs
//!   beside its lanes, and `inventory outbox parked|retry`.
//! - [`dlq`]: listing, replaying and deleting dead letters.
//! - [`shard`]: `inventory shard init|assign|status|of`, stock sharded by book.
//! - [`retention`]: the flags of the redelivery horizon, shared by `serve` and `inbox purge`,
//!   which the study's inbox purge checks its retention against.
//! - [`study`]: `inventory demo|compare|bench`, the producers `publish` and `orders`, and
//!   `serve` for the study's handlers, run by the study binary.
//! - [`telemetry`]: the tracing subscriber.
//!
//! No module imports one that imports it back: [`consumer::policy`] depends on no other module,
//! [`metrics`] on it, [`consumer`] on those, [`health`] and [`shutdown`], the commands on them.

/// The commit this binary was built from, in the 12 digits the image tags use too; `unknown`
/// where it was built without git.
pub const COMMIT: &str = short_commit(option_env!("VERGEN_GIT_SHA"));

/// Without git, vergen gives a placeholder that is no hash.
const fn short_commit(sha: Option<&'static str>) -> &'static str {
    let Some(sha) = sha else { return "unknown" };
    if sha.len() < 12 {
        return "unknown";
    }
    let (short, _) = sha.split_at(12);
    let mut at = 0;
    while at < short.len() {
        if !short.as_bytes()[at].is_ascii_hexdigit() {
            return "unknown";
        }
        at += 1;
    }
    short
}

pub mod args;
pub mod cli;
pub mod config;
pub mod consumer;
pub mod dlq;
pub mod health;
pub mod metrics;
pub mod relay;
pub mod retention;
pub mod serve;
pub mod shard;
pub mod shard_move;
pub mod shutdown;
pub mod study;
pub mod telemetry;
