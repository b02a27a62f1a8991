//! A PostgreSQL cluster of the test's own, for tests that stop and start the database under a
//! running consumer without disturbing the tests that share the local server.
//!
//! The server binaries come from `PG_BIN_DIR` if set, else the highest version under
//! `/usr/lib/postgresql/<version>/bin` (Debian's `postgresql` package), else the directory of
//! `pg_ctl` on `PATH`. PostgreSQL refuses to run as root, so as root they run as the `postgres`
//! OS user through `runuser`, in a directory that user owns.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::process::{free_ports, log_tail, on_path, scratch_dir};

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
        let mut server = Self {
            bin_dir: bin_dir(),
            dir: scratch_dir("inventory-pg"),
            port: 0,
            running: false,
        };
        if as_root() {
            let user = nix::unistd::User::from_name("postgres")
                .ok()
                .flatten()
                .expect("an OS user named postgres to run PostgreSQL as (root may not)");
            nix::unistd::chown(&server.dir, Some(user.uid), Some(user.gid))
                .expect("the scratch directory handed to the postgres user");
        }
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
        let mut failure = String::new();
        for _ in 0..START_ATTEMPTS {
            let [port] = free_ports();
            server.port = port;
            match server.pg_ctl_start().await {
                Ok(()) => return server,
                Err(message) => failure = message,
            }
        }
        panic!("PostgreSQL did not start in {START_ATTEMPTS} attempts: {failure}");
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

fn as_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// Where `initdb`, `pg_ctl` and `postgres` are.
fn bin_dir() -> PathBuf {
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

fn describe(output: &Output) -> String {
    format!(
        "{}\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}
