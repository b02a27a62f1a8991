//! One delivery's path: its count read, its body decoded, the handler called, its answer
//! settled by the [`policy`] and performed (ack, nak or dead letter). The only place a delivery
//! is acked, nak'ed or terminated.

use std::time::Instant;

use inventory_domain::{Acked, DeadLetterReason, Effect, ErrorKind, Message, Outcome, Subject};
use inventory_infra::db::{self, NoAnswer};
use inventory_infra::delivery::{self, Delivery};
use inventory_infra::jetstream::{DeadLetters, Origin};
use inventory_infra::outbox::RelayWake;
use inventory_infra::{HandleError, MessageHandler};
use tokio::sync::watch;
use tracing::{Instrument, field};

use super::LaneSettings;
use super::lanes::LaneState;
use super::ownership::Ownership;
use super::policy::{self, Action, Disposition};
use crate::metrics::ConsumerMetrics;

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

/// Everything one delivery of a consumer needs but the handler, which is the lane's: one per
/// consumer, shared by the lanes.
pub(super) struct Worker {
    pub(super) dead_letters: DeadLetters,
    pub(super) lanes: LaneSettings,
    /// Set when a handler's transient failure was the database's: each lane checks that the
    /// database answers before it takes its next batch, and nothing is fetched meanwhile.
    pub(super) lane_state: watch::Sender<LaneState>,
    pub(super) metrics: ConsumerMetrics,
    /// The outbox relay to wake after a handling that committed an event.
    pub(super) relay_wake: Option<RelayWake>,
    /// Told of a "not owned" outcome: the consumer's fetcher then stops pulling its partition
    /// until the database owns it again (`ownership.rs`).
    pub(super) ownership: Ownership,
}

impl Worker {
    /// Handles a lane's deliveries to their end with the lane's `handler`: one alone, several
    /// as one batch (the handler may commit them together). As many dispositions as
    /// deliveries, in order.
    pub(super) async fn process_all<H: MessageHandler>(
        &self,
        handler: &H,
        messages: &[Delivery],
    ) -> Vec<Disposition> {
        match messages {
            [message] => vec![
                self.process(handler, message)
                    .instrument(message_span())
                    .await,
            ],
            messages => self.process_batch(handler, messages).await,
        }
    }

    /// Handles one delivery to its end.
    async fn process<H: MessageHandler>(&self, handler: &H, message: &Delivery) -> Disposition {
        let started = Instant::now();
        let in_flight = self.metrics.start(1);
        let disposition = match self.admit(handler, message).await {
            Admitted::Settled(disposition) => disposition,
            Admitted::Decoded(origin, decoded) => {
                let result = db::within(self.lanes.work_timeout, handler.handle(&decoded))
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
    async fn process_batch<H: MessageHandler>(
        &self,
        handler: &H,
        messages: &[Delivery],
    ) -> Vec<Disposition> {
        let started = Instant::now();
        let in_flight = self.metrics.start(messages.len());
        let mut dispositions: Vec<Option<Disposition>> = Vec::with_capacity(messages.len());
        let mut decoded = Vec::with_capacity(messages.len());
        let mut origins = Vec::with_capacity(messages.len());
        // One span a message, through admission and settling: its log lines carry its id,
        // stream sequence and delivery count as a single message's do.
        let spans: Vec<tracing::Span> = messages.iter().map(|_| message_span()).collect();
        for (message, span) in messages.iter().zip(&spans) {
            match self.admit(handler, message).instrument(span.clone()).await {
                Admitted::Settled(disposition) => dispositions.push(Some(disposition)),
                Admitted::Decoded(origin, message) => {
                    dispositions.push(None);
                    decoded.push(message);
                    origins.push(origin);
                }
            }
        }
        let mut results = db::within(self.lanes.work_timeout, handler.handle_batch(&decoded))
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
    async fn admit<'a, H: MessageHandler>(
        &self,
        handler: &H,
        message: &'a Delivery,
    ) -> Admitted<'a> {
        let Some(origin) = delivery::origin(message) else {
            // Not a JetStream delivery: there is nothing to ack, so nothing to do.
            tracing::error!(subject = %message.subject, "message without JetStream metadata");
            return Admitted::Settled(Disposition::LeftForRedelivery);
        };
        let span = tracing::Span::current();
        span.record("stream_seq", origin.stream_sequence);
        span.record("delivered", origin.deliveries);
        if let Some(action) = policy::admit(origin.deliveries, &self.lanes.retry) {
            let action = self.unless_another_shards(handler, message, action).await;
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

    /// `action`, the dead letter of a delivery past the cap, unless the message is another
    /// shard's: handed here past the cap (this instance's view of the assignment lags), it is
    /// theirs to decide, or to dead-letter, and goes back soon, as a "not owned" placement
    /// does. One that cannot be decoded or asked about keeps its dead letter.
    async fn unless_another_shards<H: MessageHandler>(
        &self,
        handler: &H,
        message: &Delivery,
        action: Action,
    ) -> Action {
        match self.decode(message) {
            Ok(decoded) if matches!(handler.decides(&decoded).await, Ok(false)) => {
                self.ownership.not_owned(decoded);
                policy::decide(
                    Err((&ErrorKind::NotOwned, "not owned")),
                    0,
                    &self.lanes.retry,
                )
            }
            _ => action,
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
        let subject = Subject::parse(&message.subject).ok_or_else(|| {
            (
                DeadLetterReason::Invalid,
                format!("subject {} carries no order event", message.subject),
            )
        })?;
        let decoded = Message::decode(subject.kind, &message.payload)
            .map_err(|error| (error.reason(), error.to_string()))?;
        // A subject that routed the message by a book other than the body's sent it where
        // another book's stock is decided.
        subject
            .check(&decoded.event)
            .map_err(|mismatch| (DeadLetterReason::Invalid, mismatch))?;
        Ok(decoded)
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
                if kind == ErrorKind::Transient && error.is_database() {
                    // The database may be down as a whole: no lane takes more until it answers.
                    LaneState::change(&self.lane_state, |state| {
                        state.database_suspect = true;
                    });
                }
                if kind == ErrorKind::NotOwned
                    && let Ok(decoded) = self.decode(message)
                {
                    // Another shard's partition now: its fetcher pulls no more of it, and this
                    // message is nak'ed below as any "not owned" one.
                    self.ownership.not_owned(decoded);
                }
                let text = error.to_string();
                policy::decide(Err((&kind, &text)), origin.deliveries, retry)
            }
        };
        self.perform(message, origin, action).await
    }

    /// What a handler's error means for its delivery, logged.
    fn kind_of(&self, error: &HandleError) -> ErrorKind {
        let kind = error.kind();
        match &kind {
            ErrorKind::Permanent(_) => tracing::warn!(%error, "permanent failure"),
            ErrorKind::Internal => tracing::error!(%error, "broken invariant; stopping"),
            ErrorKind::Transient => tracing::warn!(%error, "transient failure"),
            ErrorKind::NotOwned => tracing::info!(%error, "not owned here"),
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
            // Once at most: that action is a nak or nothing, never another dead letter.
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
