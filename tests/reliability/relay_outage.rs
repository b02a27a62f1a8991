//! NATS away for more than a minute under two `inventory relay` processes while decisions
//! keep being committed: nothing is lost, nothing stored twice, each order's events in order,
//! the relays back off (they do not hammer the dead server) and say they are failing, and
//! drain the outbox once NATS is back.

use std::fs::File;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use inventory_benches::consumers::{HandlerKind, NaturalKeyPath};
use inventory_infra::jetstream;
use inventory_tests::binary::{free_port, http_get};
use inventory_tests::nats::{NatsServer, unique_names};
use inventory_tests::outbox::{self, Decided, assert_each_order_in_order, decide};
use inventory_tests::{Backend, TestDb};
use tokio_util::sync::CancellationToken;

use crate::support::binary;

const OUTAGE: Duration = Duration::from_secs(65);

struct RelayProcess {
    child: Child,
    port: u16,
    log: std::path::PathBuf,
}

impl RelayProcess {
    fn health(&self) -> Option<(u16, serde_json::Value)> {
        http_get(self.port, "/healthz")
            .map(|(status, body)| (status, serde_json::from_str(&body).unwrap()))
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: run by scripts/test.sh"]
async fn nats_away_for_over_a_minute_under_two_relays_loses_nothing() {
    let mut server = NatsServer::start().await;
    let db = TestDb::new(Backend::Postgres).await;
    let names = unique_names("relayout");
    let logs = std::env::temp_dir().join(format!("inventory-{}", names.suffix));
    std::fs::create_dir_all(&logs).unwrap();
    let relays: Vec<RelayProcess> = ["a", "b"]
        .iter()
        .map(|label| {
            let port = free_port();
            let log = logs.join(format!("{label}.log"));
            let file = File::create(&log).unwrap();
            let child = Command::new(binary())
                .args(["relay", "--metrics-addr", &format!("127.0.0.1:{port}")])
                .args(["--events-stream", &names.events_stream])
                .args(["--events-subject-prefix", &names.events_subject_prefix])
                .args(["--relay-unhealthy-after", "5s"])
                .env("DATABASE_URL", &db.url)
                .env("NATS_URL", server.url())
                .env("RUST_LOG", "info,sqlx=warn")
                .stdin(Stdio::null())
                .stdout(Stdio::from(file.try_clone().unwrap()))
                .stderr(Stdio::from(file))
                .spawn()
                .unwrap();
            RelayProcess { child, port, log }
        })
        .collect();
    let started = Instant::now();
    while relays.iter().any(|relay| relay.health().is_none()) {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the relays never listened"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let (plenty, scarce) = (db.dune(1_000_000).await, db.dune(2).await);
    let producing = CancellationToken::new();
    let producer = tokio::spawn({
        let handler = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::OneStatement));
        let producing = producing.clone();
        async move {
            let mut decided: Vec<Decided> = Vec::new();
            while !producing.is_cancelled() {
                decided.extend(decide(&handler, plenty, scarce, 4).await);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            decided
        }
    });
    let client = jetstream::connect(&server.url(), "relay outage test")
        .await
        .unwrap();
    let js = jetstream::context(client);
    let until = Instant::now() + Duration::from_secs(30);
    while outbox::stored(&js, &names.events_stream).await.len() < 100 {
        assert!(
            Instant::now() < until,
            "nothing published before the outage"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    server.stop().await;
    let outage = Instant::now();
    let mut seen_failing = [false, false];
    while outage.elapsed() < OUTAGE {
        for (seen, relay) in seen_failing.iter_mut().zip(&relays) {
            if let Some((503, body)) = relay.health()
                && body["relay"] == "failing"
            {
                *seen = true;
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let waiting = outbox::rows(&db.conn, "outbox").await.len();
    server.start_again().await;
    // Orders keep coming for a while after NATS is back, then stop.
    tokio::time::sleep(Duration::from_secs(3)).await;
    producing.cancel();
    let decided = producer.await.unwrap();
    let drained = Instant::now();
    while !outbox::rows(&db.conn, "outbox").await.is_empty() {
        assert!(
            drained.elapsed() < Duration::from_secs(120),
            "the outbox never emptied"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let drain_took = drained.elapsed();
    for relay in &relays {
        let until = Instant::now() + Duration::from_secs(30);
        while !matches!(relay.health(), Some((200, ref body)) if body["relay"] == "publishing") {
            assert!(Instant::now() < until, "{:?}", relay.health());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    let client = jetstream::connect(&server.url(), "relay outage check")
        .await
        .unwrap();
    let js = jetstream::context(client);
    let stored = outbox::stored(&js, &names.events_stream).await;
    assert_each_order_in_order(&stored, &decided, &names.events_subject_prefix);
    assert_eq!(seen_failing, [true, true], "each relay reported failing");
    // Capped exponential backoff: about a dozen retries a minute, not one per poll.
    for relay in &relays {
        let retries = relay.log().matches("outbox relay: rows wait").count();
        assert!(
            (3..=60).contains(&retries),
            "{retries} failed passes in {OUTAGE:?}:\n{}",
            relay.log()
        );
    }
    for mut relay in relays {
        let _ = Command::new("kill")
            .args(["-TERM", &relay.child.id().to_string()])
            .status();
        let until = Instant::now() + Duration::from_secs(20);
        let status = loop {
            if let Some(status) = relay.child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < until, "no exit after SIGTERM");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(status.success(), "{}", relay.log());
    }
    let _ = std::fs::remove_dir_all(&logs);
    eprintln!(
        "relay outage: {} orders, {} events, NATS away {OUTAGE:?} with {waiting} rows waiting \
         at its end, drained in {drain_took:?}",
        decided.len(),
        stored.len()
    );
}
