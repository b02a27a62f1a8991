//! `inventory shard move --partition P --to NAME`: runs a partition's move, step by step, from
//! its record in the assignment bucket. The decisions are infra's [`MoveRecord::next`] and
//! [`MoveRecord::abort`] (checked by their model); the statements are [`ShardRows`]'; this is
//! the loop that reads, acts, and records, and says what it did.
//!
//! Each turn reads the record afresh, so a mover started again after a crash, or running beside
//! another, goes on from whatever the record holds. A compare-and-set that loses means another
//! writer came first: read again. An action refused while the record still holds its step
//! means the world is not what the move left: the mover stops, and says why, for a person.

use std::time::{Duration, Instant};

use std::num::NonZeroU32;

use anyhow::{Context as _, anyhow};
use backon::{BackoffBuilder as _, Retryable as _};
use inventory_infra::db::{self, DbTimeouts, SchemaPolicy};
use inventory_infra::jetstream::{self, Context, Shards, Topology, partition_consumer};
use inventory_infra::shard_move::{
    Action, MoveRecord, Next, RowsError, Seen, ShardRows, Step, Unpublished,
};

use crate::cli::COMMAND_POOL;

/// What a move was asked for, besides where its databases are.
pub struct MoveRequest {
    pub partition: u32,
    /// The shard to move to: needed to begin a move, checked against the record to resume one.
    pub to: Option<String>,
    pub abort: bool,
    /// How long a session idle in a transaction may block the fence before it is terminated.
    pub idle_grace: Duration,
    /// How long the consumer's pause lasts at most: it lapses on its own if the move stops.
    pub pause_for: Duration,
    /// The partition consumers' base name.
    pub consumer: String,
}

/// The two databases of a move: the shard it leaves and the one it goes to.
pub struct MoveDatabases {
    pub from: ShardRows,
    pub to: ShardRows,
}

impl MoveDatabases {
    /// Opens both databases, their migrations applied, retrying as a turn of the move does: a
    /// mover run again during a failover waits for the new primary rather than stop at once.
    pub async fn open(from: &str, to: &str, partitions: NonZeroU32) -> anyhow::Result<Self> {
        let open = async |url: &str, flag: &str| {
            let opened = || {
                // The fence's watch for idle sessions, and the copy's read of the old shard
                // beside its write here, each want a connection of their own.
                db::open(
                    url,
                    COMMAND_POOL + 1,
                    SchemaPolicy::Migrate,
                    DbTimeouts::default(),
                )
            };
            let db = opened
                .retry(RETRIES.with_total_delay(Some(RETRY_FOR)))
                .notify(|error, _| tracing::warn!(%error, "opening the database of {flag}"))
                .await
                .with_context(|| format!("opening the database of {flag}"))?;
            anyhow::Ok(ShardRows::new(&db, partitions))
        };
        Ok(Self {
            from: open(from, "--from-database-url").await?,
            to: open(to, "--to-database-url").await?,
        })
    }
}

/// How often a drain looks again at the old shard's outbox.
const DRAIN_POLL: Duration = Duration::from_millis(500);

/// Runs the move of `request.partition` until it is done or aborted. Ok(true) then. A failure
/// of the databases or of NATS (a failover, a restart) is retried, for up to two minutes:
/// every step is safe to repeat, and a step whose commit is unknown is read again from what it
/// left.
pub async fn run(
    js: &Context,
    topology: &Topology,
    shards: &Shards,
    databases: &MoveDatabases,
    request: &MoveRequest,
) -> anyhow::Result<bool> {
    let partition = request.partition;
    // Whether this run has seen the move under way: a record found over afterwards is this
    // move's end, not a finished one to begin anew from.
    let mut under_way = false;
    let mut failing_since = None;
    let mut delays = RETRIES.build();
    loop {
        match turn(js, topology, shards, databases, request, &mut under_way).await {
            Ok(Turned::Again) => {
                failing_since = None;
                delays = RETRIES.build();
            }
            Ok(Turned::Over) => return Ok(true),
            Err(Failure::Stop(error)) => return Err(error),
            Err(Failure::Transient(error)) => {
                let since = *failing_since.get_or_insert_with(Instant::now);
                let delay = delays.next().unwrap_or(Duration::from_secs(5));
                if since.elapsed() + delay > RETRY_FOR {
                    return Err(error.context(format!(
                        "partition {partition}: failing for {}; run the same command again to \
                         resume",
                        humantime::format_duration(RETRY_FOR)
                    )));
                }
                tracing::warn!(
                    partition,
                    error = format!("{error:#}"),
                    "retrying the move's turn"
                );
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// How long a move retries a failing database or NATS before it stops.
const RETRY_FOR: Duration = Duration::from_secs(120);

/// After 200 ms, doubling up to 5 s.
const RETRIES: backon::ExponentialBuilder = backon::ExponentialBuilder::new()
    .with_min_delay(Duration::from_millis(200))
    .with_max_delay(Duration::from_secs(5))
    .without_max_times();

/// What one turn came to.
enum Turned {
    Again,
    Over,
}

/// Why a turn failed: worth another turn, or for a person.
#[derive(Debug)]
enum Failure {
    Transient(anyhow::Error),
    Stop(anyhow::Error),
}

impl From<anyhow::Error> for Failure {
    fn from(error: anyhow::Error) -> Self {
        Self::Stop(error)
    }
}

impl From<jetstream::NatsError> for Failure {
    fn from(error: jetstream::NatsError) -> Self {
        Self::Transient(error.into())
    }
}

impl From<RowsError> for Failure {
    fn from(error: RowsError) -> Self {
        match error {
            RowsError::Database(_) => Self::Transient(error.into()),
            other => Self::Stop(other.into()),
        }
    }
}

/// One turn: read the record and what its step needs, act, record the next step.
async fn turn(
    js: &Context,
    topology: &Topology,
    shards: &Shards,
    databases: &MoveDatabases,
    request: &MoveRequest,
    under_way: &mut bool,
) -> Result<Turned, Failure> {
    let partition = request.partition;
    let stored = shards.move_of(partition).await?;
    let stored = match stored {
        Some(stored) if !stored.record.is_over() => stored,
        finished if *under_way => {
            let step = finished.map_or(Step::Done, |stored| stored.record.step);
            println!("partition {partition}: {step}");
            return Ok(Turned::Over);
        }
        finished => {
            begin(shards, databases, request, finished.map(|f| f.revision)).await?;
            *under_way = true;
            return Ok(Turned::Again);
        }
    };
    let record = &stored.record;
    if let Some(to) = request.to.as_deref()
        && to != record.to
    {
        return Err(anyhow!(
            "partition {partition} is moving to {} already: run again with --to {} to \
             resume it, or with --abort to unwind it",
            record.to,
            record.to
        )
        .into());
    }
    // Once a run (`begin` checked them for a move it began): the databases named do not change
    // under it, and a drain's turns come every half second.
    if !*under_way {
        check_databases(databases, record).await?;
    }
    *under_way = true;
    if request.abort && !aborting(record.step) {
        let aborted = record.abort().map_err(anyhow::Error::from)?;
        if shards
            .write_move(&aborted, Some(stored.revision))
            .await?
            .is_some()
        {
            println!("partition {partition}: aborting the move to {}", record.to);
        }
        return Ok(Turned::Again);
    }
    let seen = Seen {
        assigned: shards.owner(partition).await?,
        unpublished: 0,
    };
    let (seen, drain) = if record.step == Step::Drain {
        let drain = databases.from.unpublished(partition).await?;
        (
            Seen {
                unpublished: drain.rows,
                ..seen
            },
            Some(drain),
        )
    } else {
        (seen, None)
    };
    match record.next(&seen) {
        Next::Over => {}
        Next::Wait => {
            let waiting_for = drain.as_ref().map(waiting_for);
            if waiting_for != record.waiting_for {
                println!(
                    "partition {partition}: drain: waiting for {}",
                    waiting_for.as_deref().unwrap_or("the old shard")
                );
                let noted = MoveRecord {
                    waiting_for,
                    ..record.clone()
                };
                shards.write_move(&noted, Some(stored.revision)).await?;
            }
            tokio::time::sleep(DRAIN_POLL).await;
        }
        Next::Stuck { assigned } => Err(anyhow!(
            "partition {partition} is assigned to {}, neither {} nor {}: the move stops \
             here for a person to look (`inventory shard status`)",
            assigned.as_deref().unwrap_or("no shard"),
            record.from,
            record.to
        ))?,
        Next::Advance(then) => {
            if shards
                .write_move(&then, Some(stored.revision))
                .await?
                .is_some()
            {
                println!("partition {partition}: {} → {}", record.step, then.step);
            }
        }
        Next::Do { action, then } => {
            let done = act(js, topology, shards, databases, request, record, action).await;
            match done {
                Ok(said) => {
                    if shards
                        .write_move(&then, Some(stored.revision))
                        .await?
                        .is_some()
                    {
                        println!("partition {partition}: {}: {said}", record.step);
                    }
                }
                // Another writer's compare-and-set of the key came first: the next turn
                // reads from the key which.
                Err(ActError::Lost) => {}
                Err(refused @ ActError::Refused(_)) => {
                    let now = shards.move_of(partition).await?;
                    if now.is_some_and(|now| now.revision == stored.revision) {
                        return Err(Failure::Stop(anyhow::Error::new(refused).context(format!(
                            "partition {partition}: the move stops at {} for a person to \
                                 look: what it found is not what it left",
                            record.step
                        ))));
                    }
                }
                Err(ActError::Rows(error)) => return Err(error.into()),
                Err(ActError::Nats(error)) => return Err(error.into()),
            }
        }
    }
    Ok(Turned::Again)
}

/// Creates the move's record, or replaces a finished one at `finished`'s revision.
async fn begin(
    shards: &Shards,
    databases: &MoveDatabases,
    request: &MoveRequest,
    finished: Option<u64>,
) -> Result<(), Failure> {
    let partition = request.partition;
    if request.abort {
        return Err(anyhow!("partition {partition} has no move under way to abort").into());
    }
    let to = request
        .to
        .as_deref()
        .with_context(|| format!("--to NAME: the shard to move partition {partition} to"))?;
    if partition >= shards.partitions().get() {
        return Err(anyhow!(
            "the stream has {} partitions, 0-{}: {partition} is not among them",
            shards.partitions(),
            shards.partitions().get() - 1
        )
        .into());
    }
    let assigned = shards.owner(partition).await?;
    let owner_row = databases.from.owner(partition).await?;
    let record =
        MoveRecord::begin(partition, to, assigned, owner_row).map_err(anyhow::Error::from)?;
    check_databases(databases, &record).await?;
    if shards.write_move(&record, finished).await?.is_some() {
        println!(
            "partition {partition}: moving from {} to {} (epoch {})",
            record.from, record.to, record.epoch
        );
    }
    Ok(())
}

/// The databases named must be the record's shards': neither holds partitions under another
/// shard's name.
async fn check_databases(databases: &MoveDatabases, record: &MoveRecord) -> Result<(), Failure> {
    for (flag, rows, shard) in [
        ("--from-database-url", &databases.from, &record.from),
        ("--to-database-url", &databases.to, &record.to),
    ] {
        let others = rows.other_names(shard).await?;
        if !others.is_empty() {
            return Err(anyhow!(
                "{flag} names the database of shard {}, not of shard {shard}",
                others.join(", ")
            )
            .into());
        }
    }
    Ok(())
}

fn aborting(step: Step) -> bool {
    matches!(
        step,
        Step::CancelHandOver | Step::Unfence | Step::DropCopy | Step::ResumeAborted
    )
}

/// What the drain waits for, as `shard status` shows it.
fn waiting_for(drain: &Unpublished) -> String {
    let mut said = format!("{} unpublished event(s) on the old shard", drain.rows);
    if drain.parked > 0 {
        said.push_str(&format!(
            ", {} parked ({}): `inventory outbox retry` after fixing it",
            drain.parked,
            drain
                .parked_reason
                .as_deref()
                .unwrap_or("no reason recorded")
        ));
    }
    said
}

#[derive(Debug, thiserror::Error)]
enum ActError {
    #[error("{0}")]
    Refused(String),
    #[error("another writer changed the partition's key first")]
    Lost,
    #[error(transparent)]
    Rows(RowsError),
    #[error(transparent)]
    Nats(#[from] jetstream::NatsError),
}

impl From<RowsError> for ActError {
    fn from(error: RowsError) -> Self {
        match error {
            RowsError::Refused(why) => Self::Refused(why),
            other => Self::Rows(other),
        }
    }
}

/// Does `action` of `record`'s step: what it did, to print.
async fn act(
    js: &Context,
    topology: &Topology,
    shards: &Shards,
    databases: &MoveDatabases,
    request: &MoveRequest,
    record: &MoveRecord,
    action: Action,
) -> Result<String, ActError> {
    let partition = record.partition;
    let consumer = partition_consumer(&request.consumer, partition, shards.partitions());
    let (epoch, new_epoch) = (record.epoch, record.new_epoch());
    Ok(match action {
        Action::PauseConsumer => {
            let paused =
                jetstream::pause_consumer(js, topology, &consumer, Some(request.pause_for)).await?;
            if paused {
                format!(
                    "consumer {consumer} paused for at most {}",
                    humantime::format_duration(request.pause_for)
                )
            } else {
                format!(
                    "consumer {consumer} not paused (nats-server before 2.11 has no pause): its \
                     deliveries go on and are not owned on either shard until the hand-over"
                )
            }
        }
        Action::Fence => {
            databases
                .from
                .fence(partition, epoch, request.idle_grace)
                .await?;
            format!("{} fenced at epoch {epoch}", record.from)
        }
        Action::Copy => {
            let copied = databases
                .to
                .copy_from(&databases.from, partition, (epoch, new_epoch), &record.to)
                .await?;
            format!(
                "{} book(s), {} reservation(s), {} line cancellation(s) copied to {}, incoming \
                 at epoch {new_epoch}",
                copied.books, copied.reservations, copied.line_cancellations, record.to
            )
        }
        Action::HandOver => {
            if !shards
                .reassign(partition, &record.to, record.assigned_revision)
                .await?
            {
                return Err(ActError::Lost);
            }
            format!("assigned to {}", record.to)
        }
        Action::Activate => {
            databases.to.activate(partition, new_epoch).await?;
            format!("{} active at epoch {new_epoch}", record.to)
        }
        Action::ResumeConsumer => {
            if jetstream::pause_consumer(js, topology, &consumer, None).await? {
                format!("consumer {consumer} resumed")
            } else {
                format!("consumer {consumer} was not paused")
            }
        }
        Action::Remove => {
            let removed = databases
                .from
                .remove(partition, epoch, request.idle_grace)
                .await?;
            format!(
                "{} book(s), {} reservation(s), {} line cancellation(s) removed from {}",
                removed.books, removed.reservations, removed.line_cancellations, record.from
            )
        }
        Action::CancelHandOver => {
            if !shards
                .reassign(partition, &record.from, record.assigned_revision)
                .await?
            {
                return Err(ActError::Lost);
            }
            format!(
                "assigned to {} again: the hand-over cannot happen",
                record.from
            )
        }
        Action::Unfence => {
            databases
                .from
                .unfence(partition, (epoch, new_epoch))
                .await?;
            format!("{} active again at epoch {new_epoch}", record.from)
        }
        Action::DropCopy => {
            let dropped = databases
                .to
                .drop_copy(partition, request.idle_grace)
                .await?;
            format!(
                "the copy dropped from {}: {} book(s), {} reservation(s)",
                record.to, dropped.books, dropped.reservations
            )
        }
    })
}
