//! The dead-letter format, written by the consumer and read by `inventory dlq`: the headers a
//! dead letter carries, its own `Nats-Msg-Id`, how it reads back, the id of its replay, and the
//! stream's reads, replays and deletes.
//!
//! A dead letter is the original body with the original headers, except its `Nats-Msg-Id`
//! (kept as `Dlq-Original-Msg-Id`: the dead letter has an id of its own), and the `Dlq-*`
//! headers of the contract.

use std::collections::BTreeMap;

use async_nats::HeaderMap;
use async_nats::jetstream::Context;
use async_nats::jetstream::message::{PublishMessage as Publish, StreamMessage};
use async_nats::jetstream::stream::{RawMessageErrorKind, Stream};
use bytes::Bytes;
use inventory_domain::DeadLetterReason;
use serde::Serialize;

use super::{NatsError, PublishReceipt, Topology, header_map, nats_error};

/// Dead-letter headers of the contract.
pub mod dlq_headers {
    pub const REASON: &str = "Dlq-Reason";
    pub const DETAIL: &str = "Dlq-Detail";
    pub const STREAM: &str = "Dlq-Stream";
    pub const STREAM_SEQUENCE: &str = "Dlq-Stream-Sequence";
    pub const DELIVERIES: &str = "Dlq-Deliveries";
    /// Not in the contract's list: the subject the original was published to, for a replay.
    pub const SUBJECT: &str = "Dlq-Subject";
    /// The original's `Nats-Msg-Id`, which the dead letter's own id replaces.
    pub const ORIGINAL_MSG_ID: &str = "Dlq-Original-Msg-Id";
}

/// Where a delivery came from, for its dead letter; borrowed from the delivery, since every
/// message's path reads it and few are dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Origin<'a> {
    pub subject: &'a str,
    pub stream: &'a str,
    pub stream_sequence: u64,
    pub deliveries: i64,
}

/// Header values are one line; details are cut so a hostile body cannot bloat the DLQ.
fn header_value(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(1_000)
        .collect()
}

fn is_original_id(name: &str) -> bool {
    name.eq_ignore_ascii_case(async_nats::header::NATS_MESSAGE_ID.as_ref())
}

/// The headers of `origin`'s dead letter.
fn write_headers(
    origin: &Origin<'_>,
    original_headers: Option<&HeaderMap>,
    reason: DeadLetterReason,
    detail: &str,
) -> HeaderMap {
    let mut headers = HeaderMap::new();
    let mut original_id = None;
    if let Some(original) = original_headers {
        for (name, values) in original.iter() {
            if is_original_id(name.as_ref()) {
                original_id = values.first().map(|value| value.as_str());
                continue;
            }
            for value in values {
                headers.append(name.clone(), value.clone());
            }
        }
    }
    let mut set = |name: &'static str, value: &str| {
        headers.insert(name, header_value(value).as_str());
    };
    set(dlq_headers::REASON, reason.as_str());
    set(dlq_headers::DETAIL, detail);
    set(dlq_headers::STREAM, origin.stream);
    set(
        dlq_headers::STREAM_SEQUENCE,
        &origin.stream_sequence.to_string(),
    );
    set(dlq_headers::DELIVERIES, &origin.deliveries.to_string());
    set(dlq_headers::SUBJECT, origin.subject);
    if let Some(original_id) = original_id {
        set(dlq_headers::ORIGINAL_MSG_ID, original_id);
    }
    headers
}

/// The dead letter's own `Nats-Msg-Id`, derived from the consumer and the original's place in
/// its stream: publishing it again after a crash stores it once.
fn dead_letter_id(consumer: &str, origin: &Origin<'_>) -> String {
    format!(
        "dlq:{consumer}:{}:{}",
        origin.stream, origin.stream_sequence
    )
}

/// Publishes a consumer's dead letters to `dlq.<consumer>` on the dead-letter stream.
#[derive(Clone)]
pub struct DeadLetters {
    js: Context,
    subject: String,
    consumer: String,
}

impl DeadLetters {
    pub fn new(js: Context, topology: &Topology, consumer: &str) -> Self {
        Self {
            js,
            subject: topology.dlq_subject(consumer),
            consumer: consumer.to_owned(),
        }
    }

    /// Publishes the dead letter and waits for the stream to store it.
    pub async fn publish(
        &self,
        origin: &Origin<'_>,
        original_headers: Option<&HeaderMap>,
        body: Bytes,
        reason: DeadLetterReason,
        detail: &str,
    ) -> Result<PublishReceipt, NatsError> {
        let id = dead_letter_id(&self.consumer, origin);
        let publish = Publish::build()
            // The header map first: `headers` replaces the map, and would drop the id.
            .headers(write_headers(origin, original_headers, reason, detail))
            .message_id(&id)
            .payload(body);
        let doing = format!("publishing dead letter {id}");
        let ack = self
            .js
            .send_publish(self.subject.clone(), publish)
            .await
            .map_err(nats_error(doing.clone()))?
            .await
            .map_err(nats_error(doing))?;
        Ok(PublishReceipt {
            sequence: ack.sequence,
            duplicate: ack.duplicate,
        })
    }
}

/// What waits in the dead-letter stream for one consumer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Waiting {
    pub count: u64,
    /// When the oldest was stored, Unix seconds; `None` when none waits.
    pub oldest_stored_at: Option<i64>,
}

/// A dead letter as the dead-letter stream holds it (and as `dlq list --json` prints it).
#[derive(Debug, Clone, Serialize)]
pub struct DeadLetter {
    /// Its sequence in the dead-letter stream: what `dlq replay --seq` takes.
    pub seq: u64,
    pub reason: String,
    pub detail: String,
    /// The consumer that gave up on it (the last token of its DLQ subject).
    pub consumer: String,
    pub original_subject: Option<String>,
    pub original_stream: Option<String>,
    pub original_sequence: Option<u64>,
    pub original_message_id: Option<String>,
    pub deliveries: Option<i64>,
    /// When the DLQ stored it, Unix seconds; and how long ago that was.
    pub stored_at: i64,
    pub age_seconds: i64,
    /// Every header it carries, the original's and the `Dlq-*` ones.
    pub headers: BTreeMap<String, String>,
    /// The original body; in JSON as text, bytes that are not UTF-8 replaced by U+FFFD.
    #[serde(serialize_with = "as_text")]
    pub body: Bytes,
}

fn as_text<S: serde::Serializer>(body: &Bytes, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&String::from_utf8_lossy(body))
}

impl DeadLetter {
    /// Reads a message of the dead-letter stream; `now` (Unix seconds) gives its age.
    pub fn from_stored(message: StreamMessage, now: i64) -> Self {
        Self::read(
            message.sequence,
            &message.subject,
            header_map(Some(&message.headers)),
            message.payload,
            message.time.unix_timestamp(),
            now,
        )
    }

    fn read(
        seq: u64,
        subject: &str,
        headers: BTreeMap<String, String>,
        body: Bytes,
        stored_at: i64,
        now: i64,
    ) -> Self {
        let get = |name: &str| headers.get(name).cloned();
        Self {
            seq,
            reason: get(dlq_headers::REASON).unwrap_or_default(),
            detail: get(dlq_headers::DETAIL).unwrap_or_default(),
            consumer: subject.rsplit('.').next().unwrap_or_default().to_owned(),
            original_subject: get(dlq_headers::SUBJECT),
            original_stream: get(dlq_headers::STREAM),
            original_sequence: get(dlq_headers::STREAM_SEQUENCE).and_then(|s| s.parse().ok()),
            original_message_id: get(dlq_headers::ORIGINAL_MSG_ID),
            deliveries: get(dlq_headers::DELIVERIES).and_then(|s| s.parse().ok()),
            stored_at,
            age_seconds: (now - stored_at).max(0),
            headers,
            body,
        }
    }

    /// The `Nats-Msg-Id` of its replay: `<original id>:replay:<dead letter sequence>`, stable
    /// per dead letter (a retried replay is stored once), and unlike the original id not
    /// dropped by the orders stream as a duplicate of the original.
    pub fn replay_message_id(&self) -> String {
        match &self.original_message_id {
            Some(id) => format!("{id}:replay:{}", self.seq),
            None => format!("replay:{}", self.seq),
        }
    }

    /// The headers a replay carries: the original's, without the dead letter's own.
    pub fn original_headers(&self) -> impl Iterator<Item = (&str, &str)> {
        self.headers
            .iter()
            .filter(|(name, _)| {
                !(name.to_ascii_lowercase().starts_with("dlq-") || is_original_id(name))
            })
            .map(|(name, value)| (name.as_str(), value.as_str()))
    }
}

/// The dead-letter stream as operators work on it: what it holds, putting one back, deleting one.
pub struct DeadLetterStream {
    js: Context,
    topology: Topology,
}

impl DeadLetterStream {
    pub fn new(js: Context, topology: Topology) -> Self {
        Self { js, topology }
    }

    async fn stream(&self) -> Result<Stream, NatsError> {
        let name = &self.topology.dlq_stream;
        self.js
            .get_stream(name)
            .await
            .map_err(nats_error(format!("opening the dead-letter stream {name}")))
    }

    /// What waits for `consumer`, at a cost that does not grow with the stream: two requests,
    /// the count from the stream's subject index and the oldest's time from a get of its
    /// first message on the consumer's subject.
    pub async fn waiting(&self, consumer: &str) -> Result<Waiting, NatsError> {
        use futures::StreamExt as _;
        let subject = self.topology.dlq_subject(consumer);
        let stream = self
            .js
            .get_stream_no_info(&self.topology.dlq_stream)
            .await
            .map_err(nats_error(format!(
                "opening the dead-letter stream {}",
                self.topology.dlq_stream
            )))?;
        let doing = format!("counting the dead letters on {subject}");
        let mut subjects = stream
            .info_with_subjects(&subject)
            .await
            .map_err(nats_error(doing.clone()))?;
        // The filter is one subject: the first page holds its count, if any; asking on would
        // be a request for an empty second page.
        let count = match subjects.next().await {
            Some(entry) => {
                let (name, messages) = entry.map_err(nats_error(doing))?;
                if name == subject {
                    u64::try_from(messages).unwrap_or(u64::MAX)
                } else {
                    0
                }
            }
            None => 0,
        };
        if count == 0 {
            return Ok(Waiting::default());
        }
        let oldest = match stream.get_next_raw_message_by_subject(&subject).await {
            Ok(first) => Some(first.time.unix_timestamp()),
            // Deleted since it was counted.
            Err(error) if error.kind() == RawMessageErrorKind::NoMessageFound => None,
            Err(error) => {
                return Err(nats_error(format!(
                    "reading the oldest dead letter on {subject}"
                ))(error));
            }
        };
        Ok(Waiting {
            count,
            oldest_stored_at: oldest,
        })
    }

    /// Every dead letter it holds, oldest first; `now` (Unix seconds) gives their ages.
    pub async fn read_all(&self, now: i64) -> Result<Vec<DeadLetter>, NatsError> {
        let mut stream = self.stream().await?;
        let state = stream
            .info()
            .await
            .map_err(nats_error("reading the dead-letter stream"))?
            .state
            .clone();
        let mut letters = Vec::new();
        if state.messages == 0 {
            return Ok(letters);
        }
        for seq in state.first_sequence..=state.last_sequence {
            match stream.get_raw_message(seq).await {
                Ok(message) => letters.push(DeadLetter::from_stored(message, now)),
                // Replayed (deleted) ones leave gaps in the sequence.
                Err(error) if error.kind() == RawMessageErrorKind::NoMessageFound => {}
                Err(error) => {
                    return Err(nats_error(format!("reading dead letter {seq}"))(error));
                }
            }
        }
        Ok(letters)
    }

    /// Deletes the dead letter `seq`: whether it was there to delete (another operator's delete
    /// or replay may have taken it since it was read).
    pub async fn delete(&self, seq: u64) -> Result<bool, NatsError> {
        let stream = self.stream().await?;
        let doing = format!("deleting dead letter {seq}");
        match stream.delete_message(seq).await {
            Ok(deleted) => Ok(deleted),
            // The server refuses to delete a message it does not hold; asked again, it says
            // which by the error's code, not its text.
            Err(error) => match stream.get_raw_message(seq).await {
                Err(gone) if gone.kind() == RawMessageErrorKind::NoMessageFound => Ok(false),
                _ => Err(nats_error(doing)(error)),
            },
        }
    }

    /// Republishes `letter` to `subject` (its original one) with its original headers under
    /// its replay id, and only once the orders stream stored it deletes it from here.
    pub async fn replay(
        &self,
        letter: &DeadLetter,
        subject: &str,
    ) -> Result<PublishReceipt, NatsError> {
        let mut headers = HeaderMap::new();
        for (name, value) in letter.original_headers() {
            headers.insert(name, value);
        }
        let publish = Publish::build()
            // The header map first: `headers` replaces the map, and would drop the id.
            .headers(headers)
            .message_id(letter.replay_message_id())
            .payload(letter.body.clone());
        let doing = format!("replaying dead letter {} to {subject}", letter.seq);
        let ack = self
            .js
            .send_publish(subject.to_owned(), publish)
            .await
            .map_err(nats_error(doing.clone()))?
            .await
            .map_err(nats_error(doing))?;
        // Gone already (another operator's delete or replay): the replay stands, and the
        // consumer's dedup applies to it as to any copy.
        self.delete(letter.seq).await?;
        Ok(PublishReceipt {
            sequence: ack.sequence,
            duplicate: ack.duplicate,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn origin() -> Origin<'static> {
        Origin {
            subject: "orders.placed",
            stream: "ORDERS",
            stream_sequence: 42,
            deliveries: 3,
        }
    }

    fn read_back(headers: &HeaderMap) -> DeadLetter {
        DeadLetter::read(
            7,
            "dlq.inventory-reserve-stock",
            header_map(Some(headers)),
            Bytes::from_static(b"{\"body\":1}"),
            1_000,
            1_060,
        )
    }

    #[test]
    fn a_dead_letter_reads_back_as_written() {
        let mut original = HeaderMap::new();
        original.insert(async_nats::header::NATS_MESSAGE_ID, "order-1");
        original.insert("Trace-Id", "t-9");
        let written = write_headers(
            &origin(),
            Some(&original),
            DeadLetterReason::UnknownBook,
            "no stock item for book b",
        );
        let letter = read_back(&written);
        assert_eq!(letter.seq, 7);
        assert_eq!(letter.reason, "unknown-book");
        assert_eq!(letter.detail, "no stock item for book b");
        assert_eq!(letter.consumer, "inventory-reserve-stock");
        assert_eq!(letter.original_subject.as_deref(), Some("orders.placed"));
        assert_eq!(letter.original_stream.as_deref(), Some("ORDERS"));
        assert_eq!(letter.original_sequence, Some(42));
        assert_eq!(letter.original_message_id.as_deref(), Some("order-1"));
        assert_eq!(letter.deliveries, Some(3));
        assert_eq!((letter.stored_at, letter.age_seconds), (1_000, 60));
        assert_eq!(letter.body, Bytes::from_static(b"{\"body\":1}"));
        // The wire names, as the contract spells them; the original id moved out of Nats-Msg-Id.
        let names: Vec<&str> = letter.headers.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "Dlq-Deliveries",
                "Dlq-Detail",
                "Dlq-Original-Msg-Id",
                "Dlq-Reason",
                "Dlq-Stream",
                "Dlq-Stream-Sequence",
                "Dlq-Subject",
                "Trace-Id",
            ]
        );
        assert_eq!(
            letter.original_headers().collect::<Vec<_>>(),
            [("Trace-Id", "t-9")]
        );
        assert_eq!(letter.replay_message_id(), "order-1:replay:7");
    }

    #[test]
    fn an_original_without_headers_has_no_original_id() {
        let written = write_headers(&origin(), None, DeadLetterReason::Malformed, "not JSON");
        let letter = read_back(&written);
        assert_eq!(letter.reason, "malformed");
        assert_eq!(letter.original_message_id, None);
        assert_eq!(letter.original_headers().count(), 0);
        assert_eq!(letter.replay_message_id(), "replay:7");
    }

    #[test]
    fn a_detail_is_one_line_of_at_most_a_thousand_characters() {
        let detail = format!("line one\nline two\t{}", "x".repeat(2_000));
        let written = write_headers(&origin(), None, DeadLetterReason::Invalid, &detail);
        let letter = read_back(&written);
        assert!(
            letter.detail.starts_with("line one line two x"),
            "{}",
            letter.detail
        );
        assert_eq!(letter.detail.chars().count(), 1_000);
    }

    #[test]
    fn the_dead_letter_id_names_the_consumer_and_the_original_place() {
        assert_eq!(
            dead_letter_id("inventory-reserve-stock", &origin()),
            "dlq:inventory-reserve-stock:ORDERS:42"
        );
    }

    #[test]
    fn the_json_of_a_dead_letter_holds_its_headers_and_body_as_text() {
        let mut original = HeaderMap::new();
        original.insert("Trace-Id", "t-9");
        let written = write_headers(&origin(), Some(&original), DeadLetterReason::Malformed, "x");
        let mut letter = read_back(&written);
        let json = serde_json::to_value(&letter).expect("a dead letter serializes");
        assert_eq!(json["body"], "{\"body\":1}");
        assert_eq!(json["headers"]["Trace-Id"], "t-9");
        assert_eq!(json["headers"]["Dlq-Reason"], "malformed");
        letter.body = Bytes::from_static(b"{\xff");
        let json = serde_json::to_value(&letter).expect("a dead letter serializes");
        assert_eq!(json["body"], "{\u{fffd}");
    }

    #[test]
    fn a_stored_age_is_never_negative() {
        let letter = DeadLetter::read(1, "dlq.c", BTreeMap::new(), Bytes::new(), 2_000, 1_000);
        assert_eq!(letter.age_seconds, 0);
        assert_eq!(letter.reason, "");
    }
}
