//! `inventory serve` as a process of a scenario: its own streams, consumer and database, its
//! log in a file, SIGKILL and restart at will. And [`FailoverRun`], two instances riding a
//! failover of their database, with what the failover tests read from it: the ack floor's
//! stalls, the instances' counters, each order's wait and its events.

use std::collections::HashMap;
use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream::context::Context;
use inventory_benches::fresh::FreshDatabase;
use inventory_domain::{BookId, StockItem};
use inventory_infra::StockRepository;
use inventory_infra::db::DatabaseConnection;
use inventory_infra::jetstream::{self, Topology};
use inventory_tests::binary::{free_port, http_get, sample};
use inventory_tests::nats::{TestNames, unique_names};
use inventory_tests::outbox;
use inventory_tests::workload::{self, Ledger, StreamState, Workload};
use nix::sys::signal::Signal;
use sea_orm::{ConnectionTrait, DbBackend, Statement};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

pub(crate) use inventory_tests::binary::inventory as binary;

/// The strategy a scenario's instances serve, and what it promises after the faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Served {
    /// `--strategy natural`: every order reserved exactly once, resends under new ids included.
    NaturalKey,
    /// `--strategy inbox`: exact for copies under the same message id. A resend under a new id
    /// is its known blind spot (it reserves again), so its workloads have none.
    Inbox,
    /// `--strategy email`: one mail per reserved order in the mailbox file, none lost; fed
    /// Inventory's StockReserved for each order (see [`Scenario::serve`]). One
    /// instance: its file is the provider its lookup asks, so a crash after a send is
    /// reconciled, not mailed again. Two instances would need two files (a mailbox is locked
    /// by one process), and a redelivery on the other instance looks up the wrong file.
    /// Message-id keyed like the inbox, so no resends under new ids either.
    Email,
}

impl Served {
    fn flag(self) -> &'static str {
        match self {
            Self::NaturalKey => "natural",
            Self::Inbox => "inbox",
            Self::Email => "email",
        }
    }

    /// How many instances a scenario runs.
    pub(crate) fn instances(self) -> usize {
        if self == Self::Email { 1 } else { 2 }
    }

    /// Resends under a new message id a workload of `orders` carries: 20% where the strategy
    /// catches them, none where it cannot.
    pub(crate) fn new_id_resends(self, orders: usize) -> usize {
        if self == Self::NaturalKey {
            orders / 5
        } else {
            0
        }
    }

    /// Asserts the strategy's promise after a scenario settled in `state`; a one-line summary.
    pub(crate) async fn assert_promise(
        self,
        scenario: &Scenario,
        db: &DatabaseConnection,
        workload: &Workload,
        state: StreamState,
    ) -> String {
        match self {
            Self::NaturalKey | Self::Inbox => {
                let ledger = if self == Self::Inbox {
                    Ledger::Log
                } else {
                    Ledger::Reservations
                };
                let report = workload::check_ledger(db, workload, state, ledger).await;
                report.assert_holds();
                report.summary()
            }
            Self::Email => assert_one_mail_per_order(scenario, db, workload, state).await,
        }
    }
}

/// The email's promise: every placed order mailed exactly once with its book and quantity
/// across the mailbox files, no mail for anything else, every email record completed, and
/// every message acked.
async fn assert_one_mail_per_order(
    scenario: &Scenario,
    db: &DatabaseConnection,
    workload: &Workload,
    state: StreamState,
) -> String {
    let mut mails = std::collections::HashMap::new();
    for entry in std::fs::read_dir(&scenario.mail).unwrap().flatten() {
        for line in std::fs::read_to_string(entry.path()).unwrap().lines() {
            let mail: serde_json::Value = serde_json::from_str(line).unwrap();
            let order: uuid::Uuid = mail["order_id"].as_str().unwrap().parse().unwrap();
            let book: uuid::Uuid = mail["book_id"].as_str().unwrap().parse().unwrap();
            let quantity = mail["quantity"].as_i64().unwrap();
            mails
                .entry(inventory_domain::OrderId::from(order))
                .or_insert_with(Vec::new)
                .push((book, quantity));
        }
    }
    let sent: usize = mails.values().map(Vec::len).sum();
    let exact = workload
        .orders
        .iter()
        .filter(|(order, (book, quantity))| {
            mails.get(*order).map(Vec::as_slice) == Some(&[(book.as_uuid(), *quantity)][..])
        })
        .count();
    let row = db
        .query_one_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "SELECT count(*) AS records, count(*) FILTER (WHERE completed_at IS NULL) AS open \
             FROM inbox WHERE consumer = $1",
            [scenario.names.consumer.clone().into()],
        ))
        .await
        .unwrap()
        .unwrap();
    let records: i64 = row.try_get("", "records").unwrap();
    let open: i64 = row.try_get("", "open").unwrap();
    let summary = format!(
        "{} orders, {exact} mailed exactly once; {sent} mails; {records} email records, {open} \
         still processing; stream {} messages, ack floor {}, pending {}, unacked {}, \
         redelivered {}, dead letters {}",
        workload.orders.len(),
        state.stream_messages,
        state.ack_floor,
        state.pending,
        state.ack_pending,
        state.redelivered,
        state.dead_letters
    );
    assert_eq!(exact, workload.orders.len(), "{summary}");
    assert_eq!(sent, workload.orders.len(), "{summary}");
    // One record per message id: an order's same-id resends share it.
    assert_eq!(records, workload.orders.len() as i64, "{summary}");
    assert_eq!(open, 0, "{summary}");
    assert!(state.settled(), "{summary}");
    assert_eq!(state.dead_letters, 0, "{summary}");
    summary
}

/// Where a scenario's instances run: database, NATS, names; their logs go to a scratch
/// directory, removed when the scenario ends unless the test failed.
pub(crate) struct Scenario {
    pub(crate) names: TestNames,
    pub(crate) topology: Topology,
    pub(crate) database_url: String,
    pub(crate) nats_url: String,
    pub(crate) logs: PathBuf,
    /// The email strategy's mailbox files, one per instance slot (`a`, `b`), kept across its
    /// restarts.
    mail: PathBuf,
    pub(crate) served: Served,
    /// The consumer's flags of every instance: [`serve_fault_args`] unless a test says
    /// otherwise.
    pub(crate) consumer_args: Vec<String>,
    /// Extra `serve` flags for every instance.
    pub(crate) serve_args: Vec<String>,
    pub(crate) rust_log: String,
}

impl Scenario {
    /// Serves `served`. The email notifier reads Inventory's events: its scenarios publish
    /// them to the workload's own stream, which then holds its events subjects too.
    pub(crate) fn serve(&mut self, served: Served) {
        self.served = served;
        if served == Served::Email {
            self.topology.events_stream = self.topology.stream.clone();
            self.topology.events_subject_prefix = self.topology.subject_prefix.clone();
        }
    }

    pub(crate) fn new(label: &str, database_url: &str, nats_url: &str, replicas: usize) -> Self {
        let names = unique_names(label);
        let topology = Topology {
            replicas,
            ..names.topology()
        };
        let logs = std::env::temp_dir().join(format!("inventory-{}", names.suffix));
        std::fs::create_dir_all(&logs).unwrap();
        let mail = std::env::temp_dir().join(format!("inventory-{}-mail", names.suffix));
        std::fs::create_dir_all(&mail).unwrap();
        Self {
            names,
            topology,
            database_url: database_url.to_owned(),
            nats_url: nats_url.to_owned(),
            logs,
            mail,
            served: Served::NaturalKey,
            consumer_args: serve_fault_args(),
            serve_args: Vec::new(),
            rust_log: "info,sqlx=warn".into(),
        }
    }

    /// A client of the scenario's NATS with its streams created, for the producer and checks.
    pub(crate) async fn connect(&self) -> (async_nats::Client, Context) {
        let client = jetstream::connect(&self.nats_url, "reliability test")
            .await
            .unwrap();
        let js = jetstream::context(client.clone());
        jetstream::ensure_streams(&js, &self.topology)
            .await
            .unwrap();
        (client, js)
    }

    /// Publishes `sends` to the scenario's stream in the background, `chunk` at a time with
    /// `pause` between chunks (see [`workload::publish`]), so faults land while messages flow.
    pub(crate) fn start_producer(
        &self,
        js: &Context,
        sends: &[workload::Send],
        chunk: usize,
        pause: Duration,
    ) -> JoinHandle<()> {
        let publishing = self.publishing(js, sends, chunk, pause);
        tokio::spawn(publishing)
    }

    /// Publishes `sends` at once.
    pub(crate) async fn publish(&self, js: &Context, sends: &[workload::Send]) {
        self.publishing(js, sends, sends.len(), Duration::ZERO)
            .await;
    }

    /// What the email notifier receives for `sends` (see [`Scenario::serve`]), published.
    fn publishing(
        &self,
        js: &Context,
        sends: &[workload::Send],
        chunk: usize,
        pause: Duration,
    ) -> impl Future<Output = ()> + Send + 'static {
        let sends = if self.served == Served::Email {
            workload::as_reserved_events(sends)
        } else {
            sends.to_vec()
        };
        let (js, topology) = (js.clone(), self.topology.clone());
        async move { workload::publish(&js, &topology, &sends, 64, chunk, pause).await }
    }

    /// Starts `inventory serve` with the scenario's strategy on its consumer. `label` names
    /// the log; its part before a `-` is the instance's slot, which keeps its mailbox.
    pub(crate) fn spawn(&self, label: &str) -> Instance {
        self.spawn_with(label, &[])
    }

    /// [`Self::spawn`] with `extra` flags for this instance alone.
    pub(crate) fn spawn_with(&self, label: &str, extra: &[&str]) -> Instance {
        let mut args: Vec<String> = ["serve", "--strategy", self.served.flag()]
            .map(str::to_owned)
            .into();
        if self.served == Served::Email {
            let slot = label.split('-').next().unwrap_or(label);
            args.push("--mailbox".to_owned());
            args.push(self.mailbox(slot).to_str().unwrap().to_owned());
        }
        args.extend(["--consumer".to_owned(), self.names.consumer.clone()]);
        args.extend(self.consumer_args.iter().cloned());
        args.extend(self.serve_args.iter().cloned());
        args.extend(extra.iter().map(|flag| (*flag).to_owned()));
        self.start(label, &args, &self.names.consumer)
    }

    /// The email strategy's mailbox file of an instance slot, kept across its restarts.
    pub(crate) fn mailbox(&self, slot: &str) -> PathBuf {
        self.mail.join(format!("{slot}.jsonl"))
    }

    /// Starts `inventory <args>` on the scenario's streams, database and NATS, with its
    /// metrics on a port of its own and its log in `<label>.log`; `consumer` is the one its
    /// in-flight gauge is read for (none for a relay).
    pub(crate) fn start(&self, label: &str, args: &[String], consumer: &str) -> Instance {
        let metrics_port = free_port();
        let log = self.logs.join(format!("{label}.log"));
        let file = File::options()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let topology = &self.topology;
        let mut command = Command::new(binary());
        command
            .args(args)
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            .args(["--stream", &topology.stream])
            .args(["--subject-prefix", &topology.subject_prefix])
            .args(["--dlq-stream", &topology.dlq_stream])
            .args(["--dlq-subject-prefix", &topology.dlq_subject_prefix])
            .args(["--events-stream", &topology.events_stream])
            .args(["--events-subject-prefix", &topology.events_subject_prefix])
            .args(["--replicas", &topology.replicas.to_string()])
            .env("DATABASE_URL", &self.database_url)
            .env("NATS_URL", &self.nats_url)
            .env("RUST_LOG", &self.rust_log)
            .stdin(Stdio::null())
            .stdout(Stdio::from(file.try_clone().unwrap()))
            .stderr(Stdio::from(file));
        Instance {
            child: Some(command.spawn().unwrap()),
            label: label.to_owned(),
            metrics_port,
            consumer: consumer.to_owned(),
        }
    }

    /// Lines of all instances' logs that contain `text`: evidence that a fault was felt.
    pub(crate) fn log_lines_with(&self, text: &str) -> usize {
        self.lines_with(&[text]).len()
    }

    /// The lines of all instances' logs that contain every one of `needles`.
    pub(crate) fn lines_with(&self, needles: &[&str]) -> Vec<String> {
        std::fs::read_dir(&self.logs)
            .unwrap()
            .flatten()
            .flat_map(|entry| {
                std::fs::read_to_string(entry.path())
                    .unwrap_or_default()
                    .lines()
                    .filter(|line| needles.iter().all(|needle| line.contains(needle)))
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// The tail of every instance's log, for a failure message.
    pub(crate) fn log_tails(&self) -> String {
        let mut out = String::new();
        for entry in std::fs::read_dir(&self.logs).unwrap().flatten() {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!("--- {}\n", entry.path().display()));
            out.push_str(&lines[lines.len().saturating_sub(15)..].join("\n"));
            out.push('\n');
        }
        out
    }
}

impl Drop for Scenario {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.logs);
            let _ = std::fs::remove_dir_all(&self.mail);
        } else {
            eprintln!(
                "instance logs kept in {}, mailboxes in {}",
                self.logs.display(),
                self.mail.display()
            );
        }
    }
}

/// An instance's `/metrics` and the consumer it reports.
#[derive(Debug, Clone)]
pub(crate) struct MetricsOf {
    port: u16,
    consumer: String,
}

impl MetricsOf {
    /// The consumer's gauges and counts now; `None` while the instance does not answer.
    pub(crate) fn gauges(&self) -> Option<Gauges> {
        let (_, scrape) = http_get(self.port, "/metrics")?;
        let labels = format!("{{consumer=\"{}\"}}", self.consumer);
        let outcomes = |wanted: &[&str]| -> f64 {
            wanted
                .iter()
                .map(|outcome| {
                    sample(
                        &scrape,
                        &format!(
                            "inventory_messages_total{{consumer=\"{}\",outcome=\"{outcome}\"}}",
                            self.consumer
                        ),
                    )
                })
                .sum()
        };
        let acked = ["processed", "duplicate", "rejected", "reconciled"];
        let not_acked = ["dead_lettered", "retried", "left_for_redelivery"];
        Some(Gauges {
            in_flight: sample(&scrape, &format!("inventory_messages_in_flight{labels}")),
            oldest_in_flight: sample(
                &scrape,
                &format!("inventory_oldest_in_flight_seconds{labels}"),
            ),
            acked: outcomes(&acked),
            handled: outcomes(&acked) + outcomes(&not_acked),
        })
    }
}

/// What an instance's `/metrics` says of its consumer.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Gauges {
    pub(crate) in_flight: f64,
    /// Seconds the oldest delivery in its lanes has been handled.
    pub(crate) oldest_in_flight: f64,
    /// Deliveries acked: processed, duplicates, rejected, reconciled.
    pub(crate) acked: f64,
    /// Deliveries finished, whatever their outcome.
    pub(crate) handled: f64,
}

/// One `inventory serve` process.
pub(crate) struct Instance {
    child: Option<Child>,
    pub(crate) label: String,
    metrics_port: u16,
    consumer: String,
}

impl Instance {
    pub(crate) fn pid(&self) -> u32 {
        self.child.as_ref().expect("a running instance").id()
    }

    /// Whether the process is still alive (it has not exited by itself).
    pub(crate) fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|child| matches!(child.try_wait(), Ok(None)))
    }

    /// Messages its handlers hold now, from its own `/metrics`; `None` while it does not
    /// answer (starting up).
    pub(crate) fn in_flight(&self) -> Option<f64> {
        self.metric(&format!(
            "inventory_messages_in_flight{{consumer=\"{}\"}}",
            self.consumer
        ))
    }

    /// Where its metrics are read, for another thread to read them.
    pub(crate) fn metrics(&self) -> MetricsOf {
        MetricsOf {
            port: self.metrics_port,
            consumer: self.consumer.clone(),
        }
    }

    /// The sample `name{labels}` of its own `/metrics` (0 when absent); `None` while it does
    /// not answer.
    pub(crate) fn metric(&self, name_and_labels: &str) -> Option<f64> {
        let (_, scrape) = http_get(self.metrics_port, "/metrics")?;
        Some(sample(&scrape, name_and_labels))
    }

    /// SIGKILL and reap: no drain, no ack, nothing flushed.
    pub(crate) fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits until the process catches SIGTERM. One that arrives before the handlers exist
    /// kills the process like any other, which says nothing about the drain under test.
    fn wait_until_it_catches_sigterm(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !catches_sigterm(self.pid()) {
            assert!(
                self.is_running(),
                "instance {} exited while starting",
                self.label
            );
            assert!(
                Instant::now() < deadline,
                "instance {} did not install its signal handlers within 60 s",
                self.label
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM once it catches it, and wait for the drain; its exit status.
    pub(crate) fn terminate(mut self) -> ExitStatus {
        self.wait_until_it_catches_sigterm();
        let mut child = self.child.take().expect("a running instance");
        let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap());
        nix::sys::signal::kill(pid, Signal::SIGTERM).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!(
                    "instance {} did not stop within 60 s of SIGTERM",
                    self.label
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The first value of a line of `/proc/<pid>/status`, e.g. `VmRSS:`.
fn proc_status(pid: u32, name: &str) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|line| line.starts_with(name))?;
    Some(line.split_whitespace().nth(1)?.to_owned())
}

/// `VmRSS` and `VmHWM` (peak) of a process, in KiB.
pub(crate) fn memory_kib(pid: u32) -> Option<(u64, u64)> {
    let kib = |name| proc_status(pid, name)?.parse::<u64>().ok();
    Some((kib("VmRSS:")?, kib("VmHWM:")?))
}

/// Whether the process has a handler for SIGTERM: bit 15 of the caught-signals mask.
fn catches_sigterm(pid: u32) -> bool {
    proc_status(pid, "SigCgt:")
        .and_then(|mask| u64::from_str_radix(&mask, 16).ok())
        .is_some_and(|mask| mask & (1 << (Signal::SIGTERM as u32 - 1)) != 0)
}

/// Waits until at least `fraction` of `total` messages are acked (or until two minutes pass,
/// which fails the test with the instances' log tails).
pub(crate) async fn until_acked(js: &Context, scenario: &Scenario, total: u64, fraction: f64) {
    let target = (total as f64 * fraction) as u64;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(state) =
            workload::stream_state(js, &scenario.topology, &scenario.names.consumer).await
            && state.ack_floor >= target
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "never reached {target} acked\n{}",
            scenario.log_tails()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A fresh database on the PostgreSQL server of `server_url`, with `books` books of a million
/// copies each: enough that no order of a scenario is ever rejected.
pub(crate) async fn fresh_with_books(
    server_url: &str,
    label: &str,
    books: usize,
) -> (FreshDatabase, Vec<BookId>) {
    let fresh = FreshDatabase::create(Some(server_url), label, 4)
        .await
        .unwrap();
    let ids: Vec<BookId> = (0..books).map(|_| BookId::new_v7()).collect();
    let stock = StockRepository::new(fresh.conn.clone());
    for &book in &ids {
        stock
            .put(&StockItem::new(book, "Dune", 1_000_000).unwrap())
            .await
            .unwrap();
    }
    (fresh, ids)
}

/// Polls until `table` holds no row (parked ones included); fails after `limit`.
pub(crate) async fn wait_until_empty(
    conn: &DatabaseConnection,
    table: &str,
    scenario: &Scenario,
    limit: Duration,
) {
    let deadline = Instant::now() + limit;
    loop {
        let left = inventory_tests::outbox::rows(conn, table).await;
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{table} still holds {} rows, e.g. {:?}\n{}",
            left.len(),
            left.first(),
            scenario.log_tails()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Asserts that every instance is still running (none exited by itself), then stops each
/// with SIGTERM and asserts a clean exit.
pub(crate) fn stop_all(scenario: &Scenario, instances: Vec<Instance>) {
    for mut instance in instances {
        assert!(
            instance.is_running(),
            "instance {} exited\n{}",
            instance.label,
            scenario.log_tails()
        );
        let label = instance.label.clone();
        let status = instance.terminate();
        assert!(
            status.success(),
            "instance {label}: {status}\n{}",
            scenario.log_tails()
        );
    }
}

/// The seed of a randomised scenario: `CHAOS_SEED` to replay one, else a fresh one. Printed so
/// a failing run can be replayed.
pub(crate) fn seed(scenario: &str) -> u64 {
    let seed = std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("[{scenario}] seed {seed} (replay with CHAOS_SEED={seed})");
    seed
}

/// The consumer settings of a `serve` under faults.
pub(crate) fn serve_fault_args() -> Vec<String> {
    [
        // Short: a killed instance's unacked messages come back quickly.
        "--ack-wait",
        "2s",
        // Many kills can hit one message; a max-deliveries dead letter would be a loss.
        "--max-deliver",
        "100",
        "--retry-delay",
        "200ms",
        "--max-retry-delay",
        "2s",
    ]
    .map(str::to_owned)
    .into()
}

/// Two natural-key instances riding a failover of their PostgreSQL, which they reach through
/// a proxy only, never restarted: a producer publishing a workload with the producer's
/// duplicates, and the ack floor watched. What the failover tests share; each brings its own
/// servers and its own failover between [`Self::start`] and [`Self::finish`].
pub(crate) struct FailoverRun {
    pub(crate) scenario: Scenario,
    pub(crate) js: Context,
    /// Messages the producer publishes.
    pub(crate) total: u64,
    _client: async_nats::Client,
    db: DatabaseConnection,
    workload: Workload,
    instances: Vec<Instance>,
    watch: AckFloorWatch,
    producer: JoinHandle<()>,
}

impl FailoverRun {
    /// Starts instances `a` and `b` on `fresh` (its URL the proxy's), the watch, and a
    /// producer of `orders` orders (20% resent under a new id, 10% with the same id) in
    /// `chunks` chunks with `pause` after each, so that the failover lands mid-stream.
    pub(crate) async fn start(
        label: &str,
        fresh: &FreshDatabase,
        books: &[BookId],
        orders: usize,
        chunks: usize,
        pause: Duration,
    ) -> Self {
        let nats = inventory_tests::nats::shared_url().await;
        let scenario = Scenario::new(label, &fresh.url, &nats, 1);
        let (client, js) = scenario.connect().await;
        let workload = Workload::new(books, orders, orders / 5, orders / 10, 14);
        let instances = ["a", "b"]
            .iter()
            .map(|label| scenario.spawn(label))
            .collect();
        let watch = AckFloorWatch::start(&js, &scenario);
        let producer =
            scenario.start_producer(&js, &workload.sends, workload.sends.len() / chunks, pause);
        Self {
            total: workload.sends.len() as u64,
            scenario,
            js,
            _client: client,
            db: fresh.conn.clone(),
            workload,
            instances,
            watch,
            producer,
        }
    }

    /// After the failover (the primary killed at `killed`, another promoted at `promoted`):
    /// waits for the producer, the consumer to settle and the outbox to drain, stops the
    /// instances (asserting a clean exit), reads the ledger and the events, and removes the
    /// streams. Asserts that the kill came before the last publication.
    pub(crate) async fn finish(
        self,
        killed: Instant,
        promoted: Instant,
        limit: Duration,
    ) -> Ridden {
        let Self {
            scenario,
            js,
            total,
            db,
            workload,
            instances,
            watch,
            producer,
            ..
        } = self;
        producer.await.unwrap();
        let topology = &scenario.topology;
        let state = workload::settle(&js, topology, &scenario.names.consumer, total, limit).await;
        // The relay runs inside serve: its events must be out before the instances stop.
        wait_until_empty(&db, "outbox", &scenario, limit).await;
        let samples = watch.stop().await;
        let counters = Counters::read(&instances, &scenario.names.consumer);
        stop_all(&scenario, instances);

        let report = workload::check_ledger(&db, &workload, state, Ledger::Reservations).await;
        let events = outbox::stored(&js, &topology.events_stream).await;
        let stalls = Stalls::of(&samples, killed, promoted);
        assert!(
            stalls.at_kill.stream_last_seq < total,
            "the kill came after the last publication: {:?}",
            stalls.at_kill
        );
        let longest_wait = longest_wait(&js, topology, &db).await;
        for stream in [
            &topology.stream,
            &topology.events_stream,
            &topology.dlq_stream,
        ] {
            let _ = js.delete_stream(stream).await;
        }
        Ridden {
            scenario,
            total,
            report,
            stalls,
            counters,
            events,
            workload,
            longest_wait,
        }
    }
}

/// What a [`FailoverRun`] left behind.
pub(crate) struct Ridden {
    /// Kept for its instances' logs.
    pub(crate) scenario: Scenario,
    total: u64,
    pub(crate) report: workload::Report,
    stalls: Stalls,
    counters: Counters,
    events: Vec<outbox::Stored>,
    workload: Workload,
    /// The longest any order waited from publication to reservation, and that order.
    longest_wait: (Duration, Uuid),
}

impl Ridden {
    /// The promise after a failover the instances rode out: every order reserved exactly once,
    /// nothing lost or dead-lettered, each decision's event stored once; and a delivery retried,
    /// or the failover was never felt.
    pub(crate) fn assert_rode_it_out(&self) {
        self.report.assert_holds();
        assert_one_reserved_event_per_order(&self.events, &self.workload, &self.scenario.topology);
        assert!(
            self.counters.retried > 0.0,
            "no delivery was retried: the failover was never felt"
        );
    }

    /// Where the kill found the stream: published and acked.
    pub(crate) fn at_kill(&self) -> String {
        format!(
            "{} of {} messages published and {} acked",
            self.stalls.at_kill.stream_last_seq, self.total, self.stalls.at_kill.ack_floor
        )
    }

    /// From the kill on: the ack floor's stalls, the longest wait, the counters, the events
    /// and the ledger.
    pub(crate) fn describe(&self) -> String {
        let (longest_wait, waited) = self.longest_wait;
        format!(
            "the ack floor moved again {:.1?} after the kill; longest ack-floor stall {:.1?}; \
             longest wait from publication to reservation {longest_wait:.1?} (order {waited}); \
             {}; {} events, {} republished (duplicate PubAcks); {}",
            self.stalls.first_advance_after_kill,
            self.stalls.longest,
            self.counters.describe(),
            self.events.len(),
            self.counters.duplicate_pubacks,
            self.report.summary()
        )
    }
}

/// Each decision's event once: every order exactly one `stock.reserved` (stock is plenty, so
/// nothing is rejected), none for anything else, no event id twice.
fn assert_one_reserved_event_per_order(
    events: &[outbox::Stored],
    workload: &Workload,
    topology: &Topology,
) {
    let by_order = outbox::subjects_by_order(events, &topology.events_subject_prefix);
    assert_eq!(by_order.len(), workload.orders.len(), "orders with events");
    for order in workload.orders.keys() {
        assert_eq!(
            by_order.get(&order.as_uuid()).map(Vec::as_slice),
            Some(&["stock.reserved".to_owned()][..]),
            "events of order {order}"
        );
    }
}

/// The consumer's ack floor sampled every 100 ms in the background.
struct AckFloorWatch {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Vec<(Instant, StreamState)>>,
}

impl AckFloorWatch {
    fn start(js: &Context, scenario: &Scenario) -> Self {
        let stop = CancellationToken::new();
        let (js, topology, consumer) = (
            js.clone(),
            scenario.topology.clone(),
            scenario.names.consumer.clone(),
        );
        let token = stop.clone();
        let task = tokio::spawn(async move {
            let mut samples = Vec::new();
            while !token.is_cancelled() {
                if let Some(state) = workload::stream_state(&js, &topology, &consumer).await {
                    samples.push((Instant::now(), state));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            samples
        });
        Self { stop, task }
    }

    async fn stop(self) -> Vec<(Instant, StreamState)> {
        self.stop.cancel();
        self.task.await.unwrap()
    }
}

/// How long the ack floor stood still while messages waited.
struct Stalls {
    /// The last sample before the kill: how far the producer and the consumer had come.
    at_kill: StreamState,
    /// From the kill to the first sample after the promotion with a higher ack floor than at
    /// the promotion (nothing can commit in between).
    first_advance_after_kill: Duration,
    /// The longest time between two advances of the ack floor with messages waiting.
    longest: Duration,
}

impl Stalls {
    fn of(samples: &[(Instant, StreamState)], killed: Instant, promoted: Instant) -> Self {
        let at_kill = samples
            .iter()
            .take_while(|(at, _)| *at <= killed)
            .last()
            .map(|(_, state)| *state)
            .expect("a sample before the kill");
        let floor_at_promotion = samples
            .iter()
            .take_while(|(at, _)| *at <= promoted)
            .map(|(_, state)| state.ack_floor)
            .max()
            .unwrap_or(0);
        let first_advance_after_kill = samples
            .iter()
            .find(|(at, state)| *at > promoted && state.ack_floor > floor_at_promotion)
            .map(|(at, _)| *at - killed)
            .expect("the ack floor never moved after the promotion");
        let mut longest = Duration::ZERO;
        let mut last_advance: Option<(Instant, u64)> = None;
        for &(at, state) in samples {
            match last_advance {
                Some((since, floor)) if state.ack_floor > floor => {
                    longest = longest.max(at - since);
                    last_advance = Some((at, state.ack_floor));
                }
                // Nothing waits: standing still is not a stall.
                Some(_) if state.settled() => last_advance = Some((at, state.ack_floor)),
                Some(_) => {}
                None => last_advance = Some((at, state.ack_floor)),
            }
        }
        Self {
            at_kill,
            first_advance_after_kill,
            longest,
        }
    }
}

/// What the instances counted, summed over both.
struct Counters {
    processed: f64,
    duplicates: f64,
    retried: f64,
    duplicate_pubacks: f64,
}

impl Counters {
    fn read(instances: &[Instance], consumer: &str) -> Self {
        let sum = |name: &str| -> f64 {
            instances
                .iter()
                .map(|instance| {
                    instance
                        .metric(name)
                        .unwrap_or_else(|| panic!("instance {} has no /metrics", instance.label))
                })
                .sum()
        };
        let outcome = |outcome: &str| {
            sum(&format!(
                "inventory_messages_total{{consumer=\"{consumer}\",outcome=\"{outcome}\"}}"
            ))
        };
        Self {
            processed: outcome("processed"),
            duplicates: outcome("duplicate"),
            retried: outcome("retried"),
            duplicate_pubacks: sum("inventory_outbox_duplicate_pubacks_total{outbox=\"outbox\"}"),
        }
    }

    fn describe(&self) -> String {
        format!(
            "deliveries: {} processed, {} duplicates, {} retried",
            self.processed, self.duplicates, self.retried
        )
    }
}

/// The longest any order waited from its first message's arrival in the stream to the commit
/// of its reservation (the row's `created_at`), and that order.
async fn longest_wait(
    js: &Context,
    topology: &Topology,
    db: &DatabaseConnection,
) -> (Duration, Uuid) {
    let mut stream = js.get_stream(&topology.stream).await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut published: HashMap<Uuid, i128> = HashMap::new();
    for sequence in 1..=last {
        let message = stream.get_raw_message(sequence).await.unwrap();
        let body: serde_json::Value = serde_json::from_slice(&message.payload).unwrap();
        let order: Uuid = body["order_id"].as_str().unwrap().parse().unwrap();
        let at = message.time.unix_timestamp_nanos();
        published
            .entry(order)
            .and_modify(|first| *first = (*first).min(at))
            .or_insert(at);
    }
    let rows = db
        .query_all_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT order_id, created_at FROM stock_reservations",
        ))
        .await
        .unwrap();
    rows.iter()
        .map(|row| {
            let order: Uuid = row.try_get("", "order_id").unwrap();
            let created: chrono::DateTime<chrono::Utc> = row.try_get("", "created_at").unwrap();
            let reserved = i128::from(created.timestamp_nanos_opt().unwrap());
            let waited = u64::try_from(reserved - published[&order]).unwrap_or(0);
            (Duration::from_nanos(waited), order)
        })
        .max()
        .expect("reservations")
}
