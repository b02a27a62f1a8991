//! The tasks `serve` and `relay` run beside their main work: the health server, the purge, the
//! watchers that feed the metrics. Each runs until the command stops, and every one's end is
//! looked at: one that ends before the stop, or panics at any time, fails the process. Why a
//! task ended (`early_end`) and how that is reported (`report_task_failure`) are said here
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
pub struct Background {
    stop: CancellationToken,
    /// After this, a task may end by itself: those that stop with the first signal.
    stopping: CancellationToken,
    running: FuturesUnordered<BoxFuture<'static, Ended>>,
    aborts: Vec<(&'static str, AbortHandle)>,
}

/// How the background tasks ended once stopped.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Stopped {
    /// Why each task that failed failed (a panic).
    pub(crate) failures: Vec<String>,
    /// The tasks the immediate stop cut short.
    pub(crate) abandoned: Vec<&'static str>,
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

    /// Watches `task`, which runs until `stop_token`; `name` is what the logs and
    /// `inventory_task_failures_total` call it.
    pub fn adopt(&mut self, name: &'static str, task: JoinHandle<()>) {
        self.aborts.push((name, task.abort_handle()));
        self.running
            .push(Box::pin(async move { (name, task.await) }));
    }

    /// Resolves when a task ends before the command stops, or panics: its name, and why; never
    /// while all run.
    pub(crate) async fn ended_early(&mut self) -> (&'static str, String) {
        loop {
            match self.running.next().await {
                Some((_, Ok(()))) if self.stopping.is_cancelled() => {}
                Some((name, ended)) => return (name, early_end(ended)),
                None => std::future::pending::<()>().await,
            }
        }
    }

    /// Stops the tasks and waits for each, until `immediate` at most, when those still running
    /// are aborted.
    pub(crate) async fn stop(mut self, immediate: &CancellationToken) -> Stopped {
        self.stop.cancel();
        self.stopping.cancel();
        let mut stopped = Stopped::default();
        loop {
            tokio::select! {
                ended = self.running.next() => match ended {
                    Some((_, Ok(()))) => {}
                    Some((name, Err(error))) => {
                        stopped.failures.push(format!("{name} {}", early_end(Err(error))));
                    }
                    None => return stopped,
                },
                () = immediate.cancelled() => {
                    for (name, abort) in &self.aborts {
                        if !abort.is_finished() {
                            abort.abort();
                            stopped.abandoned.push(name);
                        }
                    }
                    return stopped;
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
        let stopped = background.stop(&CancellationToken::new()).await;
        assert_eq!(stopped.failures.len(), 1, "{stopped:?}");
        assert!(
            stopped.failures[0].starts_with("the panicking one panicked: a bug met while stopping"),
            "{stopped:?}"
        );
        assert!(stopped.abandoned.is_empty(), "{stopped:?}");
    }

    #[tokio::test]
    async fn the_immediate_stop_abandons_what_still_runs_and_names_it() {
        let mut background = Background::new(CancellationToken::new());
        background.adopt("the quick one", until(background.stop_token(), false));
        background.adopt("the slow one", tokio::spawn(std::future::pending()));
        let immediate = CancellationToken::new();
        let stopping = tokio::spawn({
            let immediate = immediate.clone();
            async move { background.stop(&immediate).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        immediate.cancel();
        let stopped = tokio::time::timeout(Duration::from_secs(5), stopping)
            .await
            .expect("stopped at once")
            .expect("the stop does not panic");
        assert_eq!(
            stopped,
            Stopped {
                failures: Vec::new(),
                abandoned: vec!["the slow one"],
            }
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
        assert_eq!(
            why,
            ("the purge", "returned while the service ran".to_owned())
        );

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
