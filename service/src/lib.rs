//! The `inventory` binary's library: command-line interface, configuration and wiring.
//!
//! # Layout
//! - [`cli`]: the clap commands and what each one runs.
//! - [`demo`]: the idempotent-consumer study behind `inventory demo`.
//! - [`telemetry`]: the tracing subscriber.

pub mod cli;
pub mod demo;
pub mod telemetry;
