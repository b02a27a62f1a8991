//! A role that may not change the schema: with `--skip-migrations` the commands run no DDL,
//! serve with exactly the grants of `deploy/grants.sql`, and refuse at start, naming what is
//! missing, when a grant or a migration is.

use std::process::Child;
use std::time::{Duration, Instant};

use inventory_infra::db::SchemaPolicy;
use inventory_migrations::{Migrator, MigratorTrait};
use inventory_tests::binary::{BinaryRun, ended, stop};
use sea_orm::ConnectionTrait;
use uuid::Uuid;

const BOOK: &str = "0190f5c4-3c2e-7b4a-9d3e-aaaaaaaaaaaa";
const GRANTS_SQL: &str = include_str!("../../deploy/grants.sql");

/// A login role of the test's own, granted what `deploy/grants.sql` grants in the test's
/// database, and the URL that connects as it. Roles belong to the whole server: [`Role::drop`]
/// removes it (a failing test leaves it behind, under a name no other run uses).
struct Role {
    name: String,
    url: String,
}

impl Role {
    async fn granted(run: &BinaryRun) -> Self {
        let name = format!("inventory_service_{}", Uuid::new_v4().simple());
        let password = Uuid::new_v4().simple().to_string();
        run.db
            .conn
            .execute_unprepared(&format!(
                "CREATE ROLE {name} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD '{password}'"
            ))
            .await
            .unwrap();
        // psql's `:"role"` is the role's quoted name; the rest is plain SQL.
        let grants: String = GRANTS_SQL
            .lines()
            .filter(|line| !line.starts_with("--"))
            .collect::<Vec<_>>()
            .join("\n")
            .replace(":\"role\"", &format!("\"{name}\""));
        run.db.conn.execute_unprepared(&grants).await.unwrap();
        // The owner's URL with this role's user and password in place of the owner's.
        let (scheme, rest) = run.db.url.split_once("://").unwrap();
        let host_and_database = rest.rsplit_once('@').map_or(rest, |(_, after)| after);
        let url = format!("{scheme}://{name}:{password}@{host_and_database}");
        Self { name, url }
    }

    /// `sql` run by the owner, with `{role}` standing for this role.
    async fn execute(&self, run: &BinaryRun, sql: &str) {
        run.db
            .conn
            .execute_unprepared(&sql.replace("{role}", &self.name))
            .await
            .unwrap();
    }

    async fn drop(self, run: &BinaryRun) {
        self.execute(run, "DROP OWNED BY {role}; DROP ROLE {role}")
            .await;
    }
}

/// Waits until `sql` reads `expected`, up to 30 s.
async fn eventually_scalar(run: &BinaryRun, sql: &str, expected: i64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let value = run.scalar(sql).await;
        if value == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{sql}: {value}, never {expected}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn serve(run: &BinaryRun) -> Child {
    run.spawn(&[
        "serve",
        "--strategy",
        "natural",
        "--skip-migrations",
        "--ack-wait",
        "2s",
        "--max-deliver",
        "3",
        "--retry-delay",
        "100ms",
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_with_exactly_the_granted_privileges_serves_without_ddl() {
    let mut run = BinaryRun::new("least_privilege", "info,sqlx=warn").await;
    run.put_stock(BOOK, "Dune", 10);
    let role = Role::granted(&run).await;
    // The point of the role: it could not run DDL if the service tried.
    let may_create = run
        .scalar(&format!(
            "SELECT has_schema_privilege('{}', 'public', 'CREATE')::int::int8",
            role.name
        ))
        .await;
    assert_eq!(may_create, 0);
    run.database_url = role.url.clone();

    let service = serve(&run);
    let order = Uuid::now_v7().to_string();
    let place = |extra: &[&str]| {
        let mut args = vec![
            "publish",
            "placed",
            "--book-id",
            BOOK,
            "--quantity",
            "2",
            "--order-id",
            &order,
        ];
        args.extend_from_slice(extra);
        run.run(&args);
    };
    place(&["--message-id", "m-1"]);
    place(&["--message-id", "m-2"]);
    run.publish_for_unknown_book();
    eventually_scalar(
        &run,
        &format!("SELECT reserved::int8 FROM stock_items WHERE book_id = '{BOOK}'"),
        2,
    )
    .await;
    // The relay, in the same process under the same role, published and deleted the event.
    eventually_scalar(&run, "SELECT count(*) FROM outbox", 0).await;
    let dead_letters = run.run(&["dlq", "list", "--json"]);
    assert!(
        String::from_utf8_lossy(&dead_letters.stdout).contains("unknown-book"),
        "{dead_letters:?}"
    );
    let (status, log) = stop(service);
    assert!(status.success(), "{log}");

    // The other commands that open the database, as the same role.
    let listed = run.run(&["stock", "list", "--skip-migrations"]);
    assert!(String::from_utf8_lossy(&listed.stdout).contains("Dune"));
    run.run(&[
        "inbox",
        "purge",
        "--older-than",
        "30days",
        "--skip-migrations",
    ]);
    run.run(&[
        "orders",
        "place",
        "--book-id",
        BOOK,
        "--quantity",
        "1",
        "--skip-migrations",
    ]);
    run.run(&["outbox", "parked", "--skip-migrations"]);

    role.drop(&run).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_missing_a_grant_or_a_migration_is_refused_at_start_naming_it() {
    let mut run = BinaryRun::new("least_privilege_refused", "info,sqlx=warn").await;
    let role = Role::granted(&run).await;
    run.database_url = role.url.clone();

    role.execute(&run, "REVOKE DELETE ON outbox FROM {role}")
        .await;
    let (status, output) = ended(serve(&run));
    assert_eq!(status.code(), Some(1), "{output}");
    assert!(
        output.contains(&format!("role {} lacks DELETE on table outbox", role.name)),
        "{output}"
    );
    role.execute(&run, "GRANT DELETE ON outbox TO {role}").await;

    role.execute(&run, "REVOKE USAGE ON SEQUENCE outbox_seq_seq FROM {role}")
        .await;
    let (status, output) = ended(run.spawn(&["stock", "list", "--skip-migrations"]));
    assert_eq!(status.code(), Some(1), "{output}");
    assert!(
        output.contains("lacks USAGE on sequence outbox_seq_seq"),
        "{output}"
    );
    role.execute(&run, "GRANT USAGE ON SEQUENCE outbox_seq_seq TO {role}")
        .await;

    // The migrations table itself: without reading it the check cannot say what is applied.
    role.execute(&run, "REVOKE SELECT ON seaql_migrations FROM {role}")
        .await;
    let (status, output) = ended(serve(&run));
    assert_eq!(status.code(), Some(1), "{output}");
    assert!(
        output.contains("lacks SELECT on table seaql_migrations"),
        "{output}"
    );
    role.execute(&run, "GRANT SELECT ON seaql_migrations TO {role}")
        .await;

    let last = Migrator::migrations()
        .last()
        .map(|migration| migration.name().to_owned())
        .unwrap();
    run.db
        .conn
        .execute_unprepared(&format!(
            "DELETE FROM seaql_migrations WHERE version = '{last}'"
        ))
        .await
        .unwrap();
    let (status, output) = ended(serve(&run));
    assert_eq!(status.code(), Some(1), "{output}");
    assert!(
        output.contains(&format!("migration {last} not applied")),
        "{output}"
    );
    // Without --skip-migrations the role tries to apply it, and may not.
    let (status, output) = ended(run.spawn(&["stock", "list"]));
    assert_eq!(status.code(), Some(1), "{output}");

    // The check itself, as the library gives it to any caller.
    let refused = inventory_infra::db::open(&role.url, 1, SchemaPolicy::Check, Default::default())
        .await
        .err()
        .unwrap();
    assert!(refused.to_string().contains(&last), "{refused}");

    role.drop(&run).await;
}
