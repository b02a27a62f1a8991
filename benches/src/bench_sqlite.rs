//! `inventory bench sqlite-bound`: SQLite's own bound for the natural key, the figure the
//! service on SQLite is measured against. The handler's own statements (`natural_sqlite.rs`:
//! [`reserve_each`] inside [`in_transaction`]) on a connection opened as the handler opens its
//! writer (sqlx, WAL, synchronous FULL), in a tight loop with no NATS: one commit per message,
//! or per batch of K, on a fresh temporary file per batch size. The messages are those of
//! `inventory bench end-to-end` ([`placements`]): fresh orders over many books, a tenth of
//! them resent under a new message id.

use std::time::Instant;

use crate::fresh::FreshDatabase;
use anyhow::{Context as _, Result};
use inventory_domain::keyed_placements;
use inventory_infra::consumers::natural_sqlite::{in_transaction, reserve_each, writer_options};
use sea_orm::sqlx::{ConnectOptions as _, Connection as _};
use serde::Serialize;

use crate::bench_e2e::{ensure_reserved, placements};
use crate::workload;

#[derive(Debug, Clone, clap::Args)]
pub struct SqliteBoundArgs {
    /// Orders placed per run (each once, plus the resends).
    #[arg(long, default_value_t = 20_000)]
    pub messages: usize,
    /// Messages per commit, one run each, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    pub batch_sizes: Vec<usize>,
    /// Fraction of orders resent under a new message id.
    #[arg(long, default_value_t = 0.1)]
    pub duplicates: f64,
    /// Books the orders spread over.
    #[arg(long, default_value_t = 1_000)]
    pub books: usize,
    /// Prints JSON instead of lines of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct BoundReport {
    pub batch_size: usize,
    pub messages: u64,
    pub seconds: f64,
    pub messages_per_second: f64,
}

pub async fn run(args: &SqliteBoundArgs) -> Result<()> {
    let mut reports = Vec::with_capacity(args.batch_sizes.len());
    for &batch_size in &args.batch_sizes {
        let fresh = FreshDatabase::create(None, "inventory_bound", 1)
            .await
            .context("creating the benchmark database")?;
        let result = measure(args, batch_size.max(1), &fresh).await;
        fresh.remove().await?;
        let report = result?;
        if !args.json {
            println!(
                "sqlite-bound: a commit per {:>2} message(s): {:>6} messages in {:.2} s, {:.0} messages/s",
                report.batch_size, report.messages, report.seconds, report.messages_per_second
            );
        }
        reports.push(report);
    }
    if args.json {
        println!("{}", serde_json::to_string(&reports)?);
    }
    Ok(())
}

async fn measure(
    args: &SqliteBoundArgs,
    batch_size: usize,
    fresh: &FreshDatabase,
) -> Result<BoundReport> {
    let books = workload::stock_books(&fresh.conn, args.books.max(1)).await?;
    let (messages, expected_reserved) = placements(args.messages, args.duplicates, &books)?;
    let placements = keyed_placements(&messages);
    let mut connection = writer_options(&fresh.conn).connect().await?;
    let started = Instant::now();
    for batch in placements.chunks(batch_size) {
        in_transaction(&mut connection, async |connection| {
            reserve_each(connection, batch).await
        })
        .await?;
    }
    let seconds = started.elapsed().as_secs_f64();
    connection.close().await?;
    ensure_reserved(&fresh.conn, expected_reserved).await?;
    Ok(BoundReport {
        batch_size,
        messages: placements.len() as u64,
        seconds,
        messages_per_second: placements.len() as f64 / seconds,
    })
}
