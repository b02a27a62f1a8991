//! The backstop for a consumer with a delivery cap of its own (one created before this service
//! owned the cap, or given one by hand): after its last allowed delivery the server delivers a
//! message no more, whoever held it (a process killed with it, a nak the server did not act
//! on), and says so in a MAX_DELIVERIES advisory. A stream keeps those advisories, so one
//! emitted while no instance ran waits for the next; the backstop reads them, gets each message
//! by its stream sequence and dead-letters it: a message the server gave up on still ends in
//! the DLQ, as any other that ran out of deliveries.

use std::time::Duration;

use async_nats::jetstream::stream::{self, RawMessageErrorKind};
use inventory_domain::DeadLetterReason;
use tokio_util::sync::CancellationToken;

use super::{
    ConfigDrift, ConsumerSettings, Context, DeadLetters, NatsError, Origin, ensure_consumer,
    ensure_stream, nats_error,
};
use crate::delivery::{self, PullConsumer};

/// The advisory the server publishes when `consumer` of `stream` ran out of deliveries.
fn advisory_subject(stream: &str, consumer: &str) -> String {
    format!("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}")
}

/// The stream that keeps the MAX_DELIVERIES advisories of the consumers of `stream`.
pub fn advisories_stream(stream: &str) -> String {
    format!("{stream}_MAX_DELIVERIES")
}

/// How long the advisories' stream keeps one: long past any outage the service rides out.
const KEEP_ADVISORIES: Duration = Duration::from_secs(7 * 24 * 3600);

/// Advisories asked for at once.
const BATCH: usize = 16;

/// A MAX_DELIVERIES advisory, as the server writes it.
#[derive(Debug, serde::Deserialize)]
struct MaxDeliveries {
    stream: String,
    stream_seq: u64,
    deliveries: i64,
}

/// Reads a consumer's MAX_DELIVERIES advisories and dead-letters what they name.
pub struct Backstop {
    advisories: PullConsumer,
    client: async_nats::Client,
    stream: stream::Stream,
    dead_letters: DeadLetters,
}

impl Backstop {
    /// Sets up, where absent, the stream that keeps the advisories of every consumer of
    /// `stream` (`<stream>_MAX_DELIVERIES`) and the durable consumer of `consumer`'s
    /// (`<consumer>-max-deliveries`), which the instances share.
    pub async fn prepare(
        js: &Context,
        stream: stream::Stream,
        consumer: &str,
        replicas: usize,
        dead_letters: DeadLetters,
    ) -> Result<(Self, Vec<ConfigDrift>), NatsError> {
        let name = stream.cached_info().config.name.clone();
        let (advisories, mut drifts) = ensure_stream(
            js,
            stream::Config {
                name: advisories_stream(&name),
                subjects: vec![format!(
                    "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{name}.>"
                )],
                storage: stream::StorageType::File,
                max_age: KEEP_ADVISORIES,
                num_replicas: replicas,
                ..Default::default()
            },
        )
        .await?;
        let (advisories, consumer_drifts) = ensure_consumer(
            js,
            &advisories,
            &ConsumerSettings {
                durable_name: format!("{consumer}-max-deliveries"),
                filters: vec![advisory_subject(&name, consumer)],
                ack_wait: Duration::from_secs(30),
                max_deliver: -1,
                backoff: Vec::new(),
                max_ack_pending: 1_000,
            },
            false,
        )
        .await?;
        drifts.extend(consumer_drifts);
        Ok((
            Self {
                advisories,
                client: js.client(),
                stream,
                dead_letters,
            },
            drifts,
        ))
    }

    /// Handles advisories as they come until `stop`. One that cannot be handled now (the DLQ
    /// unreachable) comes again after a while.
    pub async fn run(self, stop: CancellationToken) {
        while !stop.is_cancelled() {
            let fetched = delivery::fetch(&self.advisories, &self.client, BATCH, &stop).await;
            if let Some(error) = &fetched.error {
                tracing::warn!(%error, "reading MAX_DELIVERIES advisories");
                tokio::select! {
                    () = stop.cancelled() => {}
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
            }
            // Handled even after the stop: each is one short publish.
            for advisory in &fetched.messages {
                let answered = match self.handle(&advisory.payload).await {
                    Ok(()) => delivery::ack(advisory).await,
                    Err(error) => {
                        tracing::warn!(%error, "a MAX_DELIVERIES advisory waits");
                        delivery::nak(advisory, Duration::from_secs(5)).await
                    }
                };
                if let Err(error) = answered {
                    tracing::warn!(%error, "answering a MAX_DELIVERIES advisory");
                }
            }
        }
    }

    /// Dead-letters the message `advisory` names.
    async fn handle(&self, advisory: &[u8]) -> Result<(), NatsError> {
        let notice: MaxDeliveries = match serde_json::from_slice(advisory) {
            Ok(notice) => notice,
            Err(error) => {
                tracing::error!(%error, "an unreadable MAX_DELIVERIES advisory; dropped");
                return Ok(());
            }
        };
        let seq = notice.stream_seq;
        let stored = match self.stream.get_raw_message(seq).await {
            Ok(stored) => stored,
            Err(error) if error.kind() == RawMessageErrorKind::NoMessageFound => {
                tracing::error!(
                    stream = notice.stream,
                    stream_seq = seq,
                    "the server gave up on a message no longer in its stream: nothing to \
                     dead-letter"
                );
                return Ok(());
            }
            Err(error) => {
                return Err(nats_error(format!(
                    "reading message {seq} of {}",
                    notice.stream
                ))(error));
            }
        };
        let origin = Origin {
            subject: stored.subject.as_str(),
            stream: &notice.stream,
            stream_sequence: seq,
            deliveries: notice.deliveries,
        };
        let detail = format!(
            "the server delivered it {} times, its consumer's own max_deliver, and delivers it \
             no more (MAX_DELIVERIES advisory)",
            notice.deliveries
        );
        self.dead_letters
            .publish(
                &origin,
                Some(&stored.headers),
                stored.payload.clone(),
                DeadLetterReason::MaxDeliveries,
                &detail,
            )
            .await?;
        tracing::warn!(
            stream_seq = seq,
            deliveries = notice.deliveries,
            "dead-lettered a message the server gave up on"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_advisory_is_read_as_the_server_writes_it() {
        let body = br#"{"type":"io.nats.jetstream.advisory.v1.max_deliver","id":"zRwR5gTz4d077anDEKfgdc","timestamp":"2026-12-04T18:55:42.997210367Z","stream":"ORDERS","consumer":"inventory-reserve-stock","stream_seq":17,"deliveries":3}"#;
        let notice: MaxDeliveries = serde_json::from_slice(body).expect("an advisory");
        assert_eq!(
            (notice.stream.as_str(), notice.stream_seq, notice.deliveries),
            ("ORDERS", 17, 3)
        );
        assert_eq!(
            advisory_subject("ORDERS", "inventory-reserve-stock"),
            "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.ORDERS.inventory-reserve-stock"
        );
    }
}
