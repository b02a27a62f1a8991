//! `inventory shard init|assign|status|of`: setting up stock sharded by book. The NATS side
//! (the transform, the bucket, the consumers) is infra's `jetstream::shards`, the database side
//! infra's [`PartitionOwners`]; this is the commands, and `assign`'s order of the two.
//!
//! `assign` writes the shard's database first and the bucket second: the bucket routes, the
//! database decides, and a partition routed to a database that does not yet own it would only
//! be nak'ed there ("not owned"), never decided by two. A claim lost in the bucket removes the
//! row it had just written.

use std::fmt;
use std::io::Write as _;
use std::num::NonZeroU32;
use std::str::FromStr;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Subcommand;
use inventory_domain::BookId;
use inventory_domain::shard::{DEFAULT_PARTITIONS, partition_of};
use inventory_infra::db;
use inventory_infra::jetstream::{
    self, Claim, Context, InitSettings, Shards, Topology, partition_consumer, unroutable_consumer,
};
use inventory_infra::partition_owner::{PartitionOwners, Recorded};
use inventory_infra::shard_move::MoveRecord;
use secrecy::{ExposeSecret as _, SecretString};
use serde::Serialize;

use crate::args::{DatabaseArgs, NatsArgs, TopologyArgs, secret, shown};
use crate::cli::COMMAND_POOL;
use crate::consumer::RuntimeSettings;
use crate::shard_move::{self, MoveDatabases, MoveRequest};

/// The unsharded consumer, and the base of the partition consumers' names.
const CONSUMER: &str = "inventory-reserve-stock";

/// The most partitions `init` makes: one durable consumer each, and a partition's number must
/// fit the `smallint` of `partition_owner`.
const MAX_PARTITIONS: u32 = 1024;

/// How long `init` waits by default for the unsharded consumer to finish what came before the
/// cut-over.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(60);

/// How long a session idle in a transaction may block a move's fence by default.
const IDLE_GRACE: Duration = Duration::from_secs(10);

/// How long a move pauses its partition's consumer at most by default.
const PAUSE_FOR: Duration = Duration::from_secs(300);

/// The consumer flag of the shard commands.
#[derive(Debug, Clone, clap::Args)]
pub struct ConsumerArgs {
    /// The unsharded durable consumer, and the base of the partition consumers' names
    /// (`<consumer>-p07`, `<consumer>-unroutable`): serve's --consumer.
    #[arg(long, default_value = CONSUMER)]
    pub consumer: String,
}

#[derive(Debug, Subcommand)]
pub enum ShardCommand {
    /// Shards the orders stream by book: sets its subject transform onto P partitions, creates
    /// the assignment bucket, a durable consumer per partition and one for what no partition
    /// takes, and retires the unsharded consumer once it has finished what was stored before.
    /// Run it while the unsharded `serve` runs; run it again to resume one that stopped.
    Init {
        /// How many partitions; never changed once set (every book's partition would move).
        #[arg(long, default_value_t = DEFAULT_PARTITIONS, value_parser = partitions_count)]
        partitions: NonZeroU32,
        /// How long to wait for the unsharded consumer to finish the messages stored before the
        /// cut-over; past it init exits 1, leaving what it set up.
        #[arg(long, default_value = shown(DRAIN_TIMEOUT), value_parser = humantime::parse_duration)]
        drain_timeout: Duration,
        #[command(flatten)]
        consumer: ConsumerArgs,
        #[command(flatten)]
        nats: NatsArgs,
        #[command(flatten)]
        topology: TopologyArgs,
    },
    /// Assigns partitions with no owner to a shard: records each in the shard's database
    /// (DATABASE_URL), then claims it in the bucket. A partition owned by another shard is
    /// refused, and then the command exits 1 naming it.
    Assign {
        /// One partition (7) or a range (0-31).
        #[arg(long)]
        partitions: Partitions,
        /// The shard's name: letters, digits, `.`, `_` and `-`, up to 100.
        #[arg(long, value_parser = shard_name)]
        to: String,
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(flatten)]
        nats: NatsArgs,
        #[command(flatten)]
        topology: TopologyArgs,
    },
    /// Moves a partition to another shard, its books' stock, reservations and line
    /// cancellations with it, while placements keep arriving: pause its consumer, fence it on
    /// the old shard, copy its rows to the new one, wait for the old shard's relay to publish
    /// its events, hand it over in the bucket, activate it on the new shard, resume the
    /// consumer, remove its rows from the old shard. Each step is recorded in the bucket
    /// (`move.<P>`): run the same command again to resume a move that stopped, from any step.
    Move {
        /// The partition to move.
        #[arg(long)]
        partition: u32,
        /// The shard to move it to. Left out, the move under way is resumed (or aborted).
        #[arg(long, value_parser = shard_name)]
        to: Option<String>,
        /// Unwinds the move under way instead: refused once the partition may have been
        /// handed over.
        #[arg(long)]
        abort: bool,
        /// The database of the shard the partition leaves.
        #[arg(long, env = "INVENTORY_FROM_DATABASE_URL", value_parser = secret, hide_env_values = true)]
        from_database_url: SecretString,
        /// The database of the shard the partition goes to.
        #[arg(long, env = "INVENTORY_TO_DATABASE_URL", value_parser = secret, hide_env_values = true)]
        to_database_url: SecretString,
        /// How long a session idle in a transaction may block the fence (or the removal, or an
        /// abort's drop of the copy) before the mover terminates it (the role needs
        /// pg_signal_backend, or to be the session's).
        #[arg(long, default_value = shown(IDLE_GRACE), value_parser = humantime::parse_duration)]
        idle_grace: Duration,
        /// How long the partition's consumer stays paused at most (nats-server 2.11 or later):
        /// a pause lapses on its own if the move stops.
        #[arg(long, default_value = shown(PAUSE_FOR), value_parser = humantime::parse_duration)]
        pause_for: Duration,
        #[command(flatten)]
        consumer: ConsumerArgs,
        #[command(flatten)]
        nats: NatsArgs,
        #[command(flatten)]
        topology: TopologyArgs,
    },
    /// One line per partition: its shard, its consumer's pending and ack-pending messages, and
    /// a move under way with its step.
    Status {
        /// Prints a JSON array, one object per partition.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        consumer: ConsumerArgs,
        #[command(flatten)]
        nats: NatsArgs,
        #[command(flatten)]
        topology: TopologyArgs,
    },
    /// The partition of a book and the shard it is assigned to.
    Of {
        /// The book's UUID.
        #[arg(long)]
        book_id: BookId,
        /// Prints JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        nats: NatsArgs,
        #[command(flatten)]
        topology: TopologyArgs,
    },
}

fn partitions_count(value: &str) -> Result<NonZeroU32, String> {
    let count: NonZeroU32 = value.parse().map_err(|error| format!("{error}"))?;
    if count.get() > MAX_PARTITIONS {
        return Err(format!("at most {MAX_PARTITIONS}"));
    }
    Ok(count)
}

/// A shard's name as the bucket holds it: printable, and never a URL.
fn shard_name(value: &str) -> Result<String, String> {
    let valid = (1..=100).contains(&value.len())
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if valid {
        Ok(value.to_owned())
    } else {
        Err("letters, digits, `.`, `_` and `-`, 1 to 100 of them".to_owned())
    }
}

/// `--partitions` of `assign`: `N` or `A-B`, both ends included.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Partitions {
    pub first: u32,
    pub last: u32,
}

impl FromStr for Partitions {
    type Err = String;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        let number = |text: &str| {
            text.trim()
                .parse::<u32>()
                .map_err(|_| format!("{text:?} is not a partition number"))
        };
        let (first, last) = match value.split_once('-') {
            Some((first, last)) => (number(first)?, number(last)?),
            None => (number(value)?, number(value)?),
        };
        if first > last {
            return Err(format!("{first}-{last} is an empty range"));
        }
        Ok(Self { first, last })
    }
}

impl fmt::Display for Partitions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.first == self.last {
            write!(f, "{}", self.first)
        } else {
            write!(f, "{}-{}", self.first, self.last)
        }
    }
}

pub async fn run(command: ShardCommand) -> anyhow::Result<bool> {
    match command {
        ShardCommand::Init {
            partitions,
            drain_timeout,
            consumer,
            nats,
            topology,
        } => {
            let js = connect(&nats).await?;
            init(
                &js,
                &topology.topology(),
                partitions,
                consumer.consumer,
                drain_timeout,
            )
            .await
        }
        ShardCommand::Assign {
            partitions,
            to,
            database,
            nats,
            topology,
        } => {
            if database.url.database_url.is_none() {
                bail!("name the shard's database: DATABASE_URL (or --database-url)");
            }
            let js = connect(&nats).await?;
            let shards = open(&js, &topology.topology()).await?;
            let conn = db::open(
                database.url(),
                COMMAND_POOL,
                database.schema(),
                database.timeouts(),
            )
            .await
            .context("opening the shard's database")?;
            assign(&shards, &PartitionOwners::new(conn), partitions, &to).await
        }
        ShardCommand::Move {
            partition,
            to,
            abort,
            from_database_url,
            to_database_url,
            idle_grace,
            pause_for,
            consumer,
            nats,
            topology,
        } => {
            let js = connect(&nats).await?;
            let topology = topology.topology();
            let shards = open(&js, &topology).await?;
            let databases = MoveDatabases::open(
                from_database_url.expose_secret(),
                to_database_url.expose_secret(),
                shards.partitions(),
            )
            .await?;
            let request = MoveRequest {
                partition,
                to,
                abort,
                idle_grace,
                pause_for,
                consumer: consumer.consumer,
            };
            shard_move::run(&js, &topology, &shards, &databases, &request).await
        }
        ShardCommand::Status {
            json,
            consumer,
            nats,
            topology,
        } => {
            let js = connect(&nats).await?;
            let topology = topology.topology();
            let shards = open(&js, &topology).await?;
            let rows = status(&js, &topology, &shards, &consumer.consumer).await?;
            print_status(&rows, json)?;
            Ok(true)
        }
        ShardCommand::Of {
            book_id,
            json,
            nats,
            topology,
        } => {
            let js = connect(&nats).await?;
            let shards = open(&js, &topology.topology()).await?;
            let partition = partition_of(book_id, shards.partitions());
            let assignment = shards.assignment().await?;
            let shard = assignment.shard_of(partition);
            if json {
                let found = BookShard {
                    book_id: book_id.to_string(),
                    partition,
                    partitions: shards.partitions().get(),
                    shard,
                };
                println!("{}", serde_json::to_string_pretty(&found)?);
            } else {
                println!(
                    "book {book_id}: partition {partition} of {}, shard {}",
                    shards.partitions(),
                    shard.unwrap_or("unassigned")
                );
            }
            Ok(true)
        }
    }
}

async fn connect(nats: &NatsArgs) -> anyhow::Result<Context> {
    Ok(jetstream::context(nats.connect("inventory shard").await?))
}

/// The bucket, or an error saying the stream is not sharded.
async fn open(js: &Context, topology: &Topology) -> anyhow::Result<Shards> {
    Shards::open(js, topology).await?.with_context(|| {
        format!(
            "stream {} is not sharded (no bucket {}): run `inventory shard init` first",
            topology.stream,
            jetstream::shards_bucket(topology)
        )
    })
}

async fn init(
    js: &Context,
    topology: &Topology,
    partitions: NonZeroU32,
    consumer: String,
    drain_timeout: Duration,
) -> anyhow::Result<bool> {
    let settings = InitSettings {
        partitions,
        consumer,
        ack_wait: RuntimeSettings::ACK_WAIT,
        max_ack_pending: RuntimeSettings::MAX_ACK_PENDING,
        drain_timeout,
    };
    println!(
        "sharding stream {} into {partitions} partitions; waiting up to {} for consumer {} to \
         finish what came before",
        topology.stream,
        humantime::format_duration(drain_timeout),
        settings.consumer
    );
    let report = jetstream::init(js, topology, &settings).await?;
    let unroutable = unroutable_consumer(&settings.consumer);
    let found = |done: bool| if done { "created" } else { "found" };
    println!("bucket {}: {}", report.bucket, found(report.bucket_created));
    println!(
        "partition consumers {}..{}: {} created, the others found; they deliver from sequence {}",
        partition_consumer(&settings.consumer, 0, partitions),
        partition_consumer(&settings.consumer, partitions.get() - 1, partitions),
        report.partition_consumers_created,
        report.partitions_start
    );
    println!(
        "consumer {}: {}",
        settings.consumer,
        if report.narrowed {
            "narrowed to the subjects without a partition"
        } else {
            "already narrowed, or gone"
        }
    );
    println!(
        "transform {}: {}",
        jetstream::partition_transform(topology, partitions).destination,
        if report.transform_set { "set" } else { "found" }
    );
    println!(
        "consumer {}: {}; it delivers from sequence {}",
        unroutable,
        found(report.unroutable_created),
        report.unroutable_start
    );
    println!(
        "consumer {}: {}",
        settings.consumer,
        if report.unsharded_deleted {
            "finished what came before; deleted"
        } else {
            "gone already"
        }
    );
    println!(
        "stream {} is sharded; assign its partitions with `inventory shard assign`",
        topology.stream
    );
    Ok(true)
}

/// What became of one partition `assign` was asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Assigned {
    Now,
    Already,
    Refused(String),
}

async fn assign(
    shards: &Shards,
    owners: &PartitionOwners,
    asked: Partitions,
    shard: &str,
) -> anyhow::Result<bool> {
    let partitions = shards.partitions();
    if asked.last >= partitions.get() {
        bail!(
            "the stream has {partitions} partitions, 0-{}: {asked} is not among them",
            partitions.get() - 1
        );
    }
    let assignment = shards.assignment().await?;
    let mut refused = Vec::new();
    for partition in asked.first..=asked.last {
        let outcome = assign_one(
            shards,
            owners,
            assignment.shard_of(partition),
            partition,
            shard,
        )
        .await
        .with_context(|| format!("assigning partition {partition} to {shard}"))?;
        match outcome {
            Assigned::Now => println!("partition {partition}: assigned to {shard}"),
            Assigned::Already => println!("partition {partition}: {shard}'s already"),
            Assigned::Refused(why) => {
                println!("partition {partition}: refused: {why}");
                refused.push(partition);
            }
        }
    }
    if !refused.is_empty() {
        bail!(
            "refused partition{} {}: {} another shard's (`inventory shard status` shows whose)",
            if refused.len() == 1 { "" } else { "s" },
            refused
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            if refused.len() == 1 {
                "it is"
            } else {
                "they are"
            }
        );
    }
    Ok(true)
}

/// One partition: the database first, then the bucket's create, undone in the database if the
/// create lost.
async fn assign_one(
    shards: &Shards,
    owners: &PartitionOwners,
    owner: Option<&str>,
    partition: u32,
    shard: &str,
) -> anyhow::Result<Assigned> {
    if let Some(owner) = owner.filter(|owner| *owner != shard) {
        return Ok(Assigned::Refused(format!("owned by {owner}")));
    }
    let recorded = owners.record(partition, shard).await?;
    if let Recorded::OtherShard(other) = recorded {
        return Ok(Assigned::Refused(format!(
            "this database owns it as shard {other}"
        )));
    }
    if owner == Some(shard) {
        return Ok(Assigned::Already);
    }
    match shards.claim(partition, shard).await? {
        Claim::Created { .. } => Ok(Assigned::Now),
        Claim::Held(held) if held.shard == shard => Ok(Assigned::Already),
        Claim::Held(held) => {
            if recorded == Recorded::Inserted {
                owners.forget(partition, shard).await?;
            }
            Ok(Assigned::Refused(format!("owned by {}", held.shard)))
        }
    }
}

/// One partition as `status` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct PartitionStatus {
    pub partition: u32,
    /// Its owner, `None` when unassigned.
    pub shard: Option<String>,
    pub consumer: String,
    /// `None` when its consumer does not exist.
    pub pending: Option<u64>,
    pub ack_pending: Option<usize>,
    /// The partition's move under way, if any.
    #[serde(rename = "move")]
    pub moving: Option<MoveStatus>,
}

/// A move under way, as `status` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct MoveStatus {
    pub from: String,
    pub to: String,
    /// Its next step: `pause`, `fence`, `copy`, `drain`, `hand_over`, `activate`, `resume`,
    /// `remove`; an abort's `cancel_hand_over`, `unfence`, `drop_copy`, `resume_aborted`.
    pub step: inventory_infra::shard_move::Step,
    /// What the step waits for, when its mover said (a drain's unpublished events).
    pub waiting_for: Option<String>,
}

impl From<MoveRecord> for MoveStatus {
    fn from(record: MoveRecord) -> Self {
        Self {
            from: record.from,
            to: record.to,
            step: record.step,
            waiting_for: record.waiting_for,
        }
    }
}

impl fmt::Display for MoveStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} -> {}: {}", self.from, self.to, self.step)?;
        if let Some(waiting_for) = &self.waiting_for {
            write!(f, " (waiting for {waiting_for})")?;
        }
        Ok(())
    }
}

async fn status(
    js: &Context,
    topology: &Topology,
    shards: &Shards,
    consumer: &str,
) -> anyhow::Result<Vec<PartitionStatus>> {
    let assignment = shards.assignment().await?;
    let mut moves = shards.moves().await?;
    moves.retain(|_, record| !record.is_over());
    let partitions = shards.partitions();
    let names: Vec<String> = (0..partitions.get())
        .map(|partition| partition_consumer(consumer, partition, partitions))
        .collect();
    let states = jetstream::consumer_states(js, topology, &names).await?;
    Ok((0..)
        .zip(names.into_iter().zip(states))
        .map(|(partition, (name, state))| PartitionStatus {
            partition,
            shard: assignment.shard_of(partition).map(str::to_owned),
            consumer: name,
            pending: state.map(|state| state.pending),
            ack_pending: state.map(|state| state.ack_pending),
            moving: moves.remove(&partition).map(MoveStatus::from),
        })
        .collect())
}

fn print_status(rows: &[PartitionStatus], json: bool) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, rows)?;
        writeln!(out)?;
        return Ok(());
    }
    let shown = |value: Option<String>| value.unwrap_or_else(|| "-".to_owned());
    writeln!(
        out,
        "{:>9}  {:<24}  {:>9}  {:>11}  move",
        "partition", "shard", "pending", "ack-pending"
    )?;
    for row in rows {
        writeln!(
            out,
            "{:>9}  {:<24}  {:>9}  {:>11}  {}",
            row.partition,
            shown(row.shard.clone()),
            shown(row.pending.map(|n| n.to_string())),
            shown(row.ack_pending.map(|n| n.to_string())),
            shown(row.moving.as_ref().map(MoveStatus::to_string))
        )?;
    }
    Ok(())
}

/// What `shard of --json` prints.
#[derive(Debug, Serialize)]
struct BookShard<'a> {
    book_id: String,
    partition: u32,
    partitions: u32,
    /// `None` when unassigned.
    shard: Option<&'a str>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_are_one_or_a_range() {
        assert_eq!(
            "7".parse::<Partitions>(),
            Ok(Partitions { first: 7, last: 7 })
        );
        assert_eq!(
            "0-31".parse::<Partitions>(),
            Ok(Partitions { first: 0, last: 31 })
        );
        assert!("5-3".parse::<Partitions>().is_err());
        assert!("a-3".parse::<Partitions>().is_err());
        assert!("-3".parse::<Partitions>().is_err());
    }

    #[test]
    fn a_shard_name_is_never_a_url() {
        assert!(shard_name("shard-a.eu_1").is_ok());
        assert!(shard_name("postgres://u:p@db/x").is_err());
        assert!(shard_name("").is_err());
        assert!(shard_name(&"a".repeat(101)).is_err());
    }
}
