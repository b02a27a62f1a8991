//! Identifiers and amounts that can only be built valid.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use sha2::{Digest, Sha256};
use uuid::Uuid;

/// Why a field of a message was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FieldError {
    #[error("{field} must be 1 to {max} characters, got {len}")]
    Length {
        field: &'static str,
        max: usize,
        len: usize,
    },
    /// PostgreSQL cannot store NUL in text at all, and control characters have no business in
    /// an identifier that ends up in logs and headers.
    #[error("{field} must not contain control characters")]
    ControlCharacter { field: &'static str },
    #[error("{field} must be an integer from {min} to {max}, got {value}")]
    Range {
        field: &'static str,
        min: i64,
        max: i64,
        value: i64,
    },
    #[error("{field} is not a UUID: {value:?}")]
    Uuid { field: &'static str, value: String },
}

fn bounded_text(field: &'static str, max: usize, value: String) -> Result<String, FieldError> {
    let len = value.chars().count();
    if len == 0 || len > max || value.trim().is_empty() {
        return Err(FieldError::Length { field, max, len });
    }
    if value.chars().any(char::is_control) {
        return Err(FieldError::ControlCharacter { field });
    }
    Ok(value)
}

/// The producer's id for one message: 1 to 100 characters, kept across the producer's retries.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MessageId(String);

impl MessageId {
    pub const MAX_CHARS: usize = 100;

    pub fn parse(value: impl Into<String>) -> Result<Self, FieldError> {
        bounded_text("message_id", Self::MAX_CHARS, value.into()).map(Self)
    }

    /// A fresh id for a new message (UUID v7: time-ordered, so inbox indexes stay compact).
    pub fn generate() -> Self {
        Self(Uuid::now_v7().to_string())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

macro_rules! uuid_id {
    ($(#[$doc:meta])* $name:ident, $field:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Uuid);

        impl $name {
            pub fn parse(value: &str) -> Result<Self, FieldError> {
                Uuid::from_str(value).map(Self).map_err(|_| FieldError::Uuid {
                    field: $field,
                    value: value.chars().take(64).collect(),
                })
            }

            pub fn new_v7() -> Self {
                Self(Uuid::now_v7())
            }

            pub fn as_uuid(&self) -> Uuid {
                self.0
            }
        }

        impl From<Uuid> for $name {
            fn from(value: Uuid) -> Self {
                Self(value)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl FromStr for $name {
            type Err = FieldError;
            fn from_str(value: &str) -> Result<Self, Self::Err> {
                Self::parse(value)
            }
        }
    };
}

uuid_id!(
    /// The order a message is about: together with the book, the natural key of a reservation.
    OrderId,
    "order_id"
);
uuid_id!(
    /// A book held in stock.
    BookId,
    "book_id"
);

/// Copies of one book in one order: 1 to 10,000.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Quantity(u32);

impl Quantity {
    pub const MAX: u32 = 10_000;

    pub fn new(value: i64) -> Result<Self, FieldError> {
        if (1..=i64::from(Self::MAX)).contains(&value) {
            Ok(Self(value as u32))
        } else {
            Err(FieldError::Range {
                field: "quantity",
                min: 1,
                max: i64::from(Self::MAX),
                value,
            })
        }
    }

    pub fn get(self) -> u32 {
        self.0
    }
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The name of a handler, the second half of the inbox key: the same message is processed once
/// per consumer, not once overall.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ConsumerName(String);

impl ConsumerName {
    pub const MAX_CHARS: usize = 100;

    pub fn parse(value: impl Into<String>) -> Result<Self, FieldError> {
        bounded_text("consumer", Self::MAX_CHARS, value.into()).map(Self)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ConsumerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What the inbox deduplicates on: the producer's message id, or for a CloudEvent its `source`
/// and `id` together. Never the correlation id, never a broker value such as a stream sequence.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum DedupKey {
    MessageId(MessageId),
    CloudEvent { source: String, id: String },
}

impl DedupKey {
    /// The key as stored in `inbox.message_id` (at most 100 characters). A CloudEvent's pair is
    /// hashed with the source's length in front, so no two pairs can collide by concatenation.
    /// A message id is its own key, borrowed: every message's path asks for it.
    pub fn storage_key(&self) -> Cow<'_, str> {
        match self {
            Self::MessageId(id) => Cow::Borrowed(id.as_str()),
            Self::CloudEvent { source, id } => {
                let mut hasher = Sha256::new();
                hasher.update((source.len() as u64).to_be_bytes());
                hasher.update(source.as_bytes());
                hasher.update(id.as_bytes());
                Cow::Owned(format!("ce:{}", hex::encode(hasher.finalize())))
            }
        }
    }
}

impl fmt::Display for DedupKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MessageId(id) => id.fmt(f),
            Self::CloudEvent { source, id } => write!(f, "{source}#{id}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_id_accepts_one_to_a_hundred_characters() {
        assert!(MessageId::parse("m").is_ok());
        assert!(MessageId::parse("é".repeat(100)).is_ok());
        assert!(MessageId::parse("").is_err());
        assert!(MessageId::parse("   ").is_err());
        assert!(MessageId::parse("x".repeat(101)).is_err());
    }

    #[test]
    fn message_id_refuses_control_characters() {
        for id in ["m\0", "m\n1", "\u{7f}", "m\u{9b}"] {
            assert_eq!(
                MessageId::parse(id),
                Err(FieldError::ControlCharacter {
                    field: "message_id"
                }),
                "{id:?}"
            );
        }
        assert!(MessageId::parse("m-1 ü ☃").is_ok());
    }

    #[test]
    fn quantity_is_bounded() {
        assert_eq!(Quantity::new(1).map(Quantity::get), Ok(1));
        assert_eq!(Quantity::new(10_000).map(Quantity::get), Ok(10_000));
        assert!(Quantity::new(0).is_err());
        assert!(Quantity::new(-3).is_err());
        assert!(Quantity::new(10_001).is_err());
    }

    #[test]
    fn uuids_are_validated() {
        assert!(OrderId::parse("0190f5c4-3c2e-7b4a-9d3e-1f2a3b4c5d6e").is_ok());
        assert!(BookId::parse("not-a-uuid").is_err());
    }

    #[test]
    fn cloud_event_keys_do_not_collide_by_concatenation() {
        let a = DedupKey::CloudEvent {
            source: "a#b".into(),
            id: "c".into(),
        };
        let b = DedupKey::CloudEvent {
            source: "a".into(),
            id: "b#c".into(),
        };
        assert_ne!(a.storage_key(), b.storage_key());
        assert!(a.storage_key().chars().count() <= MessageId::MAX_CHARS);
    }

    #[test]
    fn same_cloud_event_id_from_another_source_is_another_key() {
        let key = |source: &str| DedupKey::CloudEvent {
            source: source.into(),
            id: "42".into(),
        };
        assert_ne!(key("/shop").storage_key(), key("/warehouse").storage_key());
        assert_eq!(key("/shop").storage_key(), key("/shop").storage_key());
    }
}
