//! How `serve` and `relay` stop, in one place: one tree of cancellation tokens, one set of
//! tasks, one exit path.
//!
//! - [`Shutdown`]: the root token is the immediate stop (the second signal, or the shutdown
//!   timeout after the first); its child, the graceful one, is the first signal. Cancelling the
//!   root cancels the child, so whatever waits on the graceful stop also sees the immediate one.
//! - [`Background`]: every task a command runs beside its main work (the health server, the
//!   relay, the watchers, the study's purge) is spawned on its one `JoinSet`, under a name. Each
//!   one's end is looked at: one that ends before the first signal, or fails or panics at any
//!   time, fails the process, with what it said. (A `JoinSet` rather than a `TaskTracker`: the
//!   tracker does not say how a task ended.)
//! - `Background::finish`: the exit path of both commands: the main work ends (or a task
//!   fails, which stops it), then the tasks stop, then the NATS connection drains, each within
//!   the immediate stop.

use std::collections::HashMap;
use std::time::Duration;

use inventory_infra::jetstream;
use tokio::task::{Id, JoinError, JoinSet};
use tokio_util::sync::CancellationToken;

use crate::health::Liveness;
use crate::metrics::Metrics;

/// How a command is asked to stop: `graceful` stops taking work and waits for what is in
/// flight; `immediate` gives up waiting. `immediate` is the root: cancelled, it cancels
/// `graceful` too.
#[derive(Clone)]
pub struct Shutdown {
    pub graceful: CancellationToken,
    pub immediate: CancellationToken,
}

impl Shutdown {
    /// The whole stop: the lanes' drain, the relay's last pass and hand-back, the NATS drain.
    /// Well inside the 30 s an orchestrator waits by default before it kills the process.
    pub const TIMEOUT: Duration = Duration::from_secs(20);

    /// A stop bounded as a whole: `timeout` after the graceful stop begins, the immediate one
    /// follows and cuts short whatever still waits on it (in-flight messages, the relay's last
    /// pass, the NATS drain), so that the process ends before its supervisor kills it.
    pub fn new(timeout: Duration) -> Self {
        let immediate = CancellationToken::new();
        let shutdown = Self {
            graceful: immediate.child_token(),
            immediate,
        };
        let bound = shutdown.clone();
        // Holds nothing but the tokens: it ends with them, or with the runtime.
        tokio::spawn(async move {
            bound.graceful.cancelled().await;
            tokio::select! {
                () = bound.immediate.cancelled() => {}
                () = tokio::time::sleep(timeout) => {
                    tracing::warn!(
                        timeout = %humantime::format_duration(timeout),
                        "the shutdown timeout ran out: stopping at once"
                    );
                    bound.immediate.cancel();
                }
            }
        });
        shutdown
    }

    /// [`Self::new`], with the signal handlers: the first SIGINT or SIGTERM asks for a graceful
    /// stop, the second for an immediate one.
    pub fn on_signals(timeout: Duration) -> std::io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        let mut interrupt = signal(SignalKind::interrupt())?;
        let mut terminate = signal(SignalKind::terminate())?;
        let shutdown = Self::new(timeout);
        let signals = shutdown.clone();
        tokio::spawn(async move {
            for token in [&signals.graceful, &signals.immediate] {
                tokio::select! {
                    _ = interrupt.recv() => {}
                    _ = terminate.recv() => {}
                }
                token.cancel();
                if token == &signals.graceful {
                    tracing::info!("signal received: stopping; a second signal stops at once");
                }
            }
        });
        Ok(shutdown)
    }
}

/// The tasks one command runs beside its main work; dropped, they are aborted.
pub struct Background {
    shutdown: Shutdown,
    /// Cancelled once the main work ended: what must outlive it (the relay's last pass, the
    /// health server) stops on this rather than on the first signal.
    after_main: CancellationToken,
    tasks: JoinSet<anyhow::Result<()>>,
    names: HashMap<Id, &'static str>,
}

/// How a command's work and its background tasks ended.
#[derive(Debug)]
pub(crate) struct Finished<T> {
    /// What the main work came to.
    pub(crate) main: T,
    /// Why each task that failed failed: it ended before the first signal, or panicked.
    pub(crate) failures: Vec<String>,
    /// The tasks the immediate stop cut short.
    pub(crate) abandoned: Vec<&'static str>,
    /// Whether the NATS connection flushed and drained in time.
    pub(crate) drained: bool,
}

impl Background {
    pub(crate) fn new(shutdown: &Shutdown) -> Self {
        Self {
            after_main: shutdown.immediate.child_token(),
            shutdown: shutdown.clone(),
            tasks: JoinSet::new(),
            names: HashMap::new(),
        }
    }

    /// What a task that must outlive the main work stops on.
    pub(crate) fn after_main(&self) -> CancellationToken {
        self.after_main.clone()
    }

    /// Cancelled at the first signal: what a task that stops with the main work stops on.
    pub fn graceful(&self) -> CancellationToken {
        self.shutdown.graceful.clone()
    }

    /// Runs `task` until it stops on one of the tokens above, or fails; `name` is what the
    /// logs and `inventory_task_failures_total` call it.
    pub fn spawn(
        &mut self,
        name: &'static str,
        task: impl Future<Output = anyhow::Result<()>> + Send + 'static,
    ) {
        let id = self.tasks.spawn(task).id();
        self.names.insert(id, name);
    }

    fn name(&self, id: Id) -> &'static str {
        self.names.get(&id).copied().unwrap_or("task")
    }

    /// Resolves when a task ends before the first signal, or fails, or panics: its name, and
    /// why; never while all run.
    async fn ended_early(&mut self) -> (&'static str, String) {
        loop {
            match self.tasks.join_next_with_id().await {
                Some(Ok((_, Ok(())))) if self.shutdown.graceful.is_cancelled() => {}
                Some(Ok((id, ended))) => return (self.name(id), early_end(Ok(ended))),
                Some(Err(error)) => return (self.name(error.id()), early_end(Err(error))),
                None => std::future::pending::<()>().await,
            }
        }
    }

    /// Waits for `main` while watching the tasks (one that fails is reported and stops the
    /// main work, as a signal would); then stops the tasks and waits for each, those still
    /// running at the immediate stop aborted; then drains `client`, within the same bound.
    pub(crate) async fn finish<T>(
        mut self,
        main: impl Future<Output = T>,
        client: &jetstream::Client,
        metrics: &Metrics,
        liveness: &Liveness,
    ) -> Finished<T> {
        let mut failures = Vec::new();
        tokio::pin!(main);
        let main = tokio::select! {
            ended = &mut main => ended,
            (task, why) = self.ended_early() => {
                tracing::error!(task, %why, "a task of the service ended; stopping");
                metrics.task_failed(task);
                liveness.task_failed(task, &why);
                failures.push(format!("{task} {why}"));
                self.shutdown.graceful.cancel();
                main.await
            }
        };
        let (stopped, abandoned) = self.stop().await;
        failures.extend(stopped);
        Finished {
            main,
            failures,
            abandoned,
            drained: drain(client, &self.shutdown.immediate).await,
        }
    }

    /// Stops the tasks and waits for each, until the immediate stop at most, when those still
    /// running are aborted: why each that failed failed, and the names of those aborted.
    async fn stop(&mut self) -> (Vec<String>, Vec<&'static str>) {
        self.shutdown.graceful.cancel();
        self.after_main.cancel();
        let mut failures = Vec::new();
        loop {
            tokio::select! {
                ended = self.tasks.join_next_with_id() => match ended {
                    Some(ended) => failures.extend(self.failure(ended)),
                    None => return (failures, Vec::new()),
                },
                () = self.shutdown.immediate.cancelled() => break,
            }
        }
        self.tasks.abort_all();
        let mut abandoned = Vec::new();
        while let Some(ended) = self.tasks.join_next_with_id().await {
            match ended {
                Err(error) if error.is_cancelled() => abandoned.push(self.name(error.id())),
                ended => failures.extend(self.failure(ended)),
            }
        }
        (failures, abandoned)
    }

    /// Why a task that ended while stopping failed (its name first), if it did.
    fn failure(&self, ended: Result<(Id, anyhow::Result<()>), JoinError>) -> Option<String> {
        let (id, ended) = match ended {
            Ok((_, Ok(()))) => return None,
            Ok((id, failed)) => (id, Ok(failed)),
            Err(error) => (error.id(), Err(error)),
        };
        Some(format!("{} {}", self.name(id), early_end(ended)))
    }
}

/// Flushes what the NATS connection holds (the acks of the last messages, the relay's last
/// publishes) onto the socket, then drains it, unless the stop's time runs out first; whether
/// it did. The flush is what waits: the client's `drain` only asks for one and returns.
async fn drain(client: &jetstream::Client, immediate: &CancellationToken) -> bool {
    let flushed = async {
        client.flush().await?;
        client.drain().await?;
        Ok::<_, anyhow::Error>(())
    };
    tokio::select! {
        biased;
        () = immediate.cancelled() => false,
        done = flushed => match done {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(%error, "flushing and draining the NATS connection");
                false
            }
        },
    }
}

/// Why a task of the service (a lane, the relay) ended while it should have run, from what its
/// join handle gave.
pub(crate) fn early_end(ended: Result<anyhow::Result<()>, JoinError>) -> String {
    match ended {
        Ok(Ok(())) => "returned while the service ran".to_owned(),
        Ok(Err(error)) => format!("failed: {error:#}"),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs until `stop`, then ends, or panics.
    async fn until(stop: CancellationToken, panics: bool) -> anyhow::Result<()> {
        stop.cancelled().await;
        assert!(!panics, "a bug met while stopping");
        Ok(())
    }

    /// A shutdown with no timeout to speak of: the tests cancel its tokens themselves.
    fn shutdown() -> Shutdown {
        Shutdown::new(Duration::from_secs(3600))
    }

    #[tokio::test]
    async fn a_task_that_panics_while_stopping_is_a_failure() {
        let shutdown = shutdown();
        let mut background = Background::new(&shutdown);
        background.spawn("the quiet one", until(background.after_main(), false));
        background.spawn("the panicking one", until(background.after_main(), true));
        shutdown.graceful.cancel();
        let (failures, abandoned) = background.stop().await;
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(
            failures[0].starts_with("the panicking one panicked: a bug met while stopping"),
            "{failures:?}"
        );
        assert!(abandoned.is_empty(), "{abandoned:?}");
    }

    /// What a failed task said is the failure's reason, before the first signal and while
    /// stopping alike.
    #[tokio::test]
    async fn a_task_that_fails_is_reported_with_what_it_said() {
        let shutdown = shutdown();
        let mut background = Background::new(&shutdown);
        background.spawn("the watcher", async {
            anyhow::bail!("the partitions changed")
        });
        let why = tokio::time::timeout(Duration::from_secs(5), background.ended_early())
            .await
            .expect("reported at once");
        assert_eq!(
            why,
            ("the watcher", "failed: the partitions changed".to_owned())
        );

        let stop = background.after_main();
        background.spawn("the relay", async move {
            stop.cancelled().await;
            anyhow::bail!("its last pass failed")
        });
        let (failures, abandoned) = background.stop().await;
        assert_eq!(failures, ["the relay failed: its last pass failed"]);
        assert!(abandoned.is_empty(), "{abandoned:?}");
    }

    #[tokio::test]
    async fn the_immediate_stop_abandons_what_still_runs_and_names_it() {
        let shutdown = shutdown();
        let mut background = Background::new(&shutdown);
        background.spawn("the quick one", until(background.after_main(), false));
        background.spawn("the slow one", std::future::pending());
        let stopping = tokio::spawn(async move { background.stop().await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        shutdown.immediate.cancel();
        let (failures, abandoned) = tokio::time::timeout(Duration::from_secs(5), stopping)
            .await
            .expect("stopped at once")
            .expect("the stop does not panic");
        assert!(failures.is_empty(), "{failures:?}");
        assert_eq!(abandoned, vec!["the slow one"]);
    }

    #[tokio::test]
    async fn a_task_that_ends_before_the_first_signal_is_reported_and_one_after_is_not() {
        let shutdown = shutdown();
        let mut background = Background::new(&shutdown);
        background.spawn("the purge", async { Ok(()) });
        let why = tokio::time::timeout(Duration::from_secs(5), background.ended_early())
            .await
            .expect("reported at once");
        assert_eq!(
            why,
            ("the purge", "returned while the service ran".to_owned())
        );

        background.spawn("the watcher", until(background.graceful(), false));
        shutdown.graceful.cancel();
        let reported =
            tokio::time::timeout(Duration::from_millis(200), background.ended_early()).await;
        assert!(
            reported.is_err(),
            "a task that stopped with the signal: {reported:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_immediate_stop_follows_the_graceful_one_after_the_timeout_and_cancels_it() {
        let bounded = Shutdown::new(Duration::from_secs(20));
        bounded.graceful.cancel();
        tokio::time::sleep(Duration::from_secs(19)).await;
        assert!(!bounded.immediate.is_cancelled(), "before the timeout");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(bounded.immediate.is_cancelled(), "after the timeout");

        let at_once = shutdown();
        at_once.immediate.cancel();
        assert!(
            at_once.graceful.is_cancelled(),
            "the root cancels its child"
        );
    }
}
