//! Two instances on one durable consumer, SIGKILLed and restarted at random moments while a
//! producer publishes 10,000 orders with its duplicates mixed in.

use std::time::{Duration, Instant};

use inventory_benches::workload::SplitMix64;
use inventory_tests::workload::{self, SendKind, Workload, stream_state};
use inventory_tests::{Backend, TestDb};

use crate::support::{Scenario, seed};

const ORDERS: usize = 10_000;
/// 20% of the orders resent under a new message id, 10% with the same id.
const NEW_IDS: usize = ORDERS / 5;
const SAME_IDS: usize = ORDERS / 10;
const MIN_KILLS: usize = 12;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: run by scripts/test.sh"]
async fn kill_9_at_random_moments_neither_loses_nor_doubles_a_reservation() {
    let seed = seed("kill -9");
    let mut random = SplitMix64::new(seed);
    let db = TestDb::new(Backend::Postgres).await;
    // One book: every order contends for the same stock row.
    let book = db.dune(1_000_000).await;
    let nats = inventory_tests::nats::shared_url().await;
    let scenario = Scenario::new("kill9", &db.url, &nats, 1);
    let (_client, js) = scenario.connect().await;
    let workload = Workload::new(&[book], ORDERS, NEW_IDS, SAME_IDS, seed);
    let total = workload.sends.len() as u64;
    assert_eq!(workload.count(SendKind::NewId), NEW_IDS);
    assert_eq!(workload.count(SendKind::SameId), SAME_IDS);

    let mut instances = [scenario.spawn("a"), scenario.spawn("b")];
    let started = Instant::now();
    // About 15 s of publishing, so the kills land while messages flow.
    let producer = scenario.start_producer(&js, &workload.sends, 400, Duration::from_millis(350));

    let mut kills = 0;
    let mut mid_stream = 0;
    while !producer.is_finished() || kills < MIN_KILLS {
        tokio::time::sleep(Duration::from_millis(300 + random.below(900))).await;
        let victim = usize::try_from(random.below(instances.len() as u64)).unwrap_or(0);
        // The instances drain each burst faster than it is published: wait (briefly) for one
        // in flight, so the kill interrupts work rather than an idle consumer.
        let mut state = stream_state(&js, &scenario.topology, &scenario.names.consumer).await;
        let deadline = Instant::now() + Duration::from_secs(2);
        while state.as_ref().is_some_and(|state| state.settled())
            && !producer.is_finished()
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
            state = stream_state(&js, &scenario.topology, &scenario.names.consumer).await;
        }
        instances[victim].kill9();
        kills += 1;
        if state.is_some_and(|state| !state.settled()) {
            mid_stream += 1;
        }
        // Sometimes both are down for a moment.
        tokio::time::sleep(Duration::from_millis(random.below(500))).await;
        let label = format!(
            "{}-{kills}",
            instances[victim].label.split('-').next().unwrap()
        );
        instances[victim] = scenario.spawn(&label);
        assert!(kills < 500, "the producer never finished");
    }
    producer.await.unwrap();
    let state = workload::settle(
        &js,
        &scenario.topology,
        &scenario.names.consumer,
        total,
        Duration::from_secs(300),
    )
    .await;
    let elapsed = started.elapsed();
    for instance in &mut instances {
        assert!(instance.is_running(), "{}", scenario.log_tails());
    }
    for instance in instances {
        let label = instance.label.clone();
        let status = instance.terminate();
        assert!(
            status.success(),
            "{label}: {status}\n{}",
            scenario.log_tails()
        );
    }
    let report = workload::check(&db.conn, &workload, state).await;
    eprintln!(
        "[kill -9] {kills} SIGKILLs ({mid_stream} with messages in flight or pending), \
         2 instances, {total} messages ({ORDERS} orders, {NEW_IDS} resent with new ids, \
         {SAME_IDS} with the same id) in {elapsed:.1?}: {}",
        report.summary()
    );
    assert!(
        mid_stream >= 10,
        "only {mid_stream} kills landed mid-stream"
    );
    assert_eq!(state.stream_messages, total);
    report.assert_holds();
}
