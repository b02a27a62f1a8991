//! The delivery policy: what becomes of a delivery, decided from plain values. The consumer loop
//! only performs the [`Action`] this returns, so every row of the policy has a unit test here.

use std::time::Duration;

use inventory_domain::{Acked, DeadLetterReason, ErrorKind, Outcome};

/// How often a message is tried, and how long between tries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The deliveries of one message this service handles: the last one failing is a
    /// max-deliveries dead letter, and a later one (a crash, a kill, a lost nak) is
    /// dead-lettered unhandled. Never above `server_max_deliver`; -1 (or 0) for unlimited.
    pub max_deliver: i64,
    /// The consumer's own `max_deliver` as the server has it: after that delivery the server
    /// delivers the message no more. -1 (or 0) for none, as this service creates it.
    pub server_max_deliver: i64,
    /// Delay before the second delivery after a transient failure; doubles per delivery.
    pub retry_delay: Duration,
    /// The longest delay between deliveries.
    pub max_retry_delay: Duration,
}

impl RetryPolicy {
    /// The cap in effect: this service's (`--max-deliver`), or the server's where that is
    /// lower, since the server delivers no more after it.
    pub fn effective_cap(service: i64, server: i64) -> i64 {
        match (service > 0, server > 0) {
            (true, true) => service.min(server),
            (true, false) => service,
            (false, _) => server,
        }
    }

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

    /// Whether the server delivers the message no more after this delivery.
    fn server_gives_up_after(&self, delivered: i64) -> bool {
        self.server_max_deliver > 0 && delivered >= self.server_max_deliver
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
    /// Send nothing: the server delivers it no more (its own cap was reached), and the
    /// MAX_DELIVERIES advisory it then emits brings it to the dead letters.
    LeaveToAdvisory,
    /// Send nothing and stop: this program broke an invariant, and the process must end for
    /// its supervisor to restart it; the message comes again after its ack wait.
    Halt(String),
}

/// The decision before handling: a delivery past the cap is dead-lettered unhandled. It was
/// handed out again after its last allowed delivery (the process died holding it, or its
/// nak or dead letter was lost), and the server, which has no cap of its own, would deliver it
/// for ever.
pub fn admit(delivered: i64, retry: &RetryPolicy) -> Option<Action> {
    (retry.max_deliver > 0 && delivered > retry.max_deliver).then(|| Action::DeadLetter {
        reason: DeadLetterReason::MaxDeliveries,
        detail: format!(
            "delivered {delivered} times, past the cap of {}; not handled again",
            retry.max_deliver
        ),
    })
}

/// The decision for one handled delivery: its outcome, or the kind of its error with the
/// error's own words; `delivered` is JetStream's delivery count.
pub fn decide(
    handled: Result<&Outcome, (&ErrorKind, &str)>,
    delivered: i64,
    retry: &RetryPolicy,
) -> Action {
    match handled {
        Ok(outcome) => match outcome.acked() {
            Ok(acked) => Action::Ack(acked),
            Err(refusal) => Action::DeadLetter {
                reason: refusal.reason,
                detail: refusal.detail.clone(),
            },
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
        // Another shard's message: whatever its count, it is theirs to decide, soon.
        Err((ErrorKind::NotOwned, _)) => Action::Nak(retry.retry_delay),
        Err((ErrorKind::Internal, error)) => Action::Halt(error.to_owned()),
    }
}

/// A dead letter that could not be stored: the original stays, to come again after a delay,
/// unless the server delivers it no more: a nak then would lose it, and its advisory is what
/// brings it back.
pub fn dead_letter_not_stored(delivered: i64, retry: &RetryPolicy) -> Action {
    if retry.server_gives_up_after(delivered) {
        Action::LeaveToAdvisory
    } else {
        Action::Nak(retry.delay_after(delivered))
    }
}

/// What became of one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disposition {
    Acked(Acked),
    DeadLettered(DeadLetterReason),
    /// Nak'ed, to come again after the delay.
    Retried(Duration),
    /// Left unacked (the handler died, or an ack or dead letter could not be sent): JetStream
    /// redelivers it after the ack wait, or, past the consumer's own cap, says so in the
    /// MAX_DELIVERIES advisory that the backstop turns into a dead letter.
    LeftForRedelivery,
    /// Left unacked because the handler broke an invariant of this program: the lane stops,
    /// and with it the process.
    Halted(String),
}

#[cfg(test)]
mod tests {
    use inventory_domain::{Effect, Quantity, Refusal};

    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    fn retry(max_deliver: i64) -> RetryPolicy {
        RetryPolicy {
            max_deliver,
            server_max_deliver: -1,
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
    fn a_message_another_shard_owns_is_retried_soon_even_on_the_last_delivery() {
        for (max_deliver, delivered) in [(10, 1), (10, 9), (3, 3), (3, 4), (-1, 1_000)] {
            assert_eq!(
                decide(
                    Err((&ErrorKind::NotOwned, "not owned")),
                    delivered,
                    &retry(max_deliver)
                ),
                Action::Nak(MS(500)),
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
    }

    #[test]
    fn a_delivery_past_the_cap_is_a_dead_letter_before_it_is_handled() {
        // (cap, delivered) -> dead-lettered at admission
        let table = [
            (3, 1, false),
            (3, 3, false),
            (3, 4, true),
            (10, 57, true),
            (-1, 1_000, false),
            (0, 1_000, false),
        ];
        for (cap, delivered, dead_lettered) in table {
            let admitted = admit(delivered, &retry(cap));
            assert_eq!(
                admitted.is_some(),
                dead_lettered,
                "cap {cap}, delivery {delivered}"
            );
            if let Some(action) = admitted {
                assert!(
                    matches!(
                        action,
                        Action::DeadLetter {
                            reason: DeadLetterReason::MaxDeliveries,
                            ..
                        }
                    ),
                    "{action:?}"
                );
            }
        }
    }

    #[test]
    fn a_dead_letter_not_stored_is_nakd_unless_the_server_delivers_no_more() {
        // The consumer as this service creates it: the server has no cap.
        assert_eq!(
            dead_letter_not_stored(2, &retry(10)),
            Action::Nak(Duration::from_secs(1))
        );
        assert_eq!(
            dead_letter_not_stored(10, &retry(10)),
            Action::Nak(Duration::from_secs(30))
        );
        // A consumer that came with a cap of its own: its last delivery must not be nak'ed.
        let capped = RetryPolicy {
            server_max_deliver: 5,
            ..retry(5)
        };
        assert_eq!(
            dead_letter_not_stored(4, &capped),
            Action::Nak(Duration::from_secs(4))
        );
        assert_eq!(dead_letter_not_stored(5, &capped), Action::LeaveToAdvisory);
    }

    #[test]
    fn the_cap_in_effect_is_the_lower_of_the_services_and_the_servers() {
        let table = [
            ((10, -1), 10),
            ((10, 0), 10),
            ((10, 5), 5),
            ((3, 5), 3),
            ((-1, 5), 5),
            ((-1, -1), -1),
        ];
        for ((service, server), cap) in table {
            assert_eq!(
                RetryPolicy::effective_cap(service, server),
                cap,
                "service {service}, server {server}"
            );
        }
    }

    #[test]
    fn a_broken_invariant_halts_whatever_the_delivery() {
        for delivered in [1, 10, 11] {
            assert_eq!(
                decide(
                    Err((&ErrorKind::Internal, "fewer rows than placements")),
                    delivered,
                    &retry(10)
                ),
                Action::Halt("fewer rows than placements".into())
            );
        }
    }
}
