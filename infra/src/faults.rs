//! Injected failures, for the study and the tests only (the `harness` feature): a handler
//! passes through each [`CrashPoint`], and a plan made by a test or the demo can make it die
//! there (as a killed process would) or hold it there (to line up two concurrent copies). A
//! handler built without a plan carries `Faults::none()`, which does nothing; the serving
//! binary is built without the feature, so its handlers have no crash points at all.

use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use crate::consumers::HandleError;

/// The places where a handler can be made to die as a process would, so the failure windows of
/// each strategy can be shown and tested.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CrashPoint {
    /// The dedup check or claim ran; the work has not started.
    AfterDedupCheck,
    /// The natural key's one statement (or batch statement) on PostgreSQL is about to run. It
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

#[derive(Clone, Default)]
pub struct Faults {
    plan: Option<Arc<Plan>>,
}

struct Plan {
    crash: Mutex<Option<CrashPoint>>,
    hold: Mutex<Option<(CrashPoint, Gate)>>,
    /// Panics there instead: a bug in a handler, which the consumer loop must not outlive
    /// unnoticed.
    panic: Mutex<Option<CrashPoint>>,
}

struct Gate {
    reached: oneshot::Sender<()>,
    release: oneshot::Receiver<()>,
}

/// The test's side of a hold: wait until the handler is parked, then let it go on.
pub struct Hold {
    reached: oneshot::Receiver<()>,
    release: oneshot::Sender<()>,
}

impl Hold {
    /// Resolves once the handler stands at the held point.
    pub async fn reached(&mut self) {
        // A dropped sender means the handler ended before the point: nothing to wait for.
        let _ = (&mut self.reached).await;
    }

    pub fn release(self) {
        let _ = self.release.send(());
    }
}

impl Faults {
    /// No injected failure: what production runs with.
    pub fn none() -> Self {
        Self::default()
    }

    /// The handler dies the first time it reaches `point`.
    pub fn crash_once_at(point: CrashPoint) -> Self {
        Self::planned(None, Some(point)).0
    }

    /// The handler stops the first time it reaches `point` until the [`Hold`] is released.
    pub fn hold_once_at(point: CrashPoint) -> (Self, Hold) {
        Self::planned(Some(point), None)
    }

    /// Held at `hold_at` until released, then dies at `crash_at`: a copy that claimed its key
    /// and rolls back while another copy waits for it.
    pub fn hold_then_crash(hold_at: CrashPoint, crash_at: CrashPoint) -> (Self, Hold) {
        Self::planned(Some(hold_at), Some(crash_at))
    }

    /// The handler panics the first time it reaches `point`.
    pub fn panic_once_at(point: CrashPoint) -> Self {
        let faults = Self::planned(None, None).0;
        if let Some(plan) = &faults.plan {
            *plan
                .panic
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(point);
        }
        faults
    }

    fn planned(hold_at: Option<CrashPoint>, crash_at: Option<CrashPoint>) -> (Self, Hold) {
        let (reached_tx, reached_rx) = oneshot::channel();
        let (release_tx, release_rx) = oneshot::channel();
        let gate = Gate {
            reached: reached_tx,
            release: release_rx,
        };
        let faults = Self {
            plan: Some(Arc::new(Plan {
                crash: Mutex::new(crash_at),
                hold: Mutex::new(hold_at.map(|point| (point, gate))),
                panic: Mutex::new(None),
            })),
        };
        let hold = Hold {
            reached: reached_rx,
            release: release_tx,
        };
        (faults, hold)
    }

    /// Called by handlers at each crash point.
    pub(crate) async fn pass(&self, point: CrashPoint) -> Result<(), HandleError> {
        let Some(plan) = &self.plan else {
            return Ok(());
        };
        let gate = take_if(&plan.hold, |(held, _)| *held == point).map(|(_, gate)| gate);
        if let Some(gate) = gate {
            let _ = gate.reached.send(());
            let _ = gate.release.await;
        }
        if take_if(&plan.panic, |panic| *panic == point).is_some() {
            panic!("injected panic at {}", point.as_str());
        }
        match take_if(&plan.crash, |crash| *crash == point) {
            Some(point) => Err(HandleError::Crashed(point)),
            None => Ok(()),
        }
    }
}

fn take_if<T>(slot: &Mutex<Option<T>>, matches: impl Fn(&T) -> bool) -> Option<T> {
    let mut slot = slot.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if slot.as_ref().is_some_and(matches) {
        slot.take()
    } else {
        None
    }
}
