//! Logs: `tracing` to stderr, filtered by `RUST_LOG`.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Installs the subscriber once; `default_filter` applies when `RUST_LOG` is unset.
pub fn init(default_filter: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    // A second call (tests running commands in one process) keeps the first subscriber.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal, never in files and collectors.
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}
