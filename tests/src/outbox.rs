//! The outbox as the relay tests see it: the rows in the table, the events in the stream, and
//! the check that each event reached the stream once and in its order's order.

use inventory_benches::produce::Produce as _;
use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream::context::Context;
use chrono::Utc;
use inventory_domain::outbox::partition;
use inventory_domain::{BookId, Message, OrderId};
use inventory_infra::MessageHandler;
use inventory_infra::outbox::RelaySettings;
use sea_orm::{ConnectionTrait, DatabaseConnection, Statement};
use uuid::Uuid;

/// One outbox row, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub seq: i64,
    pub event_id: Uuid,
    pub order_id: Uuid,
    pub subject: String,
    pub parked_reason: Option<String>,
}

/// Every row of `table`, parked ones included, in seq order.
pub async fn rows(conn: &DatabaseConnection, table: &str) -> Vec<Row> {
    let sql =
        format!("SELECT seq, event_id, order_id, subject, parked_reason FROM {table} ORDER BY seq");
    conn.query_all_raw(Statement::from_sql_and_values(
        conn.get_database_backend(),
        &sql,
        [],
    ))
    .await
    .unwrap()
    .iter()
    .map(|row| Row {
        seq: row.try_get("", "seq").unwrap(),
        event_id: row.try_get("", "event_id").unwrap(),
        order_id: row.try_get("", "order_id").unwrap(),
        subject: row.try_get("", "subject").unwrap(),
        parked_reason: row.try_get("", "parked_reason").unwrap(),
    })
    .collect()
}

/// Writes a row as a handler would, with any subject and payload: for rows no handler
/// writes (too large, a subject no stream holds) and for other outbox tables. Returns it.
pub async fn insert(
    conn: &impl ConnectionTrait,
    table: &str,
    order_id: Uuid,
    subject: &str,
    payload: String,
) -> Row {
    let event_id = Uuid::now_v7();
    let sql = format!(
        "INSERT INTO {table} (event_id, relay_partition, order_id, subject, payload, created_at) \
         VALUES ($1, $2, $3, $4, $5, $6) RETURNING seq"
    );
    let row = conn
        .query_one_raw(Statement::from_sql_and_values(
            conn.get_database_backend(),
            &sql,
            [
                event_id.into(),
                partition(OrderId::from(order_id)).into(),
                order_id.into(),
                subject.into(),
                payload.into(),
                Utc::now().into(),
            ],
        ))
        .await
        .unwrap()
        .unwrap();
    Row {
        seq: row.try_get("", "seq").unwrap(),
        event_id,
        order_id,
        subject: subject.to_owned(),
        parked_reason: None,
    }
}

/// A message in a stream: its subject, `Nats-Msg-Id`, headers and body.
#[derive(Debug, Clone)]
pub struct Stored {
    pub stream_sequence: u64,
    pub subject: String,
    pub message_id: String,
    pub headers: std::collections::BTreeMap<String, String>,
    pub body: bytes::Bytes,
}

/// Every message in `stream`, in stream order; none when the stream does not exist.
pub async fn stored(js: &Context, stream: &str) -> Vec<Stored> {
    let Ok(mut stream) = js.get_stream(stream).await else {
        return Vec::new();
    };
    let state = stream.info().await.unwrap().state.clone();
    let mut messages = Vec::new();
    if state.messages == 0 {
        return messages;
    }
    for sequence in state.first_sequence..=state.last_sequence {
        let message = stream.get_raw_message(sequence).await.unwrap();
        let headers = inventory_infra::jetstream::header_map(Some(&message.headers));
        messages.push(Stored {
            stream_sequence: sequence,
            subject: message.subject.to_string(),
            message_id: headers.get("Nats-Msg-Id").cloned().unwrap_or_default(),
            headers,
            body: message.payload,
        });
    }
    messages
}

/// Asserts that the stream holds each of `expected` (rows read before the relay ran, in seq
/// order) exactly once, under `<prefix>.<subject>`, and nothing else, and that each order's
/// events are in the stream in the order of their seqs.
pub fn assert_published_once_in_order(expected: &[Row], stored: &[Stored], prefix: &str) {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for message in stored {
        *seen.entry(message.message_id.as_str()).or_default() += 1;
    }
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "stored more than once: {twice:?}");
    assert_eq!(
        stored.len(),
        expected.len(),
        "the stream holds {} messages for {} events",
        stored.len(),
        expected.len()
    );
    let position: HashMap<String, usize> = stored
        .iter()
        .enumerate()
        .map(|(at, message)| (message.message_id.clone(), at))
        .collect();
    let mut last_of_order: HashMap<Uuid, (usize, i64)> = HashMap::new();
    for row in expected {
        let at = *position
            .get(&row.event_id.to_string())
            .unwrap_or_else(|| panic!("event of seq {} is not in the stream", row.seq));
        assert_eq!(stored[at].subject, format!("{prefix}.{}", row.subject));
        if let Some((before, before_seq)) = last_of_order.insert(row.order_id, (at, row.seq)) {
            assert!(
                before < at,
                "order {}: seq {before_seq} is at stream position {before}, after seq {} at {at}",
                row.order_id,
                row.seq
            );
        }
    }
}

/// Each message in `stored` once by its `Nats-Msg-Id`, and its subjects below `prefix.` per
/// order (read from the body's `order_id`), in stream order.
pub fn subjects_by_order(stored: &[Stored], prefix: &str) -> HashMap<Uuid, Vec<String>> {
    let mut ids: Vec<&str> = stored.iter().map(|m| m.message_id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(
        ids.len(),
        stored.len(),
        "a message stored twice in {prefix}"
    );
    let mut by_order: HashMap<Uuid, Vec<String>> = HashMap::new();
    for message in stored {
        assert!(
            !message.message_id.is_empty(),
            "no Nats-Msg-Id: {message:?}"
        );
        let body: serde_json::Value = serde_json::from_slice(&message.body).unwrap();
        let order: Uuid = body["order_id"].as_str().unwrap().parse().unwrap();
        let subject = message
            .subject
            .strip_prefix(&format!("{prefix}."))
            .unwrap_or_else(|| panic!("{} is not below {prefix}", message.subject));
        by_order.entry(order).or_default().push(subject.to_owned());
    }
    by_order
}

/// One order's decisions, as [`decide`] made them: the subjects (below the prefix) of its
/// events in commit order.
#[derive(Debug, Clone)]
pub struct Decided {
    pub order: OrderId,
    pub subjects: Vec<&'static str>,
}

/// Decisions of `orders` new orders through `handler`: each reserves a copy of `plenty`;
/// every third also asks for 5 copies of `scarce` (which must have fewer: rejected); every
/// fourth is then cancelled, releasing its copy. So an order has one to three events.
pub async fn decide(
    handler: &impl MessageHandler,
    plenty: BookId,
    scarce: BookId,
    orders: usize,
) -> Vec<Decided> {
    let mut decided = Vec::with_capacity(orders);
    for i in 0..orders {
        let order = OrderId::new_v7();
        let mut subjects = vec!["stock.reserved"];
        handler
            .handle(&crate::placed_for(order, plenty, 1))
            .await
            .unwrap();
        if i % 3 == 0 {
            handler
                .handle(&crate::placed_for(order, scarce, 5))
                .await
                .unwrap();
            subjects.push("stock.rejected");
        }
        if i % 4 == 0 {
            handler.handle(&Message::cancelled(order)).await.unwrap();
            subjects.push("stock.released");
        }
        decided.push(Decided { order, subjects });
    }
    decided
}

/// Asserts that the stream holds exactly the events of `decided`, each once, each order's
/// in the order they were decided, under `<prefix>.`.
pub fn assert_each_order_in_order(stored: &[Stored], decided: &[Decided], prefix: &str) {
    let mut ids: Vec<&str> = stored.iter().map(|m| m.message_id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), stored.len(), "an event stored twice");
    let mut by_order: HashMap<Uuid, Vec<String>> = HashMap::new();
    for message in stored {
        let body: serde_json::Value = serde_json::from_slice(&message.body).unwrap();
        assert_eq!(body["event_id"], message.message_id.as_str());
        let order: Uuid = body["order_id"].as_str().unwrap().parse().unwrap();
        by_order
            .entry(order)
            .or_default()
            .push(message.subject.clone());
    }
    assert_eq!(by_order.len(), decided.len(), "orders on the stream");
    for decision in decided {
        let expected: Vec<String> = decision
            .subjects
            .iter()
            .map(|subject| format!("{prefix}.{subject}"))
            .collect();
        assert_eq!(
            by_order.get(&decision.order.as_uuid()),
            Some(&expected),
            "order {}",
            decision.order
        );
    }
}

/// Relay settings for tests: short lease and poll, fast retries.
pub fn fast_settings() -> RelaySettings {
    RelaySettings {
        lease: Duration::from_secs(2),
        poll_interval: Duration::from_millis(50),
        publish_timeout: Duration::from_secs(1),
        retry_delay: Duration::from_millis(50),
        max_retry_delay: Duration::from_millis(500),
        backlog_interval: Duration::from_millis(400),
        ..RelaySettings::default()
    }
}
