//! `inventory bench prefilter`: what a Redis pre-filter in front of the natural key saves per
//! duplicate and costs per fresh message. The one-statement handler `serve` runs, one message
//! at a time, with and without [`PreFiltered`] around it, in one run: each round measures the
//! four cases in turn (fresh and duplicate, each with and without the cache), so a machine that
//! slows down slows all four. A duplicate is a copy of a message handled earlier in the run
//! through the same path, so the pre-filtered copies find their keys in the cache.

use crate::produce::Produce as _;
use std::time::Instant;

use crate::consumers::{HandlerKind, NaturalKeyPath};
use anyhow::{Context as _, Result, ensure};
use inventory_domain::{BookId, ConsumerName, Message, OrderId, Quantity, StockItem};
use inventory_infra::{MessageHandler, StockRepository};

use crate::cache::{DedupCache, PreFiltered};
use crate::demo::DEFAULT_REDIS_URL;
use crate::fresh::FreshDatabase;

#[derive(Debug, Clone, clap::Args)]
pub struct PrefilterArgs {
    /// Server for the fresh database (postgres://…); a temporary SQLite file with sqlite://.
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub database_url: String,
    /// The Redis the pre-filter runs on.
    #[arg(long, env = "REDIS_URL", hide_env_values = true, default_value = DEFAULT_REDIS_URL)]
    pub redis_url: String,
    /// Messages per case and round.
    #[arg(long, default_value_t = 2_000)]
    pub messages: usize,
    /// Rounds of the four cases.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
}

const BOOKS: usize = 100;

const CASES: [&str; 4] = [
    "fresh, database only",
    "fresh, pre-filtered",
    "duplicate, database only",
    "duplicate, pre-filtered (a cache hit)",
];

pub async fn run(args: &PrefilterArgs) -> Result<()> {
    let server =
        inventory_infra::db::is_postgres(&args.database_url).then_some(args.database_url.as_str());
    let fresh = FreshDatabase::create(server, "inventory_bench_prefilter", 2)
        .await
        .context("creating the benchmark database")?;
    let result = measure(args, &fresh).await;
    fresh.remove().await?;
    let medians = result?;
    let [fresh_db, fresh_cached, dup_db, dup_cached] = medians;
    let (saves, costs) = (dup_db - dup_cached, fresh_cached - fresh_db);
    println!(
        "the pre-filter saves {saves:.0} µs per duplicate ({:.0}% of the database's {dup_db:.0} µs) and costs {costs:.0} µs per fresh message ({:+.0}%)",
        saves / dup_db * 100.0,
        costs / fresh_db * 100.0,
    );
    // d·saves = (1 − d)·costs: the share of duplicates at which the two paths cost the same.
    if saves > 0.0 {
        println!(
            "it pays for itself above {:.0}% duplicates",
            costs.max(0.0) / (costs.max(0.0) + saves) * 100.0
        );
    } else {
        println!(
            "it never pays for itself here: a cache hit costs what the database's refusal does"
        );
    }
    Ok(())
}

/// The median µs per message of each case over the rounds, printed with their spread.
async fn measure(args: &PrefilterArgs, fresh: &FreshDatabase) -> Result<[f64; 4]> {
    let stock = StockRepository::new(fresh.conn.clone());
    let mut books = Vec::with_capacity(BOOKS);
    for _ in 0..BOOKS {
        let item = StockItem::new(BookId::new_v7(), "Dune", 1_000_000_000)?;
        stock.put(&item).await?;
        books.push(item.book_id);
    }
    let handler = HandlerKind::NaturalKey(NaturalKeyPath::OneStatement).build(
        &fresh.conn,
        ConsumerName::parse("inventory-reserve-stock")?,
        None,
    )?;
    let prefix = format!(
        "inventory-bench-prefilter:{}",
        uuid::Uuid::new_v4().simple()
    );
    let cache = DedupCache::connect(&args.redis_url, &prefix)
        .await
        .with_context(|| format!("connecting to Redis ({})", args.redis_url))?;
    let filtered = PreFiltered {
        cache: cache.clone(),
        handler: handler.clone(),
    };
    let one = Quantity::new(1)?;
    let mut orders = 0;
    let mut timings: [Vec<f64>; 4] = Default::default();
    for _ in 0..args.rounds {
        let batch = |count: usize| -> Vec<Message> {
            (0..count)
                .map(|i| Message::placed(OrderId::new_v7(), books[i % BOOKS], one))
                .collect()
        };
        let (direct, cached) = (batch(args.messages), batch(args.messages));
        timings[0].push(per_message(&handler, &direct).await?);
        timings[1].push(per_message(&filtered, &cached).await?);
        timings[2].push(per_message(&handler, &direct).await?);
        timings[3].push(per_message(&filtered, &cached).await?);
        orders += 2 * args.messages;
    }
    cache.clear().await?;
    let mut reserved = 0;
    for book in &books {
        reserved += stock.get(*book).await?.context("a book vanished")?.reserved;
    }
    ensure!(
        reserved == i64::try_from(orders)?,
        "reserved {reserved} copies where {orders} orders of one were placed once each"
    );
    let mut medians = [0.0; 4];
    for ((case, runs), median) in CASES.iter().zip(&mut timings).zip(&mut medians) {
        runs.sort_by(f64::total_cmp);
        *median = runs[runs.len() / 2];
        println!(
            "{case:<38} {median:>7.0} µs/message (rounds {:.0} to {:.0})",
            runs[0],
            runs[runs.len() - 1]
        );
    }
    Ok(medians)
}

/// Handles `messages` one after another; µs per message. Every one must be processed or a
/// duplicate, or the figure would time something else.
async fn per_message(handler: &impl MessageHandler, messages: &[Message]) -> Result<f64> {
    let started = Instant::now();
    for message in messages {
        let outcome = handler.handle(message).await?;
        ensure!(
            outcome.processed() || outcome == inventory_domain::Outcome::Duplicate,
            "{outcome}"
        );
    }
    Ok(started.elapsed().as_secs_f64() * 1e6 / messages.len().max(1) as f64)
}
