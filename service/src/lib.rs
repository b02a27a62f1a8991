//! The `inventory` binary's library: command-line interface, configuration and wiring.
//!
//! # Layout
//! - [`cli`]: the clap commands and what each one runs; [`args`]: flags shared by commands.
//! - [`serve`]: the JetStream subscriber loop and its wiring.
//! - [`publish`]: the producer command.
//! - [`demo`]: the idempotent-consumer study behind `inventory demo`.
//! - [`bench`]: `inventory bench`: PostgreSQL's costs per dedup mode, criterion's results as a chart.
//! - [`telemetry`]: the tracing subscriber.

pub mod args;
pub mod bench;
pub mod cli;
pub mod demo;
pub mod publish;
pub mod serve;
pub mod telemetry;
