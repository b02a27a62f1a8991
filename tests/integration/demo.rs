//! `inventory demo` comes out as the study predicts on both backends.

use inventory_benches::demo;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_on_sqlite_comes_out_as_expected() {
    let report = demo::run(None).await.unwrap();
    assert!(report.all_as_expected(), "{}", report.render());
    assert_eq!(report.lines.len(), 19);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_on_postgres_comes_out_as_expected() {
    let server = inventory_tests::postgres::server_url().await;
    let report = demo::run(Some(&server)).await.unwrap();
    assert!(report.all_as_expected(), "{}", report.render());
}
