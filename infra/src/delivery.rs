//! A message as a consumer receives it from JetStream: pulling, reading where it came from, and
//! answering it (ack, nak, term). The consumer loop speaks to NATS through these alone.

use std::time::Duration;

use async_nats::jetstream::AckKind;
use async_nats::jetstream::consumer::{self, pull};

use crate::jetstream::{NatsError, Origin, boxed_nats_error, nats_error};

/// One delivery of a stored message.
pub type Delivery = async_nats::jetstream::Message;
/// The deliveries of a pull consumer, as they arrive.
pub type Deliveries = pull::Stream;
/// Why the next delivery could not be pulled (missed heartbeats while NATS reconnects).
pub type PullError = pull::MessagesError;
/// A durable pull consumer.
pub type PullConsumer = consumer::PullConsumer;
/// A consumer's settings, as the server has them.
pub type ConsumerConfig = consumer::Config;

/// Pulls continuously, `prefetch` messages per request, with heartbeats so a dead connection
/// is noticed.
pub async fn pull(consumer: &PullConsumer, prefetch: usize) -> Result<Deliveries, NatsError> {
    consumer
        .stream()
        .max_messages_per_batch(prefetch)
        .heartbeat(PULL_HEARTBEAT)
        .expires(Duration::from_secs(30))
        .messages()
        .await
        .map_err(nats_error("pulling from the consumer"))
}

/// The server's heartbeat on an idle pull; two missed and the pull reports a stall, which
/// [`Pull::recover`] answers with a new pull.
const PULL_HEARTBEAT: Duration = Duration::from_secs(2);

/// A continuous pull that is renewed when it stalls.
///
/// After a reconnect the client asks again only if the consumer has no pull request waiting at
/// all, and with several instances on one durable consumer the others' always are. Its own old
/// requests may still be held by the server on the connection that went silent (a blackhole:
/// no FIN, the server thinks it alive), which swallows what they deliver. The pull then waits
/// for their expiry; missed heartbeats say so sooner, and a new pull asks again at once.
pub struct Pull {
    consumer: PullConsumer,
    prefetch: usize,
    messages: Deliveries,
}

impl Pull {
    pub async fn start(consumer: &PullConsumer, prefetch: usize) -> Result<Self, NatsError> {
        Ok(Self {
            messages: pull(consumer, prefetch).await?,
            consumer: consumer.clone(),
            prefetch,
        })
    }

    /// The pull's deliveries, as they arrive.
    pub fn messages(&mut self) -> &mut Deliveries {
        &mut self.messages
    }

    /// After `error` from [`Self::messages`]: a stalled pull is dropped and asked anew;
    /// other errors pass (the client reconnects on its own). True if it was renewed.
    pub async fn recover(&mut self, error: &PullError) -> bool {
        if error.kind() != pull::MessagesErrorKind::MissingHeartbeat {
            return false;
        }
        match pull(&self.consumer, self.prefetch).await {
            Ok(messages) => {
                self.messages = messages;
                true
            }
            Err(error) => {
                tracing::warn!(%error, "pulling anew failed; the stalled pull is kept");
                false
            }
        }
    }
}

/// Where a delivery came from; `None` for a message without JetStream metadata.
pub fn origin(delivery: &Delivery) -> Option<Origin<'_>> {
    let info = delivery.info().ok()?;
    Some(Origin {
        subject: delivery.subject.as_str(),
        stream: info.stream,
        stream_sequence: info.stream_sequence,
        deliveries: info.delivered,
    })
}

/// Done with it: JetStream will not deliver it again.
pub async fn ack(delivery: &Delivery) -> Result<(), NatsError> {
    delivery.ack().await.map_err(boxed_nats_error("acking"))
}

/// Not now: JetStream delivers it again after `delay`.
pub async fn nak(delivery: &Delivery, delay: Duration) -> Result<(), NatsError> {
    delivery
        .ack_with(AckKind::Nak(Some(delay)))
        .await
        .map_err(boxed_nats_error("nak"))
}

/// Never again (it was dead-lettered): JetStream stops delivering it.
pub async fn terminate(delivery: &Delivery) -> Result<(), NatsError> {
    delivery
        .ack_with(AckKind::Term)
        .await
        .map_err(boxed_nats_error("terminating"))
}
