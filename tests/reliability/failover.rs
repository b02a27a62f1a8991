//! PostgreSQL failing over under two running instances: a primary with a
//! synchronous standby, HAProxy in front of both, the primary SIGKILLed mid-stream (the host
//! dying: postmaster and every backend at once), HAProxy switched to the standby and the
//! standby promoted. The switch comes first on purpose, as from a proxy whose health check only
//! asks whether a server answers: for a while the service reaches a standby, which answers but
//! refuses writes; it must hold its lanes (or retry what meets SQLSTATE 25006), never
//! dead-letter. The instances ride it out without a restart, and the natural key's promise
//! holds: every order reserved exactly once, nothing lost, nothing dead-lettered, each
//! decision's event stored once. Printed: the timeline, how long the ack floor stood still,
//! and the longest an order waited from its publication to its reservation.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use async_nats::jetstream::context::Context;
use inventory_infra::db::DatabaseConnection;
use inventory_infra::jetstream::Topology;
use inventory_tests::haproxy::HaProxy;
use inventory_tests::outbox;
use inventory_tests::pg_server::PostgresServer;
use inventory_tests::workload::{self, Ledger, StreamState, Workload};
use sea_orm::{ConnectionTrait, DbBackend, Statement};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::support::{
    Instance, Scenario, fresh_with_books, stop_all, until_acked, wait_until_empty,
};

/// The standby's `application_name`, which the primary's `synchronous_standby_names` names.
const STANDBY: &str = "inventory_standby";
const ORDERS: usize = 3_000;
/// From the primary's death to the switch: the time a failover manager (or a person) needs to
/// notice. The service has no database meanwhile.
const DETECTION: Duration = Duration::from_secs(1);
/// From the switch to the promotion: the service reaches a standby that refuses writes.
const READ_ONLY: Duration = Duration::from_secs(3);
const SETTLE: Duration = Duration::from_secs(180);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: run by scripts/test.sh"]
async fn primary_killed_and_its_synchronous_standby_promoted_behind_haproxy() {
    let mut primary = PostgresServer::start_primary(STANDBY).await;
    let mut standby = PostgresServer::start_standby(&primary, STANDBY).await;
    primary.wait_for_sync_standby(STANDBY).await;
    let proxy = HaProxy::start(&[("primary", primary.port()), ("standby", standby.port())]).await;
    // Everything, the instances included, reaches PostgreSQL through the proxy only.
    let (fresh, books) = fresh_with_books(&proxy.url(), "inventory_failover", 4).await;
    let db = fresh.conn.clone();
    let nats = inventory_tests::nats::shared_url().await;
    let scenario = Scenario::new("failover", &fresh.url, &nats, 1);
    let (_client, js) = scenario.connect().await;
    let workload = Workload::new(&books, ORDERS, ORDERS / 5, ORDERS / 10, 14);
    let total = workload.sends.len() as u64;
    let instances: Vec<Instance> = ["a", "b"]
        .iter()
        .map(|label| scenario.spawn(label))
        .collect();
    let watch = AckFloorWatch::start(&js, &scenario);
    let producer = scenario.start_producer(
        &js,
        &workload.sends,
        workload.sends.len() / 12,
        Duration::from_millis(200),
    );

    until_acked(&js, &scenario, total, 0.3).await;
    let killed = Instant::now();
    primary.kill().await;
    tokio::time::sleep(DETECTION).await;
    proxy.switch_to("standby").await;
    let switched = killed.elapsed();
    tokio::time::sleep(READ_ONLY).await;
    standby.promote().await;
    let promoted = Instant::now();
    producer.await.unwrap();

    let topology = &scenario.topology;
    let state = workload::settle(&js, topology, &scenario.names.consumer, total, SETTLE).await;
    // The relay runs inside serve: its events must be out before the instances stop.
    wait_until_empty(&db, "outbox", &scenario, SETTLE).await;
    let samples = watch.stop().await;
    let counters = Counters::read(&instances, &scenario.names.consumer);
    stop_all(&scenario, instances);

    let report = workload::check_ledger(&db, &workload, state, Ledger::Reservations).await;
    report.assert_holds();
    let events = outbox::stored(&js, &topology.events_stream).await;
    assert_one_reserved_event_per_order(&events, &workload, topology);
    assert!(
        counters.retried > 0.0,
        "no delivery was retried: the failover was never felt"
    );
    // Logs are no contract, but the only witness that the lanes held while the proxy led to a
    // standby (their check before fetching again found it read-only) instead of burning
    // deliveries on writes it refuses (SQLSTATE 25006, retried: a few slip through).
    let held = scenario.log_lines_with("the server is read-only");
    let refused = scenario.log_lines_with("SQLSTATE 25006");
    assert!(
        held > 0,
        "the lanes never held on the read-only standby ({refused} writes refused)"
    );

    let stalls = Stalls::of(&samples, killed, promoted);
    assert!(
        stalls.at_kill.stream_last_seq < total,
        "the kill came after the last publication: {:?}",
        stalls.at_kill
    );
    let (longest_wait, waited) = longest_wait(&js, topology, &db).await;
    eprintln!(
        "[failover] killed with {} of {total} messages published and {} acked; HAProxy \
         switched {switched:.1?} after the kill, the standby promoted after {:.1?} (meanwhile \
         {held} checks found it read-only, {refused} writes refused as read-only); the ack \
         floor moved again {:.1?} after the kill; longest ack-floor stall {:.1?}; longest wait \
         from publication to reservation {longest_wait:.1?} (order {waited}); {}; {} events, \
         {} republished (duplicate PubAcks); {}",
        stalls.at_kill.stream_last_seq,
        stalls.at_kill.ack_floor,
        promoted - killed,
        stalls.first_advance_after_kill,
        stalls.longest,
        counters.describe(),
        events.len(),
        counters.duplicate_pubacks,
        report.summary()
    );
    for stream in [
        &topology.stream,
        &topology.events_stream,
        &topology.dlq_stream,
    ] {
        let _ = js.delete_stream(stream).await;
    }
}

/// Each decision's event once: every order exactly one `stock.reserved` (stock is plenty, so
/// nothing is rejected), none for anything else, no event id twice.
fn assert_one_reserved_event_per_order(
    events: &[outbox::Stored],
    workload: &Workload,
    topology: &Topology,
) {
    let by_order = outbox::subjects_by_order(events, &topology.events_subject_prefix);
    assert_eq!(by_order.len(), workload.orders.len(), "orders with events");
    for order in workload.orders.keys() {
        assert_eq!(
            by_order.get(&order.as_uuid()).map(Vec::as_slice),
            Some(&["stock.reserved".to_owned()][..]),
            "events of order {order}"
        );
    }
}

/// The consumer's ack floor sampled every 100 ms in the background.
struct AckFloorWatch {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Vec<(Instant, StreamState)>>,
}

impl AckFloorWatch {
    fn start(js: &Context, scenario: &Scenario) -> Self {
        let stop = CancellationToken::new();
        let (js, topology, consumer) = (
            js.clone(),
            scenario.topology.clone(),
            scenario.names.consumer.clone(),
        );
        let token = stop.clone();
        let task = tokio::spawn(async move {
            let mut samples = Vec::new();
            while !token.is_cancelled() {
                if let Some(state) = workload::stream_state(&js, &topology, &consumer).await {
                    samples.push((Instant::now(), state));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            samples
        });
        Self { stop, task }
    }

    async fn stop(self) -> Vec<(Instant, StreamState)> {
        self.stop.cancel();
        self.task.await.unwrap()
    }
}

/// How long the ack floor stood still while messages waited.
struct Stalls {
    /// The last sample before the kill: how far the producer and the consumer had come.
    at_kill: StreamState,
    /// From the kill to the first sample after the promotion with a higher ack floor than at
    /// the promotion (nothing can commit in between).
    first_advance_after_kill: Duration,
    /// The longest time between two advances of the ack floor with messages waiting.
    longest: Duration,
}

impl Stalls {
    fn of(samples: &[(Instant, StreamState)], killed: Instant, promoted: Instant) -> Self {
        let at_kill = samples
            .iter()
            .take_while(|(at, _)| *at <= killed)
            .last()
            .map(|(_, state)| *state)
            .expect("a sample before the kill");
        let floor_at_promotion = samples
            .iter()
            .take_while(|(at, _)| *at <= promoted)
            .map(|(_, state)| state.ack_floor)
            .max()
            .unwrap_or(0);
        let first_advance_after_kill = samples
            .iter()
            .find(|(at, state)| *at > promoted && state.ack_floor > floor_at_promotion)
            .map(|(at, _)| *at - killed)
            .expect("the ack floor never moved after the promotion");
        let mut longest = Duration::ZERO;
        let mut last_advance: Option<(Instant, u64)> = None;
        for &(at, state) in samples {
            match last_advance {
                Some((since, floor)) if state.ack_floor > floor => {
                    longest = longest.max(at - since);
                    last_advance = Some((at, state.ack_floor));
                }
                // Nothing waits: standing still is not a stall.
                Some(_) if state.settled() => last_advance = Some((at, state.ack_floor)),
                Some(_) => {}
                None => last_advance = Some((at, state.ack_floor)),
            }
        }
        Self {
            at_kill,
            first_advance_after_kill,
            longest,
        }
    }
}

/// What the instances counted, summed over both.
struct Counters {
    processed: f64,
    duplicates: f64,
    retried: f64,
    duplicate_pubacks: f64,
}

impl Counters {
    fn read(instances: &[Instance], consumer: &str) -> Self {
        let sum = |name: &str| -> f64 {
            instances
                .iter()
                .map(|instance| {
                    instance
                        .metric(name)
                        .unwrap_or_else(|| panic!("instance {} has no /metrics", instance.label))
                })
                .sum()
        };
        let outcome = |outcome: &str| {
            sum(&format!(
                "inventory_messages_total{{consumer=\"{consumer}\",outcome=\"{outcome}\"}}"
            ))
        };
        Self {
            processed: outcome("processed"),
            duplicates: outcome("duplicate"),
            retried: outcome("retried"),
            duplicate_pubacks: sum("inventory_outbox_duplicate_pubacks_total{outbox=\"outbox\"}"),
        }
    }

    fn describe(&self) -> String {
        format!(
            "deliveries: {} processed, {} duplicates, {} retried",
            self.processed, self.duplicates, self.retried
        )
    }
}

/// The longest any order waited from its first message's arrival in the stream to the commit
/// of its reservation (the row's `created_at`), and that order.
async fn longest_wait(
    js: &Context,
    topology: &Topology,
    db: &DatabaseConnection,
) -> (Duration, Uuid) {
    let mut stream = js.get_stream(&topology.stream).await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut published: HashMap<Uuid, i128> = HashMap::new();
    for sequence in 1..=last {
        let message = stream.get_raw_message(sequence).await.unwrap();
        let body: serde_json::Value = serde_json::from_slice(&message.payload).unwrap();
        let order: Uuid = body["order_id"].as_str().unwrap().parse().unwrap();
        let at = message.time.unix_timestamp_nanos();
        published
            .entry(order)
            .and_modify(|first| *first = (*first).min(at))
            .or_insert(at);
    }
    let rows = db
        .query_all_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT order_id, created_at FROM stock_reservations",
        ))
        .await
        .unwrap();
    rows.iter()
        .map(|row| {
            let order: Uuid = row.try_get("", "order_id").unwrap();
            let created: chrono::DateTime<chrono::Utc> = row.try_get("", "created_at").unwrap();
            let reserved = i128::from(created.timestamp_nanos_opt().unwrap());
            let waited = u64::try_from(reserved - published[&order]).unwrap_or(0);
            (Duration::from_nanos(waited), order)
        })
        .max()
        .expect("reservations")
}
