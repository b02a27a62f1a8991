//! The command line: `inventory <command>`. Every flag that names a service also reads its
//! environment variable; values read from the environment are never echoed by `--help`, since a
//! URL can carry a password.

use std::io::Write;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use inventory_domain::{BookId, StockItem};
use inventory_infra::StockRepository;
use inventory_infra::db;
use serde::Serialize;

use crate::args::DatabaseArgs;
use crate::{compare, demo, publish, serve};

#[derive(Debug, Parser)]
#[command(
    name = "inventory",
    version,
    about = "Idempotent consumers of OrderPlaced: the bookstore's Inventory service and its study"
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
    },
    /// Applies the migrations to the database.
    Migrate {
        #[command(flatten)]
        database: DatabaseArgs,
    },
    /// Sets and shows stock.
    Stock {
        #[command(subcommand)]
        command: StockCommand,
    },
    /// Runs the JetStream subscriber until SIGINT or SIGTERM, then drains.
    Serve(serve::ServeArgs),
    /// Publishes OrderPlaced or OrderCancelled, one or many.
    Publish(publish::PublishArgs),
    /// Runs one workload with every kind of duplicate through JetStream into each strategy and
    /// prints expected versus actual reserved copies. Exits 0 only if the inbox and the natural
    /// key came out as the workload predicts.
    Compare(compare::CompareArgs),
}

#[derive(Debug, Subcommand)]
pub enum StockCommand {
    /// Sets a book's title and copies on hand (what is reserved is kept).
    Put {
        /// The book's UUID.
        #[arg(long)]
        book_id: BookId,
        /// The book's title.
        #[arg(long)]
        title: String,
        /// Copies on hand.
        #[arg(long)]
        on_hand: i64,
        #[command(flatten)]
        database: DatabaseArgs,
    },
    /// Lists stock: on hand, reserved and available per book.
    List {
        /// Prints JSON instead of a table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        database: DatabaseArgs,
    },
}

/// A small pool: these commands run a handful of statements.
const COMMAND_POOL: u32 = 2;

pub async fn run(cli: Cli) -> Result<bool> {
    match cli.command {
        Command::Demo { database_url } => {
            let report = demo::run(database_url.as_deref()).await?;
            print!("{}", report.render());
            let ok = report.all_as_expected();
            if !ok {
                eprintln!("error: some scenarios did not come out as the study predicts");
            }
            Ok(ok)
        }
        Command::Migrate { database } => {
            let conn = db::connect(&database.database_url, COMMAND_POOL)
                .await
                .context("connecting to the database")?;
            db::migrate(&conn).await.context("applying migrations")?;
            println!("migrations applied");
            Ok(true)
        }
        Command::Stock { command } => run_stock(command).await.map(|()| true),
        Command::Serve(args) => serve::start(args).await,
        Command::Publish(args) => publish::run(args).await.map(|()| true),
        Command::Compare(args) => compare::start(args).await,
    }
}

#[derive(Serialize)]
struct StockRow {
    book_id: String,
    title: String,
    on_hand: i64,
    reserved: i64,
    available: i64,
}

async fn repository(database: &DatabaseArgs) -> Result<StockRepository> {
    let conn = db::connect_and_migrate(&database.database_url, COMMAND_POOL)
        .await
        .context("connecting to the database")?;
    Ok(StockRepository::new(conn))
}

async fn run_stock(command: StockCommand) -> Result<()> {
    match command {
        StockCommand::Put {
            book_id,
            title,
            on_hand,
            database,
        } => {
            let item = StockItem::new(book_id, &title, on_hand)?;
            repository(&database).await?.put(&item).await?;
            println!("{book_id}  {}  on hand: {on_hand}", item.title);
        }
        StockCommand::List { json, database } => {
            let rows: Vec<StockRow> = repository(&database)
                .await?
                .list()
                .await?
                .into_iter()
                .map(|item| StockRow {
                    book_id: item.book_id.to_string(),
                    available: item.available(),
                    title: item.title,
                    on_hand: item.on_hand,
                    reserved: item.reserved,
                })
                .collect();
            let mut out = std::io::stdout().lock();
            if json {
                serde_json::to_writer_pretty(&mut out, &rows)?;
                writeln!(out)?;
            } else {
                writeln!(
                    out,
                    "{:<36}  {:<30}  {:>8}  {:>8}  {:>9}",
                    "book_id", "title", "on_hand", "reserved", "available"
                )?;
                for row in rows {
                    writeln!(
                        out,
                        "{:<36}  {:<30}  {:>8}  {:>8}  {:>9}",
                        row.book_id, row.title, row.on_hand, row.reserved, row.available
                    )?;
                }
            }
        }
    }
    Ok(())
}
