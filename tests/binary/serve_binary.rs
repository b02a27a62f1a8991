//! `inventory serve` and `inventory publish` as processes: signals, drain, abandon, logs.

use inventory_benches::readback::Readback as _;
use std::process::{Child, Command};
use std::time::Duration;

use inventory_benches::consumers::EMAIL_CONSUMER;
use inventory_domain::BookId;
use inventory_infra::jetstream;
use inventory_tests::binary::{self, BinaryRun};
use inventory_tests::broker::eventually;
use inventory_tests::fault_proxy::FaultProxy;
use sea_orm::{ConnectionTrait, DatabaseTransaction, TransactionTrait};

const BOOK: &str = "0190f5c4-3c2e-7b4a-9d3e-aaaaaaaaaaaa";

/// The shared process fixture, plus what these tests ask of the service.
struct Setup(BinaryRun);

impl std::ops::Deref for Setup {
    type Target = BinaryRun;

    fn deref(&self) -> &BinaryRun {
        &self.0
    }
}

impl Setup {
    async fn new() -> Self {
        Self(
            BinaryRun::new(
                "inventory_cli",
                // Duplicates are logged at debug; the first test looks for them.
                "info,sqlx=warn,inventory_service=debug",
            )
            .await,
        )
    }

    fn serve(&self) -> Child {
        self.serve_with(&["--strategy", "natural"])
    }

    fn serve_with(&self, extra: &[&str]) -> Child {
        let mut args = vec!["serve", "--ack-wait", "2s", "--shutdown-timeout", "60s"];
        args.extend_from_slice(extra);
        self.spawn(&args)
    }

    async fn reserved(&self) -> i64 {
        self.db.reserved(BookId::parse(BOOK).unwrap()).await
    }

    /// Holds the stock row from another session, so a handler blocks mid-transaction on it.
    async fn hold_stock_row(&self) -> DatabaseTransaction {
        let blocker = self.db.conn.begin().await.unwrap();
        blocker
            .execute_unprepared(&format!(
                "SELECT * FROM stock_items WHERE book_id = '{BOOK}' FOR UPDATE"
            ))
            .await
            .unwrap();
        blocker
    }

    /// Waits until a session of the service waits on a row lock; the process's start-up
    /// included, so longer than the helpers' wait for a lock waiter.
    async fn wait_until_blocked(&self) {
        for _ in 0..200 {
            if self.db.stock.sessions_waiting_for_a_lock().await.unwrap() > Some(0) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the handler never blocked on the row lock");
    }

    async fn wait_for_reserved(&self, copies: i64) {
        for _ in 0..400 {
            if self.reserved().await == copies {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("never reserved {copies}; have {}", self.reserved().await);
    }
}

fn signal(child: &Child, name: &str) {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

fn exited_within(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let deadline = std::time::Instant::now() + limit;
    while std::time::Instant::now() < deadline {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_processes_published_orders_and_exits_zero_on_sigterm() {
    let setup = Setup::new().await;
    setup.put_stock(BOOK, "Dune", 100);
    let first = setup.run(&[
        "publish",
        "placed",
        "--book-id",
        BOOK,
        "--quantity",
        "2",
        "--message-id",
        "m-1",
    ]);
    assert!(String::from_utf8_lossy(&first.stdout).contains("stored as sequence 1"));
    let again = setup.run(&[
        "publish",
        "placed",
        "--book-id",
        BOOK,
        "--quantity",
        "2",
        "--message-id",
        "m-1",
    ]);
    assert!(String::from_utf8_lossy(&again.stdout).contains("duplicate"));
    let bulk = setup.run(&[
        "publish",
        "placed",
        "--book-id",
        BOOK,
        "--quantity",
        "1",
        "--count",
        "10",
        "--resend-with-new-id",
    ]);
    assert!(String::from_utf8_lossy(&bulk.stdout).contains("published 10 messages: 10 stored"));

    let mut service = setup.serve();
    setup.wait_for_reserved(12).await;
    signal(&service, "TERM");
    let status = exited_within(&mut service, Duration::from_secs(20)).expect("serve exits");
    let output = service.wait_with_output().unwrap();
    let logs = String::from_utf8_lossy(&output.stderr);
    assert!(status.success(), "{logs}");
    // Each message's log line carries its id, stream sequence, delivery count and outcome.
    assert!(logs.contains("message_id=m-1"), "{logs}");
    assert!(logs.contains("stream_seq=1"), "{logs}");
    assert!(logs.contains("delivered=1"), "{logs}");
    assert!(logs.contains("outcome=\"duplicate\""), "{logs}");
    assert!(logs.contains("drained"), "{logs}");
}

/// JetStream not answering while serve sets up (a cluster does that for the seconds it takes
/// to elect a stream's new leader): serve asks again and starts, instead of exiting 1 on the
/// first request that timed out. `trigger`: the set-up request whose answer never comes; the
/// connection stays silent after it until the client's pings find it dead and it connects
/// again. `setup` reaches NATS through `broker`, made before it so that it outlives the run's
/// cleanup of its streams through it. Serve's log.
async fn serve_through_a_silence_after(
    setup: &Setup,
    broker: &FaultProxy,
    trigger: &[u8],
) -> String {
    broker.silence_after(trigger, 1);
    setup.put_stock(BOOK, "Dune", 100);
    let service = setup.serve_with(&[
        "--strategy",
        "natural",
        "--nats-request-timeout",
        "1s",
        "--nats-ping-interval",
        "1s",
    ]);
    // The publish after it, so the silence is serve's.
    eventually("serve's request silenced", || async {
        broker.silences_made() == 1
    })
    .await;
    setup.run(&["publish", "placed", "--book-id", BOOK, "--quantity", "2"]);
    setup.wait_for_reserved(2).await;
    let (status, logs) = binary::stop(service);
    assert!(status.success(), "{logs}");
    assert!(logs.contains("asking again"), "{logs}");
    logs
}

/// A run whose NATS is reached through a proxy of its own, and the proxy.
async fn behind_a_proxy() -> (FaultProxy, Setup, String) {
    let nats = inventory_tests::nats::shared_url().await;
    let broker = FaultProxy::in_front_of(&nats).await;
    let mut setup = Setup::new().await;
    setup.0.nats_url = broker.url_for(&nats);
    (broker, setup, nats)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_waits_out_a_consumer_lookup_left_unanswered() {
    let (broker, setup, _) = behind_a_proxy().await;
    serve_through_a_silence_after(&setup, &broker, b"$JS.API.CONSUMER.INFO").await;
}

/// An operator tuned the consumer by hand (`nats consumer edit`). A restart whose first look at
/// it goes unanswered asks again, keeps the server's settings and names each that differs from
/// its flags: it creates the consumer only when the server says there is none, never because a
/// lookup failed (create is create-or-update, and would have reset them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_tuned_by_hand_keeps_its_settings_across_a_restart_whose_lookup_fails() {
    let (broker, setup, nats) = behind_a_proxy().await;
    let js = jetstream::context(jetstream::connect(&nats, "operator").await.unwrap());
    let (stream, _) = jetstream::ensure_streams(&js, &setup.names.topology())
        .await
        .unwrap();
    let tuned = jetstream::ConsumerSettings {
        durable_name: "inventory-reserve-stock".into(),
        filters: vec![setup.names.subjects()],
        ack_wait: Duration::from_secs(7),
        max_deliver: 5,
        backoff: Vec::new(),
        max_ack_pending: 77,
    };
    jetstream::ensure_consumer(&js, &stream, &tuned, false)
        .await
        .unwrap();

    let logs = serve_through_a_silence_after(&setup, &broker, b"$JS.API.CONSUMER.INFO").await;
    for setting in ["ack_wait", "max_deliver", "max_ack_pending"] {
        assert!(
            logs.contains(&format!("has {setting} = ")) && logs.contains("keeping the existing"),
            "{setting}: {logs}"
        );
    }
    let kept = stream
        .consumer_info("inventory-reserve-stock")
        .await
        .unwrap()
        .config;
    assert_eq!(
        (kept.ack_wait, kept.max_deliver, kept.max_ack_pending),
        (Duration::from_secs(7), 5, 77)
    );
}

/// The stream is created; only the answer is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_waits_out_a_stream_create_left_unanswered() {
    let (broker, setup, _) = behind_a_proxy().await;
    serve_through_a_silence_after(&setup, &broker, b"$JS.API.STREAM.CREATE").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_abandons_the_message_in_flight_and_it_is_redelivered() {
    let setup = Setup::new().await;
    setup.put_stock(BOOK, "Dune", 100);
    let blocker = setup.hold_stock_row().await;
    setup.run(&["publish", "placed", "--book-id", BOOK, "--quantity", "2"]);
    // The ORM handler's explicit transaction is what is abandoned here: it never commits. (The
    // one-statement handler's statement, once granted the lock, commits on its own even after
    // the process is gone; its message is then applied whole and the redelivery is a
    // duplicate, as the serve tests show.)
    let mut service = setup.serve_with(&["--strategy", "natural", "--natural-handler", "orm"]);
    setup.wait_until_blocked().await;

    signal(&service, "TERM");
    assert!(
        exited_within(&mut service, Duration::from_millis(700)).is_none(),
        "the first signal waits for the message in flight"
    );
    signal(&service, "TERM");
    let status =
        exited_within(&mut service, Duration::from_secs(10)).expect("exits on the second signal");
    assert!(!status.success());
    blocker.rollback().await.unwrap();
    assert_eq!(setup.reserved().await, 0, "nothing half-applied");

    // A new instance gets the unacked message again and applies it once.
    let mut again = setup.serve();
    setup.wait_for_reserved(2).await;
    signal(&again, "TERM");
    assert!(
        exited_within(&mut again, Duration::from_secs(20))
            .expect("exits")
            .success()
    );
    assert_eq!(setup.reserved().await, 2);
}

/// The chain as processes: orders into `serve --strategy natural`, whose relay publishes each
/// decision to the events stream, and `serve --strategy email` mailing each StockReserved.
/// An order resent under a new message id is reserved once, so mailed once; its cancellation
/// (released) is not the notifier's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_email_strategy_mails_each_reserved_order_once() {
    let setup = Setup::new().await;
    setup.put_stock(BOOK, "Dune", 100);
    let mailbox =
        std::env::temp_dir().join(format!("inventory-mailbox-{}.jsonl", setup.names.suffix));
    let order = "0190f5c4-3c2e-7b4a-9d3e-bbbbbbbbbbbb";
    setup.run(&[
        "publish",
        "placed",
        "--book-id",
        BOOK,
        "--quantity",
        "2",
        "--count",
        "3",
    ]);
    setup.run(&[
        "publish",
        "placed",
        "--book-id",
        BOOK,
        "--quantity",
        "1",
        "--order-id",
        order,
        "--resend-with-new-id",
    ]);
    let mut stock = setup.serve();
    let mut email = setup.serve_with(&[
        "--strategy",
        "email",
        "--mailbox",
        mailbox.to_str().unwrap(),
    ]);
    let js = jetstream::context(
        jetstream::connect(&inventory_tests::nats::shared_url().await, "email test")
            .await
            .unwrap(),
    );
    // Settled: `events` on the events stream, and the notifier holding nothing pending or
    // unacked.
    let settled = |events: u64| {
        let js = js.clone();
        let stream = setup.names.events_stream.clone();
        async move {
            eventually(
                &format!("{events} events, the notifier settled"),
                || async {
                    let Ok(mut stream) = js.get_stream(&stream).await else {
                        return false;
                    };
                    let stored = stream.info().await.unwrap().state.messages;
                    let Ok(mut consumer) = stream
                        .get_consumer::<async_nats::jetstream::consumer::pull::Config>(
                            EMAIL_CONSUMER,
                        )
                        .await
                    else {
                        return false;
                    };
                    let state = jetstream::consumer_state(&mut consumer).await.unwrap();
                    stored == events && state.pending == 0 && state.ack_pending == 0
                },
            )
            .await;
        }
    };
    settled(4).await;
    // The cancellation after the mail went out: released, not mailed again.
    setup.run(&["publish", "cancelled", "--order-id", order]);
    settled(5).await;
    let lines = std::fs::read_to_string(&mailbox)
        .map(|text| text.lines().count())
        .unwrap_or(0);
    assert_eq!(lines, 4);
    for service in [&mut stock, &mut email] {
        signal(service, "TERM");
        let status = exited_within(service, Duration::from_secs(20)).expect("exits");
        assert!(status.success());
    }
    let output = email.wait_with_output().unwrap();
    let logs = String::from_utf8_lossy(&output.stderr);
    assert!(!logs.contains("dead-lettered"), "{logs}");
    // The file keeps one line per key whatever the consumer does; the log has every send call.
    assert_eq!(logs.matches("mailbox: mail written").count(), 4, "{logs}");
    assert_eq!(logs.matches("not written again").count(), 0, "{logs}");
    std::fs::remove_file(&mailbox).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_timeout_running_out_exits_1_with_nothing_acked() {
    let setup = Setup::new().await;
    setup.put_stock(BOOK, "Dune", 100);
    let blocker = setup.hold_stock_row().await;
    setup.run(&["publish", "placed", "--book-id", BOOK, "--quantity", "2"]);
    // The ORM handler, as above: its transaction is abandoned uncommitted.
    let mut service = setup.spawn(&[
        "serve",
        "--ack-wait",
        "2s",
        "--shutdown-timeout",
        "1s",
        "--strategy",
        "natural",
        "--natural-handler",
        "orm",
    ]);
    setup.wait_until_blocked().await;

    // One signal only: the drain waits the timeout for the blocked message, then gives up.
    signal(&service, "TERM");
    let status = exited_within(&mut service, Duration::from_secs(20)).expect("exits");
    let output = service.wait_with_output().unwrap();
    let logs = String::from_utf8_lossy(&output.stderr);
    assert_eq!(status.code(), Some(1), "{logs}");
    assert!(
        logs.contains("stopped before in-flight messages finished"),
        "{logs}"
    );
    blocker.rollback().await.unwrap();
    assert_eq!(setup.reserved().await, 0, "nothing half-applied");

    // Not acked: the next instance is delivered it again and applies it once.
    let mut again = setup.serve();
    setup.wait_for_reserved(2).await;
    signal(&again, "TERM");
    let status = exited_within(&mut again, Duration::from_secs(20)).expect("exits");
    let output = again.wait_with_output().unwrap();
    let logs = String::from_utf8_lossy(&output.stderr);
    assert!(status.success(), "{logs}");
    assert!(logs.contains("delivered=2"), "{logs}");
    assert_eq!(setup.reserved().await, 2);
}

/// The stop is bounded as a whole. NATS goes silent while a reservation waits on a row lock;
/// once it commits, the relay's publish of its event waits for a PubAck that never comes (up to
/// its 25 s publish timeout), and the NATS connection's drain after it would wait as long as
/// the client's pings take to give the connection up. `--shutdown-timeout` ends the process
/// 1 s after the signal, with exit 1 for what was left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_with_nats_gone_silent_ends_within_the_shutdown_timeout() {
    let nats = inventory_tests::nats::shared_url().await;
    let broker = FaultProxy::in_front_of(&nats).await;
    let mut setup = Setup::new().await;
    setup.0.nats_url = broker.url_for(&nats);
    setup.put_stock(BOOK, "Dune", 100);
    let blocker = setup.hold_stock_row().await;
    setup.run(&["publish", "placed", "--book-id", BOOK, "--quantity", "2"]);
    let mut service = setup.spawn(&[
        "serve",
        "--strategy",
        "natural",
        "--natural-handler",
        "orm",
        "--shutdown-timeout",
        "1s",
        "--duplicate-window",
        "5m",
        "--relay-lease",
        "30s",
        "--relay-publish-timeout",
        "25s",
        "--nats-request-timeout",
        "30s",
    ]);
    setup.wait_until_blocked().await;
    broker.blackhole();
    blocker.rollback().await.unwrap();
    setup.wait_for_reserved(2).await;
    let signalled = std::time::Instant::now();
    signal(&service, "TERM");
    let status = exited_within(&mut service, Duration::from_secs(20));
    let took = signalled.elapsed();
    let _ = service.kill();
    let output = service.wait_with_output().unwrap();
    let logs = String::from_utf8_lossy(&output.stderr);
    let status = status.unwrap_or_else(|| panic!("still running 20 s after the signal:\n{logs}"));
    assert!(took < Duration::from_secs(3), "took {took:?}:\n{logs}");
    assert_eq!(status.code(), Some(1), "{logs}");
    assert!(logs.contains("the shutdown timeout ran out"), "{logs}");
}
