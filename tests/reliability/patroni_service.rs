//! The service riding a Patroni failover: two natural-key instances reach the Patroni pair
//! (tests/src/patroni.rs) only through its HAProxy, and the leader's host is killed mid-stream
//! (its Patroni and PostgreSQL SIGKILLed). Patroni promotes the synchronous standby once the
//! leader's lease expires, HAProxy follows it by its health checks, and the instances ride it
//! out with nobody restarting or reconfiguring them: every order reserved exactly once, nothing
//! lost, nothing dead-lettered, each decision's event stored once. The counterpart cuts the
//! standby off before the kill and shows what synchronous replication prevents: orders whose
//! messages the service acked to NATS have no reservation on the new leader, and are never
//! delivered again. Printed: the timeline from the kill to the promotion and to the ack floor
//! moving again, the longest ack-floor stall and the longest wait of an order.

use std::time::{Duration, Instant};

use inventory_tests::patroni::PatroniPair;
use inventory_tests::workload;

use crate::patroni::Replication;
use crate::support::{FailoverRun, Ridden, fresh_with_books, until_acked};

/// Half of the failover test's: the slow tier's budget, with the pair's own start and a
/// failover of about Patroni's TTL (10 s) on top.
const ORDERS: usize = 1_500;
/// The kill comes once this share of the messages is acked.
const KILL_AT: f64 = 0.3;
/// In the cut-off variant, the standby is cut off once this share is acked, and the kill waits
/// for [`ACKED_CUT_OFF`] more acks: each a decision the standby never received.
const CUT_OFF_AT: f64 = 0.1;
const ACKED_CUT_OFF: u64 = 300;
/// Patroni promotes within its TTL (10 s) of the kill; room for a loaded machine.
const PROMOTION: Duration = Duration::from_secs(60);
const SETTLE: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: run by scripts/test.sh"]
async fn service_rides_a_patroni_failover_with_every_order_reserved_exactly_once() {
    ride_failover(Replication::Synchronous)
        .await
        .assert_rode_it_out();
}

/// The deliberate bug: what the test above would see if replication were asynchronous.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: run by scripts/test.sh"]
async fn service_on_a_patroni_pair_with_its_standby_cut_off_loses_acked_reservations() {
    let report = ride_failover(Replication::CutOff).await.report;
    let summary = report.summary();
    assert!(
        report.orders_missing > 0,
        "the standby was cut off yet every order has its reservation: the check cannot see a \
         loss; {summary}"
    );
    // Lost, not waiting: the stream settled (every message acked) and none was dead-lettered,
    // so the orders without a row were acked to NATS and will never be delivered again.
    assert_eq!(report.stream.dead_letters, 0, "{summary}");
}

async fn ride_failover(replication: Replication) -> Ridden {
    let mut pair = PatroniPair::start().await;
    // Everything, the instances included, reaches PostgreSQL through HAProxy only.
    let (fresh, books) = fresh_with_books(&pair.url(), "inventory_patroni", 4).await;
    // Spread over about 10 s, so that messages keep arriving while the pair has no leader.
    let run = FailoverRun::start(
        "patroni",
        &fresh,
        &books,
        ORDERS,
        20,
        Duration::from_millis(500),
    )
    .await;

    let mut cut_off_at = None;
    if replication == Replication::CutOff {
        until_acked(&run.js, &run.scenario, run.total, CUT_OFF_AT).await;
        pair.cut_off_standby().await;
        let consumer = &run.scenario.names.consumer;
        let floor = workload::stream_state(&run.js, &run.scenario.topology, consumer)
            .await
            .expect("the consumer's state")
            .ack_floor;
        let target = (floor + ACKED_CUT_OFF) as f64 / run.total as f64;
        until_acked(&run.js, &run.scenario, run.total, target).await;
        cut_off_at = Some(floor);
    }
    until_acked(&run.js, &run.scenario, run.total, KILL_AT).await;
    let killed = Instant::now();
    let old_leader = pair.kill_leader().await;
    let new_leader = pair.wait_for_leader_other_than(old_leader, PROMOTION).await;
    let promoted = Instant::now();
    let ridden = run.finish(killed, promoted, SETTLE).await;

    eprintln!(
        "[patroni service {replication:?}] pair ready in {:.1} s; {old_leader} (leader) killed \
         with {}{}; Patroni promoted {new_leader} {:.1?} after the kill; {}; {} orders without \
         a reservation",
        pair.time_to_ready().as_secs_f64(),
        ridden.at_kill(),
        cut_off_at.map_or_else(String::new, |floor| format!(
            " (the standby cut off with {floor} acked)"
        )),
        promoted - killed,
        ridden.describe(),
        ridden.report.orders_missing,
    );
    ridden
}
