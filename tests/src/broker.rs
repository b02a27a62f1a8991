//! A test's own streams on a real NATS server, and the service loop running in-process on them.

use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self as js, context::Context};
use inventory_benches::publish::OrderPublisher;
use inventory_infra::MessageHandler;
use inventory_infra::db::DatabaseConnection;
use inventory_infra::jetstream::{self, ConsumerState, DeadLetters, Topology};
use inventory_infra::outbox::RelayWake;
use inventory_service::consumer::{ConsumerRuntime, Ending, Reads, Running, RuntimeSettings};
use inventory_service::health::Liveness;
use inventory_service::metrics::ConsumerMetrics;
use inventory_service::shutdown::Shutdown;

/// A test's own streams (removed on drop) on `url`.
pub struct Broker {
    pub client: async_nats::Client,
    pub js: Context,
    pub topology: Topology,
    pub consumer_name: String,
}

/// A dead letter as stored: its headers and the original body.
#[derive(Debug, Clone)]
pub struct StoredDeadLetter {
    pub subject: String,
    pub headers: std::collections::BTreeMap<String, String>,
    pub body: bytes::Bytes,
}

impl StoredDeadLetter {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
}

impl Broker {
    /// A test's own streams on the shared NATS server.
    pub async fn new() -> Self {
        Self::on(&crate::nats::shared_url().await).await
    }

    pub async fn on(url: &str) -> Self {
        let names = crate::nats::unique_names("");
        let topology = names.topology();
        let client = jetstream::connect(url, "inventory tests").await.unwrap();
        let js = jetstream::context(client.clone());
        jetstream::ensure_streams(&js, &topology).await.unwrap();
        jetstream::ensure_prefix_stream(&js, &topology.events_stream())
            .await
            .unwrap();
        Self {
            client,
            js,
            topology,
            consumer_name: names.consumer,
        }
    }

    pub fn publisher(&self) -> OrderPublisher {
        OrderPublisher::new(self.js.clone(), self.topology.clone())
    }

    /// Publishes raw bytes to `<prefix>.<token>` with an optional `Nats-Msg-Id`.
    pub async fn publish_raw(&self, token: &str, body: impl Into<bytes::Bytes>, id: Option<&str>) {
        let subject = format!("{}.{token}", self.topology.subject_prefix);
        let mut publish = js::message::PublishMessage::build().payload(body.into());
        if let Some(id) = id {
            publish = publish.message_id(id);
        }
        self.js
            .send_publish(subject, publish)
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// Runtime settings for the test's own consumer of every order event: `concurrency` lanes,
    /// a short ack wait so a withheld ack is redelivered quickly, fast retries, and a cap of
    /// `max_deliver` deliveries (the service's: the consumer has none), one message at a time.
    pub fn settings(&self, concurrency: usize, max_deliver: i64) -> RuntimeSettings {
        let mut settings = RuntimeSettings::new(
            self.topology.clone(),
            &self.consumer_name,
            Reads::Orders,
            concurrency,
        );
        settings.consumer.ack_wait = Duration::from_secs(1);
        settings.max_deliver = max_deliver;
        settings.retry_delay = Duration::from_millis(50);
        settings.max_retry_delay = Duration::from_millis(500);
        settings
    }

    /// [`Self::settings`] for the email notifier: its consumer reads the events stream.
    pub fn email_settings(&self, concurrency: usize, max_deliver: i64) -> RuntimeSettings {
        let mut settings = self.settings(concurrency, max_deliver);
        let email = RuntimeSettings::new(
            self.topology.clone(),
            &self.consumer_name,
            Reads::Reservations,
            concurrency,
        );
        settings.reads = email.reads;
        settings.consumer.filters = email.consumer.filters;
        settings
    }

    /// Creates the test's consumer as [`Self::settings`] would, before any service starts.
    pub async fn consumer(&self, max_deliver: i64) {
        let stream = self.js.get_stream(&self.topology.stream).await.unwrap();
        let consumer = self.settings(1, max_deliver).consumer;
        jetstream::ensure_consumer(&self.js, &stream, &consumer, false)
            .await
            .unwrap();
    }

    /// The state of the test's consumer: on the orders stream, or on the events stream for
    /// the email notifier's ([`Self::email_settings`]).
    pub async fn consumer_state(&self) -> ConsumerState {
        for name in [&self.topology.stream, &self.topology.events_stream] {
            let Ok(stream) = self.js.get_stream(name).await else {
                continue;
            };
            let found: Result<PullConsumer, _> = stream.get_consumer(&self.consumer_name).await;
            if let Ok(mut consumer) = found {
                return jetstream::consumer_state(&mut consumer).await.unwrap();
            }
        }
        panic!("no consumer {} on either stream", self.consumer_name);
    }

    /// Waits until the test's consumer has nothing pending or unacked: every message acked or
    /// terminated.
    pub async fn settled(&self) {
        eventually("nothing pending or unacked", || async {
            let state = self.consumer_state().await;
            state.pending == 0 && state.ack_pending == 0
        })
        .await;
    }

    pub async fn stream_messages(&self, name: &str) -> u64 {
        crate::nats::stream_messages(&self.js, name).await
    }

    pub async fn dead_letters(&self) -> Vec<StoredDeadLetter> {
        let mut stream = self.js.get_stream(&self.topology.dlq_stream).await.unwrap();
        let state = stream.info().await.unwrap().state.clone();
        let mut letters = Vec::new();
        for sequence in state.first_sequence..=state.last_sequence {
            if state.messages == 0 {
                break;
            }
            let message = stream.get_raw_message(sequence).await.unwrap();
            letters.push(StoredDeadLetter {
                subject: message.subject.to_string(),
                headers: jetstream::header_map(Some(&message.headers)),
                body: message.payload,
            });
        }
        letters
    }

    pub fn dead_letter_publisher(&self) -> DeadLetters {
        DeadLetters::new(self.js.clone(), &self.topology, &self.consumer_name)
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let js = self.js.clone();
        // The events stream exists only if a test's relay created it, the advisories' only for
        // a consumer with a cap of its own; deleting an absent stream is harmless.
        let names = [
            self.topology.stream.clone(),
            self.topology.dlq_stream.clone(),
            self.topology.events_stream.clone(),
            jetstream::advisories_stream(&self.topology.stream),
        ];
        crate::run_to_end_from_drop(async move {
            for name in names {
                let _ = js.delete_stream(name).await;
            }
        });
    }
}

/// A PostgreSQL database and streams of the test's own, one order for 2 copies of a book with 10
/// on hand published.
pub async fn one_order() -> (crate::TestDb, Broker) {
    let db = crate::TestDb::new(crate::Backend::Postgres).await;
    let broker = Broker::new().await;
    broker
        .publisher()
        .publish(&crate::placed(db.dune(10).await, 2))
        .await
        .unwrap();
    (db, broker)
}

/// The service's consumer runtime running in-process on a test's streams.
pub struct RunningService {
    running: Running,
    /// What became of its deliveries so far.
    pub metrics: ConsumerMetrics,
    /// Where the loop reports a lane that ended while it ran, as `/livez` reads it.
    pub liveness: Liveness,
}

impl RunningService {
    /// Sets up the test's consumer as `settings` say and starts `handler` on it.
    pub async fn start<H: MessageHandler>(
        broker: &Broker,
        handler: H,
        db: DatabaseConnection,
        settings: RuntimeSettings,
    ) -> Self {
        Self::start_waking(broker, handler, db, settings, None).await
    }

    /// [`Self::start`], waking `relay` after each handling that committed an event, as
    /// `serve --strategy natural` wakes its relay.
    pub async fn start_waking<H: MessageHandler>(
        broker: &Broker,
        handler: H,
        db: DatabaseConnection,
        settings: RuntimeSettings,
        relay: Option<RelayWake>,
    ) -> Self {
        let mut runtime = ConsumerRuntime::prepare(&broker.js, db, settings)
            .await
            .unwrap();
        if let Some(wake) = relay {
            runtime.wake_relay_on_events(wake);
        }
        let liveness = Liveness::default();
        runtime.report_failures_to(liveness.clone());
        let metrics = inventory_benches::workload::unexported_metrics(
            &runtime.settings().consumer.durable_name,
        )
        .unwrap();
        let running = runtime.start(handler, metrics.clone(), Shutdown::new(Shutdown::TIMEOUT));
        Self {
            metrics,
            running,
            liveness,
        }
    }

    pub fn shutdown(&self) -> &Shutdown {
        &self.running.shutdown
    }

    /// Lanes still running (see `Running::lanes`).
    pub fn lanes(&self) -> usize {
        self.running.lanes()
    }

    pub fn is_running(&self) -> bool {
        !self.running.is_finished()
    }

    /// Asks for a graceful stop and waits for the loop to end.
    pub async fn stop(self) -> Ending {
        self.running.stop().await.unwrap()
    }

    /// Waits for the loop to end by itself: how it ended.
    pub async fn wait(self) -> anyhow::Result<Ending> {
        self.running.wait().await
    }
}

/// Polls `check` until it holds; fails the test after a generous limit.
pub async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    for _ in 0..600 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for: {what}");
}
