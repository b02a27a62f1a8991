//! Instances on one durable consumer, SIGKILLed and restarted at random moments while a
//! producer publishes orders with its duplicates mixed in: the natural key (two instances,
//! 10,000 orders), its batch statement (`--batch-size 16`), the inbox and the email.

use std::time::{Duration, Instant};

use inventory_benches::workload::SplitMix64;
use inventory_tests::workload::{self, SendKind, Workload};
use inventory_tests::{Backend, TestDb};

use crate::support::{Scenario, Served, seed};

const MIN_KILLS: usize = 12;
/// Kills that must land while the killed instance had messages in its handlers.
const MIN_IN_FLIGHT: usize = 10;

/// One chaos run: `orders` for `served` (10% resent with the same id, and 20% under a new id
/// where the strategy catches those), published `chunk` at a time every `pause`, so the
/// publishing lasts 15 to 20 s and the kills land while messages flow.
struct Chaos {
    label: &'static str,
    served: Served,
    serve_args: &'static [&'static str],
    orders: usize,
    chunk: usize,
    pause: Duration,
}

async fn kill_9_at_random_moments(chaos: Chaos) {
    let seed = seed(chaos.label);
    let mut random = SplitMix64::new(seed);
    let db = TestDb::new(Backend::Postgres).await;
    // One book: every order contends for the same stock row.
    let book = db.dune(1_000_000).await;
    let nats = inventory_tests::nats::shared_url().await;
    let mut scenario = Scenario::new("kill9", &db.url, &nats, 1);
    scenario.serve(chaos.served);
    scenario.serve_args = chaos.serve_args.iter().map(|&arg| arg.to_owned()).collect();
    let (_client, js) = scenario.connect().await;
    let new_ids = chaos.served.new_id_resends(chaos.orders);
    let same_ids = chaos.orders / 10;
    let workload = Workload::new(&[book], chaos.orders, new_ids, same_ids, seed);
    let total = workload.sends.len() as u64;
    assert_eq!(workload.count(SendKind::NewId), new_ids);
    assert_eq!(workload.count(SendKind::SameId), same_ids);

    let mut instances: Vec<_> = ["a", "b"][..chaos.served.instances()]
        .iter()
        .map(|label| scenario.spawn(label))
        .collect();
    let started = Instant::now();
    let producer = scenario.start_producer(&js, &workload.sends, chaos.chunk, chaos.pause);

    let mut kills = 0;
    let mut in_flight = 0;
    while !producer.is_finished() || kills < MIN_KILLS {
        tokio::time::sleep(Duration::from_millis(300 + random.below(900))).await;
        let victim = usize::try_from(random.below(instances.len() as u64)).unwrap_or(0);
        // The instances drain each burst faster than it is published: wait (briefly) until the
        // victim's own gauge shows messages in its handlers, so the kill interrupts work rather
        // than an idle process. The scrape is the last thing before the SIGKILL.
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut holding = instances[victim].in_flight().unwrap_or(0.0);
        while holding == 0.0 && !producer.is_finished() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
            holding = instances[victim].in_flight().unwrap_or(0.0);
        }
        instances[victim].kill9();
        kills += 1;
        if holding > 0.0 {
            in_flight += 1;
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
    let summary = chaos
        .served
        .assert_promise(&scenario, &db.conn, &workload, state)
        .await;
    eprintln!(
        "[{}] {kills} SIGKILLs ({in_flight} with messages in the killed instance's handlers), \
         {} instance(s), {total} messages ({} orders, {new_ids} resent with new ids, \
         {same_ids} with the same id) in {elapsed:.1?}: {summary}",
        chaos.label,
        chaos.served.instances(),
        chaos.orders,
    );
    assert!(
        in_flight >= MIN_IN_FLIGHT,
        "only {in_flight} kills landed on an instance with messages in flight"
    );
    assert_eq!(state.stream_messages, total);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: run by scripts/test.sh"]
async fn kill_9_at_random_moments_neither_loses_nor_doubles_a_reservation() {
    kill_9_at_random_moments(Chaos {
        label: "kill -9",
        served: Served::NaturalKey,
        serve_args: &[],
        orders: 10_000,
        chunk: 400,
        pause: Duration::from_millis(350),
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: run by scripts/test.sh"]
async fn kill_9_under_the_batch_statement_neither_loses_nor_doubles_a_reservation() {
    kill_9_at_random_moments(Chaos {
        label: "kill -9, batch",
        served: Served::NaturalKey,
        serve_args: &["--batch-size", "16"],
        orders: 3_000,
        chunk: 80,
        pause: Duration::from_millis(400),
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: run by scripts/test.sh"]
async fn kill_9_under_the_inbox_reserves_each_same_id_copy_once() {
    kill_9_at_random_moments(Chaos {
        label: "kill -9, inbox",
        served: Served::Inbox,
        serve_args: &[],
        orders: 2_000,
        chunk: 50,
        pause: Duration::from_millis(400),
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: run by scripts/test.sh"]
async fn kill_9_under_the_email_mails_each_order_once() {
    kill_9_at_random_moments(Chaos {
        label: "kill -9, email",
        served: Served::Email,
        serve_args: &[],
        orders: 2_000,
        chunk: 50,
        pause: Duration::from_millis(400),
    })
    .await;
}
