//! Stock and the reservation decision, as plain functions of state and command.

use crate::ids::{BookId, FieldError, Quantity};
use crate::outcome::{DeadLetterReason, Effect, Outcome};

/// One book's stock: `on_hand` copies, of which `reserved` are promised to orders.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StockItem {
    pub book_id: BookId,
    pub title: String,
    pub on_hand: i64,
    pub reserved: i64,
}

/// Copies a stock item can hold: the columns are 32-bit integers on every backend.
pub const MAX_ON_HAND: i64 = i32::MAX as i64;

impl StockItem {
    /// A stock item as an operator sets it (`inventory stock put`).
    pub fn new(book_id: BookId, title: &str, on_hand: i64) -> Result<Self, FieldError> {
        let title = title.trim();
        let len = title.chars().count();
        if len == 0 || len > 500 {
            return Err(FieldError::Length {
                field: "title",
                max: 500,
                len,
            });
        }
        if !(0..=MAX_ON_HAND).contains(&on_hand) {
            return Err(FieldError::Range {
                field: "on_hand",
                min: 0,
                max: MAX_ON_HAND,
                value: on_hand,
            });
        }
        Ok(Self {
            book_id,
            title: title.to_owned(),
            on_hand,
            reserved: 0,
        })
    }

    pub fn available(&self) -> i64 {
        self.on_hand - self.reserved
    }

    /// Reserves `quantity` copies, never more than are available.
    pub fn decide_reservation(&self, quantity: Quantity) -> ReservationDecision {
        let available = self.available();
        if i64::from(quantity.get()) <= available {
            ReservationDecision::Reserve {
                reserved_after: self.reserved + i64::from(quantity.get()),
            }
        } else {
            ReservationDecision::Reject {
                requested: quantity,
                available,
            }
        }
    }
}

/// The answer to one reservation request; a `Reject` is recorded like a `Reserve`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReservationDecision {
    Reserve { reserved_after: i64 },
    Reject { requested: Quantity, available: i64 },
}

impl ReservationDecision {
    pub fn status(&self) -> ReservationStatus {
        match self {
            Self::Reserve { .. } => ReservationStatus::Reserved,
            Self::Reject { .. } => ReservationStatus::Rejected,
        }
    }

    pub fn effect(&self, quantity: Quantity) -> Effect {
        match self {
            Self::Reserve { .. } => Effect::Reserved { quantity },
            Self::Reject {
                requested,
                available,
            } => Effect::Rejected {
                requested: *requested,
                available: *available,
            },
        }
    }
}

/// The `status` column of a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReservationStatus {
    Reserved,
    Rejected,
    Released,
}

impl ReservationStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reserved => "reserved",
            Self::Rejected => "rejected",
            Self::Released => "released",
        }
    }

    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "reserved" => Some(Self::Reserved),
            "rejected" => Some(Self::Rejected),
            "released" => Some(Self::Released),
            _ => None,
        }
    }
}

/// A second request for a reservation key that is taken: the same quantity is the same request
/// (a duplicate, whatever its message id); another quantity is a conflict nobody may guess at.
pub fn second_request_for_reservation(existing: Quantity, requested: Quantity) -> Outcome {
    if existing == requested {
        Outcome::Duplicate
    } else {
        Outcome::refused(
            DeadLetterReason::ConflictingReservation,
            format!(
                "order already holds a reservation of {existing}, this message asks for {requested}"
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dune(on_hand: i64, reserved: i64) -> StockItem {
        StockItem {
            reserved,
            ..StockItem::new(BookId::new_v7(), "Dune", on_hand).expect("valid stock")
        }
    }

    fn qty(value: i64) -> Quantity {
        Quantity::new(value).expect("valid quantity")
    }

    #[test]
    fn given_enough_stock_when_reserving_then_reserved_grows() {
        let decision = dune(10, 3).decide_reservation(qty(7));
        assert_eq!(
            decision,
            ReservationDecision::Reserve { reserved_after: 10 }
        );
        assert_eq!(decision.status(), ReservationStatus::Reserved);
    }

    #[test]
    fn given_too_little_stock_when_reserving_then_rejected_with_what_was_available() {
        let decision = dune(10, 9).decide_reservation(qty(2));
        assert_eq!(
            decision,
            ReservationDecision::Reject {
                requested: qty(2),
                available: 1
            }
        );
        assert_eq!(decision.status(), ReservationStatus::Rejected);
    }

    #[test]
    fn given_a_taken_key_then_same_quantity_is_a_duplicate_and_another_a_conflict() {
        assert_eq!(
            second_request_for_reservation(qty(2), qty(2)),
            Outcome::Duplicate
        );
        let Outcome::Refused(refusal) = second_request_for_reservation(qty(2), qty(3)) else {
            panic!("expected a refusal")
        };
        assert_eq!(refusal.reason, DeadLetterReason::ConflictingReservation);
    }

    #[test]
    fn stock_put_is_validated() {
        assert!(StockItem::new(BookId::new_v7(), " ", 1).is_err());
        assert!(StockItem::new(BookId::new_v7(), "Dune", -1).is_err());
        assert!(StockItem::new(BookId::new_v7(), "Dune", 0).is_ok());
    }

    #[test]
    fn status_round_trips() {
        for status in [
            ReservationStatus::Reserved,
            ReservationStatus::Rejected,
            ReservationStatus::Released,
        ] {
            assert_eq!(ReservationStatus::parse(status.as_str()), Some(status));
        }
    }
}
