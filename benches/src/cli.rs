//! `inventory-study`: the commands `inventory demo`, `inventory compare` and `inventory bench …`
//! hand their arguments to. Its name in messages and `--help` is `inventory`, as users call it.

use anyhow::Result;
use clap::{Parser, Subcommand};

use crate::{bench, compare, demo};

#[derive(Debug, Parser)]
#[command(
    name = "inventory",
    bin_name = "inventory",
    version,
    about = "The study and the measurements of the Inventory service's idempotent consumers"
)]
pub struct Cli {
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
    }
}
