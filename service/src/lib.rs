//! The `inventory` binary's library: command-line interface, configuration and wiring.
//!
//! # Layout
//! - [`cli`]: the clap commands and what each one runs; [`args`]: flags shared by commands.
//! - [`serve`]: the JetStream subscriber loop and its wiring; [`metrics`]: its Prometheus
//!   metrics and health check; [`retention`]: its background purge and the horizon guard.
//! - [`dlq`]: listing and replaying dead letters.
//! - [`publish`]: the producer command.
//! - [`demo`]: the idempotent-consumer study behind `inventory demo`.
//! - [`compare`]: the end-to-end comparison of the strategies through JetStream.
//! - [`bench`]: `inventory bench`: PostgreSQL's costs per dedup mode, criterion's results as a
//!   chart; [`bench_e2e`]: end to end through JetStream, and the pgbench script beside it.
//! - [`telemetry`]: the tracing subscriber.

pub mod args;
pub mod cli;
pub mod dlq;
pub mod metrics;
pub mod policy;
pub mod publish;
pub mod retention;
pub mod runtime;
pub mod serve;
pub mod study;
pub mod telemetry;
