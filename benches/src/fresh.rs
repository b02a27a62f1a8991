//! A database of its own for each run of the study, a benchmark or a test.

use crate::db::{connect, connect_and_migrate};
use inventory_infra::db::{self, DatabaseConnection, DbErr, SchemaError};
use sea_orm::ConnectionTrait as _;

/// A database of its own for one run (the demo, a comparison, a test): a new SQLite file in the
/// temporary directory, or a new database on the PostgreSQL server of `base_url`. Removed by
/// [`FreshDatabase::remove`].
pub struct FreshDatabase {
    pub url: String,
    pub conn: DatabaseConnection,
    place: Place,
}

enum Place {
    SqliteFile(std::path::PathBuf),
    Postgres { server_url: String, name: String },
}

impl FreshDatabase {
    /// `base_url` names the server (its database part is replaced); `None` means SQLite.
    pub async fn create(
        base_url: Option<&str>,
        label: &str,
        max_connections: u32,
    ) -> Result<Self, SchemaError> {
        let name = format!("{label}_{}", uuid::Uuid::new_v4().simple());
        let (url, place) = match base_url {
            Some(base) if db::is_postgres(base) => {
                let server = connect(base, 1).await?;
                server
                    .execute_unprepared(&format!("CREATE DATABASE \"{name}\""))
                    .await?;
                server.close().await?;
                let url = with_database_name(base, &name);
                let place = Place::Postgres {
                    server_url: base.to_owned(),
                    name,
                };
                (url, place)
            }
            _ => {
                let path = std::env::temp_dir().join(format!("{name}.db"));
                let url = format!("sqlite://{}?mode=rwc", path.display());
                (url, Place::SqliteFile(path))
            }
        };
        let conn = connect_and_migrate(&url, max_connections).await?;
        Ok(Self { url, conn, place })
    }

    pub async fn remove(self) -> Result<(), DbErr> {
        self.conn.close().await?;
        match self.place {
            Place::SqliteFile(path) => {
                for suffix in ["", "-wal", "-shm"] {
                    let mut file = path.clone().into_os_string();
                    file.push(suffix);
                    // Missing side files are normal once the last connection checkpointed.
                    let _ = std::fs::remove_file(file);
                }
            }
            Place::Postgres { server_url, name } => {
                let server = connect(&server_url, 1).await?;
                server
                    .execute_unprepared(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                    .await?;
                server.close().await?;
            }
        }
        Ok(())
    }
}

/// `postgres://user@host:5432/old?opts` with `old` replaced by `name`, options kept.
fn with_database_name(url: &str, name: &str) -> String {
    let (without_query, query) = match url.split_once('?') {
        Some((head, query)) => (head, Some(query)),
        None => (url, None),
    };
    let authority_start = without_query.find("://").map_or(0, |at| at + 3);
    let server = match without_query[authority_start..].find('/') {
        Some(slash) => &without_query[..authority_start + slash],
        None => without_query,
    };
    match query {
        Some(query) => format!("{server}/{name}?{query}"),
        None => format!("{server}/{name}"),
    }
}

#[cfg(test)]
mod tests {
    use super::with_database_name;

    #[test]
    fn database_name_is_replaced_and_options_kept() {
        assert_eq!(
            with_database_name("postgres://postgres@127.0.0.1:5432/postgres", "t1"),
            "postgres://postgres@127.0.0.1:5432/t1"
        );
        assert_eq!(
            with_database_name("postgres://u:p@h/db?sslmode=disable", "t2"),
            "postgres://u:p@h/t2?sslmode=disable"
        );
        assert_eq!(
            with_database_name("postgresql://h:5432", "t3"),
            "postgresql://h:5432/t3"
        );
    }
}
