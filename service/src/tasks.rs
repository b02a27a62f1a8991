//! The tasks `serve` and `relay` run beside their main work: the health server, the purge, the
//! watchers that feed the metrics. Each runs until the command stops, and every one's end is
//! looked at: one that ends before the stop, or panics at any time, fails the process. Why a
//! task ended ([`early_end`]) and how that is reported ([`report_task_failure`]) are said here
//! for the lanes and the relay too.

use futures::StreamExt as _;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use tokio::task::{AbortHandle, JoinError, JoinHandle};
use tokio_util::sync::CancellationToken;

use crate::health::Liveness;
use crate::metrics::Metrics;

/// A task's name and how it ended.
type Ended = (&'static str, Result<(), JoinError>);

/// The background tasks of one command, stopped together; dropped, it tells them to stop.
pub(crate) struct Background {
    stop: CancellationToken,
    /// After this, a task may end by itself: those that stop with the first signal.
    stopping: CancellationToken,
    running: FuturesUnordered<BoxFuture<'static, Ended>>,
    aborts: Vec<AbortHandle>,
}

impl Drop for Background {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Background {
    /// Tasks that end after `stopping` (the first signal) ended as they should.
    pub(crate) fn new(stopping: CancellationToken) -> Self {
        Self {
            stop: CancellationToken::new(),
            stopping,
            running: FuturesUnordered::new(),
            aborts: Vec::new(),
        }
    }

    /// What the tasks stop on.
    pub(crate) fn stop_token(&self) -> CancellationToken {
        self.stop.clone()
    }

    /// Watches `task`, which runs until [`Self::stop_token`].
    pub(crate) fn adopt(&mut self, name: &'static str, task: JoinHandle<()>) {
        self.aborts.push(task.abort_handle());
        self.running
            .push(Box::pin(async move { (name, task.await) }));
    }

    /// Resolves when a task ends before the command stops, or panics, with why; never while
    /// all run.
    pub(crate) async fn ended_early(&mut self) -> String {
        loop {
            match self.running.next().await {
                Some((_, Ok(()))) if self.stopping.is_cancelled() => {}
                Some((name, ended)) => {
                    return format!("{name} {}", early_end(ended));
                }
                None => std::future::pending::<()>().await,
            }
        }
    }

    /// Stops the tasks and waits for each, until `immediate` at most, when those still running
    /// are aborted; why any failed (a panic).
    pub(crate) async fn stop(mut self, immediate: &CancellationToken) -> Vec<String> {
        self.stop.cancel();
        self.stopping.cancel();
        let mut failures = Vec::new();
        loop {
            tokio::select! {
                ended = self.running.next() => match ended {
                    Some((_, Ok(()))) => {}
                    Some((name, Err(error))) => {
                        failures.push(format!("{name} {}", early_end(Err(error))));
                    }
                    None => return failures,
                },
                () = immediate.cancelled() => {
                    for abort in &self.aborts {
                        abort.abort();
                    }
                    return failures;
                }
            }
        }
    }
}

/// Why a task of the service (a lane, the relay) ended while it should have run, from what its
/// join handle gave.
pub(crate) fn early_end(ended: Result<(), tokio::task::JoinError>) -> String {
    match ended {
        Ok(()) => "returned while the service ran".to_owned(),
        Err(error) => match error.try_into_panic() {
            Ok(panic) => format!("panicked: {}", panic_text(panic.as_ref())),
            Err(error) => format!("was cancelled: {error}"),
        },
    }
}

/// What a panic said, if it said it as text.
fn panic_text(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)")
}

/// The ERROR line, the metric and `/livez` for a task that ended while the service ran.
pub(crate) fn report_task_failure(task: &str, why: &str, metrics: &Metrics, liveness: &Liveness) {
    tracing::error!(task, %why, "a task of the service ended; stopping");
    metrics.task_failed(task);
    liveness.task_failed(task, why);
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Runs until `stop`, then ends, or panics.
    fn until(stop: CancellationToken, panics: bool) -> JoinHandle<()> {
        tokio::spawn(async move {
            stop.cancelled().await;
            assert!(!panics, "a bug met while stopping");
        })
    }

    #[tokio::test]
    async fn a_task_that_panics_while_stopping_is_a_failure() {
        let signal = CancellationToken::new();
        let mut background = Background::new(signal.clone());
        background.adopt("the quiet one", until(background.stop_token(), false));
        background.adopt("the panicking one", until(background.stop_token(), true));
        signal.cancel();
        let failures = background.stop(&CancellationToken::new()).await;
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(
            failures[0].starts_with("the panicking one panicked: a bug met while stopping"),
            "{failures:?}"
        );
    }

    #[tokio::test]
    async fn a_task_that_ends_before_the_first_signal_is_reported_and_one_after_is_not() {
        let signal = CancellationToken::new();
        let mut background = Background::new(signal.clone());
        background.adopt("the purge", tokio::spawn(async {}));
        let why = tokio::time::timeout(Duration::from_secs(5), background.ended_early())
            .await
            .expect("reported at once");
        assert_eq!(why, "the purge returned while the service ran");

        background.adopt("the watcher", until(signal.clone(), false));
        signal.cancel();
        let reported =
            tokio::time::timeout(Duration::from_millis(200), background.ended_early()).await;
        assert!(
            reported.is_err(),
            "a task that stopped with the signal: {reported:?}"
        );
    }
}
