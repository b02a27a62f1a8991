//! The consumer: one [`RuntimeSettings`] value says where to read and how the lanes behave;
//! [`ConsumerRuntime`] sets up the streams and the durable consumer and runs the lanes with a
//! handler. `serve`, the comparison, the end-to-end benchmark and the tests all start consumers
//! through it.
//!
//! The path of one message, in the order to read it:
//! 1. `lanes.rs`: the fetcher asks the durable consumer for a batch for each lane that waits and
//!    hands them out; a lane takes one and handles it to its end;
//! 2. [`policy`] (`policy.rs`): what becomes of a delivery, from plain values: the words the
//!    next file is written in (`Action`, `Disposition`);
//! 3. `message.rs`: a delivery's count read (one past the cap is a dead letter), its body
//!    decoded (one that cannot be decoded is a dead letter), the handler called, its answer
//!    settled by the policy and performed: ack, nak or dead letter;
//! 4. the handler: `inventory_infra::NaturalKey` (`infra/src/consumers/mod.rs`), which runs
//!    `RESERVE_SQL` (`infra/src/consumers/natural_pg.rs`) or SQLite's writer.
//!
//! Nothing is acked before its transaction committed.

mod lanes;
mod message;
pub mod policy;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
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
use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;

use crate::health::Liveness;
use crate::metrics::ConsumerMetrics;
use crate::shutdown::Shutdown;
use lanes::Lanes;
use message::Worker;
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
            async move { lanes::run(lanes_of, worker, shutdown, liveness).await }
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
            let mut ticks = Every::new(every, stop);
            while ticks.tick().await {
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
    /// Stopped waiting (second signal or timeout): the lanes nak'ed what they held, to come
    /// again at once; a message whose transaction had committed comes again as a duplicate.
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
