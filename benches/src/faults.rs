//! Injected failures at the handlers' crash points ([`CrashPoint`]): a plan made by the demo or
//! a test makes a handler die there (as a killed process would), hold there (to line up two
//! concurrent copies), or panic there (a bug the consumer loop must not outlive unnoticed).
//! Each happens once, the first time the handler reaches its point.

use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use inventory_infra::{CrashPoint, FaultPlan, Faults};
use tokio::sync::oneshot;

/// The handler dies the first time it reaches `point`.
pub fn crash_once_at(point: CrashPoint) -> Faults {
    planned(None, Some(point), None).0
}

/// The handler stops the first time it reaches `point` until the [`Hold`] is released.
pub fn hold_once_at(point: CrashPoint) -> (Faults, Hold) {
    planned(Some(point), None, None)
}

/// Held at `hold_at` until released, then dies at `crash_at`: a copy that claimed its key and
/// rolls back while another copy waits for it.
pub fn hold_then_crash(hold_at: CrashPoint, crash_at: CrashPoint) -> (Faults, Hold) {
    planned(Some(hold_at), Some(crash_at), None)
}

/// The handler panics the first time it reaches `point`.
pub fn panic_once_at(point: CrashPoint) -> Faults {
    planned(None, None, Some(point)).0
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

struct Plan {
    hold: Mutex<Option<(CrashPoint, Gate)>>,
    crash: Mutex<Option<CrashPoint>>,
    panic: Mutex<Option<CrashPoint>>,
}

struct Gate {
    reached: oneshot::Sender<()>,
    release: oneshot::Receiver<()>,
}

fn planned(
    hold_at: Option<CrashPoint>,
    crash_at: Option<CrashPoint>,
    panic_at: Option<CrashPoint>,
) -> (Faults, Hold) {
    let (reached_tx, reached_rx) = oneshot::channel();
    let (release_tx, release_rx) = oneshot::channel();
    let gate = Gate {
        reached: reached_tx,
        release: release_rx,
    };
    let plan = Plan {
        hold: Mutex::new(hold_at.map(|point| (point, gate))),
        crash: Mutex::new(crash_at),
        panic: Mutex::new(panic_at),
    };
    let hold = Hold {
        reached: reached_rx,
        release: release_tx,
    };
    (Faults::planned(Arc::new(plan)), hold)
}

impl FaultPlan for Plan {
    fn dies_at(&self, point: CrashPoint) -> BoxFuture<'_, bool> {
        Box::pin(async move {
            let gate = take_if(&self.hold, |(held, _)| *held == point).map(|(_, gate)| gate);
            if let Some(gate) = gate {
                let _ = gate.reached.send(());
                let _ = gate.release.await;
            }
            if take_if(&self.panic, |panic| *panic == point).is_some() {
                panic!("injected panic at {}", point.as_str());
            }
            take_if(&self.crash, |crash| *crash == point).is_some()
        })
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
