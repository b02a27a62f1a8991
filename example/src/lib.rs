//! The natural key, whole: a NATS JetStream consumer that reserves stock for an order once,
//! however often the order arrives. The record that makes a copy harmless is the reservation
//! itself, keyed by the business key (order_id, book_id) and written in the same statement as
//! the stock it moves. Read top to bottom: tables, statement, pull, decide, ack, print.

use std::time::Duration;

use async_nats::jetstream::{self, AckKind, consumer::AckPolicy, consumer::pull, stream};
use futures::StreamExt as _;
use serde::Deserialize;
use uuid::Uuid;

/// Where to connect and what to consume. A test sets names of its own.
pub struct Config {
    pub database_url: String,
    pub nats_url: String,
    pub stream: String,
    pub subject: String,
    pub consumer: String,
    /// How long a message that failed on the database waits before it comes again.
    pub nak_delay: Duration,
}

impl Config {
    /// `DATABASE_URL`, `NATS_URL`, `EXAMPLE_STREAM`, `EXAMPLE_SUBJECT`, `EXAMPLE_CONSUMER`.
    pub fn from_env() -> Self {
        let var = |name: &str, default: &str| std::env::var(name).unwrap_or(default.into());
        Self {
            database_url: var(
                "DATABASE_URL",
                "postgres://postgres@127.0.0.1:5432/postgres",
            ),
            nats_url: var("NATS_URL", "nats://127.0.0.1:4222"),
            stream: var("EXAMPLE_STREAM", "EXAMPLE_ORDERS"),
            subject: var("EXAMPLE_SUBJECT", "example.orders.placed"),
            consumer: var("EXAMPLE_CONSUMER", "example-reserve-stock"),
            nak_delay: Duration::from_secs(1),
        }
    }
}

// 1. The tables. The reservation's primary key is the business key: one order cannot hold two
// reservations of one book, whatever message id each came under. In a schema of its own so
// that the example never meets the service's tables of the same names; yours needs no schema.
const TABLES: &str = "
CREATE SCHEMA IF NOT EXISTS natural_key_example;
SET search_path TO natural_key_example;
CREATE TABLE IF NOT EXISTS stock_items (
    book_id uuid PRIMARY KEY, on_hand int NOT NULL, reserved int NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS stock_reservations (
    order_id uuid NOT NULL, book_id uuid NOT NULL REFERENCES stock_items, quantity int NOT NULL,
    message_id text NOT NULL, PRIMARY KEY (order_id, book_id));";

// 2. The statement. One statement is one transaction: the reservation goes in unless its key
// is taken, and stock moves only if that insert won, so record and effect commit together or
// not at all. A copy running at once waits on the key until the first commits, then inserts
// nothing.
// Production adds an availability check, a lock order and an outbox row: docs/statement.md.
const RESERVE: &str = "
WITH inserted AS (
    INSERT INTO stock_reservations (order_id, book_id, quantity, message_id)
    VALUES ($1, $2, $3, $4)
    ON CONFLICT (order_id, book_id) DO NOTHING
    RETURNING order_id
), moved AS (
    UPDATE stock_items SET reserved = reserved + $3
    WHERE book_id = $2 AND EXISTS (SELECT 1 FROM inserted)
)
SELECT EXISTS (SELECT 1 FROM inserted) AS won";

// The key was taken: what it holds. A new statement, so it sees a copy that committed while
// RESERVE waited for it, which RESERVE's own snapshot could not.
const RESERVED: &str =
    "SELECT quantity FROM stock_reservations WHERE order_id = $1 AND book_id = $2";

/// The body of an order-placed message.
#[derive(Deserialize)]
pub struct OrderPlaced {
    pub message_id: String,
    pub order_id: Uuid,
    pub book_id: Uuid,
    pub quantity: i32,
}

/// Connects to PostgreSQL and creates the tables if absent.
pub async fn connect(database_url: &str) -> anyhow::Result<tokio_postgres::Client> {
    let (client, connection) = tokio_postgres::connect(database_url, tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            eprintln!("database connection: {error}");
        }
    });
    client.batch_execute(TABLES).await?;
    Ok(client)
}

/// Connects to NATS and creates the stream if absent.
pub async fn jetstream(config: &Config) -> anyhow::Result<(jetstream::Context, stream::Stream)> {
    let jetstream = jetstream::new(async_nats::connect(&config.nats_url).await?);
    let stream = jetstream
        .get_or_create_stream(stream::Config {
            name: config.stream.clone(),
            subjects: vec![config.subject.clone()],
            ..Default::default()
        })
        .await?;
    Ok((jetstream, stream))
}

/// Consumes until `stop` completes (ctrl-c in `main`, a signal of the test's in a test).
pub async fn run(config: &Config, stop: impl Future) -> anyhow::Result<()> {
    let client = connect(&config.database_url).await?;
    // 3. Pull. The durable consumer keeps its place across restarts; with explicit ack a
    // message not acked within the ack wait comes again. At-least-once: copies will come.
    let (_, stream) = jetstream(config).await?;
    let consumer = stream
        .get_or_create_consumer(
            &config.consumer,
            pull::Config {
                durable_name: Some(config.consumer.clone()),
                ack_policy: AckPolicy::Explicit,
                ..Default::default()
            },
        )
        .await?;
    let mut messages = consumer.messages().await?;
    let mut stop = std::pin::pin!(stop);
    loop {
        // A stream error ends the run: restart it, and the durable consumer resumes.
        let message = tokio::select! {
            _ = &mut stop => return Ok(()),
            Some(message) = messages.next() => message?,
        };
        // A body that does not parse never will: term stops its deliveries. A real service
        // first dead-letters it (publishes it to a dead-letter stream) so no order is lost
        // unseen.
        let Ok(order) = serde_json::from_slice::<OrderPlaced>(&message.payload) else {
            println!("unreadable body: terminated");
            reply(&message, AckKind::Term).await;
            continue;
        };
        // 5. Ack only now, after the commit: acked first, a failed commit loses the order. A
        // duplicate is acked too: its work was done before. 6. One line per message.
        let (order_id, message_id) = (order.order_id, &order.message_id);
        match decide(&client, &order).await {
            Ok(Decision::Processed) => {
                reply(&message, AckKind::Ack).await;
                println!("processed: order {order_id} message {message_id}");
            }
            Ok(Decision::Duplicate) => {
                reply(&message, AckKind::Ack).await;
                println!("duplicate: order {order_id} message {message_id}");
            }
            // Two messages disagree about one order, and no retry settles that: term. A real
            // service first dead-letters it, so a person decides.
            Ok(Decision::Conflict { held }) => {
                reply(&message, AckKind::Term).await;
                println!(
                    "conflict: order {order_id} holds {held}, message {message_id} asks {}",
                    order.quantity
                );
            }
            // A constraint refused it (SQLSTATE class 23: here a book with no stock row), which
            // no retry changes either: term, after a dead letter in a real service.
            Err(error)
                if error
                    .code()
                    .is_some_and(|code| code.code().starts_with("23")) =>
            {
                reply(&message, AckKind::Term).await;
                println!("refused: {error}");
            }
            // Nothing was applied: nak, so the message comes again after the delay.
            Err(error) => {
                println!("database error, nak: {:#}", anyhow::Error::from(error));
                reply(&message, AckKind::Nak(Some(config.nak_delay))).await;
                anyhow::ensure!(!client.is_closed(), "the database connection is closed");
            }
        }
    }
}

/// What a message came to.
enum Decision {
    Processed,
    Duplicate,
    Conflict { held: i32 },
}

// 4. Decide. The insert won: processed. It did not: a duplicate, whether a redelivery, a copy,
// or the producer's resend under a new message id, which an inbox keyed by message id could
// not see (the key is the business key); unless the reservation asks another quantity.
async fn decide(
    client: &tokio_postgres::Client,
    order: &OrderPlaced,
) -> Result<Decision, tokio_postgres::Error> {
    let (id, book, quantity) = (&order.order_id, &order.book_id, &order.quantity);
    let row = client
        .query_one(RESERVE, &[id, book, quantity, &order.message_id])
        .await?;
    if row.try_get("won")? {
        return Ok(Decision::Processed);
    }
    let held: i32 = client.query_one(RESERVED, &[id, book]).await?.try_get(0)?;
    Ok(if held == order.quantity {
        Decision::Duplicate
    } else {
        Decision::Conflict { held }
    })
}

/// A lost reply is harmless: the message comes again after the ack wait (a duplicate, if its
/// statement had committed).
async fn reply(message: &jetstream::Message, kind: AckKind) {
    if let Err(error) = message.ack_with(kind).await {
        println!("reply lost: {error}");
    }
}

/// Adds a book and publishes one order three times: the order, a copy of it under the same
/// message id (as a redelivery brings it) and the producer's resend under a new message id.
pub async fn publish(config: &Config) -> anyhow::Result<()> {
    let client = connect(&config.database_url).await?;
    let (jetstream, _) = jetstream(config).await?;
    let (order_id, book_id, first) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    let sql = "INSERT INTO stock_items (book_id, on_hand) VALUES ($1, 10)";
    client.execute(sql, &[&book_id]).await?;
    for message_id in [first, first, Uuid::new_v4()] {
        let body = serde_json::json!({"message_id": message_id.to_string(),
            "order_id": order_id, "book_id": book_id, "quantity": 2});
        // No Nats-Msg-Id header, so the stream keeps the copy; the second await is its ack.
        let stored = jetstream.publish(config.subject.clone(), body.to_string().into());
        stored.await?.await?;
    }
    println!("published order {order_id} of book {book_id} three times");
    Ok(())
}
