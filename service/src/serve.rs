//! `inventory serve`: the JetStream subscriber.
//!
//! Pulls from a durable consumer with at most `concurrency` messages in flight. Each message is
//! decoded, handled by the strategy, and then: acked (processed or duplicate: both success),
//! dead-lettered and terminated (a permanent refusal, or the last allowed delivery failing), or
//! nak'ed with a growing delay (a transient failure). Nothing is acked before its transaction
//! committed. On shutdown it stops fetching, lets in-flight messages finish and ack, and returns;
//! the caller then drains the connection.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream::AckKind;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::consumer::pull::MessagesError as PullError;
use futures::{FutureExt, StreamExt};
use inventory_domain::{ConsumerName, DeadLetterReason, ErrorKind, EventKind, Message, Outcome};
use inventory_infra::consumers::natural_pg::PgNaturalKey;
use inventory_infra::db::{self, DatabaseConnection};
use inventory_infra::jetstream::{self, ConsumerSettings, DeadLetters, Origin};
use inventory_infra::redact::redact_url;
use inventory_infra::{
    DetectMode, EMAIL_CONSUMER, EmailConsumer, FileMailbox, MessageHandler, StockConsumer, Strategy,
};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, field};

use crate::args::{DatabaseArgs, NatsArgs, TopologyArgs};
use crate::metrics::{ConsumerMetrics, Metrics};
use crate::retention::{self, PurgeSettings};

/// How the loop treats messages; see the `serve` flags for the defaults.
#[derive(Debug, Clone)]
pub struct ServeSettings {
    pub concurrency: usize,
    /// Messages a lane hands the handler at once (committed together where it supports it).
    pub batch_size: usize,
    pub max_body_bytes: usize,
    /// The consumer's `max_deliver` as the server has it; -1 for unlimited.
    pub max_deliver: i64,
    pub retry_delay: Duration,
    pub max_retry_delay: Duration,
}

impl ServeSettings {
    /// Delay before the next try after `delivered` failed deliveries: doubling, capped.
    pub fn retry_delay_after(&self, delivered: i64) -> Duration {
        let doublings = u32::try_from(delivered.saturating_sub(1).clamp(0, 20)).unwrap_or(20);
        self.retry_delay
            .saturating_mul(2u32.saturating_pow(doublings))
            .min(self.max_retry_delay)
    }

    fn is_last_delivery(&self, delivered: i64) -> bool {
        self.max_deliver > 0 && delivered >= self.max_deliver
    }
}

/// What became of one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disposition {
    /// Handled and acked; the label is the outcome's (`processed`, `duplicate`, `rejected`).
    Acked(&'static str),
    DeadLettered(DeadLetterReason),
    /// Nak'ed, to come again after the delay.
    Retried(Duration),
    /// Left unacked (the handler died, or an ack or dead letter could not be sent): JetStream
    /// redelivers it after the ack wait.
    LeftForRedelivery,
}

/// Counts of dispositions since start.
#[derive(Debug, Default)]
pub struct Stats {
    pub acked: AtomicU64,
    pub duplicates: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub retried: AtomicU64,
    pub left_for_redelivery: AtomicU64,
}

impl Stats {
    fn record(&self, disposition: &Disposition) {
        let counter = match disposition {
            Disposition::Acked("duplicate") => &self.duplicates,
            Disposition::Acked(_) => &self.acked,
            Disposition::DeadLettered(_) => &self.dead_lettered,
            Disposition::Retried(_) => &self.retried,
            Disposition::LeftForRedelivery => &self.left_for_redelivery,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// A delivery after decoding: ready for the handler, or already settled (dead-lettered).
enum Admitted {
    Decoded(Origin, Message),
    Settled(Disposition),
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

/// Everything one delivery needs; cloned into each lane.
#[derive(Clone)]
pub struct Worker<H> {
    pub handler: H,
    pub dead_letters: DeadLetters,
    pub settings: Arc<ServeSettings>,
    pub stats: Arc<Stats>,
    /// Set when a handler hit a database error: the loop checks the database before fetching.
    database_suspect: Arc<AtomicBool>,
    /// Prometheus counters, when `--metrics-addr` is set.
    metrics: Option<ConsumerMetrics>,
}

impl<H: MessageHandler> Worker<H> {
    pub fn new(handler: H, dead_letters: DeadLetters, settings: ServeSettings) -> Self {
        Self {
            handler,
            dead_letters,
            settings: Arc::new(settings),
            stats: Arc::new(Stats::default()),
            database_suspect: Arc::new(AtomicBool::new(false)),
            metrics: None,
        }
    }

    /// Records every delivery in `metrics` too.
    pub fn with_metrics(mut self, metrics: ConsumerMetrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Handles one delivery to its end: the step the loop runs for every message, public so a
    /// test can drive the consumer one message at a time.
    pub async fn process(&self, message: &async_nats::jetstream::Message) -> Disposition {
        let started = Instant::now();
        let in_flight = self.metrics.as_ref().map(ConsumerMetrics::start);
        let disposition = match self.admit(message).await {
            Admitted::Settled(disposition) => disposition,
            Admitted::Decoded(origin, decoded) => {
                let result = self.handler.handle(&decoded).await;
                self.settle(message, &origin, result).await
            }
        };
        self.record(&disposition, started);
        drop(in_flight);
        tracing::Span::current().record("disposition", field::debug(&disposition));
        disposition
    }

    fn record(&self, disposition: &Disposition, started: Instant) {
        self.stats.record(disposition);
        if let Some(metrics) = &self.metrics {
            metrics.record(disposition, started.elapsed());
        }
    }

    /// Handles deliveries as one batch: the handler may commit them in one transaction; each
    /// is then acked, dead-lettered or nak'ed on its own outcome.
    pub async fn process_batch(
        &self,
        messages: &[async_nats::jetstream::Message],
    ) -> Vec<Disposition> {
        let started = Instant::now();
        let in_flight: Vec<_> = messages
            .iter()
            .filter_map(|_| self.metrics.as_ref().map(ConsumerMetrics::start))
            .collect();
        let mut dispositions: Vec<Option<Disposition>> = Vec::with_capacity(messages.len());
        let mut decoded = Vec::new();
        let mut origins = Vec::new();
        for message in messages {
            let span = message_span();
            match self.admit(message).instrument(span).await {
                Admitted::Settled(disposition) => dispositions.push(Some(disposition)),
                Admitted::Decoded(origin, message) => {
                    dispositions.push(None);
                    decoded.push(message);
                    origins.push(origin);
                }
            }
        }
        let mut results = self.handler.handle_batch(&decoded).await.into_iter();
        let mut origins = origins.into_iter();
        let mut settled = Vec::with_capacity(messages.len());
        for (message, disposition) in messages.iter().zip(dispositions) {
            let span = message_span();
            let disposition = match (disposition, results.next(), origins.next()) {
                (Some(disposition), _, _) => disposition,
                (None, Some(result), Some(origin)) => {
                    span.record("stream_seq", origin.stream_sequence);
                    span.record("delivered", origin.deliveries);
                    self.settle(message, &origin, result)
                        .instrument(span.clone())
                        .await
                }
                // A handler that returned fewer results than messages: leave the rest for
                // redelivery rather than guess.
                (None, _, _) => Disposition::LeftForRedelivery,
            };
            span.record("disposition", field::debug(&disposition));
            self.record(&disposition, started);
            settled.push(disposition);
        }
        drop(in_flight);
        settled
    }

    /// Reads where a delivery came from and decodes it; a body that cannot be decoded is
    /// dead-lettered here.
    async fn admit(&self, message: &async_nats::jetstream::Message) -> Admitted {
        let origin = match message.info() {
            Ok(info) => Origin {
                subject: message.subject.to_string(),
                stream: info.stream.to_owned(),
                stream_sequence: info.stream_sequence,
                deliveries: info.delivered,
            },
            Err(error) => {
                // Not a JetStream delivery: there is nothing to ack, so nothing to do.
                tracing::error!(%error, subject = %message.subject, "message without JetStream metadata");
                return Admitted::Settled(Disposition::LeftForRedelivery);
            }
        };
        let span = tracing::Span::current();
        span.record("stream_seq", origin.stream_sequence);
        span.record("delivered", origin.deliveries);
        match self.decode(message) {
            Ok(decoded) => {
                span.record("message_id", field::display(&decoded.key));
                Admitted::Decoded(origin, decoded)
            }
            Err((reason, detail)) => {
                Admitted::Settled(self.dead_letter(message, &origin, reason, &detail).await)
            }
        }
    }

    /// Acts on the handler's answer: ack, dead letter, or nak.
    async fn settle(
        &self,
        message: &async_nats::jetstream::Message,
        origin: &Origin,
        result: Result<Outcome, inventory_infra::HandleError>,
    ) -> Disposition {
        match result {
            Ok(Outcome::Refused(refusal)) => {
                self.dead_letter(message, origin, refusal.reason, &refusal.detail)
                    .await
            }
            Ok(outcome) => match message.ack().await {
                Ok(()) => {
                    // A duplicate is a success like any other, not news.
                    if outcome == Outcome::Duplicate {
                        tracing::debug!(outcome = outcome.label(), "acked");
                    } else {
                        tracing::info!(outcome = outcome.label(), "acked");
                    }
                    Disposition::Acked(outcome.label())
                }
                Err(error) => {
                    tracing::warn!(%error, "ack not sent; the redelivery will be a duplicate");
                    Disposition::LeftForRedelivery
                }
            },
            Err(error) => match error.kind() {
                ErrorKind::Crashed(point) => {
                    tracing::warn!(point = point.as_str(), "handler crashed (injected)");
                    Disposition::LeftForRedelivery
                }
                ErrorKind::Permanent(refusal) => {
                    self.dead_letter(message, origin, refusal.reason, &refusal.detail)
                        .await
                }
                ErrorKind::Transient => {
                    if error.is_database() {
                        self.database_suspect.store(true, Ordering::Relaxed);
                    }
                    if self.settings.is_last_delivery(origin.deliveries) {
                        let detail =
                            format!("last of {} deliveries failed: {error}", origin.deliveries);
                        return self
                            .dead_letter(message, origin, DeadLetterReason::MaxDeliveries, &detail)
                            .await;
                    }
                    let delay = self.settings.retry_delay_after(origin.deliveries);
                    tracing::warn!(%error, retry_in = ?delay, "transient failure; nak");
                    match message.ack_with(AckKind::Nak(Some(delay))).await {
                        Ok(()) => Disposition::Retried(delay),
                        Err(_) => Disposition::LeftForRedelivery,
                    }
                }
            },
        }
    }

    fn decode(
        &self,
        message: &async_nats::jetstream::Message,
    ) -> Result<Message, (DeadLetterReason, String)> {
        if message.payload.len() > self.settings.max_body_bytes {
            return Err((
                DeadLetterReason::Malformed,
                format!(
                    "body of {} bytes is over the {}-byte limit; not parsed",
                    message.payload.len(),
                    self.settings.max_body_bytes
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

    /// Publishes the dead letter, and only once the DLQ stream stored it terminates the
    /// original, so a poison message is neither lost nor redelivered forever.
    async fn dead_letter(
        &self,
        message: &async_nats::jetstream::Message,
        origin: &Origin,
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
            let delay = self.settings.retry_delay_after(origin.deliveries);
            tracing::warn!(%error, reason = reason.as_str(), "dead letter not stored; nak");
            return match message.ack_with(AckKind::Nak(Some(delay))).await {
                Ok(()) => Disposition::Retried(delay),
                Err(_) => Disposition::LeftForRedelivery,
            };
        }
        tracing::warn!(reason = reason.as_str(), detail, "dead-lettered");
        match message.ack_with(AckKind::Term).await {
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

/// How the loop is asked to stop: `graceful` stops fetching and waits for in-flight messages;
/// `immediate` gives up waiting.
#[derive(Clone, Default)]
pub struct Shutdown {
    pub graceful: CancellationToken,
    pub immediate: CancellationToken,
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

/// Runs the consumer until `shutdown.graceful` fires, then waits up to `shutdown_timeout` for
/// in-flight messages.
///
/// `concurrency` lanes each take the next message from the shared pull stream and handle it to
/// its end. Each lane holds its own clone of the handler, so a handler that keeps a connection
/// per clone keeps one per lane, for as long as the loop runs.
pub async fn run<H: MessageHandler>(
    consumer: &PullConsumer,
    worker: Worker<H>,
    db: DatabaseConnection,
    shutdown: Shutdown,
    shutdown_timeout: Duration,
) -> anyhow::Result<Ending> {
    let lanes = worker.settings.concurrency.max(1);
    // The client asks for more once half a pull is used up: pulling twice what the lanes hold
    // keeps the next messages on their way while the lanes work.
    let prefetch = (2 * lanes * worker.settings.batch_size.max(1)).max(32);
    let messages = consumer
        .stream()
        .max_messages_per_batch(prefetch)
        .heartbeat(Duration::from_secs(5))
        .expires(Duration::from_secs(30))
        .messages()
        .await?;
    let messages = Arc::new(tokio::sync::Mutex::new(messages));
    // Stops the lanes on a shutdown request, or when one of them finds the stream ended.
    let stop = shutdown.graceful.child_token();
    let stream_ended = Arc::new(AtomicBool::new(false));
    let tracker = TaskTracker::new();
    for _ in 0..lanes {
        tracker.spawn(lane(
            worker.clone(),
            messages.clone(),
            db.clone(),
            stop.clone(),
            stream_ended.clone(),
        ));
    }
    tracker.close();
    stop.cancelled().await;
    if stream_ended.load(Ordering::Relaxed) {
        anyhow::bail!("the consumer's message stream ended");
    }
    tracing::info!(lanes, "stopped fetching; finishing in-flight messages");
    tokio::select! {
        () = tracker.wait() => Ok(Ending::Drained),
        () = shutdown.immediate.cancelled() => Ok(Ending::Abandoned),
        () = tokio::time::sleep(shutdown_timeout) => Ok(Ending::Abandoned),
    }
}

/// One lane: fetch, handle to the end, repeat, until `stop`.
async fn lane<H: MessageHandler, S>(
    worker: Worker<H>,
    messages: Arc<tokio::sync::Mutex<S>>,
    db: DatabaseConnection,
    stop: CancellationToken,
    stream_ended: Arc<AtomicBool>,
) where
    S: futures::Stream<Item = Result<async_nats::jetstream::Message, PullError>> + Unpin,
{
    let batch_size = worker.settings.batch_size.max(1);
    loop {
        if worker.database_suspect.swap(false, Ordering::Relaxed)
            && !wait_for_database(&db, &stop).await
        {
            return;
        }
        let mut batch = Vec::with_capacity(batch_size);
        {
            let mut stream = messages.lock().await;
            let next = tokio::select! {
                () = stop.cancelled() => return,
                next = stream.next() => next,
            };
            let mut next = Some(next);
            // After the first message, take what is already fetched, up to the batch size;
            // a batch never waits for messages that have not arrived.
            while let Some(item) = next.take() {
                match item {
                    Some(Ok(message)) => batch.push(message),
                    Some(Err(error)) => {
                        // Missed heartbeats and the like while NATS reconnects; it goes on.
                        tracing::warn!(%error, "pulling messages");
                    }
                    None => {
                        stream_ended.store(true, Ordering::Relaxed);
                        stop.cancel();
                        break;
                    }
                }
                if batch.len() < batch_size {
                    next = stream.next().now_or_never();
                }
            }
        }
        match batch.as_slice() {
            [] => {}
            [message] => {
                worker.process(message).instrument(message_span()).await;
            }
            messages => {
                worker.process_batch(messages).await;
            }
        }
    }
}

/// Waits until the database answers again; false if shutdown came first. While it is down
/// nothing is fetched, so messages are not burned through their delivery attempts.
async fn wait_for_database(db: &DatabaseConnection, shutdown: &CancellationToken) -> bool {
    let mut delay = Duration::from_millis(200);
    loop {
        match db.ping().await {
            Ok(()) => {
                tracing::info!("database reachable; consuming");
                return true;
            }
            Err(error) => tracing::warn!(%error, "database unreachable; not fetching"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return false,
            () = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

/// The strategy `serve` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StrategyArg {
    /// The natural key `(order_id, book_id)`: consumer `inventory-reserve-stock`.
    Natural,
    /// The inbox `(message_id, consumer)`: consumer `inventory-reserve-stock-inbox`.
    Inbox,
    /// The two-phase stock-reserved email: consumer `notifications-stock-reserved-email`, mail
    /// kept in the `--mailbox` file.
    Email,
}

impl StrategyArg {
    fn default_consumer(self) -> &'static str {
        match self {
            Self::Natural => "inventory-reserve-stock",
            Self::Inbox => "inventory-reserve-stock-inbox",
            Self::Email => EMAIL_CONSUMER,
        }
    }

    /// The email goes out for placed orders only; stock follows both events.
    fn filter_subject(self, topology: &jetstream::Topology) -> String {
        match self {
            Self::Email => topology.subject(EventKind::Placed),
            Self::Natural | Self::Inbox => format!("{}.>", topology.subject_prefix),
        }
    }
}

/// How the natural-key strategy talks to PostgreSQL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NaturalHandlerArg {
    /// One statement per message on a connection each lane holds (SQLite: the ORM handler).
    OneStatement,
    /// The sea-orm entity transaction: BEGIN, insert, upsert, select, update, COMMIT.
    Orm,
}

/// How the inbox strategy detects a duplicate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DetectArg {
    OnConflict,
    CatchViolation,
    PreCheck,
}

impl From<DetectArg> for DetectMode {
    fn from(arg: DetectArg) -> Self {
        match arg {
            DetectArg::OnConflict => Self::OnConflict,
            DetectArg::CatchViolation => Self::CatchViolation,
            DetectArg::PreCheck => Self::PreCheck,
        }
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Which handler runs.
    #[arg(long, value_enum)]
    pub strategy: StrategyArg,
    /// Durable consumer name; the contract's name for the strategy by default.
    #[arg(long)]
    pub consumer: Option<String>,
    /// The natural-key handler on PostgreSQL.
    #[arg(long, value_enum, default_value = "one-statement")]
    pub natural_handler: NaturalHandlerArg,
    /// Duplicate detection of the inbox strategy.
    #[arg(long, value_enum, default_value = "on-conflict")]
    pub inbox_detect: DetectArg,
    #[command(flatten)]
    pub database: DatabaseArgs,
    /// The email strategy's provider: sent mail as JSON lines in this file, looked up by
    /// idempotency key to reconcile an interrupted send.
    #[arg(long, default_value = "inventory-mailbox.jsonl")]
    pub mailbox: std::path::PathBuf,
    /// Database connections in the pool.
    #[arg(long, default_value_t = 10)]
    pub db_pool_size: u32,
    #[command(flatten)]
    pub nats: NatsArgs,
    #[command(flatten)]
    pub topology: TopologyArgs,
    /// Messages a lane hands the handler at once. The natural key on PostgreSQL commits a batch
    /// in one statement and acks each message after that commit; other handlers take them one
    /// by one. 1 (no batching) by default.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=1000))]
    pub batch_size: u16,
    /// Messages handled at once; the pool size by default.
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// How long JetStream waits for an ack before redelivering (when it creates the consumer).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub ack_wait: Duration,
    /// Deliveries of one message before it is dead-lettered as max-deliveries (when it creates
    /// the consumer).
    #[arg(long, default_value_t = 10)]
    pub max_deliver: i64,
    /// JetStream redelivery backoff after ack-wait timeouts, comma separated (e.g. 5s,30s,2m);
    /// none by default (when it creates the consumer).
    #[arg(long, value_delimiter = ',', value_parser = humantime::parse_duration)]
    pub backoff: Vec<Duration>,
    /// Unacked messages the server lets this consumer hold (when it creates the consumer).
    #[arg(long, default_value_t = 1_000)]
    pub max_ack_pending: i64,
    /// Delay before retrying a message that failed transiently; doubles per delivery.
    #[arg(long, default_value = "500ms", value_parser = humantime::parse_duration)]
    pub retry_delay: Duration,
    /// Longest delay between retries.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub max_retry_delay: Duration,
    /// Bodies larger than this are dead letters, never parsed.
    #[arg(long, default_value_t = 64 * 1024)]
    pub max_body_bytes: usize,
    /// How long shutdown waits for in-flight messages before leaving them for redelivery.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub shutdown_timeout: Duration,
    /// Completed inbox rows older than this are purged in the background. Must cover the
    /// redelivery horizon (redeliveries + duplicate window + replay allowance).
    #[arg(long, env = "INBOX_RETENTION", default_value = "14days", value_parser = humantime::parse_duration)]
    pub inbox_retention: Duration,
    /// Time between background purges; 0s turns the purge (and its horizon check) off.
    #[arg(long, env = "PURGE_INTERVAL", default_value = "10m", value_parser = humantime::parse_duration)]
    pub purge_interval: Duration,
    /// Rows per purge batch; each batch is one short transaction.
    #[arg(long, default_value_t = 1_000)]
    pub purge_batch_size: u64,
    /// How long after a dead letter operators may still replay it; part of the horizon.
    #[arg(long, env = "REPLAY_ALLOWANCE", default_value = "7days", value_parser = humantime::parse_duration)]
    pub replay_allowance: Duration,
    /// Starts even when --inbox-retention is shorter than the redelivery horizon (a warning
    /// instead of a refusal).
    #[arg(long)]
    pub accept_short_retention: bool,
    /// Serves Prometheus metrics on /metrics and a health check on /healthz at this address
    /// (e.g. 0.0.0.0:9090); off when absent.
    #[arg(long, env = "METRICS_ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
}

/// Installs the signal handlers: the first SIGINT or SIGTERM asks for a graceful stop, the
/// second for an immediate one.
fn listen_for_signals(shutdown: Shutdown) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    tokio::spawn(async move {
        for token in [&shutdown.graceful, &shutdown.immediate] {
            tokio::select! {
                _ = interrupt.recv() => {}
                _ = terminate.recv() => {}
            }
            token.cancel();
            if token == &shutdown.graceful {
                tracing::info!("signal received: stopping; a second signal stops at once");
            }
        }
    });
    Ok(())
}

/// What every strategy's loop is wired to; only the handler differs.
struct Wiring<'a> {
    consumer: &'a PullConsumer,
    db: DatabaseConnection,
    dead_letters: DeadLetters,
    settings: ServeSettings,
    metrics: Option<ConsumerMetrics>,
    shutdown: Shutdown,
    timeout: Duration,
}

impl Wiring<'_> {
    async fn consume<H: MessageHandler>(self, handler: H) -> anyhow::Result<Ending> {
        let mut worker = Worker::new(handler, self.dead_letters, self.settings);
        if let Some(metrics) = self.metrics {
            worker = worker.with_metrics(metrics);
        }
        run(self.consumer, worker, self.db, self.shutdown, self.timeout).await
    }
}

/// `inventory serve`: wiring, then [`run`]. Ok(true) when it drained cleanly.
pub async fn start(args: ServeArgs) -> anyhow::Result<bool> {
    let shutdown = Shutdown::default();
    listen_for_signals(shutdown.clone())?;

    let db = db::connect_and_migrate(&args.database.database_url, args.db_pool_size)
        .await
        .with_context(|| {
            format!(
                "connecting to the database at {}",
                redact_url(&args.database.database_url)
            )
        })?;
    let client = args.nats.connect("inventory serve").await?;
    let js = jetstream::context(client.clone());
    let topology = args.topology.topology();
    let (stream, drifts) = jetstream::ensure_streams(&js, &topology).await?;
    let consumer_name = args
        .consumer
        .clone()
        .unwrap_or_else(|| args.strategy.default_consumer().to_owned());
    let consumer_settings = ConsumerSettings {
        durable_name: consumer_name.clone(),
        filter_subject: args.strategy.filter_subject(&topology),
        ack_wait: args.ack_wait,
        max_deliver: args.max_deliver,
        backoff: args.backoff.clone(),
        max_ack_pending: args.max_ack_pending,
    };
    let (mut consumer, consumer_drifts) =
        jetstream::ensure_consumer(&stream, &consumer_settings).await?;
    for drift in drifts.iter().chain(&consumer_drifts) {
        tracing::warn!("{drift}");
    }
    // The server's values rule, whatever this process would have set.
    let consumer_config = consumer.info().await?.config.clone();
    let max_deliver = consumer_config.max_deliver;

    let background = CancellationToken::new();
    // Stops the purge and the metrics server however start() returns.
    let _stop_background = background.clone().drop_guard();
    let mut purge_guard = None;
    if !args.purge_interval.is_zero() {
        let horizon = inventory_domain::Horizon::new(
            &inventory_domain::RedeliveryPolicy {
                ack_wait: consumer_config.ack_wait,
                backoff: consumer_config.backoff.clone(),
                max_deliver,
                longest_nak_delay: args.max_retry_delay,
            },
            stream.cached_info().config.duplicate_window,
            args.replay_allowance,
        );
        retention::guard(
            &consumer_name,
            &horizon,
            args.inbox_retention,
            args.accept_short_retention,
        )?;
    }
    let metrics = match args.metrics_addr {
        Some(addr) => {
            let metrics = Metrics::new()?;
            crate::metrics::serve(
                addr,
                metrics.clone(),
                client.clone(),
                db.clone(),
                background.clone(),
            )
            .await?;
            Some(metrics)
        }
        None => None,
    };
    if !args.purge_interval.is_zero() {
        let settings = PurgeSettings {
            retention: args.inbox_retention,
            interval: args.purge_interval,
            batch_size: args.purge_batch_size,
        };
        // The purge stops with the first signal: it must not hold the database while draining.
        let stop = shutdown.graceful.child_token();
        retention::spawn_purge(db.clone(), settings, metrics.clone(), stop.clone())?;
        purge_guard = Some(stop.drop_guard());
    }

    let settings = ServeSettings {
        batch_size: usize::from(args.batch_size),
        concurrency: args
            .concurrency
            .unwrap_or(usize::try_from(args.db_pool_size).unwrap_or(1)),
        max_body_bytes: args.max_body_bytes,
        max_deliver,
        retry_delay: args.retry_delay,
        max_retry_delay: args.max_retry_delay,
    };
    let dead_letters = DeadLetters::new(js.clone(), &topology, &consumer_name);
    let consumer_label = ConsumerName::parse(consumer_name.clone())?;
    tracing::info!(
        strategy = ?args.strategy,
        consumer = %consumer_name,
        stream = %topology.stream,
        concurrency = settings.concurrency,
        "consuming"
    );
    let wiring = Wiring {
        consumer: &consumer,
        db: db.clone(),
        dead_letters,
        settings,
        metrics: metrics
            .as_ref()
            .map(|metrics| metrics.consumer(&consumer_name)),
        shutdown,
        timeout: args.shutdown_timeout,
    };
    let ending = match args.strategy {
        StrategyArg::Natural => {
            let reference = StockConsumer::new(db.clone(), Strategy::NaturalKey, consumer_label);
            let one_statement = match args.natural_handler {
                NaturalHandlerArg::OneStatement => PgNaturalKey::new(reference.clone()),
                NaturalHandlerArg::Orm => None,
            };
            match one_statement {
                Some(handler) => wiring.consume(handler).await?,
                None => wiring.consume(reference).await?,
            }
        }
        StrategyArg::Inbox => {
            let strategy = Strategy::Inbox(args.inbox_detect.into());
            wiring
                .consume(StockConsumer::new(db.clone(), strategy, consumer_label))
                .await?
        }
        StrategyArg::Email => {
            let mailbox = FileMailbox::open(&args.mailbox)
                .await
                .with_context(|| format!("opening the mailbox {}", args.mailbox.display()))?;
            wiring
                .consume(EmailConsumer::new(db.clone(), consumer_label, mailbox))
                .await?
        }
    };
    drop(purge_guard);
    match ending {
        Ending::Drained => {
            // Flushes the acks of the last messages before the process ends.
            client.drain().await?;
            tracing::info!("drained; bye");
            Ok(true)
        }
        Ending::Abandoned => {
            eprintln!(
                "error: stopped before in-flight messages finished; they were not acked and will be redelivered"
            );
            Ok(false)
        }
    }
}
