//! `inventory bench`: the measurements the project takes of itself.
//!
//! - `costs`: what each dedup mode costs PostgreSQL, from the server's own statistics and log.
//!   On PostgreSQL a caught unique violation aborts the transaction: it burns a transaction id,
//!   leaves the inserted heap tuple dead, and the server logs an ERROR line with the statement.
//!   `ON CONFLICT DO NOTHING` (and the natural key, built on it) avoids all three. Each mode runs
//!   a stream of messages at each duplicate ratio in a database of its own, one after another.
//! - `purge`: the retention purge of a million completed inbox rows under a steady flow of
//!   messages: its duration and the handler's latency before and during it.
//! - `chart`: criterion's medians (`cargo bench -p inventory-benches`) as an SVG line chart and
//!   a Markdown table.
//!
//! How `costs` reads the figures. The sessions that did the work are closed and gone from
//! `pg_stat_activity` before each reading: a backend flushes its statistics when it exits, so
//! no figure waits on the statistics' flush interval (on PostgreSQL before 15, whose collector
//! receives them asynchronously, it also waits a moment). Then, from a session on the server's
//! own database, so its reads are not counted: commits and rollbacks are
//! `pg_stat_database.xact_commit`/`xact_rollback` of the run's database; transaction ids are
//! the growth of `txid_snapshot_xmax(txid_current_snapshot())`, the next id to be assigned, which
//! assigns none; WAL bytes are `pg_wal_lsn_diff` of `pg_current_wal_lsn()`. Dead tuples are
//! `pg_stat_user_tables.n_dead_tup` of the run's tables, read in its database afterwards, with
//! autovacuum switched off for those tables so that a vacuum does not clear them mid-run. The
//! server log is found by `pg_current_logfile()` when the logging collector runs, else at
//! Debian's path for the server's `cluster_name` (`/var/log/postgresql/postgresql-15-main.log`
//! for `15/main`); a `RAISE LOG` probe line proves the server writes there and marks where a
//! run's lines begin and end. The bytes counted are those of the records naming the run's
//! database (`%d` in `log_line_prefix`, as Debian's default has); the file's whole growth is kept
//! too. Transaction ids, WAL and the file's growth are the whole server's, so other sessions on
//! it inflate them; the other figures are the run's own.

use crate::produce::Produce as _;
use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::bench_hand::Driver;
use crate::chart::{self, Labels};
use crate::consumers::HandlerKind;
use crate::db::connect;
use crate::fresh::FreshDatabase;
use crate::workload::{self, CopyKind, Delivery, DuplicateStream};
use crate::{
    bench_e2e, bench_pg_bound, bench_prefilter, bench_publish_rate, bench_relay, bench_sqlite,
    guard_cost,
};
use anyhow::{Context, Result, bail};
use clap::Subcommand;
use inventory_infra::MessageHandler;
use inventory_infra::db::{self, DatabaseConnection};
use sea_orm::{ConnectionTrait, DbBackend, QueryResult, Statement, Value};
use serde::Serialize;

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// OrderPlaced through JetStream into PostgreSQL (or a fresh SQLite file) by the real
    /// consumer loop, acked after commit: messages per second.
    EndToEnd(Box<bench_e2e::EndToEndArgs>),
    /// The same workload and report as `end-to-end`, consumed by a hand-written async-nats
    /// loop running the service's statements: one message at a time through tokio-postgres, or
    /// through sqlx, the service's driver, per message and in batches (`--batch-size`), on
    /// PostgreSQL or SQLite: the bound of the service's CPU per message.
    HandWritten(Box<HandWrittenArgs>),
    /// SQLite's own bound for the natural key: the SQLite handler's statements in a tight loop
    /// on a fresh file, no NATS, a commit per message and per batch: messages per second.
    SqliteBound(bench_sqlite::SqliteBoundArgs),
    /// PostgreSQL's own bound for the natural key: the handler's statements, bound as the
    /// lanes bind them, through tokio-postgres on N connections in a tight loop, no NATS:
    /// messages per second.
    PostgresBound(bench_pg_bound::PostgresBoundArgs),
    /// Prints the pgbench script (the handler's statement, or one of the statements that bound
    /// it) and the SQL that seeds its books, for scripts/bench-vs-pgbench.sh and
    /// scripts/bench-cancel-guard.sh.
    PgbenchScript {
        #[arg(long, default_value_t = 1_000)]
        books: usize,
        /// Which statement: `reserve` (`RESERVE_SQL`) or a bound of it (see guard_cost.rs).
        #[arg(long, default_value = "reserve",
              value_parser = clap::builder::PossibleValuesParser::new(guard_cost::STATEMENTS))]
        statement: String,
        /// Placements per statement (its arrays' length): a pgbench transaction is a batch.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
        batch_size: u64,
        /// Prints the seeding SQL instead of the script.
        #[arg(long)]
        seed: bool,
        /// Prints `--statement` as the lanes prepare it instead of the script: its parameters
        /// ($1 to $7) kept, on one line, for scripts/bench-statement-instructions.sh.
        #[arg(long, conflicts_with_all = ["batch_size", "seed"])]
        prepared: bool,
    },
    /// Runs each dedup mode on PostgreSQL at each duplicate ratio, in a fresh database per
    /// run, and prints what the server spent: transactions, rollbacks, transaction ids, dead
    /// tuples made and left, WAL bytes and server-log bytes.
    Costs(CostsArgs),
    /// Draws criterion's median time per message of one benchmark group as an SVG line chart
    /// (one line per mode) and prints the medians as a Markdown table.
    Chart(ChartArgs),
    /// Seeds completed inbox rows in a fresh PostgreSQL database and purges them in batches
    /// while the inbox handler takes a steady flow of messages: how long the purge takes, and
    /// the handler's latency before and during it.
    Purge(PurgeArgs),
    /// The outbox relay: events/s draining a backlog of pending rows, and the latency from a
    /// decision's commit to its event stored in the stream under a steady flow.
    Relay(Box<bench_relay::RelayArgs>),
    /// A Redis pre-filter in front of the one-statement natural key: µs per fresh message and
    /// per duplicate with and without it, side by side in one run.
    Prefilter(bench_prefilter::PrefilterArgs),
    /// OrderPlaced on its book's subject at a set rate (or as fast as the stream stores them),
    /// PubAcks awaited asynchronously, many in flight: a steady load over many books, or one
    /// stream's store rate. Prints JSON: messages, seconds, msg/s, the publisher's CPU.
    PublishRate(Box<bench_publish_rate::PublishRateArgs>),
}

#[derive(Debug, clap::Args)]
pub struct HandWrittenArgs {
    /// The driver the lanes run the statements through: tokio-postgres (the default on
    /// PostgreSQL, one message at a time), or sqlx (the service's, and the only one on SQLite),
    /// to part the driver's cost from the service loop's.
    #[arg(long, value_enum)]
    pub driver: Option<Driver>,
    // Last: the heading of its NATS flags would stick to the flags after it.
    #[command(flatten)]
    pub run: bench_e2e::EndToEndArgs,
}

#[derive(Debug, clap::Args)]
pub struct PurgeArgs {
    /// Completed inbox rows seeded, all older than the retention.
    #[arg(long, default_value_t = 1_000_000)]
    pub rows: u64,
    /// Rows per purge batch (each its own transaction).
    #[arg(long, default_value_t = 5_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub batch_size: u64,
    /// Time between two messages of the flow.
    #[arg(long, default_value = "10ms", value_parser = humantime::parse_duration)]
    pub every: Duration,
    /// The PostgreSQL server for the fresh database.
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub database_url: String,
}

#[derive(Debug, clap::Args)]
pub struct CostsArgs {
    /// Messages per mode and duplicate ratio.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub messages: u64,
    /// Duplicate ratios to run, in percent, comma separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "10,50",
        value_parser = clap::value_parser!(u32).range(0..=100)
    )]
    pub ratios: Vec<u32>,
    /// The PostgreSQL server (postgres://…; its database part names the database to observe
    /// from, each run gets a new one). Default: the local server,
    /// postgres://postgres@127.0.0.1:5432/postgres.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// Prints JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct ChartArgs {
    /// Criterion's output directory (`target/criterion` of the workspace, or
    /// `$CARGO_TARGET_DIR/criterion`).
    #[arg(long, default_value = "target/criterion")]
    pub input: PathBuf,
    /// The benchmark group to draw.
    #[arg(long, default_value = "dedup_cost")]
    pub group: String,
    /// Where to write the SVG; without it only the table is printed.
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// The chart's title.
    #[arg(
        long,
        default_value = "Cost of dedup per message on PostgreSQL (criterion median)"
    )]
    pub title: String,
    /// What the benchmark parameter is.
    #[arg(long, default_value = "duplicate ratio (%)")]
    pub x_label: String,
    /// The table shows messages per second instead of microseconds per message.
    #[arg(long)]
    pub per_second: bool,
}

pub async fn run(command: BenchCommand) -> Result<bool> {
    match command {
        BenchCommand::EndToEnd(args) => end_to_end(&args, bench_e2e::Consumer::Service)
            .await
            .map(|()| true),
        BenchCommand::HandWritten(args) => {
            let driver = args
                .driver
                .unwrap_or_else(|| Driver::default_for(&args.run.database_url));
            end_to_end(&args.run, bench_e2e::Consumer::HandWritten(driver))
                .await
                .map(|()| true)
        }
        BenchCommand::PgbenchScript {
            books,
            statement,
            batch_size,
            seed,
            prepared,
        } => {
            if seed {
                println!("{}", bench_e2e::pgbench_seed_sql(books));
            } else {
                let statement = guard_cost::statement(&statement)
                    .with_context(|| format!("no statement {statement}"))?;
                if prepared {
                    println!("{}", bench_e2e::one_line(&statement));
                } else {
                    print!(
                        "{}",
                        bench_e2e::pgbench_script(&statement, books, batch_size)
                    );
                }
            }
            Ok(true)
        }
        BenchCommand::Costs(args) => costs(args).await.map(|()| true),
        BenchCommand::Chart(args) => draw_chart(&args).map(|()| true),
        BenchCommand::Purge(args) => purge(&args).await.map(|()| true),
        BenchCommand::Relay(args) => bench_relay::run(&args).await.map(|()| true),
        BenchCommand::SqliteBound(args) => bench_sqlite::run(&args).await.map(|()| true),
        BenchCommand::PostgresBound(args) => bench_pg_bound::run(&args).await.map(|()| true),
        BenchCommand::Prefilter(args) => bench_prefilter::run(&args).await.map(|()| true),
        BenchCommand::PublishRate(args) => bench_publish_rate::run(&args).await.map(|()| true),
    }
}

async fn purge(args: &PurgeArgs) -> Result<()> {
    if !db::is_postgres(&args.database_url) {
        bail!("the purge benchmark runs on PostgreSQL");
    }
    let fresh = FreshDatabase::create(Some(&args.database_url), "inventory_bench_purge", 4)
        .await
        .context("creating the benchmark database")?;
    let result = purge_under_flow(args, &fresh.conn).await;
    fresh.remove().await?;
    result
}

async fn purge_under_flow(args: &PurgeArgs, conn: &DatabaseConnection) -> Result<()> {
    use crate::consumers::DetectMode;
    use inventory_domain::{BookId, ConsumerName, Message, OrderId, Quantity, StockItem};
    use inventory_infra::StockRepository;

    let seeding = Instant::now();
    // One statement: completed a month ago, one millisecond apart.
    conn.execute_unprepared(&format!(
        "INSERT INTO inbox (message_id, consumer, received_at, completed_at, payload_hash) \
         SELECT 'seed-' || g, 'inventory-reserve-stock-inbox', now() - interval '31 days', \
                now() - interval '30 days' + g * interval '1 millisecond', repeat('0', 64) \
         FROM generate_series(1, {}) AS g; ANALYZE inbox",
        args.rows
    ))
    .await?;
    let seeded_in = seeding.elapsed();
    let book = BookId::new_v7();
    StockRepository::new(conn.clone())
        .put(&StockItem::new(book, "Dune", 1_000_000_000)?)
        .await?;
    let handler = HandlerKind::Inbox(DetectMode::OnConflict).build(
        conn,
        ConsumerName::parse("inventory-reserve-stock-inbox")?,
        None,
    )?;

    // The flow: one message every `every`, each handled on arrival, its start and duration kept.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flow = tokio::spawn({
        let stop = stop.clone();
        let every = args.every;
        async move {
            let mut log: Vec<(Instant, Duration)> = Vec::new();
            let mut ticks = tokio::time::interval(every);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                ticks.tick().await;
                let message =
                    Message::placed(OrderId::new_v7(), book, Quantity::new(1).expect("valid"));
                let started = Instant::now();
                handler.handle(&message).await?;
                log.push((started, started.elapsed()));
            }
            anyhow::Ok(log)
        }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    let purge_started = Instant::now();
    let cutoff = chrono::Utc::now() - chrono::Duration::days(1);
    let report = crate::purge::purge_completed(
        conn,
        "inventory-reserve-stock-inbox",
        cutoff,
        args.batch_size,
        false,
    )
    .await?;
    let purge_ended = Instant::now();
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let log = flow.await??;

    let latencies = |during: bool| {
        let mut took: Vec<Duration> = log
            .iter()
            .filter(|(at, _)| (*at >= purge_started && *at < purge_ended) == during)
            .map(|(_, took)| *took)
            .collect();
        took.sort_unstable();
        took
    };
    let at = |sorted: &[Duration], p: f64| {
        sorted
            .get(((sorted.len().saturating_sub(1)) as f64 * p).round() as usize)
            .copied()
            .unwrap_or_default()
    };
    let (outside, during) = (latencies(false), latencies(true));
    println!(
        "seeded {} rows in {seeded_in:.2?}; purged {} in {:.2?} ({} batches of {}); handling \
         outside the purge: p50 {:.2?}, max {:.2?} ({} messages); during: p50 {:.2?}, p99 \
         {:.2?}, max {:.2?} ({} messages)",
        args.rows,
        report.deleted,
        purge_ended - purge_started,
        report.batches,
        args.batch_size,
        at(&outside, 0.5),
        at(&outside, 1.0),
        outside.len(),
        at(&during, 0.5),
        at(&during, 0.99),
        at(&during, 1.0),
        during.len(),
    );
    Ok(())
}

async fn end_to_end(args: &bench_e2e::EndToEndArgs, consumer: bench_e2e::Consumer) -> Result<()> {
    let report = bench_e2e::run_with(args, consumer).await?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    println!(
        "{} messages ({} processed, {} duplicates) through {} lanes, batch {}, {} handler, {} consumer: {:.2} s, {:.0} messages/s; CPU {:.1} µs per message ({:.2} s user, {:.2} s system)",
        report.messages,
        report.processed,
        report.duplicates,
        report.concurrency,
        report.batch_size,
        report.handler,
        report.consumer,
        report.seconds,
        report.messages_per_second,
        report.cpu_micros_per_message,
        report.cpu_user_seconds,
        report.cpu_system_seconds,
    );
    if let Some(latency) = &report.latency {
        println!(
            "publish to handled, {} messages: p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            latency.samples, latency.p50_ms, latency.p90_ms, latency.p99_ms, latency.max_ms
        );
    }
    if let Some(rss) = &report.rss {
        println!(
            "VmRSS over {} samples: min {} KiB, max {} KiB, last {} KiB; VmHWM {} KiB",
            rss.samples.len(),
            rss.min_kib,
            rss.max_kib,
            rss.last_kib,
            rss.peak_kib
        );
    }
    Ok(())
}

fn draw_chart(args: &ChartArgs) -> Result<()> {
    let series = chart::read_group(&args.input, &args.group)?;
    if let Some(output) = &args.output {
        let svg = chart::render_svg(
            &series,
            &Labels {
                title: args.title.clone(),
                x_axis: args.x_label.clone(),
                y_axis: "median time per message (µs)".into(),
            },
        );
        if let Some(parent) = output.parent().filter(|dir| !dir.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        std::fs::write(output, svg).with_context(|| format!("writing {}", output.display()))?;
        eprintln!("wrote {}", output.display());
    }
    let unit = if args.per_second {
        chart::Unit::PerSecond
    } else {
        chart::Unit::Micros
    };
    print!("{}", chart::markdown_table(&series, &args.x_label, unit));
    print!("{}", break_even_report(&series));
    Ok(())
}

/// The pre-check's extra lookup against what it saves on a duplicate: each inbox mode's line
/// through its medians, and the ratio where the pre-check's line crosses the others'. Empty
/// unless the group has the pre-check (the dedup groups, whose parameter is the ratio).
fn break_even_report(series: &[chart::Series]) -> String {
    let fits: Vec<chart::Fit> = series.iter().filter_map(chart::fit).collect();
    let Some(pre_check) = fits.iter().find(|fit| fit.name == "inbox-pre-check") else {
        return String::new();
    };
    let mut out = String::from(
        "\nLinear fit per mode (µs per message = fresh × (1 − ratio) + duplicate × ratio):\n\n\
         | mode | fresh message | duplicate |\n| --- | ---: | ---: |\n",
    );
    for fit in &fits {
        out.push_str(&format!(
            "| {} | {:.0} | {:.0} |\n",
            fit.name, fit.fresh, fit.duplicate
        ));
    }
    out.push('\n');
    for other in fits
        .iter()
        .filter(|fit| fit.name.starts_with("inbox-") && fit.name != pre_check.name)
    {
        let on_fresh = pre_check.fresh - other.fresh;
        let on_duplicate = pre_check.duplicate - other.duplicate;
        let verdict = match chart::break_even(pre_check, other) {
            Some(ratio) if (0.0..=100.0).contains(&ratio) => {
                format!("the pre-check pays above {ratio:.0}% duplicates")
            }
            _ if pre_check.fresh + pre_check.duplicate < other.fresh + other.duplicate => {
                "the pre-check is cheaper at every ratio".to_owned()
            }
            _ => "the pre-check never pays".to_owned(),
        };
        out.push_str(&format!(
            "pre-check minus {}: {on_fresh:+.0} µs per fresh message, {on_duplicate:+.0} µs per duplicate: {verdict}\n",
            other.name
        ));
    }
    out
}

/// The tables whose dead tuples are counted: every table a handler writes.
const TABLES: [&str; 5] = [
    "inbox",
    "stock_reservations",
    "stock_items",
    "order_states",
    "reservation_log",
];

/// How long the sessions of a finished run may take to leave.
const SESSIONS_GONE_WITHIN: Duration = Duration::from_secs(30);

/// How long a probe line may take to reach the server log.
const PROBE_WITHIN: Duration = Duration::from_secs(5);

/// A server setting by name.
const SETTING_SQL: &str = "SELECT current_setting($1) AS value";

/// More log growth than this in one run is not read back to attribute it.
const MAX_LOG_READ: u64 = 64 * 1024 * 1024;

#[derive(Serialize)]
struct CostsReport {
    server_version: String,
    messages: u64,
    server_log: Option<String>,
    /// Why log bytes are missing, when they are.
    server_log_unavailable: Option<String>,
    runs: Vec<CostRun>,
}

#[derive(Serialize)]
struct CostRun {
    mode: &'static str,
    duplicate_percent: u32,
    messages: u64,
    duplicates: u64,
    seconds: f64,
    /// This database's committed transactions.
    commits: i64,
    /// This database's rolled-back transactions.
    rollbacks: i64,
    /// Transaction ids assigned on the whole server during the run.
    xids_server_wide: i64,
    /// Dead tuples the run made per table: every update's old version, every aborted insert
    /// (`n_tup_ins + n_tup_upd - n_live_tup`; no rows are deleted).
    dead_tuples_made: BTreeMap<&'static str, i64>,
    dead_tuples_made_total: i64,
    /// `n_dead_tup` per table after the run: those made less those page pruning removed.
    dead_tuples_left: BTreeMap<&'static str, i64>,
    dead_tuples_left_total: i64,
    /// WAL written by the whole server during the run.
    wal_bytes_server_wide: i64,
    /// Bytes of the log records naming this run's database.
    log_bytes: Option<u64>,
    /// Growth of the log file during the run, every session's.
    log_bytes_server_wide: Option<u64>,
}

async fn costs(args: CostsArgs) -> Result<()> {
    let server = match args.database_url {
        Some(url) if db::is_postgres(&url) => url,
        Some(_) => bail!(
            "bench costs measures PostgreSQL's statistics: --database-url (or DATABASE_URL) must be a postgres:// URL"
        ),
        None => workload::DEFAULT_POSTGRES_SERVER.to_owned(),
    };
    let observer = connect(&server, 1).await.with_context(|| {
        format!(
            "connecting to {}",
            inventory_infra::redact::redact_url(&server)
        )
    })?;
    let server_version = text(&observer, "SELECT version() AS value", []).await?;
    let version_num: i64 = text(&observer, SETTING_SQL, ["server_version_num".into()])
        .await?
        .trim()
        .parse()
        .context("server_version_num")?;
    let log = ServerLog::find(&observer).await;
    let mut runs = Vec::new();
    for mode in workload::DEDUP {
        for &percent in &args.ratios {
            if !args.json {
                eprintln!(
                    "running {} at {percent}% duplicates ({} messages)",
                    mode.label(),
                    args.messages
                );
            }
            let run = run_once(
                &observer,
                &server,
                version_num,
                log.as_ref().ok(),
                mode,
                percent,
                args.messages,
            )
            .await
            .with_context(|| format!("{} at {percent}% duplicates", mode.label()))?;
            runs.push(run);
        }
    }
    observer.close().await?;
    let report = CostsReport {
        server_version,
        messages: args.messages,
        server_log: log.as_ref().ok().map(|log| log.path.clone()),
        server_log_unavailable: log.as_ref().err().cloned(),
        runs,
    };
    let mut out = std::io::stdout().lock();
    if args.json {
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
    } else {
        out.write_all(render(&report).as_bytes())?;
    }
    Ok(())
}

/// The server-wide readings before or after a run.
struct Mark {
    commits: i64,
    rollbacks: i64,
    next_xid: i64,
    wal_lsn: String,
    log: Option<LogSpan>,
}

/// Where a probe line landed in the server log.
#[derive(Debug, Clone, Copy)]
struct LogSpan {
    /// The offset of the probe's line: what was logged before it ends here.
    probe_start: u64,
    /// The file's size once the probe was seen: what is logged later starts after this.
    seen_end: u64,
}

async fn run_once(
    observer: &DatabaseConnection,
    server: &str,
    version_num: i64,
    log: Option<&ServerLog>,
    mode: HandlerKind,
    percent: u32,
    messages: u64,
) -> Result<CostRun> {
    let fresh = FreshDatabase::create(Some(server), "inventory_costs", 1)
        .await
        .context("creating a fresh database")?;
    let name = database_name(&fresh.url)?;
    let result = measure(
        observer,
        &fresh,
        &name,
        version_num,
        log,
        mode,
        percent,
        messages,
    )
    .await;
    let removed = fresh.remove().await.context("dropping the run's database");
    let run = result?;
    removed?;
    Ok(run)
}

#[expect(
    clippy::too_many_arguments,
    reason = "the inputs of one measured run: where it reads its figures, the mode, the ratio, the size"
)]
async fn measure(
    observer: &DatabaseConnection,
    fresh: &FreshDatabase,
    name: &str,
    version_num: i64,
    log: Option<&ServerLog>,
    mode: HandlerKind,
    percent: u32,
    messages: u64,
) -> Result<CostRun> {
    // Set-up, not measured: no autovacuum on the run's tables, stock, the messages.
    for table in TABLES {
        fresh
            .conn
            .execute_unprepared(&format!(
                "ALTER TABLE {table} SET (autovacuum_enabled = false)"
            ))
            .await?;
    }
    let books = workload::stock_books(&fresh.conn, 1).await?;
    let deliveries: Vec<Delivery> = DuplicateStream::new(
        percent,
        CopyKind::caught_by(mode),
        books,
        u64::from(percent),
    )?
    .take(messages);
    let duplicates = deliveries
        .iter()
        .filter(|delivery| delivery.is_copy)
        .count() as u64;
    fresh.conn.close_by_ref().await?;

    let before = mark(observer, name, version_num, log).await?;
    let work = connect(&fresh.url, 1).await?;
    let handler = workload::handler(mode, &work)?;
    let started = Instant::now();
    for delivery in &deliveries {
        let outcome = handler.handle(&delivery.message).await?;
        if !delivery.as_expected(&outcome) {
            bail!(
                "a {} message came out {outcome:?}",
                if delivery.is_copy { "copied" } else { "fresh" }
            );
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    drop(handler);
    work.close().await?;
    let after = mark(observer, name, version_num, log).await?;

    let reader = connect(&fresh.url, 1).await?;
    let (dead_tuples_made, dead_tuples_left) = dead_tuples(&reader).await?;
    reader.close().await?;

    let wal_bytes = integer(
        observer,
        "SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)::bigint AS value",
        [after.wal_lsn.clone().into(), before.wal_lsn.clone().into()],
    )
    .await?;
    let span = before.log.zip(after.log);
    let (log_bytes, log_bytes_server_wide) = match (log, span) {
        (Some(log), Some((before, after))) if after.probe_start >= before.seen_end => {
            let (from, to) = (before.seen_end, after.probe_start);
            let own = log.bytes_naming(observer, name, from, to).await?;
            (own, Some(to - from))
        }
        _ => (None, None),
    };
    Ok(CostRun {
        mode: mode.label(),
        duplicate_percent: percent,
        messages,
        duplicates,
        seconds,
        commits: after.commits - before.commits,
        rollbacks: after.rollbacks - before.rollbacks,
        xids_server_wide: after.next_xid - before.next_xid,
        dead_tuples_made_total: dead_tuples_made.values().sum(),
        dead_tuples_made,
        dead_tuples_left_total: dead_tuples_left.values().sum(),
        dead_tuples_left,
        wal_bytes_server_wide: wal_bytes,
        log_bytes,
        log_bytes_server_wide,
    })
}

/// Waits until no session is left on database `name`, so every one has flushed its
/// statistics, then reads the counters.
async fn mark(
    observer: &DatabaseConnection,
    name: &str,
    version_num: i64,
    log: Option<&ServerLog>,
) -> Result<Mark> {
    let deadline = Instant::now() + SESSIONS_GONE_WITHIN;
    loop {
        let sessions = integer(
            observer,
            "SELECT count(*) AS value FROM pg_stat_activity WHERE datname = $1",
            [name.into()],
        )
        .await?;
        if sessions == 0 {
            break;
        }
        if Instant::now() > deadline {
            bail!("{sessions} sessions still on {name} after {SESSIONS_GONE_WITHIN:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if version_num < 150_000 {
        // The statistics collector receives an exiting backend's counts asynchronously.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        observer
            .execute_unprepared("SELECT pg_stat_clear_snapshot()")
            .await?;
    }
    let row = one(
        observer,
        "SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = $1",
        [name.into()],
    )
    .await?;
    let commits: i64 = row.try_get("", "xact_commit")?;
    let rollbacks: i64 = row.try_get("", "xact_rollback")?;
    let next_xid = integer(
        observer,
        "SELECT txid_snapshot_xmax(txid_current_snapshot()) AS value",
        [],
    )
    .await?;
    let wal_lsn = text(observer, "SELECT pg_current_wal_lsn()::text AS value", []).await?;
    let log = match log {
        Some(log) => Some(log.sync(observer).await?),
        None => None,
    };
    Ok(Mark {
        commits,
        rollbacks,
        next_xid,
        wal_lsn,
        log,
    })
}

type PerTable = BTreeMap<&'static str, i64>;

/// Dead tuples made and left, per table. The tables are new and autovacuum (hence
/// auto-analyze) is off for them, so `n_live_tup` is the exact count the statistics keep.
async fn dead_tuples(conn: &DatabaseConnection) -> Result<(PerTable, PerTable)> {
    let rows = conn
        .query_all_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT relname::text AS relname, n_dead_tup, \
             n_tup_ins + n_tup_upd - n_live_tup AS made FROM pg_stat_user_tables",
        ))
        .await?;
    let (mut made, mut left) = (BTreeMap::new(), BTreeMap::new());
    for row in rows {
        let table: String = row.try_get("", "relname")?;
        if let Some(known) = TABLES.iter().find(|known| **known == table) {
            made.insert(*known, row.try_get::<i64>("", "made")?);
            left.insert(*known, row.try_get::<i64>("", "n_dead_tup")?);
        }
    }
    Ok((made, left))
}

/// The server's log file, as the server itself reads it (`pg_stat_file`, `pg_read_binary_file`:
/// superuser or `pg_read_server_files`), so it works wherever the server runs.
struct ServerLog {
    path: String,
    /// `log_line_prefix` names the database (`%d`), so a run's own records can be told apart.
    names_database: bool,
    /// The prefix begins with a time stamp, so a line not starting with a digit continues the
    /// record before it (a multi-line statement).
    stamped: bool,
}

impl ServerLog {
    /// Finds the log file and checks, with a probe line, that the server writes to it. `Err`
    /// says why log bytes cannot be measured.
    async fn find(observer: &DatabaseConnection) -> Result<Self, String> {
        let current = optional_text(observer, "SELECT pg_current_logfile() AS value")
            .await
            .map_err(|error| format!("pg_current_logfile() failed: {error}"))?;
        let path = match current {
            Some(path) => path,
            None => {
                let cluster = text(observer, SETTING_SQL, ["cluster_name".into()])
                    .await
                    .map_err(|error| format!("reading cluster_name: {error}"))?;
                if cluster.is_empty() {
                    return Err(
                        "the logging collector is off and the server has no cluster_name to find Debian's log file by"
                            .into(),
                    );
                }
                format!(
                    "/var/log/postgresql/postgresql-{}.log",
                    cluster.replace('/', "-")
                )
            }
        };
        let prefix = text(observer, SETTING_SQL, ["log_line_prefix".into()])
            .await
            .map_err(|error| format!("reading log_line_prefix: {error}"))?;
        let log = Self {
            names_database: prefix.contains("%d"),
            stamped: ["%m", "%t", "%n", "%s"]
                .iter()
                .any(|escape| prefix.starts_with(escape)),
            path,
        };
        log.sync(observer)
            .await
            .map_err(|error| format!("{}: {error:#}", log.path))?;
        Ok(log)
    }

    async fn size(&self, observer: &DatabaseConnection) -> Result<u64> {
        let size = integer(
            observer,
            "SELECT (pg_stat_file($1)).size AS value",
            [self.path.clone().into()],
        )
        .await?;
        Ok(u64::try_from(size)?)
    }

    async fn read(&self, observer: &DatabaseConnection, from: u64, to: u64) -> Result<Vec<u8>> {
        let row = one(
            observer,
            "SELECT pg_read_binary_file($1, $2, $3) AS value",
            [
                self.path.clone().into(),
                i64::try_from(from)?.into(),
                i64::try_from(to.saturating_sub(from))?.into(),
            ],
        )
        .await?;
        Ok(row.try_get("", "value")?)
    }

    /// Logs a probe line and waits until it is in the file: everything logged before it is
    /// written then.
    async fn sync(&self, observer: &DatabaseConnection) -> Result<LogSpan> {
        let start = self.size(observer).await?;
        let probe = format!("inventory bench costs probe {}", uuid::Uuid::new_v4());
        observer
            .execute_unprepared(&format!("DO $$BEGIN RAISE LOG '{probe}'; END$$"))
            .await?;
        let deadline = Instant::now() + PROBE_WITHIN;
        loop {
            let end = self.size(observer).await?;
            if end < start {
                bail!("the log file shrank (rotated?)");
            }
            if end - start > MAX_LOG_READ {
                bail!("the log grew by more than {MAX_LOG_READ} bytes in a moment");
            }
            let bytes = self.read(observer, start, end).await?;
            if let Some(at) = find(&bytes, probe.as_bytes()) {
                let line_start = bytes[..at]
                    .iter()
                    .rposition(|byte| *byte == b'\n')
                    .map_or(0, |newline| newline + 1);
                return Ok(LogSpan {
                    probe_start: start + line_start as u64,
                    seen_end: end,
                });
            }
            if Instant::now() > deadline {
                bail!(
                    "a RAISE LOG probe line did not appear within {PROBE_WITHIN:?} (log_min_messages above LOG, or the server logs elsewhere)"
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Bytes of the records between `from` and `to` that name database `name`; `None` when the
    /// log line prefix does not name databases or the span is too large to read.
    async fn bytes_naming(
        &self,
        observer: &DatabaseConnection,
        name: &str,
        from: u64,
        to: u64,
    ) -> Result<Option<u64>> {
        if !self.names_database || to - from > MAX_LOG_READ {
            return Ok(None);
        }
        let bytes = self.read(observer, from, to).await?;
        Ok(Some(bytes_naming(&bytes, name.as_bytes(), self.stamped)))
    }
}

/// Sums the lines that contain `name`, and when `stamped`, the continuation lines (not starting
/// with a digit) of the records that do.
fn bytes_naming(log: &[u8], name: &[u8], stamped: bool) -> u64 {
    let mut total = 0;
    let mut in_record = false;
    for line in log.split_inclusive(|byte| *byte == b'\n') {
        let continues = stamped && !line.first().is_some_and(u8::is_ascii_digit);
        in_record = if continues {
            in_record
        } else {
            find(line, name).is_some()
        };
        if in_record {
            total += line.len() as u64;
        }
    }
    total
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

fn database_name(url: &str) -> Result<String> {
    let without_query = url.split('?').next().unwrap_or(url);
    without_query
        .rsplit_once('/')
        .map(|(_, name)| name.to_owned())
        .filter(|name| !name.is_empty())
        .with_context(|| {
            format!(
                "no database name in {}",
                inventory_infra::redact::redact_url(url)
            )
        })
}

async fn one<const N: usize>(
    conn: &DatabaseConnection,
    sql: &str,
    values: [Value; N],
) -> Result<QueryResult> {
    conn.query_one_raw(Statement::from_sql_and_values(
        DbBackend::Postgres,
        sql,
        values,
    ))
    .await?
    .with_context(|| format!("no row from {sql}"))
}

async fn integer<const N: usize>(
    conn: &DatabaseConnection,
    sql: &str,
    values: [Value; N],
) -> Result<i64> {
    Ok(one(conn, sql, values).await?.try_get("", "value")?)
}

async fn text<const N: usize>(
    conn: &DatabaseConnection,
    sql: &str,
    values: [Value; N],
) -> Result<String> {
    Ok(one(conn, sql, values).await?.try_get("", "value")?)
}

async fn optional_text(conn: &DatabaseConnection, sql: &str) -> Result<Option<String>> {
    Ok(one(conn, sql, []).await?.try_get("", "value")?)
}

fn render(report: &CostsReport) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "{} messages per mode and duplicate ratio, one fresh database each, on {}\n\n",
        report.messages,
        report
            .server_version
            .split(" on ")
            .next()
            .unwrap_or(&report.server_version)
    ));
    out.push_str(&format!(
        "{:<26} {:>4} {:>7} {:>8} {:>9} {:>8} {:>9} {:>9} {:>11} {:>10}  {}\n",
        "mode",
        "dup%",
        "µs/msg",
        "commits",
        "rollbacks",
        "xids*",
        "dead made",
        "dead left",
        "WAL bytes*",
        "log bytes",
        "dead made by table"
    ));
    for run in &report.runs {
        let by_table: Vec<String> = run
            .dead_tuples_made
            .iter()
            .filter(|(_, count)| **count > 0)
            .map(|(table, count)| format!("{table} {count}"))
            .collect();
        out.push_str(&format!(
            "{:<26} {:>4} {:>7.0} {:>8} {:>9} {:>8} {:>9} {:>9} {:>11} {:>10}  {}\n",
            run.mode,
            run.duplicate_percent,
            run.seconds * 1e6 / run.messages as f64,
            run.commits,
            run.rollbacks,
            run.xids_server_wide,
            run.dead_tuples_made_total,
            run.dead_tuples_left_total,
            run.wal_bytes_server_wide,
            run.log_bytes
                .map_or_else(|| "n/a".to_owned(), |bytes| bytes.to_string()),
            by_table.join(", ")
        ));
    }
    out.push('\n');
    out.push_str(
        "* the whole server's: other sessions running meanwhile inflate transaction ids and WAL.\n\
         Commits, rollbacks and dead tuples are the run's database's own. Dead made: old versions\n\
         of updated rows and aborted inserts (n_tup_ins + n_tup_upd - n_live_tup); dead left:\n\
         n_dead_tup after the run with autovacuum off, less what page pruning already removed.\n",
    );
    match (&report.server_log, &report.server_log_unavailable) {
        (Some(path), _) => {
            let server_wide: Vec<String> = report
                .runs
                .iter()
                .map(|run| {
                    run.log_bytes_server_wide
                        .map_or_else(|| "n/a".into(), |bytes| bytes.to_string())
                })
                .collect();
            out.push_str(&format!(
                "log bytes: the records of {path} naming the run's database; the file grew by {} in the runs, other sessions' lines included.\n",
                server_wide.join(", ")
            ));
        }
        (None, Some(why)) => out.push_str(&format!("log bytes n/a: {why}\n")),
        (None, None) => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{bytes_naming, database_name};

    #[test]
    fn log_records_are_attributed_by_database_name_with_their_continuations() {
        let log = b"2025-01-01 10:00:00.000 UTC [1] postgres@db_a ERROR:  duplicate key\n\
2025-01-01 10:00:00.000 UTC [1] postgres@db_a STATEMENT:  WITH x AS (\n\
    SELECT 1\n\
)\n\
2025-01-01 10:00:00.001 UTC [2] postgres@db_b ERROR:  other\n\
    continued\n";
        let lines: Vec<usize> = log
            .split_inclusive(|byte| *byte == b'\n')
            .map(<[u8]>::len)
            .collect();
        let first_record: usize = lines[..4].iter().sum();
        assert_eq!(bytes_naming(log, b"db_a", true), first_record as u64);
        assert_eq!(
            bytes_naming(log, b"db_a", false),
            (lines[0] + lines[1]) as u64
        );
        assert_eq!(bytes_naming(log, b"db_c", true), 0);
    }

    #[test]
    fn the_database_name_is_the_last_path_segment() {
        assert_eq!(
            database_name("postgres://u@h:5432/inventory_costs_1?sslmode=disable").ok(),
            Some("inventory_costs_1".to_owned())
        );
    }
}
