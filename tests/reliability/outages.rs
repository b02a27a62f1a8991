//! PostgreSQL and NATS going away mid-stream under running instances of the binary: the
//! service rides them out without intervention, and the promise holds afterwards. The natural
//! key with 3,000 orders; the inbox and the email with 1,000 each (their promises in
//! [`Served`]).

use std::time::Duration;

use async_nats::jetstream::context::Context;
use inventory_tests::nats::NatsServer;
use inventory_tests::pg_server::PostgresServer;
use inventory_tests::workload::{self, Workload};
use inventory_tests::{Backend, TestDb};

use crate::support::{Instance, Scenario, Served, fresh_with_books, stop_all, until_acked};

/// Orders per scenario: fewer for the strategies beside the default one, to keep the slow tier
/// short.
fn orders(served: Served) -> usize {
    if served == Served::NaturalKey {
        3_000
    } else {
        1_000
    }
}

/// Publishes `workload` at a pace that lasts a few seconds whatever its size.
fn chunk(workload: &Workload) -> usize {
    (workload.sends.len() / 12).max(1)
}

/// The scenario's instances: two, or the one the email runs.
fn spawn_instances(scenario: &Scenario) -> Vec<Instance> {
    ["a", "b"][..scenario.served.instances()]
        .iter()
        .map(|label| scenario.spawn(label))
        .collect()
}

async fn finish(
    scenario: &Scenario,
    js: &Context,
    db: &inventory_infra::db::DatabaseConnection,
    workload: &Workload,
    instances: Vec<Instance>,
    what: &str,
    felt: &str,
) {
    let total = workload.sends.len() as u64;
    let state = workload::settle(
        js,
        &scenario.topology,
        &scenario.names.consumer,
        total,
        Duration::from_secs(300),
    )
    .await;
    stop_all(scenario, instances);
    let summary = scenario
        .served
        .assert_promise(scenario, db, workload, state)
        .await;
    let felt_lines = scenario.log_lines_with(felt);
    eprintln!(
        "[{what}, {:?}] {felt_lines} log lines \"{felt}\"; {summary}",
        scenario.served
    );
    assert!(felt_lines > 0, "the instances never noticed the outage");
}

async fn postgres_restarted_twice_mid_stream(served: Served) {
    let mut server = PostgresServer::start().await;
    let (fresh, books) = fresh_with_books(&server.url(), "inventory_pg_outage", 4).await;
    let nats = inventory_tests::nats::shared_url().await;
    let mut scenario = Scenario::new("pgout", &fresh.url, &nats, 1);
    scenario.serve(served);
    let (_client, js) = scenario.connect().await;
    let orders = orders(served);
    let workload = Workload::new(
        &books,
        orders,
        served.new_id_resends(orders),
        orders / 10,
        7,
    );
    let total = workload.sends.len() as u64;
    let instances = spawn_instances(&scenario);
    let producer = scenario.start_producer(
        &js,
        &workload.sends,
        chunk(&workload),
        Duration::from_millis(200),
    );

    until_acked(&js, &scenario, total, 0.2).await;
    server.stop().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    server.start_again().await;
    until_acked(&js, &scenario, total, 0.6).await;
    server.stop().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    server.start_again().await;
    producer.await.unwrap();

    finish(
        &scenario,
        &js,
        &fresh.conn,
        &workload,
        instances,
        "PostgreSQL stopped twice",
        // "database error", "database unreachable": worded loosely, logs are not a contract.
        "database",
    )
    .await;
}

async fn nats_stopped_then_killed_mid_stream(served: Served) {
    let mut server = NatsServer::start().await;
    let db = TestDb::new(Backend::Postgres).await;
    let books = [db.dune(1_000_000).await, db.dune(1_000_000).await];
    let mut scenario = Scenario::new("natsout", &db.url, &server.url(), 1);
    scenario.serve(served);
    let (_client, js) = scenario.connect().await;
    let orders = orders(served);
    let workload = Workload::new(
        &books,
        orders,
        served.new_id_resends(orders),
        orders / 10,
        11,
    );
    let total = workload.sends.len() as u64;
    let instances = spawn_instances(&scenario);
    let producer = scenario.start_producer(
        &js,
        &workload.sends,
        chunk(&workload),
        Duration::from_millis(200),
    );

    until_acked(&js, &scenario, total, 0.2).await;
    // A clean shutdown, then a crash: SIGKILL loses whatever the server had not written.
    server.stop().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    server.start_again().await;
    until_acked(&js, &scenario, total, 0.6).await;
    server.kill();
    tokio::time::sleep(Duration::from_secs(1)).await;
    server.start_again().await;
    producer.await.unwrap();

    finish(
        &scenario,
        &js,
        &db.conn,
        &workload,
        instances,
        "NATS stopped, then killed",
        "disconnected",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: run by scripts/test.sh"]
async fn postgres_restarted_twice_mid_stream_under_two_instances() {
    postgres_restarted_twice_mid_stream(Served::NaturalKey).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: run by scripts/test.sh"]
async fn postgres_restarted_twice_mid_stream_under_the_inbox() {
    postgres_restarted_twice_mid_stream(Served::Inbox).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: run by scripts/test.sh"]
async fn postgres_restarted_twice_mid_stream_under_the_email() {
    postgres_restarted_twice_mid_stream(Served::Email).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: run by scripts/test.sh"]
async fn nats_stopped_then_killed_mid_stream_under_two_instances() {
    nats_stopped_then_killed_mid_stream(Served::NaturalKey).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: run by scripts/test.sh"]
async fn nats_stopped_then_killed_mid_stream_under_the_inbox() {
    nats_stopped_then_killed_mid_stream(Served::Inbox).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: run by scripts/test.sh"]
async fn nats_stopped_then_killed_mid_stream_under_the_email() {
    nats_stopped_then_killed_mid_stream(Served::Email).await;
}
