//! Events out of Inventory: one per reservation decision (reserved, rejected, released), written
//! by the transaction that made the decision into the outbox and published later by the relay
//! to the `INVENTORY` stream, with `Nats-Msg-Id` = the event id.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::{BookId, DecodeError, OrderId, Quantity};

/// Relays lease the outbox by partition; an order's events all fall in one partition, so one
/// relay at a time publishes them, in the order they were written.
pub const PARTITIONS: u8 = 16;

/// The outbox partition of an order's events.
pub fn partition(order_id: OrderId) -> i16 {
    i16::from(order_id.as_uuid().as_bytes()[15] % PARTITIONS)
}

/// What was decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StockEventKind {
    Reserved,
    /// Not enough stock: `available` copies were left when it was decided.
    Rejected {
        available: i64,
    },
    /// A cancellation gave the reserved copies back.
    Released,
}

impl StockEventKind {
    /// The subject below the events' prefix (`inventory` by the contract): `stock.reserved`.
    pub fn subject_token(&self) -> &'static str {
        match self {
            Self::Reserved => "stock.reserved",
            Self::Rejected { .. } => "stock.rejected",
            Self::Released => "stock.released",
        }
    }
}

/// One event of the contract's `inventory.stock.*` subjects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StockEvent {
    pub event_id: Uuid,
    pub kind: StockEventKind,
    pub order_id: OrderId,
    pub book_id: BookId,
    pub quantity: Quantity,
    pub occurred_at: DateTime<Utc>,
    /// The dedup key of the message that decided it.
    pub caused_by: String,
}

/// The wire body. `available` only on a rejection.
#[derive(Serialize, Deserialize)]
struct Body {
    event_id: Uuid,
    order_id: Uuid,
    book_id: Uuid,
    quantity: u32,
    occurred_at: DateTime<Utc>,
    caused_by: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    available: Option<i64>,
}

impl StockEvent {
    /// A new event (a fresh v7 id) for a decision made now.
    pub fn new(
        kind: StockEventKind,
        order_id: OrderId,
        book_id: BookId,
        quantity: Quantity,
        caused_by: &str,
    ) -> Self {
        Self {
            event_id: Uuid::now_v7(),
            kind,
            order_id,
            book_id,
            quantity,
            occurred_at: Utc::now(),
            caused_by: caused_by.to_owned(),
        }
    }

    pub fn subject_token(&self) -> &'static str {
        self.kind.subject_token()
    }

    /// The UTF-8 JSON body published on `<prefix>.`[`Self::subject_token`].
    pub fn body(&self) -> String {
        let available = match self.kind {
            StockEventKind::Rejected { available } => Some(available),
            StockEventKind::Reserved | StockEventKind::Released => None,
        };
        let body = Body {
            event_id: self.event_id,
            order_id: self.order_id.as_uuid(),
            book_id: self.book_id.as_uuid(),
            quantity: self.quantity.get(),
            occurred_at: self.occurred_at,
            caused_by: self.caused_by.clone(),
            available,
        };
        serde_json::to_string(&body).expect("a struct of plain fields serializes")
    }

    /// An event as a consumer of `INVENTORY` reads it: the kind from the subject below the
    /// prefix (`stock.reserved`), the rest from the body.
    pub fn decode(subject_token: &str, body: &[u8]) -> Result<Self, DecodeError> {
        let wire: Body =
            serde_json::from_slice(body).map_err(|e| DecodeError::Malformed(e.to_string()))?;
        let kind = match subject_token {
            "stock.reserved" => StockEventKind::Reserved,
            "stock.released" => StockEventKind::Released,
            "stock.rejected" => StockEventKind::Rejected {
                available: wire.available.ok_or_else(|| {
                    DecodeError::Malformed("a rejection without `available`".to_owned())
                })?,
            },
            other => {
                return Err(DecodeError::Invalid(format!(
                    "not a stock event subject: {other}"
                )));
            }
        };
        Ok(Self {
            event_id: wire.event_id,
            kind,
            order_id: wire.order_id.into(),
            book_id: wire.book_id.into(),
            quantity: Quantity::new(i64::from(wire.quantity))?,
            occurred_at: wire.occurred_at,
            caused_by: wire.caused_by,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: StockEventKind) -> StockEvent {
        StockEvent::new(
            kind,
            OrderId::new_v7(),
            BookId::new_v7(),
            Quantity::new(2).expect("in range"),
            "m-1",
        )
    }

    #[test]
    fn every_kind_decodes_to_itself_from_its_subject() {
        for kind in [
            StockEventKind::Reserved,
            StockEventKind::Rejected { available: 1 },
            StockEventKind::Released,
        ] {
            let sent = event(kind);
            let read =
                StockEvent::decode(sent.subject_token(), sent.body().as_bytes()).expect("decodes");
            assert_eq!(read, sent);
        }
    }

    #[test]
    fn only_a_rejection_carries_available() {
        let rejected: serde_json::Value =
            serde_json::from_str(&event(StockEventKind::Rejected { available: 3 }).body())
                .expect("JSON");
        assert_eq!(rejected["available"], 3);
        let reserved: serde_json::Value =
            serde_json::from_str(&event(StockEventKind::Reserved).body()).expect("JSON");
        assert!(reserved.get("available").is_none(), "{reserved}");
    }

    #[test]
    fn an_order_stays_in_one_partition_and_every_partition_is_used() {
        let mut seen = [false; PARTITIONS as usize];
        for _ in 0..1_000 {
            let order = OrderId::from(Uuid::new_v4());
            let p = partition(order);
            assert_eq!(p, partition(order));
            seen[usize::try_from(p).expect("not negative")] = true;
        }
        assert!(seen.iter().all(|used| *used), "{seen:?}");
    }
}
