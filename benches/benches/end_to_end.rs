//! End to end: OrderPlaced published to JetStream and consumed by the real service loop into
//! PostgreSQL with the one-statement natural key, acked after commit, at 1, 4 and 16 messages
//! in flight (10% of the orders resent by the producer under new ids).
//!
//! Each iteration is a whole run of `inventory bench end-to-end` (fresh database, own stream,
//! publish, then consume until every message is acked); criterion times the consuming part,
//! which the run measures itself. Needs PostgreSQL (DATABASE_URL when it names a PostgreSQL
//! server, else the local one) and NATS (NATS_URL or the local server).
#![expect(clippy::unwrap_used, reason = "a benchmark fails by panicking")]

use std::time::Duration;

use clap::Parser;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use inventory_benches::bench_e2e::{self, EndToEndArgs};
use inventory_benches::workload;
use tokio::runtime::Runtime;

/// Orders per run: enough that start-up is a small share of a run.
const ORDERS: usize = 2_000;

#[derive(Parser)]
struct Wrapper {
    #[command(flatten)]
    args: EndToEndArgs,
}

fn arguments(in_flight: usize) -> EndToEndArgs {
    let concurrency = in_flight.to_string();
    let orders = ORDERS.to_string();
    // The PostgreSQL server as the other groups find it: a DATABASE_URL naming SQLite (the
    // service's default) would otherwise make every run fail.
    let server = workload::postgres_server();
    Wrapper::parse_from([
        "end_to_end",
        "--messages",
        orders.as_str(),
        "--concurrency",
        concurrency.as_str(),
        "--database-url",
        server.as_str(),
    ])
    .args
}

fn end_to_end(c: &mut Criterion) {
    let runtime = Runtime::new().unwrap();
    let mut group = c.benchmark_group("end_to_end");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(30));
    for in_flight in [1, 4, 16] {
        let args = arguments(in_flight);
        // Orders plus the 10% resent under new ids: every one of them is delivered and acked.
        group.throughput(Throughput::Elements((ORDERS + ORDERS / 10) as u64));
        group.bench_with_input(BenchmarkId::from_parameter(in_flight), &args, |b, args| {
            b.to_async(&runtime).iter_custom(|iterations| async move {
                let mut total = Duration::ZERO;
                for _ in 0..iterations {
                    let report = bench_e2e::run(args).await.unwrap();
                    total += Duration::from_secs_f64(report.seconds);
                }
                total
            });
        });
    }
    group.finish();
}

criterion_group!(benches, end_to_end);
criterion_main!(benches);
