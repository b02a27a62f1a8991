//! The lanes: the fetcher asks the durable consumer for a batch for each lane that waits and
//! hands them out; each lane handles its batch to the end ([`super::message`]), then waits for
//! the next. How they stop, gracefully or at once, and what a lane that ends early does to the
//! rest.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use backon::{ExponentialBuilder, Retryable as _};
use inventory_infra::MessageHandler;
use inventory_infra::db::{self, DatabaseConnection};
use inventory_infra::delivery::{self, Delivery, PullConsumer};
use inventory_infra::jetstream::{self, Backstop, Client};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::message::Worker;
use super::policy::Disposition;
use super::{Ending, RuntimeError};
use crate::health::Liveness;
use crate::shutdown::{self, Shutdown};

/// Runs the consumer until `shutdown.graceful` fires, then waits for every lane to finish its
/// messages, or until `shutdown.immediate`, when each naks what it holds.
///
/// `concurrency` lanes each take a batch the fetcher fetched for them and handle it to its end.
/// Each lane holds its own clone of the handler, so a handler that keeps a connection per clone
/// keeps one per lane, for as long as the loop runs.
///
/// A lane, or the fetcher, ends only once told to stop. One that ends before (a panic, a broken
/// invariant, its consumer gone) is a fault the other lanes cannot serve around: it is reported
/// (an ERROR line, the task-failure metric, `/livez`), the other lanes stop as on a signal, and
/// the loop returns an error, so the process exits with one for its supervisor to restart it,
/// rather than idle with fewer lanes or none. Every lane's end is looked at, after the stop too: a
/// panic while draining fails the loop as well.
pub(super) async fn run<H: MessageHandler>(
    Lanes {
        consumer,
        client,
        db,
        backstop,
        tracker,
    }: Lanes,
    worker: Worker<H>,
    shutdown: Shutdown,
    liveness: Liveness,
) -> Result<Ending, RuntimeError> {
    let consumer = &consumer;
    let lanes = worker.lanes.concurrency;
    let stop = shutdown.graceful.child_token();
    // A lane that waits for work says so; the fetcher asks the consumer for as many batches at
    // once as lanes wait, and hands one to each. One request per instance waits at the server
    // when idle, and nothing is fetched that a waiting lane does not start.
    let waiting = Arc::new(Semaphore::new(0));
    let (hand, handed) = tokio::sync::mpsc::channel(lanes);
    let handed = Arc::new(tokio::sync::Mutex::new(handed));
    let mut running = JoinSet::new();
    running.spawn(fetcher(
        Fetcher {
            consumer: consumer.clone(),
            client,
            batch_size: worker.lanes.batch_size,
            waiting: waiting.clone(),
            hand,
        },
        stop.clone(),
        shutdown.immediate.clone(),
    ));
    for _ in 0..lanes {
        running.spawn(tracker.track_future(lane(
            worker.clone(),
            handed.clone(),
            waiting.clone(),
            db.clone(),
            stop.clone(),
            shutdown.immediate.clone(),
        )));
    }
    if let Some(backstop) = backstop {
        let stop = stop.clone();
        running.spawn(async move {
            backstop.run(stop).await;
            Ok(())
        });
    }
    tracker.close();
    let mut failures = Vec::new();
    let mut consumer_gone = false;
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
            Ok(Err(LaneError::ConsumerGone)) => {
                consumer_gone = true;
                format!("found consumer {} gone", consumer.cached_info().name)
            }
            Ok(Err(LaneError::Halted(why))) => format!("stopped on a broken invariant: {why}"),
            Err(error) => shutdown::early_end(Err(error)),
        };
        if failures.is_empty() {
            tracing::error!(%why, "a lane ended; stopping the other lanes");
            liveness.task_failed("lane", &why);
            worker.metrics.task_failed("lane");
            // The whole service stops, as on a signal, within the same bound.
            shutdown.graceful.cancel();
        }
        failures.push(why);
    }
    // Handed to a lane that stopped before it took them: back to the server at once.
    let mut handed = handed.lock().await;
    handed.close();
    while let Ok(batch) = handed.try_recv() {
        nak_now(&batch).await;
    }
    if consumer_gone {
        return Err(RuntimeError::StreamEnded(
            consumer.cached_info().name.clone(),
        ));
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

/// What the lanes run on: the consumer, the database, the backstop beside them, and the
/// tracker that counts them.
pub(super) struct Lanes {
    pub(super) consumer: PullConsumer,
    pub(super) client: Client,
    pub(super) db: DatabaseConnection,
    pub(super) backstop: Option<Backstop>,
    pub(super) tracker: TaskTracker,
}

/// Why a lane ended before it was told to stop.
#[derive(Debug)]
enum LaneError {
    /// The durable consumer no longer exists on the server.
    ConsumerGone,
    /// A handler broke an invariant of this program (a bug): nothing was sent for the message
    /// that broke it (the others of its batch were settled first), which comes again after its
    /// ack wait, to a restarted process.
    Halted(String),
}

/// What the fetcher fetches for, and how it hands it out.
struct Fetcher {
    consumer: PullConsumer,
    client: Client,
    batch_size: usize,
    /// A permit for each lane that waits for work.
    waiting: Arc<Semaphore>,
    hand: tokio::sync::mpsc::Sender<Vec<Delivery>>,
}

/// Until `stop`: once lanes wait, asks the consumer for a batch for each of them at once (those
/// there now, or the first to come), and hands each a batch; a fetch for lanes that no longer
/// wait is given up at the stop, and what was handed out and not taken is nak'ed by the loop.
async fn fetcher(
    fetcher: Fetcher,
    stop: CancellationToken,
    immediate: CancellationToken,
) -> Result<(), LaneError> {
    let Fetcher {
        consumer,
        client,
        batch_size,
        waiting,
        hand,
    } = fetcher;
    loop {
        let lanes = tokio::select! {
            () = stop.cancelled() => return Ok(()),
            permit = waiting.acquire() => {
                permit.map_err(|_| LaneError::Halted("the lanes' semaphore closed".into()))?.forget();
                1 + waiting.forget_permits(usize::MAX)
            }
        };
        let asked = Instant::now();
        let fetched = tokio::select! {
            fetched = delivery::fetch(&consumer, &client, lanes * batch_size, &stop) => fetched,
            () = immediate.cancelled() => return Ok(()),
        };
        let failed = fetched.error.is_some();
        if let Some(error) = &fetched.error {
            tracing::warn!(%error, "fetching");
        }
        if (failed || fetched.unanswered) && jetstream::consumer_is_gone(&consumer).await {
            return Err(LaneError::ConsumerGone);
        }
        let mut messages = fetched.messages.into_iter().peekable();
        let mut handed = 0;
        while messages.peek().is_some() {
            let batch: Vec<Delivery> = messages.by_ref().take(batch_size).collect();
            if hand.send(batch).await.is_err() {
                // Every lane ended.
                return Ok(());
            }
            handed += 1;
        }
        // Those still waiting are asked for again.
        waiting.add_permits(lanes.saturating_sub(handed));
        if handed == 0 {
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
        }
    }
}

/// One lane: wait for a batch the fetcher hands it, handle it to the end, repeat, until `stop`.
/// On `immediate` it gives up the messages it holds, nak'ed to come again at once.
async fn lane<H: MessageHandler>(
    worker: Worker<H>,
    handed: Arc<tokio::sync::Mutex<tokio::sync::mpsc::Receiver<Vec<Delivery>>>>,
    waiting: Arc<Semaphore>,
    db: DatabaseConnection,
    stop: CancellationToken,
    immediate: CancellationToken,
) -> Result<(), LaneError> {
    loop {
        // Each lane holds before its next batch while the database is suspect, not only the
        // first to notice: one that fetched on would burn its messages' deliveries on an outage
        // (a lane already waiting for a batch still handles the one it is handed).
        if worker.database_suspect.load(Ordering::Relaxed) {
            if !wait_for_database(&db, worker.lanes.work_timeout, &stop).await {
                return Ok(());
            }
            worker.database_suspect.store(false, Ordering::Relaxed);
        }
        waiting.add_permits(1);
        let batch = tokio::select! {
            () = stop.cancelled() => return Ok(()),
            batch = async { handed.lock().await.recv().await } => match batch {
                Some(batch) => batch,
                None => return Ok(()),
            },
        };
        let dispositions = tokio::select! {
            dispositions = worker.process_all(&batch) => dispositions,
            () = immediate.cancelled() => {
                // Whatever committed is acked by now or comes again as a duplicate.
                nak_now(&batch).await;
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
