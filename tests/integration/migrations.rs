//! The migrations roll back and forward on both backends, are applied once by instances
//! starting together, and a schema newer than the binary is refused with what to do.

use inventory_infra::db::{self, DbTimeouts, SchemaPolicy};
use inventory_migrations::{Migrator, MigratorTrait};
use inventory_tests::{TestDb, on_both_backends};
use sea_orm::ConnectionTrait;

async fn migrations_roll_back_and_apply_again(db: TestDb) {
    let book = db.dune(3).await;
    assert_eq!(db.reserved(book).await, 0);
    Migrator::down(&db.conn, None).await.unwrap();
    assert!(
        Migrator::get_applied_migrations(&db.conn)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(db.stock.list().await.is_err(), "the tables are gone");
    Migrator::up(&db.conn, None).await.unwrap();
    assert!(db.stock.list().await.unwrap().is_empty());
    assert!(
        Migrator::get_pending_migrations(&db.conn)
            .await
            .unwrap()
            .is_empty()
    );
}

on_both_backends!(migrations_roll_back_and_apply_again);

/// Instances started together on an empty PostgreSQL database each apply the migrations at
/// start: the lock lets one apply them while the others wait, then find nothing to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_starting_together_on_an_empty_database_all_start() {
    let server = inventory_tests::postgres::server_url().await;
    let admin = inventory_benches::db::connect(&server, 1).await.unwrap();
    let name = format!("inventory_empty_{}", uuid::Uuid::new_v4().simple());
    admin
        .execute_unprepared(&format!("CREATE DATABASE \"{name}\""))
        .await
        .unwrap();
    let (base, query) = server.split_once('?').unwrap_or((&server, ""));
    let url = format!("{}/{name}?{query}", base.rsplit_once('/').unwrap().0);
    let starts: Vec<_> = (0..4)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                db::open(&url, 1, SchemaPolicy::Migrate, DbTimeouts::default())
                    .await
                    .map(drop)
                    .map_err(|error| error.to_string())
            })
        })
        .collect();
    let mut results = Vec::new();
    for start in starts {
        results.push(start.await.unwrap());
    }
    admin
        .execute_unprepared(&format!("DROP DATABASE \"{name}\" WITH (FORCE)"))
        .await
        .unwrap();
    assert!(results.iter().all(Result::is_ok), "{results:?}");
}

/// A release that meets a schema a newer one migrated refuses to migrate, saying what it can
/// do, and runs with `--skip-migrations` since every migration it knows is applied.
async fn a_newer_schema_is_refused_and_runs_without_migrating(db: TestDb) {
    db.conn
        .execute_unprepared(
            "INSERT INTO seaql_migrations (version, applied_at) \
             VALUES ('m20991231_000001_from_a_newer_release', 0)",
        )
        .await
        .unwrap();
    let refused = db::open(&db.url, 1, SchemaPolicy::Migrate, DbTimeouts::default())
        .await
        .map(drop)
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("the schema is newer than this binary")
            && refused.contains("m20991231_000001_from_a_newer_release")
            && refused.contains("--skip-migrations"),
        "{refused}"
    );
    db::open(&db.url, 1, SchemaPolicy::Check, DbTimeouts::default())
        .await
        .unwrap();
}

on_both_backends!(a_newer_schema_is_refused_and_runs_without_migrating);
