//! `inventory serve` as a process of a scenario: its own streams, consumer and database, its
//! log in a file, SIGKILL and restart at will.

use std::fs::File;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream::context::Context;
use inventory_infra::jetstream::{self, Topology};
use inventory_tests::nats::{TestNames, unique_names};
use inventory_tests::workload;
use nix::sys::signal::Signal;
use tokio::task::JoinHandle;

pub(crate) use inventory_tests::binary::inventory as binary;

/// Where a scenario's instances run: database, NATS, names; their logs go to a scratch
/// directory, removed when the scenario ends unless the test failed.
pub(crate) struct Scenario {
    pub(crate) names: TestNames,
    pub(crate) topology: Topology,
    pub(crate) database_url: String,
    pub(crate) nats_url: String,
    pub(crate) logs: PathBuf,
    /// Extra `serve` flags for every instance.
    pub(crate) serve_args: Vec<String>,
    pub(crate) rust_log: String,
}

impl Scenario {
    pub(crate) fn new(label: &str, database_url: &str, nats_url: &str, replicas: usize) -> Self {
        let names = unique_names(label);
        let topology = Topology {
            stream: names.stream.clone(),
            subject_prefix: names.subject_prefix.clone(),
            dlq_stream: names.dlq_stream.clone(),
            dlq_subject_prefix: names.dlq_subject_prefix.clone(),
            duplicate_window: Duration::from_secs(120),
            replicas,
        };
        let logs = std::env::temp_dir().join(format!("inventory-{}", names.suffix));
        std::fs::create_dir_all(&logs).unwrap();
        Self {
            names,
            topology,
            database_url: database_url.to_owned(),
            nats_url: nats_url.to_owned(),
            logs,
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
        let (js, topology, sends) = (js.clone(), self.topology.clone(), sends.to_vec());
        tokio::spawn(
            async move { workload::publish(&js, &topology, &sends, 64, chunk, pause).await },
        )
    }

    /// Starts `inventory serve --strategy natural` on the scenario's consumer.
    pub(crate) fn spawn(&self, label: &str) -> Instance {
        let log = self.logs.join(format!("{label}.log"));
        let file = File::options()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let topology = &self.topology;
        let mut command = Command::new(binary());
        command
            .args(["serve", "--strategy", "natural"])
            .args(["--consumer", &self.names.consumer])
            .args(["--stream", &topology.stream])
            .args(["--subject-prefix", &topology.subject_prefix])
            .args(["--dlq-stream", &topology.dlq_stream])
            .args(["--dlq-subject-prefix", &topology.dlq_subject_prefix])
            .args(["--replicas", &topology.replicas.to_string()])
            // Short: a killed instance's unacked messages come back quickly.
            .args(["--ack-wait", "2s"])
            // Many kills can hit one message; a max-deliveries dead letter would be a loss.
            .args(["--max-deliver", "100"])
            .args(["--retry-delay", "200ms", "--max-retry-delay", "2s"])
            .args(&self.serve_args)
            .env("DATABASE_URL", &self.database_url)
            .env("NATS_URL", &self.nats_url)
            .env("RUST_LOG", &self.rust_log)
            .stdin(Stdio::null())
            .stdout(Stdio::from(file.try_clone().unwrap()))
            .stderr(Stdio::from(file));
        Instance {
            child: Some(command.spawn().unwrap()),
            label: label.to_owned(),
        }
    }

    /// Lines of all instances' logs that contain `text`: evidence that a fault was felt.
    pub(crate) fn log_lines_with(&self, text: &str) -> usize {
        std::fs::read_dir(&self.logs)
            .unwrap()
            .flatten()
            .map(|entry| {
                std::fs::read_to_string(entry.path())
                    .unwrap_or_default()
                    .lines()
                    .filter(|line| line.contains(text))
                    .count()
            })
            .sum()
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
        } else {
            eprintln!("instance logs kept in {}", self.logs.display());
        }
    }
}

/// One `inventory serve` process.
pub(crate) struct Instance {
    child: Option<Child>,
    pub(crate) label: String,
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
