//! `inventory serve` as a process of a scenario: its own streams, consumer and database, its
//! log in a file, SIGKILL and restart at will. And [`FailoverRun`], instances riding a
//! failover of their database, unsharded or on one shard of several, with what the failover
//! tests read from it: the ack floor's stalls, the other shards' acks meanwhile, the
//! instances' counters, each order's wait and its events.

use std::collections::HashMap;
use std::fs::File;
use std::num::NonZeroU32;
use std::ops::{Range, RangeInclusive};
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
use inventory_tests::nats::{NatsServer, TestNames, binary_since_2_10, unique_names};
use inventory_tests::outbox;
use inventory_tests::workload::{
    self, ConsumerState, ConsumersState, Ledger, StreamState, Workload,
};
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
        let mut command = self.command(label, args);
        command.args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")]);
        Instance {
            child: Some(command.spawn().unwrap()),
            label: label.to_owned(),
            metrics_port,
            consumer: consumer.to_owned(),
        }
    }

    /// Runs `inventory <args>` to its end, e.g. a `shard` command; it must succeed.
    pub(crate) fn run(&self, label: &str, args: &[&str]) {
        let args: Vec<String> = args.iter().map(|arg| (*arg).to_owned()).collect();
        let status = self.command(label, &args).status().unwrap();
        assert!(status.success(), "{args:?}: {status}\n{}", self.log_tails());
    }

    /// `inventory <args>` on the scenario's streams, database and NATS, its output appended
    /// to `<label>.log`.
    pub(crate) fn command(&self, label: &str, args: &[String]) -> Command {
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
        command
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
    let consumers = [scenario.names.consumer.clone()];
    until_all_acked(js, scenario, &consumers, total, fraction).await;
}

/// [`until_acked`] by `consumers` together: their ack floor (see [`ConsumersState::combined`])
/// that far into the stream.
async fn until_all_acked(
    js: &Context,
    scenario: &Scenario,
    consumers: &[String],
    total: u64,
    fraction: f64,
) {
    let target = (total as f64 * fraction) as u64;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(state) = workload::consumers_state(js, &scenario.topology, consumers).await
            && state.combined(0..consumers.len()).ack_floor >= target
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
    fresh_with_books_where(server_url, label, books, |_| true).await
}

/// [`fresh_with_books`] with books that `wanted` takes, e.g. those of a shard's partitions.
pub(crate) async fn fresh_with_books_where(
    server_url: &str,
    label: &str,
    books: usize,
    wanted: impl Fn(BookId) -> bool,
) -> (FreshDatabase, Vec<BookId>) {
    let fresh = FreshDatabase::create(Some(server_url), label, 4)
        .await
        .unwrap();
    let ids: Vec<BookId> = std::iter::repeat_with(BookId::new_v7)
        .filter(|book| wanted(*book))
        .take(books)
        .collect();
    stock_books(&fresh.conn, &ids).await;
    (fresh, ids)
}

/// A million copies of each of `books` on hand in `conn`'s database: more than any test takes.
pub(crate) async fn stock_books(conn: &DatabaseConnection, books: &[BookId]) {
    let stock = StockRepository::new(conn.clone());
    for &book in books {
        stock
            .put(&StockItem::new(book, "Dune", 1_000_000).unwrap())
            .await
            .unwrap();
    }
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

/// Natural-key instances riding a failover of a PostgreSQL they reach through a proxy only,
/// never restarted: a producer publishing a workload with the producer's duplicates, and the
/// ack floors watched. Unsharded, two instances on one database; sharded, each shard's
/// instances on its own database, the first shard's the one that fails over. What the
/// failover tests share; each brings its own servers and its own failover between the start
/// and [`Self::finish`].
pub(crate) struct FailoverRun {
    pub(crate) scenario: Scenario,
    pub(crate) js: Context,
    /// Messages the producer publishes.
    pub(crate) total: u64,
    _client: async_nats::Client,
    shards: Vec<RunShard>,
    workload: Workload,
    watch: AckFloorWatch,
    producer: JoinHandle<()>,
    /// A sharded run's own nats-server (2.10 or later), kept until the run is finished.
    _server: Option<NatsServer>,
}

/// A shard of a sharded [`FailoverRun`]: its name, its database with `books` in stock (each
/// on one of `partitions`), the partitions assigned to it and its instances' count.
pub(crate) struct ShardSpec<'a> {
    pub(crate) name: &'static str,
    pub(crate) fresh: &'a FreshDatabase,
    pub(crate) books: &'a [BookId],
    pub(crate) partitions: RangeInclusive<u32>,
    pub(crate) instances: usize,
}

/// A shard while the run goes on; an unsharded run's one shard has no name.
struct RunShard {
    name: &'static str,
    db: DatabaseConnection,
    books: Vec<BookId>,
    /// The durable consumers its instances pull: its partitions', or the unsharded one.
    consumers: Vec<String>,
    /// Each consumer's partition; none when unsharded.
    partitions: Vec<u32>,
    instances: Vec<Instance>,
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
        let shard = RunShard {
            name: "",
            db: fresh.conn.clone(),
            books: books.to_vec(),
            consumers: vec![scenario.names.consumer.clone()],
            partitions: Vec::new(),
            instances: ["a", "b"]
                .iter()
                .map(|label| scenario.spawn(label))
                .collect(),
        };
        Self::produce(
            scenario,
            client,
            js,
            vec![shard],
            None,
            (orders, chunks, pause),
        )
    }

    /// [`Self::start`] on a stream sharded onto `partitions` (`inventory shard init`) on a
    /// nats-server 2.10+ of the run's own, with `shards` assigned their partitions, each
    /// served by its instances (`serve --shard`) from its own database; the producer's orders
    /// go round robin over all the shards' books.
    pub(crate) async fn start_sharded(
        label: &str,
        partitions: NonZeroU32,
        shards: &[ShardSpec<'_>],
        orders: usize,
        chunks: usize,
        pause: Duration,
    ) -> Self {
        // The slow tier's set-up installs one (scripts/test.sh): a skip would hide the test.
        let bin = binary_since_2_10().unwrap_or_else(|why| panic!("{why}"));
        let server = NatsServer::start_binary(&bin).await;
        let mut scenario = Scenario::new(label, &shards[0].fresh.url, &server.url(), 1);
        // A small pool (and so as many lanes): a shard's database may be on the local server,
        // whose connections other tests share. The partition consumers keep `shard init`'s
        // ack wait (`--update-consumer` would also reset their start, which the server
        // refuses): no instance is killed here, so no delivery waits on it.
        scenario
            .serve_args
            .extend(["--db-pool-size", "4"].map(str::to_owned));
        let (client, js) = scenario.connect().await;
        let base = scenario.names.consumer.clone();
        scenario.run(
            "init",
            &[
                "shard",
                "init",
                "--partitions",
                &partitions.to_string(),
                "--consumer",
                &base,
            ],
        );
        let shards = shards
            .iter()
            .map(|spec| {
                let (first, last) = (*spec.partitions.start(), *spec.partitions.end());
                scenario.run(
                    &format!("assign-{}", spec.name),
                    &[
                        "shard",
                        "assign",
                        "--partitions",
                        &format!("{first}-{last}"),
                        "--to",
                        spec.name,
                        "--database-url",
                        &spec.fresh.url,
                    ],
                );
                let serve = ["--shard", spec.name, "--database-url", &spec.fresh.url];
                RunShard {
                    name: spec.name,
                    db: spec.fresh.conn.clone(),
                    books: spec.books.to_vec(),
                    consumers: spec
                        .partitions
                        .clone()
                        .map(|partition| {
                            jetstream::partition_consumer(&base, partition, partitions)
                        })
                        .collect(),
                    partitions: spec.partitions.clone().collect(),
                    instances: (1..=spec.instances)
                        .map(|n| scenario.spawn_with(&format!("{}{n}", spec.name), &serve))
                        .collect(),
                }
            })
            .collect();
        Self::produce(
            scenario,
            client,
            js,
            shards,
            Some(server),
            (orders, chunks, pause),
        )
    }

    /// The workload over every shard's books, the watch of every shard's consumers, and the
    /// producer of `(orders, chunks, pause)` as [`Self::start`] says.
    fn produce(
        scenario: Scenario,
        client: async_nats::Client,
        js: Context,
        shards: Vec<RunShard>,
        server: Option<NatsServer>,
        (orders, chunks, pause): (usize, usize, Duration),
    ) -> Self {
        let books: Vec<BookId> = shards
            .iter()
            .flat_map(|shard| shard.books.iter().copied())
            .collect();
        let workload = Workload::new(&books, orders, orders / 5, orders / 10, 14);
        let consumers = shards
            .iter()
            .flat_map(|shard| shard.consumers.iter().cloned())
            .collect();
        let watch = AckFloorWatch::start(&js, &scenario.topology, consumers);
        let producer =
            scenario.start_producer(&js, &workload.sends, workload.sends.len() / chunks, pause);
        Self {
            total: workload.sends.len() as u64,
            scenario,
            js,
            _client: client,
            shards,
            workload,
            watch,
            producer,
            _server: server,
        }
    }

    /// Waits until the first shard, the one that fails over, has acked at least `fraction` of
    /// the messages (see [`until_acked`]).
    pub(crate) async fn until_acked(&self, fraction: f64) {
        let consumers = &self.shards[0].consumers;
        until_all_acked(&self.js, &self.scenario, consumers, self.total, fraction).await;
    }

    /// The first shard's ack floor now.
    pub(crate) async fn ack_floor(&self) -> u64 {
        let consumers = &self.shards[0].consumers;
        workload::consumers_state(&self.js, &self.scenario.topology, consumers)
            .await
            .expect("the consumers' state")
            .combined(0..consumers.len())
            .ack_floor
    }

    /// After the failover (the primary killed at `killed`, another promoted at `promoted`):
    /// waits for the producer, every shard's consumers to settle and its outbox to drain,
    /// stops the instances (asserting that each still runs, and exits cleanly), reads each
    /// shard's ledger against its part of the workload, the events, and how the other shards
    /// acked while the first was out. Asserts that the kill came before the last publication.
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
            shards,
            workload,
            watch,
            producer,
            _server,
            ..
        } = self;
        producer.await.unwrap();
        let topology = &scenario.topology;
        let mut states = Vec::with_capacity(shards.len());
        for shard in &shards {
            states.push(workload::settle_all(&js, topology, &shard.consumers, total, limit).await);
            // The relay runs inside serve: its events must be out before the instances stop.
            wait_until_empty(&shard.db, "outbox", &scenario, limit).await;
        }
        let samples = watch.stop().await;
        let counters: Vec<Counters> = shards
            .iter()
            .map(|shard| Counters::read(&shard.instances, &shard.consumers))
            .collect();

        let published = published(&js, topology).await;
        let first = 0..shards[0].consumers.len();
        let stalls = Stalls::of(&samples, first.clone(), killed, promoted);
        assert!(
            stalls.at_kill.stream_last_seq < total,
            "the kill came after the last publication: {:?}",
            stalls.at_kill
        );
        let back = killed + stalls.first_advance_after_kill;
        let mut kept_acking = Vec::new();
        let mut offset = first.end;
        for shard in &shards[1..] {
            let consumers = offset..offset + shard.consumers.len();
            offset = consumers.end;
            kept_acking.push(KeptAcking::of(
                (shard, consumers),
                (&shards[0], first.clone()),
                &samples,
                &published,
                killed..back,
            ));
        }
        let dbs: Vec<DatabaseConnection> = shards.iter().map(|shard| shard.db.clone()).collect();
        let longest_wait = longest_wait(&published, &dbs).await;

        let mut ridden = Vec::with_capacity(shards.len());
        for ((shard, state), counters) in shards.into_iter().zip(states).zip(counters) {
            stop_all(&scenario, shard.instances);
            let part = workload.on_books(&shard.books);
            let report =
                workload::check_ledger(&shard.db, &part, state, Ledger::Reservations).await;
            ridden.push(RiddenShard {
                name: shard.name,
                report,
                counters,
            });
        }
        let events = outbox::stored(&js, &topology.events_stream).await;
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
            shards: ridden,
            stalls,
            kept_acking,
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
    shards: Vec<RiddenShard>,
    /// The first shard's ack floor, which the failover stalled.
    stalls: Stalls,
    /// The other shards', while the first was out.
    kept_acking: Vec<KeptAcking>,
    events: Vec<outbox::Stored>,
    workload: Workload,
    /// The longest any order waited from publication to reservation, and that order.
    longest_wait: (Duration, Uuid),
}

/// A shard of a [`Ridden`]: its ledger against its part of the workload, and its instances'
/// counters.
struct RiddenShard {
    name: &'static str,
    report: workload::Report,
    counters: Counters,
}

impl Ridden {
    /// The promise after a failover the instances rode out: on every shard, every order of
    /// its books reserved exactly once and no row of another shard's, nothing lost or
    /// dead-lettered; each decision's event stored once; and on the first shard a delivery
    /// retried, or the failover was never felt.
    pub(crate) fn assert_rode_it_out(&self) {
        for shard in &self.shards {
            shard.report.assert_holds();
        }
        assert_one_reserved_event_per_order(&self.events, &self.workload, &self.scenario.topology);
        assert!(
            self.shards[0].counters.retried > 0.0,
            "no delivery was retried: the failover was never felt"
        );
    }

    /// The ledger of shard `name`.
    pub(crate) fn report(&self, name: &str) -> &workload::Report {
        &self
            .shards
            .iter()
            .find(|shard| shard.name == name)
            .unwrap_or_else(|| panic!("no shard {name}"))
            .report
    }

    /// Every other shard went on acking while the first had no writable leader (from the kill
    /// to its first ack after the promotion): in each half of that window enough of its
    /// messages arrived to tell, and it acked some of them within that half.
    pub(crate) fn assert_other_shards_kept_acking(&self) {
        assert!(!self.kept_acking.is_empty(), "no other shard");
        for kept in &self.kept_acking {
            for (half, &(arrived, acked)) in ["first", "second"].iter().zip(&kept.halves) {
                let name = kept.name;
                assert!(
                    arrived >= MIN_ARRIVED,
                    "only {arrived} messages of shard {name} arrived in the {half} half of the \
                     outage, too few to tell: the producer must publish through it; {}",
                    kept.describe()
                );
                assert!(
                    acked > 0,
                    "shard {name} acked none of the {arrived} messages that arrived in the \
                     {half} half of the outage; {}",
                    kept.describe()
                );
            }
        }
    }

    /// Where the kill found the stream: published, and acked by the first shard.
    pub(crate) fn at_kill(&self) -> String {
        format!(
            "{} of {} messages published and the ack floor at {}",
            self.stalls.at_kill.stream_last_seq, self.total, self.stalls.at_kill.ack_floor
        )
    }

    /// From the kill on: the first shard's ack floor's stalls, the other shards' acks
    /// meanwhile, the longest wait, each shard's counters and ledger, and the events.
    pub(crate) fn describe(&self) -> String {
        let (longest_wait, waited) = self.longest_wait;
        let shards: Vec<String> = self
            .shards
            .iter()
            .map(|shard| {
                let what = format!("{}; {}", shard.counters.describe(), shard.report.summary());
                if shard.name.is_empty() {
                    what
                } else {
                    format!("shard {}: {what}", shard.name)
                }
            })
            .collect();
        let duplicate_pubacks: f64 = self
            .shards
            .iter()
            .map(|shard| shard.counters.duplicate_pubacks)
            .sum();
        let kept: Vec<String> = self.kept_acking.iter().map(KeptAcking::describe).collect();
        format!(
            "the ack floor moved again {:.1?} after the kill; longest ack-floor stall {:.1?}; \
             {}longest wait from publication to reservation {longest_wait:.1?} (order \
             {waited}); {}; {} events, {duplicate_pubacks} republished (duplicate PubAcks)",
            self.stalls.first_advance_after_kill,
            self.stalls.longest,
            kept.iter()
                .map(|kept| format!("{kept}; "))
                .collect::<String>(),
            shards.join("; "),
            self.events.len(),
        )
    }
}

/// Messages of a shard that must arrive in each half of the first shard's outage for
/// [`Ridden::assert_other_shards_kept_acking`] to tell anything.
const MIN_ARRIVED: usize = 20;

/// How a shard that did not fail over acked while the first shard was out: from the kill to
/// the first shard's first ack after the promotion. Counted from the stored messages and the
/// shard's consumers' ack floors, so only what NATS recorded as acked counts.
struct KeptAcking {
    name: &'static str,
    /// For each half of the window: the shard's messages that arrived in the stream in it, and
    /// how many of those it had acked by the half's end.
    halves: [(usize, usize); 2],
    /// The window's length.
    window: Duration,
    /// About once a second through the window: the time since the kill, and the first
    /// shard's and this shard's acked messages.
    timeline: Vec<(Duration, usize, usize)>,
}

impl KeptAcking {
    /// `shard` and `first` with their places in the samples' consumers; `published` the
    /// stream's messages by sequence; `outage` from the kill to the first shard's first ack
    /// after the promotion.
    fn of(
        (shard, consumers): (&RunShard, Range<usize>),
        (first, first_consumers): (&RunShard, Range<usize>),
        samples: &[(Instant, ConsumersState)],
        published: &[Published],
        outage: Range<Instant>,
    ) -> Self {
        let Range {
            start: killed,
            end: back,
        } = outage;
        let at_or_after = |moment: Instant| {
            samples
                .iter()
                .find(|(at, _)| *at >= moment)
                .expect("a sample after the first shard's outage")
        };
        let before = samples
            .iter()
            .take_while(|(at, _)| *at <= killed)
            .last()
            .expect("a sample before the kill");
        let middle = at_or_after(killed + (back - killed) / 2);
        let end = at_or_after(back);
        let half = |(_, from): &(Instant, ConsumersState), (_, to): &(Instant, ConsumersState)| {
            let floors = &to.consumers[consumers.clone()];
            let arrived = from.stream_last_seq + 1..=to.stream_last_seq;
            acked_messages(published, &shard.partitions, floors, arrived)
        };
        let timeline = (0..)
            .map(|second| killed + Duration::from_secs(second))
            .take_while(|moment| *moment < back)
            .chain([back])
            .map(|moment| {
                let (at, state) = at_or_after(moment);
                let all = 1..=state.stream_last_seq;
                let acked = |partitions, consumers: &Range<usize>| {
                    let floors = &state.consumers[consumers.clone()];
                    acked_messages(published, partitions, floors, all.clone()).1
                };
                (
                    *at - killed,
                    acked(&first.partitions, &first_consumers),
                    acked(&shard.partitions, &consumers),
                )
            })
            .collect();
        Self {
            name: shard.name,
            halves: [half(before, middle), half(middle, end)],
            window: back - killed,
            timeline,
        }
    }

    fn describe(&self) -> String {
        let [(arrived_1, acked_1), (arrived_2, acked_2)] = self.halves;
        let timeline: Vec<String> = self
            .timeline
            .iter()
            .map(|(since, first, acked)| format!("{:.1} s: {first}/{acked}", since.as_secs_f64()))
            .collect();
        format!(
            "shard {} while the first was out ({:.1?}): {acked_1} of {arrived_1} of its \
             messages that arrived in the first half acked in it, {acked_2} of {arrived_2} in \
             the second (timeline since the kill, the first shard's acked messages / this \
             shard's: {})",
            self.name,
            self.window,
            timeline.join(", ")
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

/// The consumers' state sampled every 100 ms in the background.
struct AckFloorWatch {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Vec<(Instant, ConsumersState)>>,
}

impl AckFloorWatch {
    fn start(js: &Context, topology: &Topology, consumers: Vec<String>) -> Self {
        let stop = CancellationToken::new();
        let (js, topology) = (js.clone(), topology.clone());
        let token = stop.clone();
        let task = tokio::spawn(async move {
            let mut samples = Vec::new();
            while !token.is_cancelled() {
                if let Some(state) = workload::consumers_state(&js, &topology, &consumers).await {
                    samples.push((Instant::now(), state));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            samples
        });
        Self { stop, task }
    }

    async fn stop(self) -> Vec<(Instant, ConsumersState)> {
        self.stop.cancel();
        self.task.await.unwrap()
    }
}

/// How long the ack floors of some consumers (the first shard's) stood still while messages
/// waited. Each consumer's own floor only rises, so their sum rises with any one of them.
struct Stalls {
    /// The last sample before the kill: how far the producer and the consumers had come.
    at_kill: StreamState,
    /// From the kill to the first sample after the promotion with a higher ack floor than at
    /// the promotion (nothing can commit in between).
    first_advance_after_kill: Duration,
    /// The longest time between two advances of an ack floor with messages waiting.
    longest: Duration,
}

impl Stalls {
    fn of(
        samples: &[(Instant, ConsumersState)],
        consumers: Range<usize>,
        killed: Instant,
        promoted: Instant,
    ) -> Self {
        let floors = |state: &ConsumersState| -> u64 {
            state.consumers[consumers.clone()]
                .iter()
                .map(|consumer| consumer.ack_floor)
                .sum()
        };
        let at_kill = samples
            .iter()
            .take_while(|(at, _)| *at <= killed)
            .last()
            .map(|(_, state)| state.combined(consumers.clone()))
            .expect("a sample before the kill");
        let floors_at_promotion = samples
            .iter()
            .take_while(|(at, _)| *at <= promoted)
            .map(|(_, state)| floors(state))
            .max()
            .unwrap_or(0);
        let first_advance_after_kill = samples
            .iter()
            .find(|(at, state)| *at > promoted && floors(state) > floors_at_promotion)
            .map(|(at, _)| *at - killed)
            .expect("the ack floor never moved after the promotion");
        let mut longest = Duration::ZERO;
        let mut last_advance: Option<(Instant, u64)> = None;
        for (at, state) in samples {
            let floor = floors(state);
            match last_advance {
                Some((since, before)) if floor > before => {
                    longest = longest.max(*at - since);
                    last_advance = Some((*at, floor));
                }
                // Nothing waits: standing still is not a stall.
                Some(_) if state.combined(consumers.clone()).settled() => {
                    last_advance = Some((*at, floor));
                }
                Some(_) => {}
                None => last_advance = Some((*at, floor)),
            }
        }
        Self {
            at_kill,
            first_advance_after_kill,
            longest,
        }
    }
}

/// What a shard's instances counted, summed over them and their consumers.
struct Counters {
    processed: f64,
    duplicates: f64,
    retried: f64,
    duplicate_pubacks: f64,
}

impl Counters {
    fn read(instances: &[Instance], consumers: &[String]) -> Self {
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
            consumers
                .iter()
                .map(|consumer| {
                    sum(&format!(
                        "inventory_messages_total{{consumer=\"{consumer}\",outcome=\"{outcome}\"}}"
                    ))
                })
                .sum()
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

/// Of the messages with a sequence in `sequences`, those of `partitions` (arrived), and how
/// many of them lie below their partition consumer's floor in `floors` (acked); `floors` in
/// the order of `partitions`. Only what NATS recorded counts.
fn acked_messages(
    published: &[Published],
    partitions: &[u32],
    floors: &[ConsumerState],
    sequences: RangeInclusive<u64>,
) -> (usize, usize) {
    published
        .iter()
        .zip(1..)
        .filter(|(_, sequence)| sequences.contains(sequence))
        .filter_map(|(message, sequence)| {
            let index = partitions
                .iter()
                .position(|&partition| Some(partition) == message.partition)?;
            Some(sequence <= floors[index].ack_floor)
        })
        .fold((0, 0), |(arrived, acked), yes| {
            (arrived + 1, acked + usize::from(yes))
        })
}

/// A message of the orders stream as stored; they are read in order of sequence, from 1.
struct Published {
    order: Uuid,
    /// When the stream stored it, in nanoseconds since the epoch.
    at: i128,
    /// Its partition on a sharded stream: the subject is `<prefix>.placed.<partition>.<book>`
    /// (`shard init`'s transform).
    partition: Option<u32>,
}

async fn published(js: &Context, topology: &Topology) -> Vec<Published> {
    let mut stream = js.get_stream(&topology.stream).await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let prefix = format!("{}.", topology.subject_prefix);
    let mut published = Vec::new();
    for sequence in 1..=last {
        let message = stream.get_raw_message(sequence).await.unwrap();
        let body: serde_json::Value = serde_json::from_slice(&message.payload).unwrap();
        published.push(Published {
            order: body["order_id"].as_str().unwrap().parse().unwrap(),
            at: message.time.unix_timestamp_nanos(),
            partition: message
                .subject
                .strip_prefix(&prefix)
                .and_then(|rest| rest.split('.').nth(1)?.parse().ok()),
        });
    }
    published
}

/// The longest any order waited from its first message's arrival in the stream to the commit
/// of its reservation (the row's `created_at`) on any of `dbs`, and that order.
async fn longest_wait(published: &[Published], dbs: &[DatabaseConnection]) -> (Duration, Uuid) {
    let mut first: HashMap<Uuid, i128> = HashMap::new();
    for message in published {
        first
            .entry(message.order)
            .and_modify(|at| *at = (*at).min(message.at))
            .or_insert(message.at);
    }
    let mut longest = None;
    for db in dbs {
        let rows = db
            .query_all_raw(Statement::from_string(
                DbBackend::Postgres,
                "SELECT order_id, created_at FROM stock_reservations",
            ))
            .await
            .unwrap();
        for row in rows {
            let order: Uuid = row.try_get("", "order_id").unwrap();
            let created: chrono::DateTime<chrono::Utc> = row.try_get("", "created_at").unwrap();
            let reserved = i128::from(created.timestamp_nanos_opt().unwrap());
            let waited = u64::try_from(reserved - first[&order]).unwrap_or(0);
            longest = longest.max(Some((Duration::from_nanos(waited), order)));
        }
    }
    longest.expect("reservations")
}
