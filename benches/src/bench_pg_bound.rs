//! `inventory bench postgres-bound`: PostgreSQL's own bound for the natural key, the figure the
//! service on PostgreSQL is measured against beside pgbench. The handler's own statement
//! ([`RESERVE_SQL`], on one placement or on `--batch-size` of them) prepared once on each
//! of N tokio-postgres connections and run in a tight loop with no NATS, over the messages of
//! `inventory bench end-to-end` ([`placements`]): fresh orders over many books, a tenth of them
//! resent under a new message id. Each connection takes the next message (or the next batch)
//! as a lane takes the next delivery.
//!
//! pgbench runs the same statements, but it can bind only numbers: its script computes each
//! uuid in the statement (`md5('o' || :n)::uuid`) at every place the parameter is named, and
//! sends no resends. Here the values are bound as the lanes bind them, so the database does the
//! lanes' work and nothing more.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::Instant;

use crate::bench_hand::UNSHARDED;
use crate::fresh::FreshDatabase;
use anyhow::{Context as _, Result, ensure};
use inventory_domain::OrderId;
use inventory_domain::keyed_placements;
use inventory_domain::outbox::partition;
use inventory_infra::consumers::natural_pg::RESERVE_SQL;
use serde::Serialize;
use tokio::task::JoinSet;
use uuid::Uuid;

use crate::bench_e2e::{ensure_reserved, placements};
use crate::bench_hand::{self, Placed};
use crate::workload;

#[derive(Debug, Clone, clap::Args)]
pub struct PostgresBoundArgs {
    /// Orders placed per run (each once, plus the resends).
    #[arg(long, default_value_t = 20_000)]
    pub messages: usize,
    /// Connections running statements at once, one run each, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub concurrency: Vec<usize>,
    /// Messages per statement.
    #[arg(long, default_value_t = 1)]
    pub batch_size: usize,
    /// Fraction of orders resent under a new message id.
    #[arg(long, default_value_t = 0.1)]
    pub duplicates: f64,
    /// Books the orders spread over.
    #[arg(long, default_value_t = 1_000)]
    pub books: usize,
    /// PostgreSQL server for the fresh database of each run.
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub database_url: String,
    /// Prints JSON instead of lines of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct PostgresBoundReport {
    pub concurrency: usize,
    pub batch_size: usize,
    pub messages: u64,
    pub seconds: f64,
    pub messages_per_second: f64,
}

pub async fn run(args: &PostgresBoundArgs) -> Result<()> {
    ensure!(
        inventory_infra::db::is_postgres(&args.database_url),
        "the PostgreSQL bound needs a postgres:// URL"
    );
    let batch_size = args.batch_size.max(1);
    let mut reports = Vec::with_capacity(args.concurrency.len());
    for &concurrency in &args.concurrency {
        let fresh = FreshDatabase::create(Some(&args.database_url), "inventory_bound", 1)
            .await
            .context("creating the benchmark database")?;
        let result = measure(args, concurrency.max(1), batch_size, &fresh).await;
        fresh.remove().await?;
        let report = result?;
        if !args.json {
            println!(
                "postgres-bound: {:>2} connection(s), {:>2} message(s) per statement: {:>6} messages in {:.2} s, {:.0} messages/s",
                report.concurrency,
                report.batch_size,
                report.messages,
                report.seconds,
                report.messages_per_second
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
    args: &PostgresBoundArgs,
    concurrency: usize,
    batch_size: usize,
    fresh: &FreshDatabase,
) -> Result<PostgresBoundReport> {
    let books = workload::stock_books(&fresh.conn, args.books.max(1)).await?;
    let (messages, expected_reserved) = placements(args.messages, args.duplicates, &books)?;
    let placements: Arc<Vec<Placed>> = Arc::new(
        keyed_placements(&messages)
            .into_iter()
            .map(|(key, placed)| {
                Ok(Placed {
                    message_id: key.into_owned(),
                    order_id: placed.order_id.as_uuid(),
                    book_id: placed.book_id.as_uuid(),
                    quantity: i32::try_from(placed.quantity.get())?,
                })
            })
            .collect::<Result<_>>()?,
    );
    let mut connections = Vec::with_capacity(concurrency);
    for _ in 0..concurrency {
        connections.push(Connection::open(&fresh.url).await?);
    }
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut running = JoinSet::new();
    for connection in connections {
        let (placements, next) = (placements.clone(), next.clone());
        running.spawn(async move {
            loop {
                let start = next.fetch_add(batch_size, Relaxed);
                let Some(taken) = placements.get(start..placements.len().min(start + batch_size))
                else {
                    return anyhow::Ok(());
                };
                match taken {
                    [] => return Ok(()),
                    [one] => connection.reserve(one).await?,
                    many => connection.reserve_together(many).await?,
                }
            }
        });
    }
    while let Some(finished) = running.join_next().await {
        finished??;
    }
    let seconds = started.elapsed().as_secs_f64();
    ensure_reserved(&fresh.conn, expected_reserved).await?;
    Ok(PostgresBoundReport {
        concurrency,
        batch_size,
        messages: placements.len() as u64,
        seconds,
        messages_per_second: placements.len() as f64 / seconds,
    })
}

/// A connection with the statement prepared on it.
struct Connection {
    client: tokio_postgres::Client,
    statement: tokio_postgres::Statement,
}

impl Connection {
    async fn open(url: &str) -> Result<Self> {
        let client = bench_hand::connect(url).await?;
        let statement = client.prepare(RESERVE_SQL).await?;
        Ok(Self { client, statement })
    }

    async fn reserve(&self, placed: &Placed) -> Result<()> {
        bench_hand::reserve(&self.client, &self.statement, placed).await?;
        Ok(())
    }

    /// The statement on a batch, then, as the handler does, on each placement it left
    /// undecided alone: neither decided nor found taken, nor a copy of one decided before it.
    async fn reserve_together(&self, placements: &[Placed]) -> Result<()> {
        let orders: Vec<Uuid> = placements.iter().map(|p| p.order_id).collect();
        let books: Vec<Uuid> = placements.iter().map(|p| p.book_id).collect();
        let quantities: Vec<i32> = placements.iter().map(|p| p.quantity).collect();
        let keys: Vec<&str> = placements.iter().map(|p| p.message_id.as_str()).collect();
        let indexes: Vec<i32> = (0..placements.len())
            .map(i32::try_from)
            .collect::<Result<_, _>>()?;
        let event_ids: Vec<Uuid> = placements.iter().map(|_| Uuid::now_v7()).collect();
        let partitions: Vec<i16> = placements
            .iter()
            .map(|p| partition(OrderId::from(p.order_id)))
            .collect();
        let rows = self
            .client
            .query(
                &self.statement,
                &[
                    &orders,
                    &books,
                    &quantities,
                    &keys,
                    &indexes,
                    &event_ids,
                    &partitions,
                    &vec![UNSHARDED; placements.len()],
                ],
            )
            .await?;
        ensure!(rows.len() == placements.len(), "one row per placement");
        for (at, (placement, row)) in placements.iter().zip(&rows).enumerate() {
            let decided = row.try_get::<_, Option<&str>>("inserted_status")?.is_some()
                || row
                    .try_get::<_, Option<i32>>("existing_quantity")?
                    .is_some()
                || !row.try_get::<_, bool>("book_found")?;
            let copy_of_earlier = placements[..at].iter().any(|earlier| {
                (earlier.order_id, earlier.book_id) == (placement.order_id, placement.book_id)
            });
            if !decided && !copy_of_earlier {
                self.reserve(placement).await?;
            }
        }
        Ok(())
    }
}
