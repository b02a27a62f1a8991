//! Prometheus metrics of `inventory serve` and `inventory relay`, served on `--metrics-addr`
//! beside the health endpoints ([`crate::health`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inventory_infra::jetstream::ConsumerState;
use inventory_infra::outbox::RelayStatus;
use prometheus::{
    Encoder as _, GaugeVec, Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Registry, TextEncoder, histogram_opts, register_gauge_vec_with_registry,
    register_histogram_vec_with_registry, register_int_counter_vec_with_registry,
    register_int_gauge_vec_with_registry,
};

use inventory_domain::{Acked, DeadLetterReason};

use crate::consumer::policy::Disposition;

/// The service's metrics, registered in a registry of their own (no process-global state, so
/// tests in one process do not share counters).
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    dependency_up: IntGaugeVec,
    messages: IntCounterVec,
    dead_letters: IntCounterVec,
    handling: HistogramVec,
    in_flight: IntGaugeVec,
    oldest_in_flight: GaugeVec,
    /// When each delivery in flight started, by consumer: read at each scrape.
    in_flight_since: Arc<Mutex<BTreeMap<String, InFlightSince>>>,
    pending: IntGaugeVec,
    ack_pending: IntGaugeVec,
    max_ack_pending: IntGaugeVec,
    not_owned: IntGaugeVec,
    lanes: IntGaugeVec,
    dead_letters_waiting: IntGaugeVec,
    dead_letters_oldest: GaugeVec,
    dead_letters_past_allowance: IntGaugeVec,
    task_failures: IntCounterVec,
    outbox: OutboxMetrics,
    /// The relay of this process, once one runs: read at each scrape and health check.
    relay: Arc<Mutex<Option<WatchedRelay>>>,
}

/// The outbox relay's series that depend on the time of the scrape, labelled by outbox table;
/// its counts are the relay's own series ([`RelayStatus::collectors`]).
#[derive(Clone)]
struct OutboxMetrics {
    oldest_pending: GaugeVec,
    failing: IntGaugeVec,
}

#[derive(Clone)]
pub(crate) struct WatchedRelay {
    status: RelayStatus,
    unhealthy_after: Duration,
}

impl WatchedRelay {
    pub(crate) fn failing(&self) -> bool {
        self.status
            .failing_for()
            .is_some_and(|failing| failing > self.unhealthy_after)
    }
}

impl OutboxMetrics {
    fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let label = &["outbox"];
        Ok(Self {
            oldest_pending: register_gauge_vec_with_registry!(
                "inventory_outbox_oldest_pending_age_seconds",
                "Age of the oldest outbox row waiting to be published; 0 when none waits.",
                label,
                registry,
            )?,
            failing: register_int_gauge_vec_with_registry!(
                "inventory_outbox_relay_failing",
                "1 while this relay has failed for longer than --relay-unhealthy-after to \
                 publish rows that wait (as /healthz's \"relay\": \"failing\"), else 0.",
                label,
                registry,
            )?,
        })
    }

    /// Sets the series that depend on the time of the scrape.
    fn sync(&self, relay: &WatchedRelay) {
        let outbox = [relay.status.outbox()];
        self.failing
            .with_label_values(&outbox)
            .set(i64::from(relay.failing()));
        let age = relay.status.oldest_pending().map_or(0.0, |oldest| {
            (chrono::Utc::now() - oldest)
                .to_std()
                .map_or(0.0, |age| age.as_secs_f64())
        });
        self.oldest_pending.with_label_values(&outbox).set(age);
    }
}

/// The tasks `inventory_task_failures_total` shows from the start, at 0; a background task
/// appears at its first failure.
const TASKS: [&str; 2] = ["lane", "relay"];

/// A delivery's time, from 1 ms to the ack wait's 30 s and past it: a message's database work
/// may take its statement timeout (15 s) plus the client's grace, and its ack after that.
const HANDLING_BUCKETS: [f64; 16] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
];

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        // CPU, resident memory, file descriptors, start time: `process_*`.
        registry.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))?;
        let build_info = register_int_gauge_vec_with_registry!(
            "inventory_build_info",
            "1, labelled with the release and the commit this process was built from.",
            &["version", "commit"],
            registry,
        )?;
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION"), crate::COMMIT])
            .set(1);
        let dependency_up = register_int_gauge_vec_with_registry!(
            "inventory_dependency_up",
            "1 while a dependency answers as /readyz sees it (database: a ping within 2 s; nats: \
             connected; relay: publishing), 0 while it does not; read at each scrape once the \
             set-up is done.",
            &["dependency"],
            registry,
        )?;
        let messages = register_int_counter_vec_with_registry!(
            "inventory_messages_total",
            "Deliveries handled, by consumer and outcome (processed, duplicate, rejected, \
             reconciled, dead_lettered, retried, left_for_redelivery).",
            &["consumer", "outcome"],
            registry,
        )?;
        let dead_letters = register_int_counter_vec_with_registry!(
            "inventory_dead_letters_total",
            "Messages dead-lettered, by consumer and Dlq-Reason.",
            &["consumer", "reason"],
            registry,
        )?;
        let handling = register_histogram_vec_with_registry!(
            histogram_opts!(
                "inventory_message_handling_seconds",
                "Time from a delivery's arrival to its ack, nak or dead letter.",
                HANDLING_BUCKETS.to_vec()
            ),
            &["consumer"],
            registry,
        )?;
        let in_flight = register_int_gauge_vec_with_registry!(
            "inventory_messages_in_flight",
            "Deliveries being handled now.",
            &["consumer"],
            registry,
        )?;
        let oldest_in_flight = register_gauge_vec_with_registry!(
            "inventory_oldest_in_flight_seconds",
            "How long the oldest delivery being handled now has been in its lane (0 \
                             when none): a lane stuck on one message shows here.",
            &["consumer"],
            registry,
        )?;
        let pending = register_int_gauge_vec_with_registry!(
            "inventory_consumer_pending_messages",
            "Messages of the stream the durable consumer has not delivered yet (its lag), as \
             the server counted at the last look (every 10 s).",
            &["consumer"],
            registry,
        )?;
        let ack_pending = register_int_gauge_vec_with_registry!(
            "inventory_consumer_ack_pending_messages",
            "Messages delivered to the durable consumer and not acked yet, by any instance, at \
             the last look.",
            &["consumer"],
            registry,
        )?;
        let max_ack_pending = register_int_gauge_vec_with_registry!(
            "inventory_consumer_max_ack_pending",
            "The durable consumer's max_ack_pending as the server has it: past it the server \
             delivers nothing more until acks come.",
            &["consumer"],
            registry,
        )?;
        let not_owned = register_int_gauge_vec_with_registry!(
            "inventory_consumer_not_owned",
            "1 while this process pulls nothing of the consumer's partition, which a handling \
             found its shard's database does not own (a move fenced it, or the assignment \
             changed), until the database owns it again; else 0.",
            &["consumer"],
            registry,
        )?;
        let lanes = register_int_gauge_vec_with_registry!(
            "inventory_lanes",
            "Lanes of this process: messages (or batches) it handles at once.",
            &["consumer"],
            registry,
        )?;
        let dead_letters_waiting = register_int_gauge_vec_with_registry!(
            "inventory_dead_letters_waiting",
            "Dead letters of the consumer waiting in the dead-letter stream at the last look \
             (every 30 s): they stay until replayed or deleted. `inventory dlq list` says why \
             each is there.",
            &["consumer"],
            registry,
        )?;
        let dead_letters_oldest = register_gauge_vec_with_registry!(
            "inventory_dead_letters_oldest_age_seconds",
            "Age of the oldest dead letter of the consumer waiting; 0 when none.",
            &["consumer"],
            registry,
        )?;
        let dead_letters_past_allowance = register_int_gauge_vec_with_registry!(
            "inventory_dead_letters_past_replay_allowance",
            "1 when the oldest dead letter of the consumer waiting is older than \
             --replay-allowance: a replay may find its inbox row purged and apply it twice; \
             else 0.",
            &["consumer"],
            registry,
        )?;
        let task_failures = register_int_counter_vec_with_registry!(
            "inventory_task_failures_total",
            "Tasks of the process that ended while the service ran (a lane whose handler \
             panicked, the relay, a background task by its name): the process then stops, with \
             an error, for its supervisor to restart it.",
            &["task"],
            registry,
        )?;
        for task in TASKS {
            task_failures.with_label_values(&[task]);
        }
        let outbox = OutboxMetrics::new(&registry)?;
        Ok(Self {
            outbox,
            relay: Arc::default(),
            registry,
            dependency_up,
            messages,
            dead_letters,
            handling,
            in_flight,
            oldest_in_flight,
            in_flight_since: Arc::default(),
            pending,
            ack_pending,
            max_ack_pending,
            not_owned,
            lanes,
            dead_letters_waiting,
            dead_letters_oldest,
            dead_letters_past_allowance,
            task_failures,
        })
    }

    /// The handles one consumer's worker records into.
    ///
    /// Every series of the consumer that a rule or the dashboard reads exists from here on, at
    /// 0: a counter that first appears at 1 has no increase for Prometheus to see.
    pub fn consumer(&self, consumer: &str) -> ConsumerMetrics {
        for reason in DeadLetterReason::ALL {
            self.dead_letters
                .with_label_values(&[consumer, reason.as_str()]);
        }
        self.dead_letters_waiting.with_label_values(&[consumer]);
        self.dead_letters_oldest.with_label_values(&[consumer]);
        self.dead_letters_past_allowance
            .with_label_values(&[consumer]);
        self.oldest_in_flight.with_label_values(&[consumer]);
        ConsumerMetrics {
            consumer: consumer.to_owned(),
            task_failures: self.task_failures.clone(),
            outcomes: Outcomes::of(&self.messages, consumer),
            dead_letters: self.dead_letters.clone(),
            handling: self.handling.with_label_values(&[consumer]),
            in_flight: self.in_flight.with_label_values(&[consumer]),
            since: lock(&self.in_flight_since)
                .entry(consumer.to_owned())
                .or_default()
                .clone(),
            pending: self.pending.with_label_values(&[consumer]),
            ack_pending: self.ack_pending.with_label_values(&[consumer]),
            not_owned: self.not_owned.with_label_values(&[consumer]),
        }
    }

    /// The lanes of this process that serve `consumer` (on a shard, its partitions' consumers,
    /// under the strategy's name): what a saturation reads against.
    pub fn lanes(&self, consumer: &str, lanes: usize) {
        self.lanes
            .with_label_values(&[consumer])
            .set(i64::try_from(lanes).unwrap_or(i64::MAX));
    }

    /// The consumer's max_ack_pending as the server has it.
    pub fn max_ack_pending(&self, consumer: &str, max_ack_pending: i64) {
        self.max_ack_pending
            .with_label_values(&[consumer])
            .set(max_ack_pending);
    }

    /// What waits in the dead-letter stream for `consumer`: how many, the oldest's age, and
    /// whether that is past the replay allowance.
    pub fn record_dead_letters(
        &self,
        consumer: &str,
        count: u64,
        oldest: Duration,
        past_allowance: bool,
    ) {
        let labels = [consumer];
        self.dead_letters_waiting
            .with_label_values(&labels)
            .set(i64::try_from(count).unwrap_or(i64::MAX));
        self.dead_letters_oldest
            .with_label_values(&labels)
            .set(oldest.as_secs_f64());
        self.dead_letters_past_allowance
            .with_label_values(&labels)
            .set(i64::from(past_allowance));
    }

    /// Whether each dependency answers, as `/readyz` just saw.
    pub fn record_dependencies(&self, up: &[(&str, bool)]) {
        for (dependency, answers) in up {
            self.dependency_up
                .with_label_values(&[dependency])
                .set(i64::from(*answers));
        }
    }

    /// Exports `collectors` with the rest: the series of a part of the process that keeps its
    /// own (the relay's, the study's purge).
    pub fn register(
        &self,
        collectors: impl IntoIterator<Item = Box<dyn prometheus::core::Collector>>,
    ) -> Result<(), prometheus::Error> {
        for collector in collectors {
            self.registry.register(collector)?;
        }
        Ok(())
    }

    /// Reports `status`, the relay of its outbox table, in the scrapes and the health check; it
    /// counts as failing once it has failed longer than `unhealthy_after`.
    pub fn watch_relay(
        &self,
        status: RelayStatus,
        unhealthy_after: Duration,
    ) -> Result<(), prometheus::Error> {
        self.register(status.collectors())?;
        let watched = WatchedRelay {
            status,
            unhealthy_after,
        };
        self.outbox.sync(&watched);
        *lock(&self.relay) = Some(watched);
        Ok(())
    }

    pub(crate) fn watched_relay(&self) -> Option<WatchedRelay> {
        lock(&self.relay).clone()
    }

    /// How long the oldest delivery in flight, of any consumer, has been handled.
    pub fn oldest_in_flight(&self) -> Duration {
        lock(&self.in_flight_since)
            .values()
            .map(InFlightSince::oldest_age)
            .max()
            .unwrap_or(Duration::ZERO)
    }

    /// Counts a task of the process (a lane, the relay) that ended while the service ran.
    pub fn task_failed(&self, task: &str) {
        self.task_failures.with_label_values(&[task]).inc();
    }

    /// The text exposition format.
    pub fn render(&self) -> Result<String, prometheus::Error> {
        if let Some(relay) = self.watched_relay() {
            self.outbox.sync(&relay);
        }
        for (consumer, since) in lock(&self.in_flight_since).iter() {
            self.oldest_in_flight
                .with_label_values(&[consumer])
                .set(since.oldest_age().as_secs_f64());
        }
        let mut text = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut text)?;
        Ok(String::from_utf8_lossy(&text).into_owned())
    }
}

/// One consumer's metrics, cloned into every message's task.
#[derive(Clone)]
pub struct ConsumerMetrics {
    consumer: String,
    task_failures: IntCounterVec,
    outcomes: Outcomes,
    dead_letters: IntCounterVec,
    handling: Histogram,
    in_flight: IntGauge,
    since: InFlightSince,
    pending: IntGauge,
    ack_pending: IntGauge,
    not_owned: IntGauge,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The start of each delivery in flight of one consumer, oldest first.
#[derive(Clone, Default)]
struct InFlightSince(Arc<Mutex<BTreeSet<(Instant, u64)>>>);

impl InFlightSince {
    fn oldest_age(&self) -> Duration {
        lock(&self.0)
            .first()
            .map_or(Duration::ZERO, |(started, _)| started.elapsed())
    }
}

/// Counts deliveries in flight until dropped, so a handler that panics is not counted forever.
pub struct InFlight {
    gauge: IntGauge,
    deliveries: i64,
    since: InFlightSince,
    key: (Instant, u64),
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.gauge.sub(self.deliveries);
        lock(&self.since.0).remove(&self.key);
    }
}

impl ConsumerMetrics {
    /// Deliveries since start acked, and not as a duplicate: `inventory_messages_total` as
    /// tests, benchmarks and the study read it.
    pub fn acked(&self) -> u64 {
        let outcomes = &self.outcomes;
        [
            &outcomes.processed,
            &outcomes.rejected,
            &outcomes.reconciled,
        ]
        .iter()
        .map(|counter| counter.get())
        .sum()
    }

    pub fn duplicates(&self) -> u64 {
        self.outcomes.duplicate.get()
    }

    pub fn dead_lettered(&self) -> u64 {
        self.outcomes.dead_lettered.get()
    }

    pub fn retried(&self) -> u64 {
        self.outcomes.retried.get()
    }

    pub fn left_for_redelivery(&self) -> u64 {
        self.outcomes.left_for_redelivery.get()
    }

    /// Every delivery counted so far.
    pub fn deliveries(&self) -> u64 {
        self.acked()
            + self.duplicates()
            + self.dead_lettered()
            + self.retried()
            + self.left_for_redelivery()
    }

    /// Counts a task of the process that ended while the service ran.
    pub fn task_failed(&self, task: &str) {
        self.task_failures.with_label_values(&[task]).inc();
    }

    /// The consumer's counts as the server has them.
    pub fn record_lag(&self, state: &ConsumerState) {
        self.pending
            .set(i64::try_from(state.pending).unwrap_or(i64::MAX));
        self.ack_pending
            .set(i64::try_from(state.ack_pending).unwrap_or(i64::MAX));
    }

    /// Whether this process stopped pulling the consumer's partition, not owned here.
    pub fn not_owned(&self, stopped: bool) {
        self.not_owned.set(i64::from(stopped));
    }

    /// Counts `deliveries` that started together (one, or a lane's batch) in flight, as one
    /// entry of the oldest-in-flight set: a batch is one look at the lock, not one a message.
    pub fn start(&self, deliveries: usize) -> InFlight {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let deliveries = i64::try_from(deliveries).unwrap_or(i64::MAX);
        self.in_flight.add(deliveries);
        let key = (Instant::now(), NEXT.fetch_add(1, Ordering::Relaxed));
        lock(&self.since.0).insert(key);
        InFlight {
            gauge: self.in_flight.clone(),
            deliveries,
            since: self.since.clone(),
            key,
        }
    }

    pub fn record(&self, disposition: &Disposition, elapsed: Duration) {
        let outcomes = &self.outcomes;
        let counter = match disposition {
            Disposition::Acked(Acked::Processed) => &outcomes.processed,
            Disposition::Acked(Acked::Rejected) => &outcomes.rejected,
            Disposition::Acked(Acked::Reconciled) => &outcomes.reconciled,
            Disposition::Acked(Acked::Duplicate) => &outcomes.duplicate,
            Disposition::DeadLettered(reason) => {
                self.dead_letters
                    .with_label_values(&[self.consumer.as_str(), reason.as_str()])
                    .inc();
                &outcomes.dead_lettered
            }
            Disposition::Retried(_) => &outcomes.retried,
            Disposition::LeftForRedelivery | Disposition::Halted(_) => {
                &outcomes.left_for_redelivery
            }
        };
        counter.inc();
        self.handling.observe(elapsed.as_secs_f64());
    }
}

/// One consumer's series of `inventory_messages_total`, a counter per outcome, looked up once
/// (each exists from then on, at 0) rather than by its labels at every message.
#[derive(Clone)]
struct Outcomes {
    processed: IntCounter,
    rejected: IntCounter,
    reconciled: IntCounter,
    duplicate: IntCounter,
    dead_lettered: IntCounter,
    retried: IntCounter,
    left_for_redelivery: IntCounter,
}

impl Outcomes {
    fn of(messages: &IntCounterVec, consumer: &str) -> Self {
        let outcome = |label: &str| messages.with_label_values(&[consumer, label]);
        Self {
            processed: outcome(Acked::Processed.label()),
            rejected: outcome(Acked::Rejected.label()),
            reconciled: outcome(Acked::Reconciled.label()),
            duplicate: outcome(Acked::Duplicate.label()),
            dead_lettered: outcome("dead_lettered"),
            retried: outcome("retried"),
            left_for_redelivery: outcome("left_for_redelivery"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use inventory_domain::{Acked, DeadLetterReason};

    use super::Metrics;
    use crate::consumer::policy::Disposition;

    #[test]
    fn each_disposition_is_counted_under_its_own_outcome() {
        let metrics = Metrics::new().expect("a registry");
        let consumer = metrics.consumer("c");
        for disposition in [
            Disposition::Acked(Acked::Processed),
            Disposition::Acked(Acked::Rejected),
            Disposition::Acked(Acked::Reconciled),
            Disposition::Acked(Acked::Duplicate),
            Disposition::DeadLettered(DeadLetterReason::ALL[0]),
            Disposition::Retried(Duration::from_secs(1)),
            Disposition::LeftForRedelivery,
        ] {
            consumer.record(&disposition, Duration::ZERO);
        }
        let text = metrics.render().expect("rendered");
        for outcome in [
            "processed",
            "rejected",
            "reconciled",
            "duplicate",
            "dead_lettered",
            "retried",
            "left_for_redelivery",
        ] {
            let series =
                format!("inventory_messages_total{{consumer=\"c\",outcome=\"{outcome}\"}} 1");
            assert!(text.contains(&series), "{series} in\n{text}");
        }
        assert_eq!(
            (
                consumer.acked(),
                consumer.duplicates(),
                consumer.deliveries()
            ),
            (3, 1, 7)
        );
    }

    #[test]
    fn a_partition_not_owned_shows_from_the_start_at_0_and_at_1_while_stopped() {
        let metrics = Metrics::new().expect("a registry");
        let consumer = metrics.consumer("c-p03");
        let series =
            |value: u8| format!("inventory_consumer_not_owned{{consumer=\"c-p03\"}} {value}");
        let text = metrics.render().expect("rendered");
        assert!(text.contains(&series(0)), "{text}");
        consumer.not_owned(true);
        let text = metrics.render().expect("rendered");
        assert!(text.contains(&series(1)), "{text}");
        consumer.not_owned(false);
        assert!(metrics.render().expect("rendered").contains(&series(0)));
    }

    #[test]
    fn a_batch_is_in_flight_message_by_message_until_it_ends() {
        let metrics = Metrics::new().expect("a registry");
        let consumer = metrics.consumer("c");
        let in_flight = |metrics: &Metrics| {
            let text = metrics.render().expect("rendered");
            let series = "inventory_messages_in_flight{consumer=\"c\"} ";
            let at = text.find(series).expect("the gauge") + series.len();
            text[at..].lines().next().unwrap_or_default().to_owned()
        };
        let batch = consumer.start(16);
        let one = consumer.start(1);
        assert_eq!(in_flight(&metrics), "17");
        std::thread::sleep(Duration::from_millis(20));
        assert!(metrics.oldest_in_flight() >= Duration::from_millis(20));
        drop(batch);
        assert_eq!(in_flight(&metrics), "1");
        drop(one);
        assert_eq!(in_flight(&metrics), "0");
        assert_eq!(metrics.oldest_in_flight(), Duration::ZERO);
    }
}
