//! The payload hash the study's inbox stores with each row (and its cache with each key), so
//! that a message id reused for other content is told from a duplicate.

use inventory_domain::{Event, Message};
use sha2::{Digest, Sha256};

/// A hex SHA-256 of a message's business content, stored with its inbox row so that the same
/// message id arriving with other content is caught instead of being skipped as a duplicate.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PayloadHash(String);

impl PayloadHash {
    /// The hash of what the message asks for, independent of field order and envelope.
    pub fn of(message: &Message) -> Self {
        let canonical = match &message.event {
            Event::Placed(placed) => format!(
                "placed|{}|{}|{}",
                placed.order_id, placed.book_id, placed.quantity
            ),
            Event::Cancelled(cancelled) => match cancelled.book_id {
                None => format!("cancelled|{}", cancelled.order_id),
                Some(book) => format!("cancelled|{}|{book}", cancelled.order_id),
            },
            Event::StockReserved(reserved) => format!(
                "stock-reserved|{}|{}|{}",
                reserved.order_id, reserved.book_id, reserved.quantity
            ),
        };
        PayloadHash(hex::encode(Sha256::digest(canonical.as_bytes())))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use inventory_domain::EventKind;

    use super::*;

    const ORDER: &str = "0190f5c4-3c2e-7b4a-9d3e-1f2a3b4c5d6e";
    const BOOK: &str = "0190f5c4-3c2e-7b4a-9d3e-aaaaaaaaaaaa";

    #[test]
    fn payload_hash_follows_content_not_field_order() {
        let placed = format!(
            r#"{{"message_id":"m-1","order_id":"{ORDER}","book_id":"{BOOK}","quantity":2}}"#
        );
        let a = Message::decode(EventKind::Placed, placed.as_bytes()).expect("valid");
        let reordered = format!(
            r#"{{"quantity":2,"book_id":"{BOOK}","order_id":"{ORDER}","message_id":"m-1"}}"#
        );
        let b = Message::decode(EventKind::Placed, reordered.as_bytes()).expect("valid");
        let other = format!(
            r#"{{"quantity":3,"book_id":"{BOOK}","order_id":"{ORDER}","message_id":"m-1"}}"#
        );
        let c = Message::decode(EventKind::Placed, other.as_bytes()).expect("valid");
        assert_eq!(PayloadHash::of(&a), PayloadHash::of(&b));
        assert_ne!(PayloadHash::of(&a), PayloadHash::of(&c));
    }
}
