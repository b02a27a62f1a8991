//! Instances on one durable consumer, SIGKILLed and restarted at random moments while a
//! producer publishes orders with its duplicates mixed in: the natural key (two instances,
//! 10,000 orders), its batch statement (`--batch-size 16`), the inbox and the email.

use std::time::{Duration, Instant};

use inventory_benches::workload::SplitMix64;
use inventory_tests::workload::{self, SendKind, Workload};
use inventory_tests::{Backend, TestDb};

use crate::support::{Instance, Scenario, Served, seed};

/// Kills per run. Each lands on an instance whose own gauge showed messages in its handlers
/// just before the SIGKILL: a kill of an idle process tests nothing.
const MIN_KILLS: usize = 12;
/// How long a round waits for an instance to hold messages before it gives up its kill.
const HOLD_WAIT: Duration = Duration::from_secs(2);

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
    // The producer publishes all but the last sends at its pace. The instances drain each burst
    // faster than it is published, so a round may find no instance holding messages; once the
    // producer is done, the rounds that still miss a kill publish a slice of the held-back
    // sends first. Every kill lands on messages in flight, and the run always gets its
    // MIN_KILLS, within the slices held back (each of them is published in the end).
    let held_back = (chaos.chunk / 2).max(50) * MIN_KILLS * 2;
    let (paced, reserve) = workload
        .sends
        .split_at(workload.sends.len().saturating_sub(held_back));
    let mut reserve = reserve.chunks(held_back / (MIN_KILLS * 2));
    let producer = scenario.start_producer(&js, paced, chaos.chunk, chaos.pause);

    let mut kills = 0;
    let mut rounds = 0;
    while !producer.is_finished() || kills < MIN_KILLS {
        rounds += 1;
        assert!(rounds < 500, "the producer never finished");
        tokio::time::sleep(Duration::from_millis(300 + random.below(900))).await;
        if producer.is_finished() {
            let slice = reserve.next().unwrap_or_else(|| {
                panic!("only {kills} of {MIN_KILLS} kills found messages in flight")
            });
            scenario.publish(&js, slice).await;
        }
        // The scrape that saw messages in its handlers is the last thing before the SIGKILL.
        let Some(victim) = holding_messages(&instances, &mut random).await else {
            continue;
        };
        instances[victim].kill9();
        kills += 1;
        // Sometimes both are down for a moment.
        tokio::time::sleep(Duration::from_millis(random.below(500))).await;
        let label = format!(
            "{}-{kills}",
            instances[victim].label.split('-').next().unwrap()
        );
        instances[victim] = scenario.spawn(&label);
    }
    producer.await.unwrap();
    for slice in reserve {
        scenario.publish(&js, slice).await;
    }
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
        "[{}] {kills} SIGKILLs, each with messages in the killed instance's handlers, in \
         {rounds} rounds; {} instance(s), {total} messages ({} orders, {new_ids} resent with new ids, \
         {same_ids} with the same id) in {elapsed:.1?}: {summary}",
        chaos.label,
        chaos.served.instances(),
        chaos.orders,
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

/// An instance whose own gauge shows messages in its handlers, picked at random among those
/// that do, polled for up to [`HOLD_WAIT`]; `None` if none held any meanwhile.
async fn holding_messages(instances: &[Instance], random: &mut SplitMix64) -> Option<usize> {
    let deadline = Instant::now() + HOLD_WAIT;
    loop {
        let holding: Vec<usize> = (0..instances.len())
            .filter(|&index| instances[index].in_flight().unwrap_or(0.0) > 0.0)
            .collect();
        if !holding.is_empty() {
            let pick = usize::try_from(random.below(holding.len() as u64)).unwrap_or(0);
            return Some(holding[pick]);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
