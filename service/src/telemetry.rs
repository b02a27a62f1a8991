//! Logs: `tracing` to stderr, filtered by `RUST_LOG`, as text or as one JSON object a line.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// For a person: one line an event, colour only at a terminal.
    #[default]
    Text,
    /// For a collector: one JSON object a line, the event's fields and its spans' fields as
    /// keys.
    Json,
}

/// Installs the subscriber once; `default_filter` applies when `RUST_LOG` is unset.
pub fn init(default_filter: &str, format: LogFormat) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // A second call (tests running commands in one process) keeps the first subscriber.
    let _ = match format {
        // Colour codes only for a person at a terminal, never in files and collectors.
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(true)
            .try_init(),
    };
}
