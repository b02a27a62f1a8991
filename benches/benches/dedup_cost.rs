//! What detecting a duplicate costs per message: the inbox's three detection modes and the
//! natural key (through sea-orm, and as PostgreSQL's one statement), at 0, 10, 50 and 90 %
//! duplicates. Each iteration handles one message of a deterministic stream in which that
//! fraction are copies of messages already handled (the same message for the inbox, the same
//! order under a new id for the natural key). Stock never runs out, so a fresh message always
//! reserves and a copy is always a duplicate; the outcomes are checked after each sample.
//!
//! Groups: `dedup_cost` (PostgreSQL, the server of `DATABASE_URL` or the local one) and
//! `dedup_cost_sqlite` (a temporary SQLite file). Every benchmark has a database of its own,
//! created on first use and dropped when the benchmark is done; building the messages is not
//! timed (`iter_custom`).
#![expect(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test or benchmark fails by panicking"
)]

use std::sync::Mutex;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use inventory_benches::consumers::HandlerKind;
use inventory_benches::fresh::FreshDatabase;
use inventory_benches::mistakes::StudyHandler;
use inventory_benches::workload::{self, CopyKind, Delivery, DuplicateStream};
use inventory_infra::MessageHandler;
use tokio::runtime::Runtime;

const RATIOS: [u32; 4] = [0, 10, 50, 90];

/// A database, a handler on it, and the stream its messages come from (kept across samples,
/// so a copy may repeat a message of an earlier sample).
struct Fixture {
    fresh: FreshDatabase,
    handler: StudyHandler,
    stream: Mutex<DuplicateStream>,
}

impl Fixture {
    async fn new(server: Option<&str>, mode: HandlerKind, percent: u32) -> Fixture {
        let fresh = FreshDatabase::create(server, "inventory_bench_dedup", 2)
            .await
            .expect("a fresh benchmark database");
        let books = workload::stock_books(&fresh.conn, 1).await.unwrap();
        let handler = workload::handler(mode, &fresh.conn).unwrap();
        let stream = DuplicateStream::new(
            percent,
            CopyKind::caught_by(mode),
            books,
            u64::from(percent),
        )
        .unwrap();
        Fixture {
            fresh,
            handler,
            stream: Mutex::new(stream),
        }
    }

    async fn run(&self, iters: u64) -> Duration {
        let deliveries: Vec<Delivery> = self.stream.lock().unwrap().take(iters);
        let mut outcomes = Vec::with_capacity(deliveries.len());
        let start = Instant::now();
        for delivery in &deliveries {
            outcomes.push(self.handler.handle(&delivery.message).await.unwrap());
        }
        let elapsed = start.elapsed();
        for (delivery, outcome) in deliveries.iter().zip(&outcomes) {
            assert!(
                delivery.as_expected(outcome),
                "copy: {}, outcome: {outcome:?}",
                delivery.is_copy
            );
        }
        elapsed
    }
}

fn group(c: &mut Criterion, runtime: &Runtime, name: &str, server: Option<&str>) {
    let mut group = c.benchmark_group(name);
    group.throughput(Throughput::Elements(1));
    for mode in workload::DEDUP {
        for percent in RATIOS {
            let mut fixture: Option<Fixture> = None;
            group.bench_with_input(
                BenchmarkId::new(mode.label(), percent),
                &percent,
                |b, &percent| {
                    let fixture = &*fixture.get_or_insert_with(|| {
                        runtime.block_on(Fixture::new(server, mode, percent))
                    });
                    b.to_async(runtime).iter_custom(|iters| fixture.run(iters));
                },
            );
            if let Some(fixture) = fixture {
                drop(fixture.handler);
                runtime.block_on(fixture.fresh.remove()).unwrap();
            }
        }
    }
    group.finish();
}

fn dedup_cost(c: &mut Criterion) {
    let runtime = Runtime::new().unwrap();
    let server = workload::postgres_server();
    group(c, &runtime, "dedup_cost", Some(&server));
    group(c, &runtime, "dedup_cost_sqlite", None);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(5))
        .sample_size(30);
    targets = dedup_cost
}
criterion_main!(benches);
