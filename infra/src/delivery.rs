//! A message as a consumer receives it from JetStream: fetching it, reading where it came from,
//! and answering it (ack, nak, term). The consumer loop speaks to NATS through these alone.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_nats::jetstream::AckKind;
use async_nats::jetstream::consumer;

use crate::jetstream::{NatsError, Origin, nats_error};

/// One delivery of a stored message.
pub type Delivery = async_nats::jetstream::Message;
/// A durable pull consumer.
pub type PullConsumer = consumer::PullConsumer;
/// A consumer's settings, as the server has them.
pub type ConsumerConfig = consumer::Config;

/// How long a fetch waits at the server for a first message when none is there; it returns as
/// soon as one is, so this is only how often an idle instance asks again.
pub const FETCH_WAIT: Duration = Duration::from_secs(30);

/// How often a waiting fetch looks whether the client reconnected meanwhile: the server holds
/// the request on the old connection, and after a blackhole (no FIN: the server thinks it
/// alive) sends it messages that never arrive. A fetch on the new connection asks again.
///
/// Not the server's idle heartbeat: async-nats 0.51's fetch returns `Pending` after one
/// without waking again, so the messages that follow it go unread until something else polls.
const RECONNECT_CHECK: Duration = Duration::from_secs(1);

/// What one fetch brought.
#[derive(Default)]
pub struct Fetched {
    pub messages: Vec<Delivery>,
    /// The fetch ended with an error (the consumer deleted, a leader change); what came before
    /// it is in `messages` all the same.
    pub error: Option<NatsError>,
    /// The server never answered: it ends an idle request with a status at [`FETCH_WAIT`], and
    /// only the client's own timer, seconds later, ended this one. nats-server before 2.10
    /// answers nothing at all for a consumer that no longer exists.
    pub unanswered: bool,
}

/// Asks `consumer` for up to `max` messages: those it has now, else the first to arrive within
/// [`FETCH_WAIT`]. Nothing waits in a client buffer: what comes is what the caller hands its
/// lanes, so a message spends its ack wait, and a delivery, only once the caller asked for it.
///
/// A fetch still waiting for its first message when `stop` fires is given up. What the server
/// sends it in that instant, before it hears of the stop, comes again after its ack wait; a
/// fetch read to its end instead would hold the stop for up to [`FETCH_WAIT`].
pub async fn fetch(
    consumer: &PullConsumer,
    client: &async_nats::Client,
    max: usize,
    stop: &tokio_util::sync::CancellationToken,
) -> Fetched {
    use futures::StreamExt as _;
    let connects = || client.statistics().connects.load(Ordering::Relaxed);
    let (asked, asked_on) = (Instant::now(), connects());
    let mut fetched = Fetched::default();
    let request = consumer
        .fetch()
        .max_messages(max)
        .expires(FETCH_WAIT)
        .messages()
        .await;
    let mut request = match request {
        Ok(request) => request,
        Err(error) => {
            fetched.error = Some(nats_error("fetching from the consumer")(error));
            return fetched;
        }
    };
    let mut reconnect_check = tokio::time::interval(RECONNECT_CHECK);
    loop {
        tokio::select! {
            biased;
            next = request.next() => match next {
                Some(Ok(message)) => fetched.messages.push(message),
                Some(Err(error)) => {
                    fetched.error = Some(nats_error("fetching from the consumer")(error));
                    break;
                }
                None => {
                    fetched.unanswered = fetched.messages.is_empty()
                        && asked.elapsed() > FETCH_WAIT + RECONNECT_CHECK * 2;
                    break;
                }
            },
            _ = reconnect_check.tick() => {
                if connects() != asked_on {
                    tracing::info!("NATS reconnected: fetching anew");
                    break;
                }
            }
            () = stop.cancelled(), if fetched.messages.is_empty() => {
                drop(request);
                // nats-server before 2.10.14 (#5305) keeps the abandoned request queued, and a
                // redelivery falling due meanwhile (a nak at the stop) is sent as a first
                // delivery. Asking for the consumer's info makes it drop the request now.
                let _ = consumer.get_info().await;
                break;
            }
        }
    }
    fetched
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
    delivery.ack().await.map_err(nats_error("acking"))
}

/// Not now: JetStream delivers it again after `delay`.
pub async fn nak(delivery: &Delivery, delay: Duration) -> Result<(), NatsError> {
    delivery
        .ack_with(AckKind::Nak(Some(delay)))
        .await
        .map_err(nats_error("nak"))
}

/// Never again (it was dead-lettered): JetStream stops delivering it.
pub async fn terminate(delivery: &Delivery) -> Result<(), NatsError> {
    delivery
        .ack_with(AckKind::Term)
        .await
        .map_err(nats_error("terminating"))
}
