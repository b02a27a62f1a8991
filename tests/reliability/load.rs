//! 100,000 messages through one instance: throughput, and memory that does not grow with the
//! number of messages.

use std::time::{Duration, Instant};

use inventory_tests::workload::{self, Workload, stream_state};
use inventory_tests::{Backend, TestDb};

use crate::support::{Scenario, binary, memory_kib};

const MESSAGES: usize = 100_000;
/// 10% of the messages are duplicates: half resent under a new id, half with the same id.
const DUPLICATES: usize = MESSAGES / 10;
const BOOKS: usize = 20;

/// One sample of the run.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Duration,
    acked: u64,
    rss_kib: u64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: run by scripts/test.sh"]
async fn one_instance_takes_100_000_messages_in_flat_memory() {
    let db = TestDb::new(Backend::Postgres).await;
    let mut books = Vec::new();
    for _ in 0..BOOKS {
        books.push(db.dune(10_000_000).await);
    }
    let nats = inventory_tests::nats::shared_url().await;
    let mut scenario = Scenario::new("load", &db.url, &nats, 1);
    // Per-message log lines would measure the logger; warnings and errors still show.
    scenario.rust_log = "warn".into();
    let (_client, js) = scenario.connect().await;
    let workload = Workload::new(
        &books,
        MESSAGES - DUPLICATES,
        DUPLICATES / 2,
        DUPLICATES / 2,
        17,
    );
    let total = workload.sends.len() as u64;
    assert_eq!(total, MESSAGES as u64);

    // The backlog first, so the figure is the consumer's alone.
    let publishing = Instant::now();
    workload::publish(
        &js,
        &scenario.topology,
        &workload.sends,
        256,
        10_000,
        Duration::ZERO,
    )
    .await;
    let publish_time = publishing.elapsed();

    let started = Instant::now();
    let instance = scenario.spawn("load");
    let pid = instance.pid();
    let mut samples = Vec::new();
    let mut peak_kib = 0;
    let state = loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let Some((rss_kib, hwm_kib)) = memory_kib(pid) else {
            panic!("the instance died\n{}", scenario.log_tails());
        };
        peak_kib = peak_kib.max(hwm_kib);
        if let Some(state) = stream_state(&js, &scenario.topology, &scenario.names.consumer).await {
            samples.push(Sample {
                at: started.elapsed(),
                acked: state.ack_floor,
                rss_kib,
            });
            if state.settled() && state.stream_last_seq >= total {
                break state;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "100,000 messages took over 10 minutes"
        );
    };
    let elapsed = started.elapsed();
    let status = instance.terminate();
    assert!(status.success(), "{status}\n{}", scenario.log_tails());

    // Throughput from the first ack (start-up and migrations excluded) to the last.
    let first = samples.iter().find(|sample| sample.acked > 0).unwrap();
    let consuming = elapsed - first.at;
    let rate = (total - first.acked) as f64 / consuming.as_secs_f64();
    let rss_at = |fraction: f64| {
        let target = (total as f64 * fraction) as u64;
        samples
            .iter()
            .find(|sample| sample.acked >= target)
            .map_or(0, |sample| sample.rss_kib)
    };
    let (at_10, at_20, at_50, at_100) = (rss_at(0.1), rss_at(0.2), rss_at(0.5), rss_at(1.0));
    let profile = if binary()
        .components()
        .any(|part| part.as_os_str() == "release")
    {
        "release"
    } else {
        "debug"
    };
    eprintln!(
        "[load] {profile} binary, {total} messages ({DUPLICATES} duplicates) over {BOOKS} books; \
         published in {publish_time:.1?}; consumed in {consuming:.1?}: {rate:.0} messages/s; \
         RSS at 10k {} MiB, 20k {} MiB, 50k {} MiB, 100k {} MiB; peak (VmHWM) {} MiB",
        at_10 / 1024,
        at_20 / 1024,
        at_50 / 1024,
        at_100 / 1024,
        peak_kib / 1024
    );
    let report = workload::check(&db.conn, &workload, state).await;
    eprintln!("[load] {}", report.summary());
    report.assert_holds();
    // Flat: no growth with the message count beyond noise, and a modest ceiling.
    assert!(
        at_100 <= at_20 + at_20 / 4 + 8 * 1024,
        "RSS grew from {at_20} KiB at 20k messages to {at_100} KiB at 100k"
    );
    assert!(peak_kib < 256 * 1024, "peak RSS {peak_kib} KiB");
}
