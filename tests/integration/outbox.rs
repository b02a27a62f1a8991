//! The outbox, as the handlers write it: one event per decision (reserved, rejected, each
//! reservation released), in the decision's transaction; none for a copy, a resend under a new
//! id, a second cancellation or a placement after the cancellation. Every handler a user can
//! choose: the ORM handler on SQLite and PostgreSQL, the one statement and the batch statement
//! on PostgreSQL. The random sequences of `differential.rs` compare the events with the
//! domain's model too.

use inventory_benches::consumers::{HandlerKind, NaturalKeyPath};
use inventory_benches::produce::Produce as _;
use inventory_domain::{Event, Message, OrderId, StockEvent, StockEventKind};
use inventory_infra::CrashPoint;
use inventory_infra::MessageHandler;
use inventory_tests::{Backend, TestDb, crash_at, placed, placed_for};
use sea_orm::{ConnectionTrait, Statement};
use serde_json::Value;

/// (subject kind, the message that caused it) of the events waiting, in write order.
async fn events(db: &TestDb) -> Vec<(StockEventKind, String)> {
    db.pending_events()
        .await
        .into_iter()
        .map(|event: StockEvent| (event.kind, event.caused_by))
        .collect()
}

fn key(message: &Message) -> String {
    message.key.storage_key().into_owned()
}

async fn one_event_per_decision(db: TestDb, path: NaturalKeyPath) {
    let kind = HandlerKind::NaturalKey(path);
    let handler = db.consumer(kind);
    let book = db.dune(3).await;
    let reserved = placed(book, 2);
    let rejected = placed(book, 2);
    let cancellation = reserved.cancellation();
    let cancelled_order = OrderId::new_v7();
    let cancelled_first = Message::cancelled(cancelled_order);
    let after_cancellation = placed_for(cancelled_order, book, 1);
    // Decisions, each followed by what must not decide again.
    let deliveries = [
        reserved.clone(),
        reserved.clone(),
        reserved.resent_with_new_id(),
        rejected.clone(),
        rejected.resent_with_new_id(),
        cancelled_first.clone(),
        after_cancellation,
        cancellation.clone(),
        cancellation.clone(),
        cancellation.resent_with_new_id(),
    ];
    if kind.takes_batches() {
        // Copies inside one batch too.
        for batch in deliveries.chunks(3) {
            for result in handler.handle_batch(batch).await {
                result.unwrap();
            }
        }
    } else {
        for message in &deliveries {
            handler.handle(message).await.unwrap();
        }
    }
    assert_eq!(
        events(&db).await,
        [
            (StockEventKind::Reserved, key(&reserved)),
            (StockEventKind::Rejected { available: 1 }, key(&rejected)),
            (StockEventKind::Released, key(&cancellation)),
        ]
    );
}

async fn orm_one_event_per_decision(db: TestDb) {
    one_event_per_decision(db, NaturalKeyPath::Orm).await;
}

inventory_tests::on_both_backends!(
    orm_one_event_per_decision,
    crash_before_commit_writes_no_event
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_statement_one_event_per_decision() {
    one_event_per_decision(
        TestDb::new(Backend::Postgres).await,
        NaturalKeyPath::OneStatement,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_statement_one_event_per_decision() {
    one_event_per_decision(TestDb::new(Backend::Postgres).await, NaturalKeyPath::Batch).await;
}

/// On PostgreSQL, an outbox row written by a transaction that does not hold its order's lock
/// (`lock_order`'s advisory lock) is refused. The relay's per-order order rests on every writer
/// of an event taking that lock; with this trigger, a writer that forgets it fails here.
const REQUIRE_THE_ORDERS_LOCK: &str = r"
CREATE FUNCTION outbox_written_under_the_orders_lock() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- lock_order takes pg_advisory_xact_lock(1869767794, uuid_hash(order_id)): in pg_locks,
    -- classid is the first key, objid the second (an int4 shown as an oid), objsubid 2.
    IF NOT EXISTS (
        SELECT 1 FROM pg_locks
        WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted
          AND classid = 1869767794 AND objid = uuid_hash(NEW.order_id)::oid AND objsubid = 2
    ) THEN
        RAISE EXCEPTION 'outbox row of order % written without the order''s lock', NEW.order_id;
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER outbox_written_under_the_orders_lock BEFORE INSERT ON outbox
    FOR EACH ROW EXECUTE FUNCTION outbox_written_under_the_orders_lock();
";

/// Every path that writes Inventory's events (the one statement, the batch statement, the ORM
/// transaction) writes each of them holding its order's lock: a reservation, a rejection, a
/// release, with copies, resends and a placement after its cancellation between them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_path_writes_its_events_holding_the_orders_lock() {
    for path in [
        NaturalKeyPath::OneStatement,
        NaturalKeyPath::Batch,
        NaturalKeyPath::Orm,
    ] {
        let db = TestDb::new(Backend::Postgres).await;
        db.conn
            .execute_unprepared(REQUIRE_THE_ORDERS_LOCK)
            .await
            .unwrap();
        one_event_per_decision(db, path).await;
    }
}

/// A crash inside the transaction rolls the event back with the decision; the redelivery
/// decides once and writes one.
async fn crash_before_commit_writes_no_event(db: TestDb) {
    let handler = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm));
    let book = db.dune(3).await;
    let message = placed(book, 1);
    crash_at(&message, CrashPoint::BeforeCommit, |faults| {
        handler.with_faults(faults)
    })
    .await;
    assert_eq!(events(&db).await, []);
    handler.handle(&message).await.unwrap();
    assert_eq!(
        events(&db).await,
        [(StockEventKind::Reserved, key(&message))]
    );
}

/// The outbox rows' bodies, raw as the relay publishes them: (subject, payload).
async fn payloads(db: &TestDb) -> Vec<(String, String)> {
    db.conn
        .query_all_raw(Statement::from_string(
            db.conn.get_database_backend(),
            "SELECT subject, payload FROM outbox ORDER BY seq",
        ))
        .await
        .unwrap()
        .iter()
        .map(|row| {
            (
                row.try_get("", "subject").unwrap(),
                row.try_get("", "payload").unwrap(),
            )
        })
        .collect()
}

/// The statements build the event's JSON themselves (`jsonb_build_object`); the ORM path and
/// the SQLite writer serialise `StockEvent::body`. Every kind a statement writes (the one
/// statement's reserved and rejected, the batch statement's reserved) is the body the domain
/// serialises for the same decision: the same fields and values, `occurred_at` the same instant
/// (PostgreSQL writes it with an offset, serde with `Z`). The event id and the time are the
/// statement's own, so they are taken from its row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_statements_write_the_domains_body_for_every_kind() {
    let db = TestDb::new(Backend::Postgres).await;
    let book = db.dune(3).await;
    let one = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::OneStatement));
    let batch = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Batch));
    let (reserved, rejected, batched) = (placed(book, 2), placed(book, 2), placed(book, 1));
    one.handle(&reserved).await.unwrap();
    one.handle(&rejected).await.unwrap();
    for result in batch.handle_batch(std::slice::from_ref(&batched)).await {
        result.unwrap();
    }
    let decisions = [
        (&reserved, StockEventKind::Reserved),
        (&rejected, StockEventKind::Rejected { available: 1 }),
        (&batched, StockEventKind::Reserved),
    ];
    let written = payloads(&db).await;
    assert_eq!(written.len(), decisions.len());
    for ((subject, payload), (message, kind)) in written.iter().zip(decisions) {
        let Event::Placed(placement) = &message.event else {
            unreachable!("placements only")
        };
        let row: Value = serde_json::from_str(payload).unwrap();
        let text = |field: &str| row[field].as_str().unwrap().to_owned();
        let expected = StockEvent {
            event_id: text("event_id").parse().unwrap(),
            kind,
            order_id: placement.order_id,
            book_id: placement.book_id,
            quantity: placement.quantity,
            occurred_at: chrono::DateTime::parse_from_rfc3339(&text("occurred_at"))
                .unwrap()
                .to_utc(),
            caused_by: key(message),
        };
        assert_eq!(subject, expected.subject_token());
        let mut domain: Value = serde_json::from_str(&expected.body()).unwrap();
        let mut sql = row.clone();
        let instant = |body: &mut Value| {
            let text = body["occurred_at"].take();
            chrono::DateTime::parse_from_rfc3339(text.as_str().unwrap()).unwrap()
        };
        assert_eq!(instant(&mut sql), instant(&mut domain), "{payload}");
        assert_eq!(
            sql, domain,
            "{subject}: the statement's body is not the domain's"
        );
    }
}
