//! `inventory demo` comes out as the study predicts on both backends.

use inventory_benches::demo::{self, StudyReport};

/// Every scenario ran, the cache ones on the test's Redis included, and came out as predicted.
fn assert_all_ran_as_expected(report: &StudyReport) {
    assert!(report.all_as_expected(), "{}", report.render());
    assert_eq!(report.lines.len(), 21);
    assert!(
        report
            .lines
            .iter()
            .all(|line| !line.text.starts_with("skipped")),
        "{}",
        report.render()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_on_sqlite_comes_out_as_expected() {
    let report = demo::run(None, &inventory_tests::redis_url())
        .await
        .unwrap();
    assert_all_ran_as_expected(&report);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_on_postgres_comes_out_as_expected() {
    let server = inventory_tests::postgres::server_url().await;
    let report = demo::run(Some(&server), &inventory_tests::redis_url())
        .await
        .unwrap();
    assert_all_ran_as_expected(&report);
    let race = report
        .lines
        .iter()
        .find(|line| {
            line.text
                .starts_with("two copies at once -> inbox row last")
        })
        .expect("the claim-last race shows where each copy waited on PostgreSQL");
    assert!(
        race.text
            .contains("waited in SELECT … FROM stock_items … FOR UPDATE"),
        "{}",
        race.text
    );
}
