//! `/readyz` (and `/healthz`, its first name) follows the database and NATS: 503 while either
//! is gone, 200 again once it is back; `/livez` does not, so that an outage never restarts the
//! instances that will resume by themselves. An orchestrator's probes act on them: a readiness
//! that stays 503 after an outage would take a working instance out, a liveness that follows
//! the database would restart every instance at once.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use inventory_benches::fresh::FreshDatabase;
use inventory_infra::db::DatabaseConnection;
use inventory_infra::jetstream;
use inventory_service::health::{self, Liveness, Readiness};
use inventory_service::metrics::Metrics;
use inventory_tests::broker::eventually;
use inventory_tests::nats::NatsServer;
use inventory_tests::pg_server::PostgresServer;
use inventory_tests::{Backend, TestDb};
use sea_orm::TransactionTrait;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// The health endpoints served in-process, ready on `db` and a client of `nats_url`, until
/// `stop`.
async fn serve_health(
    nats_url: &str,
    db: DatabaseConnection,
    stop: &CancellationToken,
) -> SocketAddr {
    let client = jetstream::connect(nats_url, "inventory health test")
        .await
        .unwrap();
    let readiness = Readiness::default();
    readiness.ready(client, &db);
    health::serve(
        "127.0.0.1:0".parse().unwrap(),
        Metrics::new().unwrap(),
        Liveness::default(),
        readiness,
        Duration::from_secs(60),
        stop.clone(),
    )
    .await
    .map(|(addr, server)| {
        tokio::spawn(server);
        addr
    })
    .unwrap()
}

/// The status and the JSON body of `GET /healthz`.
pub(crate) async fn healthz(addr: SocketAddr) -> (u16, serde_json::Value) {
    get(addr, "/healthz").await
}

/// The status and the JSON body of `GET path`.
pub(crate) async fn get(addr: SocketAddr, path: &str) -> (u16, serde_json::Value) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let status = response.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = response.split_once("\r\n\r\n").unwrap().1;
    (status, serde_json::from_str(body).unwrap())
}

async fn wait_for_health(addr: SocketAddr, status: u16, field: &str, value: &str) {
    eventually(
        &format!("/healthz {status} with {field} {value}"),
        || async {
            let (got, body) = healthz(addr).await;
            got == status && body[field] == value
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_is_503_while_the_database_is_down_and_200_once_it_is_back() {
    let mut server = PostgresServer::start().await;
    let fresh = FreshDatabase::create(Some(&server.url()), "inventory_health", 4)
        .await
        .unwrap();
    let stop = CancellationToken::new();
    let addr = serve_health(
        &inventory_tests::nats::shared_url().await,
        fresh.conn.clone(),
        &stop,
    )
    .await;
    assert_eq!(healthz(addr).await.0, 200);
    // Twice: the second outage finds the pool the first one left behind.
    for _ in 0..2 {
        server.stop().await;
        for path in ["/healthz", "/readyz"] {
            let (status, body) = get(addr, path).await;
            assert_eq!(status, 503, "{path}: {body}");
            assert_eq!(body["database"], "unreachable");
            assert_eq!(body["nats"], "connected");
        }
        let (status, body) = get(addr, "/livez").await;
        assert_eq!(status, 200, "/livez followed the database: {body}");
        server.start_again().await;
        wait_for_health(addr, 200, "database", "reachable").await;
        assert_eq!(get(addr, "/readyz").await.0, 200);
        assert_eq!(get(addr, "/livez").await.0, 200);
    }
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_follows_the_database_while_every_pool_connection_is_taken() {
    const POOL: u32 = 2;
    let mut server = PostgresServer::start().await;
    let fresh = FreshDatabase::create(Some(&server.url()), "inventory_health_pool", POOL)
        .await
        .unwrap();
    let stop = CancellationToken::new();
    let addr = serve_health(
        &inventory_tests::nats::shared_url().await,
        fresh.conn.clone(),
        &stop,
    )
    .await;
    // The whole pool taken and never given back, as by lanes in long transactions or hung on
    // connections a failing network left half-open: the database still answers.
    let mut held = Vec::new();
    for _ in 0..POOL {
        held.push(fresh.conn.begin().await.unwrap());
    }
    let (status, body) = healthz(addr).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["database"], "reachable");

    // A restart between two checks: the check's own connection died with the server, which is
    // back; that alone must not fail the next check.
    server.stop().await;
    server.start_again().await;
    let (status, body) = healthz(addr).await;
    assert_eq!(status, 200, "{body}");

    server.stop().await;
    let (status, body) = healthz(addr).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["database"], "unreachable");
    server.start_again().await;
    // Back within seconds although the pool stays stuck: its connections died with the server
    // and are still held.
    let back = Instant::now();
    wait_for_health(addr, 200, "database", "reachable").await;
    assert!(
        back.elapsed() < Duration::from_secs(5),
        "200 only {:?} after the database came back",
        back.elapsed()
    );
    drop(held);
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_is_503_while_nats_is_disconnected_and_200_once_it_is_back() {
    let mut server = NatsServer::start().await;
    let db = TestDb::new(Backend::Postgres).await;
    let stop = CancellationToken::new();
    let addr = serve_health(&server.url(), db.conn.clone(), &stop).await;
    assert_eq!(healthz(addr).await.0, 200);
    server.stop().await;
    // The client notices the closed connection by itself, a moment later.
    wait_for_health(addr, 503, "nats", "disconnected").await;
    assert_eq!(healthz(addr).await.1["database"], "reachable");
    server.start_again().await;
    wait_for_health(addr, 200, "nats", "connected").await;
    stop.cancel();
}

/// Before the set-up is done `/readyz` says `starting` and `/livez` is 200: a slow start (the
/// migrations, a stream electing its leader) is not a dead process. A task that ended while
/// the service ran makes `/livez` 503, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_says_starting_until_set_up_and_livez_follows_the_tasks() {
    let (liveness, readiness) = (Liveness::default(), Readiness::default());
    let stop = CancellationToken::new();
    let addr = health::serve(
        "127.0.0.1:0".parse().unwrap(),
        Metrics::new().unwrap(),
        liveness.clone(),
        readiness.clone(),
        Duration::from_secs(60),
        stop.clone(),
    )
    .await
    .map(|(addr, server)| {
        tokio::spawn(server);
        addr
    })
    .unwrap();
    let (status, body) = get(addr, "/readyz").await;
    assert_eq!((status, body["status"].as_str()), (503, Some("starting")));
    assert_eq!(
        get(addr, "/livez").await,
        (
            200,
            serde_json::json!({"tasks": "running", "oldest_in_flight_seconds": 0.0})
        )
    );

    let db = TestDb::new(Backend::Postgres).await;
    let client = jetstream::connect(&inventory_tests::nats::shared_url().await, "health test")
        .await
        .unwrap();
    readiness.ready(client, &db.conn);
    assert_eq!(get(addr, "/readyz").await.0, 200);

    liveness.task_failed("lane", "panicked: injected");
    let (status, body) = get(addr, "/livez").await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["tasks"], "failed");
    assert_eq!(body["failure"], "lane panicked: injected");
    stop.cancel();
}
