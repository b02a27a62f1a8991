//! NATS for the tests.
//!
//! - [`NatsServer`]: a nats-server process of the test's own, with JetStream on a temporary
//!   store, which the test can stop, kill and start again on the same port and store, so its
//!   clients reconnect and its streams survive.
//! - [`NatsCluster`]: three such servers forming a JetStream cluster, for replicated streams.
//! - [`shared_url`]: a server many tests share (`NATS_URL`, the local server, or a container),
//!   for tests that never restart it; [`unique_names`] keeps their streams apart.
//!
//! The binary is `NATS_SERVER_BIN` if set, else `nats-server` on `PATH`, else Debian's
//! `/usr/sbin/nats-server`; a test that needs a version ([`binary_since_2_10`],
//! [`binary_before_2_10`]) looks among those and the current server `scripts/test.sh` installs.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use testcontainers_modules::nats::{Nats, NatsServerCmd};
use testcontainers_modules::testcontainers::runners::AsyncRunner;
use testcontainers_modules::testcontainers::{ContainerAsync, ImageExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::OnceCell;

use crate::process::{free_ports, kill_now, log_tail, on_path, scratch_dir, terminate};

pub const LOCAL_SERVER: &str = "nats://127.0.0.1:4222";

/// Generous: a 2.9 cluster restarted from all nodes down took 13 s to elect its meta leader.
const START_TIMEOUT: Duration = Duration::from_secs(30);
const STOP_GRACE: Duration = Duration::from_secs(10);
/// A first start that fails (another process took a chosen port) is retried on new ports.
const START_ATTEMPTS: usize = 3;

/// The nats-server binary the harness runs.
pub fn server_binary() -> PathBuf {
    if let Some(bin) = std::env::var_os("NATS_SERVER_BIN") {
        return bin.into();
    }
    on_path("nats-server").unwrap_or_else(|| PathBuf::from("/usr/sbin/nats-server"))
}

/// The `(major, minor)` version of the nats-server binary `bin`, from `--version`.
pub fn binary_version(bin: &Path) -> Option<(u32, u32)> {
    let output = Command::new(bin).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    let (_, version) = text.trim().rsplit_once('v')?;
    let mut parts = version.split('.');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// The first of these that runs: `NATS_SERVER_BIN`, `nats-server` on `PATH`, Debian's, and the
/// current server `scripts/test.sh` installs under the workspace's `target/nats-current`.
fn server_binaries() -> Vec<PathBuf> {
    let current =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/nats-current/bin/nats-server");
    std::env::var_os("NATS_SERVER_BIN")
        .map(PathBuf::from)
        .into_iter()
        .chain(on_path("nats-server"))
        .chain([PathBuf::from("/usr/sbin/nats-server"), current])
        .filter(|bin| bin.is_file())
        .collect()
}

/// A nats-server binary of 2.10 or later (stream subject transforms, which sharding needs), or
/// why there is none: the fast tier also runs where `NATS_SERVER_BIN` is Debian's 2.9.10.
pub fn binary_since_2_10() -> Result<PathBuf, String> {
    // scripts/test.sh runs the fast tier twice at once, on the shared server of each version; a
    // test on a server of its own would run the same twice, so one pass leaves it to the other.
    if std::env::var_os("INVENTORY_TESTS_OWN_SERVERS_IN_OTHER_PASS").is_some() {
        return Err("run by the fast tier's other pass, on the same server binary".to_owned());
    }
    server_binaries()
        .into_iter()
        .find(|bin| binary_version(bin).is_some_and(|version| version >= (2, 10)))
        .ok_or_else(|| {
            "no nats-server 2.10 or later (NATS_SERVER_BIN, PATH, target/nats-current; \
             scripts/test.sh installs one)"
                .to_owned()
        })
}

/// A nats-server binary older than 2.10, or why there is none.
pub fn binary_before_2_10() -> Result<PathBuf, String> {
    server_binaries()
        .into_iter()
        .find(|bin| binary_version(bin).is_some_and(|version| version < (2, 10)))
        .ok_or_else(|| "no nats-server older than 2.10 (Debian's is 2.9.10)".to_owned())
}

/// What "ready" means for a starting server.
#[derive(Debug, Clone, Copy)]
enum Ready {
    /// The monitor's `/healthz` answers 200: JetStream is up and, in a cluster, in contact with
    /// a current meta leader.
    JetStream,
    /// JetStream is enabled; used for a cluster node that cannot reach a quorum on its own.
    JetStreamEnabled,
}

enum StartError {
    /// The process ended while starting, most often because a port was taken: worth a retry.
    Exited(String),
    TimedOut(String),
}

impl StartError {
    fn message(self) -> String {
        match self {
            Self::Exited(message) | Self::TimedOut(message) => message,
        }
    }
}

struct ClusterArgs {
    name: String,
    port: u16,
    routes: Vec<u16>,
}

/// A nats-server process of its own on 127.0.0.1, JetStream on, its store in a temporary
/// directory. Dropping it kills the process and removes the directory.
pub struct NatsServer {
    bin: PathBuf,
    dir: PathBuf,
    name: String,
    port: u16,
    monitor_port: u16,
    cluster: Option<ClusterArgs>,
    /// More command-line options, e.g. `--auth TOKEN` or `--tls …`.
    extra_args: Vec<String>,
    /// A configuration file given with `-c`.
    config: Option<PathBuf>,
    child: Option<Child>,
}

impl NatsServer {
    /// Starts a server and waits until it accepts clients and JetStream answers.
    pub async fn start() -> Self {
        Self::start_configured(None, &[]).await
    }

    /// [`NatsServer::start`] with the binary `bin`, e.g. [`binary_since_2_10`]'s.
    pub async fn start_binary(bin: &Path) -> Self {
        Self::start_from(bin, None, &[]).await
    }

    /// [`NatsServer::start`] with more nats-server options (authentication, TLS).
    pub async fn start_with_args(args: &[&str]) -> Self {
        Self::start_configured(None, args).await
    }

    /// Like [`start`](Self::start), with lines of nats-server configuration given to it as a
    /// file (`-c`), for settings that have no flag, e.g. `max_payload: 8MB`. The harness's
    /// flags (ports, name, store) take precedence.
    pub async fn start_with_config(config: &str) -> Self {
        Self::start_configured(Some(config), &[]).await
    }

    /// [`start_with_config`](Self::start_with_config) with the binary `bin`.
    pub async fn start_binary_with_config(bin: &Path, config: &str) -> Self {
        Self::start_from(bin, Some(config), &[]).await
    }

    async fn start_configured(config: Option<&str>, args: &[&str]) -> Self {
        Self::start_from(&server_binary(), config, args).await
    }

    async fn start_from(bin: &Path, config: Option<&str>, args: &[&str]) -> Self {
        let mut failure = String::new();
        for _ in 0..START_ATTEMPTS {
            let [port, monitor_port] = free_ports();
            let name = format!("inventory-test-{port}");
            let mut server = Self::new(name, port, monitor_port, None);
            server.bin = bin.to_owned();
            server.extra_args = args.iter().map(|arg| (*arg).to_owned()).collect();
            if let Some(config) = config {
                let path = server.dir.join("server.conf");
                std::fs::write(&path, config).expect("the server's configuration file");
                server.config = Some(path);
            }
            server.spawn();
            match server.wait_until(Ready::JetStream).await {
                Ok(()) => return server,
                Err(StartError::Exited(message)) => failure = message,
                Err(error) => panic!("{}", error.message()),
            }
        }
        panic!("nats-server did not start in {START_ATTEMPTS} attempts: {failure}");
    }

    fn new(name: String, port: u16, monitor_port: u16, cluster: Option<ClusterArgs>) -> Self {
        Self {
            bin: server_binary(),
            dir: scratch_dir("inventory-nats"),
            name,
            port,
            monitor_port,
            cluster,
            extra_args: Vec::new(),
            config: None,
            child: None,
        }
    }

    /// `nats://127.0.0.1:<port>`; the same across restarts.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server name (`server_name`), as JetStream reports it, e.g. as a stream's leader.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What `nats-server --version` prints, e.g. `nats-server: v2.9.10`.
    pub fn version(&self) -> String {
        let output = Command::new(&self.bin)
            .arg("--version")
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", self.bin.display()));
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    /// Whether the process was started and has not been stopped or killed.
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// SIGTERM, so the server shuts down cleanly; SIGKILL if it has not exited after 10 s.
    pub async fn stop(&mut self) {
        if let Some(child) = self.child.take() {
            terminate(child, STOP_GRACE).await;
        }
    }

    /// SIGSTOP for `pause`, then SIGCONT: the server answers nothing meanwhile, its clients'
    /// connections open, as while its host stalls.
    pub async fn pause(&self, pause: Duration) {
        use nix::sys::signal::{Signal, kill};
        let child = self.child.as_ref().expect("a running server");
        let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("a pid fits in i32"));
        kill(pid, Signal::SIGSTOP).expect("SIGSTOP to nats-server");
        tokio::time::sleep(pause).await;
        kill(pid, Signal::SIGCONT).expect("SIGCONT to nats-server");
    }

    /// SIGKILL: the server dies at once, as in a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            kill_now(&mut child);
        }
    }

    /// Starts the stopped (or killed) server again on the same port and store, and waits until
    /// it is ready: clients reconnect to the same URL and find their streams.
    pub async fn start_again(&mut self) {
        self.restart(Ready::JetStream).await;
    }

    async fn restart(&mut self, ready: Ready) {
        assert!(
            self.child.is_none(),
            "nats-server {} is running: stop or kill it first",
            self.name
        );
        self.spawn();
        if let Err(error) = self.wait_until(ready).await {
            panic!("{}", error.message());
        }
    }

    fn spawn(&mut self) {
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("the server's log file");
        let mut command = Command::new(&self.bin);
        if let Some(config) = &self.config {
            command.arg("-c").arg(config);
        }
        command
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string()])
            .args(["-m", &self.monitor_port.to_string()])
            .args(["-n", &self.name, "-js", "-sd"])
            .arg(self.dir.join("store"));
        if let Some(cluster) = &self.cluster {
            let routes: Vec<String> = cluster
                .routes
                .iter()
                .map(|port| format!("nats://127.0.0.1:{port}"))
                .collect();
            command
                .args(["--cluster_name", &cluster.name])
                .args(["--cluster", &format!("nats://127.0.0.1:{}", cluster.port)])
                .args(["--routes", &routes.join(",")]);
        }
        command
            .args(&self.extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().expect("the log file, again")))
            .stderr(Stdio::from(log));
        let child = command.spawn().unwrap_or_else(|e| {
            panic!(
                "cannot run {}: {e} (install nats-server or set NATS_SERVER_BIN)",
                self.bin.display()
            )
        });
        self.child = Some(child);
    }

    async fn wait_until(&mut self, ready: Ready) -> Result<(), StartError> {
        let path = match ready {
            Ready::JetStream => "/healthz",
            Ready::JetStreamEnabled => "/healthz?js-enabled-only=true",
        };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let child = self.child.as_mut().expect("a spawned server");
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Err(StartError::Exited(format!(
                    "nats-server {} exited with {status} while starting; its log ends:\n{}",
                    self.name,
                    log_tail(&self.log_path(), 20)
                )));
            }
            // The monitor starts before the client listener, so a healthy monitor alone does
            // not prove that clients can connect yet.
            if accepts(self.port).await && http_ok(self.monitor_port, path).await {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(StartError::TimedOut(format!(
                    "nats-server {} was not ready ({path}) within {START_TIMEOUT:?}; its log \
                     ends:\n{}",
                    self.name,
                    log_tail(&self.log_path(), 20)
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("server.log")
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Three nats-servers on 127.0.0.1 routed to each other as one JetStream cluster, each with its
/// own store. Nodes are numbered 0 to 2; a stream with three replicas survives losing one.
pub struct NatsCluster {
    nodes: Vec<NatsServer>,
}

impl NatsCluster {
    pub const SIZE: usize = 3;

    /// Starts the three nodes and waits until every one is in contact with a meta leader, so a
    /// replicated stream can be created at once.
    pub async fn start() -> Self {
        let mut failure = String::new();
        for _ in 0..START_ATTEMPTS {
            let ports: [u16; 3 * Self::SIZE] = free_ports();
            let cluster_ports: Vec<u16> = ports[2 * Self::SIZE..].to_vec();
            let cluster_name = format!("inventory-test-{}", cluster_ports[0]);
            let mut nodes: Vec<NatsServer> = (0..Self::SIZE)
                .map(|i| {
                    let cluster = ClusterArgs {
                        name: cluster_name.clone(),
                        port: cluster_ports[i],
                        routes: cluster_ports
                            .iter()
                            .enumerate()
                            .filter(|&(j, _)| j != i)
                            .map(|(_, &port)| port)
                            .collect(),
                    };
                    let name = format!("{cluster_name}-n{i}");
                    NatsServer::new(name, ports[i], ports[Self::SIZE + i], Some(cluster))
                })
                .collect();
            // All at once: none can be healthy before a majority runs and elects a meta leader.
            for node in &mut nodes {
                node.spawn();
            }
            let mut outcome = Ok(());
            for node in &mut nodes {
                outcome = node.wait_until(Ready::JetStream).await;
                if outcome.is_err() {
                    break;
                }
            }
            match outcome {
                Ok(()) => {
                    let cluster = Self { nodes };
                    cluster.wait_for_placement().await;
                    return cluster;
                }
                Err(StartError::Exited(message)) => failure = message,
                Err(error) => panic!("{}", error.message()),
            }
        }
        panic!("the nats cluster did not start in {START_ATTEMPTS} attempts: {failure}");
    }

    /// Waits until the meta leader places a stream on all three nodes. A node's `/healthz` is
    /// healthy once it is in contact with a meta leader, a moment before that leader counts
    /// every peer online: a replicated stream created then is refused ("no suitable peers for
    /// placement, peer offline", 10005), as the instances of a test starting at once found.
    async fn wait_for_placement(&self) {
        let client = async_nats::connect(self.urls())
            .await
            .expect("connecting to the cluster");
        let js = async_nats::jetstream::new(client);
        let probe = async_nats::jetstream::stream::Config {
            name: "PLACEMENT_PROBE".into(),
            subjects: vec!["placement.probe".into()],
            num_replicas: Self::SIZE,
            ..Default::default()
        };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            match js.create_stream(probe.clone()).await {
                Ok(_) => {
                    js.delete_stream("PLACEMENT_PROBE")
                        .await
                        .expect("deleting the placement probe");
                    return;
                }
                Err(error) => assert!(
                    Instant::now() < deadline,
                    "the cluster placed no stream on its three nodes within {START_TIMEOUT:?}: \
                     {error}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Each node's client URL, node 0 first. async-nats takes the list as it is
    /// (`async_nats::connect(cluster.urls())`) and fails over between them; it does not split
    /// a comma-separated string.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(NatsServer::url).collect()
    }

    pub fn node(&self, index: usize) -> &NatsServer {
        &self.nodes[index]
    }

    /// The index of the node with this server name, e.g. a stream's leader.
    pub fn index_of(&self, server_name: &str) -> Option<usize> {
        self.nodes
            .iter()
            .position(|node| node.name() == server_name)
    }

    pub async fn stop_node(&mut self, index: usize) {
        self.nodes[index].stop().await;
    }

    pub fn kill_node(&mut self, index: usize) {
        self.nodes[index].kill();
    }

    /// Starts a stopped or killed node again on its ports and store. With another node running
    /// it waits until the node is back in the cluster and current; alone it cannot reach a
    /// quorum, so then it waits only for JetStream to be enabled.
    pub async fn start_node_again(&mut self, index: usize) {
        let others_running = self
            .nodes
            .iter()
            .enumerate()
            .any(|(i, node)| i != index && node.is_running());
        let ready = if others_running {
            Ready::JetStream
        } else {
            Ready::JetStreamEnabled
        };
        self.nodes[index].restart(ready).await;
    }
}

/// Whether something accepts TCP connections on 127.0.0.1:`port`.
async fn accepts(port: u16) -> bool {
    let connect = TcpStream::connect(("127.0.0.1", port));
    matches!(
        tokio::time::timeout(Duration::from_secs(1), connect).await,
        Ok(Ok(_))
    )
}

/// A bare HTTP/1.0 GET on 127.0.0.1:`port`: whether the answer's status is 200. Enough for the
/// monitor's health endpoint without an HTTP client dependency.
async fn http_ok(port: u16, path: &str) -> bool {
    let get = async {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).await?;
        let request = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        Ok::<_, std::io::Error>(response)
    };
    match tokio::time::timeout(Duration::from_secs(2), get).await {
        Ok(Ok(response)) => {
            String::from_utf8_lossy(&response).split_whitespace().nth(1) == Some("200")
        }
        _ => false,
    }
}

static SHARED: OnceCell<(String, Option<ContainerAsync<Nats>>)> = OnceCell::const_new();

/// A NATS server with JetStream that tests share, first found of: `NATS_URL`, the local server
/// on 127.0.0.1:4222, or a container started with testcontainers where a Docker engine runs.
/// With none of them the test fails: a NATS test is never skipped quietly. Tests on it keep
/// apart through [`unique_names`] and must not stop it; one that restarts NATS starts a
/// [`NatsServer`] of its own.
pub async fn shared_url() -> String {
    SHARED
        .get_or_init(|| async {
            if let Ok(url) = std::env::var("NATS_URL")
                && !url.is_empty()
            {
                return (url, None);
            }
            if accepts(4222).await {
                return (LOCAL_SERVER.to_owned(), None);
            }
            assert!(
                crate::postgres::docker_engine_runs(),
                "no NATS: set NATS_URL, start nats-server -js on 127.0.0.1:4222 \
                 (scripts/test.sh does), or run a Docker engine for testcontainers"
            );
            let container = Nats::default()
                .with_cmd(&NatsServerCmd::default().with_jetstream())
                .start()
                .await
                .expect("a NATS container");
            let port = container
                .get_host_port_ipv4(4222)
                .await
                .expect("the container's port");
            (format!("nats://127.0.0.1:{port}"), Some(container))
        })
        .await
        .0
        .clone()
}

/// Names for one test's streams, subjects and consumer, so tests running at once on a shared
/// server never touch each other's. All share one suffix, `<label>_<12 hex digits>` (or just the
/// hex digits for an empty label).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestNames {
    /// Lowercase, unique per call.
    pub suffix: String,
    /// `ORDERS_<SUFFIX>`, in place of `ORDERS`.
    pub stream: String,
    /// `t<suffix>.orders`, in place of `orders`: the stream takes `<prefix>.>`.
    pub subject_prefix: String,
    /// `ORDERS_DLQ_<SUFFIX>`, in place of `ORDERS_DLQ`.
    pub dlq_stream: String,
    /// `t<suffix>.dlq`, in place of `dlq`: dead letters go to `<prefix>.<consumer>`.
    pub dlq_subject_prefix: String,
    /// `inventory-reserve-stock-<suffix>`, in place of `inventory-reserve-stock`.
    pub consumer: String,
    /// `INVENTORY_<SUFFIX>`, in place of `INVENTORY`: the outbox relay's stream.
    pub events_stream: String,
    /// `t<suffix>.inventory`, in place of `inventory`: events go to `<prefix>.stock.reserved`.
    pub events_subject_prefix: String,
}

impl TestNames {
    /// The names as the service's [`Topology`](inventory_infra::jetstream::Topology), the
    /// contract's duplicate window, one replica.
    pub fn topology(&self) -> inventory_infra::jetstream::Topology {
        inventory_infra::jetstream::Topology {
            stream: self.stream.clone(),
            subject_prefix: self.subject_prefix.clone(),
            dlq_stream: self.dlq_stream.clone(),
            dlq_subject_prefix: self.dlq_subject_prefix.clone(),
            events_stream: self.events_stream.clone(),
            events_subject_prefix: self.events_subject_prefix.clone(),
            ..inventory_infra::jetstream::Topology::default()
        }
    }

    /// The orders stream's subject filter, `<subject_prefix>.>`.
    pub fn subjects(&self) -> String {
        format!("{}.>", self.subject_prefix)
    }

    pub fn placed_subject(&self) -> String {
        format!("{}.placed", self.subject_prefix)
    }

    pub fn cancelled_subject(&self) -> String {
        format!("{}.cancelled", self.subject_prefix)
    }

    /// The dead-letter stream's subject filter, `<dlq_subject_prefix>.>`.
    pub fn dlq_subjects(&self) -> String {
        format!("{}.>", self.dlq_subject_prefix)
    }

    /// Where `consumer`'s dead letters go.
    pub fn dlq_subject(&self, consumer: &str) -> String {
        format!("{}.{consumer}", self.dlq_subject_prefix)
    }
}

/// Fresh names for one test; `label` (e.g. the test's name) makes them readable in the server's
/// listings. Anything but ASCII letters and digits in it becomes `_`, since `.`, `*`, `>` and
/// spaces have meaning in subjects and are not allowed in stream names.
pub fn unique_names(label: &str) -> TestNames {
    let label: String = label
        .chars()
        .take(24)
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    let random = uuid::Uuid::new_v4().simple().to_string();
    // The first 12 hex digits of a v4 uuid are all random: 48 bits.
    let hex = &random[..12];
    let suffix = if label.is_empty() {
        hex.to_owned()
    } else {
        format!("{label}_{hex}")
    };
    let upper = suffix.to_ascii_uppercase();
    TestNames {
        stream: format!("ORDERS_{upper}"),
        subject_prefix: format!("t{suffix}.orders"),
        dlq_stream: format!("ORDERS_DLQ_{upper}"),
        dlq_subject_prefix: format!("t{suffix}.dlq"),
        consumer: format!("inventory-reserve-stock-{suffix}"),
        events_stream: format!("INVENTORY_{upper}"),
        events_subject_prefix: format!("t{suffix}.inventory"),
        suffix,
    }
}

/// How many messages stream `name` holds now, through `js`.
pub async fn stream_messages(js: &inventory_infra::jetstream::Context, name: &str) -> u64 {
    js.get_stream(name)
        .await
        .expect("the stream exists")
        .info()
        .await
        .expect("its info answers")
        .state
        .messages
}

#[cfg(test)]
mod tests {
    use super::unique_names;

    #[test]
    fn names_are_unique_and_safe_for_subjects_and_streams() {
        let a = unique_names("dead letter.test>*");
        let b = unique_names("dead letter.test>*");
        assert_ne!(a.suffix, b.suffix);
        assert!(a.suffix.starts_with("dead_letter_test___"));
        assert_eq!(
            a.stream,
            format!("ORDERS_{}", a.suffix.to_ascii_uppercase())
        );
        assert_eq!(a.subjects(), format!("t{}.orders.>", a.suffix));
        assert_eq!(
            a.dlq_subject(&a.consumer),
            format!("t{}.dlq.{}", a.suffix, a.consumer)
        );
        assert_eq!(
            a.events_stream,
            format!("INVENTORY_{}", a.suffix.to_ascii_uppercase())
        );
        assert_eq!(a.events_subject_prefix, format!("t{}.inventory", a.suffix));
        for name in [&a.stream, &a.dlq_stream, &a.consumer, &a.events_stream] {
            assert!(!name.contains(['.', '*', '>', ' ']), "{name}");
        }
        assert_eq!(unique_names("").suffix.len(), 12);
    }
}
