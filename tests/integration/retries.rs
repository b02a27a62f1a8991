//! The loop naks a transient failure with the delay the policy gives, doubling per delivery:
//! seen from the redeliveries JetStream makes, not from the policy's own unit test.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use inventory_domain::{Message, Outcome};
use inventory_infra::{HandleError, MessageHandler};
use inventory_tests::broker::{Broker, RunningService, eventually};
use inventory_tests::{Backend, TestDb, placed};
use sea_orm::DbErr;

/// Fails every delivery transiently, noting when each came.
#[derive(Clone, Default)]
struct FailsAndNotes(Arc<Mutex<Vec<Instant>>>);

impl MessageHandler for FailsAndNotes {
    async fn handle(&self, _message: &Message) -> Result<Outcome, HandleError> {
        self.0.lock().unwrap().push(Instant::now());
        Err(HandleError::Database(DbErr::Custom("transient".into())))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_redelivery_of_a_failing_message_waits_twice_as_long_as_the_one_before() {
    const DELIVERIES: usize = 5;
    let db = TestDb::new(Backend::Postgres).await;
    let broker = Broker::new().await;
    broker
        .publisher()
        .publish(&placed(db.dune(10).await, 1))
        .await
        .unwrap();
    let mut settings = broker.settings(1, DELIVERIES as i64);
    settings.retry_delay = Duration::from_millis(300);
    settings.max_retry_delay = Duration::from_secs(60);
    let handler = FailsAndNotes::default();
    let service = RunningService::start(&broker, handler.clone(), db.conn.clone(), settings).await;
    eventually("every delivery made", || async {
        handler.0.lock().unwrap().len() == DELIVERIES
    })
    .await;
    service.stop().await;

    let deliveries = handler.0.lock().unwrap().clone();
    let gaps: Vec<Duration> = deliveries.windows(2).map(|w| w[1] - w[0]).collect();
    eprintln!("gaps between deliveries: {gaps:?}");
    // JetStream never redelivers a nak'ed message before its delay, so each gap is at least the
    // delay the loop sent: 300 ms, 600 ms, 1.2 s, 2.4 s if it doubles per delivery.
    for (n, gap) in gaps.iter().enumerate() {
        let doubled = Duration::from_millis(300) * 2u32.pow(u32::try_from(n).unwrap());
        assert!(
            *gap >= doubled,
            "redelivery {} came after {gap:?}, sooner than {doubled:?}: {gaps:?}",
            n + 2
        );
    }
}
