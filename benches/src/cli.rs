//! `inventory-study`: the commands `inventory demo`, `inventory compare` and `inventory bench …`
//! hand their arguments to, and `inventory serve` for the study's handlers. Its name in messages
//! and `--help` is `inventory`, as users call it.

use anyhow::Result;
use clap::{Parser, Subcommand};

use inventory_service::args::ProgramArgs;
use inventory_service::config::Configured;

use crate::{bench, compare, demo, orders, publish, retention, serve};

/// `serve` and `inbox purge` read their settings from the same layers as the service's: each flag from the
/// environment (`INVENTORY_<FLAG>`) and the configuration file too; the producers' flags of the
/// same names (the NATS and database flags) as well, as in `inventory`.
pub const CONFIGURED: Configured = Configured {
    commands: &[&["serve"], &["inbox", "purge"]],
    services: &[&["serve"]],
    shared_by: Some(&[&["publish"], &["orders", "place"], &["orders", "cancel"]]),
};

#[derive(Debug, Parser)]
#[command(
    name = "inventory",
    bin_name = "inventory",
    version,
    about = "The study and the measurements of the Inventory service's idempotent consumers"
)]
pub struct Cli {
    #[command(flatten)]
    pub program: ProgramArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Replays every scenario of the idempotent-consumer study against a fresh database and
    /// prints one line per scenario, then a comparison table. Exits 0 only if all came out as
    /// expected.
    Demo {
        /// Server for the fresh database (postgres://…); embedded SQLite when absent.
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        database_url: Option<String>,
        /// Redis for the cache scenarios; they are skipped when none answers there.
        #[arg(long, env = "REDIS_URL", hide_env_values = true, default_value = demo::DEFAULT_REDIS_URL)]
        redis_url: String,
    },
    /// Runs one workload with every kind of duplicate through JetStream into each strategy and
    /// prints expected versus actual reserved copies. Exits 0 only if the inbox and the natural
    /// key came out as the workload predicts.
    Compare(Box<compare::CompareArgs>),
    /// Measurements: end to end through JetStream, what each dedup mode costs PostgreSQL,
    /// criterion's results as a chart.
    Bench {
        #[command(subcommand)]
        command: bench::BenchCommand,
    },
    /// Runs one of the study's handlers as a JetStream subscriber until SIGINT or SIGTERM, then
    /// drains: what `inventory serve --strategy inbox|email` runs.
    Serve(Box<serve::StudyServeArgs>),
    /// Publishes OrderPlaced or OrderCancelled, one or many, straight to NATS (the producer
    /// without an outbox that the study needs).
    Publish(Box<publish::PublishArgs>),
    /// The safe producer: writes an order and its message in one transaction of the orders
    /// database; `inventory relay --source orders` publishes the message.
    Orders {
        #[command(subcommand)]
        command: orders::OrdersCommand,
    },
    /// Dedup records: retention.
    Inbox {
        #[command(subcommand)]
        command: retention::InboxCommand,
    },
}

pub async fn run(cli: Cli) -> Result<bool> {
    match cli.command {
        Command::Demo {
            database_url,
            redis_url,
        } => {
            let report = demo::run(database_url.as_deref(), &redis_url).await?;
            print!("{}", report.render());
            let ok = report.all_as_expected();
            if !ok {
                eprintln!("error: some scenarios did not come out as the study predicts");
            }
            Ok(ok)
        }
        Command::Compare(args) => compare::start(*args).await,
        Command::Bench { command } => bench::run(command).await,
        Command::Serve(args) => serve::start(*args).await,
        Command::Publish(args) => publish::run(*args).await.map(|()| true),
        Command::Orders { command } => orders::run(command).await.map(|()| true),
        Command::Inbox {
            command: retention::InboxCommand::Purge(args),
        } => retention::purge_inbox(*args).await.map(|()| true),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    /// clap checks a command's definition only when it is built, in debug builds: a flag or a
    /// group defined twice (a flattened `serve` is the service's) would panic at the first run.
    #[test]
    fn the_command_line_is_well_formed() {
        super::Cli::command().debug_assert();
    }
}
