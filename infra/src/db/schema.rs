//! What a command does about the schema when it opens the database: apply the pending
//! migrations (the default, which needs a role that may change the schema), or change nothing
//! and check (`--skip-migrations`): every migration applied, and on PostgreSQL every privilege
//! of `inventory_migrations::grants` held, so that a role missing one fails at start, naming
//! it, not at the first message that needs it.

use std::collections::HashSet;
use std::fmt;

use inventory_migrations::{Migrator, MigratorTrait, grants};
use sea_orm::sea_query::Query;
use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend, DbErr, Statement};

/// What [`super::open`] does about the schema.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchemaPolicy {
    /// Applies the pending migrations.
    Migrate,
    /// Runs no DDL: refuses a schema that is not current or a role that lacks a grant.
    Check,
}

/// Why the schema check refused.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    #[error(transparent)]
    Database(#[from] DbErr),
    #[error(
        "the schema is not current: migration {} not applied; run `inventory migrate` with the \
         role that owns the schema, then start this again",
        .missing.join(", ")
    )]
    NotCurrent { missing: Vec<String> },
    #[error(
        "the schema is newer than this binary: migration {} was applied by a newer release. \
         This binary runs on it with --skip-migrations (env INVENTORY_SKIP_MIGRATIONS), which \
         changes no schema and checks that every migration it knows is applied; it cannot \
         apply or undo the newer ones (docs/deploying.md, upgrading and rolling back)",
        .unknown.join(", ")
    )]
    Newer { unknown: Vec<String> },
    #[error(
        "role {role} lacks {}: grant what deploy/grants.sql grants (docs/deploying.md)",
        .missing.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
    )]
    MissingPrivileges {
        role: String,
        missing: Vec<MissingPrivilege>,
    },
}

/// A privilege the role lacks on one object, e.g. "DELETE on table outbox".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingPrivilege {
    pub privilege: String,
    /// `table outbox`, `sequence outbox_seq_seq`, `function lock_order(uuid)`, `schema public`.
    pub object: String,
}

impl fmt::Display for MissingPrivilege {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} on {}", self.privilege, self.object)
    }
}

/// Every migration applied, none pending.
pub(super) async fn check_current(db: &DatabaseConnection) -> Result<(), SchemaError> {
    let (present, readable) = migrations_table(db).await?;
    if !readable {
        return Err(SchemaError::MissingPrivileges {
            role: current_role(db).await?,
            missing: vec![MissingPrivilege {
                privilege: "SELECT".into(),
                object: format!("table {}", grants::MIGRATIONS_TABLE),
            }],
        });
    }
    let applied = if present {
        applied_versions(db).await?
    } else {
        HashSet::new()
    };
    let missing: Vec<String> = Migrator::migrations()
        .iter()
        .map(|migration| migration.name().to_owned())
        .filter(|name| !applied.contains(name))
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(SchemaError::NotCurrent { missing })
    }
}

/// Whether the migrations table exists, and whether this role may read it (SQLite has no
/// privileges).
async fn migrations_table(conn: &impl ConnectionTrait) -> Result<(bool, bool), DbErr> {
    let backend = conn.get_database_backend();
    let sql = match backend {
        DbBackend::Postgres => {
            "SELECT to_regclass($1) IS NOT NULL AS present, \
             to_regclass($1) IS NULL OR has_table_privilege($1, 'SELECT') AS readable"
        }
        _ => {
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?) \
             AS present, true AS readable"
        }
    };
    let table = Statement::from_sql_and_values(backend, sql, [grants::MIGRATIONS_TABLE.into()]);
    let row = conn
        .query_one_raw(table)
        .await?
        .ok_or_else(|| DbErr::RecordNotFound("the migrations table's check".into()))?;
    Ok((row.try_get("", "present")?, row.try_get("", "readable")?))
}

/// The migrations recorded as applied. The table must exist.
async fn applied_versions(conn: &impl ConnectionTrait) -> Result<HashSet<String>, DbErr> {
    let versions = Query::select()
        .column("version")
        .from(grants::MIGRATIONS_TABLE)
        .to_owned();
    super::column_of_rows(conn, &versions, "version").await
}

/// The migrations recorded as applied that this binary does not know, in order; none where
/// nothing was ever migrated.
pub(super) async fn unknown_migrations(conn: &impl ConnectionTrait) -> Result<Vec<String>, DbErr> {
    let (present, _) = migrations_table(conn).await?;
    if !present {
        return Ok(Vec::new());
    }
    let known: HashSet<String> = Migrator::migrations()
        .iter()
        .map(|migration| migration.name().to_owned())
        .collect();
    let mut unknown: Vec<String> = applied_versions(conn)
        .await?
        .into_iter()
        .filter(|version| !known.contains(version))
        .collect();
    unknown.sort();
    Ok(unknown)
}

/// The grants of `inventory_migrations::grants`, each looked up for the current role in one
/// query; those it lacks, in order.
const PRIVILEGES_SQL: &str = "\
SELECT object, privilege FROM (
    SELECT 'schema ' || current_schema() AS object, 'USAGE' AS privilege,
           has_schema_privilege(current_schema(), 'USAGE') AS held
    UNION ALL
    SELECT 'table ' || t, p, has_table_privilege(t, p)
    FROM unnest($1::text[]) t, unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE']) p
    UNION ALL
    SELECT 'table ' || $2, 'SELECT', has_table_privilege($2, 'SELECT')
    UNION ALL
    SELECT 'sequence ' || s, 'USAGE', has_sequence_privilege(s, 'USAGE') FROM unnest($3::text[]) s
    UNION ALL
    SELECT 'function ' || f, 'EXECUTE', has_function_privilege(f, 'EXECUTE')
    FROM unnest($4::text[]) f
) grants
WHERE NOT held";

/// On PostgreSQL, every privilege a serving role needs (SQLite has no roles).
pub(super) async fn check_privileges(db: &DatabaseConnection) -> Result<(), SchemaError> {
    if db.get_database_backend() != DbBackend::Postgres {
        return Ok(());
    }
    let names = |names: &[&str]| {
        names
            .iter()
            .map(|&name| name.to_owned())
            .collect::<Vec<_>>()
    };
    let rows = db
        .query_all_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            PRIVILEGES_SQL,
            [
                names(&grants::TABLES).into(),
                grants::MIGRATIONS_TABLE.into(),
                names(&grants::SEQUENCES).into(),
                names(&grants::FUNCTIONS).into(),
            ],
        ))
        .await?;
    let missing = rows
        .iter()
        .map(|row| {
            Ok(MissingPrivilege {
                object: row.try_get("", "object")?,
                privilege: row.try_get("", "privilege")?,
            })
        })
        .collect::<Result<Vec<_>, DbErr>>()?;
    if missing.is_empty() {
        return Ok(());
    }
    Err(SchemaError::MissingPrivileges {
        role: current_role(db).await?,
        missing,
    })
}

async fn current_role(db: &DatabaseConnection) -> Result<String, DbErr> {
    let row = db
        .query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT current_user::text AS role",
        ))
        .await?;
    Ok(row
        .map(|row| row.try_get::<String>("", "role"))
        .transpose()?
        .unwrap_or_default())
}
