//! `inventory bench hand-written`: the consumer one would write by hand around the service's
//! statements, as the bound of what the service's own loop costs per message. N lanes take
//! from one continuous JetStream pull, as one writes it by hand (async-nats's `messages()`;
//! the service fetches each lane's batch on demand instead): the next message, and after it
//! what is already fetched, up to `--batch-size` (a batch never waits for more). A lane decodes
//! the OrderPlaced bodies, runs the service's statements for them and acks each message after
//! the commit. No retry policy, dead letters, spans, metrics or outage handling: a failure ends
//! the run. Cancellations are not part of the workload.
//!
//! Which statements, on which connection:
//! - PostgreSQL through tokio-postgres (the default there): [`RESERVE_SQL`] per message, on a
//!   connection of the lane's own, prepared once.
//! - PostgreSQL through sqlx (`--driver sqlx`), the service's driver, connected with the
//!   service's options: a message or a batch through `RESERVE_SQL` in one statement, so one
//!   commit, those it leaves undecided through it alone after it, as the service's handler
//!   does.
//! - SQLite (sqlx, the only driver there): one writer connection for every lane, opened as the
//!   service opens its writer, each lane's message or batch in `BEGIN IMMEDIATE … COMMIT`, each
//!   placement through the service's `READ_SQL` and `WRITE_SQL`.
//!
//! The service's CPU per message against the sqlx loops parts what its own loop costs from what
//! the statements and the driver cost.
//!
//! The workload, the report and the wait for the last ack are `inventory bench end-to-end`'s
//! ([`crate::bench_e2e`]); this module only consumes.
//!
//! # Layout
//! - this module: the lanes, their batches and acks;
//! - [`postgres`]: the PostgreSQL lanes, tokio-postgres and sqlx;
//! - [`sqlite`]: SQLite's one writer, shared by the lanes.
//!
//! [`RESERVE_SQL`]: inventory_infra::consumers::natural_pg::RESERVE_SQL

mod postgres;
mod sqlite;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use anyhow::{Context as _, Result, ensure};
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use futures::{FutureExt as _, Stream, StreamExt as _};
use inventory_infra::db;
use inventory_infra::jetstream::{Context, Topology};
use serde::Deserialize;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::fresh::FreshDatabase;
use crate::latency::PublishClock;

pub(crate) use postgres::{UNSHARDED, connect, reserve};

/// The fields of a plain OrderPlaced body the statements need.
#[derive(Deserialize)]
pub(crate) struct Placed {
    pub(crate) message_id: String,
    pub(crate) order_id: Uuid,
    pub(crate) book_id: Uuid,
    pub(crate) quantity: i32,
}

impl Placed {
    /// Another placement of the same reservation key `(order_id, book_id)`.
    fn same_key(&self, other: &Self) -> bool {
        self.order_id == other.order_id && self.book_id == other.book_id
    }
}

/// The driver a lane runs the statements through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Driver {
    TokioPostgres,
    Sqlx,
}

impl Driver {
    /// The driver when none is named: tokio-postgres on PostgreSQL, sqlx (the only one) on
    /// SQLite.
    pub fn default_for(database_url: &str) -> Self {
        if db::is_postgres(database_url) {
            Self::TokioPostgres
        } else {
            Self::Sqlx
        }
    }
}

/// Whether `driver` can run `batch_size` placements at a time on the database of
/// `database_url`.
pub(crate) fn check(driver: Driver, database_url: &str, batch_size: usize) -> Result<()> {
    if driver == Driver::TokioPostgres {
        ensure!(
            db::is_postgres(database_url),
            "the tokio-postgres lanes run on PostgreSQL; SQLite runs on sqlx (--driver sqlx)"
        );
        ensure!(
            batch_size <= 1,
            "the tokio-postgres lanes run one message at a time; batches run on sqlx (--driver sqlx)"
        );
    }
    Ok(())
}

/// Where the lanes' connections come from.
enum Database {
    TokioPostgres(String),
    Postgres(postgres::SqlxOptions),
    Sqlite(sqlite::Writer),
}

impl Database {
    async fn open(fresh: &FreshDatabase, driver: Driver) -> Result<Self> {
        Ok(match driver {
            Driver::TokioPostgres => Self::TokioPostgres(fresh.url.clone()),
            Driver::Sqlx if db::is_postgres(&fresh.url) => {
                Self::Postgres(postgres::SqlxOptions::of(&fresh.conn))
            }
            Driver::Sqlx => Self::Sqlite(sqlite::Writer::open(&fresh.conn).await?),
        })
    }

    /// A lane's connection: its own on PostgreSQL, the shared writer on SQLite.
    async fn lane(&self) -> Result<Lane> {
        Ok(match self {
            Self::TokioPostgres(url) => Lane::TokioPostgres(postgres::TokioLane::open(url).await?),
            Self::Postgres(options) => Lane::Postgres(options.open().await?),
            Self::Sqlite(writer) => Lane::Sqlite(writer.clone()),
        })
    }
}

/// A lane's connection.
enum Lane {
    TokioPostgres(postgres::TokioLane),
    Postgres(postgres::SqlxLane),
    Sqlite(sqlite::Writer),
}

impl Lane {
    /// Runs the statements for `placed`, committed once it returns: for each placement,
    /// whether it reserved (false: its key was taken, a copy).
    async fn reserve(&mut self, placed: &[Placed]) -> Result<Vec<bool>> {
        match self {
            Self::TokioPostgres(lane) => lane.reserve(placed).await,
            Self::Postgres(lane) => lane.reserve(placed).await,
            Self::Sqlite(writer) => writer.reserve(placed).await,
        }
    }
}

/// The next batch for a lane: the next message, waited for, then what `messages` has already
/// fetched, up to `size`, as the service's lanes take theirs. An error or the end of the stream
/// ends the run.
async fn next_batch<S, T, E>(messages: &mut S, size: usize) -> Result<Vec<T>>
where
    S: Stream<Item = Result<T, E>> + Unpin,
    E: std::error::Error + Send + Sync + 'static,
{
    let mut batch = Vec::with_capacity(size.max(1));
    let mut next = Some(messages.next().await);
    while let Some(item) = next.take() {
        batch.push(item.context("the pull stream ended")??);
        if batch.len() < size {
            next = messages.next().now_or_never();
        }
    }
    Ok(batch)
}

/// What the lanes counted.
#[derive(Debug, Default)]
pub(crate) struct Counts {
    pub(crate) acked: AtomicU64,
    /// Acked, the statement having found the order's reservation already there.
    pub(crate) duplicates: AtomicU64,
}

/// The lanes, running.
pub(crate) struct HandWritten {
    pub(crate) counts: Arc<Counts>,
    pub(crate) consumer: PullConsumer,
    stop: CancellationToken,
    lanes: JoinSet<Result<()>>,
}

/// Creates the durable pull consumer on the orders stream; [`HandWritten::start`] consumes.
pub(crate) async fn prepare(js: &Context, topology: &Topology) -> Result<PullConsumer> {
    let stream = js.get_stream(&topology.stream).await?;
    let name = "inventory-bench-hand-written";
    let config = pull::Config {
        durable_name: Some(name.into()),
        filter_subject: format!("{}.>", topology.subject_prefix),
        ack_policy: AckPolicy::Explicit,
        max_ack_pending: 20_000,
        ..Default::default()
    };
    Ok(stream.get_or_create_consumer(name, config).await?)
}

impl HandWritten {
    /// Starts `lanes` lanes on `consumer`, each handing up to `batch_size` messages at once to
    /// its connection through `driver`; each opens its connection first, as the service's lanes
    /// open theirs on their first message.
    pub(crate) async fn start(
        fresh: &FreshDatabase,
        driver: Driver,
        consumer: PullConsumer,
        lanes: usize,
        batch_size: usize,
        clock: Option<Arc<PublishClock>>,
    ) -> Result<Self> {
        let batch_size = batch_size.max(1);
        check(driver, &fresh.url, batch_size)?;
        let database = Arc::new(Database::open(fresh, driver).await?);
        // Twice what the lanes hold, asked again when half is used.
        let messages = consumer
            .stream()
            .max_messages_per_batch((2 * lanes * batch_size).max(32))
            .heartbeat(std::time::Duration::from_secs(2))
            .expires(std::time::Duration::from_secs(30))
            .messages()
            .await?;
        let messages = Arc::new(tokio::sync::Mutex::new(messages));
        let counts = Arc::new(Counts::default());
        let stop = CancellationToken::new();
        let mut running = JoinSet::new();
        for _ in 0..lanes {
            let failed = stop.clone();
            let (database, messages, counts, stop, clock) = (
                database.clone(),
                messages.clone(),
                counts.clone(),
                stop.clone(),
                clock.clone(),
            );
            let lane = async move {
                let mut connection = database.lane().await.context("opening a lane")?;
                loop {
                    let batch = {
                        let mut messages = messages.lock().await;
                        tokio::select! {
                            () = stop.cancelled() => return Ok(()),
                            batch = next_batch(&mut *messages, batch_size) => batch?,
                        }
                    };
                    let placed = batch
                        .iter()
                        .map(|message| serde_json::from_slice::<Placed>(&message.payload))
                        .collect::<Result<Vec<_>, _>>()?;
                    let reserved = connection.reserve(&placed).await?;
                    ensure!(
                        reserved.len() == batch.len(),
                        "{} results for {} messages",
                        reserved.len(),
                        batch.len()
                    );
                    // Committed: each message is acked, in order.
                    for ((message, placed), reserved) in batch.iter().zip(&placed).zip(reserved) {
                        message.ack().await.map_err(anyhow::Error::from_boxed)?;
                        if let Some(clock) = &clock {
                            clock.handled(&placed.message_id, Instant::now());
                        }
                        let counter = if reserved {
                            &counts.acked
                        } else {
                            &counts.duplicates
                        };
                        counter.fetch_add(1, Relaxed);
                    }
                }
            };
            running.spawn(async move {
                let result: Result<()> = lane.await;
                if result.is_err() {
                    failed.cancel();
                }
                result
            });
        }
        Ok(Self {
            counts,
            consumer,
            stop,
            lanes: running,
        })
    }

    /// A lane failed, and the others were told to stop (the error is [`stop`](Self::stop)'s).
    pub(crate) fn is_finished(&self) -> bool {
        self.stop.is_cancelled()
    }

    /// Stops the lanes and returns the first lane's error, if one failed.
    pub(crate) async fn stop(mut self) -> Result<()> {
        self.stop.cancel();
        while let Some(lane) = self.lanes.join_next().await {
            lane??;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![expect(clippy::unwrap_used, reason = "a test fails by panicking")]

    use super::next_batch;
    use futures::FutureExt as _;
    use futures::channel::mpsc;

    type Item = Result<u32, std::io::Error>;

    #[tokio::test]
    async fn a_batch_takes_what_is_already_fetched_up_to_its_size_and_never_waits_for_more() {
        let (sender, mut messages) = mpsc::unbounded::<Item>();
        for message in 1..=5 {
            sender.unbounded_send(Ok(message)).unwrap();
        }
        assert_eq!(next_batch(&mut messages, 3).await.unwrap(), [1, 2, 3]);
        // Two left of five: the batch is short rather than wait for a third.
        assert_eq!(next_batch(&mut messages, 3).await.unwrap(), [4, 5]);
        // Nothing fetched: the next batch waits for its first message, then takes it alone.
        let mut waiting = Box::pin(next_batch(&mut messages, 3));
        assert!((&mut waiting).now_or_never().is_none());
        sender.unbounded_send(Ok(6)).unwrap();
        assert_eq!(waiting.await.unwrap(), [6]);
    }

    #[tokio::test]
    async fn a_batch_of_one_is_one_message_whatever_is_fetched() {
        let (sender, mut messages) = mpsc::unbounded::<Item>();
        for message in 1..=3 {
            sender.unbounded_send(Ok(message)).unwrap();
        }
        assert_eq!(next_batch(&mut messages, 1).await.unwrap(), [1]);
        assert_eq!(next_batch(&mut messages, 1).await.unwrap(), [2]);
    }

    #[tokio::test]
    async fn an_error_or_the_end_of_the_stream_ends_the_run() {
        let (sender, mut messages) = mpsc::unbounded::<Item>();
        sender.unbounded_send(Ok(1)).unwrap();
        sender
            .unbounded_send(Err(std::io::Error::other("missed heartbeat")))
            .unwrap();
        assert!(next_batch(&mut messages, 3).await.is_err());
        drop(sender);
        assert!(next_batch(&mut messages, 3).await.is_err());
    }
}
