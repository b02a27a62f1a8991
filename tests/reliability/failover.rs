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

use std::time::{Duration, Instant};

use inventory_tests::haproxy::HaProxy;
use inventory_tests::pg_server::PostgresServer;

use crate::support::{FailoverRun, fresh_with_books, until_acked};

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
    let run = FailoverRun::start(
        "failover",
        &fresh,
        &books,
        ORDERS,
        12,
        Duration::from_millis(200),
    )
    .await;

    until_acked(&run.js, &run.scenario, run.total, 0.3).await;
    let killed = Instant::now();
    primary.kill().await;
    tokio::time::sleep(DETECTION).await;
    proxy.switch_to("standby").await;
    let switched = killed.elapsed();
    tokio::time::sleep(READ_ONLY).await;
    standby.promote().await;
    let promoted = Instant::now();
    let ridden = run.finish(killed, promoted, SETTLE).await;

    ridden.assert_rode_it_out();
    // Logs are no contract, but the only witness that the lanes held while the proxy led to a
    // standby (their check before fetching again found it read-only) instead of burning
    // deliveries on writes it refuses (SQLSTATE 25006, retried: a few slip through).
    let held = ridden.scenario.log_lines_with("the server is read-only");
    let refused = ridden.scenario.log_lines_with("SQLSTATE 25006");
    assert!(
        held > 0,
        "the lanes never held on the read-only standby ({refused} writes refused)"
    );
    eprintln!(
        "[failover] killed with {}; HAProxy switched {switched:.1?} after the kill, the standby \
         promoted after {:.1?} (meanwhile {held} checks found it read-only, {refused} writes \
         refused as read-only); {}",
        ridden.at_kill(),
        promoted - killed,
        ridden.describe()
    );
}
