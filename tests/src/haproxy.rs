//! HAProxy in front of PostgreSQL servers, as a platform runs it for a failover: one TCP
//! listener, a backend that lists every server with all but the current primary disabled, and
//! the switch to another server made over HAProxy's runtime API (its admin socket), the way an
//! operator's runbook or a failover script makes it. Or, in front of a Patroni pair, a backend
//! whose health check asks each node's Patroni REST API whether it is the primary, so HAProxy
//! follows a failover on its own.
//!
//! The binary comes from `HAPROXY` if set, else `haproxy` on `PATH` or in `/usr/sbin`
//! (Debian's `haproxy` package, which `scripts/test.sh` installs).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::process::{free_ports, kill_now, log_tail, on_path, scratch_dir};

/// The name of HAProxy's section (frontend and backend in one) for PostgreSQL.
const SECTION: &str = "postgres";
/// A first start whose port was taken meanwhile is retried on another.
const START_ATTEMPTS: usize = 3;

/// An HAProxy process of the test's own on 127.0.0.1; killed and its directory removed on
/// drop.
pub struct HaProxy {
    child: Option<Child>,
    /// Holds the configuration, the admin socket and the log.
    dir: PathBuf,
    port: u16,
    servers: Vec<String>,
    routing: Routing,
}

/// How HAProxy picks the server a new connection goes to.
enum Routing {
    /// The first server; the others are disabled until [`HaProxy::switch_to`].
    Switched,
    /// Whichever server's Patroni REST API, on the port at the same index, answers
    /// `GET /primary` with 200.
    PatroniPrimary(Vec<u16>),
}

impl HaProxy {
    /// Starts HAProxy forwarding to the first of `servers` (name, port on 127.0.0.1); the
    /// others are listed disabled, ready for [`Self::switch_to`].
    pub async fn start(servers: &[(&str, u16)]) -> Self {
        Self::start_routed(servers, Routing::Switched).await
    }

    /// Starts HAProxy forwarding to whichever of `servers` (name, PostgreSQL port, Patroni
    /// REST port) Patroni says is the primary, checked every 500 ms; a server marked down has
    /// its sessions cut, so no client keeps writing to a demoted node.
    pub async fn start_following_patroni(servers: &[(&str, u16, u16)]) -> Self {
        let postgres: Vec<(&str, u16)> = servers.iter().map(|(name, pg, _)| (*name, *pg)).collect();
        let rest = servers.iter().map(|(_, _, rest)| *rest).collect();
        Self::start_routed(&postgres, Routing::PatroniPrimary(rest)).await
    }

    async fn start_routed(servers: &[(&str, u16)], routing: Routing) -> Self {
        assert!(!servers.is_empty(), "a backend needs a server");
        let mut proxy = Self {
            child: None,
            dir: scratch_dir("inventory-haproxy"),
            port: 0,
            servers: servers.iter().map(|(name, _)| (*name).to_owned()).collect(),
            routing,
        };
        let mut failure = String::new();
        for _ in 0..START_ATTEMPTS {
            let [port] = free_ports();
            proxy.port = port;
            match proxy.spawn(servers).await {
                Ok(()) => return proxy,
                Err(message) => failure = message,
            }
        }
        panic!("HAProxy did not start in {START_ATTEMPTS} attempts: {failure}");
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres`, through the proxy.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// From now on every new connection goes to `name`: every other server is put in
    /// maintenance and its sessions are cut (a primary that is only cut off, not dead, must
    /// not keep taking writes), then `name` is enabled.
    pub async fn switch_to(&self, name: &str) {
        assert!(
            self.servers.iter().any(|server| server == name),
            "no server {name} in {:?}",
            self.servers
        );
        let mut commands: Vec<String> = self
            .servers
            .iter()
            .filter(|server| *server != name)
            .flat_map(|server| {
                [
                    format!("disable server {SECTION}/{server}"),
                    format!("shutdown sessions server {SECTION}/{server}"),
                ]
            })
            .collect();
        commands.push(format!("enable server {SECTION}/{name}"));
        let answer = self.command(&commands.join("; ")).await;
        // These commands answer nothing when they succeed.
        assert!(
            answer.trim().is_empty(),
            "HAProxy refused the switch to {name}: {answer}"
        );
    }

    /// The servers HAProxy's health checks currently hold up (status `UP`), from `show stat`.
    pub async fn servers_up(&self) -> Vec<String> {
        let stat = self.command("show stat").await;
        // CSV: proxy name, server name, … with the status in the 18th column.
        stat.lines()
            .filter_map(|line| {
                let fields: Vec<&str> = line.split(',').collect();
                let is_server = fields.first() == Some(&SECTION)
                    && self
                        .servers
                        .iter()
                        .any(|name| Some(&name.as_str()) == fields.get(1));
                (is_server && fields.get(17) == Some(&"UP")).then(|| fields[1].to_owned())
            })
            .collect()
    }

    /// One line of the runtime API (commands separated by `;`) and HAProxy's answer.
    pub async fn command(&self, line: &str) -> String {
        let exchange = async {
            let mut socket = UnixStream::connect(self.socket()).await?;
            socket.write_all(format!("{line}\n").as_bytes()).await?;
            socket.shutdown().await?;
            let mut answer = String::new();
            socket.read_to_string(&mut answer).await?;
            Ok::<_, std::io::Error>(answer)
        };
        tokio::time::timeout(Duration::from_secs(10), exchange)
            .await
            .unwrap_or_else(|_| panic!("HAProxy did not answer `{line}` within 10 s"))
            .unwrap_or_else(|e| panic!("HAProxy's admin socket, `{line}`: {e}"))
    }

    async fn spawn(&mut self, servers: &[(&str, u16)]) -> Result<(), String> {
        let config = self.dir.join("haproxy.cfg");
        std::fs::write(&config, self.config(servers))
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", config.display()));
        let log = self.dir.join("haproxy.log");
        let file = File::create(&log).expect("HAProxy's log file");
        // -db: in the foreground, so the child is HAProxy itself and dies with the test.
        let child = Command::new(binary())
            .arg("-f")
            .arg(&config)
            .arg("-db")
            .stdin(Stdio::null())
            .stdout(Stdio::from(file.try_clone().expect("the log file")))
            .stderr(Stdio::from(file))
            .spawn()
            .map_err(|e| format!("cannot run haproxy: {e}"))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let child = self.child.as_mut().expect("just spawned");
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Err(format!("haproxy exited: {status}\n{}", log_tail(&log, 20)));
            }
            if UnixStream::connect(self.socket()).await.is_ok()
                && tokio::net::TcpStream::connect(("127.0.0.1", self.port))
                    .await
                    .is_ok()
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                self.stop();
                return Err(format!(
                    "haproxy did not listen within 10 s\n{}",
                    log_tail(&log, 20)
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The configuration: TCP passthrough, a health check every 500 ms that marks a dead
    /// server down within a second and cuts its sessions, and idle timeouts longer than a
    /// connection pool keeps an idle connection.
    fn config(&self, servers: &[(&str, u16)]) -> String {
        let mut lines = vec![
            "global".to_owned(),
            format!(
                "    stats socket {} mode 600 level admin",
                self.socket().display()
            ),
            "defaults".to_owned(),
            "    mode tcp".to_owned(),
            "    timeout connect 2s".to_owned(),
            "    timeout client 30m".to_owned(),
            "    timeout server 30m".to_owned(),
            format!("listen {SECTION}"),
            format!("    bind 127.0.0.1:{}", self.port),
            "    default-server inter 500ms fall 2 rise 1 on-marked-down shutdown-sessions"
                .to_owned(),
        ];
        match &self.routing {
            Routing::Switched => {
                for (at, (name, port)) in servers.iter().enumerate() {
                    let disabled = if at == 0 { "" } else { " disabled" };
                    lines.push(format!(
                        "    server {name} 127.0.0.1:{port} check{disabled}"
                    ));
                }
            }
            Routing::PatroniPrimary(rest_ports) => {
                lines.push("    option httpchk GET /primary".to_owned());
                lines.push("    http-check expect status 200".to_owned());
                for ((name, port), rest) in servers.iter().zip(rest_ports) {
                    lines.push(format!(
                        "    server {name} 127.0.0.1:{port} check port {rest}"
                    ));
                }
            }
        }
        lines.push(String::new());
        lines.join("\n")
    }

    fn socket(&self) -> PathBuf {
        self.dir.join("admin.sock")
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            kill_now(&mut child);
        }
    }
}

impl Drop for HaProxy {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn binary() -> PathBuf {
    if let Some(path) = std::env::var_os("HAPROXY") {
        return path.into();
    }
    on_path("haproxy")
        .or_else(|| Some(Path::new("/usr/sbin/haproxy").to_path_buf()).filter(|p| p.is_file()))
        .expect(
            "no haproxy: install Debian's haproxy package (scripts/test.sh does) or set HAPROXY",
        )
}
