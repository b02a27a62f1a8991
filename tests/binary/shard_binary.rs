//! `inventory shard …` as processes, on a nats-server 2.10+ of the test's own (stream subject
//! transforms): assigning partitions to shards' databases, where a book lives, the status, and
//! the unsharded `serve` refusing a sharded stream. With no such server here the tests say so
//! and return.

use std::num::NonZeroU32;
use std::process::Output;

use inventory_domain::BookId;
use inventory_domain::shard::partition_of;
use inventory_infra::partition_owner::{PartitionOwners, PartitionRow};
use inventory_tests::binary::{self, BinaryRun};
use inventory_tests::{Backend, TestDb};

const P: NonZeroU32 = NonZeroU32::new(8).unwrap();

fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// `shard assign` into the database at `url`.
fn assign(run: &BinaryRun, partitions: &str, shard: &str, url: &str) -> Output {
    run.command(&["shard", "assign", "--partitions", partitions, "--to", shard])
        .env("DATABASE_URL", url)
        .output()
        .unwrap()
}

async fn rows(db: &TestDb) -> Vec<(u32, String, i64, String)> {
    PartitionOwners::new(db.conn.clone())
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(
            |PartitionRow {
                 partition,
                 shard,
                 epoch,
                 state,
             }| (partition, shard, epoch, state),
        )
        .collect()
}

fn active(
    partitions: impl IntoIterator<Item = u32>,
    shard: &str,
) -> Vec<(u32, String, i64, String)> {
    partitions
        .into_iter()
        .map(|partition| (partition, shard.to_owned(), 1, "active".to_owned()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shard_assign_records_owners_in_the_shards_database_and_refuses_anothers_partitions() {
    let Some((_server, run)) = BinaryRun::sharded("shard_assign", "warn", P).await else {
        return;
    };
    let a = &run.db;
    let b = TestDb::labelled(Backend::Postgres, "shard_b").await;

    let output = assign(&run, "0-3", "a", &a.url);
    assert!(output.status.success(), "{output:?}");
    assert_eq!(rows(a).await, active(0..=3, "a"));
    // Again: nothing new, and no error.
    let again = assign(&run, "2", "a", &a.url);
    assert!(again.status.success(), "{again:?}");
    assert!(
        text(&again).0.contains("partition 2: a's already"),
        "{again:?}"
    );

    // Partition 3 is a's: refused, and nothing of it written to b's database.
    let output = assign(&run, "3-5", "b", &b.url);
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    let (stdout, stderr) = text(&output);
    assert!(
        stdout.contains("partition 3: refused: owned by a"),
        "{stdout}"
    );
    assert!(stderr.contains("refused partition 3:"), "{stderr}");
    assert_eq!(rows(&b).await, active(4..=5, "b"));
    assert_eq!(rows(a).await, active(0..=3, "a"));

    let outside = assign(&run, "7-8", "b", &b.url);
    assert_eq!(outside.status.code(), Some(1), "{outside:?}");
    assert!(text(&outside).1.contains("8 partitions"), "{outside:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shard_of_names_the_partition_and_its_shard_and_status_lists_every_partition() {
    let Some((_server, run)) = BinaryRun::sharded("shard_of", "warn", P).await else {
        return;
    };
    let book = BookId::from(uuid::Uuid::new_v4());
    let partition = partition_of(book, P);
    let output = assign(&run, &partition.to_string(), "a", &run.db.url);
    assert!(output.status.success(), "{output:?}");

    let (stdout, _) = text(&run.run(&["shard", "of", "--book-id", &book.to_string()]));
    assert_eq!(
        stdout.trim(),
        format!("book {book}: partition {partition} of {P}, shard a")
    );
    let (json, _) = text(&run.run(&["shard", "of", "--book-id", &book.to_string(), "--json"]));
    let found: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(found["partition"], partition);
    assert_eq!(found["partitions"], P.get());
    assert_eq!(found["shard"], "a");

    // A book of another partition, which nobody owns.
    let other = std::iter::repeat_with(|| BookId::from(uuid::Uuid::new_v4()))
        .find(|other| partition_of(*other, P) != partition)
        .unwrap();
    let (stdout, _) = text(&run.run(&["shard", "of", "--book-id", &other.to_string()]));
    assert!(stdout.trim().ends_with("shard unassigned"), "{stdout}");

    let (json, _) = text(&run.run(&["shard", "status", "--json"]));
    let rows: Vec<serde_json::Value> = serde_json::from_str(&json).unwrap();
    assert_eq!(rows.len(), P.get() as usize, "{json}");
    for (row, expected) in rows.iter().zip(0..) {
        assert_eq!(row["partition"], expected, "{json}");
        let owner = if expected == partition {
            serde_json::json!("a")
        } else {
            serde_json::Value::Null
        };
        assert_eq!(row["shard"], owner, "{json}");
        assert_eq!(row["pending"], 0, "{json}");
        assert_eq!(row["ack_pending"], 0, "{json}");
    }
    let (table, _) = text(&run.run(&["shard", "status"]));
    assert_eq!(table.lines().count(), 1 + P.get() as usize, "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shard_bucket_makes_an_unsharded_serve_refuse_to_start() {
    let Some((_server, run)) = BinaryRun::sharded("shard_serve", "warn", P).await else {
        return;
    };
    let (status, output) = binary::ended(run.spawn(&["serve"]));
    assert_eq!(status.code(), Some(1), "{output}");
    assert!(output.contains("serve --shard NAME"), "{output}");
    assert!(
        output.contains(&format!("{}_SHARDS", run.names.stream)),
        "{output}"
    );
}
