//! `inventory bench relay`: the outbox relay measured on PostgreSQL and NATS.
//!
//! - **Drain**: `--rows` pending rows seeded in one statement into a fresh database's `outbox`
//!   (one order each, a body the size of a real event), then one relay's passes until the table
//!   is empty: events/s, the machine's CPU per event by process (the relay's, nats-server,
//!   PostgreSQL, the rest) and the outbox's dead tuples and size after.
//! - **Latency**: placements decided by the one-statement handler at a steady `--rate` for
//!   `--seconds`, in this process, with the relay running beside them and woken after each
//!   commit, as `serve` wakes it. Each event's latency runs from its handler's return (the
//!   commit) to the event's arrival on a subscription of the events stream's subjects, which
//!   the server sends once the stream stored it (the PubAck leaves at the same moment).

use crate::produce::Produce as _;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::consumers::{HandlerKind, NaturalKeyPath};
use crate::fresh::FreshDatabase;
use crate::system_cpu::CpuSnapshot;
use anyhow::{Context as _, Result, bail};
use futures::StreamExt;
use inventory_domain::{BookId, ConsumerName, Message, OrderId, Quantity, StockEvent, StockItem};
use inventory_infra::StockRepository;
use inventory_infra::db::DatabaseConnection;
use inventory_infra::jetstream::{self, Context, Topology};
use inventory_infra::outbox::relay::{Relay, RelaySettings};
use inventory_infra::outbox::source::OutboxSource;
use inventory_service::args::NatsArgs;
use sea_orm::{ConnectionTrait, DbBackend, Statement};
use tokio_util::sync::CancellationToken;

#[derive(Debug, clap::Args)]
pub struct RelayArgs {
    /// Pending rows the drain starts from.
    #[arg(long, default_value_t = 100_000)]
    pub rows: u64,
    /// Placements per second while the latency is measured.
    #[arg(long, default_value_t = 1_000)]
    pub rate: u64,
    /// How long the steady flow runs.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub seconds: Duration,
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub database_url: String,
    #[command(flatten)]
    pub nats: NatsArgs,
}

pub async fn run(args: &RelayArgs) -> Result<()> {
    if !args.database_url.starts_with("postgres") {
        bail!("the relay benchmark runs on PostgreSQL");
    }
    let client = jetstream::connect(args.nats.url(), "inventory bench relay").await?;
    let js = jetstream::context(client.clone());
    drain(args, &js).await?;
    latency(args, &client, &js).await
}

/// A topology of this run's own, so nothing else's events mix in.
fn own_topology() -> Topology {
    let suffix = uuid::Uuid::new_v4().simple().to_string()[..12].to_uppercase();
    Topology {
        events_stream: format!("BENCH_RELAY_{suffix}"),
        events_subject_prefix: format!("benchrelay{suffix}.inventory"),
        ..Topology::default()
    }
}

async fn relay(js: &Context, db: &DatabaseConnection, topology: &Topology) -> Result<Relay> {
    let (relay, _) = Relay::prepare(
        js,
        db.clone(),
        OutboxSource::inventory(topology),
        &topology.events_stream(),
        RelaySettings::default(),
    )
    .await?;
    Ok(relay)
}

/// One outbox row per order, `rows` of them, with bodies built as the statements build them.
const SEED_SQL: &str = "\
INSERT INTO outbox (event_id, relay_partition, order_id, subject, payload, created_at)
SELECT e, get_byte(uuid_send(o), 15) % 16, o, 'stock.reserved',
       jsonb_build_object('event_id', e, 'order_id', o, 'book_id', gen_random_uuid(),
                          'quantity', 2, 'occurred_at', now(), 'caused_by', e::text)::text,
       now()
FROM (SELECT gen_random_uuid() AS e, gen_random_uuid() AS o FROM generate_series(1, $1)) g";

async fn drain(args: &RelayArgs, js: &Context) -> Result<()> {
    let fresh = FreshDatabase::create(Some(&args.database_url), "inventory_bench_relay", 4)
        .await
        .context("a fresh database")?;
    let topology = own_topology();
    let result = async {
        let rows = i64::try_from(args.rows)?;
        fresh
            .conn
            .execute_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                SEED_SQL,
                [rows.into()],
            ))
            .await?;
        fresh.conn.execute_unprepared("ANALYZE outbox").await?;
        let mut relay = relay(js, &fresh.conn, &topology).await?;
        let cpu_before = CpuSnapshot::before()?;
        let started = Instant::now();
        let mut passes = 0;
        loop {
            let report = relay.pass().await?;
            passes += 1;
            if report.read == 0 {
                break;
            }
        }
        let took = started.elapsed();
        let cpu_after = CpuSnapshot::after()?;
        let published = relay.status().published();
        let cpu = cpu_after.since(&cpu_before, published);
        let size = table_figures(&fresh.conn).await?;
        println!(
            "drain: {published} events of {} pending rows in {:.2} s ({passes} passes): {:.0} events/s; \
             µs CPU an event: relay {:.1}, nats-server {:.1}, PostgreSQL {:.1}, rest {:.1}, machine {:.1}; \
             outbox after: {} dead tuples, {} live, {} kB",
            args.rows,
            took.as_secs_f64(),
            published as f64 / took.as_secs_f64(),
            cpu.this_process,
            cpu.nats_server,
            cpu.postgres,
            cpu.rest,
            cpu.machine,
            size.dead,
            size.live,
            size.bytes / 1024
        );
        anyhow::Ok(())
    }
    .await;
    let _ = js.delete_stream(&topology.events_stream).await;
    let _ = fresh.remove().await;
    result
}

struct TableFigures {
    dead: i64,
    live: i64,
    bytes: i64,
}

/// The outbox's dead and live tuples and its size, indexes included. The statistics of this
/// session's deletes are flushed at the end of each transaction.
async fn table_figures(db: &DatabaseConnection) -> Result<TableFigures> {
    let row = db
        .query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT n_dead_tup AS dead, n_live_tup AS live, \
             pg_total_relation_size('outbox') AS bytes \
             FROM pg_stat_user_tables WHERE relname = 'outbox'",
        ))
        .await?
        .context("no statistics for outbox")?;
    Ok(TableFigures {
        dead: row.try_get("", "dead")?,
        live: row.try_get("", "live")?,
        bytes: row.try_get("", "bytes")?,
    })
}

async fn latency(args: &RelayArgs, client: &jetstream::Client, js: &Context) -> Result<()> {
    let fresh = FreshDatabase::create(Some(&args.database_url), "inventory_bench_relay", 4)
        .await
        .context("a fresh database")?;
    let topology = own_topology();
    let result = steady_flow(args, client, js, &fresh.conn, &topology).await;
    let _ = js.delete_stream(&topology.events_stream).await;
    let _ = fresh.remove().await;
    result
}

async fn steady_flow(
    args: &RelayArgs,
    client: &jetstream::Client,
    js: &Context,
    db: &DatabaseConnection,
    topology: &Topology,
) -> Result<()> {
    let book = BookId::new_v7();
    StockRepository::new(db.clone())
        .put(&StockItem::new(book, "Dune", 1_000_000_000)?)
        .await?;
    let handler = HandlerKind::NaturalKey(NaturalKeyPath::OneStatement).build(
        db,
        ConsumerName::parse("inventory-reserve-stock")?,
        None,
    )?;
    let relay = relay(js, db, topology).await?;
    let wake = relay.wake();
    let stop = CancellationToken::new();
    let running = tokio::spawn(relay.run(stop.clone()));

    let committed: Arc<Mutex<HashMap<OrderId, Instant>>> = Arc::default();
    let mut arrivals = client
        .subscribe(format!("{}.>", topology.events_subject_prefix))
        .await?;
    let stop_watching = CancellationToken::new();
    let latencies = tokio::spawn({
        let committed = Arc::clone(&committed);
        let stop_watching = stop_watching.clone();
        async move {
            let mut latencies = Vec::new();
            loop {
                let message = tokio::select! {
                    () = stop_watching.cancelled() => break,
                    message = arrivals.next() => match message {
                        Some(message) => message,
                        None => break,
                    },
                };
                let arrived = Instant::now();
                let token = message.subject.split('.').rev().take(2).collect::<Vec<_>>();
                let token = format!("{}.{}", token[1], token[0]);
                let Ok(event) = StockEvent::decode(&token, &message.payload) else {
                    continue;
                };
                let commit = committed
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .get(&event.order_id)
                    .copied();
                if let Some(commit) = commit {
                    latencies.push(arrived.saturating_duration_since(commit));
                }
            }
            latencies
        }
    });

    let total = args.rate * args.seconds.as_secs().max(1);
    // Lanes of their own connection each, fed at the rate: one lane alone would set the pace.
    let (orders, received) = tokio::sync::mpsc::channel::<OrderId>(1_024);
    let received = Arc::new(tokio::sync::Mutex::new(received));
    let lanes: Vec<_> = (0..FLOW_LANES)
        .map(|_| {
            let (handler, received, committed, wake) = (
                handler.clone(),
                Arc::clone(&received),
                Arc::clone(&committed),
                wake.clone(),
            );
            tokio::spawn(async move {
                loop {
                    let Some(order) = received.lock().await.recv().await else {
                        break;
                    };
                    let message = Message::placed(order, book, Quantity::new(1)?);
                    let outcome = handler.handle(&message).await?;
                    if !outcome.processed() {
                        bail!("a fresh placement came out as {outcome:?}");
                    }
                    committed
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .insert(order, Instant::now());
                    wake.notify();
                }
                anyhow::Ok(())
            })
        })
        .collect();
    let mut ticks =
        tokio::time::interval(Duration::from_secs(1) / u32::try_from(args.rate.max(1))?);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let started = Instant::now();
    for _ in 0..total {
        ticks.tick().await;
        orders.send(OrderId::new_v7()).await?;
    }
    drop(orders);
    for lane in lanes {
        lane.await??;
    }
    let flow = started.elapsed();
    // Every event published and, a moment later, arrived.
    let deadline = Instant::now() + Duration::from_secs(30);
    while count_outbox(db).await? > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.cancel();
    running.await?;
    stop_watching.cancel();
    let mut latencies = latencies.await?;
    if latencies.is_empty() {
        bail!("no event arrived");
    }
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    println!(
        "latency: {} placements at {:.0}/s (asked {}/s), {} events seen: commit to stored p50 {:.1} ms, \
         p99 {:.1} ms, max {:.1} ms",
        total,
        total as f64 / flow.as_secs_f64(),
        args.rate,
        latencies.len(),
        at(0.5).as_secs_f64() * 1e3,
        at(0.99).as_secs_f64() * 1e3,
        latencies.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
    );
    Ok(())
}

/// Lanes deciding the steady flow's placements.
const FLOW_LANES: usize = 4;

async fn count_outbox(db: &DatabaseConnection) -> Result<i64> {
    let row = db
        .query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT count(*) AS n FROM outbox",
        ))
        .await?
        .context("count")?;
    Ok(row.try_get("", "n")?)
}
