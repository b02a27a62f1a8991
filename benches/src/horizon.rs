//! The redelivery horizon: how long after a message was handled a copy of it can still arrive,
//! so how long its dedup record must be kept. A retention shorter than that lets a late copy
//! find no record and be applied twice.
//!
//! Four things bring a copy back late: JetStream redelivering (a lost ack, a nak), the producer
//! retrying (the stream drops retries only inside its duplicate window, so the inbox must at
//! least cover that), a copy stored in the stream waiting for its first delivery while the
//! consumer lags (as long as the stream's `max_age` keeps it, or, with no `max_age`, an
//! allowance the operator states), and an operator replaying a dead letter (an allowance the
//! operator chooses). The horizon is their sum: a conservative bound, never an estimate.

use std::time::Duration;

/// How the consumer redelivers, as the server has it configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedeliveryPolicy {
    /// Wait for an ack before redelivering, when there is no backoff.
    pub ack_wait: Duration,
    /// JetStream `backoff`: the ack wait of delivery n is `backoff[n-1]`, the last step
    /// repeating; it replaces `ack_wait` when not empty.
    pub backoff: Vec<Duration>,
    /// Deliveries of one message; -1 (or any value below 1) means unlimited.
    pub max_deliver: i64,
    /// The longest delay this service asks for when it naks a transient failure.
    pub longest_nak_delay: Duration,
}

impl RedeliveryPolicy {
    /// The longest time from a delivery until the next one: the ack timeout of delivery `n`
    /// (1-based), or the nak delay, whichever is longer.
    fn gap_after(&self, delivery: usize) -> Duration {
        let ack_timeout = match self.backoff.as_slice() {
            [] => self.ack_wait,
            steps => steps[delivery.saturating_sub(1).min(steps.len() - 1)],
        };
        ack_timeout.max(self.longest_nak_delay)
    }

    /// The longest time JetStream can keep delivering a message after its first delivery: the
    /// sum of the gaps after every delivery (the last one's too, since a copy handled at the
    /// last delivery may still be in flight that long). `None` when deliveries are unlimited.
    pub fn redelivery_span(&self) -> Option<Duration> {
        let deliveries = usize::try_from(self.max_deliver).ok().filter(|&n| n > 0)?;
        Some(
            (1..=deliveries)
                .map(|n| self.gap_after(n))
                .fold(Duration::ZERO, Duration::saturating_add),
        )
    }
}

/// The parts of the horizon, kept apart so a refusal can say where the time comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Horizon {
    /// `None`: the consumer redelivers without limit, so no finite retention is safe.
    pub redelivery: Option<Duration>,
    pub duplicate_window: Duration,
    pub first_delivery: FirstDelivery,
    pub replay_allowance: Duration,
}

/// How long a message stored in the stream can wait for its first delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FirstDelivery {
    /// The stream's `max_age`: an older message is gone from it.
    MaxAge(Duration),
    /// The stream keeps messages without an age limit, so as long as the consumer may lag
    /// behind it: what the operator allows for.
    LagAllowance(Duration),
}

impl FirstDelivery {
    /// From the stream's `max_age` (zero: none) and the operator's lag allowance.
    pub fn new(max_age: Duration, lag_allowance: Duration) -> Self {
        if max_age.is_zero() {
            Self::LagAllowance(lag_allowance)
        } else {
            Self::MaxAge(max_age)
        }
    }

    pub fn wait(self) -> Duration {
        match self {
            Self::MaxAge(wait) | Self::LagAllowance(wait) => wait,
        }
    }
}

impl Horizon {
    pub fn new(
        policy: &RedeliveryPolicy,
        duplicate_window: Duration,
        first_delivery: FirstDelivery,
        replay_allowance: Duration,
    ) -> Self {
        Self {
            redelivery: policy.redelivery_span(),
            duplicate_window,
            first_delivery,
            replay_allowance,
        }
    }

    /// The whole horizon; `None` when unbounded.
    pub fn total(&self) -> Option<Duration> {
        self.redelivery.map(|redelivery| {
            redelivery
                .saturating_add(self.duplicate_window)
                .saturating_add(self.first_delivery.wait())
                .saturating_add(self.replay_allowance)
        })
    }

    /// Whether dedup records kept for `retention` outlive every copy that can still come.
    pub fn check(&self, retention: Duration) -> Result<(), RetentionTooShort> {
        match self.total() {
            Some(horizon) if retention >= horizon => Ok(()),
            horizon => Err(RetentionTooShort { retention, horizon }),
        }
    }
}

/// A retention shorter than the horizon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionTooShort {
    pub retention: Duration,
    /// `None`: unbounded.
    pub horizon: Option<Duration>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    fn policy(ack_wait: u64, backoff: &[u64], max_deliver: i64, nak: u64) -> RedeliveryPolicy {
        RedeliveryPolicy {
            ack_wait: Duration::from_secs(ack_wait),
            backoff: backoff.iter().map(|&s| Duration::from_secs(s)).collect(),
            max_deliver,
            longest_nak_delay: Duration::from_secs(nak),
        }
    }

    #[test]
    fn without_backoff_every_delivery_waits_the_ack_wait() {
        // Given 10 deliveries of a 30 s ack wait and naks of at most 5 s
        let span = policy(30, &[], 10, 5).redelivery_span();
        // Then JetStream may deliver for 10 × 30 s
        assert_eq!(span, Some(Duration::from_secs(300)));
    }

    #[test]
    fn backoff_replaces_the_ack_wait_and_its_last_step_repeats() {
        // Given backoff 1s, 10s, 60s over 5 deliveries
        let span = policy(30, &[1, 10, 60], 5, 0).redelivery_span();
        // Then 1 + 10 + 60 + 60 + 60
        assert_eq!(span, Some(Duration::from_secs(191)));
    }

    #[test]
    fn a_nak_delay_longer_than_the_ack_wait_counts() {
        assert_eq!(
            policy(2, &[], 3, 30).redelivery_span(),
            Some(Duration::from_secs(90))
        );
    }

    #[test]
    fn unlimited_deliveries_have_no_horizon() {
        assert_eq!(policy(30, &[], -1, 0).redelivery_span(), None);
        let horizon = Horizon::new(
            &policy(30, &[], -1, 0),
            SECOND,
            FirstDelivery::LagAllowance(SECOND),
            SECOND,
        );
        assert_eq!(horizon.total(), None);
        let forever = Duration::from_secs(u64::MAX);
        assert_eq!(
            horizon.check(forever),
            Err(RetentionTooShort {
                retention: forever,
                horizon: None
            })
        );
    }

    #[test]
    fn the_horizon_adds_the_duplicate_window_the_first_delivery_and_the_replay_allowance() {
        // Given 300 s of redeliveries, a 2 min duplicate window, a stream keeping messages 10 min
        // and a 1 h replay allowance
        let horizon = Horizon::new(
            &policy(30, &[], 10, 5),
            Duration::from_secs(120),
            FirstDelivery::new(Duration::from_secs(600), Duration::from_secs(86_400)),
            Duration::from_secs(3_600),
        );
        let total = Duration::from_secs(300 + 120 + 600 + 3_600);
        assert_eq!(horizon.total(), Some(total));
        // Then a retention of exactly the horizon passes, one second less is refused
        assert_eq!(horizon.check(total), Ok(()));
        assert_eq!(
            horizon.check(total - SECOND),
            Err(RetentionTooShort {
                retention: total - SECOND,
                horizon: Some(total)
            })
        );
    }

    #[test]
    fn a_stream_without_max_age_counts_the_lag_allowance_and_one_with_it_its_max_age() {
        let hour = Duration::from_secs(3_600);
        assert_eq!(
            FirstDelivery::new(Duration::ZERO, hour),
            FirstDelivery::LagAllowance(hour)
        );
        assert_eq!(
            FirstDelivery::new(10 * hour, hour),
            FirstDelivery::MaxAge(10 * hour)
        );
        // A long max_age outweighs a short lag allowance: the stream may hold a copy that long.
        assert_eq!(FirstDelivery::new(10 * hour, hour).wait(), 10 * hour);
    }
}
