//! A partition found not owned: on a shard, a consumer's fetcher stops pulling its partition at
//! the first "not owned" outcome, asks the database every few seconds whether it owns the
//! partition again, and pulls again once it does.
//!
//! Why. During a move the old shard's owner row is `fenced` long before the instance's watch of
//! the assignment sees the change: pulling on, it would nak every message of the partition again
//! and again, spending their deliveries (each has a cap) and its CPU, while the shard that owns
//! the partition waits for them.
//!
//! Why this is safe. Stopping changes only whether the fetcher asks for more: every delivery
//! already fetched goes its usual way (`message.rs`), each "not owned" one nak'ed with the retry
//! delay by the policy, and what is not fetched waits at the server, its deliveries unspent.
//! Which database decides a message is still the owner row's to say, read under the stock row's
//! lock: a fetcher that stops late, or pulls again early, costs a nak, never a decision.
//! An unsharded handler never finds a message "not owned", so its consumer never stops.

use std::time::Duration;

use backon::{ExponentialBuilder, Retryable as _};
use inventory_domain::Message;
use inventory_infra::db::{self, NoAnswer};
use inventory_infra::{HandleError, MessageHandler};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::message::Worker;

/// Whether a consumer's partition is owned here, as its handlings last found: `Some` with a
/// message of the partition once one was "not owned" (the question to ask the database), `None`
/// while owned. Set by the lanes, read and cleared by the consumer's fetcher.
#[derive(Debug)]
pub(super) struct Ownership(watch::Sender<Option<Message>>);

impl Default for Ownership {
    fn default() -> Self {
        Self(watch::Sender::new(None))
    }
}

impl Ownership {
    /// A handling of `message` came to "not owned": its fetcher stops pulling. The first such
    /// message is kept; the others of the partition ask the same.
    pub(super) fn not_owned(&self, message: Message) {
        self.0.send_if_modified(|held| {
            let first = held.is_none();
            if first {
                *held = Some(message);
            }
            first
        });
    }

    /// The database owns the partition again: its fetcher pulls it.
    fn owned_again(&self) {
        self.0.send_replace(None);
    }

    /// What the fetcher watches.
    pub(super) fn subscribe(&self) -> watch::Receiver<Option<Message>> {
        self.0.subscribe()
    }
}

/// Why a look did not find the partition owned.
enum Look {
    NotYet,
    Failed(HandleError),
}

/// Waits, pulling nothing of `worker`'s consumer (named `consumer` in the logs), until `asker`'s
/// database owns the partition of `probe` again, then clears the consumer's [`Ownership`];
/// false if `stop` came first. One log line when it stops pulling, one when it pulls again, and
/// the consumer's `inventory_consumer_not_owned` gauge at 1 meanwhile.
pub(super) async fn wait_until_owned<H: MessageHandler>(
    asker: &H,
    worker: &Worker,
    consumer: &str,
    probe: &Message,
    stop: &CancellationToken,
) -> bool {
    tracing::info!(consumer, "partition not owned here: stopped pulling it");
    worker.metrics.not_owned(true);
    let look = || async {
        let answer = db::within(worker.lanes.work_timeout, asker.decides(probe))
            .await
            .unwrap_or_else(|NoAnswer(bound)| Err(HandleError::TimedOut(bound)));
        match answer {
            Ok(true) => Ok(()),
            Ok(false) => Err(Look::NotYet),
            Err(error) => Err(Look::Failed(error)),
        }
    };
    let owned = look.retry(OWNERSHIP_LOOKS).notify(|look, _| {
        if let Look::Failed(error) = look {
            tracing::warn!(consumer, %error, "asking whether the partition is owned here");
        }
    });
    tokio::select! {
        () = stop.cancelled() => return false,
        _ = owned => {}
    }
    worker.ownership.owned_again();
    worker.metrics.not_owned(false);
    tracing::info!(consumer, "partition owned here again: pulling it");
    true
}

/// How often a stopped partition asks: after 1 s, doubling up to 5 s, with jitter (so the
/// instances of a shard do not ask together), until the database says it is owned here.
const OWNERSHIP_LOOKS: ExponentialBuilder = ExponentialBuilder::new()
    .with_min_delay(Duration::from_secs(1))
    .with_max_delay(Duration::from_secs(5))
    .with_jitter()
    .without_max_times();
