//! Property tests of the message decoder, the service's first contact with hostile input:
//! it never panics on any bytes, a body it accepts obeys every rule of the contract and
//! survives a round trip, and for plain bodies built field by field it accepts exactly the
//! valid ones and calls a missing or mistyped field malformed and a broken rule invalid.
//!
//! The acceptance properties generate valid messages on purpose (a third of the plain orders, half
//! the envelopes) beside broken and arbitrary ones, and print how many cases of each kind ran
//! (`--nocapture`); too few of a kind fails the test.
//!
//! Run briefly with every `cargo test` (a few hundred cases each); `PROPTEST_CASES` raises it.
#![expect(clippy::unwrap_used, reason = "a test fails by panicking")]

use std::cell::Cell;
use std::str::FromStr;

use inventory_domain::{DeadLetterReason, DedupKey, Event, EventKind, Message, MessageId};
use proptest::prelude::*;
use proptest::test_runner::{TestCaseError, TestRunner};
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
}

/// What became of the cases of one property, printed so a run says how many of each ran.
#[derive(Default)]
struct Tally {
    accepted: Cell<usize>,
    invalid: Cell<usize>,
    malformed: Cell<usize>,
}

impl Tally {
    fn count(&self, result: &Result<Message, DeadLetterReason>) {
        let counter = match result {
            Ok(_) => &self.accepted,
            Err(DeadLetterReason::Invalid) => &self.invalid,
            Err(_) => &self.malformed,
        };
        counter.set(counter.get() + 1);
    }

    /// Prints the tally, and fails if a kind of case the property is about hardly ran: a
    /// generator that drifted away from valid messages would otherwise pass unseen.
    fn report_and_check(&self, property: &str, cases: u32, malformed_expected: bool) {
        let (accepted, invalid, malformed) = (
            self.accepted.get(),
            self.invalid.get(),
            self.malformed.get(),
        );
        println!("{property}: {accepted} accepted, {invalid} invalid, {malformed} malformed");
        let enough = (cases / 8) as usize;
        assert!(accepted >= enough, "only {accepted} accepted cases ran");
        assert!(invalid >= enough, "only {invalid} invalid cases ran");
        if malformed_expected {
            assert!(malformed >= enough, "only {malformed} malformed cases ran");
        }
    }
}

/// A message id the contract accepts: 1 to 100 characters, not blank, no control characters.
fn a_valid_id() -> impl Strategy<Value = String> {
    prop_oneof!["[a-z0-9-]{1,100}", "\\PC{1,100}", Just("x".repeat(100)),]
        .prop_filter("not blank", |id| !id.trim().is_empty())
}

fn a_valid_uuid() -> impl Strategy<Value = String> {
    (any::<u128>(), any::<bool>()).prop_map(|(n, upper)| {
        let text = uuid::Uuid::from_u128(n).to_string();
        if upper { text.to_uppercase() } else { text }
    })
}

/// The four fields of a plain OrderPlaced, each valid.
fn a_valid_order() -> impl Strategy<Value = [Field; 4]> {
    (
        a_valid_id(),
        a_valid_uuid(),
        a_valid_uuid(),
        prop_oneof![Just(1i64), Just(10_000), 1i64..=10_000],
    )
        .prop_map(|(id, order, book, quantity)| {
            [
                Field::Text(id),
                Field::Text(order),
                Field::Text(book),
                Field::Int(quantity),
            ]
        })
}

/// A value of the right JSON type that breaks the rule of field `at` (0 to 3, in
/// [`PLAIN_FIELDS`] order): an id empty, blank, too long or with a control character, a UUID
/// that is none, a quantity outside 1 to 10,000.
fn a_broken_value(at: usize) -> BoxedStrategy<Field> {
    match at {
        0 => prop_oneof![
            Just(String::new()),
            Just("   ".to_owned()),
            "[a-z]{101,130}",
            "[a-z]{0,5}[\x00-\x1f][a-z]{0,5}",
        ]
        .prop_map(Field::Text)
        .boxed(),
        1 | 2 => "[a-z0-9-]{0,40}".prop_map(Field::Text).boxed(),
        _ => prop_oneof![
            Just(0i64),
            Just(-1),
            Just(10_001),
            i64::MIN..=0,
            10_001i64..=i64::MAX
        ]
        .prop_map(Field::Int)
        .boxed(),
    }
}

/// Plain orders of four kinds in equal parts: every field valid; a valid one with one field's
/// rule broken; a valid one with one field replaced by an arbitrary one (often missing or of
/// another type); four arbitrary fields.
fn a_plain_order() -> impl Strategy<Value = [Field; 4]> {
    let one_broken = (a_valid_order(), 0..4usize).prop_flat_map(|(fields, at)| {
        a_broken_value(at).prop_map(move |broken| {
            let mut fields = fields.clone();
            fields[at] = broken;
            fields
        })
    });
    prop_oneof![
        a_valid_order(),
        one_broken,
        (a_valid_order(), 0..4usize, field()).prop_map(|(mut fields, at, other)| {
            fields[at] = other;
            fields
        }),
        (field(), field(), field(), field()).prop_map(|(a, b, c, d)| [a, b, c, d]),
    ]
}

const PLAIN_FIELDS: [&str; 4] = ["message_id", "order_id", "book_id", "quantity"];

#[test]
fn a_plain_order_is_accepted_exactly_when_every_field_is_valid() {
    let config = config();
    let cases = config.cases;
    let tally = Tally::default();
    let strategy = (a_plain_order(), prop::option::of(("[a-z_]{1,12}", text())));
    TestRunner::new(config)
        .run(&strategy, |(fields, extra)| {
            let mut body = serde_json::Map::new();
            for (name, field) in PLAIN_FIELDS.iter().zip(&fields) {
                if let Some(value) = field.json() {
                    body.insert((*name).into(), value);
                }
            }
            if let Some((name, value)) = extra
                && !PLAIN_FIELDS.contains(&name.as_str())
                && !["correlation_id", "occurred_at"].contains(&name.as_str())
            {
                // Unknown fields are ignored.
                body.insert(name, json!(value));
            }
            let result = check(
                EventKind::Placed,
                Value::Object(body).to_string().as_bytes(),
            );
            tally.count(&result);

            let [message_id, order_id, book_id, quantity] = &fields;
            let typed = text_of(message_id).is_some()
                && text_of(order_id).is_some()
                && text_of(book_id).is_some()
                && matches!(quantity, Field::Int(_));
            if !typed {
                // Something missing, null or of the wrong type.
                prop_assert!(result.is_err(), "{result:?}");
                if text_of(message_id).is_none() || text_of(order_id).is_none() {
                    prop_assert_eq!(result.unwrap_err(), DeadLetterReason::Malformed);
                }
                return Ok(());
            }
            let Field::Int(copies) = quantity else {
                unreachable!()
            };
            let (id, order, book) = (
                text_of(message_id).unwrap(),
                text_of(order_id).unwrap(),
                text_of(book_id).unwrap(),
            );
            let valid = valid_id(id)
                && valid_uuid(order)
                && valid_uuid(book)
                && (1..=10_000).contains(copies);
            if !valid {
                prop_assert_eq!(result.unwrap_err(), DeadLetterReason::Invalid);
                return Ok(());
            }
            // Accepted, and as sent: the decoder kept every field.
            let message = result.map_err(|reason| TestCaseError::fail(format!("{reason:?}")))?;
            prop_assert_eq!(
                &message.key,
                &DedupKey::MessageId(MessageId::parse(id).unwrap())
            );
            let Event::Placed(placed) = &message.event else {
                unreachable!()
            };
            prop_assert_eq!(
                placed.order_id.as_uuid(),
                uuid::Uuid::from_str(order).unwrap()
            );
            prop_assert_eq!(
                placed.book_id.as_uuid(),
                uuid::Uuid::from_str(book).unwrap()
            );
            prop_assert_eq!(i64::from(placed.quantity.get()), *copies);
            Ok(())
        })
        .unwrap();
    tally.report_and_check("plain orders", cases, true);
}

/// A CloudEvents envelope: valid on purpose in half the cases, arbitrary in the rest.
fn an_envelope() -> impl Strategy<Value = (String, String, String, String)> {
    let valid =
        (a_valid_id(), prop_oneof!["/[a-z]{1,999}", "\\PC{1,1000}"]).prop_map(|(id, source)| {
            (
                "1.0".to_owned(),
                id,
                source,
                "bookstore.order.placed".to_owned(),
            )
        });
    let arbitrary = (
        prop_oneof![Just("1.0".to_owned()), text()],
        text(),
        prop_oneof![Just("/shop".to_owned()), "/[a-z]{1000,1010}", text()],
        prop_oneof![
            Just("bookstore.order.placed".to_owned()),
            Just("bookstore.order.cancelled".to_owned()),
            text()
        ],
    );
    prop_oneof![valid, arbitrary]
}

#[test]
fn a_cloud_event_is_accepted_exactly_when_its_envelope_is_valid() {
    let config = config();
    let cases = config.cases;
    let tally = Tally::default();
    TestRunner::new(config)
        .run(&an_envelope(), |(specversion, id, source, event_type)| {
            let body = json!({
                "specversion": specversion,
                "id": id,
                "source": source,
                "type": event_type,
                "data": {"order_id": ORDER, "book_id": BOOK, "quantity": 2},
            });
            let result = check(EventKind::Placed, body.to_string().as_bytes());
            tally.count(&result);
            let source_chars = source.chars().count();
            let valid = specversion == "1.0"
                && event_type == "bookstore.order.placed"
                && valid_id(&id)
                && (1..=1_000).contains(&source_chars);
            if valid {
                let message =
                    result.map_err(|reason| TestCaseError::fail(format!("{reason:?}")))?;
                prop_assert_eq!(message.key, DedupKey::CloudEvent { source, id });
            } else {
                prop_assert_eq!(result.unwrap_err(), DeadLetterReason::Invalid);
            }
            Ok(())
        })
        .unwrap();
    tally.report_and_check("cloud events", cases, false);
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
