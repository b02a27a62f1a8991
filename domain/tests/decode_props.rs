//! Property tests of the message decoder, the service's first contact with hostile input:
//! it never panics on any bytes, a body it accepts obeys every rule of the contract and
//! survives a round trip, and for plain bodies built field by field it accepts exactly the
//! valid ones and calls a missing or mistyped field malformed and a broken rule invalid.
//!
//! Run briefly with every `cargo test` (a few hundred cases each); `PROPTEST_CASES` raises it.
#![expect(clippy::unwrap_used, reason = "a test fails by panicking")]

use std::str::FromStr;

use inventory_domain::{DeadLetterReason, DedupKey, Event, EventKind, Message};
use proptest::prelude::*;
use serde_json::{Value, json};

const BOOK: &str = "0190f5c4-3c2e-7b4a-9d3e-aaaaaaaaaaaa";
const ORDER: &str = "0190f5c4-3c2e-7b4a-9d3e-1f2a3b4c5d6e";

fn config() -> ProptestConfig {
    // Brief by default: CI runs it with the rest; the environment variable asks for more.
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(512);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn kind() -> impl Strategy<Value = EventKind> {
    prop_oneof![Just(EventKind::Placed), Just(EventKind::Cancelled)]
}

/// What the contract allows of a decoded message, whatever body it came from.
fn obeys_the_rules(message: &Message, kind: EventKind) {
    let id = match &message.key {
        DedupKey::MessageId(id) => id.as_str().to_owned(),
        DedupKey::CloudEvent { source, id } => {
            let len = source.chars().count();
            assert!((1..=1_000).contains(&len), "source of {len} chars");
            id.clone()
        }
    };
    let len = id.chars().count();
    assert!(valid_id(&id), "id {id:?} of {len} chars");
    assert_eq!(message.event.kind(), kind);
    if let Event::Placed(placed) = &message.event {
        assert!((1..=10_000).contains(&placed.quantity.get()));
    }
    if let Some(body) = message.to_plain_json() {
        assert_eq!(Message::decode(kind, &body).as_ref(), Ok(message));
    }
}

fn check(kind: EventKind, body: &[u8]) -> Result<Message, DeadLetterReason> {
    match Message::decode(kind, body) {
        Ok(message) => {
            obeys_the_rules(&message, kind);
            Ok(message)
        }
        Err(error) => {
            let reason = error.reason();
            assert!(
                matches!(
                    reason,
                    DeadLetterReason::Malformed | DeadLetterReason::Invalid
                ),
                "{error}"
            );
            Err(reason)
        }
    }
}

/// A valid plain body to mutate.
fn valid_body() -> Vec<u8> {
    format!(r#"{{"message_id":"m-1","order_id":"{ORDER}","book_id":"{BOOK}","quantity":2}}"#)
        .into_bytes()
}

fn valid_cloud_event() -> Vec<u8> {
    format!(
        r#"{{"specversion":"1.0","id":"e-1","source":"/shop","type":"bookstore.order.placed","data":{{"order_id":"{ORDER}","book_id":"{BOOK}","quantity":2}}}}"#
    )
    .into_bytes()
}

/// One field of a plain body as a test builds it.
#[derive(Debug, Clone)]
enum Field {
    Missing,
    Text(String),
    Int(i64),
    Float(f64),
    Bool(bool),
    Null,
}

impl Field {
    fn json(&self) -> Option<Value> {
        match self {
            Self::Missing => None,
            Self::Text(text) => Some(json!(text)),
            Self::Int(n) => Some(json!(n)),
            Self::Float(x) => Some(json!(x)),
            Self::Bool(b) => Some(json!(b)),
            Self::Null => Some(Value::Null),
        }
    }
}

/// Texts that are sometimes valid ids or UUIDs and often not.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(ORDER.to_owned()),
        Just(BOOK.to_owned()),
        Just(String::new()),
        Just("   ".to_owned()),
        "[a-z0-9-]{1,100}",
        "[a-z]{101,130}",
        any::<String>(),
    ]
}

fn field() -> impl Strategy<Value = Field> {
    prop_oneof![
        4 => text().prop_map(Field::Text),
        2 => prop_oneof![Just(0i64), Just(1), Just(10_000), Just(10_001), Just(-1), any::<i64>(), 1i64..=10_000]
            .prop_map(Field::Int),
        1 => any::<f64>().prop_filter("JSON has no NaN or infinity", |x| x.is_finite()).prop_map(Field::Float),
        1 => any::<bool>().prop_map(Field::Bool),
        1 => Just(Field::Null),
        1 => Just(Field::Missing),
    ]
}

fn text_of(field: &Field) -> Option<&str> {
    match field {
        Field::Text(text) => Some(text),
        _ => None,
    }
}

fn valid_id(text: &str) -> bool {
    let len = text.chars().count();
    (1..=100).contains(&len) && !text.trim().is_empty() && !text.chars().any(char::is_control)
}

fn valid_uuid(text: &str) -> bool {
    uuid::Uuid::from_str(text).is_ok()
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn arbitrary_bytes_never_panic(kind in kind(), body in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = check(kind, &body);
    }

    #[test]
    fn a_valid_body_cut_or_flipped_never_panics(
        kind in kind(),
        cloud in any::<bool>(),
        cut in any::<prop::sample::Index>(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
    ) {
        let mut body = if cloud { valid_cloud_event() } else { valid_body() };
        for (at, byte) in flips {
            let at = at.index(body.len());
            body[at] = byte;
        }
        let keep = cut.index(body.len() + 1);
        body.truncate(keep);
        let _ = check(kind, &body);
    }

    #[test]
    fn any_json_value_never_panics(kind in kind(), value in json_value()) {
        let _ = check(kind, value.to_string().as_bytes());
    }

    #[test]
    fn a_plain_order_is_accepted_exactly_when_every_field_is_valid(
        message_id in field(),
        order_id in field(),
        book_id in field(),
        quantity in field(),
        extra in prop::option::of(("[a-z_]{1,12}", text())),
    ) {
        let mut body = serde_json::Map::new();
        for (name, field) in [("message_id", &message_id), ("order_id", &order_id), ("book_id", &book_id), ("quantity", &quantity)] {
            if let Some(value) = field.json() {
                body.insert(name.into(), value);
            }
        }
        if let Some((name, value)) = extra
            && !["message_id", "order_id", "book_id", "quantity", "correlation_id", "occurred_at"].contains(&name.as_str())
        {
            // Unknown fields are ignored.
            body.insert(name, json!(value));
        }
        let result = check(EventKind::Placed, Value::Object(body).to_string().as_bytes());

        let typed = text_of(&message_id).is_some()
            && text_of(&order_id).is_some()
            && text_of(&book_id).is_some()
            && matches!(quantity, Field::Int(_));
        if !typed {
            // Something missing, null or of the wrong type.
            prop_assert!(result.is_err(), "{result:?}");
            if text_of(&message_id).is_none() || text_of(&order_id).is_none() {
                prop_assert_eq!(result.unwrap_err(), DeadLetterReason::Malformed);
            }
        } else {
            let Field::Int(copies) = quantity else { unreachable!() };
            let valid = valid_id(text_of(&message_id).unwrap())
                && valid_uuid(text_of(&order_id).unwrap())
                && valid_uuid(text_of(&book_id).unwrap())
                && (1..=10_000).contains(&copies);
            if valid {
                prop_assert!(result.is_ok(), "{result:?}");
            } else {
                prop_assert_eq!(result.unwrap_err(), DeadLetterReason::Invalid);
            }
        }
    }

    #[test]
    fn a_cloud_event_is_accepted_exactly_when_its_envelope_is_valid(
        specversion in prop_oneof![Just("1.0".to_owned()), text()],
        id in text(),
        source in prop_oneof![Just("/shop".to_owned()), "/[a-z]{1000,1010}", text()],
        event_type in prop_oneof![Just("bookstore.order.placed".to_owned()), Just("bookstore.order.cancelled".to_owned()), text()],
    ) {
        let body = json!({
            "specversion": specversion,
            "id": id,
            "source": source,
            "type": event_type,
            "data": {"order_id": ORDER, "book_id": BOOK, "quantity": 2},
        });
        let result = check(EventKind::Placed, body.to_string().as_bytes());
        let source_chars = source.chars().count();
        let valid = specversion == "1.0"
            && event_type == "bookstore.order.placed"
            && valid_id(&id)
            && (1..=1_000).contains(&source_chars);
        if valid {
            prop_assert!(result.is_ok(), "{result:?}");
        } else {
            prop_assert_eq!(result.unwrap_err(), DeadLetterReason::Invalid);
        }
    }
}

/// Arbitrary JSON values, nested a few levels, with the contract's field names among the keys.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        text().prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::vec(
                (
                    prop_oneof![
                        Just("message_id".to_owned()),
                        Just("order_id".to_owned()),
                        Just("book_id".to_owned()),
                        Just("quantity".to_owned()),
                        Just("specversion".to_owned()),
                        Just("source".to_owned()),
                        Just("data".to_owned()),
                        "[a-z]{1,8}",
                    ],
                    inner
                ),
                0..8
            )
            .prop_map(|pairs| Value::Object(pairs.into_iter().collect())),
        ]
    })
}
