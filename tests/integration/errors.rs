//! Real PostgreSQL errors, through each path a handler takes: the codes survive and decide.

use inventory_benches::produce::Produce as _;
use inventory_domain::{
    BookId, ConsumerName, Effect, Message, OrderId, Outcome, Quantity, StockItem,
};
use sea_orm::ConnectionTrait;

use inventory_benches::consumers::{Handler, HandlerKind, NaturalKeyPath};
use inventory_benches::fresh::FreshDatabase;
use inventory_domain::{DeadLetterReason, ErrorKind, Refusal};
use inventory_infra::db::{self, DbErrorCode};
use inventory_infra::{DataError, HandleError, MessageHandler, StockRepository};

/// A database of its own on the server of `DATABASE_URL`, else the local one. These tests
/// are about PostgreSQL's codes: without a server they fail, never skip.
async fn fresh_postgres() -> FreshDatabase {
    let server = std::env::var("DATABASE_URL")
        .ok()
        .filter(|url| db::is_postgres(url))
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/postgres".into());
    FreshDatabase::create(Some(&server), "infra_errors", 4)
        .await
        .expect("a fresh PostgreSQL database (set DATABASE_URL)")
}

async fn book(db: &FreshDatabase, on_hand: i64) -> BookId {
    let item = StockItem::new(BookId::new_v7(), "Dune", on_hand).expect("valid stock");
    StockRepository::new(db.conn.clone())
        .put(&item)
        .await
        .expect("stock put");
    item.book_id
}

fn placed(order_id: OrderId, book_id: BookId, quantity: i64) -> Message {
    Message::placed(
        order_id,
        book_id,
        Quantity::new(quantity).expect("valid quantity"),
    )
}

fn handlers(db: &FreshDatabase) -> (Handler, Handler) {
    let consumer = ConsumerName::parse("inventory-reserve-stock").expect("valid name");
    let build = |path| {
        HandlerKind::NaturalKey(path)
            .build(&db.conn, consumer.clone(), None)
            .expect("a PostgreSQL handler")
    };
    (build(NaturalKeyPath::Orm), build(NaturalKeyPath::Batch))
}

fn sqlstate(result: &Result<Outcome, HandleError>) -> Option<String> {
    match result {
        Err(HandleError::Database(error)) => match DbErrorCode::of(error) {
            Some(DbErrorCode::Sqlstate(code)) => Some(code),
            _ => None,
        },
        _ => None,
    }
}

fn kind(result: &Result<Outcome, HandleError>) -> Option<ErrorKind> {
    result.as_ref().err().map(HandleError::kind)
}

fn is_permanent(result: &Result<Outcome, HandleError>) -> bool {
    matches!(
        kind(result),
        Some(ErrorKind::Permanent(Refusal {
            reason: DeadLetterReason::NeedsReconciliation,
            ..
        }))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_error_keeps_its_sqlstate_and_is_classified_by_it() {
    let db = fresh_postgres().await;
    let error = |statement: &'static str| {
        let conn = db.conn.clone();
        async move {
            let error = conn
                .execute_unprepared(statement)
                .await
                .expect_err("the statement fails");
            HandleError::from(error)
        }
    };
    let division = error("SELECT 1 / 0").await;
    assert_eq!(
        sqlstate(&Err(division.clone())).as_deref(),
        Some("22012"),
        "{division}"
    );
    assert!(is_permanent(&Err(division.clone())), "{division}");
    assert!(
        division.to_string().contains("(SQLSTATE 22012)"),
        "{division}"
    );
    // A deadlock and a shutdown, raised under their codes: retried, not dead-lettered.
    let deadlock =
        error("DO $$ BEGIN RAISE EXCEPTION 'injected' USING ERRCODE = '40P01'; END $$").await;
    assert_eq!(sqlstate(&Err(deadlock.clone())).as_deref(), Some("40P01"));
    assert_eq!(deadlock.kind(), ErrorKind::Transient);
    let shutdown =
        error("DO $$ BEGIN RAISE EXCEPTION 'injected' USING ERRCODE = '57P01'; END $$").await;
    assert_eq!(shutdown.kind(), ErrorKind::Transient);
    // A constraint of the schema: stock below zero.
    let negative = StockItem {
        on_hand: -1,
        ..StockItem::new(BookId::new_v7(), "Dune", 1).expect("valid stock")
    };
    let check = StockRepository::new(db.conn.clone())
        .put(&negative)
        .await
        .expect_err("the check constraint refuses it");
    assert_eq!(
        DbErrorCode::of(&check),
        Some(DbErrorCode::Sqlstate("23514".into()))
    );
    assert!(is_permanent(&Err(check.into())));
    db.remove().await.expect("database removed");
}

/// Refuses, under the SQLSTATE in `injected_failure`, every reservation of its book.
const INJECT_FAILURE_SQL: &str = "
CREATE TABLE injected_failure (book_id uuid, code text);
CREATE FUNCTION injected_failure() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE failing injected_failure;
BEGIN
SELECT * INTO failing FROM injected_failure WHERE book_id = NEW.book_id;
IF FOUND THEN
    RAISE EXCEPTION 'injected failure' USING ERRCODE = failing.code;
END IF;
RETURN NEW;
END $$;
CREATE TRIGGER injected_failure BEFORE INSERT ON stock_reservations
FOR EACH ROW EXECUTE FUNCTION injected_failure();";

async fn fail_book(db: &FreshDatabase, book: BookId, code: &str) {
    db.conn
        .execute_unprepared(&format!(
            "DELETE FROM injected_failure;
             INSERT INTO injected_failure VALUES ('{book}', '{code}')"
        ))
        .await
        .expect("failure injected");
}

async fn reserved(db: &FreshDatabase, book: BookId) -> i64 {
    StockRepository::new(db.conn.clone())
        .get(book)
        .await
        .expect("stock read")
        .expect("the book")
        .reserved
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_batch_path_keeps_each_error_its_code_and_kind() {
    let db = fresh_postgres().await;
    db.conn
        .execute_unprepared(INJECT_FAILURE_SQL)
        .await
        .expect("trigger created");
    let (_, handler) = handlers(&db);
    let failing = book(&db, 10).await;
    let fine = book(&db, 10).await;

    // A transient failure of the statement: nothing committed, every placement retried,
    // each with the statement's own code.
    fail_book(&db, failing, "40P01").await;
    let batch = [
        placed(OrderId::new_v7(), failing, 1),
        placed(OrderId::new_v7(), fine, 2),
    ];
    let results = handler.handle_batch(&batch).await;
    for result in &results {
        assert_eq!(sqlstate(result).as_deref(), Some("40P01"), "{result:?}");
        assert_eq!(kind(result), Some(ErrorKind::Transient));
    }
    assert_eq!(reserved(&db, fine).await, 0);

    // A permanent one: decided one by one, so only the placement it is about is refused.
    fail_book(&db, failing, "23514").await;
    let results = handler.handle_batch(&batch).await;
    assert_eq!(sqlstate(&results[0]).as_deref(), Some("23514"));
    assert!(is_permanent(&results[0]), "{:?}", results[0]);
    assert!(
        matches!(results[1], Ok(Outcome::Processed(Effect::Reserved { .. }))),
        "{:?}",
        results[1]
    );
    assert_eq!(reserved(&db, fine).await, 2);
    db.remove().await.expect("database removed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_reservation_is_refused_on_every_path_and_alone() {
    let db = fresh_postgres().await;
    let (reference, one_statement) = handlers(&db);
    let book = book(&db, 10).await;
    let corrupt_order = OrderId::new_v7();
    db.conn
        .execute_unprepared(&format!(
            "INSERT INTO stock_reservations
                 (order_id, book_id, quantity, status, message_id, created_at)
             VALUES ('{corrupt_order}', '{book}', 0, 'reserved', 'm-1', now())"
        ))
        .await
        .expect("corrupt row written");
    let copy = placed(corrupt_order, book, 2);
    for result in [
        reference.handle(&copy).await,
        one_statement.handle(&copy).await,
    ] {
        assert!(is_permanent(&result), "{result:?}");
        assert!(matches!(
            result,
            Err(HandleError::Data(DataError::Unreadable { .. }))
        ));
    }
    // In a batch, the other placement is reserved by the statement and reported so.
    let batch = [copy, placed(OrderId::new_v7(), book, 1)];
    let results = one_statement.handle_batch(&batch).await;
    assert!(is_permanent(&results[0]), "{:?}", results[0]);
    assert!(
        matches!(results[1], Ok(Outcome::Processed(Effect::Reserved { .. }))),
        "{:?}",
        results[1]
    );
    assert_eq!(reserved(&db, book).await, 1);
    db.remove().await.expect("database removed");
}
