//! The strategies on fresh messages: naive, the inbox (`ON CONFLICT`), the natural key through
//! sea-orm and PostgreSQL's one-statement natural key, on 1, 4 and 16 concurrent connections
//! (1 and 4 on SQLite, which has one writer at a time anyway).
//!
//! N tasks each handle their share of a sample's messages with a handler clone of their own,
//! as the consumer's lanes do; the time is the sample's wall clock, so criterion's throughput
//! is total messages per second across the N connections. Each task orders a book of its own,
//! so the tasks do not queue on one stock row: what is measured is the handler and the
//! database, not one hot row's lock.
//!
//! Groups: `strategies` (PostgreSQL) and `strategies_sqlite`; every benchmark has a database
//! of its own, dropped when it is done.
#![expect(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test or benchmark fails by panicking"
)]

use inventory_benches::produce::Produce as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use inventory_benches::fresh::FreshDatabase;
use inventory_benches::mistakes::{Strategy, StudyHandler};
use inventory_benches::workload;
use inventory_domain::{BookId, Message, OrderId, Quantity};
use inventory_infra::MessageHandler;
use tokio::runtime::Runtime;

struct Fixture {
    fresh: FreshDatabase,
    /// One per task, made once: a one-statement clone holds its connection across samples.
    lanes: Vec<(Arc<StudyHandler>, BookId)>,
}

impl Fixture {
    async fn new(server: Option<&str>, mode: Strategy, connections: usize) -> Fixture {
        let pool = u32::try_from(connections).unwrap();
        let fresh = FreshDatabase::create(server, "inventory_bench_strategies", pool)
            .await
            .expect("a fresh benchmark database");
        let books = workload::stock_books(&fresh.conn, connections)
            .await
            .unwrap();
        let handler = workload::handler(mode, &fresh.conn).unwrap();
        let lanes = books
            .into_iter()
            .map(|book| (Arc::new(handler.clone()), book))
            .collect();
        Fixture { fresh, lanes }
    }

    async fn run(&self, iters: u64) -> Duration {
        let lanes = self.lanes.len() as u64;
        let quantity = Quantity::new(1).unwrap();
        let shares: Vec<Vec<Message>> = self
            .lanes
            .iter()
            .enumerate()
            .map(|(lane, (_, book))| {
                let share = iters / lanes + u64::from((lane as u64) < iters % lanes);
                (0..share)
                    .map(|_| Message::placed(OrderId::new_v7(), *book, quantity))
                    .collect()
            })
            .collect();
        let start = Instant::now();
        let tasks: Vec<_> = self
            .lanes
            .iter()
            .zip(shares)
            .map(|((handler, _), messages)| {
                let handler = handler.clone();
                tokio::spawn(async move {
                    for message in &messages {
                        let outcome = handler.handle(message).await.unwrap();
                        assert!(outcome.processed(), "{outcome:?}");
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        start.elapsed()
    }
}

fn group(c: &mut Criterion, runtime: &Runtime, name: &str, server: Option<&str>) {
    let connections: &[usize] = if server.is_some() {
        &[1, 4, 16]
    } else {
        &[1, 4]
    };
    let mut group = c.benchmark_group(name);
    group.throughput(Throughput::Elements(1));
    for mode in workload::STRATEGIES {
        for &count in connections {
            let mut fixture: Option<Fixture> = None;
            group.bench_with_input(
                BenchmarkId::new(mode.label(), count),
                &count,
                |b, &count| {
                    let fixture = &*fixture
                        .get_or_insert_with(|| runtime.block_on(Fixture::new(server, mode, count)));
                    b.to_async(runtime).iter_custom(|iters| fixture.run(iters));
                },
            );
            if let Some(fixture) = fixture {
                drop(fixture.lanes);
                runtime.block_on(fixture.fresh.remove()).unwrap();
            }
        }
    }
    group.finish();
}

fn strategies(c: &mut Criterion) {
    let runtime = Runtime::new().unwrap();
    let server = workload::postgres_server();
    group(c, &runtime, "strategies", Some(&server));
    group(c, &runtime, "strategies_sqlite", None);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(5))
        .sample_size(30);
    targets = strategies
}
criterion_main!(benches);
