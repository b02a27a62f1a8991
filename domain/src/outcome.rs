//! What handling a message came to, what a failure to handle it means for its delivery, and the
//! dead-letter reasons of the contract.

use std::fmt;

use crate::ids::Quantity;

/// The contract's `Dlq-Reason` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeadLetterReason {
    Malformed,
    Invalid,
    UnknownBook,
    PayloadMismatch,
    ConflictingReservation,
    MaxDeliveries,
    /// Only a person can settle it: an interrupted send the provider cannot account for, or
    /// stored data the handler cannot use (a corrupt or vanished row, a write the database
    /// refuses by constraint). Retrying would meet the same state.
    NeedsReconciliation,
    /// On a sharded stream, an event no partition takes: it names no book (an order-level
    /// cancellation, an old producer's placement), so no shard can decide it.
    Unroutable,
}

impl DeadLetterReason {
    pub const ALL: [Self; 8] = [
        Self::Malformed,
        Self::Invalid,
        Self::UnknownBook,
        Self::PayloadMismatch,
        Self::ConflictingReservation,
        Self::MaxDeliveries,
        Self::NeedsReconciliation,
        Self::Unroutable,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Malformed => "malformed",
            Self::Invalid => "invalid",
            Self::UnknownBook => "unknown-book",
            Self::PayloadMismatch => "payload-mismatch",
            Self::ConflictingReservation => "conflicting-reservation",
            Self::MaxDeliveries => "max-deliveries",
            Self::NeedsReconciliation => "needs-reconciliation",
            Self::Unroutable => "unroutable",
        }
    }
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a message that was applied did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Effect {
    Reserved {
        quantity: Quantity,
    },
    /// Not enough stock: the refusal is recorded, so a redelivery gets the same answer.
    Rejected {
        requested: Quantity,
        available: i64,
    },
    Released {
        copies: i64,
    },
    /// The order was cancelled before this placement arrived: nothing is reserved.
    ArrivedAfterCancellation,
    EmailSent,
    /// An earlier delivery sent the email and died before recording it; the provider's lookup
    /// said so, and this delivery completed the record without sending. Not a plain duplicate:
    /// this delivery wrote the record's second phase, and operators want to see it happened.
    EmailReconciled,
}

/// A message that must not be applied and must not be retried: it becomes a dead letter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub reason: DeadLetterReason,
    pub detail: String,
}

/// The result of handling one message. Every variant is final for that delivery: the consumer
/// acks `Processed` and `Duplicate`, and dead-letters `Refused`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Processed(Effect),
    /// Already handled: success-to-skip, never an error.
    Duplicate,
    Refused(Refusal),
}

impl Outcome {
    pub fn refused(reason: DeadLetterReason, detail: impl Into<String>) -> Self {
        Self::Refused(Refusal {
            reason,
            detail: detail.into(),
        })
    }

    /// Whether this delivery applied the message's work.
    pub fn processed(&self) -> bool {
        matches!(self, Self::Processed(_))
    }

    /// How the delivery is acked, or why it is refused instead.
    pub fn acked(&self) -> Result<Acked, &Refusal> {
        match self {
            Self::Processed(Effect::Rejected { .. }) => Ok(Acked::Rejected),
            Self::Processed(Effect::EmailReconciled) => Ok(Acked::Reconciled),
            Self::Processed(_) => Ok(Acked::Processed),
            Self::Duplicate => Ok(Acked::Duplicate),
            Self::Refused(refusal) => Err(refusal),
        }
    }

    pub fn label(&self) -> &'static str {
        match self.acked() {
            Ok(acked) => acked.label(),
            Err(refusal) => refusal.reason.as_str(),
        }
    }
}

/// How an acked delivery ended: the outcomes operators count apart.
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
    pub fn label(self) -> &'static str {
        match self {
            Self::Processed => "processed",
            Self::Rejected => "rejected",
            Self::Reconciled => "reconciled",
            Self::Duplicate => "duplicate",
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Refused(refusal) => write!(f, "{}: {}", refusal.reason, refusal.detail),
            other => f.write_str(other.label()),
        }
    }
}

/// What a failure to handle a message means for its delivery. Handlers' errors say it by their
/// type, so the consumer decides between retrying and dead-lettering with a `match`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ErrorKind {
    /// Nothing was applied and a later attempt may succeed (the database unreachable, a lost
    /// race with another transaction, the email provider down): retry after a delay.
    Transient,
    /// Nothing was applied and every attempt would fail the same way: dead-letter it now.
    Permanent(Refusal),
    /// On a shard, the database does not own the message's partition and applied nothing:
    /// the message is another shard's to decide. Retried without counting against it, never
    /// dead-lettered.
    NotOwned,
    /// This program broke one of its own invariants: a bug, not the weather. Neither a retry
    /// nor a dead letter is right; the process stops for its supervisor to restart it.
    Internal,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reconciled_email_is_processed_under_its_own_label() {
        let outcome = Outcome::Processed(Effect::EmailReconciled);
        assert!(outcome.processed());
        assert_eq!(outcome.label(), "reconciled");
        assert_eq!(outcome.to_string(), "reconciled");
    }
}
