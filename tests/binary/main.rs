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
mod dlq_operator;
mod documents;
mod least_privilege;
mod logs;
mod nats_permissions;
mod operating;
mod prometheus;
mod relay_binary;
mod serve_binary;
mod shard_binary;
mod shard_move;
mod shard_serve;
