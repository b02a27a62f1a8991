//! Operating `inventory serve` as a process: the horizon guard, the background purge, metrics
//! and health while messages flow, the dead-letter commands, and secrets kept out of every log.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use inventory_domain::BookId;
use inventory_infra::jetstream::{self, Topology};
use inventory_tests::binary::{BinaryRun, ended, free_port, http_get, sample, stop};
use inventory_tests::nats;
use sea_orm::ConnectionTrait;

const BOOK: &str = "0190f5c4-3c2e-7b4a-9d3e-bbbbbbbbbbbb";
const UNKNOWN_BOOK: &str = "0190f5c4-3c2e-7b4a-9d3e-cccccccccccc";

/// The shared process fixture, plus what these tests ask of the service.
struct Setup(BinaryRun);

impl std::ops::Deref for Setup {
    type Target = BinaryRun;

    fn deref(&self) -> &BinaryRun {
        &self.0
    }
}

impl std::ops::DerefMut for Setup {
    fn deref_mut(&mut self) -> &mut BinaryRun {
        &mut self.0
    }
}

impl Setup {
    async fn new() -> Self {
        Self(BinaryRun::new("inventory_ops", "info,sqlx=warn").await)
    }

    fn serve(&self, args: &[&str]) -> Child {
        let mut all = vec!["serve"];
        all.extend_from_slice(args);
        self.spawn(&all)
    }
}

/// Waits until a `serve` fetches from the durable consumer `name`: past its start-up checks
/// (the refused run before it created the consumer already).
async fn wait_until_fetching(setup: &Setup, name: &str) {
    wait_for_pulls(setup, name, true).await;
}

/// Waits until the durable consumer `name` has pull requests waiting (`fetching`), or none.
async fn wait_for_pulls(setup: &Setup, name: &str, fetching: bool) {
    let client = inventory_infra::jetstream::connect(
        &inventory_tests::nats::shared_url().await,
        "operating test",
    )
    .await
    .unwrap();
    let js = inventory_infra::jetstream::context(client);
    let what = if fetching { "a pull" } else { "no pull" };
    inventory_tests::broker::eventually(&format!("{what} on consumer {name}"), || async {
        let Ok(stream) = js.get_stream(&setup.names.stream).await else {
            return false;
        };
        let Ok(mut consumer) = stream
            .get_consumer::<async_nats::jetstream::consumer::pull::Config>(name)
            .await
        else {
            return false;
        };
        consumer
            .info()
            .await
            .is_ok_and(|info| (info.num_waiting > 0) == fetching)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retention_shorter_than_the_redelivery_horizon_is_refused() {
    let setup = Setup::new().await;
    let output = setup
        .command(&[
            "serve",
            "--strategy",
            "inbox",
            "--ack-wait",
            "30s",
            "--max-deliver",
            "10",
            "--duplicate-window",
            "2m",
            "--replay-allowance",
            "1day",
            "--lag-allowance",
            "1h",
            "--inbox-retention",
            "1day",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    // 10 deliveries × 30 s + the 2 min window + an hour's lag (the stream has no max_age) + the
    // 1 day allowance: both durations named, and each part.
    assert!(
        stderr.contains("--inbox-retention 1day is shorter than the redelivery horizon 1day 1h 7m"),
        "{stderr}"
    );
    assert!(
        stderr.contains(
            "redeliveries 5m, duplicate window 2m, lag allowance 1h, replay allowance 1day"
        ),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unlimited_deliveries_refuse_any_retention_unless_accepted() {
    let setup = Setup::new().await;
    let args = [
        "serve",
        "--strategy",
        "inbox",
        "--consumer",
        "unlimited",
        "--max-deliver=-1",
        "--inbox-retention",
        "3650days",
    ];
    let refused = setup.command(&args).output().unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("which is unbounded"), "{stderr}");

    let mut accepted = args.to_vec();
    accepted.push("--accept-short-retention");
    let service = setup.serve(&accepted[1..]);
    wait_until_fetching(&setup, "unlimited").await;
    let (status, logs) = stop(service);
    assert!(status.success(), "{logs}");
    assert!(
        logs.contains("going on as --accept-short-retention says"),
        "{logs}"
    );

    // The natural key keeps no inbox rows: no horizon to guard, no purge.
    let natural = setup.serve(&[
        "--strategy",
        "natural",
        "--consumer",
        "natural-unlimited",
        "--max-deliver=-1",
    ]);
    wait_until_fetching(&setup, "natural-unlimited").await;
    let (status, logs) = stop(natural);
    assert!(status.success(), "{logs}");
    assert!(!logs.contains("horizon"), "{logs}");
}

/// Creates the durable consumer `name` with these redelivery settings, through `serve` with
/// the purge off (so no horizon check), and stops it once it fetches.
async fn create_consumer(setup: &Setup, name: &str, ack_wait: &str, max_deliver: &str) {
    let service = setup.serve(&[
        "--strategy",
        "inbox",
        "--consumer",
        name,
        "--ack-wait",
        ack_wait,
        "--max-deliver",
        max_deliver,
        "--purge-interval",
        "0s",
    ]);
    wait_until_fetching(setup, name).await;
    let (status, logs) = stop(service);
    assert!(status.success(), "{logs}");
    // Its pulls gone, so a later wait for a pull sees the next instance's.
    wait_for_pulls(setup, name, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_horizon_is_the_existing_consumers_not_the_flags() {
    let setup = Setup::new().await;
    // Horizons without the replay allowance: `short` about a minute plus the duplicate window,
    // `long` over 10 hours. A retention of 2 hours lies between them.
    create_consumer(&setup, "short", "1s", "2").await;
    create_consumer(&setup, "long", "1h", "10").await;
    let serve = |name: &'static str, ack_wait: &'static str, max_deliver: &'static str| {
        vec![
            "--strategy",
            "inbox",
            "--consumer",
            name,
            "--ack-wait",
            ack_wait,
            "--max-deliver",
            max_deliver,
            "--replay-allowance",
            "0s",
            "--lag-allowance",
            "0s",
            "--inbox-retention",
            "2h",
        ]
    };

    // Flags asking for the long horizon, on the short consumer: accepted.
    let accepted = setup.serve(&serve("short", "1h", "10"));
    wait_until_fetching(&setup, "short").await;
    let (status, logs) = stop(accepted);
    assert!(status.success(), "{logs}");
    assert!(
        logs.contains("inbox retention covers the redelivery horizon"),
        "{logs}"
    );

    // Flags asking for the short horizon, on the long consumer: refused.
    let mut refused = vec!["serve"];
    refused.extend(serve("long", "1s", "2"));
    let output = setup.command(&refused).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--inbox-retention 2h is shorter than the redelivery horizon"),
        "{stderr}"
    );
    assert!(stderr.contains("of consumer long"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_metrics_health_and_dead_letters_while_messages_flow() {
    let setup = Setup::new().await;
    setup.put_stock(BOOK, "Dune", 1000);
    // 300 completed rows from two days ago, and one older row still "processing", all this
    // consumer's: the purge takes only its own consumer's rows.
    setup
        .db
        .conn
        .execute_unprepared(
            "INSERT INTO inbox (message_id, consumer, received_at, completed_at, payload_hash) \
             SELECT 'old-' || g, 'inventory-reserve-stock-inbox', now() - interval '2 days', \
                    now() - interval '2 days', repeat('0', 64) FROM generate_series(1, 300) g; \
             INSERT INTO inbox VALUES ('stuck', 'inventory-reserve-stock-inbox', \
                    now() - interval '3 days', NULL, repeat('0', 64))",
        )
        .await
        .unwrap();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let service = setup.serve(&[
        "--strategy",
        "inbox",
        "--metrics-addr",
        &addr,
        "--inbox-retention",
        "1day",
        "--replay-allowance",
        "1h",
        "--lag-allowance",
        "1h",
        "--purge-interval",
        "1s",
        "--purge-batch-size",
        "100",
    ]);
    // The listener is up before the set-up, saying `starting` until it is done; `/livez`
    // answers 200 all along.
    let deadline = Instant::now() + Duration::from_secs(30);
    while http_get(port, "/healthz").is_none_or(|(_, body)| body.contains("starting")) {
        assert!(Instant::now() < deadline, "never done starting");
        if let Some((status, body)) = http_get(port, "/livez") {
            assert_eq!(status, 200, "/livez during the set-up: {body}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, health) = http_get(port, "/healthz").unwrap();
    assert_eq!(status, 200, "{health}");
    let health: serde_json::Value = serde_json::from_str(&health).unwrap();
    assert_eq!(health["nats"], "connected");
    assert_eq!(health["database"], "reachable");

    // Messages flow from a publisher process while the test scrapes.
    let publisher = setup
        .command(&[
            "publish",
            "placed",
            "--book-id",
            BOOK,
            "--quantity",
            "1",
            "--count",
            "200",
        ])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    setup.run(&[
        "publish",
        "placed",
        "--book-id",
        UNKNOWN_BOOK,
        "--quantity",
        "1",
        "--message-id",
        "for-a-book-not-yet-stocked",
    ]);
    let consumer = "consumer=\"inventory-reserve-stock-inbox\"";
    let processed = format!("inventory_messages_total{{{consumer},outcome=\"processed\"}}");
    let mut scrapes_while_flowing = 0;
    let scrape = loop {
        let (status, scrape) = http_get(port, "/metrics").unwrap();
        assert_eq!(status, 200);
        let done = sample(&scrape, &processed);
        if done > 0.0 && done < 200.0 {
            scrapes_while_flowing += 1;
            assert_eq!(http_get(port, "/healthz").unwrap().0, 200);
        }
        if done >= 200.0 && sample(&scrape, "inventory_inbox_rows_purged_total") >= 300.0 {
            break scrape;
        }
        assert!(
            Instant::now() < deadline + Duration::from_secs(60),
            "{scrape}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let publisher = publisher.wait_with_output().unwrap();
    assert!(publisher.status.success());
    assert!(scrapes_while_flowing > 0, "no scrape saw messages in flow");
    assert_eq!(sample(&scrape, &processed), 200.0, "{scrape}");
    assert_eq!(
        sample(
            &scrape,
            &format!("inventory_dead_letters_total{{{consumer},reason=\"unknown-book\"}}")
        ),
        1.0,
        "{scrape}"
    );
    assert_eq!(
        sample(
            &scrape,
            &format!("inventory_messages_total{{{consumer},outcome=\"dead_lettered\"}}")
        ),
        1.0
    );
    assert_eq!(
        sample(
            &scrape,
            &format!("inventory_message_handling_seconds_count{{{consumer}}}")
        ),
        201.0
    );
    assert!(scrape.contains(&format!("inventory_messages_in_flight{{{consumer}}}")));
    assert_eq!(
        sample(
            &scrape,
            &format!("inventory_inbox_processing_older_than_retention{{{consumer}}}")
        ),
        1.0
    );
    // The old completed rows are gone; the new ones and the processing row are kept.
    assert_eq!(
        setup
            .scalar("SELECT count(*) FROM inbox WHERE message_id LIKE 'old-%'")
            .await,
        0
    );
    assert_eq!(
        setup
            .scalar("SELECT count(*) FROM inbox WHERE message_id = 'stuck'")
            .await,
        1
    );

    // The dead letter, listed by the CLI, then replayed once the book is stocked.
    let listed = setup.run(&["dlq", "list", "--json", "--reason", "unknown-book"]);
    let letters: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(letters.as_array().unwrap().len(), 1, "{letters}");
    assert_eq!(
        letters[0]["original_message_id"],
        "for-a-book-not-yet-stocked"
    );
    let none = setup.run(&["dlq", "list", "--json", "--reason", "malformed"]);
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&none.stdout).unwrap(),
        serde_json::json!([])
    );
    let table = setup.run(&["dlq", "list"]);
    assert!(String::from_utf8_lossy(&table.stdout).contains("unknown-book"));
    setup.put_stock(UNKNOWN_BOOK, "Arrakis", 5);
    let seq = letters[0]["seq"].to_string();
    let replayed = setup.run(&["dlq", "replay", "--seq", &seq]);
    assert!(String::from_utf8_lossy(&replayed.stdout).contains("replayed dead letter"));
    let deadline = Instant::now() + Duration::from_secs(20);
    while setup
        .db
        .reserved(BookId::parse(UNKNOWN_BOOK).unwrap())
        .await
        != 1
    {
        assert!(
            Instant::now() < deadline,
            "the replayed order was never reserved"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let empty = setup.run(&["dlq", "list", "--json"]);
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&empty.stdout).unwrap(),
        serde_json::json!([])
    );

    let (status, logs) = stop(service);
    assert!(status.success(), "{logs}");
    assert!(
        logs.contains("inbox rows still processing past the retention"),
        "{logs}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_never_reach_the_logs_or_help() {
    let mut setup = Setup::new().await;
    let nonce = &uuid::Uuid::new_v4().simple().to_string()[..10];
    let db_password = format!("DbPw-{nonce}");
    let nats_password = format!("NatsPw-{nonce}");
    let nats_token = format!("NatsTok-{nonce}");
    // A role of the test's own with a password and rights on the test's database, so the
    // password is real whatever the server's authentication (trust here, scram on a fresh
    // Debian).
    let role = format!("inventory_secret_{nonce}");
    setup
        .db
        .conn
        .execute_unprepared(&format!(
            "CREATE ROLE {role} LOGIN PASSWORD '{db_password}'; \
             GRANT ALL ON SCHEMA public TO {role}; \
             GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}; \
             GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}"
        ))
        .await
        .unwrap();
    let server = setup.db.url.split('@').nth(1).unwrap().to_owned();
    setup.database_url = format!("postgres://{role}:{db_password}@{server}");
    let secrets = [
        db_password.as_str(),
        nats_password.as_str(),
        nats_token.as_str(),
    ];
    let with_secrets = |command: &mut Command| {
        command
            .env("INVENTORY_NATS_USER", "inventory")
            .env("INVENTORY_NATS_PASSWORD", &nats_password)
            .env("INVENTORY_NATS_TOKEN", &nats_token)
            .env("RUST_LOG", "debug");
    };

    // The NATS flags are listed once, in the program's help; serve's points there.
    let mut seen = String::new();
    for command in [&["--help"][..], &["serve", "--help"]] {
        let mut help = setup.command(command);
        with_secrets(&mut help);
        seen.push_str(&String::from_utf8_lossy(&help.output().unwrap().stdout));
    }
    assert!(seen.contains("--nats-password"), "{seen}");

    let mut serve = setup.command(&["serve", "--strategy", "natural"]);
    with_secrets(&mut serve);
    let service = serve
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    setup.put_stock(BOOK, "Dune", 10);
    setup.run(&["publish", "placed", "--book-id", BOOK, "--quantity", "2"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while setup.db.reserved(BookId::parse(BOOK).unwrap()).await != 2 {
        assert!(Instant::now() < deadline, "the order was never reserved");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, logs) = stop(service);
    assert!(status.success(), "{logs}");
    assert!(logs.contains("DEBUG"), "not a debug log: {logs}");
    seen.push_str(&logs);

    // Failures print the URLs they could not reach: with the credentials masked.
    let mut unreachable =
        setup.command(&["publish", "placed", "--book-id", BOOK, "--quantity", "1"]);
    with_secrets(&mut unreachable);
    let unreachable = unreachable
        .env(
            "NATS_URL",
            format!("nats://inventory:{nats_password}@127.0.0.1:1"),
        )
        .output()
        .unwrap();
    assert!(!unreachable.status.success());
    seen.push_str(&String::from_utf8_lossy(&unreachable.stderr));
    let mut bad_db = setup.command(&["stock", "list"]);
    with_secrets(&mut bad_db);
    let bad_db = bad_db
        .env(
            "DATABASE_URL",
            format!("postgres://{role}:{db_password}@127.0.0.1:1/x"),
        )
        .output()
        .unwrap();
    assert!(!bad_db.status.success());
    seen.push_str(&String::from_utf8_lossy(&bad_db.stderr));
    // The driver takes the password as a parameter too; `serve` names the URL it could not open.
    let mut bad_db = setup.command(&["serve", "--strategy", "natural"]);
    with_secrets(&mut bad_db);
    let bad_db = bad_db
        .env(
            "DATABASE_URL",
            format!("postgres://{role}@127.0.0.1:1/x?password={db_password}"),
        )
        .output()
        .unwrap();
    assert!(!bad_db.status.success());
    let stderr = String::from_utf8_lossy(&bad_db.stderr);
    assert!(stderr.contains("password=***"), "{stderr}");
    seen.push_str(&stderr);

    for secret in secrets {
        assert!(!seen.contains(secret), "{secret} appeared in:\n{seen}");
    }
    // The role's grants live in the test's database: drop that first.
    drop(setup);
    let admin = inventory_benches::db::connect(&inventory_tests::postgres::server_url().await, 1)
        .await
        .unwrap();
    admin
        .execute_unprepared(&format!("DROP ROLE IF EXISTS {role}"))
        .await
        .unwrap();
}

/// The stream's own `max_age` counts in the horizon: a copy can wait that long in the stream
/// for its first delivery. The stream is made before `serve` looks, with 20 days.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_streams_max_age_counts_in_the_horizon() {
    let setup = Setup::new().await;
    let mut config = Topology {
        stream: setup.names.stream.clone(),
        subject_prefix: setup.names.subject_prefix.clone(),
        ..Topology::default()
    }
    .stream_config();
    config.max_age = Duration::from_secs(20 * 24 * 3600);
    let client = jetstream::connect(&nats::shared_url().await, "max_age test")
        .await
        .unwrap();
    jetstream::context(client)
        .create_stream(config)
        .await
        .unwrap();
    let (status, stderr) = ended(setup.serve(&["--strategy", "inbox", "--consumer", "aged"]));
    assert_eq!(status.code(), Some(1), "{stderr}");
    // The default 14-day retention under 20 days of max_age, 7 of replay allowance and more.
    assert!(
        stderr.contains("--inbox-retention 14days is shorter"),
        "{stderr}"
    );
    assert!(stderr.contains("max_age 20days"), "{stderr}");
}

/// `inventory inbox purge` checks each consumer's horizon as `serve` does, and purges each
/// consumer's rows on their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_purge_refuses_a_cutoff_inside_a_consumers_horizon_unless_forced() {
    let setup = Setup::new().await;
    create_consumer(&setup, "short", "1s", "2").await;
    create_consumer(&setup, "long", "1h", "10").await;
    // Completed two days ago, for each consumer.
    for consumer in ["short", "long"] {
        setup
            .db
            .conn
            .execute_unprepared(&format!(
                "INSERT INTO inbox (message_id, consumer, received_at, completed_at, payload_hash) \
                 SELECT 'old-' || g, '{consumer}', now() - interval '3 days', \
                        now() - interval '2 days', repeat('0', 64) \
                 FROM generate_series(1, 5) AS g"
            ))
            .await
            .unwrap();
    }
    let purge = |extra: &[&str]| {
        let mut args = vec![
            "inbox",
            "purge",
            "--older-than",
            "1day",
            "--replay-allowance",
            "0s",
            "--lag-allowance",
            "0s",
        ];
        args.extend_from_slice(extra);
        setup.command(&args).output().unwrap()
    };
    let rows = |consumer: &'static str| {
        let setup = &setup;
        async move {
            setup
                .scalar(&format!(
                    "SELECT count(*) FROM inbox WHERE consumer = '{consumer}'"
                ))
                .await
        }
    };

    // Every consumer by default: `long`'s horizon (10 hours and more) is within a day, but
    // refused whole: nothing is deleted, not even `short`'s.
    let everyone = purge(&["--max-retry-delay", "3h"]);
    let stderr = String::from_utf8_lossy(&everyone.stderr);
    assert_eq!(everyone.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--older-than 1day is shorter than the redelivery horizon"),
        "{stderr}"
    );
    assert!(stderr.contains("of consumer long"), "{stderr}");
    assert!(stderr.contains("or pass --force"), "{stderr}");
    assert_eq!((rows("short").await, rows("long").await), (5, 5));

    // One consumer whose horizon the cutoff covers: its rows only.
    let short = purge(&["--consumer", "short"]);
    assert!(short.status.success(), "{short:?}");
    assert_eq!((rows("short").await, rows("long").await), (0, 5));

    // A consumer the server does not know: its horizon is unknown, so refused.
    setup
        .db
        .conn
        .execute_unprepared(
            "INSERT INTO inbox (message_id, consumer, received_at, completed_at, payload_hash) \
             VALUES ('gone-1', 'gone', now() - interval '3 days', now() - interval '2 days', \
                     repeat('0', 64))",
        )
        .await
        .unwrap();
    let unknown = purge(&["--consumer", "gone"]);
    let stderr = String::from_utf8_lossy(&unknown.stderr);
    assert_eq!(unknown.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("consumer gone is on neither"), "{stderr}");

    // --force purges what it is told, looking nothing up.
    let forced = purge(&["--force", "--max-retry-delay", "3h"]);
    assert!(forced.status.success(), "{forced:?}");
    assert_eq!((rows("long").await, rows("gone").await), (0, 0));
}
