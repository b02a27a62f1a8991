//! A flaky network between `inventory serve` and its servers: a [`FaultProxy`] in front of
//! PostgreSQL and one in front of NATS, each fault applied in turn while orders flow through
//! two instances of the natural key (one on the one-statement path, one on sea-orm's
//! transactions, whose commit is a `COMMIT` of its own):
//!
//! - PostgreSQL: latency; every connection cut at once, mid-statement; two transactions gone
//!   silent holding their stock row's lock; connections cut right after a commit reached the
//!   server (it commits, the client never hears: the message's outcome is unknown to it); a
//!   blackhole, whose connections stay silent for good.
//! - NATS: latency; every connection cut; a blackhole.
//!
//! Then 300 more orders over 15 s: each instance must ack some, so none is left with a lane on a
//! connection gone silent or a pull that no longer fetches.
//! The promise holds (every order reserved exactly once, nothing lost, no dead letters), the
//! instances are still running and stop cleanly on SIGTERM, and at least one message
//! whose commit was cut off was redelivered and recognised as a duplicate. It prints the
//! longest time a lane held one message (each instance's `inventory_oldest_in_flight_seconds`,
//! scraped every 100 ms) and the longest time no delivery finished anywhere.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use inventory_tests::fault_proxy::FaultProxy;
use inventory_tests::workload::{self, Workload};
use inventory_tests::{Backend, TestDb};

use crate::support::{MetricsOf, Scenario, Served, until_acked};

const ORDERS: usize = 2_000;
/// Orders published over 20 s once NATS is back.
const ORDERS_AFTER: usize = 300;
/// The longest an instance may go without an ack while those flow: a reconnect (pings every
/// second, two unanswered) and the waiting fetch asked anew on the new connection (it looks
/// every second), with room to spare, and well under the 35 s a fetch left on the old
/// connection would otherwise wait.
const FETCH_STALL: Duration = Duration::from_secs(12);
/// A lane holding one message longer than this is stuck: many times the client's bound on a
/// message's database work (`--db-statement-timeout` plus 1 s) and its NATS timeouts.
const STUCK: Duration = Duration::from_secs(30);

/// Short timeouts, so each fault is outlived within seconds.
fn timeout_flags() -> Vec<String> {
    [
        "--db-statement-timeout",
        "2s",
        "--db-connect-timeout",
        "2s",
        "--nats-connect-timeout",
        "2s",
        "--nats-ping-interval",
        "1s",
        "--nats-request-timeout",
        "3s",
    ]
    .map(str::to_owned)
    .into()
}

/// The longest stalls seen by scraping the instances every 100 ms.
#[derive(Debug, Default, Clone, Copy)]
struct Stalls {
    /// The largest `inventory_oldest_in_flight_seconds` of any instance.
    longest_lane_hold: f64,
    /// The longest time no delivery finished on any instance while one was in flight.
    longest_without_progress: Duration,
}

/// Scrapes `instances` until `stop`, on a thread of its own (the scrape is blocking).
fn watch(instances: Vec<MetricsOf>, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<Stalls> {
    std::thread::spawn(move || {
        let mut stalls = Stalls::default();
        let mut last_handled = 0.0;
        let mut progress_at = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            let seen: Vec<_> = instances.iter().filter_map(MetricsOf::gauges).collect();
            let handled: f64 = seen.iter().map(|gauges| gauges.handled).sum();
            let in_flight: f64 = seen.iter().map(|gauges| gauges.in_flight).sum();
            for gauges in &seen {
                stalls.longest_lane_hold = stalls.longest_lane_hold.max(gauges.oldest_in_flight);
            }
            if handled > last_handled || in_flight == 0.0 {
                last_handled = handled;
                progress_at = Instant::now();
            }
            stalls.longest_without_progress =
                stalls.longest_without_progress.max(progress_at.elapsed());
            std::thread::sleep(Duration::from_millis(100));
        }
        stalls
    })
}

/// The stream sequences of the log lines holding every one of `needles`.
fn sequences_where(scenario: &Scenario, needles: &[&str]) -> HashSet<u64> {
    scenario
        .lines_with(needles)
        .iter()
        .filter_map(|line| {
            let after = line.split("stream_seq=").nth(1)?;
            after
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: run by scripts/test.sh"]
async fn a_flaky_network_under_two_instances() {
    let db = TestDb::new(Backend::Postgres).await;
    let books = [db.dune(1_000_000).await, db.dune(1_000_000).await];
    let nats = inventory_tests::nats::shared_url().await;
    let postgres = FaultProxy::in_front_of(&db.url).await;
    let broker = FaultProxy::in_front_of(&nats).await;
    // The producer and the checks talk to the servers directly; only the instances go
    // through the proxies.
    let mut scenario = Scenario::new("netfault", &db.url, &nats, 1);
    let (_client, js) = scenario.connect().await;
    scenario.database_url = postgres.url_for(&db.url);
    scenario.nats_url = broker.url_for(&nats);
    scenario.serve_args = timeout_flags();
    // A duplicate's ack is logged at DEBUG: the evidence for a commit cut off.
    scenario.rust_log = "info,sqlx=warn,inventory_service::consumer=debug".into();
    let workload = Workload::new(
        &books,
        ORDERS,
        Served::NaturalKey.new_id_resends(ORDERS),
        ORDERS / 10,
        17,
    );
    let total = workload.sends.len() as u64;
    let instances = vec![
        scenario.spawn("a"),
        scenario.spawn_with("b", &["--natural-handler", "orm"]),
    ];
    // Slow enough to outlast the faults below.
    let producer = scenario.start_producer(
        &js,
        &workload.sends,
        total as usize / 150,
        Duration::from_millis(200),
    );
    let stop_watching = Arc::new(AtomicBool::new(false));
    let metrics: Vec<MetricsOf> = instances
        .iter()
        .map(|instance| instance.metrics())
        .collect();
    let watcher = watch(metrics.clone(), stop_watching.clone());
    let started = Instant::now();

    until_acked(&js, &scenario, total, 0.05).await;
    postgres.latency(Duration::from_millis(20));
    tokio::time::sleep(Duration::from_secs(3)).await;
    postgres.pass();
    // Instance b's transactions gone silent right after locking their book's stock row: their
    // sessions sit idle in the transaction, the lock held, until the server ends them. Armed
    // before the cut, as only a connection's first such query carries its text.
    postgres.silence_after(br#"FROM "stock_items""#, 2);
    let cut = postgres.cut_all();
    eprintln!("[network] PostgreSQL: {cut} connections cut mid-stream");
    let deadline = Instant::now() + Duration::from_secs(20);
    while postgres.silences_made() < 2 {
        assert!(
            Instant::now() < deadline,
            "no transaction to silence within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    // One at a time, so each cut lands on a connection of its own.
    for made in 1..=8 {
        postgres.cut_after_commits(1);
        let deadline = Instant::now() + Duration::from_secs(20);
        while postgres.commit_cuts_made() < made {
            assert!(
                Instant::now() < deadline,
                "no commit to cut after within 20 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    postgres.blackhole();
    tokio::time::sleep(Duration::from_secs(5)).await;
    postgres.pass();
    until_acked(&js, &scenario, total, 0.4).await;
    broker.latency(Duration::from_millis(50));
    tokio::time::sleep(Duration::from_secs(3)).await;
    broker.pass();
    let cut = broker.cut_all();
    eprintln!("[network] NATS: {cut} connections cut mid-stream");
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Under load: each instance's pull requests waiting at the server stay on its connection
    // gone silent, and a pull that waits for them stalls until they expire.
    broker.blackhole();
    tokio::time::sleep(Duration::from_secs(6)).await;
    broker.pass();
    let back = Instant::now();
    let faults_done = started.elapsed();
    let mut workload = workload;

    // Orders over 20 s from now on, beside the producer's last: the longest each instance
    // went without acking one is how long its fetching stayed stuck after NATS came back.
    let after = Workload::new(&books, ORDERS_AFTER, 0, 0, 19);
    let publishing = scenario.start_producer(
        &js,
        &after.sends,
        after.sends.len() / 20,
        Duration::from_secs(1),
    );
    let mut acked: Vec<(f64, Instant)> = vec![(0.0, back); metrics.len()];
    let mut fetch_stalls = vec![Duration::ZERO; metrics.len()];
    while !publishing.is_finished() {
        for ((metrics, (count, since)), stall) in
            metrics.iter().zip(&mut acked).zip(&mut fetch_stalls)
        {
            let now = metrics.gauges().unwrap_or_default().acked;
            if now > *count {
                *count = now;
                *since = Instant::now();
            }
            *stall = (*stall).max(since.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    producer.await.unwrap();
    publishing.await.unwrap();
    workload.orders.extend(after.orders);
    workload.sends.extend(after.sends);
    let total = workload.sends.len() as u64;
    let state = workload::settle(
        &js,
        &scenario.topology,
        &scenario.names.consumer,
        total,
        Duration::from_secs(120),
    )
    .await;
    stop_watching.store(true, Ordering::Relaxed);
    let stalls = watcher.join().unwrap();
    for mut instance in instances {
        assert!(instance.is_running(), "{}", scenario.log_tails());
        let status = instance.terminate();
        assert!(status.success(), "{status}\n{}", scenario.log_tails());
    }
    let report = workload::check(&db.conn, &workload, state).await;
    report.assert_holds();

    // A delivery whose handling failed on the database and whose redelivery was then acked
    // as a duplicate: its first handling committed, unknown to the lane.
    let failed = sequences_where(&scenario, &["transient failure"]);
    let duplicates = sequences_where(&scenario, &["acked", "outcome=\"duplicate\""]);
    let recognised = failed.intersection(&duplicates).count();
    let abandoned = scenario.log_lines_with("database work abandoned");
    let nats_lost = scenario.log_lines_with("NATS disconnected");
    let fetches_renewed = scenario.log_lines_with("fetching anew");
    eprintln!(
        "[network] faults over after {:.1} s; {} commits cut off, {recognised} of the failed \
         deliveries came back as duplicates; {abandoned} handlings abandoned at the client's \
         bound; NATS lost {nats_lost} times, {fetches_renewed} waiting fetches asked anew; the longest \
         each instance went without an ack once NATS came back {:?}; PostgreSQL proxy {} connections, NATS proxy {}; longest a lane held one \
         message {:.1} s, longest without a delivery finished anywhere {:.1} s; {}",
        faults_done.as_secs_f64(),
        postgres.commit_cuts_made(),
        fetch_stalls,
        postgres.accepted(),
        broker.accepted(),
        stalls.longest_lane_hold,
        stalls.longest_without_progress.as_secs_f64(),
        report.summary()
    );
    assert!(
        recognised > 0,
        "no delivery cut off after its commit was recognised as a duplicate"
    );
    assert!(
        abandoned > 0,
        "the blackhole never made a lane give up its work"
    );
    assert!(nats_lost > 0, "the instances never noticed NATS going away");
    for (instance, stall) in ["a", "b"].iter().zip(&fetch_stalls) {
        assert!(
            *stall < FETCH_STALL,
            "instance {instance} went {stall:?} without an ack while orders flowed after NATS \
             came back"
        );
    }
    assert!(
        stalls.longest_lane_hold < STUCK.as_secs_f64(),
        "a lane held one message for {:.1} s",
        stalls.longest_lane_hold
    );
}
