//! The delivery policy: what becomes of a delivery, decided from plain values. The consumer loop
//! only performs the [`Action`] this returns, so every row of the policy has a unit test here.

use std::time::Duration;

use inventory_domain::{DeadLetterReason, Effect, ErrorKind, Outcome};

/// The consumer's redelivery settings, as the server has them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The consumer's `max_deliver`; -1 (or 0) for unlimited.
    pub max_deliver: i64,
    /// Delay before the second delivery after a transient failure; doubles per delivery.
    pub retry_delay: Duration,
    /// The longest delay between deliveries.
    pub max_retry_delay: Duration,
}

impl RetryPolicy {
    /// Delay before the next try after `delivered` failed deliveries: doubling, capped.
    pub fn delay_after(&self, delivered: i64) -> Duration {
        let doublings = u32::try_from(delivered.saturating_sub(1).clamp(0, 20)).unwrap_or(20);
        self.retry_delay
            .saturating_mul(2u32.saturating_pow(doublings))
            .min(self.max_retry_delay)
    }

    fn is_last_delivery(&self, delivered: i64) -> bool {
        self.max_deliver > 0 && delivered >= self.max_deliver
    }
}

/// How an acked delivery ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Acked {
    /// Its work was applied.
    Processed,
    /// The reservation was refused for want of stock, and that decision recorded.
    Rejected,
    /// An interrupted email send found sent and its record completed.
    Reconciled,
    /// Already handled: skipped.
    Duplicate,
}

impl Acked {
    pub const ALL: [Self; 4] = [
        Self::Processed,
        Self::Rejected,
        Self::Reconciled,
        Self::Duplicate,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Self::Processed => "processed",
            Self::Rejected => "rejected",
            Self::Reconciled => "reconciled",
            Self::Duplicate => "duplicate",
        }
    }
}

/// What the loop does with a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Ack(Acked),
    /// Publish a dead letter, then terminate the original.
    DeadLetter {
        reason: DeadLetterReason,
        detail: String,
    },
    /// Negative ack: JetStream delivers it again after the delay.
    Nak(Duration),
}

/// The decision for one handled delivery: its outcome, or the kind of its error with the
/// error's own words; `delivered` is JetStream's delivery count.
pub fn decide(
    handled: Result<&Outcome, (&ErrorKind, &str)>,
    delivered: i64,
    retry: &RetryPolicy,
) -> Action {
    match handled {
        Ok(Outcome::Processed(Effect::Rejected { .. })) => Action::Ack(Acked::Rejected),
        Ok(Outcome::Processed(Effect::EmailReconciled)) => Action::Ack(Acked::Reconciled),
        Ok(Outcome::Processed(_)) => Action::Ack(Acked::Processed),
        Ok(Outcome::Duplicate) => Action::Ack(Acked::Duplicate),
        Ok(Outcome::Refused(refusal)) => Action::DeadLetter {
            reason: refusal.reason,
            detail: refusal.detail.clone(),
        },
        Err((ErrorKind::Permanent(refusal), _)) => Action::DeadLetter {
            reason: refusal.reason,
            detail: refusal.detail.clone(),
        },
        Err((ErrorKind::Transient, error)) if retry.is_last_delivery(delivered) => {
            Action::DeadLetter {
                reason: DeadLetterReason::MaxDeliveries,
                detail: format!("last of {delivered} deliveries failed: {error}"),
            }
        }
        Err((ErrorKind::Transient, _)) => Action::Nak(retry.delay_after(delivered)),
    }
}

/// A dead letter that could not be stored: the original stays, to come again after a delay.
pub fn dead_letter_not_stored(delivered: i64, retry: &RetryPolicy) -> Action {
    Action::Nak(retry.delay_after(delivered))
}

#[cfg(test)]
mod tests {
    use inventory_domain::{Quantity, Refusal};

    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    fn retry(max_deliver: i64) -> RetryPolicy {
        RetryPolicy {
            max_deliver,
            retry_delay: MS(500),
            max_retry_delay: Duration::from_secs(30),
        }
    }

    const REFUSED: &str = "connection refused";

    fn quantity(copies: i64) -> Quantity {
        Quantity::new(copies).expect("a valid quantity")
    }

    #[test]
    fn outcomes_are_acked_under_their_own_kind() {
        let table = [
            (
                Outcome::Processed(Effect::Reserved {
                    quantity: quantity(2),
                }),
                Acked::Processed,
            ),
            (
                Outcome::Processed(Effect::ArrivedAfterCancellation),
                Acked::Processed,
            ),
            (
                Outcome::Processed(Effect::Released { copies: 2 }),
                Acked::Processed,
            ),
            (Outcome::Processed(Effect::EmailSent), Acked::Processed),
            (
                Outcome::Processed(Effect::Rejected {
                    requested: quantity(3),
                    available: 1,
                }),
                Acked::Rejected,
            ),
            (
                Outcome::Processed(Effect::EmailReconciled),
                Acked::Reconciled,
            ),
            (Outcome::Duplicate, Acked::Duplicate),
        ];
        for (outcome, acked) in table {
            // Even on the last allowed delivery: a success is a success.
            for delivered in [1, 10] {
                assert_eq!(
                    decide(Ok(&outcome), delivered, &retry(10)),
                    Action::Ack(acked),
                    "{outcome:?} on delivery {delivered}"
                );
            }
        }
    }

    #[test]
    fn refusals_and_permanent_failures_are_dead_letters_on_the_first_delivery() {
        let refused = Outcome::refused(DeadLetterReason::UnknownBook, "no such book");
        assert_eq!(
            decide(Ok(&refused), 1, &retry(10)),
            Action::DeadLetter {
                reason: DeadLetterReason::UnknownBook,
                detail: "no such book".into()
            }
        );
        let permanent = ErrorKind::Permanent(Refusal {
            reason: DeadLetterReason::NeedsReconciliation,
            detail: "stored quantity 0 is out of range".into(),
        });
        assert_eq!(
            decide(Err((&permanent, "unusable data")), 1, &retry(10)),
            Action::DeadLetter {
                reason: DeadLetterReason::NeedsReconciliation,
                detail: "stored quantity 0 is out of range".into()
            }
        );
    }

    #[test]
    fn a_transient_failure_is_retried_later_each_time_until_the_last_delivery() {
        // (max_deliver, delivered) -> what happens
        let table = [
            (10, 1, Action::Nak(MS(500))),
            (10, 2, Action::Nak(MS(1_000))),
            (10, 3, Action::Nak(MS(2_000))),
            (10, 7, Action::Nak(Duration::from_secs(30))),
            (10, 9, Action::Nak(Duration::from_secs(30))),
            (-1, 1_000, Action::Nak(Duration::from_secs(30))),
            (0, 1_000, Action::Nak(Duration::from_secs(30))),
        ];
        for (max_deliver, delivered, action) in table {
            assert_eq!(
                decide(
                    Err((&ErrorKind::Transient, REFUSED)),
                    delivered,
                    &retry(max_deliver)
                ),
                action,
                "max_deliver {max_deliver}, delivery {delivered}"
            );
        }
    }

    #[test]
    fn the_last_allowed_delivery_failing_becomes_a_max_deliveries_dead_letter() {
        for (max_deliver, delivered) in [(10, 10), (3, 3), (3, 4), (1, 1)] {
            assert_eq!(
                decide(
                    Err((&ErrorKind::Transient, REFUSED)),
                    delivered,
                    &retry(max_deliver)
                ),
                Action::DeadLetter {
                    reason: DeadLetterReason::MaxDeliveries,
                    detail: format!("last of {delivered} deliveries failed: connection refused"),
                },
                "max_deliver {max_deliver}, delivery {delivered}"
            );
        }
    }

    #[test]
    fn the_retry_delay_doubles_and_stops_at_its_cap_without_overflowing() {
        let retry = retry(10);
        assert_eq!(retry.delay_after(0), MS(500));
        assert_eq!(retry.delay_after(1), MS(500));
        assert_eq!(retry.delay_after(6), Duration::from_secs(16));
        assert_eq!(retry.delay_after(7), Duration::from_secs(30));
        assert_eq!(retry.delay_after(i64::MAX), Duration::from_secs(30));
        assert_eq!(
            dead_letter_not_stored(2, &retry),
            Action::Nak(Duration::from_secs(1))
        );
    }
}
