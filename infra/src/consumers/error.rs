//! Why a handler failed, and what that means for the delivery: [`HandleError::kind`].

use inventory_domain::{BookId, DeadLetterReason, ErrorKind, Refusal};
use sea_orm::DbErr;

use crate::db::{DbErrorCode, DbFailure};
use crate::faults::CrashPoint;
use crate::stock::DataError;

/// Why handling failed without an outcome. Nothing of the message was acknowledged;
/// [`HandleError::kind`] says whether it is retried, dead-lettered, or left to its ack wait.
///
/// `Clone`, so the one failure of a batch statement is each of its messages' failure, with its
/// database code and kind intact.
#[derive(Debug, Clone, thiserror::Error)]
pub enum HandleError {
    /// The database failed; its [`DbFailure`] says whether for good.
    #[error("database error{code}: {0}", code = code_note(.0))]
    Database(#[from] DbErr),
    /// Stored data the handler cannot use, which no retry changes.
    #[error("unusable data: {0}")]
    Data(#[from] DataError),
    /// A service the handler depends on beside the database (the study's email provider) did
    /// not take the call: retry later.
    #[error("{0}")]
    Unavailable(String),
    /// A crash injected at this point (the study's and the tests' `FaultPlan`): the handler
    /// "died" there, as a killed process would.
    #[error("crashed at {}", .0.as_str())]
    Crashed(CrashPoint),
    /// The database work did not finish within the client's bound (a server gone silent, a
    /// link dropped without a word) and was abandoned, its connection closed. Whether it
    /// committed is unknown: the retry finds out.
    #[error("database work abandoned after {0:?} without an answer")]
    TimedOut(std::time::Duration),
    /// On a shard: the database does not own the partition of the placement's book, so it
    /// decided nothing. The instance's view of the assignment lags, or the partition is moving;
    /// the shard that owns it decides the message.
    #[error("book {book}'s partition is not owned by this shard's database")]
    NotOwned { book: BookId },
    /// An invariant of this program does not hold (a statement returned fewer rows than it
    /// was given): a bug, which no retry fixes and no dead letter explains.
    #[error("internal error: {0}")]
    Internal(&'static str),
}

impl From<CrashPoint> for HandleError {
    fn from(point: CrashPoint) -> Self {
        Self::Crashed(point)
    }
}

/// The database's code in the message, so a log line says which failure it was.
fn code_note(error: &DbErr) -> String {
    DbErrorCode::of(error).map_or_else(String::new, |code| format!(" ({code})"))
}

impl HandleError {
    /// A failure of a statement the raw sqlx paths (natural_pg.rs, natural_sqlite.rs) ran
    /// themselves, as sea-orm would have reported it, so it is judged as any other.
    pub(crate) fn from_sqlx(error: sea_orm::sqlx::Error) -> Self {
        Self::Database(DbErr::Exec(sea_orm::RuntimeErr::SqlxError(
            std::sync::Arc::new(error),
        )))
    }

    /// What becomes of the delivery. A permanent failure is dead-lettered as
    /// `needs-reconciliation`: the stored data or a constraint stands in its way, and a person
    /// has to settle that before a replay can succeed.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Database(error) if DbFailure::of(error).is_transient() => ErrorKind::Transient,
            Self::Database(_) | Self::Data(_) => ErrorKind::Permanent(Refusal {
                reason: DeadLetterReason::NeedsReconciliation,
                detail: self.to_string(),
            }),
            Self::Unavailable(_) | Self::TimedOut(_) => ErrorKind::Transient,
            Self::NotOwned { .. } => ErrorKind::NotOwned,
            Self::Internal(_) => ErrorKind::Internal,
            // Transient to the policy, as any failure another attempt would get past; the
            // consumer loop settles it before asking, leaving the delivery unacked as a dead
            // process would.
            Self::Crashed(_) => ErrorKind::Transient,
        }
    }

    /// A failure of the database, which may be down as a whole: the consumer checks whether
    /// it is reachable before fetching more.
    pub fn is_database(&self) -> bool {
        matches!(self, Self::Database(_) | Self::TimedOut(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn permanent(error: &HandleError) -> Refusal {
        match error.kind() {
            ErrorKind::Permanent(refusal) => refusal,
            other => panic!("{error} is {other:?}, not permanent"),
        }
    }

    #[test]
    fn kinds_follow_the_error_type() {
        let provider = HandleError::Unavailable("email provider unavailable: down".into());
        assert_eq!(provider.kind(), ErrorKind::Transient);
        let unknown = HandleError::from(DbErr::Custom("anything".into()));
        assert_eq!(unknown.kind(), ErrorKind::Transient);
        assert!(unknown.is_database());
        let silent = HandleError::TimedOut(std::time::Duration::from_secs(16));
        assert_eq!(silent.kind(), ErrorKind::Transient);
        assert!(silent.is_database());
    }

    #[test]
    fn unusable_stored_data_is_permanent_and_says_what() {
        let corrupt = HandleError::from(DataError::Unreadable {
            column: "reservation status",
            value: "\"reserv\"".into(),
        });
        let refusal = permanent(&corrupt);
        assert_eq!(refusal.reason, DeadLetterReason::NeedsReconciliation);
        assert_eq!(
            refusal.detail,
            "unusable data: stored reservation status \"reserv\" is not valid"
        );
        assert!(!corrupt.is_database());
        let undecodable = HandleError::from(DbErr::Type("NULL in book_found".into()));
        assert_eq!(
            permanent(&undecodable).reason,
            DeadLetterReason::NeedsReconciliation
        );
    }
}
