//! Flags shared by several commands.

use std::time::Duration;

use inventory_infra::db::DEFAULT_DATABASE_URL;
use inventory_infra::jetstream::Topology;

#[derive(Debug, Clone, clap::Args)]
pub struct DatabaseArgs {
    /// Database URL: postgres://… or sqlite://….
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, default_value = DEFAULT_DATABASE_URL)]
    pub database_url: String,
}

#[derive(Debug, Clone, clap::Args)]
pub struct NatsArgs {
    /// NATS server URL.
    #[arg(
        long,
        env = "NATS_URL",
        hide_env_values = true,
        default_value = "nats://127.0.0.1:4222"
    )]
    pub nats_url: String,
}

/// Stream and subject names; the contract's by default.
#[derive(Debug, Clone, clap::Args)]
pub struct TopologyArgs {
    /// The orders stream.
    #[arg(long, global = true, default_value = "ORDERS")]
    pub stream: String,
    /// Subjects of the orders stream: `<prefix>.placed`, `<prefix>.cancelled`.
    #[arg(long, global = true, default_value = "orders")]
    pub subject_prefix: String,
    /// The dead-letter stream.
    #[arg(long, global = true, default_value = "ORDERS_DLQ")]
    pub dlq_stream: String,
    /// Subjects of the dead-letter stream: `<prefix>.<consumer>`.
    #[arg(long, global = true, default_value = "dlq")]
    pub dlq_subject_prefix: String,
    /// How long the stream drops a resend of a `Nats-Msg-Id` it has stored (when it creates the
    /// streams).
    #[arg(long, global = true, default_value = "2m", value_parser = humantime::parse_duration)]
    pub duplicate_window: Duration,
    /// Stream replicas (when it creates the streams); 3 on a JetStream cluster.
    #[arg(long, global = true, default_value_t = 1)]
    pub replicas: usize,
}

impl TopologyArgs {
    pub fn topology(&self) -> Topology {
        Topology {
            stream: self.stream.clone(),
            subject_prefix: self.subject_prefix.clone(),
            dlq_stream: self.dlq_stream.clone(),
            dlq_subject_prefix: self.dlq_subject_prefix.clone(),
            duplicate_window: self.duplicate_window,
            replicas: self.replicas,
        }
    }
}
