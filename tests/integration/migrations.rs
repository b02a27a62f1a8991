//! The migrations roll back and forward on both backends.

use inventory_migrations::{Migrator, MigratorTrait};
use inventory_tests::{TestDb, on_both_backends};

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
