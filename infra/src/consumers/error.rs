//! Why a handler failed, and what that means for the delivery: [`HandleError::kind`].

use inventory_domain::{CrashPoint, DeadLetterReason, ErrorKind, ProviderError, Refusal};
use sea_orm::DbErr;

use crate::db::{DbErrorCode, DbFailure};
use crate::stock::DataError;

/// Why handling failed without an outcome. Nothing of the message was acknowledged;
/// [`HandleError::kind`] says whether it is retried, dead-lettered, or left to its ack wait.
///
/// `Clone`, so the one failure of a batch statement is each of its messages' failure, with its
/// database code and kind intact.
#[derive(Debug, Clone, thiserror::Error)]
pub enum HandleError {
    /// The database failed; its [`DbFailure`] says whether for good.
    #[error("database error{code}: {0}", code = code_note(.0))]
    Database(#[from] DbErr),
    /// Stored data the handler cannot use, which no retry changes.
    #[error("unusable data: {0}")]
    Data(#[from] DataError),
    /// The provider did not take the email: retry later.
    #[error(transparent)]
    Provider(#[from] ProviderError),
    /// An injected crash: the handler "died" at this point, as a killed process would.
    #[error("crashed at {}", .0.as_str())]
    Crashed(CrashPoint),
    /// The database work did not finish within the client's bound (a server gone silent, a
    /// link dropped without a word) and was abandoned, its connection closed. Whether it
    /// committed is unknown: the retry finds out.
    #[error("database work abandoned after {0:?} without an answer")]
    TimedOut(std::time::Duration),
}

/// The database's code in the message, so a log line says which failure it was.
fn code_note(error: &DbErr) -> String {
    DbErrorCode::of(error).map_or_else(String::new, |code| format!(" ({code})"))
}

impl HandleError {
    /// A failure of a statement the raw sqlx paths (natural_pg.rs, natural_sqlite.rs) ran
    /// themselves, as sea-orm would have reported it, so it is judged as any other.
    pub(crate) fn from_sqlx(error: sea_orm::sqlx::Error) -> Self {
        Self::Database(DbErr::Exec(sea_orm::RuntimeErr::SqlxError(
            std::sync::Arc::new(error),
        )))
    }

    /// What becomes of the delivery. A permanent failure is dead-lettered as
    /// `needs-reconciliation`: the stored data or a constraint stands in its way, and a person
    /// has to settle that before a replay can succeed.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Database(error) if DbFailure::of(error).is_transient() => ErrorKind::Transient,
            Self::Database(_) | Self::Data(_) => ErrorKind::Permanent(Refusal {
                reason: DeadLetterReason::NeedsReconciliation,
                detail: self.to_string(),
            }),
            Self::Provider(_) | Self::TimedOut(_) => ErrorKind::Transient,
            Self::Crashed(point) => ErrorKind::Crashed(*point),
        }
    }

    /// A failure of the database, which may be down as a whole: the consumer checks whether
    /// it is reachable before fetching more.
    pub fn is_database(&self) -> bool {
        matches!(self, Self::Database(_) | Self::TimedOut(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn permanent(error: &HandleError) -> Refusal {
        match error.kind() {
            ErrorKind::Permanent(refusal) => refusal,
            other => panic!("{error} is {other:?}, not permanent"),
        }
    }

    #[test]
    fn kinds_follow_the_error_type() {
        let crashed = HandleError::Crashed(CrashPoint::BeforeCommit);
        assert_eq!(crashed.kind(), ErrorKind::Crashed(CrashPoint::BeforeCommit));
        let provider = HandleError::from(ProviderError("down".into()));
        assert_eq!(provider.kind(), ErrorKind::Transient);
        let unknown = HandleError::from(DbErr::Custom("anything".into()));
        assert_eq!(unknown.kind(), ErrorKind::Transient);
        assert!(unknown.is_database());
        let silent = HandleError::TimedOut(std::time::Duration::from_secs(16));
        assert_eq!(silent.kind(), ErrorKind::Transient);
        assert!(silent.is_database());
    }

    #[test]
    fn unusable_stored_data_is_permanent_and_says_what() {
        let corrupt = HandleError::from(DataError::Unreadable {
            column: "reservation status",
            value: "\"reserv\"".into(),
        });
        let refusal = permanent(&corrupt);
        assert_eq!(refusal.reason, DeadLetterReason::NeedsReconciliation);
        assert_eq!(
            refusal.detail,
            "unusable data: stored reservation status \"reserv\" is not valid"
        );
        assert!(!corrupt.is_database());
        let undecodable = HandleError::from(DbErr::Type("NULL in book_found".into()));
        assert_eq!(
            permanent(&undecodable).reason,
            DeadLetterReason::NeedsReconciliation
        );
    }
}

/// Real PostgreSQL errors, through each path a handler takes: the codes survive and decide.
#[cfg(test)]
mod on_postgres {
    use inventory_domain::{
        BookId, ConsumerName, Effect, Message, OrderId, Outcome, Quantity, StockItem,
    };
    use sea_orm::ConnectionTrait;

    use super::*;
    use crate::consumers::{Handler, HandlerKind, MessageHandler, NaturalKeyPath};
    use crate::db::{self, FreshDatabase};
    use crate::stock::StockRepository;

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

    #[tokio::test]
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

    #[tokio::test]
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

    #[tokio::test]
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
}
