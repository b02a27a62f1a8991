//! The `inventory` binary run as a process: its command line, `serve` under signals, and what an
//! operator sees. Needs the binary built first (`cargo build --workspace --bins`;
//! `scripts/test.sh` does it).
#![expect(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test fails by panicking"
)]

mod cli;
mod configuration;
mod deploy;
mod least_privilege;
mod nats_permissions;
mod operating;
mod relay_binary;
mod serve_binary;
