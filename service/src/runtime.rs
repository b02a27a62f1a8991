//! The consumer runtime: one [`RuntimeSettings`] value says where to read, which handler runs
//! and how the lanes behave; [`ConsumerRuntime`] sets up the streams and the durable consumer
//! and runs the lanes. `serve`, the comparison, the end-to-end benchmark and the tests all start
//! consumers through it.
//!
//! The path of one message, in this file from top to bottom: the `fetcher` asks the consumer
//! for a batch for each lane that waits and hands them out; a lane (`lane`) takes one;
//! `Worker::process` reads its delivery count, dead-letters a delivery past the cap, and
//! decodes it (a body that cannot be decoded is a dead letter here); the handler applies it in one
//! transaction; [`policy::decide`] says what becomes of it; `Worker::perform` acks, naks or
//! dead-letters it. Nothing is acked before its transaction committed.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use backon::{ExponentialBuilder, Retryable as _};
use inventory_domain::{
    ConsumerName, DeadLetterReason, Effect, ErrorKind, EventKind, Message, Outcome,
};
use inventory_infra::db::{self, DatabaseConnection, NoAnswer};
use inventory_infra::delivery::{self, ConsumerConfig, Delivery, PullConsumer};
use inventory_infra::jetstream::{
    self, Backstop, Client, ConsumerSettings, ConsumerState, Context, DeadLetters, NatsError,
    Origin, Topology,
};
use inventory_infra::outbox::RelayWake;
use inventory_infra::{HandleError, MessageHandler};
use tokio::sync::Semaphore;
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, field};

use crate::health::Liveness;
use crate::metrics::ConsumerMetrics;
use crate::policy::{self, Acked, Action, Disposition, RetryPolicy};
use crate::shutdown::{self, Shutdown};

/// Everything that says how one consumer runs.
#[derive(Debug, Clone)]
pub struct RuntimeSettings {
    pub topology: Topology,
    /// The durable consumer, created with these settings if absent; an existing one keeps its
    /// own unless `update_consumer`, and the runtime follows the server's.
    pub consumer: ConsumerSettings,
    /// Sets an existing consumer's settings to `consumer`'s where they differ.
    pub update_consumer: bool,
    /// Which stream the consumer reads.
    pub reads: Reads,
    /// The deliveries of one message this service handles (see [`RetryPolicy::max_deliver`]);
    /// the server's own cap, where an existing consumer has one, lowers it.
    pub max_deliver: i64,
    /// Messages handled at once, each lane to its end.
    pub concurrency: usize,
    /// Messages a lane hands its handler at once, of those already fetched; 1 for a handler
    /// that has no batch path of its own.
    pub batch_size: usize,
    /// Bodies larger than this are dead letters, never parsed.
    pub max_body_bytes: usize,
    /// Delay before retrying a transient failure; doubles per delivery up to `max_retry_delay`.
    pub retry_delay: Duration,
    pub max_retry_delay: Duration,
    /// The client's bound on a handler's database work for one message or batch (and on a
    /// lane's check that the database answers): past it the work is abandoned and the
    /// message nak'ed as a transient failure. `None`: unbounded.
    pub work_timeout: Option<Duration>,
}

impl RuntimeSettings {
    /// `serve`'s defaults, which its flags show.
    pub const ACK_WAIT: Duration = Duration::from_secs(30);
    /// This service's cap. The consumer it creates has none: the server never stops
    /// delivering a message on its own, so none is dropped while a lane cannot hold it.
    pub const MAX_DELIVER: i64 = 10;
    pub const MAX_ACK_PENDING: i64 = 1_000;
    pub const MAX_BODY_BYTES: usize = 64 * 1024;
    pub const RETRY_DELAY: Duration = Duration::from_millis(500);
    pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(30);

    /// The durable consumer `durable_name`, reading what `reads` names of `topology`'s
    /// subjects, with the `serve` defaults: what a caller changes is set on the value returned.
    pub fn new(topology: Topology, durable_name: &str, reads: Reads, concurrency: usize) -> Self {
        let filter_subject = match reads {
            Reads::Orders => format!("{}.>", topology.subject_prefix),
            Reads::Reservations => format!(
                "{}.{}",
                topology.events_subject_prefix,
                EventKind::StockReserved.subject_token()
            ),
        };
        Self {
            consumer: ConsumerSettings {
                durable_name: durable_name.to_owned(),
                filter_subject,
                ack_wait: Self::ACK_WAIT,
                max_deliver: -1,
                backoff: Vec::new(),
                max_ack_pending: Self::MAX_ACK_PENDING,
            },
            update_consumer: false,
            topology,
            reads,
            max_deliver: Self::MAX_DELIVER,
            concurrency,
            batch_size: 1,
            max_body_bytes: Self::MAX_BODY_BYTES,
            retry_delay: Self::RETRY_DELAY,
            max_retry_delay: Self::MAX_RETRY_DELAY,
            work_timeout: None,
        }
    }
}

/// Which stream a consumer reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reads {
    /// Both order events: the stock consumers.
    Orders,
    /// Inventory's own reservations, from the events stream: the study's email notifier.
    Reservations,
}

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Nats(#[from] NatsError),
    #[error("the message stream of consumer {0} ended")]
    StreamEnded(String),
    #[error("a lane {0}: the other lanes were stopped")]
    LaneFailed(String),
}

/// A consumer set up on the server, ready to start.
pub struct ConsumerRuntime {
    settings: RuntimeSettings,
    db: DatabaseConnection,
    dead_letters: DeadLetters,
    consumer: PullConsumer,
    client: Client,
    /// The consumer's settings as the server has them, which rule over `settings.consumer`.
    server_consumer: ConsumerConfig,
    duplicate_window: Duration,
    /// The stream's `max_age`; zero: none.
    max_age: Duration,
    /// Runs beside the lanes when the server has a cap of its own on the consumer.
    backstop: Option<Backstop>,
    relay_wake: Option<RelayWake>,
    liveness: Liveness,
}

impl ConsumerRuntime {
    /// Creates the streams and the durable consumer where absent, and logs how existing ones
    /// differ from `settings`.
    pub async fn prepare(
        js: &Context,
        db: DatabaseConnection,
        settings: RuntimeSettings,
    ) -> Result<Self, RuntimeError> {
        let (orders, mut drifts) = jetstream::ensure_streams(js, &settings.topology).await?;
        let stream = match settings.reads {
            Reads::Orders => orders,
            Reads::Reservations => {
                let (events, events_drifts) =
                    jetstream::ensure_prefix_stream(js, &settings.topology.events_stream()).await?;
                drifts.extend(events_drifts);
                events
            }
        };
        let (consumer, consumer_drifts) =
            jetstream::ensure_consumer(js, &stream, &settings.consumer, settings.update_consumer)
                .await?;
        drifts.extend(consumer_drifts);
        // What the server answered to the set-up, whatever this process asked for.
        let server_consumer = consumer.cached_info().config.clone();
        let dead_letters = DeadLetters::new(
            js.clone(),
            &settings.topology,
            &settings.consumer.durable_name,
        );
        // A consumer with a cap of its own drops a message after its last delivery: its
        // advisories are the backstop's to turn into dead letters.
        let backstop = if server_consumer.max_deliver > 0 {
            let (backstop, backstop_drifts) = Backstop::prepare(
                js,
                stream.clone(),
                &settings.consumer.durable_name,
                settings.topology.replicas,
                dead_letters.clone(),
            )
            .await?;
            drifts.extend(backstop_drifts);
            Some(backstop)
        } else {
            None
        };
        for drift in &drifts {
            tracing::warn!("{drift}");
        }
        Ok(Self {
            dead_letters,
            backstop,
            duplicate_window: stream.cached_info().config.duplicate_window,
            max_age: stream.cached_info().config.max_age,
            settings,
            db,
            consumer,
            client: js.client(),
            server_consumer,
            relay_wake: None,
            liveness: Liveness::default(),
        })
    }

    /// Wakes the outbox relay of this process after every handling that committed an event
    /// (a reservation decided, reserved or rejected, or released), instead of leaving the
    /// event to the relay's backup poll.
    pub fn wake_relay_on_events(&mut self, wake: RelayWake) {
        self.relay_wake = Some(wake);
    }

    /// Where a lane that ends while the others run is reported (`/livez`).
    pub fn report_failures_to(&mut self, liveness: Liveness) {
        self.liveness = liveness;
    }

    pub fn settings(&self) -> &RuntimeSettings {
        &self.settings
    }

    /// The durable consumer's settings as the server has them.
    pub fn server_consumer(&self) -> &ConsumerConfig {
        &self.server_consumer
    }

    /// How long the stream drops a resend of a message id it has stored.
    pub fn duplicate_window(&self) -> Duration {
        self.duplicate_window
    }

    /// How long the stream keeps a message; zero when it has no limit.
    pub fn stream_max_age(&self) -> Duration {
        self.max_age
    }

    /// The durable consumer's name, under which a handler keeps its dedup rows.
    pub fn consumer_name(&self) -> Result<ConsumerName, inventory_domain::FieldError> {
        ConsumerName::parse(self.settings.consumer.durable_name.clone())
    }

    /// Starts the lanes with `handler` in a task of their own, until `shutdown`, counting into
    /// `metrics`.
    pub fn start<H: MessageHandler>(
        self,
        handler: H,
        metrics: ConsumerMetrics,
        shutdown: Shutdown,
    ) -> Running {
        let batch_size = self.settings.batch_size.max(1);
        let worker = Worker {
            handler,
            dead_letters: self.dead_letters,
            lanes: Arc::new(LaneSettings {
                concurrency: self.settings.concurrency.max(1),
                batch_size,
                max_body_bytes: self.settings.max_body_bytes,
                work_timeout: self.settings.work_timeout,
                retry: RetryPolicy {
                    max_deliver: RetryPolicy::effective_cap(
                        self.settings.max_deliver,
                        self.server_consumer.max_deliver,
                    ),
                    server_max_deliver: self.server_consumer.max_deliver,
                    retry_delay: self.settings.retry_delay,
                    max_retry_delay: self.settings.max_retry_delay,
                },
            }),
            database_suspect: Arc::new(AtomicBool::new(false)),
            metrics,
            relay_wake: self.relay_wake,
        };
        let metrics = worker.metrics.clone();
        let consumer = self.consumer.clone();
        let lanes = TaskTracker::new();
        let task = tokio::spawn({
            let (shutdown, lanes) = (shutdown.clone(), lanes.clone());
            let liveness = self.liveness;
            let lanes_of = Lanes {
                consumer: self.consumer,
                client: self.client,
                db: self.db,
                backstop: self.backstop,
                tracker: lanes,
            };
            async move { run(lanes_of, worker, shutdown, liveness).await }
        });
        Running {
            shutdown,
            metrics,
            consumer,
            lanes,
            task,
        }
    }
}

/// A consumer's lanes, running.
pub struct Running {
    pub shutdown: Shutdown,
    /// What became of its deliveries so far, among the rest.
    pub metrics: ConsumerMetrics,
    consumer: PullConsumer,
    lanes: TaskTracker,
    task: JoinHandle<Result<Ending, RuntimeError>>,
}

impl Running {
    /// Lanes still running: all of them while consuming; after a graceful stop, those still
    /// finishing a message.
    pub fn lanes(&self) -> usize {
        self.lanes.len()
    }

    /// The durable consumer's counts as the server has them: what is pending and unacked.
    pub async fn consumer_state(&self) -> Result<ConsumerState, NatsError> {
        jetstream::consumer_state(&mut self.consumer.clone()).await
    }

    /// Reads the consumer's counts every `every` into `metrics` until the first signal, for
    /// the caller to spawn: its lag is the server's to know, not any one instance's. A failed
    /// look keeps the last figures.
    pub fn report_lag(
        &self,
        metrics: ConsumerMetrics,
        every: Duration,
    ) -> impl Future<Output = ()> + Send + 'static {
        let mut consumer = self.consumer.clone();
        let stop = self.shutdown.graceful.clone();
        async move {
            let mut ticks = tokio::time::interval(every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    _ = ticks.tick() => {}
                }
                match jetstream::consumer_state(&mut consumer).await {
                    Ok(state) => metrics.record_lag(&state),
                    Err(error) => tracing::debug!(%error, "reading the consumer's lag"),
                }
            }
        }
    }

    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Waits until the lanes end: after `shutdown`, or when the consumer's stream ends.
    pub async fn wait(self) -> anyhow::Result<Ending> {
        Ok(self.task.await??)
    }

    /// Asks for a graceful stop and waits for it.
    pub async fn stop(self) -> anyhow::Result<Ending> {
        self.shutdown.graceful.cancel();
        self.wait().await
    }
}

/// How the loop ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Every in-flight message finished.
    Drained,
    /// Stopped waiting (second signal or timeout): unfinished messages stay unacked and will be
    /// redelivered; their transactions were never committed.
    Abandoned,
}

/// How the lanes treat messages.
#[derive(Debug)]
struct LaneSettings {
    concurrency: usize,
    batch_size: usize,
    max_body_bytes: usize,
    work_timeout: Option<Duration>,
    /// With the cap in effect, and the server's own.
    retry: RetryPolicy,
}

/// Runs the consumer until `shutdown.graceful` fires, then waits for every lane to finish its
/// messages, or until `shutdown.immediate`, when each naks what it holds.
///
/// `concurrency` lanes each take a batch the fetcher fetched for them and handle it to its end.
/// Each lane holds its own clone of the handler, so a handler that keeps a connection per clone
/// keeps one per lane, for as long as the loop runs.
///
/// A lane, or the fetcher, ends only once told to stop. One that ends before (a panic, a broken
/// invariant, its consumer gone) is a fault the other lanes cannot serve around: it is reported
/// (an ERROR line, the task-failure metric, `/livez`), the other lanes stop as on a signal, and
/// the loop returns an error, so the process exits with one for its supervisor to restart it,
/// rather than idle with fewer lanes or none. Every lane's end is looked at, after the stop too: a
/// panic while draining fails the loop as well.
async fn run<H: MessageHandler>(
    Lanes {
        consumer,
        client,
        db,
        backstop,
        tracker,
    }: Lanes,
    worker: Worker<H>,
    shutdown: Shutdown,
    liveness: Liveness,
) -> Result<Ending, RuntimeError> {
    let consumer = &consumer;
    let lanes = worker.lanes.concurrency;
    let stop = shutdown.graceful.child_token();
    // A lane that waits for work says so; the fetcher asks the consumer for as many batches at
    // once as lanes wait, and hands one to each. One request per instance waits at the server
    // when idle, and nothing is fetched that a waiting lane does not start.
    let waiting = Arc::new(Semaphore::new(0));
    let (hand, handed) = tokio::sync::mpsc::channel(lanes);
    let handed = Arc::new(tokio::sync::Mutex::new(handed));
    let mut running = JoinSet::new();
    running.spawn(fetcher(
        Fetcher {
            consumer: consumer.clone(),
            client,
            batch_size: worker.lanes.batch_size,
            waiting: waiting.clone(),
            hand,
        },
        stop.clone(),
        shutdown.immediate.clone(),
    ));
    for _ in 0..lanes {
        running.spawn(tracker.track_future(lane(
            worker.clone(),
            handed.clone(),
            waiting.clone(),
            db.clone(),
            stop.clone(),
            shutdown.immediate.clone(),
        )));
    }
    if let Some(backstop) = backstop {
        let stop = stop.clone();
        running.spawn(async move {
            backstop.run(stop).await;
            Ok(())
        });
    }
    tracker.close();
    let mut failures = Vec::new();
    let mut consumer_gone = false;
    // After an immediate stop, the lanes nak what they hold and end; those that do not within
    // the grace are aborted.
    let abort_after_grace = async {
        shutdown.immediate.cancelled().await;
        tokio::time::sleep(IMMEDIATE_GRACE).await;
    };
    tokio::pin!(abort_after_grace);
    let (mut stopping, mut aborted) = (false, false);
    loop {
        let ended = tokio::select! {
            ended = running.join_next() => match ended {
                Some(ended) => ended,
                None => break,
            },
            () = stop.cancelled(), if !stopping => {
                stopping = true;
                tracing::info!(lanes, "stopped fetching; finishing in-flight messages");
                continue;
            }
            () = &mut abort_after_grace, if !aborted => {
                aborted = true;
                running.abort_all();
                continue;
            }
        };
        let why = match ended {
            Ok(Ok(())) if stop.is_cancelled() => continue,
            Err(error) if error.is_cancelled() && aborted => continue,
            Ok(Ok(())) => "returned while the service ran".to_owned(),
            Ok(Err(LaneError::ConsumerGone)) => {
                consumer_gone = true;
                format!("found consumer {} gone", consumer.cached_info().name)
            }
            Ok(Err(LaneError::Halted(why))) => format!("stopped on a broken invariant: {why}"),
            Err(error) => shutdown::early_end(Err(error)),
        };
        if failures.is_empty() {
            tracing::error!(%why, "a lane ended; stopping the other lanes");
            liveness.task_failed("lane", &why);
            worker.metrics.task_failed("lane");
            // The whole service stops, as on a signal, within the same bound.
            shutdown.graceful.cancel();
        }
        failures.push(why);
    }
    // Handed to a lane that stopped before it took them: back to the server at once.
    let mut handed = handed.lock().await;
    handed.close();
    while let Ok(batch) = handed.try_recv() {
        nak_now(&batch).await;
    }
    if consumer_gone {
        return Err(RuntimeError::StreamEnded(
            consumer.cached_info().name.clone(),
        ));
    }
    if !failures.is_empty() {
        return Err(RuntimeError::LaneFailed(failures.join("; ")));
    }
    Ok(if shutdown.immediate.is_cancelled() {
        Ending::Abandoned
    } else {
        Ending::Drained
    })
}

/// What the lanes run on: the consumer, the database, the backstop beside them, and the
/// tracker that counts them.
struct Lanes {
    consumer: PullConsumer,
    client: Client,
    db: DatabaseConnection,
    backstop: Option<Backstop>,
    tracker: TaskTracker,
}

/// Why a lane ended before it was told to stop.
#[derive(Debug)]
enum LaneError {
    /// The durable consumer no longer exists on the server.
    ConsumerGone,
    /// A handler broke an invariant of this program (a bug): nothing was sent for the
    /// messages it held, which come again after their ack wait, to a restarted process.
    Halted(String),
}

/// What the fetcher fetches for, and how it hands it out.
struct Fetcher {
    consumer: PullConsumer,
    client: Client,
    batch_size: usize,
    /// A permit for each lane that waits for work.
    waiting: Arc<Semaphore>,
    hand: tokio::sync::mpsc::Sender<Vec<Delivery>>,
}

/// Until `stop`: once lanes wait, asks the consumer for a batch for each of them at once (those
/// there now, or the first to come), and hands each a batch; a fetch for lanes that no longer
/// wait is given up at the stop, and what was handed out and not taken is nak'ed by the loop.
async fn fetcher(
    fetcher: Fetcher,
    stop: CancellationToken,
    immediate: CancellationToken,
) -> Result<(), LaneError> {
    let Fetcher {
        consumer,
        client,
        batch_size,
        waiting,
        hand,
    } = fetcher;
    loop {
        let lanes = tokio::select! {
            () = stop.cancelled() => return Ok(()),
            permit = waiting.acquire() => {
                permit.map_err(|_| LaneError::Halted("the lanes' semaphore closed".into()))?.forget();
                1 + waiting.forget_permits(usize::MAX)
            }
        };
        let asked = Instant::now();
        let fetched = tokio::select! {
            fetched = delivery::fetch(&consumer, &client, lanes * batch_size, &stop) => fetched,
            () = immediate.cancelled() => return Ok(()),
        };
        let failed = fetched.error.is_some();
        if let Some(error) = &fetched.error {
            tracing::warn!(%error, "fetching");
        }
        if (failed || fetched.unanswered) && jetstream::consumer_is_gone(&consumer).await {
            return Err(LaneError::ConsumerGone);
        }
        let mut messages = fetched.messages.into_iter().peekable();
        let mut handed = 0;
        while messages.peek().is_some() {
            let batch: Vec<Delivery> = messages.by_ref().take(batch_size).collect();
            if hand.send(batch).await.is_err() {
                // Every lane ended.
                return Ok(());
            }
            handed += 1;
        }
        // Those still waiting are asked for again.
        waiting.add_permits(lanes.saturating_sub(handed));
        if handed == 0 {
            // Failed, or refused at once (other requests wait for what there is): not a reason
            // to ask again in a tight loop.
            let pause = if failed {
                FAILED_FETCH_PAUSE
            } else if asked.elapsed() < EMPTY_FETCH_PAUSE {
                EMPTY_FETCH_PAUSE
            } else {
                Duration::ZERO
            };
            tokio::select! {
                () = stop.cancelled() => return Ok(()),
                () = tokio::time::sleep(pause) => {}
            }
        }
    }
}

/// One lane: wait for a batch the fetcher hands it, handle it to the end, repeat, until `stop`.
/// On `immediate` it gives up the messages it holds, nak'ed to come again at once.
async fn lane<H: MessageHandler>(
    worker: Worker<H>,
    handed: Arc<tokio::sync::Mutex<tokio::sync::mpsc::Receiver<Vec<Delivery>>>>,
    waiting: Arc<Semaphore>,
    db: DatabaseConnection,
    stop: CancellationToken,
    immediate: CancellationToken,
) -> Result<(), LaneError> {
    loop {
        // Every lane holds while the database is suspect, not only the first to notice: a lane
        // that fetched on would burn its messages' deliveries on an outage.
        if worker.database_suspect.load(Ordering::Relaxed) {
            if !wait_for_database(&db, worker.lanes.work_timeout, &stop).await {
                return Ok(());
            }
            worker.database_suspect.store(false, Ordering::Relaxed);
        }
        waiting.add_permits(1);
        let batch = tokio::select! {
            () = stop.cancelled() => return Ok(()),
            batch = async { handed.lock().await.recv().await } => match batch {
                Some(batch) => batch,
                None => return Ok(()),
            },
        };
        let handled = async {
            match batch.as_slice() {
                [message] => vec![worker.process(message).instrument(message_span()).await],
                messages => worker.process_batch(messages).await,
            }
        };
        let dispositions = tokio::select! {
            dispositions = handled => dispositions,
            () = immediate.cancelled() => {
                // Whatever committed is acked by now or comes again as a duplicate.
                nak_now(&batch).await;
                return Ok(());
            }
        };
        if let Some(Disposition::Halted(why)) = dispositions
            .into_iter()
            .find(|disposition| matches!(disposition, Disposition::Halted(_)))
        {
            return Err(LaneError::Halted(why));
        }
    }
}

/// How long the lanes have to nak what they hold after an immediate stop.
const IMMEDIATE_GRACE: Duration = Duration::from_millis(500);

/// Pause after a fetch refused at once.
const EMPTY_FETCH_PAUSE: Duration = Duration::from_millis(50);
/// Pause after a fetch that failed (NATS away, or reconnecting).
const FAILED_FETCH_PAUSE: Duration = Duration::from_secs(1);

/// Gives `messages` back for redelivery now: held at an immediate stop.
async fn nak_now(messages: &[Delivery]) {
    for message in messages {
        if let Err(error) = delivery::nak(message, Duration::ZERO).await {
            tracing::warn!(%error, "nak not sent; the message comes again after its ack wait");
        }
    }
}

/// Waits until the database answers again and takes writes (a standby reached during a
/// failover answers, but refuses every write); false if shutdown came first. Until then nothing
/// is fetched, so messages are not burned through their delivery attempts. Each look is
/// bounded by `bound`: one on a connection gone silent would wait forever.
async fn wait_for_database(
    db: &DatabaseConnection,
    bound: Option<Duration>,
    shutdown: &CancellationToken,
) -> bool {
    let mut was_down = false;
    let reachable = (|| async { db::within(bound, db::check_writable(db)).await? })
        .retry(DATABASE_LOOKS)
        .notify(|error, _| {
            was_down = true;
            tracing::warn!(%error, "database unreachable; not fetching");
        });
    tokio::select! {
        () = shutdown.cancelled() => return false,
        _ = reachable => {}
    }
    if was_down {
        tracing::info!("database reachable; consuming");
    }
    true
}

/// How often [`wait_for_database`] looks: after 200 ms, doubling up to 5 s, until it answers.
const DATABASE_LOOKS: ExponentialBuilder = ExponentialBuilder::new()
    .with_min_delay(Duration::from_millis(200))
    .with_max_delay(Duration::from_secs(5))
    .without_max_times();

/// Whether a handling that came to `outcome` committed an outbox event: every decision of
/// the natural key does, a duplicate or a placement after the cancellation does not.
fn wrote_an_event(outcome: &Outcome) -> bool {
    matches!(
        outcome,
        Outcome::Processed(
            Effect::Reserved { .. } | Effect::Rejected { .. } | Effect::Released { .. }
        )
    )
}

fn message_span() -> tracing::Span {
    tracing::info_span!(
        "message",
        message_id = field::Empty,
        stream_seq = field::Empty,
        delivered = field::Empty,
        disposition = field::Empty,
    )
}

/// A delivery after decoding: ready for the handler, or already settled (dead-lettered).
enum Admitted<'a> {
    Decoded(Origin<'a>, Message),
    Settled(Disposition),
}

/// Everything one delivery needs; cloned into each lane.
#[derive(Clone)]
struct Worker<H> {
    handler: H,
    dead_letters: DeadLetters,
    lanes: Arc<LaneSettings>,
    /// Set when a handler hit a database error: the loop checks the database before fetching.
    database_suspect: Arc<AtomicBool>,
    metrics: ConsumerMetrics,
    /// The outbox relay to wake after a handling that committed an event.
    relay_wake: Option<RelayWake>,
}

impl<H: MessageHandler> Worker<H> {
    /// Handles one delivery to its end.
    async fn process(&self, message: &Delivery) -> Disposition {
        let started = Instant::now();
        let in_flight = self.metrics.start();
        let disposition = match self.admit(message).await {
            Admitted::Settled(disposition) => disposition,
            Admitted::Decoded(origin, decoded) => {
                let result = db::within(self.lanes.work_timeout, self.handler.handle(&decoded))
                    .await
                    .unwrap_or_else(|NoAnswer(bound)| Err(HandleError::TimedOut(bound)));
                self.settle(message, &origin, result).await
            }
        };
        self.record(&disposition, started);
        drop(in_flight);
        tracing::Span::current().record("disposition", field::debug(&disposition));
        disposition
    }

    fn record(&self, disposition: &Disposition, started: Instant) {
        self.metrics.record(disposition, started.elapsed());
    }

    /// Handles deliveries as one batch: the handler may commit them in one transaction; each
    /// is then acked, dead-lettered or nak'ed on its own outcome.
    async fn process_batch(&self, messages: &[Delivery]) -> Vec<Disposition> {
        let started = Instant::now();
        let in_flight: Vec<_> = messages.iter().map(|_| self.metrics.start()).collect();
        let mut dispositions: Vec<Option<Disposition>> = Vec::with_capacity(messages.len());
        let mut decoded = Vec::new();
        let mut origins = Vec::new();
        // One span a message, through admission and settling: its log lines carry its id,
        // stream sequence and delivery count as a single message's do.
        let spans: Vec<tracing::Span> = messages.iter().map(|_| message_span()).collect();
        for (message, span) in messages.iter().zip(&spans) {
            match self.admit(message).instrument(span.clone()).await {
                Admitted::Settled(disposition) => dispositions.push(Some(disposition)),
                Admitted::Decoded(origin, message) => {
                    dispositions.push(None);
                    decoded.push(message);
                    origins.push(origin);
                }
            }
        }
        let mut results = db::within(self.lanes.work_timeout, self.handler.handle_batch(&decoded))
            .await
            .unwrap_or_else(|NoAnswer(bound)| {
                vec![Err(HandleError::TimedOut(bound)); decoded.len()]
            })
            .into_iter();
        let mut origins = origins.into_iter();
        let mut settled = Vec::with_capacity(messages.len());
        for ((message, disposition), span) in messages.iter().zip(dispositions).zip(spans) {
            // Results and origins belong to the decoded deliveries only, in order: one settled
            // at admission takes none.
            let disposition = match disposition {
                Some(disposition) => disposition,
                None => match (results.next(), origins.next()) {
                    (Some(result), Some(origin)) => {
                        self.settle(message, &origin, result)
                            .instrument(span.clone())
                            .await
                    }
                    // A handler that returned fewer results than messages: a bug, not a guess.
                    _ => Disposition::Halted(
                        "the handler returned fewer results than messages".to_owned(),
                    ),
                },
            };
            span.record("disposition", field::debug(&disposition));
            self.record(&disposition, started);
            settled.push(disposition);
        }
        drop(in_flight);
        settled
    }

    /// Reads where a delivery came from and decodes it; a delivery past the cap, or a body
    /// that cannot be decoded, is dead-lettered here.
    async fn admit<'a>(&self, message: &'a Delivery) -> Admitted<'a> {
        let Some(origin) = delivery::origin(message) else {
            // Not a JetStream delivery: there is nothing to ack, so nothing to do.
            tracing::error!(subject = %message.subject, "message without JetStream metadata");
            return Admitted::Settled(Disposition::LeftForRedelivery);
        };
        let span = tracing::Span::current();
        span.record("stream_seq", origin.stream_sequence);
        span.record("delivered", origin.deliveries);
        if let Some(action) = policy::admit(origin.deliveries, &self.lanes.retry) {
            return Admitted::Settled(self.perform(message, &origin, action).await);
        }
        match self.decode(message) {
            Ok(decoded) => {
                span.record("message_id", field::display(&decoded.key));
                Admitted::Decoded(origin, decoded)
            }
            Err((reason, detail)) => {
                let action = Action::DeadLetter { reason, detail };
                Admitted::Settled(self.perform(message, &origin, action).await)
            }
        }
    }

    fn decode(&self, message: &Delivery) -> Result<Message, (DeadLetterReason, String)> {
        if message.payload.len() > self.lanes.max_body_bytes {
            return Err((
                DeadLetterReason::Malformed,
                format!(
                    "body of {} bytes is over the {}-byte limit; not parsed",
                    message.payload.len(),
                    self.lanes.max_body_bytes
                ),
            ));
        }
        let kind = EventKind::from_subject(&message.subject).ok_or_else(|| {
            (
                DeadLetterReason::Invalid,
                format!("subject {} carries no order event", message.subject),
            )
        })?;
        Message::decode(kind, &message.payload).map_err(|error| (error.reason(), error.to_string()))
    }

    /// Asks the policy what becomes of the handler's answer, and does it.
    async fn settle(
        &self,
        message: &Delivery,
        origin: &Origin<'_>,
        result: Result<Outcome, HandleError>,
    ) -> Disposition {
        // A crash injected at a crash point (the study's and the tests' `FaultPlan`): the process
        // "died" here, so it sends nothing and JetStream delivers the message again after its
        // ack wait.
        if let Err(HandleError::Crashed(point)) = &result {
            tracing::warn!(point = point.as_str(), "handler crashed (injected)");
            return Disposition::LeftForRedelivery;
        }
        if let Some(wake) = &self.relay_wake
            && matches!(&result, Ok(outcome) if wrote_an_event(outcome))
        {
            // Committed: the relay can see the row now.
            wake.notify();
        }
        let retry = &self.lanes.retry;
        let action = match &result {
            Ok(outcome) => policy::decide(Ok(outcome), origin.deliveries, retry),
            Err(error) => {
                let kind = self.kind_of(error);
                let text = error.to_string();
                policy::decide(Err((&kind, &text)), origin.deliveries, retry)
            }
        };
        self.perform(message, origin, action).await
    }

    /// What a handler's error means for its delivery, logged; a database error also pauses
    /// fetching until the database answers.
    fn kind_of(&self, error: &HandleError) -> ErrorKind {
        let kind = error.kind();
        match &kind {
            ErrorKind::Permanent(_) => tracing::warn!(%error, "permanent failure"),
            ErrorKind::Internal => tracing::error!(%error, "broken invariant; stopping"),
            ErrorKind::Transient => {
                if error.is_database() {
                    self.database_suspect.store(true, Ordering::Relaxed);
                }
                tracing::warn!(%error, "transient failure");
            }
        }
        kind
    }

    /// Sends what `action` says: the only place a delivery is acked, nak'ed or terminated.
    async fn perform(
        &self,
        message: &Delivery,
        origin: &Origin<'_>,
        action: Action,
    ) -> Disposition {
        match action {
            Action::Ack(acked) => match delivery::ack(message).await {
                Ok(()) => {
                    // A duplicate is a success like any other, not news.
                    if acked == Acked::Duplicate {
                        tracing::debug!(outcome = acked.label(), "acked");
                    } else {
                        tracing::info!(outcome = acked.label(), "acked");
                    }
                    Disposition::Acked(acked)
                }
                Err(error) => {
                    tracing::warn!(%error, "ack not sent; the redelivery will be a duplicate");
                    Disposition::LeftForRedelivery
                }
            },
            Action::Nak(delay) => {
                tracing::warn!(retry_in = ?delay, "nak");
                match delivery::nak(message, delay).await {
                    Ok(()) => Disposition::Retried(delay),
                    Err(_) => Disposition::LeftForRedelivery,
                }
            }
            Action::DeadLetter { reason, detail } => {
                self.dead_letter(message, origin, reason, &detail).await
            }
            Action::LeaveToAdvisory => {
                tracing::warn!(
                    "the server delivers this message no more; its MAX_DELIVERIES advisory \
                     brings it to the dead letters"
                );
                Disposition::LeftForRedelivery
            }
            Action::Halt(why) => Disposition::Halted(why),
        }
    }

    /// Publishes the dead letter, and only once the DLQ stream stored it terminates the
    /// original, so a poison message is neither lost nor redelivered forever.
    async fn dead_letter(
        &self,
        message: &Delivery,
        origin: &Origin<'_>,
        reason: DeadLetterReason,
        detail: &str,
    ) -> Disposition {
        let published = self
            .dead_letters
            .publish(
                origin,
                message.headers.as_ref(),
                message.payload.clone(),
                reason,
                detail,
            )
            .await;
        if let Err(error) = published {
            tracing::warn!(%error, reason = reason.as_str(), "dead letter not stored");
            let action = policy::dead_letter_not_stored(origin.deliveries, &self.lanes.retry);
            return Box::pin(self.perform(message, origin, action)).await;
        }
        tracing::warn!(reason = reason.as_str(), detail, "dead-lettered");
        match delivery::terminate(message).await {
            Ok(()) => Disposition::DeadLettered(reason),
            Err(error) => {
                // The dead letter is stored under an id derived from this delivery: the
                // redelivery stores no second copy.
                tracing::warn!(%error, "term not sent");
                Disposition::LeftForRedelivery
            }
        }
    }
}
