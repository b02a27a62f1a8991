//! The messages the service consumes: OrderPlaced and OrderCancelled, decoded from plain JSON or
//! CloudEvents 1.0 structured mode, and Inventory's own StockReserved event (the email
//! notifier's input), decoded from the outbox's event body.

use std::borrow::Cow;

use serde::Deserialize;
use serde::de::IgnoredAny;

use crate::ids::{BookId, DedupKey, FieldError, MessageId, OrderId, Quantity};
use crate::outbox::{StockEvent, StockEventKind};
use crate::outcome::DeadLetterReason;

/// Which event a subject carries: plain JSON bodies say it only through their subject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    Placed,
    Cancelled,
    StockReserved,
}

impl EventKind {
    /// The kind from a subject's last tokens (`orders.placed`, `test-42.orders.cancelled`,
    /// `inventory.stock.reserved`, `orders.placed.<book_id>`): [`Subject::parse`]'s.
    pub fn from_subject(subject: &str) -> Option<Self> {
        Subject::parse(subject).map(|parsed| parsed.kind)
    }

    fn from_token(token: &str) -> Option<Self> {
        match token {
            "placed" => Some(Self::Placed),
            "cancelled" => Some(Self::Cancelled),
            _ => None,
        }
    }

    /// The subject below its stream's prefix.
    pub fn subject_token(self) -> &'static str {
        match self {
            Self::Placed => "placed",
            Self::Cancelled => "cancelled",
            Self::StockReserved => StockEventKind::Reserved.subject_token(),
        }
    }

    pub fn cloud_event_type(self) -> &'static str {
        match self {
            Self::Placed => "bookstore.order.placed",
            Self::Cancelled => "bookstore.order.cancelled",
            Self::StockReserved => "bookstore.inventory.stock.reserved",
        }
    }
}

/// What a subject says of the message it carries. An order event's subject may name its book
/// (`orders.placed.<book_id>`, as producers publish it so that a sharded stream can route it),
/// and a sharded stream stores it with the partition before the book
/// (`orders.placed.<partition>.<book_id>`); the plain `orders.placed` names neither.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Subject<'a> {
    pub kind: EventKind,
    /// The book token as the subject spells it.
    pub book: Option<&'a str>,
    /// The partition token as the subject spells it.
    pub partition: Option<&'a str>,
}

impl<'a> Subject<'a> {
    /// Read from the right, so that any prefix goes before the kind (`test-42.orders.placed`).
    /// `None`: the subject carries no event this service takes.
    pub fn parse(subject: &'a str) -> Option<Self> {
        let mut tokens = subject.rsplit('.');
        let last = tokens.next()?;
        let before = tokens.next();
        if last == "reserved" && before == Some("stock") {
            return Some(Self::of(EventKind::StockReserved));
        }
        if let Some(kind) = EventKind::from_token(last) {
            return Some(Self::of(kind));
        }
        // Not a kind: a book token, after the kind or after the partition.
        let book = Some(last);
        match before.map(|token| (token, EventKind::from_token(token))) {
            Some((_, Some(kind))) => Some(Self {
                kind,
                book,
                partition: None,
            }),
            Some((partition, None)) if partition.bytes().all(|byte| byte.is_ascii_digit()) => {
                let kind = EventKind::from_token(tokens.next()?)?;
                Some(Self {
                    kind,
                    book,
                    partition: Some(partition),
                })
            }
            _ => None,
        }
    }

    fn of(kind: EventKind) -> Self {
        Self {
            kind,
            book: None,
            partition: None,
        }
    }

    /// Whether what the subject says agrees with `event`: a subject that names a book names
    /// the body's, spelled as producers must spell it (the canonical lowercase form the
    /// partition is hashed from), and only a placement's subject names one (a cancellation per
    /// order line is not taken yet). The error says what differs.
    pub fn check(&self, event: &Event) -> Result<(), String> {
        let Some(token) = self.book else {
            return Ok(());
        };
        match event {
            Event::Placed(placed) if token == placed.book_id.to_string() => Ok(()),
            Event::Placed(placed) => Err(format!(
                "the subject names book {token:?}, the body book {}",
                placed.book_id
            )),
            _ => Err(format!(
                "a {} subject names book {token:?}: only a placement's subject names a book",
                self.kind.subject_token()
            )),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderPlaced {
    pub order_id: OrderId,
    pub book_id: BookId,
    pub quantity: Quantity,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderCancelled {
    pub order_id: OrderId,
}

/// Inventory reserved stock for an order: what the email notifier mails about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StockReserved {
    pub order_id: OrderId,
    pub book_id: BookId,
    pub quantity: Quantity,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Placed(OrderPlaced),
    Cancelled(OrderCancelled),
    StockReserved(StockReserved),
}

impl Event {
    pub fn kind(&self) -> EventKind {
        match self {
            Self::Placed(_) => EventKind::Placed,
            Self::Cancelled(_) => EventKind::Cancelled,
            Self::StockReserved(_) => EventKind::StockReserved,
        }
    }

    /// Its subject below the orders stream's prefix: a placement's names its book
    /// (`placed.<book_id>`), so that a sharded stream can route it by book; a cancellation's is
    /// the order's (`cancelled`).
    pub fn subject_below_prefix(&self) -> String {
        match self {
            Self::Placed(placed) => format!("{}.{}", self.kind().subject_token(), placed.book_id),
            _ => self.kind().subject_token().to_owned(),
        }
    }

    pub fn order_id(&self) -> OrderId {
        match self {
            Self::Placed(placed) => placed.order_id,
            Self::Cancelled(cancelled) => cancelled.order_id,
            Self::StockReserved(reserved) => reserved.order_id,
        }
    }
}

/// One decoded message: the event plus what identifies this copy of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub key: DedupKey,
    pub correlation_id: Option<String>,
    pub occurred_at: Option<String>,
    pub event: Event,
}

/// Why a body could not become a [`Message`]; each is a dead letter, never a retry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Not UTF-8 JSON of the expected shape: syntax, types, missing or repeated fields.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// Well-formed, but a value breaks a rule (length, range, UUID, event type).
    #[error("invalid message: {0}")]
    Invalid(String),
}

impl DecodeError {
    pub fn reason(&self) -> DeadLetterReason {
        match self {
            Self::Malformed(_) => DeadLetterReason::Malformed,
            Self::Invalid(_) => DeadLetterReason::Invalid,
        }
    }
}

impl From<FieldError> for DecodeError {
    fn from(error: FieldError) -> Self {
        Self::Invalid(error.to_string())
    }
}

fn malformed(error: serde_json::Error) -> DecodeError {
    DecodeError::Malformed(error.to_string())
}

#[derive(Deserialize)]
struct EnvelopeProbe {
    specversion: Option<IgnoredAny>,
}

/// The ids are parsed into UUIDs, so they are borrowed from the body where they can be (a
/// string without escapes): no allocation for what is dropped at once.
#[derive(Deserialize)]
struct EventFields<'a> {
    #[serde(borrow)]
    order_id: Cow<'a, str>,
    #[serde(borrow)]
    book_id: Option<Cow<'a, str>>,
    quantity: Option<i64>,
    correlation_id: Option<String>,
    occurred_at: Option<String>,
}

/// The plain body: the event's fields beside `message_id`. Not `#[serde(flatten)]`, which would
/// let a repeated field through.
#[derive(Deserialize)]
struct PlainBody<'a> {
    /// Set only in a CloudEvent, which then decodes as one.
    specversion: Option<IgnoredAny>,
    message_id: String,
    #[serde(borrow)]
    order_id: Cow<'a, str>,
    #[serde(borrow)]
    book_id: Option<Cow<'a, str>>,
    quantity: Option<i64>,
    correlation_id: Option<String>,
    occurred_at: Option<String>,
}

#[derive(Deserialize)]
struct CloudEventBody<'a> {
    specversion: String,
    id: String,
    source: String,
    #[serde(rename = "type")]
    event_type: String,
    #[serde(borrow)]
    data: EventFields<'a>,
}

/// The CloudEvents `source` is a URI reference; the bound keeps hostile bodies from bloating logs.
const MAX_SOURCE_CHARS: usize = 1_000;

impl EventFields<'_> {
    /// The event, and the fields the message keeps beside it.
    fn into_message(self, key: DedupKey, kind: EventKind) -> Result<Message, DecodeError> {
        Ok(Message {
            key,
            event: self.event(kind)?,
            correlation_id: self.correlation_id,
            occurred_at: self.occurred_at,
        })
    }

    fn event(&self, kind: EventKind) -> Result<Event, DecodeError> {
        let order_id = OrderId::parse(&self.order_id)?;
        Ok(match kind {
            EventKind::Placed => {
                let book_id = self
                    .book_id
                    .as_deref()
                    .ok_or_else(|| DecodeError::Malformed("missing field `book_id`".into()))?;
                let quantity = self
                    .quantity
                    .ok_or_else(|| DecodeError::Malformed("missing field `quantity`".into()))?;
                Event::Placed(OrderPlaced {
                    order_id,
                    book_id: BookId::parse(book_id)?,
                    quantity: Quantity::new(quantity)?,
                })
            }
            EventKind::Cancelled => Event::Cancelled(OrderCancelled { order_id }),
            EventKind::StockReserved => {
                return Err(DecodeError::Invalid(
                    "StockReserved comes only as Inventory's event body".into(),
                ));
            }
        })
    }
}

impl Message {
    /// Decodes a body that arrived on a subject of `kind`. Unknown fields are ignored; a field
    /// given twice is malformed, since which copy a reader honours would be a guess.
    pub fn decode(kind: EventKind, body: &[u8]) -> Result<Self, DecodeError> {
        // serde_json skips an ignored field's string without checking its UTF-8, so invalid
        // bytes in an unknown field would otherwise pass.
        std::str::from_utf8(body)
            .map_err(|error| DecodeError::Malformed(format!("body is not UTF-8: {error}")))?;
        if kind == EventKind::StockReserved {
            return Self::decode_stock_reserved(body);
        }
        // The plain body is the common case, so it is parsed first and the envelope probed only
        // when that fails: one parse per message, the same answers as probing first.
        let plain = match serde_json::from_slice::<PlainBody>(body) {
            Ok(plain) if plain.specversion.is_none() => plain,
            Ok(_) => return Self::decode_cloud_event(kind, body),
            Err(plain_error) => {
                let probe: EnvelopeProbe = serde_json::from_slice(body).map_err(malformed)?;
                if probe.specversion.is_some() {
                    return Self::decode_cloud_event(kind, body);
                }
                return Err(malformed(plain_error));
            }
        };
        let key = DedupKey::MessageId(MessageId::parse(plain.message_id)?);
        let fields = EventFields {
            order_id: plain.order_id,
            book_id: plain.book_id,
            quantity: plain.quantity,
            correlation_id: plain.correlation_id,
            occurred_at: plain.occurred_at,
        };
        fields.into_message(key, kind)
    }

    /// Inventory's event: its id is the dedup key, as its `Nats-Msg-Id` is.
    fn decode_stock_reserved(body: &[u8]) -> Result<Self, DecodeError> {
        let event = StockEvent::decode(EventKind::StockReserved.subject_token(), body)?;
        Ok(Self::stock_reserved(&event))
    }

    /// The message a consumer of `INVENTORY` reads for a reservation's event.
    pub fn stock_reserved(event: &StockEvent) -> Self {
        let id = MessageId::parse(event.event_id.to_string()).expect("a UUID is a valid id");
        Self {
            key: DedupKey::MessageId(id),
            correlation_id: None,
            occurred_at: Some(event.occurred_at.to_rfc3339()),
            event: Event::StockReserved(StockReserved {
                order_id: event.order_id,
                book_id: event.book_id,
                quantity: event.quantity,
            }),
        }
    }

    fn decode_cloud_event(kind: EventKind, body: &[u8]) -> Result<Self, DecodeError> {
        let event: CloudEventBody = serde_json::from_slice(body).map_err(malformed)?;
        if event.specversion != "1.0" {
            return Err(DecodeError::Invalid(format!(
                "unsupported CloudEvents specversion {:?}",
                truncate(&event.specversion)
            )));
        }
        if event.event_type != kind.cloud_event_type() {
            return Err(DecodeError::Invalid(format!(
                "CloudEvents type {:?} does not match the subject's {}",
                truncate(&event.event_type),
                kind.cloud_event_type()
            )));
        }
        // The id obeys the message id's rules; the pair (source, id) is the key.
        let id = MessageId::parse(event.id)?.as_str().to_owned();
        let source_chars = event.source.chars().count();
        if source_chars == 0 || source_chars > MAX_SOURCE_CHARS {
            return Err(DecodeError::Invalid(format!(
                "CloudEvents source must be 1 to {MAX_SOURCE_CHARS} characters, got {source_chars}"
            )));
        }
        let key = DedupKey::CloudEvent {
            source: event.source,
            id,
        };
        event.data.into_message(key, kind)
    }

    /// The plain JSON body a producer publishes for this message, or `None` for a CloudEvent
    /// key, which has no `message_id` field to carry it, and for a StockReserved, which
    /// Inventory's relay publishes as its event body.
    pub fn to_plain_json(&self) -> Option<Vec<u8>> {
        let DedupKey::MessageId(message_id) = &self.key else {
            return None;
        };
        if let Event::StockReserved(_) = self.event {
            return None;
        }
        let mut body = serde_json::Map::new();
        body.insert("message_id".into(), message_id.as_str().into());
        body.insert("order_id".into(), self.event.order_id().to_string().into());
        if let Event::Placed(placed) = &self.event {
            body.insert("book_id".into(), placed.book_id.to_string().into());
            body.insert("quantity".into(), placed.quantity.get().into());
        }
        if let Some(correlation_id) = &self.correlation_id {
            body.insert("correlation_id".into(), correlation_id.as_str().into());
        }
        if let Some(occurred_at) = &self.occurred_at {
            body.insert("occurred_at".into(), occurred_at.as_str().into());
        }
        serde_json::to_vec(&body).ok()
    }
}

/// The placements among `messages`, each with its dedup key as stored: what a batch of the
/// natural key commits together.
pub fn keyed_placements(messages: &[Message]) -> Vec<(Cow<'_, str>, &OrderPlaced)> {
    messages
        .iter()
        .filter_map(|message| match &message.event {
            Event::Placed(placed) => Some((message.key.storage_key(), placed)),
            Event::Cancelled(_) | Event::StockReserved(_) => None,
        })
        .collect()
}

fn truncate(value: &str) -> String {
    value.chars().take(64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const ORDER: &str = "0190f5c4-3c2e-7b4a-9d3e-1f2a3b4c5d6e";
    const BOOK: &str = "0190f5c4-3c2e-7b4a-9d3e-aaaaaaaaaaaa";

    fn placed_body(extra: &str) -> Vec<u8> {
        format!(
            r#"{{"message_id":"m-1","order_id":"{ORDER}","book_id":"{BOOK}","quantity":2{extra}}}"#
        )
        .into_bytes()
    }

    #[test]
    fn plain_order_placed_is_decoded_and_unknown_fields_ignored() {
        let message = Message::decode(
            EventKind::Placed,
            &placed_body(r#","correlation_id":"c-9","colour":"blue""#),
        )
        .expect("valid body");
        assert_eq!(
            message.key,
            DedupKey::MessageId(MessageId::parse("m-1").expect("valid id"))
        );
        assert_eq!(message.correlation_id.as_deref(), Some("c-9"));
        let Event::Placed(placed) = message.event else {
            panic!("expected OrderPlaced")
        };
        assert_eq!(placed.quantity.get(), 2);
    }

    /// The ids are borrowed from the body when they can be; one with a JSON escape cannot, and
    /// decodes the same.
    #[test]
    fn ids_written_with_escapes_decode_as_without() {
        let plain = Message::decode(EventKind::Placed, &placed_body("")).expect("valid body");
        let escaped = |id: &str| id.replacen('-', r"\u002d", 1);
        let body = format!(
            r#"{{"message_id":"m-1","order_id":"{}","book_id":"{}","quantity":2}}"#,
            escaped(ORDER),
            escaped(BOOK)
        );
        assert_eq!(
            Message::decode(EventKind::Placed, body.as_bytes()).expect("escaped ids"),
            plain
        );
        let cloud_event = format!(
            r#"{{"specversion":"1.0","id":"e-1","source":"/shop","type":"bookstore.order.placed","data":{{"order_id":"{}","book_id":"{}","quantity":2}}}}"#,
            escaped(ORDER),
            escaped(BOOK)
        );
        let decoded = Message::decode(EventKind::Placed, cloud_event.as_bytes()).expect("escaped");
        assert_eq!(decoded.event, plain.event);
    }

    #[test]
    fn the_correlation_id_never_becomes_the_key() {
        let message = Message::decode(
            EventKind::Placed,
            &placed_body(r#","correlation_id":"shared""#),
        )
        .expect("valid body");
        assert_eq!(message.key.storage_key(), "m-1");
    }

    /// The key of the CloudEvents below: source `/shop`, id `e-1`.
    fn shop_event_key() -> DedupKey {
        DedupKey::CloudEvent {
            source: "/shop".into(),
            id: "e-1".into(),
        }
    }

    #[test]
    fn cloud_event_is_keyed_by_source_and_id() {
        let body = format!(
            r#"{{"specversion":"1.0","id":"e-1","source":"/shop","type":"bookstore.order.cancelled","data":{{"order_id":"{ORDER}"}}}}"#
        );
        let message = Message::decode(EventKind::Cancelled, body.as_bytes()).expect("valid");
        assert_eq!(message.key, shop_event_key());
        assert!(matches!(message.event, Event::Cancelled(_)));
    }

    #[test]
    fn a_specversion_makes_a_cloud_event_even_beside_plain_fields() {
        let body = format!(
            r#"{{"specversion":"1.0","message_id":"m-1","order_id":"{ORDER}","id":"e-1","source":"/shop","type":"bookstore.order.cancelled","data":{{"order_id":"{ORDER}"}}}}"#
        );
        let message = Message::decode(EventKind::Cancelled, body.as_bytes()).expect("valid");
        assert_eq!(message.key, shop_event_key());
    }

    #[test]
    fn a_plain_body_with_a_null_specversion_stays_plain() {
        let message = Message::decode(EventKind::Placed, &placed_body(r#","specversion":null"#))
            .expect("valid body");
        assert_eq!(message.key.storage_key(), "m-1");
    }

    #[test]
    fn cloud_event_of_the_other_type_is_invalid() {
        let body = format!(
            r#"{{"specversion":"1.0","id":"e-1","source":"/shop","type":"bookstore.order.cancelled","data":{{"order_id":"{ORDER}"}}}}"#
        );
        let error = Message::decode(EventKind::Placed, body.as_bytes()).expect_err("mismatch");
        assert_eq!(error.reason(), DeadLetterReason::Invalid);
    }

    #[test]
    fn cloud_event_without_source_is_malformed() {
        let body = format!(
            r#"{{"specversion":"1.0","id":"e-1","type":"bookstore.order.cancelled","data":{{"order_id":"{ORDER}"}}}}"#
        );
        let error = Message::decode(EventKind::Cancelled, body.as_bytes()).expect_err("no source");
        assert_eq!(error.reason(), DeadLetterReason::Malformed);
    }

    #[test]
    fn broken_shapes_are_malformed() {
        for body in [
            &b"{"[..],
            b"[]",
            b"\xff\xfe",
            br#"{"message_id":"m","order_id":"x","book_id":"y","quantity":"2"}"#,
            br#"{"message_id":"m","message_id":"n","order_id":"x","book_id":"y","quantity":2}"#,
            br#"{"order_id":"x","book_id":"y","quantity":2}"#,
            br#"{"message_id":"m","order_id":"x","book_id":"y","quantity":2,"quantity":3}"#,
        ] {
            let error = Message::decode(EventKind::Placed, body).expect_err("malformed");
            assert_eq!(error.reason(), DeadLetterReason::Malformed, "{body:?}");
        }
    }

    #[test]
    fn invalid_utf8_in_an_unknown_field_is_malformed() {
        let mut body = placed_body(r#","title":"B"#);
        body.truncate(body.len() - 1);
        body.extend_from_slice(b"\xfccher\"}");
        let error = Message::decode(EventKind::Placed, &body).expect_err("not UTF-8");
        assert_eq!(error.reason(), DeadLetterReason::Malformed);
    }

    #[test]
    fn rule_breaking_values_are_invalid() {
        for body in [
            format!(r#"{{"message_id":"","order_id":"{ORDER}","book_id":"{BOOK}","quantity":2}}"#),
            format!(r#"{{"message_id":"m","order_id":"nope","book_id":"{BOOK}","quantity":2}}"#),
            format!(r#"{{"message_id":"m","order_id":"{ORDER}","book_id":"{BOOK}","quantity":0}}"#),
            format!(
                r#"{{"message_id":"m","order_id":"{ORDER}","book_id":"{BOOK}","quantity":10001}}"#
            ),
        ] {
            let error = Message::decode(EventKind::Placed, body.as_bytes()).expect_err("invalid");
            assert_eq!(error.reason(), DeadLetterReason::Invalid, "{body}");
        }
    }

    #[test]
    fn plain_json_round_trips() {
        let message = Message::decode(
            EventKind::Placed,
            &placed_body(r#","correlation_id":"c","occurred_at":"2026-11-30T10:00:00Z""#),
        )
        .expect("valid");
        let body = message.to_plain_json().expect("message id key");
        assert_eq!(Message::decode(EventKind::Placed, &body), Ok(message));
    }

    #[test]
    fn subject_names_the_kind() {
        assert_eq!(
            EventKind::from_subject("orders.placed"),
            Some(EventKind::Placed)
        );
        assert_eq!(
            EventKind::from_subject("t1.orders.cancelled"),
            Some(EventKind::Cancelled)
        );
        assert_eq!(EventKind::from_subject("orders.shipped"), None);
    }

    #[test]
    fn a_subject_may_name_the_book_and_its_partition() {
        let book = "0b5e2c1a-9f3d-4c7e-8a61-2d4f6b8c0e1a";
        let placed = format!("orders.placed.{book}");
        assert_eq!(
            Subject::parse(&placed),
            Some(Subject {
                kind: EventKind::Placed,
                book: Some(book),
                partition: None
            })
        );
        let routed = format!("t1.orders.placed.17.{book}");
        assert_eq!(
            Subject::parse(&routed),
            Some(Subject {
                kind: EventKind::Placed,
                book: Some(book),
                partition: Some("17")
            })
        );
        assert_eq!(
            Subject::parse(&format!("orders.cancelled.{book}")).map(|s| s.kind),
            Some(EventKind::Cancelled)
        );
        for unknown in [
            format!("orders.shipped.{book}"),
            format!("orders.placed.x7.{book}"),
            format!("orders.17.{book}"),
            book.to_owned(),
        ] {
            assert_eq!(Subject::parse(&unknown), None, "{unknown}");
        }
    }

    #[test]
    fn a_placements_subject_names_its_own_book_in_canonical_form() {
        let event = Event::Placed(OrderPlaced {
            order_id: OrderId::new_v7(),
            book_id: BookId::parse("0B5E2C1A-9F3D-4C7E-8A61-2D4F6B8C0E1A").expect("a UUID"),
            quantity: Quantity::new(1).expect("valid"),
        });
        let subject = format!("orders.{}", event.subject_below_prefix());
        assert_eq!(
            subject,
            "orders.placed.0b5e2c1a-9f3d-4c7e-8a61-2d4f6b8c0e1a"
        );
        let parsed = Subject::parse(&subject).expect("parses");
        assert_eq!(parsed.check(&event), Ok(()));
        let upper = "orders.placed.0B5E2C1A-9F3D-4C7E-8A61-2D4F6B8C0E1A";
        assert!(
            Subject::parse(upper)
                .expect("parses")
                .check(&event)
                .is_err()
        );
        let other = format!("orders.placed.{}", BookId::new_v7());
        assert!(
            Subject::parse(&other)
                .expect("parses")
                .check(&event)
                .is_err()
        );
        let cancelled = Event::Cancelled(OrderCancelled {
            order_id: event.order_id(),
        });
        assert_eq!(cancelled.subject_below_prefix(), "cancelled");
        assert!(parsed.check(&cancelled).is_err());
        assert_eq!(
            Subject::parse("orders.placed")
                .expect("parses")
                .check(&cancelled),
            Ok(())
        );
    }
}
