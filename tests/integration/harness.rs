//! The server harnesses themselves: what the restart tests rely on must hold on this machine's
//! nats-server and PostgreSQL.

use std::time::{Duration, Instant};

use async_nats::ToServerAddrs;
use async_nats::jetstream::{self, Context, message::PublishMessage, stream};
use inventory_infra::db;
use inventory_tests::nats::{NatsCluster, NatsServer, TestNames, shared_url, unique_names};
use inventory_tests::pg_server::PostgresServer;
use sea_orm::{ConnectionTrait, Database, DbBackend, Statement};

/// A client that retries a lost server every 100 ms rather than backing off for seconds, so a
/// test resumes as soon as the server is back.
async fn client(servers: impl ToServerAddrs) -> Context {
    let client = async_nats::ConnectOptions::new()
        .reconnect_delay_callback(|_| Duration::from_millis(100))
        .connect(servers)
        .await
        .expect("a NATS connection");
    jetstream::new(client)
}

async fn create_orders(js: &Context, names: &TestNames, replicas: usize) -> stream::Stream {
    js.create_stream(stream::Config {
        name: names.stream.clone(),
        subjects: vec![names.subjects()],
        storage: stream::StorageType::File,
        num_replicas: replicas,
        ..Default::default()
    })
    .await
    .expect("the orders stream")
}

/// Publishes `order <n>` with message id `<n>` until the stream acknowledges it. Retrying is
/// safe: the stream drops a second copy with the same id.
async fn publish(js: &Context, names: &TestNames, n: u64) {
    // Long enough for a cluster to elect a new stream leader after losing the old one: seconds
    // alone, but over 20 s seen while the rest of the suite kept both cores busy.
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let message = PublishMessage::build()
            .message_id(n.to_string())
            .payload(format!("order {n}").into());
        let acked = match js.send_publish(names.placed_subject(), message).await {
            Ok(ack) => ack.await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match acked {
            Ok(_) => return,
            Err(e) if Instant::now() >= deadline => panic!("order {n} was never stored: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

async fn assert_orders(js: &Context, names: &TestNames, count: u64) {
    let mut stream = js
        .get_stream(&names.stream)
        .await
        .expect("the orders stream");
    let info = stream.info().await.expect("the stream's info");
    assert_eq!(info.state.messages, count);
    for n in 1..=count {
        let message = stream.get_raw_message(n).await.expect("a stored order");
        assert_eq!(message.payload, format!("order {n}").as_bytes());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_nats_server_keeps_its_streams_across_a_restart() {
    let mut server = NatsServer::start().await;
    eprintln!("{}", server.version());
    let names = unique_names("harness restart");
    let js = client(&server.url()).await;
    create_orders(&js, &names, 1).await;
    for n in 1..=3 {
        publish(&js, &names, n).await;
    }

    server.stop().await;
    assert!(std::net::TcpStream::connect(("127.0.0.1", server.port())).is_err());
    server.start_again().await;

    // The same client, reconnected to the same URL.
    assert_orders(&js, &names, 3).await;
    publish(&js, &names, 4).await;
    assert_orders(&js, &names, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_nats_server_keeps_acknowledged_messages_when_killed() {
    let mut server = NatsServer::start().await;
    let names = unique_names("harness kill");
    let js = client(&server.url()).await;
    create_orders(&js, &names, 1).await;
    publish(&js, &names, 1).await;

    server.kill();
    server.start_again().await;

    assert_orders(&js, &names, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_of_three_keeps_a_replicated_stream_when_its_leader_dies() {
    let mut cluster = NatsCluster::start().await;
    eprintln!("{}", cluster.node(0).version());
    let names = unique_names("harness cluster");
    let js = client(cluster.urls()).await;
    let mut stream = create_orders(&js, &names, 3).await;
    for n in 1..=3 {
        publish(&js, &names, n).await;
    }
    let info = stream.info().await.expect("the stream's info");
    let replicas = info.cluster.as_ref().expect("cluster info");
    assert_eq!(
        replicas.replicas.len(),
        2,
        "two followers beside the leader"
    );
    let leader = replicas.leader.clone().expect("a stream leader");
    let leader = cluster
        .index_of(&leader)
        .expect("the leader is one of the nodes");

    // The worst node to lose: the stream needs a new leader before it takes another message.
    cluster.kill_node(leader);
    publish(&js, &names, 4).await;
    assert_orders(&js, &names, 4).await;

    cluster.start_node_again(leader).await;
    publish(&js, &names, 5).await;
    assert_orders(&js, &names, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_nats_server_takes_a_stream_under_names_of_the_tests_own() {
    let names = unique_names("harness shared");
    let js = client(shared_url().await).await;
    create_orders(&js, &names, 1).await;
    publish(&js, &names, 1).await;
    assert_orders(&js, &names, 1).await;
    js.delete_stream(&names.stream)
        .await
        .expect("the test's stream removed from the shared server");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_postgres_keeps_a_table_across_a_restart() {
    let mut server = PostgresServer::start().await;
    eprintln!("{}", server.version());
    let db = Database::connect(server.url()).await.expect("a connection");
    db.execute_unprepared(
        "CREATE TABLE kept (id int PRIMARY KEY); INSERT INTO kept VALUES (1), (2)",
    )
    .await
    .expect("a table with two rows");
    db.close().await.expect("closed");

    server.stop().await;
    assert!(std::net::TcpStream::connect(("127.0.0.1", server.port())).is_err());
    server.start_again().await;

    let db = Database::connect(server.url())
        .await
        .expect("a connection again");
    assert_eq!(rows_kept(&db).await, 2);
}

/// The rows of the table `kept`.
async fn rows_kept(db: &impl ConnectionTrait) -> i64 {
    db.query_one_raw(Statement::from_string(
        DbBackend::Postgres,
        "SELECT count(*) AS n FROM kept",
    ))
    .await
    .expect("the count")
    .expect("a row")
    .try_get("", "n")
    .expect("a count")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_standby_has_every_commit_and_takes_writes_once_promoted() {
    let mut primary = PostgresServer::start_primary("harness_standby").await;
    let mut standby = PostgresServer::start_standby(&primary, "harness_standby").await;
    primary.wait_for_sync_standby("harness_standby").await;
    let db = Database::connect(primary.url()).await.expect("the primary");
    db.execute_unprepared(
        "CREATE TABLE kept (id int PRIMARY KEY); INSERT INTO kept SELECT generate_series(1, 100)",
    )
    .await
    .expect("a table with 100 rows, committed on both servers");
    db::check_writable(&db)
        .await
        .expect("the primary takes writes");
    let replica = Database::connect(standby.url()).await.expect("the standby");
    let refused = db::check_writable(&replica).await;
    assert!(
        matches!(refused, Err(db::NotWritable::ReadOnly)),
        "a standby taken as writable: {refused:?}"
    );

    primary.kill().await;
    assert!(std::net::TcpStream::connect(("127.0.0.1", primary.port())).is_err());
    standby.promote().await;
    db::check_writable(&replica)
        .await
        .expect("the promoted standby takes writes");
    replica
        .execute_unprepared("INSERT INTO kept VALUES (101)")
        .await
        .expect("a write to the promoted standby, which commits alone");
    assert_eq!(rows_kept(&replica).await, 101);
}
