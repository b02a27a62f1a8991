//! A TCP proxy that injects network faults between the service and a server (PostgreSQL or
//! NATS): latency, every connection cut at once, a PostgreSQL connection cut right after it
//! sent a commit (the server commits, the client never hears), a connection silenced right
//! after it sent a given statement, and a blackhole.
//!
//! The blackhole is a peer that neither answers nor closes: every connection open when it
//! starts, and every one made while it lasts, goes silent for good (its bytes are taken and
//! dropped, nothing comes back, no FIN, no RST), as when a host vanishes or a firewall drops a
//! flow. Only the client's own clock gets it out. [`FaultProxy::pass`] ends it for new
//! connections; the silent ones stay silent until [`FaultProxy::cut_all`] or the proxy is
//! dropped.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How long a connection cut after a commit still lets the server work, so the commit is
/// done before the cut.
const COMMIT_SETTLES: Duration = Duration::from_millis(300);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Pass,
    Latency(Duration),
    Blackhole,
}

/// One proxied connection.
#[derive(Default)]
struct Connection {
    /// Closes both sockets.
    cut: CancellationToken,
    /// Blackholed: nothing is forwarded any more, either way, and nothing is closed.
    silent: AtomicBool,
    /// The server's answers are dropped (a commit was just sent; the cut follows).
    deaf: AtomicBool,
}

struct Shared {
    target: SocketAddr,
    mode: Mutex<Mode>,
    connections: Mutex<Vec<Weak<Connection>>>,
    /// Cuts after a commit still to make.
    commit_cuts_armed: AtomicUsize,
    commit_cuts_made: AtomicUsize,
    /// What a client sends that silences its connection right after, and how many times more.
    silence_trigger: Mutex<Vec<u8>>,
    silences_armed: AtomicUsize,
    silences_made: AtomicUsize,
    accepted: AtomicUsize,
}

impl Shared {
    fn mode(&self) -> Mode {
        *self.mode.lock().unwrap()
    }

    fn live(&self) -> Vec<Arc<Connection>> {
        let mut connections = self.connections.lock().unwrap();
        connections.retain(|connection| connection.strong_count() > 0);
        connections.iter().filter_map(Weak::upgrade).collect()
    }
}

/// A fault-injecting proxy on a free local port, forwarding to `target`; stopped (every
/// connection closed) when dropped.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
    accept: JoinHandle<()>,
}

impl FaultProxy {
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            target,
            mode: Mutex::new(Mode::Pass),
            connections: Mutex::new(Vec::new()),
            commit_cuts_armed: AtomicUsize::new(0),
            commit_cuts_made: AtomicUsize::new(0),
            silence_trigger: Mutex::new(Vec::new()),
            silences_armed: AtomicUsize::new(0),
            silences_made: AtomicUsize::new(0),
            accepted: AtomicUsize::new(0),
        });
        let stop = CancellationToken::new();
        let accept = tokio::spawn(accept_loop(listener, shared.clone(), stop.clone()));
        Self {
            addr,
            shared,
            stop,
            accept,
        }
    }

    /// A proxy in front of the server `url` names (`scheme://[user@]host:port[/…]`).
    pub async fn in_front_of(url: &str) -> Self {
        let (_, host_and_port, _) = split_url(url);
        let target = tokio::net::lookup_host(host_and_port)
            .await
            .unwrap()
            .next()
            .unwrap();
        Self::start(target).await
    }

    /// `url` (`postgres://…@host:port/…`, `nats://host:port`) with its host and port
    /// replaced by the proxy's.
    /// `url` through this proxy. A PostgreSQL URL that says nothing of TLS gets
    /// `sslmode=disable`: the proxy reads the protocol to place its faults (after a commit,
    /// after a query naming a table), which TLS would hide from it.
    pub fn url_for(&self, url: &str) -> String {
        let url = with_address(url, self.addr);
        if !inventory_infra::db::is_postgres(&url) || url.contains("sslmode=") {
            return url;
        }
        let separator = if url.contains('?') { '&' } else { '?' };
        format!("{url}{separator}sslmode=disable")
    }

    /// Forwards as is; new connections go through again after a blackhole.
    pub fn pass(&self) {
        *self.shared.mode.lock().unwrap() = Mode::Pass;
    }

    /// Holds every chunk this long, each way.
    pub fn latency(&self, delay: Duration) {
        *self.shared.mode.lock().unwrap() = Mode::Latency(delay);
    }

    /// Silences every open connection for good, and every new one until [`Self::pass`].
    pub fn blackhole(&self) {
        *self.shared.mode.lock().unwrap() = Mode::Blackhole;
        for connection in self.shared.live() {
            connection.silent.store(true, Ordering::SeqCst);
        }
    }

    /// Closes every open connection now, wherever its statements are.
    pub fn cut_all(&self) -> usize {
        let live = self.shared.live();
        for connection in &live {
            connection.cut.cancel();
        }
        live.len()
    }

    /// Cuts the next `count` connections that send a commit, right after it reached the
    /// server and before its answer reaches the client: the commit's outcome is unknown to it.
    pub fn cut_after_commits(&self, count: usize) {
        self.shared
            .commit_cuts_armed
            .fetch_add(count, Ordering::SeqCst);
    }

    /// Cuts after a commit made so far.
    pub fn commit_cuts_made(&self) -> usize {
        self.shared.commit_cuts_made.load(Ordering::SeqCst)
    }

    /// Silences for good the next `count` connections that send `trigger`, right after it
    /// reached the server: whatever it started there (a transaction holding the locks it
    /// took) stays as it is, and the client hears nothing more.
    pub fn silence_after(&self, trigger: &[u8], count: usize) {
        *self.shared.silence_trigger.lock().unwrap() = trigger.to_vec();
        self.shared
            .silences_armed
            .fetch_add(count, Ordering::SeqCst);
    }

    /// Connections silenced by [`Self::silence_after`] so far.
    pub fn silences_made(&self) -> usize {
        self.shared.silences_made.load(Ordering::SeqCst)
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.cancel();
        self.accept.abort();
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>, stop: CancellationToken) {
    loop {
        let client = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => client,
                Err(_) => continue,
            },
        };
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        let connection = Arc::new(Connection {
            cut: stop.child_token(),
            ..Connection::default()
        });
        shared
            .connections
            .lock()
            .unwrap()
            .push(Arc::downgrade(&connection));
        tokio::spawn(serve(client, shared.clone(), connection));
    }
}

async fn serve(client: TcpStream, shared: Arc<Shared>, connection: Arc<Connection>) {
    let _ = client.set_nodelay(true);
    if shared.mode() == Mode::Blackhole {
        connection.silent.store(true, Ordering::SeqCst);
    }
    if connection.silent.load(Ordering::SeqCst) {
        // Accepted and never answered: the client's bytes are left unread.
        connection.cut.cancelled().await;
        return;
    }
    let server = tokio::select! {
        () = connection.cut.cancelled() => return,
        server = TcpStream::connect(shared.target) => match server {
            Ok(server) => server,
            // The server is down: the client sees its connection closed.
            Err(_) => return,
        },
    };
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let upstream = pump(client_read, server_write, &shared, &connection, true);
    let downstream = pump(server_read, client_write, &shared, &connection, false);
    tokio::select! {
        () = connection.cut.cancelled() => {}
        () = async { tokio::join!(upstream, downstream); } => {}
    }
    // Both halves of both sockets are dropped here: the client sees its connection closed.
}

/// Copies one way, chunk by chunk, applying the mode; ends when either side closes.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: &Shared,
    connection: &Connection,
    client_to_server: bool,
) {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => {
                let _ = to.shutdown().await;
                return;
            }
            Ok(read) => read,
        };
        let chunk = &buffer[..read];
        if let Mode::Latency(delay) = shared.mode() {
            tokio::time::sleep(delay).await;
        }
        if connection.silent.load(Ordering::SeqCst) {
            // Taken and dropped; nothing more is read, nothing closed.
            std::future::pending::<()>().await;
        }
        let cut_after =
            client_to_server && sends_a_commit(chunk) && take_one(&shared.commit_cuts_armed);
        let silence_after = client_to_server
            && shared.silences_armed.load(Ordering::SeqCst) > 0
            && contains(chunk, &shared.silence_trigger.lock().unwrap())
            && take_one(&shared.silences_armed);
        if cut_after {
            connection.deaf.store(true, Ordering::SeqCst);
        }
        if !client_to_server && connection.deaf.load(Ordering::SeqCst) {
            continue;
        }
        if to.write_all(chunk).await.is_err() {
            return;
        }
        if silence_after {
            connection.silent.store(true, Ordering::SeqCst);
            shared.silences_made.fetch_add(1, Ordering::SeqCst);
        }
        if cut_after {
            tokio::time::sleep(COMMIT_SETTLES).await;
            shared.commit_cuts_made.fetch_add(1, Ordering::SeqCst);
            connection.cut.cancel();
            return;
        }
    }
}

/// `url` with its host and port replaced by `addr`, user and the rest kept.
fn with_address(url: &str, addr: SocketAddr) -> String {
    let (head, _, tail) = split_url(url);
    format!("{head}{addr}{tail}")
}

/// `scheme://user@`, `host:port`, and the path and query after them.
fn split_url(url: &str) -> (&str, &str, &str) {
    let scheme_end = url.find("://").map_or(0, |at| at + 3);
    let authority_end = url[scheme_end..]
        .find(['/', '?'])
        .map_or(url.len(), |at| scheme_end + at);
    let host_start = url[scheme_end..authority_end]
        .rfind('@')
        .map_or(scheme_end, |at| scheme_end + at + 1);
    (
        &url[..host_start],
        &url[host_start..authority_end],
        &url[authority_end..],
    )
}

fn take_one(counter: &AtomicUsize) -> bool {
    counter
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
            left.checked_sub(1)
        })
        .is_ok()
}

/// Whether a chunk a PostgreSQL client sent ends a unit of work the server commits on
/// receipt: a simple-query `COMMIT` (sea-orm's and sqlx's transactions), or an
/// extended-protocol Execute of the unnamed portal closed by a Sync (sqlx's prepared
/// statements: outside a transaction, the Sync commits the statement on its own).
fn sends_a_commit(chunk: &[u8]) -> bool {
    const EXECUTE_UNNAMED: &[u8] = b"E\0\0\0\x09\0\0\0\0\0";
    const SYNC: &[u8] = b"S\0\0\0\x04";
    contains(chunk, b"COMMIT") || (chunk.ends_with(SYNC) && contains(chunk, EXECUTE_UNNAMED))
}

fn contains(chunk: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && chunk.windows(needle.len()).any(|window| window == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_point_at_the_proxy() {
        let proxy_addr: SocketAddr = "127.0.0.1:5999".parse().unwrap();
        let rewrite = |url: &str| with_address(url, proxy_addr);
        assert_eq!(
            rewrite("postgres://postgres@127.0.0.1:5432/db_1?sslmode=disable"),
            "postgres://postgres@127.0.0.1:5999/db_1?sslmode=disable"
        );
        assert_eq!(rewrite("nats://127.0.0.1:4222"), "nats://127.0.0.1:5999");
    }

    #[test]
    fn commits_are_recognised_in_both_protocols() {
        assert!(sends_a_commit(b"Q\0\0\0\x0bCOMMIT\0"));
        let mut extended = b"B\0\0\0\x10rest of the bind".to_vec();
        extended.extend_from_slice(b"E\0\0\0\x09\0\0\0\0\0");
        extended.extend_from_slice(b"C\0\0\0\x06P\0");
        extended.extend_from_slice(b"S\0\0\0\x04");
        assert!(sends_a_commit(&extended));
        assert!(!sends_a_commit(b"Q\0\0\0\x0aBEGIN\0"));
        assert!(!sends_a_commit(&extended[..extended.len() - 5]));
    }
}
