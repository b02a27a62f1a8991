//! The one-statement natural key on PostgreSQL keeps the reference handler's promises.

use inventory_benches::consumers::{Handler, HandlerKind, NaturalKeyPath};
use inventory_benches::faults;
use inventory_benches::produce::Produce as _;
use inventory_benches::readback::Readback as _;
use inventory_domain::Message;
use inventory_domain::{
    BookId, DeadLetterReason, Effect, OrderId, Outcome, ReservationStatus, StockItem,
};
use inventory_infra::CrashPoint;
use inventory_infra::MessageHandler;
use inventory_tests::{Backend, TestDb, crash_at, placed, placed_for};
use sea_orm::{ConnectionTrait, DatabaseTransaction, DbBackend, Statement, TransactionTrait};

async fn fixture() -> (TestDb, Handler) {
    let db = TestDb::new(Backend::Postgres).await;
    let handler = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::OneStatement));
    (db, handler)
}

fn reason(outcome: &Outcome) -> Option<DeadLetterReason> {
    match outcome {
        Outcome::Refused(refusal) => Some(refusal.reason),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_statement_refuses_redelivery_new_ids_and_other_quantities() {
    let (db, handler) = fixture().await;
    let book = db.dune(10).await;
    let message = placed(book, 2);
    assert!(handler.handle(&message).await.unwrap().processed());
    assert_eq!(handler.handle(&message).await.unwrap(), Outcome::Duplicate);
    assert_eq!(
        handler.handle(&message.resent_with_new_id()).await.unwrap(),
        Outcome::Duplicate
    );
    let other = placed_for(message.event.order_id(), book, 3);
    assert_eq!(
        reason(&handler.handle(&other).await.unwrap()),
        Some(DeadLetterReason::ConflictingReservation)
    );
    assert_eq!(db.reserved(book).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_statement_keeps_a_rejection_and_refuses_an_unknown_book() {
    let (db, handler) = fixture().await;
    let book = db.dune(1).await;
    let message = placed(book, 2);
    assert!(matches!(
        handler.handle(&message).await.unwrap(),
        Outcome::Processed(Effect::Rejected { available: 1, .. })
    ));
    db.stock
        .put(&StockItem::new(book, "Dune", 10).unwrap())
        .await
        .unwrap();
    assert_eq!(handler.handle(&message).await.unwrap(), Outcome::Duplicate);
    assert_eq!(db.reserved(book).await, 0);
    let order = message.event.order_id();
    let status = db
        .stock
        .reservation(order, book)
        .await
        .unwrap()
        .unwrap()
        .status;
    assert_eq!(status, ReservationStatus::Rejected);

    let stranger = placed(BookId::new_v7(), 1);
    assert_eq!(
        reason(&handler.handle(&stranger).await.unwrap()),
        Some(DeadLetterReason::UnknownBook)
    );
    let nothing = db
        .stock
        .reservation(stranger.event.order_id(), BookId::new_v7())
        .await
        .unwrap();
    assert_eq!(nothing, None);
}

/// Row versions and lockers of what a placement touches: any write or row lock changes them.
async fn row_versions(db: &TestDb, message: &inventory_domain::Message) -> Vec<String> {
    use sea_orm::{ConnectionTrait, DbBackend, Statement};
    let order = message.event.order_id().as_uuid();
    let sql = format!(
        "SELECT (SELECT xmin || '/' || xmax FROM stock_items) || ' ' || \
                coalesce((SELECT xmin || '/' || xmax FROM order_states WHERE order_id = '{order}'), 'none') || ' ' || \
                (SELECT xmin || '/' || xmax FROM stock_reservations WHERE order_id = '{order}')"
    );
    let row = db
        .conn
        .query_one_raw(Statement::from_string(DbBackend::Postgres, sql))
        .await
        .unwrap()
        .unwrap();
    let versions: String = row.try_get_by_index(0).unwrap();
    versions.split(' ').map(str::to_owned).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_of_a_decided_placement_writes_and_locks_nothing() {
    let (db, handler) = fixture().await;
    let book = db.dune(10).await;
    let message = placed(book, 2);
    assert!(handler.handle(&message).await.unwrap().processed());
    let before = row_versions(&db, &message).await;
    assert_eq!(handler.handle(&message).await.unwrap(), Outcome::Duplicate);
    assert_eq!(
        handler.handle(&message.resent_with_new_id()).await.unwrap(),
        Outcome::Duplicate
    );
    let after = row_versions(&db, &message).await;
    assert_eq!(before, after, "rows written or locked");
    assert_eq!(db.reserved(book).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_statement_lets_a_cancellation_that_came_first_win() {
    let (db, handler) = fixture().await;
    let book = db.dune(10).await;
    let message = placed(book, 2);
    let order = message.event.order_id();
    handler.handle(&Message::cancelled(order)).await.unwrap();
    assert_eq!(
        handler.handle(&message).await.unwrap(),
        Outcome::Processed(Effect::ArrivedAfterCancellation)
    );
    assert_eq!(db.reserved(book).await, 0);
}

/// A transaction of the test's own holding a lock, so that handlers started meanwhile are
/// all seen waiting inside their statements at once before any of them goes on.
async fn hold(db: &TestDb, sql: &str, id: uuid::Uuid) -> DatabaseTransaction {
    let blocker = db.conn.begin().await.unwrap();
    blocker
        .execute_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            sql,
            [id.into()],
        ))
        .await
        .unwrap();
    blocker
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_lanes_with_copies_of_one_order_reserve_it_once() {
    let (db, handler) = fixture().await;
    let book = db.dune(1_000).await;
    let message = placed(book, 2);
    // Every copy reads "no reservation yet", then queues on the stock row held here: twelve
    // statements in flight together, proof that they race rather than run one after another.
    let blocker = hold(
        &db,
        "SELECT 1 FROM stock_items WHERE book_id = $1 FOR UPDATE",
        book.as_uuid(),
    )
    .await;
    let copies: Vec<_> = (0..12)
        .map(|i| {
            let lane = handler.clone();
            let copy = if i % 2 == 0 {
                message.clone()
            } else {
                message.resent_with_new_id()
            };
            tokio::spawn(async move { lane.handle(&copy).await })
        })
        .collect();
    db.wait_for_lock_waiters(12).await;
    blocker.rollback().await.unwrap();
    let mut processed = 0;
    for copy in copies {
        let outcome = copy.await.unwrap().unwrap();
        processed += usize::from(outcome.processed());
        assert!(outcome.processed() || outcome == Outcome::Duplicate);
    }
    assert_eq!(processed, 1);
    assert_eq!(db.reserved(book).await, 2);
}

/// Copies of one order are kept apart by the reservation key whatever the stock row's lock
/// does; different orders for the same book are kept apart only by that lock. Twelve orders
/// of 2 for 10 copies, all seen waiting on the stock row at once: five reserved, seven
/// rejected, never more reserved than on hand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_lanes_with_different_orders_never_reserve_past_the_stock() {
    let (db, handler) = fixture().await;
    let book = db.dune(10).await;
    let blocker = hold(
        &db,
        "SELECT 1 FROM stock_items WHERE book_id = $1 FOR UPDATE",
        book.as_uuid(),
    )
    .await;
    let orders: Vec<_> = (0..12)
        .map(|_| {
            let lane = handler.clone();
            let order = placed(book, 2);
            tokio::spawn(async move { lane.handle(&order).await })
        })
        .collect();
    db.wait_for_lock_waiters(12).await;
    blocker.rollback().await.unwrap();
    let (mut reserved, mut rejected) = (0, 0);
    for order in orders {
        match order.await.unwrap().unwrap() {
            Outcome::Processed(Effect::Reserved { .. }) => reserved += 1,
            Outcome::Processed(Effect::Rejected { .. }) => rejected += 1,
            other => panic!("neither reserved nor rejected: {other:?}"),
        }
    }
    assert_eq!((reserved, rejected), (5, 7), "orders reserved, rejected");
    assert_eq!(db.reserved(book).await, 10);
}

/// Placements racing their cancellations for the order's lock, `rounds` times: the
/// cancellation wins each race, whichever was started first.
async fn cancellations_race_their_placements(db: &TestDb, handler: &Handler, rounds: usize) {
    let book = db.dune(10_000).await;
    for round in 0..rounds {
        let order = OrderId::new_v7();
        let place = placed_for(order, book, 3);
        let cancel = Message::cancelled(order);
        let (a, b) = (handler.clone(), handler.clone());
        // Both take the order's lock, held here until both are seen waiting for it: then they
        // race for it, whichever was started first.
        let blocker = hold(db, "SELECT lock_order($1)", order.as_uuid()).await;
        let (placed, cancelled) = if round % 2 == 0 {
            let place = tokio::spawn(async move { a.handle(&place).await });
            let cancel = tokio::spawn(async move { b.handle(&cancel).await });
            db.wait_for_lock_waiters(2).await;
            blocker.rollback().await.unwrap();
            (place.await.unwrap(), cancel.await.unwrap())
        } else {
            let cancel = tokio::spawn(async move { b.handle(&cancel).await });
            let place = tokio::spawn(async move { a.handle(&place).await });
            db.wait_for_lock_waiters(2).await;
            blocker.rollback().await.unwrap();
            (place.await.unwrap(), cancel.await.unwrap())
        };
        placed.unwrap();
        cancelled.unwrap();
        let status = db
            .stock
            .reservation(order, book)
            .await
            .unwrap()
            .unwrap()
            .status;
        assert_eq!(status, ReservationStatus::Released, "round {round}");
    }
    assert_eq!(db.reserved(book).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancellation_racing_its_placement_always_wins() {
    let (db, handler) = fixture().await;
    cancellations_race_their_placements(&db, &handler, 30).await;
}

/// A placement of the order on a lower book commits after the cancellation read the books to
/// lock and before it took the order's lock: the cancellation starts over, locking that book
/// too, before the order's. Without the new start it would hold only the higher book while it
/// releases the lower one, and deadlock with a transaction that locks both in book order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancellation_starts_over_when_its_order_gained_a_book_meanwhile() {
    let (db, handler) = fixture().await;
    let (first, second) = (db.dune(10).await, db.dune(10).await);
    let (low, high) = (first.min(second), first.max(second));
    let order = OrderId::new_v7();
    assert!(
        handler
            .handle(&placed_for(order, high, 2))
            .await
            .unwrap()
            .processed()
    );

    let blocker = hold(&db, "SELECT lock_order($1)", order.as_uuid()).await;
    let (faults, mut at_release) = faults::hold_once_at(CrashPoint::AfterDedupCheck);
    let cancel = tokio::spawn({
        let handler = handler.with_faults(faults);
        async move { handler.handle(&Message::cancelled(order)).await }
    });
    db.wait_for_lock_waiter().await;
    // What a placement of the order on the lower book commits, under the order's lock.
    for sql in [
        "UPDATE stock_items SET reserved = reserved + 1 WHERE book_id = $2",
        "INSERT INTO stock_reservations \
             (order_id, book_id, quantity, status, message_id, created_at) \
         VALUES ($1, $2, 1, 'reserved', 'meanwhile', now())",
    ] {
        blocker
            .execute_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                sql,
                [order.as_uuid().into(), low.as_uuid().into()],
            ))
            .await
            .unwrap();
    }
    blocker.commit().await.unwrap();
    at_release.reached().await;

    let both_books = db.conn.begin().await.unwrap();
    let locking = tokio::spawn(async move {
        both_books
            .execute_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "SELECT 1 FROM stock_items WHERE book_id IN ($1, $2) ORDER BY book_id FOR UPDATE",
                [low.as_uuid().into(), high.as_uuid().into()],
            ))
            .await?;
        both_books.commit().await
    });
    db.wait_for_lock_waiter().await;
    at_release.release();
    assert_eq!(
        cancel.await.unwrap().unwrap(),
        Outcome::Processed(Effect::Released { copies: 3 })
    );
    locking.await.unwrap().unwrap();
    assert_eq!((db.reserved(low).await, db.reserved(high).await), (0, 0));
}

/// The statement is written for READ COMMITTED: under REPEATABLE READ a placement reads the
/// order's state from the snapshot its transaction began with, so it misses a cancellation that
/// committed while it waited for the order's lock, and reserves a cancelled order. The
/// service's connections ask for READ COMMITTED whatever the database's default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placements_run_at_read_committed_whatever_the_database_default() {
    let db = TestDb::new(Backend::Postgres).await;
    let name = db
        .url
        .rsplit('/')
        .next()
        .unwrap()
        .split('?')
        .next()
        .unwrap();
    db.conn
        .execute_unprepared(&format!(
            "ALTER DATABASE \"{name}\" SET default_transaction_isolation = 'repeatable read'"
        ))
        .await
        .unwrap();
    let conn = inventory_benches::db::connect(&db.url, 4).await.unwrap();
    let level = conn
        .query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            "SHOW transaction_isolation",
        ))
        .await
        .unwrap()
        .unwrap()
        .try_get_by_index::<String>(0)
        .unwrap();
    assert_eq!(level, "read committed");
    let handler = HandlerKind::NaturalKey(NaturalKeyPath::OneStatement)
        .build(
            &conn,
            inventory_domain::ConsumerName::parse("inventory-reserve-stock-test").unwrap(),
            None,
        )
        .unwrap();
    cancellations_race_their_placements(&db, &handler, 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_statement_is_a_duplicate_on_redelivery() {
    let (db, handler) = fixture().await;
    let book = db.dune(10).await;
    let message = placed(book, 2);
    crash_at(&message, CrashPoint::AfterCommit, |faults| {
        handler.with_faults(faults)
    })
    .await;
    assert_eq!(handler.handle(&message).await.unwrap(), Outcome::Duplicate);
    assert_eq!(db.reserved(book).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_decides_each_message_as_one_by_one_handling_would() {
    let (db, handler) = fixture().await;
    let plenty = db.dune(1_000).await;
    let short = db.dune(4).await;
    let earlier = placed(plenty, 2);
    handler.handle(&earlier).await.unwrap();
    let cancelled_first = placed(plenty, 1);
    handler
        .handle(&Message::cancelled(cancelled_first.event.order_id()))
        .await
        .unwrap();

    let fresh = placed(plenty, 3);
    let short_a = placed(short, 3);
    let short_b = placed(short, 3);
    let batch = vec![
        fresh.clone(),
        earlier.resent_with_new_id(), // already reserved
        fresh.resent_with_new_id(),   // a copy inside the batch
        placed_for(fresh.event.order_id(), plenty, 5), // the same key, another quantity
        placed(BookId::new_v7(), 1),  // unknown book
        cancelled_first.clone(),      // its cancellation came first
        short_a.clone(),              // 3 of 4: fits
        short_b.clone(),              // 3 more: rejected, as one by one
        Message::cancelled(fresh.event.order_id()), // releases the fresh order
    ];
    let results: Vec<Outcome> = handler
        .handle_batch(&batch)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert!(matches!(
        results[0],
        Outcome::Processed(Effect::Reserved { .. })
    ));
    assert_eq!(results[1], Outcome::Duplicate);
    assert_eq!(results[2], Outcome::Duplicate);
    assert_eq!(
        reason(&results[3]),
        Some(DeadLetterReason::ConflictingReservation)
    );
    assert_eq!(reason(&results[4]), Some(DeadLetterReason::UnknownBook));
    assert_eq!(
        results[5],
        Outcome::Processed(Effect::ArrivedAfterCancellation)
    );
    assert!(matches!(
        results[6],
        Outcome::Processed(Effect::Reserved { .. })
    ));
    assert!(matches!(
        results[7],
        Outcome::Processed(Effect::Rejected { available: 1, .. })
    ));
    assert_eq!(
        results[8],
        Outcome::Processed(Effect::Released { copies: 3 })
    );
    assert_eq!(db.reserved(plenty).await, 2);
    assert_eq!(db.reserved(short).await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batching_lanes_with_every_kind_of_duplicate_reserve_exactly_once() {
    use inventory_tests::broker::{Broker, RunningService, eventually};

    let (db, handler) = batch_fixture().await;
    let book = db.dune(1_000_000).await;
    let broker = Broker::new().await;
    let publisher = broker.publisher();
    let mut expected = 0;
    for i in 0..400 {
        let order = placed(book, 1 + i % 3);
        expected += 1 + i % 3;
        publisher.publish(&order).await.unwrap();
        if i % 10 == 0 {
            publisher
                .publish(&order.resent_with_new_id())
                .await
                .unwrap();
        }
        if i % 7 == 0 {
            // The same body again under another Nats-Msg-Id: a broker-side replay.
            broker
                .publish_raw(
                    "placed",
                    order.to_plain_json().unwrap(),
                    Some(&format!("replay-{i}")),
                )
                .await;
        }
    }
    let mut settings = broker.settings(4, 10);
    settings.batch_size = 16;
    let service = RunningService::start(&broker, handler.clone(), db.conn.clone(), settings).await;
    eventually("every order reserved once", || async {
        db.reserved(book).await == expected
    })
    .await;
    broker.settled().await;
    assert_eq!(service.metrics.acked(), 400);
    // 40 resends under new ids and 58 replays; more only if one outwaited the 1 s ack wait.
    assert!(service.metrics.duplicates() >= 40 + 58);
    assert_eq!(service.metrics.dead_lettered(), 0);
    assert!(handler.seen().1 > 1, "no batch of more than one message");
    service.stop().await;
    assert_eq!(db.reserved(book).await, expected);
}

/// The plan a lane's prepared statement may keep: generic, made on an empty table. It must probe
/// stock_reservations by its key, not scan it, or every batch reads the whole table as it grows;
/// so must the second look for a copy committed while the statement waited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_probe_reservations_by_key_even_in_a_generic_plan_of_an_empty_table() {
    use inventory_infra::consumers::natural_pg::{EXISTING_SQL, RESERVE_SQL};
    use sea_orm::{ConnectionTrait, DbBackend, Statement, TransactionTrait};

    let db = TestDb::new(Backend::Postgres).await;
    let txn = db.conn.begin().await.unwrap();
    let plan = async |types: &str, sql: &str, arguments: &str| {
        let name = format!("probe_{}", types.len());
        for statement in [
            "SET LOCAL plan_cache_mode = force_generic_plan".to_owned(),
            format!("PREPARE {name} ({types}) AS {sql}"),
        ] {
            txn.execute_unprepared(&statement).await.unwrap();
        }
        let rows = txn
            .query_all_raw(Statement::from_string(
                DbBackend::Postgres,
                format!("EXPLAIN EXECUTE {name} ({arguments})"),
            ))
            .await
            .unwrap();
        rows.iter()
            .map(|row| row.try_get_by_index::<String>(0).unwrap())
            .collect::<Vec<_>>()
            .join("\n")
    };
    let reserve = plan(
        "uuid[], uuid[], int4[], text[], int4[], uuid[], int2[], int2[]",
        RESERVE_SQL,
        "ARRAY[gen_random_uuid()], ARRAY[gen_random_uuid()], ARRAY[1], ARRAY['m'], ARRAY[0], \
         ARRAY[gen_random_uuid()], ARRAY[0::int2], ARRAY[NULL::int2]",
    )
    .await;
    let existing = plan(
        "uuid, uuid",
        EXISTING_SQL,
        "gen_random_uuid(), gen_random_uuid()",
    )
    .await;
    for (statement, plan) in [("RESERVE_SQL", reserve), ("EXISTING_SQL", existing)] {
        assert!(
            !plan.contains("Seq Scan on stock_reservations"),
            "{statement} scans stock_reservations:\n{plan}"
        );
        // By the whole key, through either index that holds it (the key's own, or the move's
        // by book then order): never one column of it, then a filter over a hot book's rows.
        let lines: Vec<&str> = plan.lines().collect();
        let probes: Vec<&str> = lines
            .windows(2)
            .filter(|pair| {
                pair[0].contains("Index Scan using") && pair[0].contains("on stock_reservations")
            })
            .map(|pair| pair[1])
            .collect();
        assert!(
            !probes.is_empty()
                && probes.iter().all(|cond| {
                    cond.contains("Index Cond")
                        && cond.contains("order_id =")
                        && cond.contains("book_id =")
                }),
            "{statement} never probes stock_reservations by key:\n{plan}"
        );
    }
    txn.rollback().await.unwrap();
}

/// The batch handler, noting which orders it was handed and the largest batch, so a test can
/// wait until every message met a failure and see that batches were formed.
#[derive(Clone)]
struct Seen {
    inner: Handler,
    orders: std::sync::Arc<std::sync::Mutex<(std::collections::HashSet<OrderId>, usize)>>,
}

impl Seen {
    fn new(inner: Handler) -> Self {
        Self {
            inner,
            orders: Default::default(),
        }
    }

    fn seen(&self) -> (usize, usize) {
        let orders = self.orders.lock().unwrap();
        (orders.0.len(), orders.1)
    }
}

impl MessageHandler for Seen {
    async fn handle(&self, message: &Message) -> Result<Outcome, inventory_infra::HandleError> {
        self.handle_batch(std::slice::from_ref(message))
            .await
            .pop()
            .unwrap()
    }

    async fn handle_batch(
        &self,
        messages: &[Message],
    ) -> Vec<Result<Outcome, inventory_infra::HandleError>> {
        {
            let mut orders = self.orders.lock().unwrap();
            orders.0.extend(messages.iter().map(|m| m.event.order_id()));
            orders.1 = orders.1.max(messages.len());
        }
        self.inner.handle_batch(messages).await
    }
}

async fn batch_fixture() -> (TestDb, Seen) {
    let db = TestDb::new(Backend::Postgres).await;
    let handler = Seen::new(db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Batch)));
    (db, handler)
}

/// The broker's settings with lanes handing batches of up to `batch_size` to the batch handler.
fn batch_settings(
    broker: &inventory_tests::broker::Broker,
    max_deliver: i64,
    batch_size: usize,
) -> inventory_service::consumer::RuntimeSettings {
    let mut settings = broker.settings(1, max_deliver);
    settings.batch_size = batch_size;
    settings
}

async fn rows_and_orders(db: &TestDb) -> (i64, i64) {
    let row = db
        .conn
        .query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT count(*), count(DISTINCT order_id) FROM stock_reservations",
        ))
        .await
        .unwrap()
        .unwrap();
    (
        row.try_get_by_index(0).unwrap(),
        row.try_get_by_index(1).unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_batch_statement_naks_the_whole_batch_and_each_is_applied_once_later() {
    use inventory_tests::broker::{Broker, RunningService, eventually};

    const ORDERS: usize = 24;
    let (db, handler) = batch_fixture().await;
    // Every reservation fails with a serialization failure (transient) while `failing` has a
    // row: the batch statement as a whole is refused, as under a real conflict.
    db.conn
        .execute_unprepared(
            "CREATE TABLE failing (on_purpose bool); INSERT INTO failing VALUES (true);
             CREATE FUNCTION fail_reservation() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF EXISTS (SELECT 1 FROM failing) THEN
                     RAISE EXCEPTION 'injected' USING ERRCODE = '40001';
                 END IF;
                 RETURN NEW;
             END $$;
             CREATE TRIGGER fail_reservation BEFORE INSERT ON stock_reservations
                 FOR EACH ROW EXECUTE FUNCTION fail_reservation();",
        )
        .await
        .unwrap();
    let book = db.dune(1_000).await;
    let broker = Broker::new().await;
    let publisher = broker.publisher();
    let mut expected = 0;
    for i in 0..ORDERS {
        let quantity = 1 + i64::try_from(i % 3).unwrap();
        expected += quantity;
        publisher.publish(&placed(book, quantity)).await.unwrap();
    }
    let settings = batch_settings(&broker, 1_000, 8);
    let service = RunningService::start(&broker, handler.clone(), db.conn.clone(), settings).await;

    eventually("every message failed and nak'ed", || async {
        handler.seen().0 == ORDERS && service.metrics.retried() >= ORDERS as u64
    })
    .await;
    // Every one was tried and refused: none committed, none acked, none dead-lettered.
    assert_eq!(db.reserved(book).await, 0);
    assert_eq!(rows_and_orders(&db).await, (0, 0));
    assert_eq!(service.metrics.acked(), 0);
    assert_eq!(service.metrics.dead_lettered(), 0);
    assert!(handler.seen().1 > 1, "no batch of more than one message");

    db.conn
        .execute_unprepared("DELETE FROM failing")
        .await
        .unwrap();
    eventually("every order reserved", || async {
        db.reserved(book).await == expected
    })
    .await;
    broker.settled().await;
    let orders = i64::try_from(ORDERS).unwrap();
    assert_eq!(rows_and_orders(&db).await, (orders, orders));
    assert_eq!(service.metrics.acked(), ORDERS as u64);
    assert_eq!(service.metrics.dead_lettered(), 0);
    service.stop().await;
    assert_eq!(db.reserved(book).await, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_refused_message_in_a_batch_is_dead_lettered_alone_and_the_rest_reserved() {
    use inventory_infra::jetstream::dlq_headers;
    use inventory_tests::broker::{Broker, RunningService};

    let (db, handler) = batch_fixture().await;
    let book = db.dune(1_000).await;
    let broker = Broker::new().await;
    let publisher = broker.publisher();
    let unknown = placed(BookId::new_v7(), 1);
    let taken = placed(book, 2);
    // The same order again with another quantity: a payload mismatch, refused for good.
    let mismatch = placed_for(taken.event.order_id(), book, 3);
    let mut expected = 0;
    for i in 0..20 {
        publisher.publish(&placed(book, 1)).await.unwrap();
        expected += 1;
        let extra = match i {
            5 => &unknown,
            9 => &taken,
            12 => &mismatch,
            _ => continue,
        };
        publisher.publish(extra).await.unwrap();
    }
    expected += 2;
    let settings = batch_settings(&broker, 10, 32);
    let service = RunningService::start(&broker, handler.clone(), db.conn.clone(), settings).await;
    broker.settled().await;
    assert!(handler.seen().1 > 1, "no batch of more than one message");
    assert_eq!(db.reserved(book).await, expected);
    assert_eq!(rows_and_orders(&db).await, (21, 21));
    assert_eq!(service.metrics.acked(), 21);
    assert_eq!(service.metrics.dead_lettered(), 2);
    let letters = broker.dead_letters().await;
    let mut refused: Vec<(&str, Message)> = letters
        .iter()
        .map(|letter| {
            (
                letter.header(dlq_headers::REASON).unwrap(),
                Message::decode(inventory_domain::EventKind::Placed, &letter.body).unwrap(),
            )
        })
        .collect();
    refused.sort_by_key(|(reason, _)| *reason);
    let refused: Vec<(&str, OrderId)> = refused
        .iter()
        .map(|(reason, message)| (*reason, message.event.order_id()))
        .collect();
    assert_eq!(
        refused,
        [
            ("conflicting-reservation", mismatch.event.order_id()),
            ("unknown-book", unknown.event.order_id()),
        ]
    );
    service.stop().await;
}
