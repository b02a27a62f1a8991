//! `/healthz` follows the database and NATS: 503 while either is gone, 200 again once it is
//! back. An orchestrator's probe acts on it, so a health check that stays 503 after an outage
//! would take a working instance out.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use inventory_benches::fresh::FreshDatabase;
use inventory_infra::db::DatabaseConnection;
use inventory_infra::jetstream;
use inventory_service::metrics::{self, Metrics};
use inventory_tests::broker::eventually;
use inventory_tests::nats::NatsServer;
use inventory_tests::pg_server::PostgresServer;
use inventory_tests::{Backend, TestDb};
use sea_orm::TransactionTrait;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// `/healthz` served in-process on `db` and a client of `nats_url`, until `stop`.
async fn serve_health(
    nats_url: &str,
    db: DatabaseConnection,
    stop: &CancellationToken,
) -> SocketAddr {
    let client = jetstream::connect(nats_url, "inventory health test")
        .await
        .unwrap();
    metrics::serve(
        "127.0.0.1:0".parse().unwrap(),
        Metrics::new().unwrap(),
        client,
        db,
        stop.clone(),
    )
    .await
    .unwrap()
}

/// The status and the JSON body of `GET /healthz`.
pub(crate) async fn healthz(addr: SocketAddr) -> (u16, serde_json::Value) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
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
        let (status, body) = healthz(addr).await;
        assert_eq!(status, 503, "{body}");
        assert_eq!(body["database"], "unreachable");
        assert_eq!(body["nats"], "connected");
        server.start_again().await;
        wait_for_health(addr, 200, "database", "reachable").await;
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
