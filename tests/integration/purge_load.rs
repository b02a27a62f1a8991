//! The retention purge under load: a million completed inbox rows on PostgreSQL deleted in
//! batches of 5,000 while the consumer handles a steady flow of messages. No message may wait
//! for the whole purge: each batch is its own short transaction.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inventory_domain::{Message, Outcome};
use inventory_infra::retention::purge_completed;
use inventory_infra::{DetectMode, HandleError, Handler, HandlerKind, MessageHandler};
use inventory_tests::broker::{Broker, RunningService, eventually};
use inventory_tests::{Backend, TestDb, placed};
use sea_orm::ConnectionTrait;

const SEEDED: u64 = 1_000_000;
const BATCH: u64 = 5_000;

/// The inbox consumer, timing every message it handles.
#[derive(Clone)]
struct Timed {
    inner: Handler,
    /// (when handling started, how long it took)
    log: Arc<Mutex<Vec<(Instant, Duration)>>>,
}

impl MessageHandler for Timed {
    async fn handle(&self, message: &Message) -> Result<Outcome, HandleError> {
        let started = Instant::now();
        let outcome = self.inner.handle(message).await;
        self.log.lock().unwrap().push((started, started.elapsed()));
        outcome
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[rank]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purging_a_million_rows_never_holds_the_consumer_up_for_long() {
    let db = TestDb::new(Backend::Postgres).await;
    let seeding = Instant::now();
    // One statement, so the seed takes seconds: completed a month ago, one millisecond apart.
    db.conn
        .execute_unprepared(&format!(
            "INSERT INTO inbox (message_id, consumer, received_at, completed_at, payload_hash) \
             SELECT 'seed-' || g, 'inventory-reserve-stock-inbox', \
                    now() - interval '31 days', \
                    now() - interval '30 days' + g * interval '1 millisecond', \
                    repeat('0', 64) \
             FROM generate_series(1, {SEEDED}) AS g; ANALYZE inbox"
        ))
        .await
        .unwrap();
    let seeded_in = seeding.elapsed();

    let broker = Broker::new().await;
    let book = db.dune(1_000_000).await;
    let log = Arc::new(Mutex::new(Vec::new()));
    let handler = Timed {
        inner: db.consumer(HandlerKind::Inbox(DetectMode::OnConflict)),
        log: log.clone(),
    };
    let service =
        RunningService::start(&broker, handler, db.conn.clone(), broker.settings(4, 5)).await;

    // A steady flow, one message every 10 ms, from before the purge until after it.
    let stop_flow = tokio_util::sync::CancellationToken::new();
    let flow = tokio::spawn({
        let publisher = broker.publisher();
        let stop = stop_flow.clone();
        async move {
            let mut sent = 0u64;
            let mut ticks = tokio::time::interval(Duration::from_millis(10));
            while !stop.is_cancelled() {
                ticks.tick().await;
                publisher.publish(&placed(book, 1)).await.unwrap();
                sent += 1;
            }
            sent
        }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;

    let purge_started = Instant::now();
    let cutoff = chrono::Utc::now() - chrono::Duration::days(1);
    let report = purge_completed(&db.conn, cutoff, BATCH, false)
        .await
        .unwrap();
    let purge_took = purge_started.elapsed();
    let purge_ended = Instant::now();
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop_flow.cancel();
    let sent = flow.await.unwrap();
    eventually("every message handled", || async {
        db.reserved(book).await == i64::try_from(sent).unwrap()
    })
    .await;
    service.stop().await;

    assert_eq!(report.deleted, SEEDED);
    assert_eq!(report.batches, SEEDED / BATCH + 1);
    let log = log.lock().unwrap();
    let mut before: Vec<Duration> = log
        .iter()
        .filter(|(at, _)| *at < purge_started)
        .map(|(_, took)| *took)
        .collect();
    let mut during: Vec<Duration> = log
        .iter()
        .filter(|(at, _)| *at >= purge_started && *at < purge_ended)
        .map(|(_, took)| *took)
        .collect();
    before.sort_unstable();
    during.sort_unstable();
    let max = *during.last().unwrap();
    eprintln!(
        "seeded {SEEDED} rows in {seeded_in:?}; purged them in {purge_took:?} ({} batches of \
         {BATCH}); handling latency before the purge: p50 {:?}, max {:?} ({} messages); during: \
         p50 {:?}, p99 {:?}, max {max:?} ({} messages)",
        report.batches,
        percentile(&before, 0.5),
        before.last().unwrap(),
        before.len(),
        percentile(&during, 0.5),
        percentile(&during, 0.99),
        during.len(),
    );
    // The consumer kept going all along, and no message waited anywhere near the whole purge.
    assert!(
        during.len() as f64 >= purge_took.as_secs_f64() * 50.0,
        "only {} messages handled during a purge of {purge_took:?}",
        during.len()
    );
    assert!(
        max < purge_took / 10,
        "a message took {max:?} during a purge of {purge_took:?}"
    );
}
