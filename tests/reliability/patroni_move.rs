//! A partition moved onto a shard whose Patroni leader dies during the move. The orders stream
//! is sharded onto four partitions on a nats-server of the test's own (`inventory shard init`);
//! partition P belongs to shard a, a plain database of the local PostgreSQL, holding
//! [`RESERVATIONS`] reservations of [`BOOKS`] books (every 1,000th released, with its line
//! cancellation), put there by SQL. `inventory shard move --partition P --to b` moves it to
//! shard b, whose database lives on the Patroni pair (tests/src/patroni.rs) and which the mover
//! reaches only through HAProxy. Once the copy's transaction is open on b's leader (the move's
//! advisory lock held there), b's leader host is killed (its Patroni and PostgreSQL
//! SIGKILLed): Patroni promotes the synchronous standby once the leader's lease expires,
//! HAProxy follows it, and the mover, which retries a failing database for up to two minutes,
//! goes on. Should it stop after those two minutes, the same command run again must finish the
//! move (it resumes from the record); a mover that stops sooner fails the test.
//!
//! Placements arrive all along: [`PLACEMENTS`] of the partition's books, 20 a second from 2 s
//! before the mover starts, served by `serve --shard a` on a and `serve --shard b` on b through
//! HAProxy, each started again whenever it exits (as a supervisor would: an instance stops when
//! its shard's partitions change, and one that cannot reach its database at start exits).
//!
//! Afterwards: b's owner row active at the next epoch and a's gone; every reservation a held
//! and every placement on b exactly once (same keys, quantities and statuses), and nothing left
//! on a; each book's `reserved` on b the sum of its reserved reservations, what it was on a
//! plus its placements; the line cancellations moved; the assignment names b; the move's
//! record says done; no dead letter. Printed: the mover's lines timed from the kill, its
//! retries, whether it had to be run again, and how often each instance was started.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead as _, BufReader, Read as _};
use std::num::NonZeroU32;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use inventory_domain::shard::partition_of;
use inventory_domain::{BookId, Event, OrderId};
use inventory_infra::jetstream::shards_bucket;
use inventory_infra::shard_move::{MoveRecord, Step};
use inventory_tests::binary::BinaryRun;
use inventory_tests::patroni::{PatroniPair, connect};
use inventory_tests::placed_for;
use inventory_tests::workload::{self, Send, SendKind};
use sea_orm::{ConnectionTrait as _, DatabaseConnection, DbBackend, Statement};
use tokio::sync::mpsc;

const PARTITIONS: NonZeroU32 = NonZeroU32::new(4).unwrap();
const PARTITION: u32 = 1;
const BOOKS: usize = 20;
const RESERVATIONS: usize = 30_000;
/// Placements published over the move: [`PLACEMENT_CHUNK`] every [`PLACEMENT_PAUSE`], 20 a
/// second for 15 s, from 2 s before the mover starts.
const PLACEMENTS: usize = 300;
const PLACEMENT_CHUNK: usize = 10;
const PLACEMENT_PAUSE: Duration = Duration::from_millis(500);
/// How long the placements may take to be reserved once the move is done.
const SETTLE: Duration = Duration::from_secs(60);
/// Patroni promotes within its TTL (10 s) of the kill; room for a loaded machine.
const PROMOTION: Duration = Duration::from_secs(60);
/// The mover retries for two minutes; room beyond that for its last attempt.
const MOVER_ENDS: Duration = Duration::from_secs(150);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: run by scripts/test.sh"]
async fn a_partition_moves_onto_a_shard_whose_patroni_leader_is_killed_during_the_copy() {
    let began = Instant::now();
    let mut pair = PatroniPair::start().await;
    let (_server, run) = BinaryRun::sharded("patroni_move", "warn", PARTITIONS)
        .await
        .expect("a nats-server 2.10 or later (scripts/test.sh installs one)");
    let a = &run.db;
    let b = inventory_benches::fresh::FreshDatabase::create(Some(&pair.url()), "move_b", 2)
        .await
        .expect("shard b's database on the pair, through HAProxy");
    let p = PARTITION.to_string();
    run.run(&["shard", "assign", "--partitions", &p, "--to", "a"]);
    let books: Vec<BookId> = std::iter::repeat_with(BookId::new_v7)
        .filter(|book| partition_of(*book, PARTITIONS) == PARTITION)
        .take(BOOKS)
        .collect();
    put_rows(&a.conn, &books).await;
    let held = Held::read(&a.conn).await;
    assert_eq!(held.reservations.len(), RESERVATIONS);

    // The placements: `serve --shard a` on a, `serve --shard b` on b through HAProxy (started
    // again whenever it exits, as its supervisor would: it stops when the assignment changes),
    // and a producer putting [`PLACEMENTS`] on the partition's books over the move.
    let logs = std::env::temp_dir().join(format!("patroni_move_{}", run.names.suffix));
    std::fs::create_dir_all(&logs).unwrap();
    let serve_a = Served::start(&run, "a", &a.url, &logs);
    let serve_b = Served::start(&run, "b", &b.url, &logs);
    let placements: Vec<Send> = (0..PLACEMENTS)
        .map(|n| Send {
            message: placed_for(OrderId::new_v7(), books[n % books.len()], 1),
            kind: SendKind::Original,
        })
        .collect();
    let producer = {
        let (js, topology, sends) = (run_js(&run).await, run.names.topology(), placements.clone());
        tokio::spawn(async move {
            workload::publish(&js, &topology, &sends, 10, PLACEMENT_CHUNK, PLACEMENT_PAUSE).await;
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;

    let mut mover = Mover::spawn(
        run.command(&["shard", "move", "--partition", &p, "--to", "b"]),
        &a.url,
        &b.url,
    );
    let fenced = mover
        .until(|line| line.contains(": fence:"), Duration::from_secs(60))
        .await;
    let copying = until_copying(&pair, &mut mover).await;
    let killed = Instant::now();
    let old_leader = pair.kill_leader().await;
    let new_leader = pair.wait_for_leader_other_than(old_leader, PROMOTION).await;
    let promoted = killed.elapsed();
    let first = mover.end().await;
    let ran_again = if first.success {
        None
    } else {
        // It stopped: the same command again resumes from the record, once b takes writes
        // through HAProxy (the command does not retry opening its databases at start).
        until_writable(&b.url).await;
        let mut again = Mover::spawn(
            run.command(&["shard", "move", "--partition", &p, "--to", "b"]),
            &a.url,
            &b.url,
        );
        let again = again.end().await;
        assert!(
            again.success,
            "the move stopped at the failover and did not finish when run again:\nfirst: {}\n\
             {}\nagain: {}\n{}\n{}",
            first.stdout,
            first.stderr,
            again.stdout,
            again.stderr,
            pair.logs()
        );
        // A mover may stop once it has retried for its two minutes; one that stops sooner
        // broke that promise, even though running it again finished the move.
        assert!(
            first
                .stderr
                .contains("run the same command again to resume"),
            "the mover stopped before retrying for its two minutes:\n{}\n{}",
            first.stdout,
            first.stderr
        );
        Some(again)
    };
    let moved_in = killed.elapsed();
    producer.await.unwrap();
    let placed: BTreeSet<(String, String, i32, String)> = placements
        .iter()
        .map(|send| match &send.message.event {
            Event::Placed(placed) => (
                placed.order_id.to_string(),
                placed.book_id.to_string(),
                1,
                "reserved".to_owned(),
            ),
            _ => unreachable!("placements only"),
        })
        .collect();
    let b_now = connect(&b.url)
        .await
        .expect("b's database through HAProxy after the failover");
    until_reserved(&b_now, &placed, &logs).await;
    let restarts_b = serve_b.stop();
    let restarts_a = serve_a.stop();

    // What the move left, read afresh on b's new leader: what a held and every placement,
    // each exactly once.
    assert_eq!(
        owner(&b_now).await,
        Some(("b".to_owned(), 2, "active".to_owned()))
    );
    assert_eq!(owner(&a.conn).await, None, "a's owner row is left");
    let on_b = Held::read(&b_now).await;
    let expected: BTreeSet<_> = held.reservations.union(&placed).cloned().collect();
    assert_eq!(
        on_b.reservations.len(),
        expected.len(),
        "reservations on b, against those a held and the placements"
    );
    assert!(
        on_b.reservations == expected,
        "b's reservations are not a's and the placements': {} missing, {} unexpected",
        expected.difference(&on_b.reservations).count(),
        on_b.reservations.difference(&expected).count()
    );
    let orders: BTreeSet<&String> = on_b.reservations.iter().map(|r| &r.0).collect();
    assert_eq!(
        orders.len(),
        on_b.reservations.len(),
        "an order reserved twice"
    );
    assert_eq!(on_b.line_cancellations, held.line_cancellations);
    let mut expected_reserved = held.reserved.clone();
    for (_, book, quantity, _) in &placed {
        *expected_reserved.get_mut(book).unwrap() += quantity;
    }
    assert_eq!(
        on_b.reserved, expected_reserved,
        "each book's reserved on b"
    );
    assert_eq!(
        on_b.reserved,
        on_b.sum_of_reserved(),
        "reserved = its reservations on b"
    );
    let on_a = Held::read(&a.conn).await;
    assert!(
        on_a.reservations.is_empty() && on_a.reserved.is_empty() && on_a.line_cancellations == 0,
        "a still holds {} reservations, {} books",
        on_a.reservations.len(),
        on_a.reserved.len()
    );
    let of = run.run(&["shard", "of", "--book-id", &books[0].to_string()]);
    assert!(
        String::from_utf8_lossy(&of.stdout)
            .trim()
            .ends_with("shard b"),
        "{of:?}"
    );
    assert_eq!(move_record(&run).await.step, Step::Done);
    let dead = run_js(&run)
        .await
        .get_stream(&run.names.dlq_stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages;
    assert_eq!(dead, 0, "dead letters");
    let exits_b = exit_reasons(&logs.join("serve-b.log"));
    let exits_a = exit_reasons(&logs.join("serve-a.log"));
    let _ = std::fs::remove_dir_all(&logs);

    let retries = first.stderr.matches("retrying the move's turn").count();
    let first_error = first
        .stderr
        .lines()
        .find(|line| line.contains("retrying the move's turn"))
        .unwrap_or("none");
    eprintln!(
        "[patroni move] pair ready in {:.1} s; {RESERVATIONS} reservations of {BOOKS} books; \
         {old_leader} (b's leader) killed {:.2?} after the mover started, after its line {fenced:?}, {}; \
         Patroni promoted {new_leader} {promoted:.1?} after the kill; the move finished \
         {moved_in:.1?} after the kill, {}; {PLACEMENTS} placements each reserved once on b, \
         serve --shard a started {restarts_a} time(s) (exits: {exits_a}), b {restarts_b} \
         (exits: {exits_b}); the whole test {:.1?}; \
         its first retry: {first_error}\n{}",
        pair.time_to_ready().as_secs_f64(),
        killed - mover.started,
        if copying {
            "while the copy's transaction was open on it"
        } else {
            "once the copy had committed"
        },
        match &ran_again {
            None => format!("on its own, after {retries} retried turn(s)"),
            Some(_) =>
                format!("when run again (the first stopped after {retries} retried turn(s))"),
        },
        began.elapsed(),
        mover.timeline(killed),
    );
}

/// The partition's rows on a: each book a billion copies on hand, [`RESERVATIONS`] over the
/// books in turn (1 to 3 copies), every 1,000th released with its line cancellation, each
/// book's `reserved` the sum of its reserved ones.
async fn put_rows(db: &DatabaseConnection, books: &[BookId]) {
    let values = books
        .iter()
        .enumerate()
        .map(|(n, book)| format!("({n}, '{book}'::uuid)"))
        .collect::<Vec<_>>()
        .join(", ");
    db.execute_unprepared(&format!(
        "CREATE TEMP TABLE move_books (n int PRIMARY KEY, book_id uuid NOT NULL);
         INSERT INTO move_books VALUES {values};
         INSERT INTO stock_items (book_id, title, on_hand, reserved)
           SELECT book_id, 'Book ' || n, 1000000000, 0 FROM move_books;
         INSERT INTO stock_reservations (order_id, book_id, quantity, status, message_id, created_at)
           SELECT gen_random_uuid(), b.book_id, 1 + i % 3,
                  CASE WHEN i % 1000 = 999 THEN 'released' ELSE 'reserved' END,
                  'move-' || i, now()
           FROM generate_series(0, {last}) AS i JOIN move_books b ON b.n = i % {count};
         INSERT INTO line_cancellations (order_id, book_id, cancelled_at, cancel_message_id)
           SELECT order_id, book_id, now(), 'move-cancel-' || message_id
           FROM stock_reservations WHERE status = 'released';
         UPDATE stock_items s SET reserved = r.held
           FROM (SELECT book_id, sum(quantity) AS held FROM stock_reservations
                 WHERE status = 'reserved' GROUP BY book_id) r
           WHERE s.book_id = r.book_id;
         DROP TABLE move_books;",
        last = RESERVATIONS - 1,
        count = books.len(),
    ))
    .await
    .expect("the partition's rows on a");
}

/// The advisory lock the copy takes on the new shard for its whole transaction (`MOVE_LOCK` in
/// infra/src/shard_move/rows.rs).
const MOVE_LOCK: i64 = 1_265_079_457;

/// Waits until the copy's transaction is open on b's leader (its advisory lock held), or the
/// mover says the copy is done: whether the copy was under way.
async fn until_copying(pair: &PatroniPair, mover: &mut Mover) -> bool {
    let leader = pair.leader().await.expect("b's leader");
    let direct = connect(&pair.node_url(leader))
        .await
        .expect("b's leader, bypassing HAProxy");
    let sql = format!(
        "SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND classid = {MOVE_LOCK} \
         AND objid = {PARTITION} AND granted"
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let held: i64 = query(&direct, &sql).await[0].try_get("", "n").unwrap();
        if held > 0 {
            return true;
        }
        if mover
            .try_lines()
            .iter()
            .any(|line| line.contains(": copy:"))
        {
            return false;
        }
        assert!(
            Instant::now() < deadline,
            "the copy never began: {:?}",
            mover.seen
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// What a database holds of the partition (all its rows here are the partition's).
struct Held {
    /// (order, book, quantity, status)
    reservations: BTreeSet<(String, String, i32, String)>,
    /// Each book's `reserved`.
    reserved: BTreeMap<String, i32>,
    line_cancellations: i64,
}

impl Held {
    async fn read(db: &DatabaseConnection) -> Self {
        let reservations = query(
            db,
            "SELECT order_id::text AS o, book_id::text AS b, quantity AS q, status AS s \
             FROM stock_reservations",
        )
        .await
        .iter()
        .map(|row| {
            (
                row.try_get("", "o").unwrap(),
                row.try_get("", "b").unwrap(),
                row.try_get("", "q").unwrap(),
                row.try_get("", "s").unwrap(),
            )
        })
        .collect();
        let reserved = query(
            db,
            "SELECT book_id::text AS b, reserved AS r FROM stock_items",
        )
        .await
        .iter()
        .map(|row| (row.try_get("", "b").unwrap(), row.try_get("", "r").unwrap()))
        .collect();
        let line_cancellations = query(db, "SELECT count(*) AS n FROM line_cancellations").await[0]
            .try_get("", "n")
            .unwrap();
        Self {
            reservations,
            reserved,
            line_cancellations,
        }
    }

    /// Each book's reserved reservations, summed.
    fn sum_of_reserved(&self) -> BTreeMap<String, i32> {
        let mut sums: BTreeMap<String, i32> =
            self.reserved.keys().map(|book| (book.clone(), 0)).collect();
        for (_, book, quantity, status) in &self.reservations {
            if status == "reserved" {
                *sums.entry(book.clone()).or_default() += quantity;
            }
        }
        sums
    }
}

async fn query(db: &DatabaseConnection, sql: &str) -> Vec<sea_orm::QueryResult> {
    db.query_all_raw(Statement::from_string(DbBackend::Postgres, sql))
        .await
        .unwrap_or_else(|error| panic!("{sql}: {error}"))
}

async fn owner(db: &DatabaseConnection) -> Option<(String, i64, String)> {
    let rows = query(
        db,
        &format!(
            "SELECT shard, epoch, state FROM partition_owner WHERE partition_id = {PARTITION}"
        ),
    )
    .await;
    rows.first().map(|row| {
        (
            row.try_get("", "shard").unwrap(),
            row.try_get("", "epoch").unwrap(),
            row.try_get("", "state").unwrap(),
        )
    })
}

/// Waits until `url` (through HAProxy) leads to a primary, within [`PROMOTION`].
async fn until_writable(url: &str) {
    let deadline = Instant::now() + PROMOTION;
    loop {
        if let Some(db) = connect(url).await
            && let Ok(Some(row)) = db
                .query_one_raw(Statement::from_string(
                    DbBackend::Postgres,
                    "SELECT pg_is_in_recovery() AS r",
                ))
                .await
            && row.try_get::<bool>("", "r") == Ok(false)
        {
            return;
        }
        assert!(Instant::now() < deadline, "{url} never took writes");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The errors an instance's log says it exited with, counted, the first 60 characters of each.
fn exit_reasons(log: &std::path::Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
    for line in text.lines().filter(|line| line.starts_with("error: ")) {
        *reasons
            .entry(line.chars().skip(7).take(60).collect())
            .or_default() += 1;
    }
    format!("{reasons:?}")
}

/// A JetStream context on the run's nats-server.
async fn run_js(run: &BinaryRun) -> async_nats::jetstream::Context {
    async_nats::jetstream::new(async_nats::connect(&run.nats_url).await.unwrap())
}

/// Waits until every placement has its reservation on b, within [`SETTLE`].
async fn until_reserved(
    b: &DatabaseConnection,
    placed: &BTreeSet<(String, String, i32, String)>,
    logs: &std::path::Path,
) {
    let ids = placed
        .iter()
        .map(|(order, ..)| format!("'{order}'"))
        .collect::<Vec<_>>()
        .join(", ");
    let sql =
        format!("SELECT count(*) AS n FROM stock_reservations WHERE order_id::text IN ({ids})");
    let deadline = Instant::now() + SETTLE;
    loop {
        let n: i64 = query(b, &sql).await[0].try_get("", "n").unwrap();
        if n >= placed.len() as i64 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{n} of {} placements reserved on b after {SETTLE:?}; the instances' logs are in {}",
            placed.len(),
            logs.display()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `serve --shard NAME` on its database, started again whenever it exits, until stopped.
struct Served {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    supervisor: Option<std::thread::JoinHandle<usize>>,
}

impl Served {
    fn start(run: &BinaryRun, shard: &str, url: &str, logs: &std::path::Path) -> Self {
        let mut command = run.command(&[
            "serve",
            "--shard",
            shard,
            "--max-deliver",
            "100",
            "--retry-delay",
            "200ms",
            "--max-retry-delay",
            "2s",
            "--db-pool-size",
            "4",
        ]);
        command.env("DATABASE_URL", url).env("RUST_LOG", "info");
        let log = logs.join(format!("serve-{shard}.log"));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopping = stop.clone();
        let supervisor = std::thread::spawn(move || {
            let mut starts = 0;
            while !stopping.load(std::sync::atomic::Ordering::SeqCst) {
                let out = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)
                    .unwrap();
                let mut child = command
                    .stdout(out.try_clone().unwrap())
                    .stderr(out)
                    .spawn()
                    .expect("the inventory binary starts");
                starts += 1;
                loop {
                    if child.try_wait().unwrap().is_some() {
                        break;
                    }
                    if stopping.load(std::sync::atomic::Ordering::SeqCst) {
                        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
                        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
                        let _ = child.wait();
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            starts
        });
        Self {
            stop,
            supervisor: Some(supervisor),
        }
    }

    /// Stops it (SIGTERM): how many times it was started.
    fn stop(mut self) -> usize {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.supervisor.take().map_or(0, |s| s.join().unwrap())
    }
}

/// A failing test stops the instance too.
impl Drop for Served {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(supervisor) = self.supervisor.take() {
            let _ = supervisor.join();
        }
    }
}

/// The move's record, `move.<P>` in the assignment's bucket.
async fn move_record(run: &BinaryRun) -> MoveRecord {
    let client = async_nats::connect(&run.nats_url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let topology = inventory_infra::jetstream::Topology {
        stream: run.names.stream.clone(),
        ..inventory_infra::jetstream::Topology::default()
    };
    let bucket = js.get_key_value(shards_bucket(&topology)).await.unwrap();
    let value = bucket
        .get(format!("move.{PARTITION}"))
        .await
        .unwrap()
        .expect("the move's record");
    serde_json::from_slice(&value).expect("a move record")
}

/// `inventory shard move` running, its lines timed as they come.
struct Mover {
    child: Child,
    started: Instant,
    lines: mpsc::UnboundedReceiver<(Instant, String)>,
    seen: Vec<(Instant, String)>,
    stderr: Option<std::thread::JoinHandle<String>>,
}

/// How a mover ended.
struct Ended {
    success: bool,
    stdout: String,
    stderr: String,
}

impl Mover {
    fn spawn(mut command: Command, from: &str, to: &str) -> Self {
        let mut child = command
            .env("INVENTORY_FROM_DATABASE_URL", from)
            .env("INVENTORY_TO_DATABASE_URL", to)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the inventory binary starts");
        let started = Instant::now();
        let (send, lines) = mpsc::unbounded_channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = send.send((Instant::now(), line));
            }
        });
        let mut stderr = child.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut all = String::new();
            let _ = stderr.read_to_string(&mut all);
            all
        });
        Self {
            child,
            started,
            lines,
            seen: Vec::new(),
            stderr: Some(stderr),
        }
    }

    /// Waits for a line that `wanted` takes; returns it.
    async fn until(&mut self, wanted: impl Fn(&str) -> bool, within: Duration) -> String {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let line = tokio::time::timeout_at(deadline, self.lines.recv())
                .await
                .unwrap_or_else(|_| panic!("no such line within {within:?}: {:?}", self.seen))
                .unwrap_or_else(|| panic!("the mover ended first: {:?}", self.seen));
            self.seen.push(line.clone());
            if wanted(&line.1) {
                return line.1;
            }
        }
    }

    /// The lines that came since the last look, kept.
    fn try_lines(&mut self) -> Vec<String> {
        let mut new = Vec::new();
        while let Ok(line) = self.lines.try_recv() {
            new.push(line.1.clone());
            self.seen.push(line);
        }
        new
    }

    /// Waits for the mover to end (within [`MOVER_ENDS`]).
    async fn end(&mut self) -> Ended {
        let deadline = Instant::now() + MOVER_ENDS;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("the mover still runs after {MOVER_ENDS:?}: {:?}", self.seen);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let stderr = self
            .stderr
            .take()
            .map(|t| t.join().unwrap())
            .unwrap_or_default();
        // The reader thread ends with the pipe: every line is in the channel by now or soon.
        while let Some(line) = self.lines.recv().await {
            self.seen.push(line);
        }
        Ended {
            success: status.success(),
            stdout: self
                .seen
                .iter()
                .map(|(_, line)| line.as_str())
                .collect::<Vec<_>>()
                .join("\n"),
            stderr,
        }
    }

    /// Each line with its time from `zero` (negative before it).
    fn timeline(&self, zero: Instant) -> String {
        self.seen
            .iter()
            .map(|(at, line)| {
                let from = if *at >= zero {
                    format!("+{:.2}", (*at - zero).as_secs_f64())
                } else {
                    format!("-{:.2}", (zero - *at).as_secs_f64())
                };
                format!("  {from} s  {line}")
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for Mover {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
