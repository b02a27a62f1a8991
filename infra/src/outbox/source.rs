//! An outbox as the relay sees it: a table of the outbox's columns (`seq`, `event_id`,
//! `relay_partition`, `order_id`, `subject`, `payload`, `created_at`, `parked_at`,
//! `parked_reason`), the stream its rows go to and the prefix their subjects go under. The
//! relay, the parked-row commands and the backlog metrics are written against this, never
//! against one table, so Inventory's `outbox` and the orders producer's `orders_outbox` share
//! them.
//!
//! Every statement here stands alone (no transaction is opened), so none is ever held open
//! while the relay talks to the broker.

use chrono::{DateTime, Utc};
use sea_orm::{ConnectionTrait, DbBackend, DbErr, FromQueryResult, Statement, Value as DbValue};
use uuid::Uuid;

use super::OutboxTable;
use crate::jetstream::Topology;

/// Where an outbox's rows come from and where they go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxSource {
    table: String,
    stream: String,
    subject_prefix: String,
}

#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not a table name this relay reads (lowercase letters, digits and _)")]
pub struct InvalidTable(String);

impl OutboxSource {
    /// Rows of `table` go to `stream` under `<subject_prefix>.<row's subject>`. The table name
    /// is written into SQL, so only plain lowercase identifiers are taken.
    pub fn new(table: &str, stream: &str, subject_prefix: &str) -> Result<Self, InvalidTable> {
        let plain = !table.is_empty()
            && table.len() <= 63
            && table.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
            && table
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !plain {
            return Err(InvalidTable(table.to_owned()));
        }
        Ok(Self {
            table: table.to_owned(),
            stream: stream.to_owned(),
            subject_prefix: subject_prefix.to_owned(),
        })
    }

    /// Inventory's events: `outbox` to the events stream (`INVENTORY`, `inventory.>`).
    pub fn inventory(topology: &Topology) -> Self {
        Self {
            table: OutboxTable::Inventory.name().to_owned(),
            stream: topology.events_stream.clone(),
            subject_prefix: topology.events_subject_prefix.clone(),
        }
    }

    /// The orders producer's events: `orders_outbox` to the orders stream (`ORDERS`,
    /// `orders.>`).
    pub fn orders(topology: &Topology) -> Self {
        Self {
            table: OutboxTable::Orders.name().to_owned(),
            stream: topology.stream.clone(),
            subject_prefix: topology.subject_prefix.clone(),
        }
    }

    pub fn table(&self) -> &str {
        &self.table
    }

    pub fn stream(&self) -> &str {
        &self.stream
    }

    pub fn subject_prefix(&self) -> &str {
        &self.subject_prefix
    }

    /// The subject a row with `subject` (below the prefix, `stock.reserved`) is published on.
    pub fn subject(&self, below_prefix: &str) -> String {
        format!("{}.{below_prefix}", self.subject_prefix)
    }

    /// Fails unless the table is there: a relay started before its outbox was created says so
    /// at once rather than failing every pass.
    pub(crate) async fn check_table(&self, db: &impl ConnectionTrait) -> Result<(), DbErr> {
        let sql = format!("SELECT seq FROM {} WHERE 1 = 0", self.table);
        db.query_all_raw(statement(db, &sql, [])).await.map(drop)
    }

    /// Up to `limit` rows of `partitions` waiting to be published, in seq order: every row
    /// still there, never "after the last one seen", so a row whose transaction committed
    /// after a higher seq's is read on the next pass rather than skipped. Parked rows are
    /// left out, and so is every later row of an order that has one parked: the later rows
    /// wait behind it, so the order's events stay in order. Both in one statement, so one
    /// snapshot: an operator's retry between two reads cannot let a later row overtake.
    pub(crate) async fn read_pending(
        &self,
        db: &impl ConnectionTrait,
        partitions: &[i16],
        limit: usize,
    ) -> Result<Vec<PendingRow>, DbErr> {
        if partitions.is_empty() {
            return Ok(Vec::new());
        }
        let sql = format!(
            "SELECT o.seq, o.event_id, o.relay_partition, o.order_id, o.subject, o.payload, \
                    o.created_at \
             FROM {table} o \
             WHERE o.relay_partition IN ({partitions}) AND o.parked_at IS NULL \
               AND NOT EXISTS (SELECT 1 FROM {table} p \
                               WHERE p.order_id = o.order_id AND p.parked_at IS NOT NULL \
                                 AND p.seq < o.seq) \
             ORDER BY o.seq LIMIT $1",
            table = self.table,
            partitions = int_list(partitions.iter().map(|p| i64::from(*p))),
        );
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        PendingRow::find_by_statement(statement(db, &sql, [limit.into()]))
            .all(db)
            .await
    }

    /// Removes published rows, `chunk` seqs per statement: each a short statement of its own
    /// that touches only rows the handlers never write again, so it never waits for them nor
    /// they for it.
    pub(crate) async fn delete(
        &self,
        db: &impl ConnectionTrait,
        seqs: &[i64],
        chunk: usize,
    ) -> Result<u64, DbErr> {
        let mut deleted = 0;
        for part in seqs.chunks(chunk.max(1)) {
            let sql = format!(
                "DELETE FROM {} WHERE seq IN ({})",
                self.table,
                int_list(part.iter().copied())
            );
            deleted += db
                .execute_raw(statement(db, &sql, []))
                .await?
                .rows_affected();
        }
        Ok(deleted)
    }

    /// Sets a row aside with its reason: the relay stops trying it, and its order's later
    /// rows wait behind it until an operator retries it.
    pub(crate) async fn park(
        &self,
        db: &impl ConnectionTrait,
        seq: i64,
        reason: &str,
    ) -> Result<(), DbErr> {
        let sql = format!(
            "UPDATE {} SET parked_at = $1, parked_reason = $2 \
             WHERE seq = $3 AND parked_at IS NULL",
            self.table
        );
        db.execute_raw(statement(
            db,
            &sql,
            [Utc::now().into(), reason.into(), seq.into()],
        ))
        .await
        .map(drop)
    }

    /// The parked rows, oldest first.
    pub async fn parked(&self, db: &impl ConnectionTrait) -> Result<Vec<ParkedRow>, DbErr> {
        let sql = format!(
            "SELECT seq, event_id, order_id, subject, CAST(length(payload) AS BIGINT) AS payload_chars, \
                    created_at, parked_at, parked_reason \
             FROM {} WHERE parked_at IS NOT NULL ORDER BY seq",
            self.table
        );
        ParkedRow::find_by_statement(statement(db, &sql, []))
            .all(db)
            .await
    }

    /// Puts parked rows back in line (all of them, or those with these seqs); the relay
    /// tries them on its next pass, before their orders' later rows. Returns the seqs
    /// released.
    pub async fn retry(&self, db: &impl ConnectionTrait, which: &Retry) -> Result<Vec<i64>, DbErr> {
        let filter = match which {
            Retry::All => String::new(),
            Retry::Seqs(seqs) if seqs.is_empty() => return Ok(Vec::new()),
            Retry::Seqs(seqs) => format!(" AND seq IN ({})", int_list(seqs.iter().copied())),
        };
        let sql = format!(
            "UPDATE {} SET parked_at = NULL, parked_reason = NULL \
             WHERE parked_at IS NOT NULL{filter} RETURNING seq",
            self.table
        );
        let rows = db.query_all_raw(statement(db, &sql, [])).await?;
        let mut seqs = rows
            .iter()
            .map(|row| row.try_get::<i64>("", "seq"))
            .collect::<Result<Vec<_>, _>>()?;
        seqs.sort_unstable();
        Ok(seqs)
    }

    /// Figures for the metrics, each read through an index, so their cost does not grow with
    /// the outbox (it grows most when a broker outage holds the relays back): the oldest row
    /// waiting (through the primary key, past the few parked ones), the newest row, and the
    /// parked rows (through their partial index, counted up to [`PARKED_COUNTED`]). The rows
    /// waiting are estimated by the span of seqs from the oldest waiting to the newest: exact
    /// while the relays publish in write order, more while a partition lags behind.
    pub(crate) async fn backlog(&self, db: &impl ConnectionTrait) -> Result<Backlog, DbErr> {
        let [oldest, newest, parked] = self.backlog_statements();
        let oldest = db.query_one_raw(statement(db, &oldest, [])).await?;
        let newest = db.query_one_raw(statement(db, &newest, [])).await?;
        let parked = db
            .query_one_raw(statement(db, &parked, []))
            .await?
            .map(|row| row.try_get::<i64>("", "parked"))
            .transpose()?
            .unwrap_or(0);
        let (pending, oldest_pending) = match (oldest, newest) {
            (Some(oldest), Some(newest)) => {
                let first = oldest.try_get::<i64>("", "seq")?;
                let last = newest.try_get::<i64>("", "seq")?;
                (
                    u64::try_from(last - first + 1).unwrap_or(0),
                    Some(oldest.try_get::<DateTime<Utc>>("", "created_at")?),
                )
            }
            _ => (0, None),
        };
        Ok(Backlog {
            pending,
            parked: u64::try_from(parked).unwrap_or(0),
            oldest_pending,
        })
    }

    /// The statements behind the backlog's figures: the oldest row waiting, the newest row, the
    /// parked rows counted; public so that a test can look at their plans.
    pub fn backlog_statements(&self) -> [String; 3] {
        let table = &self.table;
        [
            format!(
                "SELECT seq, created_at FROM {table} WHERE parked_at IS NULL ORDER BY seq LIMIT 1"
            ),
            format!("SELECT seq FROM {table} ORDER BY seq DESC LIMIT 1"),
            format!(
                "SELECT COUNT(*) AS parked FROM (SELECT 1 FROM {table} \
                 WHERE parked_at IS NOT NULL LIMIT {PARKED_COUNTED}) AS parked_rows"
            ),
        ]
    }
}

/// Parked rows counted for the metrics, at most: a few are expected, and each waits for an
/// operator.
const PARKED_COUNTED: i64 = 1_000;

/// Which parked rows `retry` puts back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Retry {
    All,
    Seqs(Vec<i64>),
}

/// A row waiting to be published.
#[derive(Debug, Clone, PartialEq, Eq, FromQueryResult)]
pub(crate) struct PendingRow {
    pub(crate) seq: i64,
    pub(crate) event_id: Uuid,
    pub(crate) relay_partition: i16,
    pub(crate) order_id: Uuid,
    pub(crate) subject: String,
    pub(crate) payload: String,
    pub(crate) created_at: DateTime<Utc>,
}

/// A row the relay set aside, for `inventory outbox parked`.
#[derive(Debug, Clone, PartialEq, Eq, FromQueryResult, serde::Serialize)]
pub struct ParkedRow {
    pub seq: i64,
    pub event_id: Uuid,
    pub order_id: Uuid,
    /// Below the stream's prefix, as stored.
    pub subject: String,
    /// The payload's length in characters (bytes for the JSON the handlers write).
    pub payload_chars: i64,
    pub created_at: DateTime<Utc>,
    pub parked_at: DateTime<Utc>,
    pub parked_reason: Option<String>,
}

/// How far behind the relays are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backlog {
    /// Rows waiting, estimated: the span of seqs from the oldest waiting row to the newest.
    pub pending: u64,
    pub parked: u64,
    pub oldest_pending: Option<DateTime<Utc>>,
}

/// `1, 2, 3`: integers written into SQL (never text, so nothing to escape).
fn int_list(values: impl Iterator<Item = i64>) -> String {
    values.map(|v| v.to_string()).collect::<Vec<_>>().join(", ")
}

/// `$n` placeholders work on both backends (sqlx numbers them on SQLite too).
pub(crate) fn statement<const N: usize>(
    db: &impl ConnectionTrait,
    sql: &str,
    values: [DbValue; N],
) -> Statement {
    Statement::from_sql_and_values(backend(db), sql, values)
}

pub(crate) fn backend(db: &impl ConnectionTrait) -> DbBackend {
    db.get_database_backend()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_table_names_are_taken() {
        for good in ["outbox", "orders_outbox", "_x1"] {
            assert!(OutboxSource::new(good, "S", "p").is_ok(), "{good}");
        }
        for bad in [
            "",
            "Outbox",
            "1outbox",
            "out box",
            "outbox;drop",
            "a.b",
            "\"x\"",
        ] {
            assert!(OutboxSource::new(bad, "S", "p").is_err(), "{bad}");
        }
    }

    #[test]
    fn subjects_go_below_the_prefix() {
        let topology = Topology::default();
        let inventory = OutboxSource::inventory(&topology);
        assert_eq!(
            inventory.subject("stock.reserved"),
            "inventory.stock.reserved"
        );
        assert_eq!(inventory.stream(), "INVENTORY");
        let orders = OutboxSource::orders(&topology);
        assert_eq!(orders.subject("placed"), "orders.placed");
        assert_eq!(
            (orders.table(), orders.stream()),
            ("orders_outbox", "ORDERS")
        );
    }
}
