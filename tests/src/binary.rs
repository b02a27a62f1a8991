//! The `inventory` binary run as a process against a test's own database and stream names: what
//! the process-level tests of the service package share.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use inventory_infra::jetstream;

use crate::nats::{NatsServer, TestNames, binary_since_2_10, unique_names};
use crate::{Backend, TestDb, run_to_end_from_drop};

/// The `inventory` binary under test: `INVENTORY_BIN` if set (e.g. a release build for the
/// load figures), else the one built beside these tests (`cargo build --workspace --bins`,
/// which `scripts/test.sh` runs first; a test binary cannot ask cargo for another package's
/// binary).
pub fn inventory() -> PathBuf {
    std::env::var_os("INVENTORY_BIN").map_or_else(|| workspace_binary("inventory"), PathBuf::from)
}

/// A binary of this workspace, from the target directory these tests were built in
/// (`target/<profile>/deps/<test>` is where a test runs from).
pub fn workspace_binary(name: &str) -> PathBuf {
    let test = std::env::current_exe().expect("the test knows its own path");
    let profile_dir = test
        .parent()
        .and_then(std::path::Path::parent)
        .expect("a test runs from target/<profile>/deps");
    let binary = profile_dir.join(name);
    assert!(
        binary.exists(),
        "{} is not built: run `cargo build --workspace --bins` first (scripts/test.sh does)",
        binary.display()
    );
    binary
}

/// A fresh PostgreSQL database, stream names of the test's own, and the binary to run; the
/// database and the streams are removed when it is dropped, also by a failing test.
pub struct BinaryRun {
    pub db: TestDb,
    pub names: TestNames,
    /// What the commands get as `DATABASE_URL`: the fresh database's, unless a test swaps it.
    pub database_url: String,
    /// What the commands get as `NATS_URL`: the shared server's, unless a test swaps it (the
    /// streams are removed through it when the run is dropped).
    pub nats_url: String,
    binary: PathBuf,
    log_filter: &'static str,
}

impl BinaryRun {
    /// Runs [`inventory`] with `RUST_LOG` set to `log_filter`.
    pub async fn new(label: &str, log_filter: &'static str) -> Self {
        let db = TestDb::labelled(Backend::Postgres, label).await;
        Self {
            database_url: db.url.clone(),
            db,
            names: unique_names(""),
            nats_url: crate::nats::shared_url().await,
            binary: inventory(),
            log_filter,
        }
    }

    /// A run whose orders stream is sharded onto `partitions` (`inventory shard init`) on a
    /// nats-server 2.10+ of the test's own (stream subject transforms), and that server; `None`
    /// after saying why there is no such server. `test` names the test in that message.
    pub async fn sharded(
        test: &str,
        log_filter: &'static str,
        partitions: std::num::NonZeroU32,
    ) -> Option<(NatsServer, Self)> {
        let bin = match binary_since_2_10() {
            Ok(bin) => bin,
            Err(why) => {
                eprintln!("{test}: skipped: {why}");
                return None;
            }
        };
        let server = NatsServer::start_binary(&bin).await;
        let mut run = Self::new("shard", log_filter).await;
        run.nats_url = server.url();
        run.run(&["shard", "init", "--partitions", &partitions.to_string()]);
        Some((server, run))
    }

    /// The flags that point a command at the test's streams.
    pub fn topology_args(&self) -> Vec<String> {
        [
            "--stream",
            &self.names.stream,
            "--subject-prefix",
            &self.names.subject_prefix,
            "--dlq-stream",
            &self.names.dlq_stream,
            "--dlq-subject-prefix",
            &self.names.dlq_subject_prefix,
            "--events-stream",
            &self.names.events_stream,
            "--events-subject-prefix",
            &self.names.events_subject_prefix,
        ]
        .map(str::to_owned)
        .into()
    }

    /// `inventory <args>`, with the test's streams for the commands that use NATS.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(&self.binary);
        command.args(args);
        let first = args.first().copied().unwrap_or_default();
        if ["serve", "publish", "dlq", "relay", "inbox", "shard"].contains(&first) {
            command.args(self.topology_args());
        }
        command
            .env("DATABASE_URL", &self.database_url)
            .env("NATS_URL", &self.nats_url)
            // The health listener is on by default at a fixed port; tests run many processes
            // at once, so each takes a free one unless it names its own (the flag wins).
            .env("INVENTORY_METRICS_ADDR", "127.0.0.1:0")
            .env("RUST_LOG", self.log_filter);
        command
    }

    /// Runs a command to its end; it must succeed.
    pub fn run(&self, args: &[&str]) -> Output {
        let output = self
            .command(args)
            .output()
            .expect("the inventory binary runs");
        assert!(output.status.success(), "{args:?}: {output:?}");
        output
    }

    /// `inventory stock put`: `book_id` titled `title` with `on_hand` copies.
    pub fn put_stock(&self, book_id: &str, title: &str, on_hand: u32) -> Output {
        let on_hand = on_hand.to_string();
        self.run(&[
            "stock",
            "put",
            "--book-id",
            book_id,
            "--title",
            title,
            "--on-hand",
            &on_hand,
        ])
    }

    /// `inventory publish placed` of one copy of a book nobody stocks: a dead letter once served.
    pub fn publish_for_unknown_book(&self) -> Output {
        let book_id = inventory_domain::BookId::new_v7().to_string();
        self.run(&[
            "publish",
            "placed",
            "--book-id",
            &book_id,
            "--quantity",
            "1",
        ])
    }

    /// The one `int8` `sql` reads from the test's database.
    pub async fn scalar(&self, sql: &str) -> i64 {
        self.db.scalar(sql).await
    }

    /// Starts a command with its output captured, e.g. `serve`.
    pub fn spawn(&self, args: &[&str]) -> Child {
        self.command(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the inventory binary starts")
    }
}

impl Drop for BinaryRun {
    fn drop(&mut self) {
        let nats_url = self.nats_url.clone();
        let streams = [
            self.names.stream.clone(),
            self.names.dlq_stream.clone(),
            self.names.events_stream.clone(),
            jetstream::advisories_stream(&self.names.stream),
        ];
        run_to_end_from_drop(async move {
            if let Ok(client) = jetstream::connect(&nats_url, "test cleanup").await {
                let js = jetstream::context(client);
                for name in &streams {
                    let _ = js.delete_stream(name).await;
                }
            }
        });
    }
}

/// SIGTERM, then the exit status and everything the process printed (SIGKILL after 20 s).
pub fn stop(mut child: Child) -> (std::process::ExitStatus, String) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline && child.try_wait().unwrap().is_none() {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let output = child.wait_with_output().unwrap();
    let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&output.stderr));
    (output.status, text)
}

/// The exit status and output of a command that must end by itself within 30 s; one still
/// running then is killed and the test fails.
pub fn ended(mut child: Child) -> (std::process::ExitStatus, String) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("still running after 30 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let output = child.wait_with_output().unwrap();
    let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&output.stderr));
    (output.status, text)
}

/// A plain HTTP/1.0 GET: (status, body); `None` while nothing listens.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n")?.1.to_owned();
    Some((status, body))
}

/// The value of the sample `name{labels}` in a scrape, 0 when absent.
pub fn sample(scrape: &str, name_and_labels: &str) -> f64 {
    scrape
        .lines()
        .find_map(|line| line.strip_prefix(name_and_labels)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
