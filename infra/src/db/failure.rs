//! What a database error means for a retry, read from the code the database gave it (SQLSTATE
//! on PostgreSQL, the extended result code on SQLite) or from sea-orm's and sqlx's error types,
//! never from its text.

use std::fmt;

use sea_orm::sqlx::postgres::PgDatabaseError;
use sea_orm::sqlx::sqlite::SqliteError;
use sea_orm::sqlx::{self, error::DatabaseError};
use sea_orm::{DbErr, RuntimeErr};

/// How a database failure bears on trying the same work again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DbFailure {
    /// The database cannot be reached or is not taking work: connection lost or refused, pool
    /// timeout, shutting down, out of connections or disk, a standby after a failover.
    Unavailable,
    /// This transaction lost to a concurrent one: deadlock, serialization failure, lock
    /// timeout, SQLite busy or locked.
    Conflict,
    /// The database refuses this work itself and will refuse it again: a constraint violation,
    /// a data exception, a stored value that does not decode into its type.
    Refused,
    /// Nothing says it is permanent. Most failures of a shared database pass, and the delivery
    /// cap ends one that does not, so these are retried.
    Unknown,
}

impl DbFailure {
    /// What `error` means for a retry.
    pub fn of(error: &DbErr) -> Self {
        match error {
            DbErr::ConnectionAcquire(_) | DbErr::Conn(_) => Self::Unavailable,
            DbErr::Exec(runtime) | DbErr::Query(runtime) => match runtime {
                RuntimeErr::SqlxError(error) => Self::of_sqlx(error),
                _ => Self::Unknown,
            },
            // sea-orm's conversions of a column's value into its Rust type.
            DbErr::Type(_) | DbErr::TryIntoErr { .. } | DbErr::Json(_) => Self::Refused,
            _ => Self::Unknown,
        }
    }

    fn of_sqlx(error: &sqlx::Error) -> Self {
        match error {
            sqlx::Error::Database(database) => DbErrorCode::of_database(database.as_ref())
                .map_or(Self::Unknown, |code| code.failure()),
            sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed
            | sqlx::Error::BeginFailed => Self::Unavailable,
            sqlx::Error::ColumnDecode { .. } | sqlx::Error::Decode(_) | sqlx::Error::Encode(_) => {
                Self::Refused
            }
            _ => Self::Unknown,
        }
    }

    /// Whether the same work may succeed later.
    pub fn is_transient(self) -> bool {
        self != Self::Refused
    }
}

/// The code a database answered an error with.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum DbErrorCode {
    /// PostgreSQL's SQLSTATE, such as `40P01`.
    Sqlstate(String),
    /// SQLite's extended result code, such as 2067 (a unique constraint).
    Sqlite(i32),
}

impl DbErrorCode {
    /// The code of `error`, if it is the database's own answer.
    pub fn of(error: &DbErr) -> Option<Self> {
        let (DbErr::Exec(RuntimeErr::SqlxError(error))
        | DbErr::Query(RuntimeErr::SqlxError(error))
        | DbErr::Conn(RuntimeErr::SqlxError(error))) = error
        else {
            return None;
        };
        match error.as_ref() {
            sqlx::Error::Database(database) => Self::of_database(database.as_ref()),
            _ => None,
        }
    }

    fn of_database(error: &dyn DatabaseError) -> Option<Self> {
        if let Some(postgres) = error.try_downcast_ref::<PgDatabaseError>() {
            return Some(Self::Sqlstate(postgres.code().to_owned()));
        }
        error.try_downcast_ref::<SqliteError>()?;
        error.code()?.parse().ok().map(Self::Sqlite)
    }

    pub fn failure(&self) -> DbFailure {
        match self {
            Self::Sqlstate(code) => sqlstate_failure(code),
            Self::Sqlite(code) => sqlite_failure(*code),
        }
    }
}

impl fmt::Display for DbErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Sqlstate(code) => write!(f, "SQLSTATE {code}"),
            Self::Sqlite(code) => write!(f, "SQLite code {code}"),
        }
    }
}

/// PostgreSQL's error codes (appendix A of its manual): the first two characters are the class.
fn sqlstate_failure(code: &str) -> DbFailure {
    match code {
        // serialization_failure, deadlock_detected, lock_not_available (lock_timeout, NOWAIT).
        "40001" | "40P01" | "55P03" => DbFailure::Conflict,
        // admin_shutdown, crash_shutdown, cannot_connect_now; read_only_sql_transaction: a
        // connection to a server that became a standby in a failover.
        "57P01" | "57P02" | "57P03" | "25006" => DbFailure::Unavailable,
        _ => match code.get(..2) {
            // connection_exception; insufficient_resources (too_many_connections, disk_full,
            // out_of_memory).
            Some("08" | "53") => DbFailure::Unavailable,
            // data_exception; integrity_constraint_violation.
            Some("22" | "23") => DbFailure::Refused,
            _ => DbFailure::Unknown,
        },
    }
}

/// SQLite's result codes (sqlite.org/rescode.html): an extended code's low byte is its primary.
fn sqlite_failure(code: i32) -> DbFailure {
    const BUSY: i32 = 5;
    const LOCKED: i32 = 6;
    const IOERR: i32 = 10;
    const FULL: i32 = 13;
    const CANTOPEN: i32 = 14;
    const TOOBIG: i32 = 18;
    const CONSTRAINT: i32 = 19;
    const MISMATCH: i32 = 20;
    match code & 0xff {
        BUSY | LOCKED => DbFailure::Conflict,
        IOERR | FULL | CANTOPEN => DbFailure::Unavailable,
        TOOBIG | CONSTRAINT | MISMATCH => DbFailure::Refused,
        _ => DbFailure::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_are_classified() {
        let table = [
            ("40P01", DbFailure::Conflict),    // deadlock_detected
            ("40001", DbFailure::Conflict),    // serialization_failure
            ("55P03", DbFailure::Conflict),    // lock_not_available
            ("57P01", DbFailure::Unavailable), // admin_shutdown
            ("57P02", DbFailure::Unavailable), // crash_shutdown
            ("57P03", DbFailure::Unavailable), // cannot_connect_now
            ("25006", DbFailure::Unavailable), // read_only_sql_transaction
            ("08000", DbFailure::Unavailable), // connection_exception
            ("08006", DbFailure::Unavailable), // connection_failure
            ("08001", DbFailure::Unavailable), // sqlclient_unable_to_establish_sqlconnection
            ("08P01", DbFailure::Unavailable), // protocol_violation
            ("53300", DbFailure::Unavailable), // too_many_connections
            ("53100", DbFailure::Unavailable), // disk_full
            ("23505", DbFailure::Refused),     // unique_violation
            ("23503", DbFailure::Refused),     // foreign_key_violation
            ("23502", DbFailure::Refused),     // not_null_violation
            ("23514", DbFailure::Refused),     // check_violation
            ("22003", DbFailure::Refused),     // numeric_value_out_of_range
            ("22012", DbFailure::Refused),     // division_by_zero
            ("22P02", DbFailure::Refused),     // invalid_text_representation
            ("22001", DbFailure::Refused),     // string_data_right_truncation
            ("57014", DbFailure::Unknown),     // query_canceled (statement_timeout)
            ("40003", DbFailure::Unknown),     // statement_completion_unknown
            ("42P01", DbFailure::Unknown),     // undefined_table: a deploy, not the message
            ("XX000", DbFailure::Unknown),     // internal_error
            ("", DbFailure::Unknown),
        ];
        for (code, failure) in table {
            let code = DbErrorCode::Sqlstate(code.into());
            assert_eq!(code.failure(), failure, "{code}");
        }
    }

    #[test]
    fn sqlite_result_codes_are_classified() {
        let table = [
            (5, DbFailure::Conflict),     // SQLITE_BUSY
            (517, DbFailure::Conflict),   // SQLITE_BUSY_SNAPSHOT
            (6, DbFailure::Conflict),     // SQLITE_LOCKED
            (262, DbFailure::Conflict),   // SQLITE_LOCKED_SHAREDCACHE
            (10, DbFailure::Unavailable), // SQLITE_IOERR
            (13, DbFailure::Unavailable), // SQLITE_FULL
            (14, DbFailure::Unavailable), // SQLITE_CANTOPEN
            (1555, DbFailure::Refused),   // SQLITE_CONSTRAINT_PRIMARYKEY
            (2067, DbFailure::Refused),   // SQLITE_CONSTRAINT_UNIQUE
            (275, DbFailure::Refused),    // SQLITE_CONSTRAINT_CHECK
            (787, DbFailure::Refused),    // SQLITE_CONSTRAINT_FOREIGNKEY
            (20, DbFailure::Refused),     // SQLITE_MISMATCH
            (18, DbFailure::Refused),     // SQLITE_TOOBIG
            (1, DbFailure::Unknown),      // SQLITE_ERROR
            (11, DbFailure::Unknown),     // SQLITE_CORRUPT: the whole file, not this message
        ];
        for (code, failure) in table {
            let code = DbErrorCode::Sqlite(code);
            assert_eq!(code.failure(), failure, "{code}");
        }
    }

    #[test]
    fn errors_without_a_code_are_classified_by_type() {
        use sea_orm::ConnAcquireErr;
        let sqlx_error =
            |error: sqlx::Error| DbErr::Exec(RuntimeErr::SqlxError(std::sync::Arc::new(error)));
        let table = [
            (
                DbErr::ConnectionAcquire(ConnAcquireErr::Timeout),
                DbFailure::Unavailable,
            ),
            (
                DbErr::ConnectionAcquire(ConnAcquireErr::ConnectionClosed),
                DbFailure::Unavailable,
            ),
            (
                sqlx_error(sqlx::Error::PoolTimedOut),
                DbFailure::Unavailable,
            ),
            (sqlx_error(sqlx::Error::PoolClosed), DbFailure::Unavailable),
            (
                sqlx_error(sqlx::Error::Io(std::io::ErrorKind::ConnectionReset.into())),
                DbFailure::Unavailable,
            ),
            (
                sqlx_error(sqlx::Error::Protocol("unexpected message".into())),
                DbFailure::Unavailable,
            ),
            (
                sqlx_error(sqlx::Error::Decode("not a uuid".into())),
                DbFailure::Refused,
            ),
            (DbErr::Type("not an i32".into()), DbFailure::Refused),
            (sqlx_error(sqlx::Error::RowNotFound), DbFailure::Unknown),
            (DbErr::RecordNotFound("row".into()), DbFailure::Unknown),
            (DbErr::Custom("anything".into()), DbFailure::Unknown),
        ];
        for (error, failure) in table {
            assert_eq!(DbFailure::of(&error), failure, "{error}");
            assert_eq!(DbErrorCode::of(&error), None, "{error}");
        }
    }
}
