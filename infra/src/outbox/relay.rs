//! The outbox relay: publishes an outbox's rows to their stream and removes them once the
//! stream has them.
//!
//! # One pass
//!
//! 1. Leases (`lease.rs`), kept by a task of their own every fifth of the lease whatever the
//!    passes do: heartbeat, renew, and move towards the fair share of the 16 partitions. A
//!    pass publishes in the partitions held with time left.
//! 2. Read every row still waiting in the partitions held, in `seq` order, up to a batch
//!    (never "seq after the last seen": a row whose transaction commits after a higher seq's
//!    is found by the next pass instead of being skipped). No transaction is opened.
//! 3. Publish, `Nats-Msg-Id` = the event id, subject `<prefix>.<row's subject>`: one chain
//!    per order, the chains of different orders pipelined (up to `max_in_flight` at once),
//!    the rows of one order one after the other, each only after the PubAck of the one
//!    before. A PubAck counts, a duplicate PubAck too (the stream had it already). Which row
//!    goes out next and what each outcome does are decided in `pass.rs`, apart from the
//!    publishing done here.
//! 4. Delete the acknowledged rows, in chunks, each its own short statement.
//!
//! # Order per order
//!
//! Within an order, `seq` order is commit order (every event-writing transaction first takes
//! the order's lock, see `consumers/natural_pg.rs`; a test refuses any row written without it,
//! `tests/integration/outbox.rs`), so once a row is visible,
//! every earlier row of its order is too. A relay never has two publishes of one order in
//! flight: the chain sends an order's next row only after the PubAck of the one before, and
//! a pass starts only after the previous one ended. If a publish fails, the order's later
//! rows are not sent in that pass; the next pass reads the failed row first again. So every
//! event of an order is stored in the stream before any later event of the order is sent by
//! anyone: whichever relay publishes event 2 has first seen a PubAck for event 1.
//!
//! # Several relays, and a stale one
//!
//! Partitions are leased, so relays do not do each other's work. The lease is not what keeps
//! the stream right, though; two things are:
//! - every relay reads in `seq` order and chains an order's rows as above, so even two
//!   relays on one partition cannot store an order's events out of order;
//! - a republished event (a relay that died after its PubAck and before its delete, or a
//!   stale holder whose lease ran out while it published) carries the same `Nats-Msg-Id`, so
//!   the stream drops it as long as it comes inside its duplicate window.
//!
//! A relay starts a publish only while at least `publish_timeout` of its lease is left (by
//! its own monotonic clock, from before it sent the renewal), so its publishes end before
//! another relay can take the partition. A republish by the next holder comes within about
//! one lease of the first publish. [`RelaySettings::check_window`] refuses to start unless
//! the lease plus the publish timeout is at most a quarter of the stream's duplicate window.
//! The one copy a window cannot catch is a publish the NATS client buffered while
//! disconnected and sent after reconnecting later than the window; consumers dedup by event
//! id all the same.
//!
//! # Rows that cannot be published
//!
//! A row larger than the server's `max_payload` (or the stream's maximum message size), or
//! whose subject no stream holds while the relay's stream exists, is parked: `parked_at` and
//! `parked_reason` set, and left alone until an operator retries it. It blocks nothing but
//! its own order's later rows, which wait behind it so that the order's events stay in order.
//! Everything else (no connection, a timeout, the relay's whole stream missing) is a failure
//! of the broker: the rows stay, the relay backs off (doubling up to `max_retry_delay`) and
//! drains them once the broker is back. One that has failed for longer than its lease gives
//! its partitions back and stands aside until JetStream answers it, so that a relay cut off
//! from NATS while others are not holds none of the outbox back.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::context::{GetStreamByNameErrorKind, PublishError, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::{self as js, ErrorCode};
use backon::{BackoffBuilder as _, ExponentialBackoff, ExponentialBuilder};
use bytes::Bytes;
use chrono::{DateTime, Utc};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use prometheus::core::Collector;
use prometheus::{IntCounter, IntGauge, Opts};
use sea_orm::{DatabaseConnection, DbErr};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::lease::{Held, Leases};
use super::pass::{Pass, Settled};
pub use super::pass::{PassReport, Published};
use super::source::{Backlog, OutboxSource, PendingRow};
use crate::db::{NoAnswer, within};
use crate::jetstream::{self, ConfigDrift, Context, NatsError, PrefixStream};

/// How a relay runs. The defaults suit a service; tests shorten the times.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelaySettings {
    /// How long a partition stays leased without renewal. A relay renews every fifth of it.
    pub lease: Duration,
    /// The backup poll, for rows committed by processes that cannot wake this relay.
    pub poll_interval: Duration,
    /// Rows read per pass.
    pub batch_size: usize,
    /// Orders with a publish in flight at once.
    pub max_in_flight: usize,
    /// How long a publish waits for its PubAck.
    pub publish_timeout: Duration,
    /// The first delay after a failed pass; doubles per failed pass up to `max_retry_delay`.
    pub retry_delay: Duration,
    pub max_retry_delay: Duration,
    /// Rows per DELETE statement.
    pub delete_chunk: usize,
    /// The bound on each of its database calls ([`crate::db::DbTimeouts::work`]): a
    /// connection gone silent would otherwise hold the relay, and the stop waiting for it,
    /// for good. `None`: unbounded.
    pub db_timeout: Option<Duration>,
    /// How often the backlog's figures are read for the metrics.
    pub backlog_interval: Duration,
}

impl Default for RelaySettings {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(10),
            poll_interval: Duration::from_millis(200),
            batch_size: 500,
            max_in_flight: 128,
            publish_timeout: Duration::from_secs(3),
            retry_delay: Duration::from_millis(100),
            max_retry_delay: Duration::from_secs(5),
            delete_chunk: 500,
            db_timeout: crate::db::DbTimeouts::default().work(),
            backlog_interval: Duration::from_secs(30),
        }
    }
}

/// The lease is too long for the stream's duplicate window (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the relay's lease ({lease:?}) plus its publish timeout ({publish_timeout:?}) must be at \
     most a quarter of stream {stream}'s duplicate window ({window:?}): a relay that took over \
     a partition could republish an event after the window, and the stream would store it twice. \
     Shorten the lease or lengthen the window"
)]
pub struct LeaseTooLong {
    pub stream: String,
    pub lease: Duration,
    pub publish_timeout: Duration,
    pub window: Duration,
}

impl RelaySettings {
    /// Refuses a lease that is not much shorter than the stream's duplicate `window` (lease
    /// plus publish timeout at most a quarter of it), and a publish timeout not shorter than
    /// the lease (no publish could start inside a lease).
    pub fn check_window(&self, stream: &str, window: Duration) -> Result<(), LeaseTooLong> {
        if (self.lease + self.publish_timeout) * 4 <= window && self.publish_timeout < self.lease {
            Ok(())
        } else {
            Err(LeaseTooLong {
                stream: stream.to_owned(),
                lease: self.lease,
                publish_timeout: self.publish_timeout,
                window,
            })
        }
    }
}

/// Wakes a relay in this process as soon as a transaction that wrote an event committed, so
/// the event does not wait for the backup poll.
#[derive(Debug, Clone, Default)]
pub struct RelayWake(Arc<Notify>);

impl RelayWake {
    /// Wakes the relay; wakes while it is busy come to one more pass, not one each.
    pub fn notify(&self) {
        self.0.notify_one();
    }
}

/// What a relay has done, for the metrics, the health check and the tests. Its counters and
/// gauges are Prometheus's, labelled with the outbox table and set where each event happens;
/// `serve` and `relay` register them ([`RelayStatus::collectors`]).
#[derive(Debug, Clone)]
pub struct RelayStatus(Arc<StatusInner>);

#[derive(Debug)]
struct StatusInner {
    /// The outbox table its series are labelled with.
    outbox: String,
    published: IntCounter,
    duplicates: IntCounter,
    held_partitions: IntGauge,
    pending: IntGauge,
    parked: IntGauge,
    /// When the oldest waiting row was written, at the last look at the backlog.
    oldest_pending: Mutex<Option<DateTime<Utc>>>,
    /// Since when every pass that had rows to publish failed; `None` while it publishes.
    failing_since: Mutex<Option<Instant>>,
    last_failure: Mutex<Option<String>>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A series of the relay of `outbox`.
fn series<M: prometheus::core::Metric>(
    make: fn(Opts) -> prometheus::Result<M>,
    name: &str,
    help: &str,
    outbox: &str,
) -> M {
    make(Opts::new(name, help).const_label("outbox", outbox))
        .expect("a valid metric name and label")
}

impl RelayStatus {
    /// The status of a relay of the outbox table `outbox`, its series unregistered.
    pub fn new(outbox: &str) -> Self {
        Self(Arc::new(StatusInner {
            outbox: outbox.to_owned(),
            published: series(
                IntCounter::with_opts,
                "inventory_outbox_published_total",
                "Outbox rows this relay published and the stream stored as new.",
                outbox,
            ),
            duplicates: series(
                IntCounter::with_opts,
                "inventory_outbox_duplicate_pubacks_total",
                "Outbox rows this relay published that the stream had already (a republish \
                 after a crash or a takeover): done all the same.",
                outbox,
            ),
            held_partitions: series(
                IntGauge::with_opts,
                "inventory_outbox_relay_partitions",
                "Outbox partitions this relay leases now.",
                outbox,
            ),
            pending: series(
                IntGauge::with_opts,
                "inventory_outbox_pending_rows",
                "Outbox rows waiting to be published (parked rows not included), at the \
                 relay's last look.",
                outbox,
            ),
            parked: series(
                IntGauge::with_opts,
                "inventory_outbox_parked_rows",
                "Outbox rows the relay set aside (too large, no stream for the subject).",
                outbox,
            ),
            oldest_pending: Mutex::default(),
            failing_since: Mutex::default(),
            last_failure: Mutex::default(),
        }))
    }

    /// The outbox table it relays.
    pub fn outbox(&self) -> &str {
        &self.0.outbox
    }

    /// Its series, for a registry.
    pub fn collectors(&self) -> Vec<Box<dyn Collector>> {
        let inner = &self.0;
        vec![
            Box::new(inner.published.clone()),
            Box::new(inner.duplicates.clone()),
            Box::new(inner.held_partitions.clone()),
            Box::new(inner.pending.clone()),
            Box::new(inner.parked.clone()),
        ]
    }

    /// Rows published and acknowledged as new by the stream, since start.
    pub fn published(&self) -> u64 {
        self.0.published.get()
    }

    /// Rows the stream acknowledged as duplicates (it had the event id already).
    pub fn duplicates(&self) -> u64 {
        self.0.duplicates.get()
    }

    /// Partitions this relay holds now.
    pub fn held_partitions(&self) -> usize {
        usize::try_from(self.0.held_partitions.get()).unwrap_or(0)
    }

    /// When the oldest waiting row was written, at the last look at the backlog.
    pub fn oldest_pending(&self) -> Option<DateTime<Utc>> {
        *lock(&self.0.oldest_pending)
    }

    /// How long it has failed to publish rows that wait; `None` while it publishes.
    pub fn failing_for(&self) -> Option<Duration> {
        lock(&self.0.failing_since).map(|since| since.elapsed())
    }

    pub fn last_failure(&self) -> Option<String> {
        lock(&self.0.last_failure).clone()
    }

    fn holds(&self, partitions: usize) {
        self.0
            .held_partitions
            .set(i64::try_from(partitions).unwrap_or(i64::MAX));
    }

    fn saw(&self, backlog: Backlog) {
        self.0
            .pending
            .set(i64::try_from(backlog.pending).unwrap_or(i64::MAX));
        self.0
            .parked
            .set(i64::try_from(backlog.parked).unwrap_or(i64::MAX));
        *lock(&self.0.oldest_pending) = backlog.oldest_pending;
    }

    fn failed(&self, error: String) {
        lock(&self.0.failing_since).get_or_insert_with(Instant::now);
        *lock(&self.0.last_failure) = Some(error);
    }

    fn succeeded(&self) {
        *lock(&self.0.failing_since) = None;
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("outbox relay database: {0}")]
    Database(#[from] DbErr),
    #[error("outbox relay database: {0}")]
    NoAnswer(#[from] NoAnswer),
    #[error(transparent)]
    Nats(#[from] NatsError),
    #[error(transparent)]
    LeaseTooLong(#[from] LeaseTooLong),
    #[error("the outbox table {table} cannot be read: {source}")]
    MissingTable {
        table: String,
        #[source]
        source: DbErr,
    },
    #[error("NATS is not connected")]
    Disconnected,
}

/// `work` within the relay's bound on its database calls: a failure and no answer are alike
/// a [`RelayError`].
async fn bounded<T>(
    bound: Option<Duration>,
    work: impl Future<Output = Result<T, DbErr>>,
) -> Result<T, RelayError> {
    Ok(within(bound, work).await??)
}

/// What a failed publish means for its row.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Verdict {
    /// The row can never be published as it is.
    Park(String),
    /// Nobody answered for the subject: no stream holds it, or the server is not ready.
    NoResponders,
    /// The broker is down, slow or busy: the row waits.
    Retry(String),
}

fn verdict(error: &PublishError) -> Verdict {
    match error.kind() {
        PublishErrorKind::MaxPayloadExceeded => Verdict::Park(format!("too large: {error}")),
        PublishErrorKind::StreamNotFound => Verdict::NoResponders,
        _ => {
            let js_code = std::error::Error::source(error)
                .and_then(|source| source.downcast_ref::<js::Error>())
                .map(js::Error::error_code);
            match js_code {
                Some(ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM) => {
                    Verdict::Park(format!("too large for the stream: {error}"))
                }
                _ => Verdict::Retry(error.to_string()),
            }
        }
    }
}

/// What a failed publish does to its row.
#[derive(Debug, Clone, PartialEq, Eq)]
enum RowFailure {
    Park(String),
    Retry(String),
}

/// A subject a client may publish on: dot-separated tokens, none empty, no wildcard, no
/// whitespace.
fn publishable(subject: &str) -> bool {
    !subject.is_empty()
        && subject.split('.').all(|token| {
            !token.is_empty()
                && token != "*"
                && token != ">"
                && !token.chars().any(|c| c.is_whitespace() || c.is_control())
        })
}

/// A panic of a task the relay runs, passed on as the relay's own, so whoever supervises the
/// relay sees it.
fn pass_on_panic(ended: Result<(), tokio::task::JoinError>) {
    if let Err(error) = ended
        && error.is_panic()
    {
        std::panic::resume_unwind(error.into_panic());
    }
}

/// Reads the outbox's backlog for the metrics every `every` until `stop`, apart from the lease
/// rounds: a failure to read it says nothing of whether the relay publishes. A failed look
/// keeps the last figures.
async fn watch_backlog(
    db: DatabaseConnection,
    source: OutboxSource,
    status: RelayStatus,
    every: Duration,
    db_timeout: Option<Duration>,
    stop: CancellationToken,
) {
    let mut ticks = crate::periodic::Every::new(every, stop);
    while ticks.tick().await {
        match bounded(db_timeout, source.backlog(&db)).await {
            Ok(backlog) => status.saw(backlog),
            Err(error) => tracing::debug!(%error, "reading the outbox's backlog"),
        }
    }
}

impl LeaseKeeper {
    /// Makes the rounds when due until `stop`, and gives itself back for the last release.
    async fn keep(mut self, stop: CancellationToken) -> Self {
        loop {
            tokio::select! {
                () = stop.cancelled() => return self,
                () = tokio::time::sleep_until(self.leases.next_round().into()) => {}
            }
            if let Err(error) = self.round().await {
                self.status.failed(error.to_string());
            }
        }
    }

    /// One round, unless this relay stands aside; a partition taken wakes the relay, so that
    /// what waits there goes out now rather than at the next poll.
    async fn round(&mut self) -> Result<(), RelayError> {
        if !self.stand_aside_while_cut_off().await? {
            return Ok(());
        }
        let round = bounded(self.settings.db_timeout, self.leases.round(&self.db)).await?;
        let held = self.leases.held().count();
        self.status.holds(held);
        if !round.taken.is_empty() || !round.released.is_empty() || !round.lost.is_empty() {
            tracing::info!(
                outbox = self.source.table(),
                live_relays = round.live_relays,
                fair_share = round.fair_share,
                taken = ?round.taken,
                released = ?round.released,
                lost = ?round.lost,
                held,
                "outbox partitions"
            );
        }
        if !round.taken.is_empty() {
            self.wake.notify();
        }
        Ok(())
    }

    /// A relay that has failed to publish for longer than its lease (NATS silent, or
    /// unreachable from here only) gives its partitions back and stops counting itself among
    /// the live relays, so that the others take them at their next round instead of waiting
    /// behind it. Aside, it asks JetStream for its stream's info each round, and takes a share
    /// again once that answers. Whether it takes part in this round.
    async fn stand_aside_while_cut_off(&mut self) -> Result<bool, RelayError> {
        let cut_off = self
            .status
            .failing_for()
            .is_some_and(|failing| failing > self.settings.lease);
        if cut_off && !self.aside.load(Ordering::Relaxed) {
            bounded(self.settings.db_timeout, self.leases.release_all(&self.db)).await?;
            self.status.holds(0);
            self.aside.store(true, Ordering::Relaxed);
            tracing::warn!(
                outbox = self.source.table(),
                error = self.status.last_failure().unwrap_or_default(),
                "outbox relay: cannot publish for longer than its lease; its partitions are \
                 given back until the broker answers it again"
            );
        }
        if !self.aside.load(Ordering::Relaxed) {
            return Ok(true);
        }
        self.leases.skip_round(Instant::now());
        let answers = tokio::time::timeout(
            self.settings.publish_timeout,
            self.js.get_stream(self.source.stream()),
        )
        .await;
        if !matches!(answers, Ok(Ok(_))) {
            return Ok(false);
        }
        self.aside.store(false, Ordering::Relaxed);
        self.status.succeeded();
        tracing::info!(
            outbox = self.source.table(),
            "outbox relay: the broker answers again; taking a share of the partitions"
        );
        Ok(true)
    }

    /// Gives every partition back (a stop).
    async fn release_all(&mut self) {
        let released = bounded(self.settings.db_timeout, self.leases.release_all(&self.db)).await;
        if let Err(error) = released {
            tracing::warn!(%error, "outbox relay: partitions not released; they expire");
        }
        self.status.holds(0);
    }
}

/// A relay of one outbox, set up and ready to run.
pub struct Relay {
    db: DatabaseConnection,
    js: Context,
    client: async_nats::Client,
    source: OutboxSource,
    settings: RelaySettings,
    /// The partitions held, kept by the lease keeper.
    held: Held,
    /// Makes the lease rounds. `run` gives it a task of its own; a caller that drives the
    /// passes itself (a test, a benchmark) has them make the rounds when due.
    keeper: Option<LeaseKeeper>,
    holder: String,
    wake: RelayWake,
    status: RelayStatus,
    /// Set by the keeper (see [`LeaseKeeper::stand_aside_while_cut_off`]).
    aside: Arc<AtomicBool>,
}

/// Keeps a relay's leases: heartbeat, renewal and fair share every fifth of the lease, and
/// standing aside while the relay cannot publish.
struct LeaseKeeper {
    db: DatabaseConnection,
    js: Context,
    source: OutboxSource,
    settings: RelaySettings,
    leases: Leases,
    status: RelayStatus,
    wake: RelayWake,
    /// It has failed to publish for longer than its lease and gave its partitions back: it
    /// holds none, and is not counted among the live relays, until NATS answers it again.
    aside: Arc<AtomicBool>,
}

impl Relay {
    /// Creates the source's stream if absent (keeping an existing one and returning how it
    /// differs), checks the lease against the stream's duplicate window as the server has
    /// it, checks the table is there, and registers this relay's heartbeat.
    pub async fn prepare(
        js: &Context,
        db: DatabaseConnection,
        source: OutboxSource,
        stream: &PrefixStream,
        settings: RelaySettings,
    ) -> Result<(Self, Vec<ConfigDrift>), RelayError> {
        let (stream_handle, drifts) = jetstream::ensure_prefix_stream(js, stream).await?;
        let window = stream_handle.cached_info().config.duplicate_window;
        settings.check_window(&stream.name, window)?;
        source
            .check_table(&db)
            .await
            .map_err(|source_error| RelayError::MissingTable {
                table: source.table().to_owned(),
                source: source_error,
            })?;
        let holder = format!(
            "pid{}-{}",
            std::process::id(),
            &Uuid::new_v4().simple().to_string()[..12]
        );
        let leases = Leases::new(source.table(), &holder, settings.lease);
        leases.register(&db).await?;
        let (wake, aside) = (RelayWake::default(), Arc::default());
        let status = RelayStatus::new(source.table());
        let keeper = LeaseKeeper {
            db: db.clone(),
            js: js.clone(),
            source: source.clone(),
            settings: settings.clone(),
            leases,
            status: status.clone(),
            wake: wake.clone(),
            aside: Arc::clone(&aside),
        };
        Ok((
            Self {
                db,
                client: js.client(),
                js: js.clone(),
                source,
                settings,
                held: keeper.leases.held(),
                keeper: Some(keeper),
                holder,
                wake,
                status,
                aside,
            },
            drifts,
        ))
    }

    /// The handle that wakes this relay.
    pub fn wake(&self) -> RelayWake {
        self.wake.clone()
    }

    pub fn status(&self) -> RelayStatus {
        self.status.clone()
    }

    pub fn source(&self) -> &OutboxSource {
        &self.source
    }

    /// This relay's name in the lease table.
    pub fn holder(&self) -> &str {
        &self.holder
    }

    /// Publishes until `stop`, then makes one last pass (so what was committed just before
    /// the stop goes out, unless the broker is failing) and gives its partitions back. The
    /// pass in flight when `stop` comes always finishes, so no row is left published and not
    /// removed; dropping the future instead (an immediate stop) leaves such rows, which the
    /// next holder republishes as duplicates the stream drops.
    pub async fn run(mut self, stop: CancellationToken) {
        let backlog = tokio::spawn(watch_backlog(
            self.db.clone(),
            self.source.clone(),
            self.status.clone(),
            self.settings.backlog_interval,
            self.settings.db_timeout,
            stop.clone(),
        ));
        // The leases are kept on their own timer, however long a pass takes, until the last
        // pass is done (or this future is dropped).
        let keeping = CancellationToken::new();
        let _keeping = keeping.clone().drop_guard();
        let mut keeper = self
            .keeper
            .take()
            .map(|keeper| tokio::spawn(keeper.keep(keeping.clone())));
        // The delays still to come, while passes fail.
        let mut backoff: Option<ExponentialBackoff> = None;
        // When the next pass is due: now, after a wake or a full batch; a poll interval after
        // a pass; a backoff delay after a failed one.
        let mut next_pass = Instant::now();
        loop {
            if Instant::now() >= next_pass {
                next_pass = match self.pass().await {
                    Ok(report) if report.failed == 0 => {
                        // Aside, a pass publishes nothing: no news of the broker.
                        if backoff.take().is_some() && !self.aside.load(Ordering::Relaxed) {
                            tracing::info!(outbox = self.source.table(), "publishing again");
                        }
                        if report.more {
                            Instant::now()
                        } else {
                            Instant::now() + self.settings.poll_interval
                        }
                    }
                    Ok(_) | Err(_) => {
                        let next = backoff
                            .get_or_insert_with(|| {
                                ExponentialBuilder::new()
                                    .with_min_delay(self.settings.retry_delay)
                                    .with_max_delay(self.settings.max_retry_delay)
                                    .without_max_times()
                                    .build()
                            })
                            .next()
                            .unwrap_or(self.settings.max_retry_delay);
                        tracing::warn!(
                            outbox = self.source.table(),
                            error = self.status.last_failure().unwrap_or_default(),
                            retry_in = ?next,
                            "outbox relay: rows wait"
                        );
                        Instant::now() + next
                    }
                };
            }
            if stop.is_cancelled() {
                break;
            }
            let backing_off = backoff.is_some();
            tokio::select! {
                () = stop.cancelled() => break,
                // A wake does not cut a backoff short: a failing broker is not hammered.
                () = self.wake.0.notified(), if !backing_off => next_pass = Instant::now(),
                () = tokio::time::sleep_until(next_pass.into()) => {}
                ended = async {
                    match keeper.as_mut() {
                        Some(task) => task.await,
                        None => std::future::pending().await,
                    }
                } => {
                    // Without its leases it would only publish until they lapse: the relay
                    // ends, and its supervisor sees why (a panic passed on as one).
                    tracing::error!(
                        outbox = self.source.table(),
                        "outbox relay: its lease keeper ended; stopping"
                    );
                    backlog.abort();
                    pass_on_panic(ended.map(drop));
                    return;
                }
            }
        }
        // The last pass publishes under the leases as they are; the keeper stops first so
        // that no round takes a partition back while they are given back.
        keeping.cancel();
        let keeper = match keeper {
            Some(task) => {
                let ended = task.await;
                match ended {
                    Ok(keeper) => Some(keeper),
                    Err(error) => {
                        pass_on_panic(Err(error));
                        None
                    }
                }
            }
            None => self.keeper.take(),
        };
        if backoff.is_none()
            && jetstream::is_connected(&self.client)
            && let Err(error) = self.pass().await
        {
            tracing::warn!(%error, "outbox relay: last pass failed; the rows stay");
        }
        match keeper {
            Some(mut keeper) => keeper.release_all().await,
            None => tracing::warn!("outbox relay: partitions not released; they expire"),
        }
        // It stopped with `stop`.
        pass_on_panic(backlog.await);
        tracing::info!(outbox = self.source.table(), "outbox relay stopped");
    }

    /// One pass: the lease round if due, publish what waits, delete what was acknowledged.
    /// The step [`Self::run`] repeats; public, so a test or a benchmark drives the relay pass by
    /// pass.
    pub async fn pass(&mut self) -> Result<PassReport, RelayError> {
        let published = match self.publish_pending().await {
            Ok(published) => published,
            Err(error) => {
                self.status.failed(error.to_string());
                return Err(error);
            }
        };
        let failure = published.failure.clone();
        let report = match self.delete_published(published).await {
            Ok(report) => report,
            Err(error) => {
                self.status.failed(error.to_string());
                return Err(error);
            }
        };
        match failure {
            Some(error) => self.status.failed(error),
            // Aside, it published nothing: that is no sign the broker answers it.
            None if self.aside.load(Ordering::Relaxed) => {}
            None => self.status.succeeded(),
        }
        Ok(report)
    }

    /// Steps 1 to 3 of a pass: the rows acknowledged by the stream are returned, not yet
    /// deleted. A process that dies here has published rows still in the outbox; the next
    /// relay republishes them and the stream drops them as duplicates. Public, so a test can stop
    /// a relay between the two.
    pub async fn publish_pending(&mut self) -> Result<Published, RelayError> {
        if let Some(keeper) = &mut self.keeper
            && keeper.leases.due(Instant::now())
        {
            keeper.round().await?;
        }
        let margin = self.settings.publish_timeout;
        let partitions = self.held.usable(Instant::now(), margin);
        if partitions.is_empty() {
            return Ok(Published::default());
        }
        let rows = bounded(
            self.settings.db_timeout,
            self.source
                .read_pending(&self.db, &partitions, self.settings.batch_size),
        )
        .await?;
        let full = rows.len() >= self.settings.batch_size;
        let mut pass = Pass::new(rows, self.settings.max_in_flight, full);
        if !pass.over() && !jetstream::is_connected(&self.client) {
            // Nothing is sent while disconnected: the client would only buffer it.
            pass.hold_back_all(RelayError::Disconnected.to_string());
        }
        // The pass decides what goes out; this runs the publishes, several orders at once.
        let this = &*self;
        let usable = |partition| this.held.still_usable(partition, Instant::now(), margin);
        let mut in_flight = FuturesUnordered::new();
        loop {
            while let Some((chain, row)) = pass.next(usable) {
                in_flight.push(async move { (chain, this.publish(row).await) });
            }
            match in_flight.next().await {
                Some((chain, settled)) => pass.settled(chain, settled),
                None => break,
            }
        }
        let published = pass.finish();
        let report = &published.report;
        self.status.0.published.inc_by(report.published as u64);
        self.status.0.duplicates.inc_by(report.duplicates as u64);
        Ok(published)
    }

    /// Step 4 of a pass: removes the rows the stream acknowledged.
    async fn delete_published(&mut self, published: Published) -> Result<PassReport, RelayError> {
        let mut report = published.report;
        if !published.seqs.is_empty() {
            // Rows left here are published again by a later pass: duplicates, dropped by
            // the stream.
            report.deleted = bounded(
                self.settings.db_timeout,
                self.source
                    .delete(&self.db, &published.seqs, self.settings.delete_chunk),
            )
            .await?;
        }
        Ok(report)
    }

    /// Publishes one row and parks it if it can never be published as it is.
    async fn publish(&self, row: PendingRow) -> Settled {
        let reason = match self.publish_row(&row).await {
            Ok(ack) => {
                return Settled::Acked {
                    duplicate: ack.duplicate,
                };
            }
            Err(RowFailure::Retry(error)) => return Settled::BrokerFailed(error),
            Err(RowFailure::Park(reason)) => reason,
        };
        let parked = self.source.park(&self.db, row.seq, &reason);
        match bounded(self.settings.db_timeout, parked).await {
            Ok(()) => {
                tracing::error!(
                    outbox = self.source.table(),
                    seq = row.seq,
                    event_id = %row.event_id,
                    order_id = %row.order_id,
                    %reason,
                    "outbox row parked; its order's later rows wait behind it"
                );
                Settled::Parked
            }
            Err(error) => Settled::ParkFailed(error.to_string()),
        }
    }

    /// Publishes one row and waits for its PubAck; a failure comes back as what it means for
    /// the row.
    async fn publish_row(&self, row: &PendingRow) -> Result<PublishAck, RowFailure> {
        let subject = self.source.subject(&row.subject);
        if !publishable(&subject) {
            return Err(RowFailure::Park(format!(
                "not a subject one can publish on: {subject:?}"
            )));
        }
        let message = PublishMessage::build()
            .message_id(row.event_id.to_string())
            .payload(Bytes::from(row.payload.clone()));
        let attempt = async {
            let ack = self.js.send_publish(subject.clone(), message).await?;
            ack.await
        };
        let result = match tokio::time::timeout(self.settings.publish_timeout, attempt).await {
            Ok(result) => result,
            Err(_) => Err(PublishError::new(PublishErrorKind::TimedOut)),
        };
        let error = match result {
            Ok(ack) => return Ok(ack),
            Err(error) => error,
        };
        Err(match verdict(&error) {
            Verdict::Park(reason) => RowFailure::Park(reason),
            Verdict::Retry(error) => RowFailure::Retry(error),
            Verdict::NoResponders => self.no_stream_for(&subject).await,
        })
    }

    /// After "no responders": parks only if the relay's stream is there and JetStream says no
    /// stream holds the subject. A missing stream, or a server that did not answer (still
    /// starting), is a failure of the broker: every row waits, none is parked.
    async fn no_stream_for(&self, subject: &str) -> RowFailure {
        match self.js.stream_by_subject(subject).await {
            Ok(stream) => RowFailure::Retry(format!(
                "no responders for {subject}, which stream {stream} holds: the server was not ready"
            )),
            Err(error) if error.kind() == GetStreamByNameErrorKind::NotFound => {
                match self.js.get_stream(self.source.stream()).await {
                    Ok(_) => RowFailure::Park(format!(
                        "no stream holds subject {subject} (stream {} exists, and its subjects \
                         do not cover it)",
                        self.source.stream()
                    )),
                    Err(error) => RowFailure::Retry(format!(
                        "stream {} is not there: {error}",
                        self.source.stream()
                    )),
                }
            }
            Err(error) => RowFailure::Retry(format!("no responders for {subject}: {error}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_failed_publish_means_for_its_row() {
        let cases = [
            (PublishErrorKind::MaxPayloadExceeded, "park"),
            (PublishErrorKind::StreamNotFound, "no responders"),
            (PublishErrorKind::TimedOut, "retry"),
            (PublishErrorKind::BrokenPipe, "retry"),
            (PublishErrorKind::MaxAckPending, "retry"),
            (PublishErrorKind::Other, "retry"),
        ];
        for (kind, expected) in cases {
            let got = match verdict(&PublishError::new(kind)) {
                Verdict::Park(_) => "park",
                Verdict::NoResponders => "no responders",
                Verdict::Retry(_) => "retry",
            };
            assert_eq!(got, expected, "{kind:?}");
        }
    }

    #[test]
    fn only_plain_subjects_are_published() {
        assert!(publishable("inventory.stock.reserved"));
        for bad in [
            "",
            "inventory..x",
            "inventory.*",
            "inventory.>",
            "a b",
            "a.\n",
        ] {
            assert!(!publishable(bad), "{bad:?}");
        }
    }

    #[test]
    fn the_lease_must_be_much_shorter_than_the_duplicate_window() {
        let settings = RelaySettings::default();
        assert!(settings.check_window("S", Duration::from_secs(120)).is_ok());
        assert!(settings.check_window("S", Duration::from_secs(52)).is_ok());
        let error = settings
            .check_window("S", Duration::from_secs(51))
            .expect_err("13 s is more than a quarter of 51 s");
        assert!(error.to_string().contains("duplicate window"), "{error}");
        let slow = RelaySettings {
            publish_timeout: Duration::from_secs(10),
            ..RelaySettings::default()
        };
        assert!(slow.check_window("S", Duration::from_secs(3600)).is_err());
    }
}
