//! Crash points: the places where a handler can be stopped as a killed process would stop, so
//! that each strategy's failure windows can be shown and tested. Every handler passes through
//! its points; what happens there is a [`FaultPlan`], which only the study and the tests
//! provide (`inventory_benches::faults`). A served handler carries [`Faults::none`], and its
//! points do nothing.

use std::sync::Arc;

use futures::future::BoxFuture;

/// The places where a handler can be made to die as a process would.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CrashPoint {
    /// The dedup check or claim ran; the work has not started.
    AfterDedupCheck,
    /// The natural key's statement on PostgreSQL (on a message or a batch) is about to run. It
    /// is the check, the work and the commit at once, so nothing of it is written yet.
    BeforeStatement,
    /// The work ran inside the transaction, which is not committed yet.
    BeforeCommit,
    /// The work committed; the dedup record (check-then-process) or the ack is still to come.
    AfterCommit,
    /// The email went out; the record still says "processing".
    AfterSend,
}

impl CrashPoint {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AfterDedupCheck => "after-dedup-check",
            Self::BeforeStatement => "before-statement",
            Self::BeforeCommit => "before-commit",
            Self::AfterCommit => "after-commit",
            Self::AfterSend => "after-send",
        }
    }
}

/// What happens when a handler reaches a crash point: the study's and the tests' side.
pub trait FaultPlan: Send + Sync {
    /// Awaited as a handler reaches `point` (a plan may hold it there); `true` stops the
    /// handler there, as a crash would.
    fn dies_at(&self, point: CrashPoint) -> BoxFuture<'_, bool>;
}

/// The plan a handler follows at its crash points, if any.
#[derive(Clone, Default)]
pub struct Faults(Option<Arc<dyn FaultPlan>>);

impl Faults {
    /// No injected failure: what `serve` runs with.
    pub fn none() -> Self {
        Self::default()
    }

    pub fn planned(plan: Arc<dyn FaultPlan>) -> Self {
        Self(Some(plan))
    }

    /// Called by handlers at each crash point: `Err` is the point where the handler dies
    /// (a `HandleError::Crashed`).
    pub async fn pass(&self, point: CrashPoint) -> Result<(), CrashPoint> {
        match &self.0 {
            Some(plan) if plan.dies_at(point).await => Err(point),
            _ => Ok(()),
        }
    }
}
