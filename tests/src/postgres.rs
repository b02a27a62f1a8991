//! The PostgreSQL server the tests create their databases on, first found of: `DATABASE_URL`
//! (when it is a postgres URL), the local server on 127.0.0.1:5432, or a container started with
//! testcontainers where a Docker engine runs. With none of them the tests fail: a PostgreSQL test
//! is never skipped quietly.

use std::process::{Command, Stdio};

use testcontainers_modules::postgres::Postgres;
use testcontainers_modules::testcontainers::ContainerAsync;
use testcontainers_modules::testcontainers::runners::AsyncRunner;
use tokio::sync::OnceCell;

pub const LOCAL_SERVER: &str = "postgres://postgres@127.0.0.1:5432/postgres";

static SERVER: OnceCell<(String, Option<ContainerAsync<Postgres>>)> = OnceCell::const_new();

pub async fn server_url() -> String {
    SERVER
        .get_or_init(|| async {
            if let Ok(url) = std::env::var("DATABASE_URL")
                && inventory_infra::db::is_postgres(&url)
            {
                return (url, None);
            }
            if sea_orm::Database::connect(LOCAL_SERVER).await.is_ok() {
                return (LOCAL_SERVER.to_owned(), None);
            }
            assert!(
                docker_engine_runs(),
                "no PostgreSQL: set DATABASE_URL, start a local server on 127.0.0.1:5432 \
                 (scripts/test.sh does), or run a Docker engine for testcontainers"
            );
            let container = Postgres::default()
                .start()
                .await
                .expect("a PostgreSQL container");
            let port = container
                .get_host_port_ipv4(5432)
                .await
                .expect("the container's port");
            let url = format!("postgres://postgres:postgres@127.0.0.1:{port}/postgres");
            (url, Some(container))
        })
        .await
        .0
        .clone()
}

pub(crate) fn docker_engine_runs() -> bool {
    Command::new("docker")
        .arg("info")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}
