//! `inventory compare` end to end: a small workload with every kind of duplicate, through a real
//! NATS server into every strategy, each row held against what the workload predicts.

use inventory_benches::mistakes::Strategy;
use inventory_benches::readback::Readback as _;
use std::time::Duration;

use inventory_benches::compare::{
    self, Backend, CompareReport, Fault, Rates, STRATEGIES, Settings, Workload,
};
use inventory_benches::consumers::{DetectMode, HandlerKind, NaturalKeyPath};
use inventory_tests::nats::shared_url;
use inventory_tests::postgres::server_url;
use inventory_tests::{TestDb, placed};
use sea_orm::{ConnectionTrait, DbBackend, Statement};

async fn settings(seed: u64, database_url: String) -> Settings {
    Settings {
        orders: 60,
        books: 5,
        rates: Rates {
            producer_new_id: 0.1,
            producer_same_id: 0.1,
            redelivery: 0.1,
            concurrent_copies: 0.1,
        },
        seed,
        database_url,
        nats_url: shared_url().await,
        ack_wait: Duration::from_secs(1),
        concurrency: 4,
    }
}

/// Copies of the orders that got `faults`, summed from the workload itself rather than from the
/// command's own prediction.
fn copies(workload: &Workload, faults: &[Fault]) -> i64 {
    workload
        .orders
        .iter()
        .filter(|order| faults.contains(&order.fault))
        .map(|order| order.quantity)
        .sum()
}

fn orders(workload: &Workload, faults: &[Fault]) -> i64 {
    workload
        .orders
        .iter()
        .filter(|order| faults.contains(&order.fault))
        .count() as i64
}

async fn compare_and_check(settings: Settings, backend: Backend) -> CompareReport {
    let report = compare::run(&settings).await.expect("the comparison runs");
    let table = report.render();
    let workload = Workload::generate(&settings).unwrap();
    assert_eq!(report.workload.backend, backend);
    assert_eq!(report.workload.published.dropped_same_id, 6, "{table}");
    assert_eq!(report.strategies.len(), STRATEGIES.len());
    for row in &report.strategies {
        assert!(
            row.as_predicted(),
            "{}: {:?}\n{table}",
            row.strategy,
            row.deviations
        );
        assert_eq!(row.dead_lettered, 0, "{table}");
        assert_eq!(row.retried, 0, "{table}");
        assert_eq!(
            row.expected_reserved,
            workload
                .orders
                .iter()
                .map(|order| order.quantity)
                .sum::<i64>()
        );
        // 60 orders + 6 new-id resends + 6 second copies + 6 redeliveries, and anything the
        // broker redelivered on its own.
        assert_eq!(row.delivered, 78 + row.unplanned_deliveries, "{table}");
        assert_eq!(row.ack_withheld, 6, "{table}");
    }
    // The two-copies case is a race only if copies were handled at the same time. Whether a
    // given pair overlaps is itself a race (a loaded machine may run a strategy's six pairs one
    // after the other), so the run as a whole must show some.
    assert!(
        report.strategies.iter().any(|row| row.copies_at_once > 0),
        "no pair of copies was handled at the same time\n{table}"
    );
    assert!(report.as_predicted, "{table}");

    let row = |strategy: Strategy| report.row(strategy).unwrap();
    let natural = row(HandlerKind::NaturalKey(NaturalKeyPath::Orm).into());
    assert_eq!(natural.difference, 0, "{table}");
    assert_eq!(natural.orders_reserved_more_than_once, 0, "{table}");

    let inbox = row(HandlerKind::Inbox(DetectMode::OnConflict).into());
    let resent = copies(&workload, &[Fault::NewIdResend]);
    assert!(resent > 0);
    assert_eq!(inbox.difference, resent, "{table}");
    assert_eq!(
        inbox.orders_reserved_more_than_once,
        orders(&workload, &[Fault::NewIdResend]),
        "{table}"
    );

    let every = [Fault::NewIdResend, Fault::Redelivered, Fault::TwoCopies];
    let naive = row(Strategy::Naive);
    if naive.unplanned_deliveries == 0 {
        assert_eq!(naive.difference, copies(&workload, &every), "{table}");
        assert_eq!(
            naive.orders_reserved_more_than_once,
            orders(&workload, &every),
            "{table}"
        );
    } else {
        assert!(naive.difference > copies(&workload, &every), "{table}");
    }

    let check_then_process = row(Strategy::CheckThenProcess);
    let window = copies(&workload, &[Fault::NewIdResend, Fault::Redelivered]);
    assert!(check_then_process.difference >= window, "{table}");
    if check_then_process.unplanned_deliveries == 0 {
        assert!(
            check_then_process.difference <= copies(&workload, &every),
            "{table}"
        );
    }
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_row_as_predicted_on_postgres_seed_1() {
    compare_and_check(settings(1, server_url().await).await, Backend::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_row_as_predicted_on_postgres_seed_2() {
    compare_and_check(settings(2, server_url().await).await, Backend::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_row_as_predicted_on_postgres_seed_3() {
    let report = compare_and_check(settings(3, server_url().await).await, Backend::Postgres).await;
    assert_eq!(report.workload.instances_per_strategy, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_row_as_predicted_on_sqlite() {
    let report = compare_and_check(
        settings(4, "sqlite://compare".into()).await,
        Backend::Sqlite,
    )
    .await;
    assert_eq!(report.workload.instances_per_strategy, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_rates_are_refused_before_anything_is_made() {
    let mut wrong = settings(1, "postgres://nowhere.invalid/postgres".into()).await;
    wrong.rates.redelivery = 0.7;
    wrong.rates.concurrent_copies = 0.7;
    let error = compare::run(&wrong).await.unwrap_err();
    assert!(error.to_string().contains("add up"), "{error}");
}

/// The "orders >1" figure sees an order the natural key reserved twice: its table keeps one row
/// per order, so the second reservation shows only as stock moved past the rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_the_natural_key_reserved_twice_is_counted() {
    let db = TestDb::new(inventory_tests::Backend::Postgres).await;
    let handler = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm));
    let book = db.dune(10).await;
    assert!(handler.handle(&placed(book, 2)).await.unwrap().processed());
    assert_eq!(db.stock.orders_reserved_more_than_once().await.unwrap(), 0);
    // What a handler that moves stock on a copy whose key was taken leaves behind.
    db.conn
        .execute_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "UPDATE stock_items SET reserved = reserved + 2 WHERE book_id = $1",
            [book.as_uuid().into()],
        ))
        .await
        .unwrap();
    assert_eq!(db.stock.orders_reserved_more_than_once().await.unwrap(), 1);
}
