//! `inventory shard move` as a process, on a nats-server 2.10+ of the test's own: a partition
//! moved from one shard's database to another's with its rows, the drain waiting for the old
//! shard's outbox and `shard status` saying so, the consumer paused meanwhile (2.11+), and an
//! abort before the hand-over unwinding the move. The statements themselves are the
//! integration tests' (`moving.rs`).

use std::num::NonZeroU32;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use inventory_benches::produce::Produce as _;
use inventory_domain::shard::partition_of;
use inventory_domain::{BookId, Message, OrderId};
use inventory_infra::jetstream::partition_consumer;
use inventory_infra::{MessageHandler, NaturalKey};
use inventory_tests::binary::{self, BinaryRun};
use inventory_tests::{Backend, TestDb, on_shard, placed_for};
use sea_orm::ConnectionTrait as _;

const P: NonZeroU32 = NonZeroU32::new(8).unwrap();

/// `shard move` from `from` to `to`'s databases, with `args`.
fn mover(run: &BinaryRun, from: &TestDb, to: &TestDb, args: &[&str]) -> Command {
    let mut command = run.command(&[&["shard", "move"], args].concat());
    command
        .env("INVENTORY_FROM_DATABASE_URL", &from.url)
        .env("INVENTORY_TO_DATABASE_URL", &to.url);
    command
}

fn spawned(mut command: Command) -> Child {
    command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the inventory binary starts")
}

/// `shard status`'s line of `partition`, once `wanted` holds of it (within 20 s).
fn status_line(run: &BinaryRun, partition: u32, wanted: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let output = run.run(&["shard", "status"]);
        let table = String::from_utf8_lossy(&output.stdout).into_owned();
        let line = table
            .lines()
            .find(|line| line.split_whitespace().next() == Some(&partition.to_string()))
            .unwrap_or_default()
            .to_owned();
        if wanted(&line) {
            return line;
        }
        assert!(Instant::now() < deadline, "never so: {table}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

async fn paused(run: &BinaryRun, consumer: &str) -> bool {
    let client = async_nats::connect(&run.nats_url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let stream = js.get_stream(&run.names.stream).await.unwrap();
    stream.consumer_info(consumer).await.unwrap().paused
}

/// A book with 10 copies on the run's database, its partition assigned to shard `a` there, a
/// handler of that shard, and a fresh database for shard `b`, labelled `label`.
async fn shard_a_with_a_book(run: &BinaryRun, label: &str) -> (TestDb, BookId, u32, NaturalKey) {
    let a = &run.db;
    let b = TestDb::labelled(Backend::Postgres, label).await;
    let book = a.dune(10).await;
    let partition = partition_of(book, P);
    let assigned = run
        .command(&[
            "shard",
            "assign",
            "--partitions",
            &partition.to_string(),
            "--to",
            "a",
        ])
        .env("DATABASE_URL", &a.url)
        .output()
        .unwrap();
    assert!(assigned.status.success(), "{assigned:?}");
    (b, book, partition, on_shard(a, P))
}

async fn owner(db: &TestDb, partition: u32) -> Option<(String, i64, String)> {
    let row = db
        .conn
        .query_one_raw(sea_orm::Statement::from_string(
            sea_orm::DbBackend::Postgres,
            format!(
                "SELECT shard, epoch, state FROM partition_owner WHERE partition_id = {partition}"
            ),
        ))
        .await
        .unwrap()?;
    Some((
        row.try_get("", "shard").unwrap(),
        row.try_get("", "epoch").unwrap(),
        row.try_get("", "state").unwrap(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shard_move_takes_a_partition_with_its_rows_once_the_old_shards_events_are_out() {
    let Some((_server, run)) = BinaryRun::sharded("shard_move", "warn", P).await else {
        return;
    };
    let a = &run.db;
    let (b, book, partition, on_a) = shard_a_with_a_book(&run, "shard_move_b").await;
    let kept = placed_for(OrderId::new_v7(), book, 2);
    assert!(on_a.handle(&kept).await.unwrap().processed());
    let cancelled = OrderId::new_v7();
    assert!(
        on_a.handle(&Message::cancelled_line(cancelled, book))
            .await
            .unwrap()
            .processed()
    );
    let consumer = partition_consumer("inventory-reserve-stock", partition, P);

    // No relay runs here: the reservation's event waits in a's outbox, and the drain for it.
    let moving = spawned(mover(
        &run,
        a,
        &b,
        &["--partition", &partition.to_string(), "--to", "b"],
    ));
    let line = status_line(&run, partition, |line| line.contains("waiting for"));
    assert!(line.contains("a -> b: drain"), "{line}");
    assert!(line.contains("1 unpublished event"), "{line}");
    assert!(paused(&run, &consumer).await, "the consumer was not paused");
    a.conn
        .execute_unprepared(
            "UPDATE outbox SET parked_at = now(), parked_reason = 'too large to publish'",
        )
        .await
        .unwrap();
    let line = status_line(&run, partition, |line| line.contains("parked"));
    assert!(line.contains("too large to publish"), "{line}");
    // As the relay does once an operator retried the row and it went out.
    a.conn
        .execute_unprepared("DELETE FROM outbox")
        .await
        .unwrap();
    let (status, output) = binary::ended(moving);
    assert!(status.success(), "{output}");
    for said in [
        "moving from a to b (epoch 1)",
        "a fenced at epoch 1",
        "1 book(s), 1 reservation(s), 1 line cancellation(s) copied to b",
        "assigned to b",
        "b active at epoch 2",
        "removed from a",
        "partition",
    ] {
        assert!(output.contains(said), "{said:?} not in {output}");
    }

    assert_eq!(owner(a, partition).await, None);
    assert_eq!(
        owner(&b, partition).await,
        Some(("b".to_owned(), 2, "active".to_owned()))
    );
    assert_eq!(b.reserved(book).await, 2);
    assert_eq!(a.scalar("SELECT count(*) FROM stock_reservations").await, 0);
    assert!(
        !paused(&run, &consumer).await,
        "the consumer is still paused"
    );
    let of = run.run(&["shard", "of", "--book-id", &book.to_string()]);
    assert!(
        String::from_utf8_lossy(&of.stdout)
            .trim()
            .ends_with("shard b"),
        "{of:?}"
    );
    let line = status_line(&run, partition, |_| true);
    assert!(
        line.trim_end().ends_with('-'),
        "a finished move still shown: {line}"
    );

    // Run again: the move is over, and the partition is b's already.
    let again = mover(
        &run,
        a,
        &b,
        &["--partition", &partition.to_string(), "--to", "b"],
    )
    .output()
    .unwrap();
    assert_eq!(again.status.code(), Some(1), "{again:?}");
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("on shard b already"),
        "{again:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shard_move_abort_before_the_hand_over_leaves_the_partition_where_it_was() {
    let Some((_server, run)) = BinaryRun::sharded("shard_move_abort", "warn", P).await else {
        return;
    };
    let a = &run.db;
    let (b, book, partition, on_a) = shard_a_with_a_book(&run, "shard_move_abort_b").await;
    assert!(
        on_a.handle(&placed_for(OrderId::new_v7(), book, 3))
            .await
            .unwrap()
            .processed()
    );
    let p = partition.to_string();

    let moving = spawned(mover(&run, a, &b, &["--partition", &p, "--to", "b"]));
    status_line(&run, partition, |line| line.contains("waiting for"));
    let elsewhere = mover(&run, a, &b, &["--partition", &p, "--to", "c"])
        .output()
        .unwrap();
    assert_eq!(elsewhere.status.code(), Some(1), "{elsewhere:?}");
    assert!(
        String::from_utf8_lossy(&elsewhere.stderr).contains("moving to b already"),
        "{elsewhere:?}"
    );
    let abort = mover(&run, a, &b, &["--partition", &p, "--abort"])
        .output()
        .unwrap();
    assert!(abort.status.success(), "{abort:?}");
    let said = String::from_utf8_lossy(&abort.stdout).into_owned();
    assert!(said.trim_end().ends_with("aborted"), "{said}");
    // The first mover reads the abort and unwinds beside it: either may do each step.
    let (status, output) = binary::ended(moving);
    assert!(status.success(), "{output}");
    assert!(output.trim_end().ends_with("aborted"), "{output}");
    assert!(
        said.contains("assigned to a again") || output.contains("assigned to a again"),
        "{said}{output}"
    );

    assert_eq!(
        owner(a, partition).await,
        Some(("a".to_owned(), 2, "active".to_owned()))
    );
    assert_eq!(owner(&b, partition).await, None);
    assert_eq!(b.scalar("SELECT count(*) FROM stock_items").await, 0);
    assert_eq!(a.reserved(book).await, 3);
    assert!(
        on_a.handle(&placed_for(OrderId::new_v7(), book, 1))
            .await
            .unwrap()
            .processed(),
        "the old shard decides again"
    );
    let consumer = partition_consumer("inventory-reserve-stock", partition, P);
    assert!(
        !paused(&run, &consumer).await,
        "the consumer is still paused"
    );
    let none = mover(&run, a, &b, &["--partition", &p, "--abort"])
        .output()
        .unwrap();
    assert_eq!(none.status.code(), Some(1), "{none:?}");
    assert!(
        String::from_utf8_lossy(&none.stderr).contains("no move under way"),
        "{none:?}"
    );
}
