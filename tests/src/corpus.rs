//! The hostile-input corpus: `tests/corpus/manifest.tsv` lists each message with the subject it
//! is published to and the dead-letter reason it must get under each strategy. Bodies live in
//! `tests/corpus/messages/`; the few that are big or deep (a multi-megabyte body, nesting past
//! the parser's limit) are built here instead, named `gen:<name>` in the manifest.

use std::path::PathBuf;

/// The book the corpus's orders name; the test stocks it before the corpus runs.
pub const KNOWN_BOOK: &str = "0190f5c4-3c2e-7b4a-9d3e-aaaaaaaaaaaa";
/// The baseline order, processed before the corpus so "same id, other content" has a first.
pub const BASE_ORDER: &str = "0190f5c4-3c2e-7b4a-9d3e-000000000001";
pub const BASE_MESSAGE_ID: &str = "corpus-base";
pub const BASE_QUANTITY: i64 = 2;

#[derive(Debug, Clone)]
pub struct Entry {
    /// The file name, or `gen:<name>`.
    pub name: String,
    /// The subject below the prefix: `placed`, `placed.<book_id>`, `cancelled`, or one no event
    /// uses.
    pub subject_token: String,
    pub body: Vec<u8>,
    /// The expected `Dlq-Reason` under the natural key and under the inbox.
    pub natural_reason: String,
    pub inbox_reason: String,
    pub what: String,
}

pub fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("corpus")
}

/// The baseline message's body.
pub fn baseline() -> Vec<u8> {
    format!(
        r#"{{"message_id":"{BASE_MESSAGE_ID}","order_id":"{BASE_ORDER}","book_id":"{KNOWN_BOOK}","quantity":{BASE_QUANTITY}}}"#
    )
    .into_bytes()
}

/// Every entry of the manifest with its body.
pub fn load() -> Vec<Entry> {
    let manifest = std::fs::read_to_string(dir().join("manifest.tsv")).expect("the manifest");
    manifest
        .lines()
        .filter(|line| !line.trim().is_empty() && !line.starts_with('#'))
        .map(|line| {
            let fields: Vec<&str> = line.split('\t').collect();
            let [name, subject, natural, inbox, what] = fields[..] else {
                panic!("a manifest line needs 5 tab-separated fields: {line:?}");
            };
            let body = match name.strip_prefix("gen:") {
                Some(generated) => generate(generated),
                None => std::fs::read(dir().join("messages").join(name))
                    .unwrap_or_else(|e| panic!("corpus file {name}: {e}")),
            };
            Entry {
                name: name.to_owned(),
                subject_token: subject.to_owned(),
                body,
                natural_reason: natural.to_owned(),
                inbox_reason: inbox.to_owned(),
                what: what.to_owned(),
            }
        })
        .collect()
}

/// A valid order for the known book with a `padding` field making the body `len` bytes long.
fn padded_order(message_id: &str, order: &str, len: usize) -> Vec<u8> {
    let head = format!(
        r#"{{"message_id":"{message_id}","order_id":"{order}","book_id":"{KNOWN_BOOK}","quantity":1,"padding":""#
    );
    let tail = r#""}"#;
    let mut body = head.into_bytes();
    body.resize(len - tail.len(), b'x');
    body.extend_from_slice(tail.as_bytes());
    body
}

/// `depth` levels of `open` … `close` as the whole body: no order in it, only depth.
fn nested(open: &str, close: &str, depth: usize, inner: &str) -> Vec<u8> {
    format!("{}{inner}{}", open.repeat(depth), close.repeat(depth)).into_bytes()
}

fn generate(name: &str) -> Vec<u8> {
    match name {
        "multi-megabyte" => padded_order(
            "corpus-big",
            "0190f5c4-3c2e-7b4a-9d3e-000000000901",
            2 * 1024 * 1024,
        ),
        "just-over-limit" => padded_order(
            "corpus-over",
            "0190f5c4-3c2e-7b4a-9d3e-000000000902",
            64 * 1024 + 1,
        ),
        "deep-arrays" => nested("[", "]", 30_000, ""),
        "deep-objects" => nested(r#"{"a":"#, "}", 10_000, "1"),
        other => panic!("no generator for gen:{other}"),
    }
}
