//! The consumer: one [`RuntimeSettings`] value says where to read and how the lanes behave;
//! [`ConsumerRuntime`] sets up the streams and the durable consumer and runs the lanes with a
//! handler. `serve`, the comparison, the end-to-end benchmark and the tests all start consumers
//! through it.
//!
//! The path of one message, in the order to read it:
//! 1. `lanes.rs`: while a lane waits, each durable consumer's fetcher asks it for a batch and
//!    hands it out; a lane, whichever consumer the batch is of, takes it and handles it to its
//!    end;
//! 2. [`policy`] (`policy.rs`): what becomes of a delivery, from plain values: the words the
//!    next file is written in (`Action`, `Disposition`);
//! 3. `message.rs`: a delivery's count read (one past the cap is a dead letter), its body
//!    decoded (one that cannot be decoded is a dead letter), the handler called, its answer
//!    settled by the policy and performed: ack, nak or dead letter; on a shard, a "not owned"
//!    answer also stops its consumer's fetcher pulling the partition (`ownership.rs`) until
//!    the database owns it again;
//! 4. the handler: `inventory_infra::NaturalKey` (`infra/src/consumers/mod.rs`), which runs
//!    `RESERVE_SQL` (`infra/src/consumers/natural_pg.rs`) or SQLite's writer.
//!
//! Nothing is acked before its transaction committed.

mod lanes;
mod message;
mod ownership;
pub mod policy;

use std::sync::Arc;
use std::time::Duration;

use inventory_domain::{ConsumerName, EventKind};
use inventory_infra::MessageHandler;
use inventory_infra::db::DatabaseConnection;
use inventory_infra::delivery::{ConsumerConfig, PullConsumer};
use inventory_infra::jetstream::{
    self, Backstop, Client, ConsumerSettings, ConsumerState, Context, DeadLetters, NatsError,
    Topology,
};
use inventory_infra::outbox::RelayWake;
use inventory_infra::periodic::Every;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::health::Liveness;
use crate::metrics::ConsumerMetrics;
use crate::shutdown::Shutdown;
use lanes::{Fed, LaneState, Lanes};
use message::Worker;
use ownership::Ownership;
use policy::RetryPolicy;

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
    /// Lanes [`ConsumerRuntime::start`] runs: messages (or batches) handled at once, each to
    /// its end.
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
        let filter = match reads {
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
                filters: vec![filter],
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

    /// Reads the consumer's counts every `every` into `metrics` until `stop`, for the caller to
    /// spawn: its lag is the server's to know, not any one instance's. A failed look keeps the
    /// last figures.
    pub fn report_lag(
        &self,
        metrics: ConsumerMetrics,
        every: Duration,
        stop: CancellationToken,
    ) -> impl Future<Output = anyhow::Result<()>> + Send + 'static {
        let mut consumer = self.consumer.clone();
        async move {
            let mut ticks = Every::new(every, stop);
            while ticks.tick().await {
                match jetstream::consumer_state(&mut consumer).await {
                    Ok(state) => metrics.record_lag(&state),
                    Err(error) => tracing::debug!(%error, "reading the consumer's lag"),
                }
            }
            Ok(())
        }
    }

    /// Starts its `concurrency` lanes with `handler` in a task of their own, until `shutdown`,
    /// counting into `metrics`.
    pub fn start<H: MessageHandler>(
        self,
        handler: H,
        metrics: ConsumerMetrics,
        shutdown: Shutdown,
    ) -> Running {
        let lanes = self.settings.concurrency;
        self.start_sharing(metrics, Vec::new(), handler, lanes, shutdown)
    }

    /// Starts `lanes` lanes with `handler` in a task of their own, until `shutdown`, shared by
    /// this consumer and `others`, each counting into the metrics beside it. The lanes check
    /// that the database answers on this one's, and report a lane that fails where this one
    /// says ([`Self::report_failures_to`]).
    pub fn start_sharing<H: MessageHandler>(
        self,
        metrics: ConsumerMetrics,
        others: Vec<(ConsumerRuntime, ConsumerMetrics)>,
        handler: H,
        lanes: usize,
        shutdown: Shutdown,
    ) -> Running {
        let state = watch::Sender::new(LaneState::default());
        let (client, db, liveness) = (self.client.clone(), self.db.clone(), self.liveness.clone());
        let work_timeout = self.settings.work_timeout;
        let consumers: Vec<Fed> = std::iter::once((self, metrics))
            .chain(others)
            .map(|(runtime, metrics)| runtime.fed(metrics, state.clone()))
            .collect();
        let tracker = TaskTracker::new();
        let pulled = consumers.iter().map(|fed| fed.consumer.clone()).collect();
        let lanes_of = Lanes {
            consumers,
            lanes: lanes.max(1),
            client,
            db,
            work_timeout,
            state,
            tracker: tracker.clone(),
        };
        let task = tokio::spawn(lanes::run(lanes_of, handler, shutdown.clone(), liveness));
        Running {
            shutdown,
            consumers: pulled,
            lanes: tracker,
            task,
        }
    }

    /// The consumer as the lanes serve it: its deliveries handled as its settings say.
    fn fed(self, metrics: ConsumerMetrics, state: watch::Sender<LaneState>) -> Fed {
        let worker = Worker {
            dead_letters: self.dead_letters,
            lanes: LaneSettings {
                batch_size: self.settings.batch_size.max(1),
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
            },
            lane_state: state,
            metrics,
            relay_wake: self.relay_wake,
            ownership: Ownership::default(),
        };
        Fed {
            consumer: self.consumer,
            worker: Arc::new(worker),
            backstop: self.backstop,
        }
    }
}

/// Lanes running, and the consumers they serve.
pub struct Running {
    pub shutdown: Shutdown,
    consumers: Vec<PullConsumer>,
    lanes: TaskTracker,
    task: JoinHandle<Result<Ending, RuntimeError>>,
}

impl Running {
    /// Lanes still running: all of them while consuming; after a graceful stop, those still
    /// finishing a message.
    pub fn lanes(&self) -> usize {
        self.lanes.len()
    }

    /// The durable consumers' counts as the server has them, summed: what is pending and
    /// unacked.
    pub async fn consumer_state(&self) -> Result<ConsumerState, NatsError> {
        let mut sum = ConsumerState {
            pending: 0,
            ack_pending: 0,
            redelivered: 0,
        };
        for consumer in &self.consumers {
            let state = jetstream::consumer_state(&mut consumer.clone()).await?;
            sum.pending += state.pending;
            sum.ack_pending += state.ack_pending;
            sum.redelivered += state.redelivered;
        }
        Ok(sum)
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
    /// Stopped waiting (second signal or timeout): the lanes nak'ed what they held, to come
    /// again at once; a message whose transaction had committed comes again as a duplicate.
    Abandoned,
}

/// How the lanes treat messages.
#[derive(Debug)]
struct LaneSettings {
    /// Messages a lane takes of this consumer at once.
    batch_size: usize,
    max_body_bytes: usize,
    work_timeout: Option<Duration>,
    /// With the cap in effect, and the server's own.
    retry: RetryPolicy,
}
