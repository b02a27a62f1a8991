//! One integration-test binary: every test owns a fresh database, on SQLite and PostgreSQL.
#![expect(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test fails by panicking"
)]

mod boundary;
mod compare;
mod corpus;
mod crash_points;
mod dead_letter_safety;
mod demo;
mod differential;
mod dlq;
mod email;
mod errors;
mod example;
mod harness;
mod health;
mod inbox;
mod lock_order;
mod migrations;
mod moving;
mod naive;
mod natural;
mod natural_pg;
mod natural_sqlite;
mod orders;
mod outages;
mod outbox;
mod ownership;
mod publisher;
mod purge_load;
mod relay;
mod retention;
mod retries;
mod routing;
mod secure;
mod serve;
mod shards;
mod silent_network;

use inventory_benches::faults;
use inventory_benches::mistakes::StudyHandler;
use inventory_domain::{Message, Outcome};
use inventory_infra::CrashPoint;
use inventory_infra::{HandleError, MessageHandler};
use inventory_tests::{Backend, TestDb};

/// Two copies of `message` at once. The first is held right after its dedup claim (and, with
/// `first_crashes_at`, dies after release). With `second_must_wait` the test proves the second
/// is blocked behind it (on PostgreSQL by a lock wait in `pg_stat_activity`; on SQLite, whose
/// writers queue on the database lock, by its not finishing while the first is held); without,
/// the second runs to its end while the first is parked.
pub(crate) async fn two_copies(
    db: &TestDb,
    consumer: impl Into<StudyHandler>,
    message: &Message,
    first_crashes_at: Option<CrashPoint>,
    second_must_wait: bool,
) -> (Result<Outcome, HandleError>, Outcome) {
    let consumer = consumer.into();
    let (faults, mut hold) = match first_crashes_at {
        Some(point) => faults::hold_then_crash(CrashPoint::AfterDedupCheck, point),
        None => faults::hold_once_at(CrashPoint::AfterDedupCheck),
    };
    let first = tokio::spawn({
        let consumer = consumer.with_faults(faults);
        let message = message.clone();
        async move { consumer.handle(&message).await }
    });
    hold.reached().await;
    let second = tokio::spawn({
        let consumer = consumer.clone();
        let message = message.clone();
        async move { consumer.handle(&message).await }
    });
    if !second_must_wait {
        // Nothing holds the second copy back: let it finish while the first is parked, so both
        // have passed their checks before either records anything.
        let second = second.await.unwrap().expect("the second copy is handled");
        hold.release();
        return (first.await.unwrap(), second);
    }
    match db.backend {
        Backend::Postgres => db.wait_for_lock_waiter().await,
        // SQLite shows no waiting writer (it retries inside its busy handler): the second is
        // given time to reach the writer lock, and must not have finished below.
        Backend::Sqlite => tokio::time::sleep(std::time::Duration::from_millis(300)).await,
    }
    assert!(!second.is_finished(), "the second copy did not wait");
    hold.release();
    let first = first.await.unwrap();
    let second = second.await.unwrap().expect("the second copy is handled");
    (first, second)
}
