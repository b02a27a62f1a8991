//! Every injectable crash point of every strategy, through the real consumer loop on real NATS
//! and PostgreSQL: the handler dies at the point (nothing acked), JetStream redelivers after the
//! ack wait, and the final state is the strategy's promise. The natural key and the inbox come
//! out exact; naive and check-then-process reserve twice where their documented window is
//! (a crash after the commit); the email goes out at most once: with a provider lookup exactly
//! once, without one the redelivery is a needs-reconciliation dead letter, never a blind resend.
//!
//! The handler-level versions of these (no broker) are in `natural.rs`, `inbox.rs`, `naive.rs`
//! and `email.rs`; here the redelivery is JetStream's own.

use inventory_benches::faults;
use inventory_benches::mail::InMemoryEmailProvider;
use inventory_benches::mistakes::Strategy;
use inventory_benches::produce::Produce as _;
use inventory_benches::readback::Readback as _;
use std::sync::{Arc, Mutex};

use inventory_benches::consumers::{
    DetectMode, EMAIL_CONSUMER, EmailConsumer, HandlerKind, NaturalKeyPath,
};
use inventory_domain::{
    BookId, ConsumerName, Event, EventKind, Message, Outcome, ReservationStatus,
};
use inventory_infra::CrashPoint;
use inventory_infra::jetstream::dlq_headers;
use inventory_infra::{HandleError, MessageHandler};
use inventory_service::consumer::RuntimeSettings;
use inventory_service::metrics::ConsumerMetrics;
use inventory_tests::broker::{Broker, RunningService, eventually};
use inventory_tests::{Backend, TestDb, placed, stock_reserved, workload};

const STOCK_POINTS: [CrashPoint; 3] = [
    CrashPoint::AfterDedupCheck,
    CrashPoint::BeforeCommit,
    CrashPoint::AfterCommit,
];

/// What one run ended with.
struct Run {
    book: BookId,
    order: inventory_domain::OrderId,
    stats: ConsumerMetrics,
    dead_letter_reasons: Vec<String>,
}

/// One order through the loop with `handler`, which dies once at its planned point: an
/// OrderPlaced for a stock consumer, for the email notifier Inventory's StockReserved.
async fn crash_and_redeliver<H: MessageHandler>(
    db: &TestDb,
    make_handler: impl FnOnce() -> H,
    email: bool,
) -> Run {
    let broker = Broker::new().await;
    let book = db.dune(10).await;
    let (message, settings) = if email {
        let message = stock_reserved(book, 2);
        (message, broker.email_settings(2, 5))
    } else {
        (placed(book, 2), broker.settings(2, 5))
    };
    let (stats, dead_letter_reasons) = crash_in_loop(
        &broker,
        db,
        make_handler(),
        settings,
        std::slice::from_ref(&message),
    )
    .await;
    assert_eq!(stats.left_for_redelivery(), 1, "the handler crashed once");
    Run {
        book,
        order: message.event.order_id(),
        stats,
        dead_letter_reasons,
    }
}

/// Publishes `messages`, runs `handler` on them in the loop until each has ended (after the
/// redeliveries its crash causes) and nothing is left on the consumer; returns the loop's
/// counts and the dead letters' reasons.
async fn crash_in_loop<H: MessageHandler>(
    broker: &Broker,
    db: &TestDb,
    handler: H,
    settings: RuntimeSettings,
    messages: &[Message],
) -> (ConsumerMetrics, Vec<String>) {
    for message in messages {
        match &message.event {
            Event::StockReserved(_) => {
                let event = workload::reserved_event(message);
                broker.publisher().publish_event(&event).await.unwrap();
            }
            _ => {
                broker.publisher().publish(message).await.unwrap();
            }
        }
    }
    let service = RunningService::start(broker, handler, db.conn.clone(), settings).await;
    let stats = service.metrics.clone();
    let published = messages.len() as u64;
    eventually("every message ended, redeliveries included", || async {
        stats.acked() + stats.duplicates() + stats.dead_lettered() == published
    })
    .await;
    broker.settled().await;
    service.stop().await;
    let dead_letter_reasons = broker
        .dead_letters()
        .await
        .iter()
        .map(|letter| letter.header(dlq_headers::REASON).unwrap_or("").to_owned())
        .collect();
    (stats, dead_letter_reasons)
}

/// Runs every point of `strategy` at once and checks each against `expected(point)`: the
/// copies reserved and whether the redelivery was a duplicate.
async fn stock_strategy(
    strategy: impl Into<Strategy>,
    expected: impl Fn(CrashPoint) -> (i64, bool),
) {
    let strategy = strategy.into();
    let db = TestDb::new(Backend::Postgres).await;
    let consumer = db.study_consumer(strategy);
    let runs = futures::future::join_all(STOCK_POINTS.map(|point| {
        let consumer = consumer.clone();
        let db = &db;
        async move {
            let run = crash_and_redeliver(
                db,
                || consumer.with_faults(faults::crash_once_at(point)),
                false,
            )
            .await;
            (point, run)
        }
    }))
    .await;
    for (point, run) in runs {
        let (copies, duplicate) = expected(point);
        let context = format!("{} crashed {}", strategy.label(), point.as_str());
        assert_eq!(db.reserved(run.book).await, copies, "{context}");
        assert_eq!(
            run.stats.duplicates(),
            u64::from(duplicate),
            "{context}: the redelivery's outcome"
        );
        assert!(run.dead_letter_reasons.is_empty(), "{context}");
        if strategy == HandlerKind::NaturalKey(NaturalKeyPath::Orm).into() {
            let row = db.stock.reservation(run.order, run.book).await.unwrap();
            assert_eq!(row.map(|row| row.quantity.get()), Some(2), "{context}");
        } else {
            // One log row per reservation made: the over-reservation is visible row by row.
            let rows = db.stock.logged_reservations(run.order).await.unwrap();
            assert_eq!(rows.len() as i64, copies / 2, "{context}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn natural_key_crash_at_every_point_is_redelivered_and_reserves_once() {
    stock_strategy(HandlerKind::NaturalKey(NaturalKeyPath::Orm), |point| {
        (2, point == CrashPoint::AfterCommit)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_crash_at_every_point_in_every_mode_is_redelivered_and_reserves_once() {
    for mode in DetectMode::ALL {
        stock_strategy(HandlerKind::Inbox(mode), |point| {
            (2, point == CrashPoint::AfterCommit)
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn naive_crash_after_commit_is_redelivered_and_reserves_twice() {
    // The documented over-reservation: the redelivery reserves again.
    stock_strategy(Strategy::Naive, |point| {
        (
            if point == CrashPoint::AfterCommit {
                4
            } else {
                2
            },
            false,
        )
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_then_process_crash_after_commit_is_redelivered_and_reserves_twice() {
    // The window between the work's commit and the inbox record.
    stock_strategy(Strategy::CheckThenProcess, |point| {
        (
            if point == CrashPoint::AfterCommit {
                4
            } else {
                2
            },
            false,
        )
    })
    .await;
}

/// A handler that keeps each delivery's outcome, so a test can say what the redelivery did.
#[derive(Clone)]
struct Recorded<H> {
    inner: H,
    outcomes: Arc<Mutex<Vec<&'static str>>>,
}

impl<H: MessageHandler> MessageHandler for Recorded<H> {
    async fn handle(&self, message: &Message) -> Result<Outcome, HandleError> {
        let result = self.inner.handle(message).await;
        if let Ok(outcome) = &result {
            self.outcomes.lock().unwrap().push(outcome.label());
        }
        result
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn email_crash_at_every_point_is_redelivered_and_mails_once() {
    let db = TestDb::new(Backend::Postgres).await;
    let name = ConsumerName::parse(EMAIL_CONSUMER).unwrap();
    let cases = [
        (CrashPoint::AfterDedupCheck, true),
        (CrashPoint::AfterSend, true),
        (CrashPoint::AfterDedupCheck, false),
        (CrashPoint::AfterSend, false),
    ];
    let runs = futures::future::join_all(cases.map(|(point, lookup)| {
        let db = &db;
        let name = name.clone();
        async move {
            let provider = if lookup {
                InMemoryEmailProvider::with_lookup()
            } else {
                InMemoryEmailProvider::without_lookup()
            };
            let outcomes = Arc::default();
            let run = crash_and_redeliver(
                db,
                || Recorded {
                    inner: EmailConsumer::new(db.conn.clone(), name, provider.clone())
                        .with_faults(faults::crash_once_at(point)),
                    outcomes: Arc::clone(&outcomes),
                },
                true,
            )
            .await;
            let outcomes = outcomes.lock().unwrap().clone();
            let sent = (provider.sent_count(), provider.send_calls());
            (point, lookup, sent, outcomes, run)
        }
    }))
    .await;
    for (point, lookup, sent, outcomes, run) in runs {
        let context = format!("email (lookup: {lookup}) crashed {}", point.as_str());
        // With a lookup the redelivery finds out: after a crash before the send it sends, after
        // one after the send it completes the record without sending again. Without one it
        // cannot tell a crash before the send from one after it, so it never sends blind: a
        // needs-reconciliation dead letter for an operator, and at most one email. The provider
        // drops a repeat under a delivered key, so the calls to `send` are what is counted.
        let (expected_calls, redelivery, expected_letters): (usize, &str, &[&str]) =
            match (lookup, point) {
                (true, CrashPoint::AfterSend) => (1, "reconciled", &[]),
                (true, _) => (1, "processed", &[]),
                (false, CrashPoint::AfterSend) => {
                    (1, "needs-reconciliation", &["needs-reconciliation"])
                }
                (false, _) => (0, "needs-reconciliation", &["needs-reconciliation"]),
            };
        assert_eq!(
            sent,
            (expected_calls, expected_calls),
            "{context}: emails delivered, send calls"
        );
        assert_eq!(
            outcomes,
            [redelivery],
            "{context}: the redelivery's outcome"
        );
        assert_eq!(run.dead_letter_reasons, expected_letters, "{context}");
    }
}

/// The points the natural key's default path passes: a placement the statement's two, a
/// cancellation the other two and `AfterCommit`.
const STATEMENT_PATH_POINTS: [CrashPoint; 4] = [
    CrashPoint::BeforeStatement,
    CrashPoint::AfterDedupCheck,
    CrashPoint::BeforeCommit,
    CrashPoint::AfterCommit,
];

/// A handler that keeps the kind of each message it crashed on. The placement's statement and
/// the cancellation's both pass `AfterCommit`, so a crash counted there says
/// nothing of which passed it: a statement path that skipped the point would go unseen.
#[derive(Clone)]
struct CrashedOn<H> {
    inner: H,
    kinds: Arc<Mutex<Vec<EventKind>>>,
}

impl<H> CrashedOn<H> {
    fn note(&self, message: &Message, result: &Result<Outcome, HandleError>) {
        if matches!(result, Err(HandleError::Crashed(_))) {
            self.kinds.lock().unwrap().push(message.event.kind());
        }
    }
}

impl<H: MessageHandler> MessageHandler for CrashedOn<H> {
    async fn handle(&self, message: &Message) -> Result<Outcome, HandleError> {
        let result = self.inner.handle(message).await;
        self.note(message, &result);
        result
    }

    async fn handle_batch(&self, messages: &[Message]) -> Vec<Result<Outcome, HandleError>> {
        let results = self.inner.handle_batch(messages).await;
        for (message, result) in messages.iter().zip(&results) {
            self.note(message, result);
        }
        results
    }
}

/// `kind` on `backend` (the fast path, or its batch path with lanes handing over up to 16
/// messages) dies once at each point in turn, inside the loop, on a stream of two orders and
/// the cancellation of one of them. One lane keeps the stream's order, so a placement reaches
/// the statement's points first and only the cancellation reaches the other two.
async fn statement_path_crashes(backend: Backend, kind: HandlerKind) {
    let db = TestDb::new(backend).await;
    let handler = db.consumer(kind);
    let runs = futures::future::join_all(STATEMENT_PATH_POINTS.map(|point| {
        let kinds = Arc::default();
        let handler = CrashedOn {
            inner: handler.with_faults(faults::crash_once_at(point)),
            kinds: Arc::clone(&kinds),
        };
        let db = &db;
        async move {
            let broker = Broker::new().await;
            let book = db.dune(10).await;
            let kept = placed(book, 3);
            let withdrawn = placed(book, 2);
            let cancellation = Message::cancelled(withdrawn.event.order_id());
            let mut settings = broker.settings(1, 5);
            if kind.takes_batches() {
                settings.batch_size = 16;
            }
            let (stats, letters) = crash_in_loop(
                &broker,
                db,
                handler,
                settings,
                &[withdrawn.clone(), kept.clone(), cancellation],
            )
            .await;
            let kinds = kinds.lock().unwrap().clone();
            (point, book, kept, withdrawn, stats, letters, kinds)
        }
    }))
    .await;
    for (point, book, kept, withdrawn, stats, letters, kinds) in runs {
        let context = format!("{} on {backend:?} crashed {}", kind.label(), point.as_str());
        let crashed = stats.left_for_redelivery();
        // A crash in the batch statement loses the whole batch: every placement in it.
        assert!(crashed >= 1, "{context}: the point was reached");
        // One lane in the stream's order: a placement reaches the statement's points first.
        let crashed_on = match point {
            CrashPoint::BeforeStatement | CrashPoint::AfterCommit => EventKind::Placed,
            _ => EventKind::Cancelled,
        };
        assert!(
            !kinds.is_empty() && kinds.iter().all(|kind| *kind == crashed_on),
            "{context}: crashed on {kinds:?}, not only on {crashed_on:?}"
        );
        if kind == HandlerKind::NaturalKey(NaturalKeyPath::OneStatement)
            || matches!(
                point,
                CrashPoint::AfterDedupCheck | CrashPoint::BeforeCommit
            )
        {
            assert_eq!(crashed, 1, "{context}: one message crashed");
        }
        // Redelivered after the commit, each crashed message finds its own work done.
        let duplicates = if point == CrashPoint::AfterCommit {
            crashed
        } else {
            0
        };
        assert_eq!(
            stats.duplicates(),
            duplicates,
            "{context}: the redeliveries' outcome"
        );
        assert!(letters.is_empty(), "{context}: {letters:?}");
        assert_eq!(db.reserved(book).await, 3, "{context}: only the kept order");
        for (order, status) in [
            (&kept, ReservationStatus::Reserved),
            (&withdrawn, ReservationStatus::Released),
        ] {
            let row = db
                .stock
                .reservation(order.event.order_id(), book)
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("{context}: no reservation row"));
            assert_eq!(row.status, status, "{context}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_statement_crash_at_every_point_is_redelivered_and_reserves_once() {
    statement_path_crashes(
        Backend::Postgres,
        HandlerKind::NaturalKey(NaturalKeyPath::OneStatement),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_statement_crash_at_every_point_is_redelivered_and_reserves_once() {
    statement_path_crashes(
        Backend::Postgres,
        HandlerKind::NaturalKey(NaturalKeyPath::Batch),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_writer_crash_at_every_point_is_redelivered_and_reserves_once() {
    statement_path_crashes(
        Backend::Sqlite,
        HandlerKind::NaturalKey(NaturalKeyPath::OneStatement),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_writer_batch_crash_at_every_point_is_redelivered_and_reserves_once() {
    statement_path_crashes(
        Backend::Sqlite,
        HandlerKind::NaturalKey(NaturalKeyPath::Batch),
    )
    .await;
}
