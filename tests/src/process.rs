//! What the server harnesses share: free loopback ports, scratch directories, finding binaries,
//! and stopping a child process politely.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// `N` distinct ports that were free on 127.0.0.1 a moment ago. All listeners are held until
/// every port is chosen, so the ports differ; another process can still take one before the
/// server binds it, which is why the harnesses retry a first start that fails.
pub(crate) fn free_ports<const N: usize>() -> [u16; N] {
    let listeners: Vec<TcpListener> = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("a free loopback port"))
        .collect();
    std::array::from_fn(|i| {
        listeners[i]
            .local_addr()
            .expect("a bound listener's address")
            .port()
    })
}

/// A new empty directory under the system's temporary directory, named `<prefix>-<uuid>`.
pub(crate) fn scratch_dir(prefix: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("{prefix}-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
    dir
}

/// The first file called `name` in a directory of `PATH`.
pub(crate) fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// SIGTERM, then up to `grace` for the process to exit, then SIGKILL. Always reaps the child.
pub(crate) async fn terminate(mut child: Child, grace: Duration) {
    let pid = i32::try_from(child.id()).expect("a pid fits in i32");
    // ESRCH only means it has exited already; the wait below reaps it either way.
    let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if matches!(child.try_wait(), Ok(Some(_))) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    kill_now(&mut child);
}

/// SIGKILL and reap: no zombie and no process left behind.
pub(crate) fn kill_now(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// The last `lines` lines of a log file, for a failure message.
pub(crate) fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Returns once nothing accepts connections on 127.0.0.1:`port` any more, as after a SIGKILL of
/// the server on it; panics naming `server` if it still does 10 s later.
pub(crate) async fn until_port_refuses(port: u16, server: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_ok()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "{server}'s port {port} still accepts 10 s after SIGKILL"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
