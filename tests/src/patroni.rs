//! A PostgreSQL HA pair under Patroni on this one machine, as a shard runs in production: one
//! etcd (Patroni's distributed configuration store), two Patroni nodes each managing a
//! PostgreSQL server, and HAProxy in front sending connections to whichever node Patroni says
//! is the primary. Killing the leader's host makes Patroni promote the other node and HAProxy
//! follow, with nobody switching anything by hand.
//!
//! The binaries come from `PATRONI` and `ETCD` if set, else `patroni` and `etcd` on `PATH`
//! (Debian's `patroni` and `etcd-server` packages, which `scripts/test.sh` installs); the
//! PostgreSQL server binaries as in [`crate::pg_server`]. Debian's Patroni speaks etcd's v2 API,
//! so etcd runs with it enabled. PostgreSQL refuses to run as root, so as root Patroni runs as
//! the `postgres` OS user, in directories that user owns.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::haproxy::HaProxy;
use crate::pg_server::{
    as_root, bin_dir, children_of, hand_to_postgres, kill_postmaster, postgres_user, postmaster_pid,
};
use crate::process::{free_ports, kill_now, log_tail, on_path, scratch_dir, until_port_refuses};

/// The nodes' names, which are also their `application_name` as standbys.
const NODES: [&str; 2] = ["node_a", "node_b"];
/// How long bootstrapping may take: etcd, `initdb` on one node, `pg_basebackup` on the other,
/// the first leader election and the standby turning synchronous.
const START_TIMEOUT: Duration = Duration::from_secs(90);
/// Patroni's leader lease: the leader renews it every `loop_wait`; a standby takes over once
/// it expires. These are the smallest values Patroni accepts
/// (`loop_wait + 2 * retry_timeout <= ttl`), so a failover takes at most about `TTL`.
const TTL: u32 = 10;
const LOOP_WAIT: u32 = 2;
const RETRY_TIMEOUT: u32 = 4;

/// One etcd, two Patroni nodes and HAProxy, all of the test's own (own ports, own scratch
/// directory); every process killed and the directory removed on drop.
///
/// Replication is synchronous (`synchronous_mode: true`): a commit returns only once the
/// standby has flushed it, and Patroni fails over only to the standby it lists as synchronous,
/// so an acknowledged commit survives the leader's death. `synchronous_mode_strict` is off:
/// when the standby dies, the leader drops it from `synchronous_standby_names` and keeps
/// taking writes alone, and while it does no automatic failover happens until the standby has
/// caught up and is synchronous again. Strict mode would instead refuse every write while
/// either node of the pair is down, the new leader after a failover included, which makes a
/// two-node shard unwritable for as long as its dead node takes to rebuild.
pub struct PatroniPair {
    proxy: Option<HaProxy>,
    nodes: Vec<Node>,
    etcd: Option<Child>,
    /// A standby's WAL receiver stopped by [`Self::cut_off_standby`], SIGKILLed with the
    /// leader so that nothing the kernel still buffers for it reaches the standby.
    stopped_receiver: Option<Pid>,
    /// Holds etcd's data, each node's directory (data, configuration, socket, log) and logs.
    dir: PathBuf,
    time_to_ready: Duration,
}

struct Node {
    name: &'static str,
    pg_port: u16,
    rest_port: u16,
    dir: PathBuf,
    patroni: Option<Child>,
}

impl PatroniPair {
    /// Starts etcd, both Patroni nodes and HAProxy, and waits (up to 90 s) until HAProxy leads
    /// to a primary that accepts writes and the other node streams from it as its synchronous
    /// standby.
    pub async fn start() -> Self {
        let started = Instant::now();
        // Built first and filled in, so a start that fails half-way is cleaned up by Drop.
        let mut pair = Self {
            proxy: None,
            nodes: Vec::new(),
            etcd: None,
            stopped_receiver: None,
            dir: scratch_dir("inventory-patroni"),
            time_to_ready: Duration::ZERO,
        };
        hand_to_postgres(&pair.dir);
        let [etcd_client, etcd_peer, pg_a, rest_a, pg_b, rest_b] = free_ports();
        pair.etcd = Some(start_etcd(&pair.dir, etcd_client, etcd_peer).await);
        for (name, pg_port, rest_port) in [(NODES[0], pg_a, rest_a), (NODES[1], pg_b, rest_b)] {
            let dir = pair.dir.join(name);
            std::fs::create_dir(&dir).expect("a node's directory");
            hand_to_postgres(&dir);
            pair.nodes.push(Node {
                name,
                pg_port,
                rest_port,
                dir,
                patroni: None,
            });
            let node = pair.nodes.last_mut().expect("just pushed");
            node.start_patroni(etcd_client);
        }
        let servers: Vec<(&str, u16, u16)> = pair
            .nodes
            .iter()
            .map(|node| (node.name, node.pg_port, node.rest_port))
            .collect();
        pair.proxy = Some(HaProxy::start_following_patroni(&servers).await);
        pair.wait_until_ready().await;
        pair.time_to_ready = started.elapsed();
        pair
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres`, through HAProxy.
    pub fn url(&self) -> String {
        self.proxy().url()
    }

    /// A node's own server, bypassing HAProxy.
    pub fn node_url(&self, name: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres",
            self.node(name).pg_port
        )
    }

    /// From the start to the pair being ready: etcd, bootstrap, election, sync standby.
    pub fn time_to_ready(&self) -> Duration {
        self.time_to_ready
    }

    /// The node whose Patroni answers `GET /primary` with 200 (as HAProxy's check asks), if
    /// exactly one does.
    pub async fn leader(&self) -> Option<&'static str> {
        let mut leaders = Vec::new();
        for node in &self.nodes {
            if node.patroni.is_some() && node.is_primary().await {
                leaders.push(node.name);
            }
        }
        match leaders[..] {
            [leader] => Some(leader),
            _ => None,
        }
    }

    /// Waits (up to `within`) until a node other than `old` leads, and returns it.
    pub async fn wait_for_leader_other_than(&self, old: &str, within: Duration) -> &'static str {
        let deadline = Instant::now() + within;
        loop {
            match self.leader().await {
                Some(leader) if leader != old => return leader,
                _ => assert!(
                    Instant::now() < deadline,
                    "no node but {old} led within {within:?}\n{}",
                    self.logs()
                ),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The leader's host dying: SIGKILL to its Patroni (else it would start PostgreSQL again
    /// in place, still holding the leader lease) and then to its postmaster and every backend.
    /// Returns the killed node's name once its port refuses connections.
    pub async fn kill_leader(&mut self) -> &'static str {
        let leader = self.leader().await.expect("a leader to kill");
        let node = self.node_mut(leader);
        if let Some(mut patroni) = node.patroni.take() {
            kill_now(&mut patroni);
        }
        if let Some(postmaster) = postmaster_pid(&node.dir.join("data")) {
            kill_postmaster(postmaster);
        }
        if let Some(receiver) = self.stopped_receiver.take() {
            // The standby's postmaster takes this as a crash and restarts in recovery from
            // what the receiver had written; what it had not read is gone with the socket.
            let _ = kill(receiver, Signal::SIGKILL);
        }
        until_port_refuses(self.node(leader).pg_port, leader).await;
        leader
    }

    /// The deliberate bug: replication made asynchronous (`synchronous_mode: false` through
    /// Patroni's `PATCH /config`, and any lag allowed at failover) and the standby's WAL
    /// receiver stopped (SIGSTOP), so the leader acknowledges commits the standby never gets
    /// and Patroni still promotes it when the leader dies. [`Self::kill_leader`] SIGKILLs the
    /// stopped receiver after the leader.
    pub async fn cut_off_standby(&mut self) {
        let leader = self.leader().await.expect("a leader");
        let standby = self.other_than(leader);
        let body = r#"{"synchronous_mode": false, "maximum_lag_on_failover": 1073741824}"#;
        let answer = http(self.node(leader).rest_port, "PATCH", "/config", body).await;
        assert!(
            matches!(answer, Some((200, _))),
            "Patroni refused PATCH /config: {answer:?}"
        );
        // Patroni clears synchronous_standby_names on its next loop; until then the stopped
        // receiver would hold every commit.
        self.wait_for_standby_state(leader, standby, "async").await;
        let postmaster = postmaster_pid(&self.node(standby).dir.join("data"))
            .unwrap_or_else(|| panic!("{standby} runs no PostgreSQL"));
        let receiver = children_of(postmaster)
            .into_iter()
            .find(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|cmdline| cmdline.contains("walreceiver"))
            })
            .unwrap_or_else(|| panic!("{standby} has no WAL receiver"));
        kill(receiver, Signal::SIGSTOP).expect("SIGSTOP to the WAL receiver");
        self.stopped_receiver = Some(receiver);
    }

    /// The other node's name.
    pub fn other_than(&self, name: &str) -> &'static str {
        self.nodes
            .iter()
            .find(|node| node.name != name)
            .expect("two nodes")
            .name
    }

    async fn wait_until_ready(&mut self) {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            // A Patroni that could not start (its port taken, a bad configuration) exits.
            let exited = self.nodes.iter_mut().find_map(|node| {
                let status = node.patroni.as_mut()?.try_wait().ok()??;
                Some((node.name, status))
            });
            if let Some((name, status)) = exited {
                panic!("{name}'s Patroni exited: {status}\n{}", self.logs());
            }
            if let Some(leader) = self.leader().await {
                let standby = self.other_than(leader);
                if self.proxy().servers_up().await == [leader]
                    && self.standby_state(leader, standby).await.as_deref() == Some("sync")
                    && accepts_writes(&self.url()).await
                {
                    return;
                }
            }
            if Instant::now() > deadline {
                panic!(
                    "the Patroni pair was not ready within {START_TIMEOUT:?} (a leader, HAProxy \
                     leading to it, a synchronous standby, a write through HAProxy)\n{}",
                    self.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn wait_for_standby_state(&self, leader: &str, standby: &str, state: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.standby_state(leader, standby).await.as_deref() != Some(state) {
            assert!(
                Instant::now() < deadline,
                "{standby} did not become {state} on {leader} within 30 s\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `sync_state` of `standby` streaming from `leader`, per the leader's
    /// `pg_stat_replication`.
    async fn standby_state(&self, leader: &str, standby: &str) -> Option<String> {
        let db = connect(&self.node_url(leader)).await?;
        let sql = Statement::from_sql_and_values(
            DbBackend::Postgres,
            "SELECT sync_state AS v FROM pg_stat_replication \
             WHERE application_name = $1 AND state = 'streaming'",
            [standby.into()],
        );
        let row = db.query_one_raw(sql).await.ok().flatten();
        let _ = db.close().await;
        row?.try_get::<String>("", "v").ok()
    }

    /// The end of every process's log, for a failure message.
    pub fn logs(&self) -> String {
        let mut text = format!(
            "etcd's log ends:\n{}",
            log_tail(&self.dir.join("etcd.log"), 10)
        );
        for node in &self.nodes {
            text += &format!(
                "\n{}'s log (Patroni and PostgreSQL) ends:\n{}",
                node.name,
                log_tail(&node.log(), 20)
            );
        }
        text
    }

    fn proxy(&self) -> &HaProxy {
        self.proxy.as_ref().expect("HAProxy started")
    }

    fn node(&self, name: &str) -> &Node {
        self.nodes
            .iter()
            .find(|node| node.name == name)
            .unwrap_or_else(|| panic!("no node {name}"))
    }

    fn node_mut(&mut self, name: &str) -> &mut Node {
        self.nodes
            .iter_mut()
            .find(|node| node.name == name)
            .unwrap_or_else(|| panic!("no node {name}"))
    }
}

impl Drop for PatroniPair {
    fn drop(&mut self) {
        self.proxy = None;
        if let Some(receiver) = self.stopped_receiver.take() {
            let _ = kill(receiver, Signal::SIGKILL);
        }
        for node in &mut self.nodes {
            // Patroni first, or it would start PostgreSQL again. A node without one was
            // killed already: its postmaster.pid is stale and its pid may be another's now.
            if let Some(mut patroni) = node.patroni.take() {
                kill_now(&mut patroni);
                if let Some(postmaster) = postmaster_pid(&node.dir.join("data")) {
                    kill_postmaster(postmaster);
                }
            }
        }
        if let Some(mut etcd) = self.etcd.take() {
            kill_now(&mut etcd);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Node {
    fn start_patroni(&mut self, etcd_port: u16) {
        let config = self.dir.join("patroni.yml");
        std::fs::write(&config, self.config(etcd_port))
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", config.display()));
        let log = File::create(self.log()).expect("a node's log file");
        let mut command = Command::new(binary("PATRONI", "patroni"));
        command
            .arg(&config)
            .current_dir(&self.dir)
            .env("HOME", &self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().expect("the log file")))
            .stderr(Stdio::from(log));
        if as_root() {
            // Set in the child rather than through runuser, so the child is Patroni itself
            // and a SIGKILL to it is the host's death, not runuser's.
            use std::os::unix::process::CommandExt as _;
            let user = postgres_user();
            command.uid(user.uid.as_raw()).gid(user.gid.as_raw());
        }
        self.patroni = Some(
            command
                .spawn()
                .unwrap_or_else(|e| panic!("cannot run patroni: {e}")),
        );
    }

    /// Patroni's configuration. The `bootstrap.dcs` part is written to etcd by the node that
    /// bootstraps the cluster and then holds for both.
    fn config(&self, etcd_port: u16) -> String {
        let dir = self.dir.display();
        let (name, pg, rest) = (self.name, self.pg_port, self.rest_port);
        let bin = bin_dir();
        format!(
            r"scope: inventory
name: {name}
restapi:
  listen: 127.0.0.1:{rest}
  connect_address: 127.0.0.1:{rest}
etcd:
  host: 127.0.0.1:{etcd_port}
bootstrap:
  dcs:
    ttl: {TTL}
    loop_wait: {LOOP_WAIT}
    retry_timeout: {RETRY_TIMEOUT}
    synchronous_mode: true
    synchronous_mode_strict: false
    postgresql:
      use_pg_rewind: false
      parameters:
        max_connections: 40
  initdb:
    - encoding: UTF8
    - locale: C
    - auth: trust
    - no-sync
  pg_hba:
    - local all all trust
    - host all all 127.0.0.1/32 trust
    - host replication all 127.0.0.1/32 trust
postgresql:
  listen: 127.0.0.1:{pg}
  connect_address: 127.0.0.1:{pg}
  data_dir: {dir}/data
  bin_dir: {bin}
  pgpass: {dir}/pgpass
  basebackup:
    - checkpoint: fast
  authentication:
    superuser:
      username: postgres
      password: postgres
    replication:
      username: replicator
      password: replicator
  parameters:
    unix_socket_directories: '{dir}'
    shared_buffers: 16MB
",
            bin = bin.display()
        )
    }

    async fn is_primary(&self) -> bool {
        matches!(
            http(self.rest_port, "GET", "/primary", "").await,
            Some((200, _))
        )
    }

    fn log(&self) -> PathBuf {
        self.dir.join("patroni.log")
    }
}

async fn start_etcd(dir: &Path, client: u16, peer: u16) -> Child {
    let log = dir.join("etcd.log");
    let file = File::create(&log).expect("etcd's log file");
    let client_url = format!("http://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let mut etcd = Command::new(binary("ETCD", "etcd"))
        .args(["--name", "etcd", "--data-dir"])
        .arg(dir.join("etcd"))
        .args(["--listen-client-urls", &client_url])
        .args(["--advertise-client-urls", &client_url])
        .args(["--listen-peer-urls", &peer_url])
        .args(["--initial-advertise-peer-urls", &peer_url])
        .args(["--initial-cluster", &format!("etcd={peer_url}")])
        .arg("--enable-v2=true")
        .stdin(Stdio::null())
        .stdout(Stdio::from(file.try_clone().expect("the log file")))
        .stderr(Stdio::from(file))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run etcd: {e}"));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(Some(status)) = etcd.try_wait() {
            panic!("etcd exited: {status}\n{}", log_tail(&log, 20));
        }
        // The v2 API Patroni uses, not only the server.
        if matches!(http(client, "GET", "/v2/keys", "").await, Some((200, _))) {
            return etcd;
        }
        if Instant::now() > deadline {
            kill_now(&mut etcd);
            panic!("etcd did not answer within 20 s\n{}", log_tail(&log, 20));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether a transaction id can be assigned through `url`: a standby refuses.
async fn accepts_writes(url: &str) -> bool {
    let Some(db) = connect(url).await else {
        return false;
    };
    let wrote = tokio::time::timeout(
        Duration::from_secs(5),
        db.execute_unprepared("SELECT txid_current()"),
    )
    .await
    .is_ok_and(|result| result.is_ok());
    let _ = db.close().await;
    wrote
}

/// One connection, or `None` if none comes within 5 s.
pub async fn connect(url: &str) -> Option<DatabaseConnection> {
    tokio::time::timeout(
        Duration::from_secs(5),
        inventory_benches::db::connect(url, 1),
    )
    .await
    .ok()?
    .ok()
}

/// One HTTP/1.0 exchange with 127.0.0.1:`port`: the status and the body, or `None` if it
/// failed or took over 2 s.
async fn http(port: u16, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    let exchange = async {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
        let request = format!(
            "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await.ok()?;
        let status = response.split_whitespace().nth(1)?.parse().ok()?;
        let body = response.split_once("\r\n\r\n")?.1.to_owned();
        Some((status, body))
    };
    tokio::time::timeout(Duration::from_secs(2), exchange)
        .await
        .ok()
        .flatten()
}

/// The binary named by the environment variable `variable`, else `name` on `PATH`.
fn binary(variable: &str, name: &str) -> PathBuf {
    std::env::var_os(variable)
        .map(PathBuf::from)
        .or_else(|| on_path(name))
        .unwrap_or_else(|| {
            panic!(
                "no {name}: install Debian's patroni and etcd-server packages (scripts/test.sh \
                 does) or set {variable}"
            )
        })
}
