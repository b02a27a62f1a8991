//! The outbox relay as processes: the one `serve --strategy natural` runs, `inventory relay`
//! on its own, and the `outbox parked|retry` commands.

use std::time::{Duration, Instant};

use inventory_benches::consumers::{HandlerKind, NaturalKeyPath};
use inventory_domain::{BookId, OrderId};
use inventory_infra::jetstream;
use inventory_tests::binary::{BinaryRun, free_port, http_get, sample, stop};
use inventory_tests::broker::eventually;
use inventory_tests::outbox::{self, assert_published_once_in_order};
use inventory_tests::placed_for;
use sea_orm::{ConnectionTrait, DbBackend, Statement};
use uuid::Uuid;

const BOOK: &str = "0190f5c4-3c2e-7b4a-9d3e-aaaaaaaaaaaa";

/// Waits until the process's /healthz answers, and returns it.
/// `/healthz` once the set-up is done: the listener answers `starting` before.
fn wait_for_health(port: u16) -> (u16, serde_json::Value) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some((status, body)) = http_get(port, "/healthz") {
            let body: serde_json::Value = serde_json::from_str(&body).unwrap();
            if body["status"] != "starting" {
                return (status, body);
            }
        }
        assert!(Instant::now() < deadline, "never done starting");
        std::thread::sleep(Duration::from_millis(100));
    }
}

async fn scalar(run: &BinaryRun, sql: &str) -> i64 {
    run.db
        .conn
        .query_one_raw(Statement::from_string(DbBackend::Postgres, sql))
        .await
        .unwrap()
        .unwrap()
        .try_get_by_index::<i64>(0)
        .unwrap()
}

async fn stored(run: &BinaryRun) -> Vec<outbox::Stored> {
    let client = jetstream::connect(&inventory_tests::nats::shared_url().await, "relay test")
        .await
        .unwrap();
    outbox::stored(&jetstream::context(client), &run.names.events_stream).await
}

/// `serve --strategy natural` publishes the event of each decision to the events stream (3
/// reserved, then 2 rejected: 3 copies on hand), reports its relay in /metrics and /healthz,
/// and leaves the outbox empty and its partitions free when it stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_natural_publishes_each_decision_and_reports_its_relay() {
    let run = BinaryRun::new("inventory_relay_serve", "info,sqlx=warn").await;
    run.put_stock(BOOK, "Dune", 3);
    run.run(&[
        "publish",
        "placed",
        "--book-id",
        BOOK,
        "--quantity",
        "1",
        "--count",
        "5",
    ]);
    let port = free_port();
    let service = run.spawn(&[
        "serve",
        "--strategy",
        "natural",
        "--metrics-addr",
        &format!("127.0.0.1:{port}"),
    ]);
    let (status, health) = wait_for_health(port);
    eventually("five events on the stream", || async {
        stored(&run).await.len() == 5
    })
    .await;
    let events = stored(&run).await;
    let prefix = &run.names.events_subject_prefix;
    let subjects: Vec<&str> = events.iter().map(|e| e.subject.as_str()).collect();
    let reserved = format!("{prefix}.stock.reserved");
    let rejected = format!("{prefix}.stock.rejected");
    assert_eq!(
        subjects.iter().filter(|s| **s == reserved).count(),
        3,
        "{subjects:?}"
    );
    assert_eq!(
        subjects.iter().filter(|s| **s == rejected).count(),
        2,
        "{subjects:?}"
    );
    for event in &events {
        let body: serde_json::Value = serde_json::from_slice(&event.body).unwrap();
        assert_eq!(body["event_id"], event.message_id.as_str());
        assert_eq!(body["book_id"], BOOK);
    }
    assert_eq!(status, 200, "{health}");
    assert_eq!(health["relay"], "publishing");
    let (_, scrape) = http_get(port, "/metrics").unwrap();
    assert_eq!(
        sample(
            &scrape,
            "inventory_outbox_published_total{outbox=\"outbox\"}"
        ),
        5.0,
        "{scrape}"
    );
    // The gauge is set once the lease round that took them has ended; a pass may publish
    // under the partitions it took before that.
    let partitions = "inventory_outbox_relay_partitions{outbox=\"outbox\"}";
    eventually("the relay's 16 partitions in its gauge", || async {
        http_get(port, "/metrics").is_some_and(|(_, scrape)| sample(&scrape, partitions) == 16.0)
    })
    .await;

    let (status, logs) = stop(service);
    assert!(status.success(), "{logs}");
    assert!(logs.contains("outbox relay stopped"), "{logs}");
    assert_eq!(scalar(&run, "SELECT count(*) FROM outbox").await, 0);
    assert_eq!(
        scalar(
            &run,
            "SELECT count(*) FROM outbox_leases WHERE holder IS NOT NULL"
        )
        .await,
        0,
        "partitions given back"
    );
}

/// `inventory relay` publishes rows other processes committed (here the test's), parks a
/// row too large for NATS, which `outbox parked` lists and `outbox retry` puts back (parked
/// again: it is still too large), and exits 0 on SIGTERM with its partitions given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inventory_relay_publishes_until_sigterm_and_parked_rows_are_listed_and_retried() {
    let run = BinaryRun::new("inventory_relay_cmd", "info,sqlx=warn").await;
    let handler = run
        .db
        .consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm));
    let book = BookId::parse(BOOK).unwrap();
    run.put_stock(BOOK, "Dune", 100);
    for _ in 0..10 {
        handler
            .handle(&placed_for(OrderId::new_v7(), book, 1))
            .await
            .unwrap();
    }
    let expected = outbox::rows(&run.db.conn, "outbox").await;
    let port = free_port();
    let relay = run.spawn(&[
        "relay",
        "--metrics-addr",
        &format!("127.0.0.1:{port}"),
        "--relay-poll-interval",
        "50ms",
    ]);
    wait_for_health(port);
    eventually("the outbox empty", || async {
        outbox::rows(&run.db.conn, "outbox").await.is_empty()
    })
    .await;
    assert_published_once_in_order(
        &expected,
        &stored(&run).await,
        &run.names.events_subject_prefix,
    );

    let big = format!("{{\"pad\":\"{}\"}}", "x".repeat(2 * 1024 * 1024));
    let poison = outbox::insert(
        &run.db.conn,
        "outbox",
        Uuid::now_v7(),
        "stock.reserved",
        big,
    )
    .await;
    let parked = || async {
        let output = run.run(&["outbox", "parked", "--json"]);
        serde_json::from_slice::<serde_json::Value>(&output.stdout).unwrap()
    };
    eventually("the row parked", || async {
        parked().await.as_array().unwrap().len() == 1
    })
    .await;
    let listed = parked().await;
    assert_eq!(listed[0]["seq"], poison.seq);
    assert!(
        listed[0]["parked_reason"]
            .as_str()
            .unwrap()
            .contains("too large"),
        "{listed}"
    );
    let table = String::from_utf8(run.run(&["outbox", "parked"]).stdout).unwrap();
    assert!(table.contains(&poison.event_id.to_string()), "{table}");
    eventually("the parked row counted", || async {
        let (_, scrape) = http_get(port, "/metrics").unwrap();
        sample(&scrape, "inventory_outbox_parked_rows{outbox=\"outbox\"}") == 1.0
    })
    .await;
    // A parked row is the operator's to look at, not a failing relay.
    assert_eq!(http_get(port, "/healthz").unwrap().0, 200);

    let seq = poison.seq.to_string();
    let retried = run.run(&["outbox", "retry", "--seq", &seq]);
    assert!(
        String::from_utf8_lossy(&retried.stdout)
            .contains(&format!("outbox row {seq} back in line")),
        "{retried:?}"
    );
    eventually("parked again", || async {
        let listed = parked().await;
        listed.as_array().unwrap().len() == 1 && listed[0]["seq"] == poison.seq
    })
    .await;
    let missing = run
        .command(&["outbox", "retry", "--seq", "999999999"])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(1), "{missing:?}");
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no parked outbox row"));

    let (status, logs) = stop(relay);
    assert!(status.success(), "{logs}");
    assert!(logs.contains("relay stopped; bye"), "{logs}");
    assert_eq!(
        scalar(
            &run,
            "SELECT count(*) FROM outbox_leases WHERE holder IS NOT NULL"
        )
        .await,
        0
    );
}

/// The safe producer end to end: `inventory orders place` and `orders cancel` write the
/// order and its message into `orders_outbox`; `inventory relay --source orders` publishes
/// them to the orders stream, in order, with `Nats-Msg-Id` = the message id the commands
/// printed, and removes the rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_orders_relay_publishes_what_orders_place_and_cancel_wrote() {
    let run = BinaryRun::new("inventory_relay_orders", "info,sqlx=warn").await;
    let order = OrderId::new_v7().to_string();
    let message_id = |output: std::process::Output| {
        let stdout = String::from_utf8(output.stdout).unwrap();
        stdout
            .split("message ")
            .nth(1)
            .unwrap_or_else(|| panic!("{stdout}"))
            .trim()
            .to_owned()
    };
    let placed = message_id(run.run(&[
        "orders",
        "place",
        "--book-id",
        BOOK,
        "--quantity",
        "2",
        "--order-id",
        &order,
    ]));
    let cancelled = message_id(run.run(&["orders", "cancel", "--order-id", &order]));
    assert_eq!(scalar(&run, "SELECT count(*) FROM orders_outbox").await, 2);

    let relay = run.spawn(&[
        "relay",
        "--source",
        "orders",
        "--relay-poll-interval",
        "50ms",
    ]);
    eventually("orders_outbox empty", || async {
        scalar(&run, "SELECT count(*) FROM orders_outbox").await == 0
    })
    .await;
    let client = jetstream::connect(&inventory_tests::nats::shared_url().await, "relay test")
        .await
        .unwrap();
    let stored = outbox::stored(&jetstream::context(client), &run.names.stream).await;
    let seen: Vec<(&str, &str)> = stored
        .iter()
        .map(|m| (m.subject.as_str(), m.message_id.as_str()))
        .collect();
    let prefix = &run.names.subject_prefix;
    assert_eq!(
        seen,
        [
            (format!("{prefix}.placed.{BOOK}").as_str(), placed.as_str()),
            (
                format!("{prefix}.cancelled.{BOOK}").as_str(),
                cancelled.as_str()
            ),
        ]
    );
    let (status, logs) = stop(relay);
    assert!(status.success(), "{logs}");
}

/// Two `inventory relay --source orders` share the orders outbox; one reaches NATS through a
/// proxy that then swallows every byte, its connections kept open. It fails to publish, and
/// once that has lasted longer than its lease it gives its partitions back: the other relay
/// takes them, and every order placed after the silence reaches the stream within the lease
/// plus a margin. A relay that went on renewing its leases held half of the partitions back
/// for as long as the silence lasted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_cut_off_from_nats_gives_its_partitions_to_one_that_can_publish() {
    let nats = inventory_tests::nats::shared_url().await;
    let broker = inventory_tests::fault_proxy::FaultProxy::in_front_of(&nats).await;
    let run = BinaryRun::new("inventory_relay_cut_off", "info,sqlx=warn").await;
    let relay = |nats_url: &str| {
        let port = free_port();
        let mut command = run.command(&[
            "relay",
            "--source",
            "orders",
            "--relay-lease",
            "4s",
            "--relay-poll-interval",
            "100ms",
            "--metrics-addr",
            &format!("127.0.0.1:{port}"),
        ]);
        let child = command
            .env("NATS_URL", nats_url)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        (child, port)
    };
    let (cut_off, cut_off_port) = relay(&broker.url_for(&nats));
    let (direct, direct_port) = relay(&nats);
    for port in [cut_off_port, direct_port] {
        wait_for_health(port);
    }
    let client = jetstream::connect(&nats, "relay test").await.unwrap();
    let js = jetstream::context(client);
    let place = |count: usize| {
        for _ in 0..count {
            run.run(&["orders", "place", "--book-id", BOOK, "--quantity", "1"]);
        }
    };
    let stored = || async { outbox::stored(&js, &run.names.stream).await.len() };
    // Both relays publish, each its half of the partitions.
    place(16);
    eventually("16 orders on the stream", || async { stored().await == 16 }).await;

    broker.blackhole();
    let silenced = Instant::now();
    place(48);
    let deadline = silenced + Duration::from_secs(20);
    while stored().await < 64 {
        assert!(
            Instant::now() < deadline,
            "{} of 64 orders on the stream 20 s after the silence; {} rows wait",
            stored().await,
            scalar(&run, "SELECT count(*) FROM orders_outbox").await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let took = silenced.elapsed();
    eprintln!("64 of 64 orders on the stream {took:?} after the silence");
    assert_eq!(scalar(&run, "SELECT count(*) FROM orders_outbox").await, 0);
    // Each published once.
    let ids: std::collections::BTreeSet<String> = outbox::stored(&js, &run.names.stream)
        .await
        .into_iter()
        .map(|message| message.message_id)
        .collect();
    assert_eq!(ids.len(), 64, "took {took:?}");
    let (_, direct_metrics) = http_get(direct_port, "/metrics").unwrap();
    assert_eq!(
        sample(
            &direct_metrics,
            "inventory_outbox_relay_partitions{outbox=\"orders_outbox\"}"
        ),
        16.0
    );
    let _ = stop(cut_off);
    let (status, logs) = stop(direct);
    assert!(status.success(), "{logs}");
}
