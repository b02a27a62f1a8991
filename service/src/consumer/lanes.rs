//! The lanes: an instance's `concurrency` lanes, shared by every consumer started on them (one
//! unsharded; each partition's of a shard). Each consumer has a fetcher that, while lanes wait,
//! asks its consumer for a batch for each, shared out among the consumers, and hands them to the
//! lanes free; each lane handles its batch to the end ([`super::message`]), with its own handler
//! (its own connection), then waits for the next. How they stop, gracefully or at once, and what
//! a lane that ends early does to the rest.
//!
//! Why this is safe. A fetched message spends its ack wait and a delivery, so what is fetched
//! and not started is kept small: a fetcher asks only while lanes wait, for its share of their
//! batches (all of them with one consumer, in one request; one batch each when there are more
//! consumers than waiting lanes), and asks again only once lanes started all it handed. So
//! about a batch a consumer waits for a lane (none with one consumer: nothing is fetched that a
//! waiting lane does not start), and a stop gives those back at once. No fetcher takes a lane's turn: while a lane waits, every
//! consumer's fetch waits at the server, so a message on any of them starts within a round trip,
//! whichever others are idle. Nothing is fetched while the database is suspect, until a lane
//! found it answering again; nor, on a shard, of a partition a handling found not owned here,
//! until the database owns it again (`ownership.rs`), while the other partitions keep the lanes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use backon::{ExponentialBuilder, Retryable as _};
use inventory_domain::Message;
use inventory_infra::MessageHandler;
use inventory_infra::db::{self, DatabaseConnection};
use inventory_infra::delivery::{self, Delivery, PullConsumer};
use inventory_infra::jetstream::{self, Backstop, Client};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::message::Worker;
use super::ownership;
use super::policy::Disposition;
use super::{Ending, RuntimeError};
use crate::health::Liveness;
use crate::shutdown::{self, Shutdown};

/// Runs the consumers until `shutdown.graceful` fires, then waits for every lane to finish its
/// messages, or until `shutdown.immediate`, when each naks what it holds.
///
/// Each lane holds its own clone of the handler, so a handler that keeps a connection per clone
/// keeps one per lane, for as long as the loop runs, however many consumers the lanes serve.
///
/// A lane, or a fetcher, ends only once told to stop. One that ends before (a panic, a broken
/// invariant, its consumer gone) is a fault the other lanes cannot serve around: it is reported
/// (an ERROR line, the task-failure metric, `/livez`), the other lanes stop as on a signal, and
/// the loop returns an error, so the process exits with one for its supervisor to restart it,
/// rather than idle with fewer lanes or none. Every lane's end is looked at, after the stop too: a
/// panic while draining fails the loop as well.
pub(super) async fn run<H: MessageHandler>(
    Lanes {
        consumers,
        lanes,
        client,
        db,
        work_timeout,
        state,
        tracker,
    }: Lanes,
    handler: H,
    shutdown: Shutdown,
    liveness: Liveness,
) -> Result<Ending, RuntimeError> {
    let stop = shutdown.graceful.child_token();
    // Not labelled by consumer: any consumer's handles count it.
    let task_failures = consumers.first().map(|fed| fed.worker.metrics.clone());
    // Room for all that the fetchers fetched at once: a batch for each waiting lane, rounded up
    // per consumer, so no fetcher holds a batch outside it at a stop.
    let sharing = consumers.len().max(1);
    let (hand, handed) = mpsc::channel(lanes + sharing);
    let handed = Arc::new(tokio::sync::Mutex::new(handed));
    // What a fetcher whose partition is not owned here asks the database through: a handler of
    // its own, shared by all the fetchers, so at most one connection more, opened at the first
    // question.
    let asker = Arc::new(handler.clone());
    let mut running = JoinSet::new();
    for fed in consumers {
        if let Some(backstop) = fed.backstop {
            let stop = stop.clone();
            running.spawn(async move {
                backstop.run(stop).await;
                Ok(())
            });
        }
        running.spawn(fetcher(
            Fetcher {
                consumer: fed.consumer,
                sharing,
                worker: fed.worker,
                client: client.clone(),
                state: state.subscribe(),
                hand: hand.clone(),
                asker: asker.clone(),
            },
            stop.clone(),
            shutdown.immediate.clone(),
        ));
    }
    drop(hand);
    for _ in 0..lanes {
        running.spawn(tracker.track_future(lane(
            handler.clone(),
            handed.clone(),
            state.clone(),
            (db.clone(), work_timeout),
            stop.clone(),
            shutdown.immediate.clone(),
        )));
    }
    tracker.close();
    let mut failures = Vec::new();
    let mut consumer_gone = None;
    // After an immediate stop, the lanes nak what they hold and end; those that do not within
    // the grace are aborted.
    let abort_after_grace = async {
        shutdown.immediate.cancelled().await;
        tokio::time::sleep(IMMEDIATE_GRACE).await;
    };
    tokio::pin!(abort_after_grace);
    let (mut stopping, mut aborted) = (false, false);
    loop {
        let ended = tokio::select! {
            ended = running.join_next() => match ended {
                Some(ended) => ended,
                None => break,
            },
            () = stop.cancelled(), if !stopping => {
                stopping = true;
                tracing::info!(lanes, "stopped fetching; finishing in-flight messages");
                continue;
            }
            () = &mut abort_after_grace, if !aborted => {
                aborted = true;
                running.abort_all();
                continue;
            }
        };
        let why = match ended {
            Ok(Ok(())) if stop.is_cancelled() => continue,
            Err(error) if error.is_cancelled() && aborted => continue,
            Ok(Ok(())) => "returned while the service ran".to_owned(),
            Ok(Err(LaneError::ConsumerGone(name))) => {
                let why = format!("found consumer {name} gone");
                consumer_gone = Some(name);
                why
            }
            Ok(Err(LaneError::Halted(why))) => format!("stopped on a broken invariant: {why}"),
            Err(error) => shutdown::early_end(Err(error)),
        };
        if failures.is_empty() {
            tracing::error!(%why, "a lane ended; stopping the other lanes");
            liveness.task_failed("lane", &why);
            if let Some(metrics) = &task_failures {
                metrics.task_failed("lane");
            }
            // The whole service stops, as on a signal, within the same bound.
            shutdown.graceful.cancel();
        }
        failures.push(why);
    }
    // Handed to a lane that stopped before it took them: back to the server at once.
    let mut handed = handed.lock().await;
    handed.close();
    while let Ok(batch) = handed.try_recv() {
        nak_now(&batch.messages).await;
    }
    if let Some(name) = consumer_gone {
        return Err(RuntimeError::StreamEnded(name));
    }
    if !failures.is_empty() {
        return Err(RuntimeError::LaneFailed(failures.join("; ")));
    }
    Ok(if shutdown.immediate.is_cancelled() {
        Ending::Abandoned
    } else {
        Ending::Drained
    })
}
/// What the lanes run on: the consumers they serve, the database, and the tracker that counts
/// them.
pub(super) struct Lanes {
    pub(super) consumers: Vec<Fed>,
    pub(super) lanes: usize,
    pub(super) client: Client,
    pub(super) db: DatabaseConnection,
    /// The bound on a lane's check that the database answers.
    pub(super) work_timeout: Option<Duration>,
    pub(super) state: watch::Sender<LaneState>,
    pub(super) tracker: TaskTracker,
}

/// One consumer the lanes serve: where its fetcher fetches, how its deliveries are handled, and
/// the backstop beside it.
pub(super) struct Fed {
    pub(super) consumer: PullConsumer,
    pub(super) worker: Arc<Worker>,
    pub(super) backstop: Option<Backstop>,
}

/// What the fetchers wait on: a lane waiting for work, and the database not suspect.
#[derive(Debug, Default)]
pub(super) struct LaneState {
    /// Lanes waiting for a batch.
    pub(super) waiting: usize,
    /// A handler's transient failure was the database's: the lanes hold until it answers.
    pub(super) database_suspect: bool,
}

impl LaneState {
    /// Whether the fetchers may fetch: a lane waits and the database is not suspect.
    fn lets_fetch(&self) -> bool {
        self.waiting > 0 && !self.database_suspect
    }

    /// Changes `state`, waking the fetchers only when whether they may fetch changed: not on
    /// every lane's coming and going, which would wake every consumer's fetcher each time.
    pub(super) fn change(state: &watch::Sender<Self>, change: impl FnOnce(&mut Self)) {
        state.send_if_modified(|state| {
            let before = state.lets_fetch();
            change(state);
            before != state.lets_fetch()
        });
    }
}

/// Why a lane ended before it was told to stop.
#[derive(Debug)]
enum LaneError {
    /// The durable consumer of this name no longer exists on the server.
    ConsumerGone(String),
    /// A handler broke an invariant of this program (a bug): nothing was sent for the message
    /// that broke it (the others of its batch were settled first), which comes again after its
    /// ack wait, to a restarted process.
    Halted(String),
}

/// A batch a fetcher fetched, waiting for a lane.
struct Handed {
    messages: Vec<Delivery>,
    /// How its consumer's deliveries are handled.
    worker: Arc<Worker>,
    /// Dropped when a lane takes the batch: its fetcher may fetch the next.
    taken: oneshot::Sender<()>,
}

/// What one consumer's fetcher fetches from, and where it hands what it fetched.
struct Fetcher<H> {
    consumer: PullConsumer,
    /// How many consumers share the lanes, this one included.
    sharing: usize,
    worker: Arc<Worker>,
    client: Client,
    state: watch::Receiver<LaneState>,
    hand: mpsc::Sender<Handed>,
    /// Asked whether the partition is owned here again, once a handling found it not.
    asker: Arc<H>,
}

/// Until `stop`: once a lane waits and the database is not suspect, asks the consumer for a
/// batch (what is there now, or the first to come) and hands it out, then waits until a lane
/// took it. A fetch still waiting is given up at the stop; what was handed out and not taken is
/// nak'ed by the loop. Once a handling found the consumer's partition not owned here, it asks
/// for nothing more until the database owns it again (`ownership.rs`).
async fn fetcher<H: MessageHandler>(
    Fetcher {
        consumer,
        sharing,
        worker,
        client,
        mut state,
        hand,
        asker,
    }: Fetcher<H>,
    stop: CancellationToken,
    immediate: CancellationToken,
) -> Result<(), LaneError> {
    let name = consumer.cached_info().name.clone();
    let mut ownership = worker.ownership.subscribe();
    loop {
        // A batch for each waiting lane, shared out among the consumers: with one, a request for
        // every lane that waits, as they wait; with many, one batch each, so what is fetched
        // and not started stays about a batch a consumer.
        let batches = tokio::select! {
            () = stop.cancelled() => return Ok(()),
            ready = state.wait_for(LaneState::lets_fetch) => {
                ready
                    .map_err(|_| LaneError::Halted("the lanes' state closed".into()))?
                    .waiting
                    .div_ceil(sharing)
                    .max(1)
            }
        };
        // Not owned here, a handling found: nothing more is pulled of the partition until the
        // database owns it again. What was fetched before goes its way, each nak'ed.
        let not_owned = ownership.borrow_and_update().clone();
        if let Some(probe) = not_owned {
            if !ownership::wait_until_owned(&*asker, &worker, &name, &probe, &stop).await {
                return Ok(());
            }
            continue;
        }
        let asked = Instant::now();
        let batch_size = worker.lanes.batch_size;
        let fetched = tokio::select! {
            fetched = fetch_while_owned(
                (&consumer, &client),
                batches * batch_size,
                &mut ownership,
                &stop,
            ) => fetched,
            () = immediate.cancelled() => return Ok(()),
        };
        let failed = fetched.error.is_some();
        if let Some(error) = &fetched.error {
            tracing::warn!(%error, "fetching");
        }
        if (failed || fetched.unanswered) && jetstream::consumer_is_gone(&consumer).await {
            return Err(LaneError::ConsumerGone(consumer.cached_info().name.clone()));
        }
        if fetched.messages.is_empty() {
            // Failed, or refused at once (other requests wait for what there is): not a reason
            // to ask again in a tight loop.
            let pause = if failed {
                FAILED_FETCH_PAUSE
            } else if asked.elapsed() < EMPTY_FETCH_PAUSE {
                EMPTY_FETCH_PAUSE
            } else {
                Duration::ZERO
            };
            tokio::select! {
                () = stop.cancelled() => return Ok(()),
                () = tokio::time::sleep(pause) => {}
            }
            continue;
        }
        let mut messages = fetched.messages.into_iter().peekable();
        let mut started = Vec::with_capacity(batches);
        while messages.peek().is_some() {
            let (taken, took) = oneshot::channel();
            let batch = Handed {
                messages: messages.by_ref().take(batch_size).collect(),
                worker: worker.clone(),
                taken,
            };
            if hand.send(batch).await.is_err() {
                // Every lane ended.
                return Ok(());
            }
            started.push(took);
        }
        tokio::select! {
            () = stop.cancelled() => return Ok(()),
            _ = futures::future::join_all(started) => {}
        }
    }
}

/// `delivery::fetch` of up to `max`, given up (as at `stop`) while still empty if a handling
/// finds the partition not owned meanwhile: a fetch waits at the server up to 30 s, and one
/// still waiting would take the partition's next message, and the naks' redeliveries, all to be
/// nak'ed again.
async fn fetch_while_owned(
    (consumer, client): (&PullConsumer, &Client),
    max: usize,
    ownership: &mut watch::Receiver<Option<Message>>,
    stop: &CancellationToken,
) -> delivery::Fetched {
    let give_up = stop.child_token();
    let fetch = delivery::fetch(consumer, client, max, &give_up);
    tokio::pin!(fetch);
    tokio::select! {
        fetched = &mut fetch => return fetched,
        _ = ownership.wait_for(Option::is_some) => give_up.cancel(),
    }
    // Ends at once if nothing came yet; else with what came, which is handed out as any.
    fetch.await
}

/// One lane: wait for a batch a fetcher hands it, handle it to the end with `handler`, repeat,
/// until `stop`. On `immediate` it gives up the messages it holds, nak'ed to come again at once.
async fn lane<H: MessageHandler>(
    handler: H,
    handed: Arc<tokio::sync::Mutex<mpsc::Receiver<Handed>>>,
    state: watch::Sender<LaneState>,
    // Where it checks that the database answers, and within what bound.
    (db, work_timeout): (DatabaseConnection, Option<Duration>),
    stop: CancellationToken,
    immediate: CancellationToken,
) -> Result<(), LaneError> {
    loop {
        // Each lane holds before its next batch while the database is suspect, not only the
        // first to notice: one that took on would burn its messages' deliveries on an outage
        // (a lane already waiting for a batch still handles the one it is handed).
        if state.borrow().database_suspect {
            if !wait_for_database(&db, work_timeout, &stop).await {
                return Ok(());
            }
            LaneState::change(&state, |state| state.database_suspect = false);
        }
        LaneState::change(&state, |state| state.waiting += 1);
        let batch = tokio::select! {
            () = stop.cancelled() => None,
            batch = async { handed.lock().await.recv().await } => batch,
        };
        LaneState::change(&state, |state| state.waiting -= 1);
        let Some(Handed {
            messages,
            worker,
            taken,
        }) = batch
        else {
            return Ok(());
        };
        // Started: its consumer's fetcher may fetch the next.
        drop(taken);
        let dispositions = tokio::select! {
            dispositions = worker.process_all(&handler, &messages) => dispositions,
            () = immediate.cancelled() => {
                // Whatever committed is acked by now or comes again as a duplicate.
                nak_now(&messages).await;
                return Ok(());
            }
        };
        if let Some(Disposition::Halted(why)) = dispositions
            .into_iter()
            .find(|disposition| matches!(disposition, Disposition::Halted(_)))
        {
            return Err(LaneError::Halted(why));
        }
    }
}

/// How long the lanes have to nak what they hold after an immediate stop.
const IMMEDIATE_GRACE: Duration = Duration::from_millis(500);

/// Pause after a fetch refused at once.
const EMPTY_FETCH_PAUSE: Duration = Duration::from_millis(50);
/// Pause after a fetch that failed (NATS away, or reconnecting).
const FAILED_FETCH_PAUSE: Duration = Duration::from_secs(1);

/// Gives `messages` back for redelivery now: held at an immediate stop.
async fn nak_now(messages: &[Delivery]) {
    for message in messages {
        if let Err(error) = delivery::nak(message, Duration::ZERO).await {
            tracing::warn!(%error, "nak not sent; the message comes again after its ack wait");
        }
    }
}

/// Waits until the database answers again and takes writes (a standby reached during a
/// failover answers, but refuses every write); false if shutdown came first. Until then nothing
/// is fetched, so messages are not burned through their delivery attempts. Each look is
/// bounded by `bound`: one on a connection gone silent would wait forever.
async fn wait_for_database(
    db: &DatabaseConnection,
    bound: Option<Duration>,
    shutdown: &CancellationToken,
) -> bool {
    let mut was_down = false;
    let reachable = (|| async { db::within(bound, db::check_writable(db)).await? })
        .retry(DATABASE_LOOKS)
        .notify(|error, _| {
            was_down = true;
            tracing::warn!(%error, "database unreachable; not fetching");
        });
    tokio::select! {
        () = shutdown.cancelled() => return false,
        _ = reachable => {}
    }
    if was_down {
        tracing::info!("database reachable; consuming");
    }
    true
}

/// How often [`wait_for_database`] looks: after 200 ms, doubling up to 5 s, until it answers.
const DATABASE_LOOKS: ExponentialBuilder = ExponentialBuilder::new()
    .with_min_delay(Duration::from_millis(200))
    .with_max_delay(Duration::from_secs(5))
    .without_max_times();
