//! Stock sharded by book, on the NATS side: the orders stream's subject transform that maps
//! `<prefix>.<event>.<book>` onto P partitions, the bucket that says which shard owns each
//! partition ([`Shards`]), the consumers of the partitions, and [`init`], which turns an
//! unsharded stream into a sharded one.
//!
//! The assignment is a KV bucket (`<orders stream>_SHARDS`) whose keys are `partition.<n>` and
//! whose values are shard names. It is only ever changed by compare-and-set: a key is created
//! when it does not exist, or updated at the revision its writer read, so two operators racing
//! for one partition cannot both win.
//!
//! P lives in one place, the transform's destination (`{{partition(P,2)}}`): every reader
//! parses it back from the stream's configuration, so no flag or second record can disagree
//! with what the server does.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{self, AckPolicy, DeliverPolicy};
use async_nats::jetstream::context::KeyValueErrorKind;
use async_nats::jetstream::kv::{self, CreateErrorKind, Operation, UpdateErrorKind};
use async_nats::jetstream::stream::{self, SubjectTransform};
use futures::{Stream, StreamExt as _, TryStreamExt as _};

use crate::shard_move::MoveRecord;

use super::{
    ConsumerState, Context, NatsError, Topology, ensure_streams, is_consumer_not_found,
    is_missing_stream, nats_error, patiently,
};

/// The KV bucket of the assignment of `topology`'s orders stream: `ORDERS_SHARDS`.
pub fn shards_bucket(topology: &Topology) -> String {
    format!("{}_SHARDS", topology.stream)
}

/// The key of `partition` in the bucket.
pub fn partition_key(partition: u32) -> String {
    format!("partition.{partition}")
}

/// The durable consumer of `partition`: `inventory-reserve-stock-p07`, the number zero-padded
/// to the width of the highest partition so that the names sort in partition order.
pub fn partition_consumer(base: &str, partition: u32, partitions: NonZeroU32) -> String {
    let width = (partitions.get() - 1).to_string().len();
    format!("{base}-p{partition:0width$}")
}

/// The consumer of what no partition takes: `inventory-reserve-stock-unroutable`.
pub fn unroutable_consumer(base: &str) -> String {
    format!("{base}-unroutable")
}

/// What the consumer of `partition` reads: `orders.*.<p>.*`, the transformed subjects.
pub fn partition_filter(topology: &Topology, partition: u32) -> String {
    format!("{}.*.{partition}.*", topology.subject_prefix)
}

/// What the unroutable consumer reads: `orders.*`, an event without a book (an order-level
/// cancellation, an old producer's placement), and `orders.*.*`, an event with its book stored
/// before the transform took effect. The transform leaves neither shape behind it, so these never
/// overlap a partition's filter.
pub fn unroutable_filters(topology: &Topology) -> Vec<String> {
    let prefix = &topology.subject_prefix;
    vec![format!("{prefix}.*"), format!("{prefix}.*.*")]
}

/// The orders stream's transform onto `partitions`: `orders.placed.<book>` is stored as
/// `orders.placed.<partition_of(book)>.<book>`. The partition function hashes the second
/// wildcard's token, the book (FNV-1a, as `inventory_domain::shard::partition_of`).
pub fn partition_transform(topology: &Topology, partitions: NonZeroU32) -> SubjectTransform {
    let prefix = &topology.subject_prefix;
    SubjectTransform {
        source: format!("{prefix}.*.*"),
        destination: format!(
            "{prefix}.{{{{wildcard(1)}}}}.{{{{partition({partitions},2)}}}}.{{{{wildcard(2)}}}}"
        ),
    }
}

/// What the stream's configuration says of its partitions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Partitioning {
    /// No subject transform: an unsharded stream.
    None,
    /// The transform [`partition_transform`] makes, onto this many partitions.
    Partitions(NonZeroU32),
    /// A transform this service did not make; nothing here touches it.
    Foreign(SubjectTransform),
}

/// Reads the partitions back from `config`'s subject transform.
pub fn partitioning(topology: &Topology, config: &stream::Config) -> Partitioning {
    let Some(transform) = &config.subject_transform else {
        return Partitioning::None;
    };
    let count = transform
        .destination
        .split_once("{{partition(")
        .and_then(|(_, rest)| rest.split_once(",2)}}"))
        .and_then(|(count, _)| count.trim().parse::<NonZeroU32>().ok());
    match count {
        Some(partitions) if partition_transform(topology, partitions) == *transform => {
            Partitioning::Partitions(partitions)
        }
        _ => Partitioning::Foreign(transform.clone()),
    }
}

/// The shard that owns a partition, and the bucket revision that says so: an update must name
/// it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Owner {
    pub shard: String,
    pub revision: u64,
}

/// Which shard owns each partition, as the bucket held it when read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    pub partitions: NonZeroU32,
    /// Partitions with an owner; one absent has none.
    pub owners: BTreeMap<u32, Owner>,
}

impl Assignment {
    /// The partitions `shard` owns, in order.
    pub fn partitions_of(&self, shard: &str) -> Vec<u32> {
        self.owners
            .iter()
            .filter(|(_, owner)| owner.shard == shard)
            .map(|(partition, _)| *partition)
            .collect()
    }

    /// The shard that owns `partition`, if any.
    pub fn shard_of(&self, partition: u32) -> Option<&str> {
        self.owners
            .get(&partition)
            .map(|owner| owner.shard.as_str())
    }
}

/// What a claim of a partition came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The key did not exist; it now names the claimant, at this revision.
    Created { revision: u64 },
    /// The key exists already, naming this owner (perhaps the claimant itself).
    Held(Owner),
}

/// The assignment bucket of a sharded orders stream.
#[derive(Debug, Clone)]
pub struct Shards {
    store: kv::Store,
    partitions: NonZeroU32,
}

impl Shards {
    /// The bucket of `topology`'s orders stream; `None` when there is none (an unsharded
    /// deployment). A bucket beside a stream without this service's transform is an error: a
    /// `shard init` that did not finish, or a transform changed by hand.
    pub async fn open(js: &Context, topology: &Topology) -> Result<Option<Self>, NatsError> {
        let Some(store) = open_bucket(js, topology).await? else {
            return Ok(None);
        };
        let stream = js
            .get_stream(&topology.stream)
            .await
            .map_err(nats_error(format!("reading stream {}", topology.stream)))?;
        match partitioning(topology, &stream.cached_info().config) {
            Partitioning::Partitions(partitions) => Ok(Some(Self { store, partitions })),
            other => Err(NatsError::found(
                format!("opening the shards bucket {}", shards_bucket(topology)),
                format!(
                    "stream {} has {}: `inventory shard init` did not finish; run it again",
                    topology.stream,
                    match other {
                        Partitioning::Foreign(transform) => format!(
                            "a subject transform it did not set ({} -> {})",
                            transform.source, transform.destination
                        ),
                        _ => "no partition transform".to_owned(),
                    }
                ),
            )),
        }
    }

    /// P, as the stream's transform says.
    pub fn partitions(&self) -> NonZeroU32 {
        self.partitions
    }

    /// The assignment as the bucket holds it now.
    pub async fn assignment(&self) -> Result<Assignment, NatsError> {
        let doing = || format!("reading the shards bucket {}", self.store.name);
        let keys: Vec<String> = self
            .store
            .keys()
            .await
            .map_err(nats_error(doing()))?
            .try_collect()
            .await
            .map_err(nats_error(doing()))?;
        let mut owners = BTreeMap::new();
        for key in keys {
            let Some(partition) = partition_of_key(&key) else {
                continue;
            };
            // Deleted between the listing and the read: no owner.
            if let Some(entry) = self.store.entry(key).await.map_err(nats_error(doing()))?
                && entry.operation == Operation::Put
            {
                owners.insert(partition, owner_of(&entry));
            }
        }
        Ok(Assignment {
            partitions: self.partitions,
            owners,
        })
    }

    /// The assignment now, then again after each change to it. Built on a watch of the whole
    /// bucket opened before the first read, so that no change between the two is missed; an
    /// entry older than what was read is skipped, and an assignment is given only when it
    /// changed.
    pub async fn watch(
        &self,
    ) -> Result<impl Stream<Item = Result<Assignment, NatsError>> + use<>, NatsError> {
        let name = self.store.name.clone();
        let watch = self
            .store
            .watch_all()
            .await
            .map_err(nats_error(format!("watching the shards bucket {name}")))?;
        let first = self.assignment().await?;
        // The revision each key was last seen at, deletes included.
        let seen: BTreeMap<u32, u64> = first
            .owners
            .iter()
            .map(|(partition, owner)| (*partition, owner.revision))
            .collect();
        let changes = watch.scan((first.clone(), seen), move |(assignment, seen), entry| {
            let next = match entry {
                Err(error) => Some(Some(Err(nats_error(format!(
                    "watching the shards bucket {name}"
                ))(error)))),
                Ok(entry) => {
                    let shard = (entry.operation == Operation::Put).then(|| owner_of(&entry).shard);
                    let changed = partition_of_key(&entry.key).is_some_and(|partition| {
                        apply(assignment, seen, partition, entry.revision, shard)
                    });
                    Some(changed.then(|| Ok(assignment.clone())))
                }
            };
            std::future::ready(next)
        });
        Ok(futures::stream::once(std::future::ready(Ok(first)))
            .chain(changes.filter_map(std::future::ready)))
    }

    /// Claims `partition` for `shard` if it has no owner: a KV create, which fails when the key
    /// exists, so of two claimants exactly one wins.
    pub async fn claim(&self, partition: u32, shard: &str) -> Result<Claim, NatsError> {
        let key = partition_key(partition);
        let doing = || format!("claiming partition {partition} for shard {shard}");
        match self.store.create(&key, shard.to_owned().into()).await {
            Ok(revision) => Ok(Claim::Created { revision }),
            Err(error) if error.kind() == CreateErrorKind::AlreadyExists => {
                let entry = self.store.entry(key).await.map_err(nats_error(doing()))?;
                match entry {
                    Some(entry) if entry.operation == Operation::Put => {
                        Ok(Claim::Held(owner_of(&entry)))
                    }
                    // Deleted again since: the claim lost to a change, not to an owner.
                    _ => Err(NatsError::found(
                        doing(),
                        "the key changed while it was claimed; try again",
                    )),
                }
            }
            Err(error) => Err(nats_error(doing())(error)),
        }
    }
}

/// A partition's move record as the bucket holds it, and its revision: the next step's
/// compare-and-set names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMove {
    pub record: MoveRecord,
    pub revision: u64,
}

impl Shards {
    /// The owner of `partition` now, with its key's revision; `None` when it has none.
    pub async fn owner(&self, partition: u32) -> Result<Option<Owner>, NatsError> {
        let entry = self
            .store
            .entry(partition_key(partition))
            .await
            .map_err(nats_error(format!(
                "reading the owner of partition {partition}"
            )))?;
        Ok(entry
            .filter(|entry| entry.operation == Operation::Put)
            .map(|entry| owner_of(&entry)))
    }

    /// Names `shard` the owner of `partition` if its key is still at `revision`: the
    /// hand-over of a move and an abort's cancellation of it. `false`: the key was changed
    /// since, and nothing was written.
    pub async fn reassign(
        &self,
        partition: u32,
        shard: &str,
        revision: u64,
    ) -> Result<bool, NatsError> {
        let written = self
            .store
            .update(partition_key(partition), shard.to_owned().into(), revision)
            .await;
        match written {
            Ok(_) => Ok(true),
            Err(error) if error.kind() == UpdateErrorKind::WrongLastRevision => Ok(false),
            Err(error) => Err(nats_error(format!(
                "assigning partition {partition} to {shard} at revision {revision}"
            ))(error)),
        }
    }

    /// The move record of `partition`, if one was ever written.
    pub async fn move_of(&self, partition: u32) -> Result<Option<StoredMove>, NatsError> {
        let doing = || format!("reading the move of partition {partition}");
        let entry = self
            .store
            .entry(move_key(partition))
            .await
            .map_err(nats_error(doing()))?;
        let Some(entry) = entry.filter(|entry| entry.operation == Operation::Put) else {
            return Ok(None);
        };
        let record = serde_json::from_slice(&entry.value).map_err(|error| {
            NatsError::found(
                doing(),
                format!("a move record that does not parse: {error}"),
            )
        })?;
        Ok(Some(StoredMove {
            record,
            revision: entry.revision,
        }))
    }

    /// Every partition's move record, by partition.
    pub async fn moves(&self) -> Result<BTreeMap<u32, MoveRecord>, NatsError> {
        let keys: Vec<String> = self
            .store
            .keys()
            .await
            .map_err(nats_error("listing the moves"))?
            .try_collect()
            .await
            .map_err(nats_error("listing the moves"))?;
        let mut moves = BTreeMap::new();
        for partition in keys.iter().filter_map(|key| key.strip_prefix("move.")) {
            let Ok(partition) = partition.parse() else {
                continue;
            };
            if let Some(stored) = self.move_of(partition).await? {
                moves.insert(partition, stored.record);
            }
        }
        Ok(moves)
    }

    /// Writes `record` as its partition's move: created when `revision` is `None` (refused if
    /// a record exists), else at `revision`. `None`: another writer came first; read again.
    pub async fn write_move(
        &self,
        record: &MoveRecord,
        revision: Option<u64>,
    ) -> Result<Option<u64>, NatsError> {
        let key = move_key(record.partition);
        let doing = || format!("recording the move of partition {}", record.partition);
        let value = serde_json::to_vec(record)
            .map_err(|error| NatsError::found(doing(), error.to_string()))?;
        match revision {
            None => match self.store.create(&key, value.into()).await {
                Ok(revision) => Ok(Some(revision)),
                Err(error) if error.kind() == CreateErrorKind::AlreadyExists => Ok(None),
                Err(error) => Err(nats_error(doing())(error)),
            },
            Some(revision) => match self.store.update(&key, value.into(), revision).await {
                Ok(revision) => Ok(Some(revision)),
                Err(error) if error.kind() == UpdateErrorKind::WrongLastRevision => Ok(None),
                Err(error) => Err(nats_error(doing())(error)),
            },
        }
    }
}

/// The key of `partition`'s move record: `move.<n>`, beside the assignment's keys, which its
/// readers skip.
pub fn move_key(partition: u32) -> String {
    format!("move.{partition}")
}

/// A change a watch saw of `partition`'s key at `revision` (`shard`: its new owner, `None`
/// when deleted), applied to `assignment` unless it is no newer than what was seen of the key:
/// whether the assignment changed.
fn apply(
    assignment: &mut Assignment,
    seen: &mut BTreeMap<u32, u64>,
    partition: u32,
    revision: u64,
    shard: Option<String>,
) -> bool {
    if seen.get(&partition).is_some_and(|seen| *seen >= revision) {
        return false;
    }
    seen.insert(partition, revision);
    let before = assignment.owners.get(&partition).cloned();
    match shard {
        Some(shard) => {
            assignment
                .owners
                .insert(partition, Owner { shard, revision });
        }
        None => {
            assignment.owners.remove(&partition);
        }
    }
    // A new revision of the same owner is a change too: an update must name the new one.
    assignment.owners.get(&partition) != before.as_ref()
}

fn owner_of(entry: &kv::Entry) -> Owner {
    Owner {
        shard: String::from_utf8_lossy(&entry.value).into_owned(),
        revision: entry.revision,
    }
}

fn partition_of_key(key: &str) -> Option<u32> {
    key.strip_prefix("partition.")?.parse().ok()
}

/// The bucket, or `None` when its stream does not exist.
async fn open_bucket(js: &Context, topology: &Topology) -> Result<Option<kv::Store>, NatsError> {
    let bucket = shards_bucket(topology);
    let doing = || format!("opening the shards bucket {bucket}");
    match js.get_key_value(&bucket).await {
        Ok(store) => Ok(Some(store)),
        Err(error) if error.kind() == KeyValueErrorKind::GetBucket => {
            // The lookup of its stream failed: absent, or the lookup itself failed.
            match js.get_stream(format!("KV_{bucket}")).await {
                Err(lookup) if is_missing_stream(&lookup) => Ok(None),
                Err(lookup) => Err(nats_error(doing())(lookup)),
                Ok(_) => Err(nats_error(doing())(error)),
            }
        }
        Err(error) => Err(nats_error(doing())(error)),
    }
}

/// The version of the server `js` talks to, as `(major, minor)`, from its INFO.
pub fn server_version(js: &Context) -> Option<(u32, u32)> {
    let version = js.client().server_info().version;
    let mut parts = version.trim_start_matches('v').split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Pauses the consumer `name` of `topology`'s orders stream for `pause` (it lapses on its own
/// after), or resumes it (`None`). `false`: the server is older than 2.11 and has no pause;
/// nothing was done.
pub async fn pause_consumer(
    js: &Context,
    topology: &Topology,
    name: &str,
    pause: Option<Duration>,
) -> Result<bool, NatsError> {
    if server_version(js).is_some_and(|version| version < (2, 11)) {
        return Ok(false);
    }
    let doing = || {
        let what = if pause.is_some() {
            "pausing"
        } else {
            "resuming"
        };
        format!("{what} consumer {name}")
    };
    let stream = js
        .get_stream(&topology.stream)
        .await
        .map_err(nats_error(doing()))?;
    match pause {
        Some(pause) => stream
            .pause_consumer(name, async_nats::datetime::now() + pause)
            .await
            .map_err(nats_error(doing()))?,
        None => stream
            .resume_consumer(name)
            .await
            .map_err(nats_error(doing()))?,
    };
    Ok(true)
}

/// The pending and ack-pending counts of each of `names`, consumers of `topology`'s orders
/// stream; `None` for one that does not exist.
pub async fn consumer_states(
    js: &Context,
    topology: &Topology,
    names: &[String],
) -> Result<Vec<Option<ConsumerState>>, NatsError> {
    let stream = js
        .get_stream(&topology.stream)
        .await
        .map_err(nats_error(format!("reading stream {}", topology.stream)))?;
    let mut states = Vec::with_capacity(names.len());
    for name in names {
        states.push(
            consumer_info(&stream, name)
                .await?
                .map(|info| ConsumerState {
                    pending: info.num_pending,
                    ack_pending: info.num_ack_pending,
                    redelivered: info.num_redelivered,
                }),
        );
    }
    Ok(states)
}

/// How `shard init` runs.
#[derive(Debug, Clone)]
pub struct InitSettings {
    pub partitions: NonZeroU32,
    /// The unsharded durable consumer, and the base of the new consumers' names.
    pub consumer: String,
    /// The new consumers' ack wait and max ack pending: `serve`'s defaults.
    pub ack_wait: Duration,
    pub max_ack_pending: i64,
    /// How long to wait for the unsharded consumer to finish what was stored before the
    /// cut-over.
    pub drain_timeout: Duration,
}

/// Why `shard init` stopped without finishing.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error(
        "nats-server {version} has no stream subject transforms: sharding needs nats-server 2.10 \
         or later"
    )]
    ServerTooOld { version: String },
    #[error(
        "stream {stream} is sharded into {existing} partitions already (its subject transform); \
         asked for {asked}. The count never changes in place: every book's partition would move"
    )]
    OtherPartitions {
        stream: String,
        existing: NonZeroU32,
        asked: NonZeroU32,
    },
    #[error(
        "stream {stream} has a subject transform this service did not set ({from} -> {to}); \
         remove it first if it is not needed"
    )]
    ForeignTransform {
        stream: String,
        from: String,
        to: String,
    },
    #[error(
        "stream {stream} has its partition transform but no partition consumer to say where the \
         partitions start; create them by hand (deliver by start sequence after the last \
         message stored before the transform)"
    )]
    NoPartitionStart { stream: String },
    #[error(
        "consumer {consumer} did not finish the messages stored up to sequence {up_to} within \
         {timeout:?} ({pending} pending, {ack_pending} waiting for an ack, delivered up to \
         sequence {delivered}): the unsharded `inventory serve` that ran when init began must \
         finish them (one started now refuses: the stream is sharded). Everything set up so far \
         stays; run `inventory shard init` again to resume"
    )]
    NotDrained {
        consumer: String,
        up_to: u64,
        timeout: Duration,
        pending: u64,
        ack_pending: usize,
        delivered: u64,
    },
    #[error(transparent)]
    Nats(#[from] NatsError),
}

/// What `shard init` did; each step done before (a resumed init) is reported as found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitReport {
    pub partitions: NonZeroU32,
    pub bucket: String,
    pub bucket_created: bool,
    /// Partition consumers created now (the others existed).
    pub partition_consumers_created: u32,
    /// The first stream sequence the partition consumers deliver.
    pub partitions_start: u64,
    /// Whether the unsharded consumer was narrowed to the unsharded subjects now.
    pub narrowed: bool,
    pub transform_set: bool,
    pub unroutable_created: bool,
    /// The first stream sequence the unroutable consumer delivers; the unsharded consumer
    /// finished everything before it.
    pub unroutable_start: u64,
    /// Whether the unsharded consumer was deleted now (false: it was gone already).
    pub unsharded_deleted: bool,
}

/// Turns `topology`'s orders stream into a sharded one, or resumes a run that stopped. Each
/// step looks before it acts, so running it again does only what is left. The order, and why
/// nothing is lost or decided twice, is in `docs/scaling.md` ("Setting up shards"):
///
/// 1. refuse a server before 2.10, a stream sharded otherwise, a transform not ours;
/// 2. create the bucket: from now on an unsharded `serve` refuses to start, so none recreates
///    or widens the unsharded consumer behind this run;
/// 3. create the partition consumers, delivering from just after the stream's last message
///    (nothing matches them yet);
/// 4. narrow the unsharded consumer to the unsharded subjects (`orders.*`, `orders.*.*`), so it
///    never delivers a transformed message;
/// 5. set the transform;
/// 6. create the unroutable consumer, delivering from just after the stream's last message now:
///    every untransformed message with a book is before it;
/// 7. wait until the unsharded consumer has acked everything before that, then delete it.
pub async fn init(
    js: &Context,
    topology: &Topology,
    settings: &InitSettings,
) -> Result<InitReport, InitError> {
    // 1.
    if server_version(js).is_none_or(|version| version < (2, 10)) {
        return Err(InitError::ServerTooOld {
            version: js.client().server_info().version,
        });
    }
    let (mut orders, _) = ensure_streams(js, topology).await?;
    let transform_set_before = match partitioning(topology, &orders.cached_info().config) {
        Partitioning::None => false,
        Partitioning::Partitions(existing) if existing == settings.partitions => true,
        Partitioning::Partitions(existing) => {
            return Err(InitError::OtherPartitions {
                stream: topology.stream.clone(),
                existing,
                asked: settings.partitions,
            });
        }
        Partitioning::Foreign(transform) => {
            return Err(InitError::ForeignTransform {
                stream: topology.stream.clone(),
                from: transform.source,
                to: transform.destination,
            });
        }
    };

    // 2.
    let bucket = shards_bucket(topology);
    let bucket_created = match open_bucket(js, topology).await? {
        Some(_) => false,
        None => {
            create_bucket(js, topology).await?;
            true
        }
    };

    // 3. A consumer made by an earlier run says where the partitions start.
    let names: Vec<String> = (0..settings.partitions.get())
        .map(|p| partition_consumer(&settings.consumer, p, settings.partitions))
        .collect();
    let mut partitions_start = None;
    for name in &names {
        if let Some(info) = consumer_info(&orders, name).await? {
            partitions_start = start_of(&info.config);
            break;
        }
    }
    let partitions_start = match partitions_start {
        Some(start) => start,
        None if !transform_set_before => last_sequence(&mut orders).await? + 1,
        None => {
            return Err(InitError::NoPartitionStart {
                stream: topology.stream.clone(),
            });
        }
    };
    let mut partition_consumers_created = 0;
    for (partition, name) in (0..).zip(&names) {
        let wanted = consumer::pull::Config {
            filter_subject: partition_filter(topology, partition),
            ..consumer_config(name, partitions_start, settings)
        };
        if create_consumer(&orders, name, wanted).await? {
            partition_consumers_created += 1;
        }
    }

    // 4.
    let narrowed = narrow(&orders, topology, &settings.consumer).await?;

    // 5.
    let transform_set = if transform_set_before {
        false
    } else {
        let mut config = orders.cached_info().config.clone();
        config.subject_transform = Some(partition_transform(topology, settings.partitions));
        js.update_stream(config).await.map_err(nats_error(format!(
            "setting the partition transform on stream {}",
            topology.stream
        )))?;
        true
    };

    // 6.
    let unroutable = unroutable_consumer(&settings.consumer);
    let (unroutable_start, unroutable_created) = match consumer_info(&orders, &unroutable).await? {
        Some(info) => (start_of(&info.config).unwrap_or(1), false),
        None => {
            let start = last_sequence(&mut orders).await? + 1;
            let wanted = consumer::pull::Config {
                filter_subjects: unroutable_filters(topology),
                ..consumer_config(&unroutable, start, settings)
            };
            (start, create_consumer(&orders, &unroutable, wanted).await?)
        }
    };

    // 7.
    let unsharded_deleted = drain_and_delete(
        &orders,
        &settings.consumer,
        unroutable_start - 1,
        settings.drain_timeout,
    )
    .await?;
    Ok(InitReport {
        partitions: settings.partitions,
        bucket,
        bucket_created,
        partition_consumers_created,
        partitions_start,
        narrowed,
        transform_set,
        unroutable_created,
        unroutable_start,
        unsharded_deleted,
    })
}

async fn create_bucket(js: &Context, topology: &Topology) -> Result<(), NatsError> {
    let bucket = shards_bucket(topology);
    let created = js
        .create_key_value(kv::Config {
            bucket: bucket.clone(),
            description: format!(
                "the shard that owns each partition of stream {}",
                topology.stream
            ),
            // A few changes of each partition's owner, for whoever reads its history.
            history: 8,
            num_replicas: topology.replicas,
            ..Default::default()
        })
        .await;
    match created {
        Ok(_) => Ok(()),
        // Another init made it in between.
        Err(error) => match open_bucket(js, topology).await? {
            Some(_) => Ok(()),
            None => Err(nats_error(format!("creating the shards bucket {bucket}"))(
                error,
            )),
        },
    }
}

/// A durable pull consumer of init's, delivering from `start`, with `serve`'s settings; its
/// filter is the caller's.
fn consumer_config(name: &str, start: u64, settings: &InitSettings) -> consumer::pull::Config {
    consumer::pull::Config {
        durable_name: Some(name.to_owned()),
        deliver_policy: DeliverPolicy::ByStartSequence {
            start_sequence: start,
        },
        ack_policy: AckPolicy::Explicit,
        ack_wait: settings.ack_wait,
        max_deliver: -1,
        max_ack_pending: settings.max_ack_pending,
        ..Default::default()
    }
}

fn start_of(config: &consumer::Config) -> Option<u64> {
    match config.deliver_policy {
        DeliverPolicy::ByStartSequence { start_sequence } => Some(start_sequence),
        _ => None,
    }
}

async fn last_sequence(stream: &mut stream::Stream) -> Result<u64, NatsError> {
    let info = stream
        .info()
        .await
        .map_err(nats_error("reading the orders stream's last sequence"))?;
    Ok(info.state.last_sequence)
}

async fn consumer_info(
    stream: &stream::Stream,
    name: &str,
) -> Result<Option<consumer::Info>, NatsError> {
    patiently(|| async {
        match stream.consumer_info(name).await {
            Ok(info) => Ok(Some(info)),
            Err(error) if is_consumer_not_found(&error) => Ok(None),
            Err(error) => Err(nats_error(format!("looking up consumer {name}"))(error)),
        }
    })
    .await
}

/// Creates `name` unless it exists (an existing one is kept as it is); whether it was created.
async fn create_consumer(
    stream: &stream::Stream,
    name: &str,
    wanted: consumer::pull::Config,
) -> Result<bool, NatsError> {
    if consumer_info(stream, name).await?.is_some() {
        return Ok(false);
    }
    match stream.create_consumer_strict(wanted).await {
        Ok(_) => Ok(true),
        Err(error) if consumer_info(stream, name).await?.is_some() => {
            tracing::debug!(%error, consumer = name, "created meanwhile by another");
            Ok(false)
        }
        Err(error) => Err(nats_error(format!("creating consumer {name}"))(error)),
    }
}

/// Narrows the unsharded consumer, if it exists, to the subjects without a partition; whether
/// it was changed now.
async fn narrow(
    stream: &stream::Stream,
    topology: &Topology,
    name: &str,
) -> Result<bool, NatsError> {
    let Some(info) = consumer_info(stream, name).await? else {
        return Ok(false);
    };
    let filters = unroutable_filters(topology);
    if info.config.filter_subjects == filters && info.config.filter_subject.is_empty() {
        return Ok(false);
    }
    let config = consumer::Config {
        filter_subject: String::new(),
        filter_subjects: filters,
        ..info.config
    };
    stream
        .update_consumer(config)
        .await
        .map_err(nats_error(format!(
            "narrowing consumer {name} to the unsharded subjects"
        )))?;
    Ok(true)
}

/// How often the drain looks at the unsharded consumer.
const DRAIN_POLL: Duration = Duration::from_millis(250);

/// Waits until consumer `name` has acked every message it takes up to sequence `up_to`, then
/// deletes it; whether it existed to delete.
async fn drain_and_delete(
    stream: &stream::Stream,
    name: &str,
    up_to: u64,
    timeout: Duration,
) -> Result<bool, InitError> {
    let deadline = Instant::now() + timeout;
    loop {
        let Some(info) = consumer_info(stream, name).await? else {
            return Ok(false);
        };
        if drained(&info, up_to) {
            break;
        }
        if Instant::now() >= deadline {
            return Err(InitError::NotDrained {
                consumer: name.to_owned(),
                up_to,
                timeout,
                pending: info.num_pending,
                ack_pending: info.num_ack_pending,
                delivered: info.delivered.stream_sequence,
            });
        }
        tokio::time::sleep(DRAIN_POLL).await;
    }
    match stream.delete_consumer(name).await {
        Ok(_) => Ok(true),
        // Deleted by another init meanwhile.
        Err(_) if consumer_info(stream, name).await?.is_none() => Ok(false),
        Err(error) => Err(nats_error(format!("deleting consumer {name}"))(error).into()),
    }
}

/// Whether everything the consumer takes up to `up_to` was delivered and acked: its ack floor
/// is there, or nothing waits for an ack and it has delivered past it (or has nothing left).
/// The ack floor alone can stay below `up_to` for good: it stops at the last message the
/// consumer took, and the last ones before `up_to` may be none of its filters'.
fn drained(info: &consumer::Info, up_to: u64) -> bool {
    is_drained(
        Progress {
            ack_floor: info.ack_floor.stream_sequence,
            delivered: info.delivered.stream_sequence,
            pending: info.num_pending,
            ack_pending: info.num_ack_pending,
        },
        up_to,
    )
}

/// A consumer's progress as its info gives it.
#[derive(Debug, Clone, Copy)]
struct Progress {
    ack_floor: u64,
    delivered: u64,
    pending: u64,
    ack_pending: usize,
}

fn is_drained(progress: Progress, up_to: u64) -> bool {
    progress.ack_floor >= up_to
        || (progress.ack_pending == 0 && (progress.pending == 0 || progress.delivered >= up_to))
}

#[cfg(test)]
mod tests {
    use super::*;

    const P4: NonZeroU32 = NonZeroU32::new(4).unwrap();
    const P64: NonZeroU32 = NonZeroU32::new(64).unwrap();
    const P1000: NonZeroU32 = NonZeroU32::new(1000).unwrap();

    fn topology() -> Topology {
        Topology::default()
    }

    #[test]
    fn names_and_filters_follow_the_partition() {
        assert_eq!(
            partition_consumer("inventory-reserve-stock", 7, P64),
            "inventory-reserve-stock-p07"
        );
        assert_eq!(partition_consumer("c", 7, P1000), "c-p007");
        assert_eq!(partition_consumer("c", 0, NonZeroU32::MIN), "c-p0");
        assert_eq!(partition_filter(&topology(), 7), "orders.*.7.*");
        assert_eq!(unroutable_filters(&topology()), ["orders.*", "orders.*.*"]);
        assert_eq!(shards_bucket(&topology()), "ORDERS_SHARDS");
    }

    #[test]
    fn the_partitions_are_read_back_from_the_transform_and_only_from_ours() {
        let p = P64;
        let transform = partition_transform(&topology(), p);
        assert_eq!(transform.source, "orders.*.*");
        assert_eq!(
            transform.destination,
            "orders.{{wildcard(1)}}.{{partition(64,2)}}.{{wildcard(2)}}"
        );
        let mut config = topology().stream_config();
        assert_eq!(partitioning(&topology(), &config), Partitioning::None);
        config.subject_transform = Some(transform);
        assert_eq!(
            partitioning(&topology(), &config),
            Partitioning::Partitions(p)
        );
        let foreign = SubjectTransform {
            source: "orders.*.*".into(),
            destination: "orders.{{wildcard(1)}}.{{partition(64,1)}}.{{wildcard(2)}}".into(),
        };
        config.subject_transform = Some(foreign.clone());
        assert_eq!(
            partitioning(&topology(), &config),
            Partitioning::Foreign(foreign)
        );
    }

    #[test]
    fn the_unsharded_consumer_is_drained_once_nothing_up_to_the_cut_over_waits() {
        let progress = |ack_floor, delivered, pending, ack_pending| Progress {
            ack_floor,
            delivered,
            pending,
            ack_pending,
        };
        let up_to = 100;
        // Acked up to the cut-over, whatever came after it.
        assert!(is_drained(progress(100, 120, 5, 3), up_to));
        // Its last message was before the cut-over, delivered and acked: nothing left.
        assert!(is_drained(progress(90, 90, 0, 0), up_to));
        // Delivered past the cut-over with nothing waiting for an ack: later ones still pending.
        assert!(is_drained(progress(90, 101, 4, 0), up_to));
        // One not yet acked (or nak'ed, waiting for its redelivery), perhaps before the cut-over.
        assert!(!is_drained(progress(90, 101, 4, 1), up_to));
        // Not yet delivered up to the cut-over.
        assert!(!is_drained(progress(50, 60, 40, 0), up_to));
    }

    #[test]
    fn a_watch_applies_only_what_is_newer_than_it_saw() {
        let mut assignment = Assignment {
            partitions: P4,
            owners: BTreeMap::new(),
        };
        let mut seen = BTreeMap::new();
        assert!(apply(&mut assignment, &mut seen, 1, 5, Some("a".into())));
        assert_eq!(assignment.shard_of(1), Some("a"));
        // The watch's first entries repeat what the first read gave, or are older.
        assert!(!apply(&mut assignment, &mut seen, 1, 5, Some("a".into())));
        assert!(!apply(&mut assignment, &mut seen, 1, 3, Some("b".into())));
        assert!(apply(&mut assignment, &mut seen, 2, 6, Some("a".into())));
        assert_eq!(assignment.partitions_of("a"), [1, 2]);
        assert!(apply(&mut assignment, &mut seen, 1, 7, None));
        assert_eq!(assignment.shard_of(1), None);
        assert_eq!(assignment.partitions_of("a"), [2]);
    }
}
