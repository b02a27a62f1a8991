//! The command line: `inventory <command>`. The flags of the commands that run as a service and
//! of those run beside them are settings, also read from the environment and a file
//! ([`crate::config`]); a secret's value is never echoed by `--help`.

use std::io::Write;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use inventory_domain::{BookId, StockItem};
use inventory_infra::StockRepository;
use inventory_infra::db;
use serde::Serialize;

use crate::args::{
    DatabaseArgs, DatabaseUrlArgs, NatsArgs, ProgramArgs, REPLAY_ALLOWANCE, TopologyArgs,
};
use crate::{dlq, relay, serve, shard, study};

/// `inventory --version`: the release, the commit it was built from and the build's date.
fn version() -> String {
    format!(
        "{} (commit {}, built {})",
        env!("CARGO_PKG_VERSION"),
        crate::COMMIT,
        env!("VERGEN_BUILD_DATE")
    )
}

#[derive(Debug, Parser)]
#[command(
    name = "inventory",
    version = version(),
    about = "Idempotent consumers of OrderPlaced: the bookstore's Inventory service and its study"
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
    /// expected. [the study binary]
    #[command(disable_help_flag = true)]
    Demo(study::Forwarded),
    /// Applies the migrations to the database.
    Migrate {
        #[command(flatten)]
        database: DatabaseUrlArgs,
    },
    /// Sets and shows stock.
    Stock {
        #[command(subcommand)]
        command: StockCommand,
    },
    /// Dedup records: retention. [the study binary]
    #[command(disable_help_flag = true)]
    Inbox(study::Forwarded),
    /// Dead letters in ORDERS_DLQ: list them, replay them to their original subject, delete
    /// them.
    Dlq {
        #[command(subcommand)]
        command: Box<DlqCommand>,
    },
    /// Stock sharded by book: sharding the orders stream, assigning its partitions to shards,
    /// where each partition and book is.
    Shard {
        #[command(subcommand)]
        command: Box<shard::ShardCommand>,
    },
    /// Runs the JetStream subscriber until SIGINT or SIGTERM, then drains.
    Serve(Box<serve::ServeCommand>),
    /// Publishes an outbox's pending rows to its stream until SIGINT or SIGTERM (`serve
    /// --strategy natural` runs the inventory relay itself).
    Relay(Box<relay::RelayCommandArgs>),
    /// The outbox: rows the relay parked, and retrying them.
    Outbox {
        #[command(subcommand)]
        command: relay::OutboxCommand,
    },
    /// Publishes OrderPlaced or OrderCancelled, one or many, straight to NATS (the producer
    /// without an outbox that the study needs). [the study binary]
    #[command(disable_help_flag = true)]
    Publish(study::Forwarded),
    /// The safe producer: writes an order and its message in one transaction of the orders
    /// database; `inventory relay --source orders` publishes the message. [the study binary]
    #[command(disable_help_flag = true)]
    Orders(study::Forwarded),
    /// Runs one workload with every kind of duplicate through JetStream into each strategy and
    /// prints expected versus actual reserved copies. [the study binary]
    #[command(disable_help_flag = true)]
    Compare(study::Forwarded),
    /// Measurements: end to end through JetStream, what each dedup mode costs PostgreSQL,
    /// criterion's results as a chart. [the study binary]
    #[command(disable_help_flag = true)]
    Bench(study::Forwarded),
}

/// Which dead letters `dlq replay` and `dlq delete` take.
#[derive(Debug, clap::Args)]
pub struct Chosen {
    /// The dead letter's sequence in the DLQ, as `dlq list` shows it; repeatable. Not with
    /// --reason.
    #[arg(long, required_unless_present = "reason", conflicts_with = "reason")]
    seq: Vec<u64>,
    /// Every dead letter with this Dlq-Reason. Not with --seq.
    #[arg(long)]
    reason: Option<String>,
    /// With --reason: only its dead letters older than this (7d, 36h).
    #[arg(long, requires = "reason", value_parser = humantime::parse_duration)]
    older_than: Option<std::time::Duration>,
}

impl Chosen {
    fn selection(self) -> dlq::Selection {
        match self.reason {
            Some(reason) => dlq::Selection::Reason {
                reason,
                older_than: self.older_than,
            },
            None => dlq::Selection::Sequences(self.seq),
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// Lists the dead letters: reason, detail, original subject and sequence, age.
    List {
        /// Prints JSON instead of a table, with each dead letter's headers and body.
        #[arg(long)]
        json: bool,
        /// Only dead letters with this Dlq-Reason (e.g. unknown-book).
        #[arg(long)]
        reason: Option<String>,
        #[command(flatten)]
        nats: NatsArgs,
        #[command(flatten)]
        topology: TopologyArgs,
    },
    /// Republishes dead letters to their original subject with their original body (the
    /// consumer's dedup applies: a duplicate is skipped), then deletes them from the DLQ. One
    /// older than the replay allowance refuses the whole replay unless --force.
    Replay {
        #[command(flatten)]
        chosen: Chosen,
        /// How long after a dead letter operators may still replay it: the service's own
        /// --replay-allowance, the last part of the inbox's redelivery horizon. An older one may
        /// find its inbox row purged and be applied twice, so it is refused unless --force.
        #[arg(long, default_value = REPLAY_ALLOWANCE, value_parser = humantime::parse_duration)]
        replay_allowance: std::time::Duration,
        /// Replays dead letters older than --replay-allowance too.
        #[arg(long)]
        force: bool,
        /// Prints what would be replayed, and publishes and deletes nothing.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        nats: NatsArgs,
        #[command(flatten)]
        topology: TopologyArgs,
    },
    /// Deletes dead letters from the DLQ without replaying them, once understood: those that
    /// must never be replayed (malformed, invalid, conflicting-reservation, payload-mismatch),
    /// and those settled by hand (needs-reconciliation).
    Delete {
        #[command(flatten)]
        chosen: Chosen,
        /// Prints what would be deleted, and deletes nothing.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        nats: NatsArgs,
        #[command(flatten)]
        topology: TopologyArgs,
    },
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

/// A command's result as the process's exit code: 0 when it succeeded, 1 when it ran and
/// failed (its error printed) or came out other than expected.
pub fn exit_code(result: Result<bool>) -> std::process::ExitCode {
    match result {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::FAILURE,
        Err(error) => {
            eprintln!("error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// A small pool: these commands run a handful of statements.
pub const COMMAND_POOL: u32 = 2;

pub async fn run(cli: Cli) -> Result<bool> {
    match cli.command {
        Command::Demo(args) => study::forward("demo", args),
        Command::Migrate { database } => {
            let conn = db::connect_with(
                database.url(),
                COMMAND_POOL,
                db::DbTimeouts::unbounded_statements(),
            )
            .await
            .context("connecting to the database")?;
            db::migrate(&conn).await.context("applying migrations")?;
            println!("migrations applied");
            Ok(true)
        }
        Command::Stock { command } => run_stock(command).await.map(|()| true),
        Command::Inbox(args) => study::forward("inbox", args),
        Command::Dlq { command } => run_dlq(*command).await.map(|()| true),
        Command::Shard { command } => shard::run(*command).await,
        Command::Serve(args) => serve::start(*args).await,
        Command::Relay(args) => relay::run(*args).await,
        Command::Outbox { command } => relay::run_outbox(command).await.map(|()| true),
        Command::Publish(args) => study::forward("publish", args),
        Command::Orders(args) => study::forward("orders", args),
        Command::Compare(args) => study::forward("compare", args),
        Command::Bench(args) => study::forward("bench", args),
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
    let conn = db::open(
        database.url(),
        COMMAND_POOL,
        database.schema(),
        database.timeouts(),
    )
    .await
    .context("opening the database")?;
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

async fn run_dlq(command: DlqCommand) -> Result<()> {
    match command {
        DlqCommand::List {
            json,
            reason,
            nats,
            topology,
        } => {
            let client = nats.connect("inventory dlq").await?;
            let js = inventory_infra::jetstream::context(client);
            let letters = dlq::list(&js, &topology.topology(), reason.as_deref()).await?;
            let mut out = std::io::stdout().lock();
            if json {
                serde_json::to_writer_pretty(&mut out, &letters)?;
                writeln!(out)?;
                return Ok(());
            }
            writeln!(
                out,
                "{:>6}  {:<24}  {:<28}  {:>8}  {:>5}  detail",
                "seq", "reason", "original subject", "orig seq", "age"
            )?;
            for letter in &letters {
                writeln!(
                    out,
                    "{:>6}  {:<24}  {:<28}  {:>8}  {:>5}  {}",
                    letter.seq,
                    letter.reason,
                    letter.original_subject.as_deref().unwrap_or("?"),
                    letter
                        .original_sequence
                        .map_or_else(|| "?".into(), |seq| seq.to_string()),
                    dlq::short_age(letter.age_seconds),
                    letter.detail
                )?;
            }
        }
        DlqCommand::Replay {
            chosen,
            replay_allowance,
            force,
            dry_run,
            nats,
            topology,
        } => {
            let client = nats.connect("inventory dlq").await?;
            let js = inventory_infra::jetstream::context(client);
            let options = dlq::ReplayOptions {
                allowance: replay_allowance,
                force,
                dry_run,
            };
            let report =
                dlq::replay(&js, &topology.topology(), &chosen.selection(), options).await?;
            let forced = |forced: bool| {
                if forced {
                    format!(
                        " (forced: past the replay allowance {})",
                        humantime::format_duration(replay_allowance)
                    )
                } else {
                    String::new()
                }
            };
            if dry_run {
                for planned in &report.planned {
                    let letter = &planned.letter;
                    println!(
                        "would replay dead letter {} ({}, {} old) to {} as {}{}",
                        letter.seq,
                        letter.reason,
                        dlq::short_age(letter.age_seconds),
                        planned.subject,
                        planned.message_id(),
                        forced(planned.forced)
                    );
                }
            }
            for r in &report.replayed {
                println!(
                    "replayed dead letter {} ({}, {} old) to {} as {} -> stored as sequence {}{}{}",
                    r.seq,
                    r.reason,
                    dlq::short_age(r.age_seconds),
                    r.subject,
                    r.message_id,
                    r.stream_sequence,
                    if r.duplicate {
                        " (already there: a retried replay)"
                    } else {
                        ""
                    },
                    forced(r.forced)
                );
            }
            match (report.planned.len(), dry_run) {
                // A --seq not in the DLQ is the error below.
                (0, _) if !report.missing.is_empty() => {}
                (0, _) => println!("no dead letter matched"),
                (n, true) => println!(
                    "would replay {}; --dry-run: nothing published or deleted",
                    dead_letters(n)
                ),
                (n, false) => println!("replayed {}", dead_letters(n)),
            }
            missing(&report.missing)?;
        }
        DlqCommand::Delete {
            chosen,
            dry_run,
            nats,
            topology,
        } => {
            let client = nats.connect("inventory dlq").await?;
            let js = inventory_infra::jetstream::context(client);
            let report =
                dlq::delete(&js, &topology.topology(), &chosen.selection(), dry_run).await?;
            let verb = if dry_run { "would delete" } else { "deleted" };
            for letter in &report.deleted {
                println!(
                    "{verb} dead letter {} ({}, {} old): consumer {}, original subject {}",
                    letter.seq,
                    letter.reason,
                    dlq::short_age(letter.age_seconds),
                    letter.consumer,
                    letter.original_subject.as_deref().unwrap_or("?"),
                );
            }
            for seq in &report.gone {
                println!(
                    "dead letter {seq} was gone before its delete: deleted or replayed by another"
                );
            }
            match (report.deleted.len(), dry_run) {
                (0, _) if !report.missing.is_empty() => {}
                (0, _) if report.gone.is_empty() => println!("no dead letter matched"),
                (n, true) => println!(
                    "would delete {}; --dry-run: nothing deleted",
                    dead_letters(n)
                ),
                (n, false) => println!("deleted {}", dead_letters(n)),
            }
            missing(&report.missing)?;
        }
    }
    Ok(())
}

/// `1 dead letter`, `2 dead letters`.
fn dead_letters(n: usize) -> String {
    if n == 1 {
        "1 dead letter".to_owned()
    } else {
        format!("{n} dead letters")
    }
}

/// Sequences asked for that are not in the DLQ: an error naming them, after the others were
/// handled.
fn missing(missing: &[u64]) -> Result<()> {
    if missing.is_empty() {
        return Ok(());
    }
    anyhow::bail!("no dead letter with sequence {missing:?} in the DLQ")
}
