//! A three-node JetStream cluster, streams with three replicas, two instances given every
//! node's URL: the stream's leader is killed mid-stream and brought back.

use std::time::{Duration, Instant};

use inventory_tests::nats::NatsCluster;
use inventory_tests::workload::{self, Workload, stream_state};
use inventory_tests::{Backend, TestDb};

use crate::support::Scenario;

const ORDERS: usize = 5_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: run by scripts/test.sh"]
async fn a_cluster_losing_its_stream_leader_mid_stream_loses_nothing() {
    let mut cluster = NatsCluster::start().await;
    let db = TestDb::new(Backend::Postgres).await;
    let books = [db.dune(1_000_000).await, db.dune(1_000_000).await];
    // What a user gives the service for a cluster: every node, comma separated.
    let urls = cluster.urls().join(",");
    let scenario = Scenario::new("cluster", &db.url, &urls, 3);
    let (_client, js) = scenario.connect().await;
    let workload = Workload::new(&books, ORDERS, ORDERS / 5, ORDERS / 10, 13);
    let total = workload.sends.len() as u64;
    let instances = [scenario.spawn("a"), scenario.spawn("b")];
    let producer = scenario.start_producer(&js, &workload.sends, 300, Duration::from_millis(200));

    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let state = stream_state(&js, &scenario.topology, &scenario.names.consumer).await;
        if state.is_some_and(|state| state.ack_floor >= total / 4) {
            break;
        }
        assert!(Instant::now() < deadline, "a quarter never got acked");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut stream = js.get_stream(&scenario.topology.stream).await.unwrap();
    let info = stream.info().await.unwrap();
    assert_eq!(info.config.num_replicas, 3);
    let leader = info
        .cluster
        .as_ref()
        .and_then(|cluster| cluster.leader.clone())
        .expect("the stream has a leader");
    let index = cluster
        .index_of(&leader)
        .expect("the leader is one of ours");
    cluster.kill_node(index);
    tokio::time::sleep(Duration::from_secs(3)).await;
    cluster.start_node_again(index).await;
    producer.await.unwrap();

    let state = workload::settle(
        &js,
        &scenario.topology,
        &scenario.names.consumer,
        total,
        Duration::from_secs(300),
    )
    .await;
    let new_leader = js
        .get_stream(&scenario.topology.stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .cluster
        .as_ref()
        .and_then(|cluster| cluster.leader.clone());
    for mut instance in instances {
        assert!(instance.is_running(), "{}", scenario.log_tails());
        let status = instance.terminate();
        assert!(status.success(), "{status}\n{}", scenario.log_tails());
    }
    let report = workload::check(&db.conn, &workload, state).await;
    eprintln!(
        "[cluster] killed stream leader {leader}, now led by {new_leader:?}: {}",
        report.summary()
    );
    report.assert_holds();
}
