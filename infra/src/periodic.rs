//! The one loop of the watchers that read a figure now and then (the relay's backlog, the
//! consumer's lag, the dead letters waiting, the study's purge).

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// A watcher's ticks: the first at once, then every period, one look at a time (a period
/// missed while a look ran is not made up), none after the stop.
pub struct Every {
    ticks: tokio::time::Interval,
    stop: CancellationToken,
}

impl Every {
    pub fn new(period: Duration, stop: CancellationToken) -> Self {
        let mut ticks = tokio::time::interval(period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Self { ticks, stop }
    }

    /// Waits for the next tick: false once stopped.
    pub async fn tick(&mut self) -> bool {
        tokio::select! {
            biased;
            () = self.stop.cancelled() => false,
            _ = self.ticks.tick() => true,
        }
    }

    /// `look`, unless the stop comes first: then `None`, and `look` is dropped where it stands.
    pub async fn unless_stopped<T>(&self, look: impl Future<Output = T>) -> Option<T> {
        tokio::select! {
            biased;
            () = self.stop.cancelled() => None,
            seen = look => Some(seen),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn ticks_come_at_once_then_every_period_and_none_after_the_stop() {
        let stop = CancellationToken::new();
        let mut ticks = Every::new(Duration::from_secs(10), stop.clone());
        let start = tokio::time::Instant::now();
        assert!(ticks.tick().await);
        assert_eq!(start.elapsed(), Duration::ZERO);
        assert!(ticks.tick().await);
        assert_eq!(start.elapsed(), Duration::from_secs(10));
        stop.cancel();
        assert!(!ticks.tick().await, "a tick after the stop");
    }

    #[tokio::test(start_paused = true)]
    async fn a_look_in_flight_at_the_stop_is_dropped() {
        let stop = CancellationToken::new();
        let ticks = Every::new(Duration::from_secs(10), stop.clone());
        let stopping = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            stop.cancel();
        });
        let seen = ticks.unless_stopped(std::future::pending::<()>()).await;
        assert_eq!(seen, None);
        stopping.await.expect("the stop does not panic");
        assert_eq!(
            ticks.unless_stopped(async { 7 }).await,
            None,
            "stopped already"
        );
    }
}
