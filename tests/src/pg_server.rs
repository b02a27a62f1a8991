//! A PostgreSQL cluster of the test's own, for tests that stop and start the database under a
//! running consumer without disturbing the tests that share the local server; or a pair of
//! them, a primary and its synchronous standby, for a failover.
//!
//! The server binaries come from `PG_BIN_DIR` if set, else the highest version under
//! `/usr/lib/postgresql/<version>/bin` (Debian's `postgresql` package), else the directory of
//! `pg_ctl` on `PATH`. PostgreSQL refuses to run as root, so as root they run as the `postgres`
//! OS user through `runuser`, in a directory that user owns.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, Statement, TryGetable};

use crate::process::{free_ports, log_tail, on_path, scratch_dir, until_port_refuses};

const DEBIAN_BINARIES: &str = "/usr/lib/postgresql";
/// A first start whose port was taken meanwhile is retried on another.
const START_ATTEMPTS: usize = 3;

/// A PostgreSQL server on 127.0.0.1 with its own data directory (trust authentication, user
/// `postgres`). Dropping it stops the server at once and removes the directory.
pub struct PostgresServer {
    bin_dir: PathBuf,
    /// Holds `data/`, the server's log and its Unix socket.
    dir: PathBuf,
    port: u16,
    running: bool,
}

impl PostgresServer {
    /// Creates a new cluster with `initdb` and starts it.
    pub async fn start() -> Self {
        let server = Self::initdb().await;
        server.start_on_a_free_port().await
    }

    /// A primary whose every commit waits until the standby that connects as `standby` (its
    /// `application_name`) has flushed it: streaming replication with `synchronous_commit`
    /// on, so a commit the client saw succeed is on both servers. `initdb`'s defaults already
    /// let a local replication connection in (`wal_level = replica`, `max_wal_senders`, the
    /// `replication` lines of `pg_hba.conf`); they are restated here for the reader.
    pub async fn start_primary(standby: &str) -> Self {
        let server = Self::initdb().await;
        server.append_to_config(&[
            "# A primary with one synchronous standby.",
            "wal_level = replica",
            "max_wal_senders = 4",
            "synchronous_commit = on",
            &format!("synchronous_standby_names = '{standby}'"),
        ]);
        server.start_on_a_free_port().await
    }

    /// A hot standby of `primary`, copied with `pg_basebackup -R` (which writes
    /// `standby.signal` and a `primary_conninfo` naming `name` as the `application_name`) and
    /// streaming from it. Its configuration is the primary's copy, `synchronous_standby_names`
    /// included, which matters once it is promoted (see [`Self::promote`]).
    pub async fn start_standby(primary: &Self, name: &str) -> Self {
        let server = Self::scratch();
        let source = format!(
            "host=127.0.0.1 port={} user=postgres application_name={name}",
            primary.port
        );
        let data = server.data_dir();
        let output = server
            .run(
                "pg_basebackup",
                &[
                    "-d",
                    &source,
                    "-D",
                    &data,
                    "-R",
                    "-X",
                    "stream",
                    "--no-sync",
                ],
            )
            .await;
        assert!(
            output.status.success(),
            "pg_basebackup failed: {}",
            describe(&output)
        );
        server.start_on_a_free_port().await
    }

    /// An empty cluster, not started.
    async fn initdb() -> Self {
        let server = Self::scratch();
        let data = server.data_dir();
        // --no-sync: initdb's closing fsync of every file is most of its time, and a test
        // cluster need not survive a power cut.
        let output = server
            .run(
                "initdb",
                &[
                    "-D",
                    &data,
                    "-A",
                    "trust",
                    "-U",
                    "postgres",
                    "-E",
                    "UTF8",
                    "--locale=C",
                    "--no-sync",
                ],
            )
            .await;
        assert!(
            output.status.success(),
            "initdb failed: {}",
            describe(&output)
        );
        server
    }

    /// A scratch directory the server binaries may write to, no cluster in it yet.
    fn scratch() -> Self {
        let server = Self {
            bin_dir: bin_dir(),
            dir: scratch_dir("inventory-pg"),
            port: 0,
            running: false,
        };
        hand_to_postgres(&server.dir);
        server
    }

    async fn start_on_a_free_port(mut self) -> Self {
        let mut failure = String::new();
        for _ in 0..START_ATTEMPTS {
            let [port] = free_ports();
            self.port = port;
            match self.pg_ctl_start().await {
                Ok(()) => return self,
                Err(message) => failure = message,
            }
        }
        panic!("PostgreSQL did not start in {START_ATTEMPTS} attempts: {failure}");
    }

    fn append_to_config(&self, lines: &[&str]) {
        use std::io::Write as _;
        let path = self.dir.join("data").join("postgresql.conf");
        let text = format!("\n{}\n", lines.join("\n"));
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .and_then(|mut file| file.write_all(text.as_bytes()))
            .unwrap_or_else(|e| panic!("cannot append to {}: {e}", path.display()));
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres`; the same across restarts.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// What `postgres --version` prints, e.g. `postgres (PostgreSQL) 15.14 (Debian 15.14-0+deb12u1)`.
    pub fn version(&self) -> String {
        let output = Command::new(self.bin_dir.join("postgres"))
            .arg("--version")
            .output()
            .expect("postgres --version");
        String::from_utf8_lossy(&output.stdout).trim().to_owned()
    }

    pub fn is_running(&self) -> bool {
        self.running
    }

    /// A fast shutdown (`pg_ctl stop -m fast`): open transactions roll back, sessions are cut,
    /// committed data is kept.
    pub async fn stop(&mut self) {
        if !self.running {
            return;
        }
        let output = self.pg_ctl_stop("fast").await;
        assert!(
            output.status.success(),
            "pg_ctl stop failed: {}",
            describe(&output)
        );
        self.running = false;
    }

    /// Starts the stopped server again on the same port and data directory.
    pub async fn start_again(&mut self) {
        assert!(!self.running, "PostgreSQL is running: stop it first");
        if let Err(message) = self.pg_ctl_start().await {
            panic!("PostgreSQL did not start again: {message}");
        }
    }

    /// The host dying: SIGKILL to the postmaster and every process it started, so no session
    /// is told anything and nothing more is written or sent (`kill_postmaster`). Returns
    /// once the port refuses connections. The cluster is not started again.
    pub async fn kill(&mut self) {
        assert!(self.running, "PostgreSQL is not running");
        let postmaster = postmaster_pid(&self.dir.join("data"))
            .unwrap_or_else(|| panic!("no postmaster pid in {}", self.dir.display()));
        kill_postmaster(postmaster);
        self.running = false;
        until_port_refuses(self.port, "PostgreSQL").await;
    }

    /// Promotes a standby (`pg_ctl promote`, which waits until it is out of recovery) and
    /// makes it commit alone: its `synchronous_standby_names`, copied from the old primary,
    /// names a standby that no longer exists, and while it does every commit waits for it
    /// forever. Until a new standby is attached, commits are on this server only.
    pub async fn promote(&mut self) {
        let data = self.data_dir();
        let output = self
            .run("pg_ctl", &["-D", &data, "-w", "-t", "30", "promote"])
            .await;
        assert!(
            output.status.success(),
            "pg_ctl promote failed: {}",
            describe(&output)
        );
        let db = self.connect().await;
        let in_recovery = scalar::<bool>(&db, "SELECT pg_is_in_recovery() AS v").await;
        assert!(!in_recovery, "still in recovery after pg_ctl promote");
        db.execute_unprepared("ALTER SYSTEM SET synchronous_standby_names = ''")
            .await
            .expect("synchronous_standby_names cleared");
        assert!(scalar::<bool>(&db, "SELECT pg_reload_conf() AS v").await);
        let _ = db.close().await;
    }

    /// Waits (up to 30 s) until the standby `name` streams from this primary as its
    /// synchronous standby: before that, a commit would not wait for it.
    pub async fn wait_for_sync_standby(&self, name: &str) {
        let db = self.connect().await;
        let deadline = Instant::now() + Duration::from_secs(30);
        let sql = Statement::from_sql_and_values(
            DbBackend::Postgres,
            "SELECT count(*) AS v FROM pg_stat_replication \
             WHERE application_name = $1 AND state = 'streaming' AND sync_state = 'sync'",
            [name.into()],
        );
        loop {
            let row = db
                .query_one_raw(sql.clone())
                .await
                .expect("pg_stat_replication");
            if row.and_then(|row| row.try_get::<i64>("", "v").ok()) == Some(1) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "standby {name} did not become a synchronous standby within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = db.close().await;
    }

    /// One connection to this server's `postgres` database.
    async fn connect(&self) -> DatabaseConnection {
        inventory_benches::db::connect(&self.url(), 1)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to {}: {e}", self.url()))
    }

    async fn pg_ctl_start(&mut self) -> Result<(), String> {
        let data = self.data_dir();
        let log = self.log_path();
        // The server's own options; the socket goes into the scratch directory so it never
        // clashes with the machine's server in /var/run/postgresql.
        let options = format!(
            "-p {} -k '{}' -c listen_addresses=127.0.0.1 -c shared_buffers=16MB",
            self.port,
            self.dir.display()
        );
        // -l matters beyond logging: without it the server would keep pg_ctl's output pipes
        // open and the wait for pg_ctl would never end.
        let output = self
            .run(
                "pg_ctl",
                &[
                    "-D", &data, "-l", &log, "-o", &options, "-w", "-t", "30", "start",
                ],
            )
            .await;
        if output.status.success() {
            self.running = true;
            return Ok(());
        }
        // A failed start can leave a server behind that pg_ctl gave up waiting for.
        let _ = self.pg_ctl_stop("immediate").await;
        Err(format!(
            "{}; the server's log ends:\n{}",
            describe(&output),
            log_tail(Path::new(&log), 20)
        ))
    }

    async fn pg_ctl_stop(&self, mode: &str) -> Output {
        let data = self.data_dir();
        self.run("pg_ctl", &["-D", &data, "-m", mode, "-w", "stop"])
            .await
    }

    async fn run(&self, program: &str, args: &[&str]) -> Output {
        tokio::process::Command::from(self.command(program, args))
            .output()
            .await
            .unwrap_or_else(|e| panic!("cannot run {program}: {e}"))
    }

    /// `program` from the server binaries with `args`, as the postgres user when we are root.
    fn command(&self, program: &str, args: &[&str]) -> Command {
        let path = self.bin_dir.join(program);
        let mut command = if as_root() {
            let mut runuser = Command::new("runuser");
            runuser.args(["-u", "postgres", "--"]).arg(path);
            runuser
        } else {
            Command::new(path)
        };
        // The postgres user may not be allowed into the test's working directory.
        command.args(args).current_dir(&self.dir);
        command
    }

    fn data_dir(&self) -> String {
        utf8(&self.dir.join("data"))
    }

    fn log_path(&self) -> String {
        utf8(&self.dir.join("server.log"))
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        if self.running {
            let data = self.data_dir();
            // Immediate: the data is thrown away next, so there is nothing to shut down cleanly.
            let _ = self
                .command("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"])
                .output();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(crate) fn as_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// The OS user PostgreSQL runs as when we are root (it refuses to run as root).
pub(crate) fn postgres_user() -> nix::unistd::User {
    nix::unistd::User::from_name("postgres")
        .ok()
        .flatten()
        .expect("an OS user named postgres to run PostgreSQL as (root may not)")
}

/// Gives `dir` to the postgres user when we are root, so PostgreSQL can write in it.
pub(crate) fn hand_to_postgres(dir: &Path) {
    if as_root() {
        let user = postgres_user();
        nix::unistd::chown(dir, Some(user.uid), Some(user.gid))
            .unwrap_or_else(|e| panic!("cannot hand {} to postgres: {e}", dir.display()));
    }
}

/// Where `initdb`, `pg_ctl` and `postgres` are.
pub(crate) fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("PG_BIN_DIR") {
        return dir.into();
    }
    if let Some(dir) = highest_version_bin(Path::new(DEBIAN_BINARIES)) {
        return dir;
    }
    on_path("pg_ctl")
        .and_then(|pg_ctl| pg_ctl.parent().map(Path::to_path_buf))
        .expect(
            "no PostgreSQL server binaries: install Debian's postgresql package (scripts/test.sh \
             does) or set PG_BIN_DIR",
        )
}

/// `<root>/<version>/bin` for the highest version (compared as numbers, so 9.6 < 15) that has
/// `pg_ctl`.
fn highest_version_bin(root: &Path) -> Option<PathBuf> {
    std::fs::read_dir(root)
        .ok()?
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let version: Vec<u32> = entry
                .file_name()
                .to_str()?
                .split('.')
                .map(str::parse)
                .collect::<Result<_, _>>()
                .ok()?;
            let bin = entry.path().join("bin");
            bin.join("pg_ctl").is_file().then_some((version, bin))
        })
        .max_by(|a, b| a.0.cmp(&b.0))
        .map(|(_, bin)| bin)
}

/// The scratch paths go into pg_ctl's option string, which is text.
fn utf8(path: &Path) -> String {
    path.to_str()
        .unwrap_or_else(|| {
            panic!(
                "a temporary directory with a UTF-8 path, not {}",
                path.display()
            )
        })
        .to_owned()
}

/// The postmaster's pid, from `postmaster.pid` in the data directory `data`, if one runs there.
pub(crate) fn postmaster_pid(data: &Path) -> Option<Pid> {
    let text = std::fs::read_to_string(data.join("postmaster.pid")).ok()?;
    text.lines().next()?.trim().parse().ok().map(Pid::from_raw)
}

/// SIGKILL to the postmaster and every process it started. (Each backend leads a process
/// group of its own, so the postmaster's group is not enough: its children are found in
/// `/proc` while it is stopped and cannot start more.)
pub(crate) fn kill_postmaster(postmaster: Pid) {
    // ESRCH throughout: it, or a child, exited meanwhile.
    let _ = kill(postmaster, Signal::SIGSTOP);
    for child in children_of(postmaster) {
        let _ = kill(child, Signal::SIGKILL);
    }
    let _ = kill(postmaster, Signal::SIGKILL);
}

/// The processes whose parent is `parent`, read from `/proc/<pid>/stat`.
pub(crate) fn children_of(parent: Pid) -> Vec<Pid> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid: i32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            // `pid (comm) state ppid …`; comm may hold spaces and parentheses.
            let ppid: i32 = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            (ppid == parent.as_raw()).then(|| Pid::from_raw(pid))
        })
        .collect()
}

/// The column `v` of the one row `sql` returns.
async fn scalar<T: TryGetable>(db: &DatabaseConnection, sql: &str) -> T {
    db.query_one_raw(Statement::from_string(DbBackend::Postgres, sql))
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .unwrap_or_else(|| panic!("{sql}: no row"))
        .try_get("", "v")
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

fn describe(output: &Output) -> String {
    format!(
        "{}\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}
