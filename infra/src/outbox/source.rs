//! An outbox as the relay sees it: a table of the outbox's columns (`seq`, `event_id`,
//! `relay_partition`, `order_id`, `subject`, `payload`, `created_at`, `parked_at`,
//! `parked_reason`), the stream its rows go to and the prefix their subjects go under. The
//! relay, the parked-row commands and the backlog metrics are written against this, never
//! against one table, so Inventory's `outbox` and the orders producer's `orders_outbox` share
//! them.
//!
//! Every statement here stands alone (no transaction is opened), so none is ever held open
//! while the relay talks to the broker. They are built with sea-query for the connection's
//! backend: the table is a quoted identifier and every value a bound parameter.

use chrono::{DateTime, Utc};
use sea_orm::sea_query::{Alias, Asterisk, Expr, ExprTrait, Func, Order, Query};
use sea_orm::{ConnectionTrait, DbBackend, DbErr, FromQueryResult, Statement};
use uuid::Uuid;

use super::{OutboxTable, WRITTEN};
use crate::db::column_of_rows;
use crate::jetstream::Topology;

/// Where an outbox's rows come from and where they go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxSource {
    table: String,
    stream: String,
    subject_prefix: String,
}

impl OutboxSource {
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

    /// The table as an identifier of a statement.
    fn iden(&self) -> Alias {
        Alias::new(&self.table)
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
        let probe = Query::select()
            .column("seq")
            .from(self.iden())
            .limit(0)
            .to_owned();
        db.query_all(&probe).await.map(drop)
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
        // The drivers bind the LIMIT as a BIGINT.
        let limit = i64::try_from(limit).unwrap_or(i64::MAX).unsigned_abs();
        let parked_before = Query::select()
            .column(("p", "seq"))
            .from_as(self.iden(), "p")
            .and_where(Expr::col(("p", "order_id")).equals(("o", "order_id")))
            .and_where(Expr::col(("p", "parked_at")).is_not_null())
            .and_where(Expr::col(("p", "seq")).lt(Expr::col(("o", "seq"))))
            .to_owned();
        let pending = Query::select()
            .column(("o", "seq"))
            .columns(WRITTEN.map(|column| ("o", column)))
            .from_as(self.iden(), "o")
            .and_where(Expr::col(("o", "relay_partition")).is_in(partitions.iter().copied()))
            .and_where(Expr::col(("o", "parked_at")).is_null())
            .and_where(Expr::not_exists(parked_before))
            .order_by(("o", "seq"), Order::Asc)
            .limit(limit)
            .to_owned();
        PendingRow::find_by_statement(db.get_database_backend().build(&pending))
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
            let published = Query::delete()
                .from_table(self.iden())
                .and_where(Expr::col("seq").is_in(part.iter().copied()))
                .to_owned();
            deleted += db.execute(&published).await?.rows_affected();
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
        let park = Query::update()
            .table(self.iden())
            .values([
                ("parked_at", Utc::now().into()),
                ("parked_reason", reason.into()),
            ])
            .and_where(Expr::col("seq").eq(seq))
            .and_where(Expr::col("parked_at").is_null())
            .to_owned();
        db.execute(&park).await.map(drop)
    }

    /// The parked rows, oldest first.
    pub async fn parked(&self, db: &impl ConnectionTrait) -> Result<Vec<ParkedRow>, DbErr> {
        let parked = Query::select()
            .columns(["seq", "event_id", "order_id", "subject"])
            .expr_as(
                Func::cast_as(Func::char_length(Expr::col("payload")), "BIGINT"),
                "payload_chars",
            )
            .columns(["created_at", "parked_at", "parked_reason"])
            .from(self.iden())
            .and_where(Expr::col("parked_at").is_not_null())
            .order_by("seq", Order::Asc)
            .to_owned();
        ParkedRow::find_by_statement(db.get_database_backend().build(&parked))
            .all(db)
            .await
    }

    /// Puts parked rows back in line (all of them, or those with these seqs); the relay
    /// tries them on its next pass, before their orders' later rows. Returns the seqs
    /// released.
    pub async fn retry(&self, db: &impl ConnectionTrait, which: &Retry) -> Result<Vec<i64>, DbErr> {
        let only = match which {
            Retry::All => None,
            Retry::Seqs(seqs) if seqs.is_empty() => return Ok(Vec::new()),
            Retry::Seqs(seqs) => Some(Expr::col("seq").is_in(seqs.iter().copied())),
        };
        let release = Query::update()
            .table(self.iden())
            .values([("parked_at", Expr::null()), ("parked_reason", Expr::null())])
            .and_where(Expr::col("parked_at").is_not_null())
            .and_where_option(only)
            .returning_col("seq")
            .to_owned();
        let mut seqs: Vec<i64> = column_of_rows(db, &release, "seq").await?;
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
        let [oldest, newest, parked] = self.backlog_statements(db.get_database_backend());
        let oldest = db.query_one_raw(oldest).await?;
        let newest = db.query_one_raw(newest).await?;
        let parked = db
            .query_one_raw(parked)
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

    /// The statements behind the backlog's figures, built for `backend`: the oldest row
    /// waiting, the newest row, the parked rows counted; public so that a test can look at their
    /// plans.
    pub fn backlog_statements(&self, backend: DbBackend) -> [Statement; 3] {
        let oldest = Query::select()
            .columns(["seq", "created_at"])
            .from(self.iden())
            .and_where(Expr::col("parked_at").is_null())
            .order_by("seq", Order::Asc)
            .limit(1)
            .to_owned();
        let newest = Query::select()
            .column("seq")
            .from(self.iden())
            .order_by("seq", Order::Desc)
            .limit(1)
            .to_owned();
        let parked_rows = Query::select()
            .column("seq")
            .from(self.iden())
            .and_where(Expr::col("parked_at").is_not_null())
            .limit(PARKED_COUNTED)
            .to_owned();
        let parked = Query::select()
            .expr_as(Func::count(Expr::col(Asterisk)), "parked")
            .from_subquery(parked_rows, "parked_rows")
            .to_owned();
        [oldest, newest, parked].map(|query| backend.build(&query))
    }
}

/// Parked rows counted for the metrics, at most: a few are expected, and each waits for an
/// operator.
const PARKED_COUNTED: u64 = 1_000;

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

#[cfg(test)]
mod tests {
    use super::*;

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
