//! `inventory demo`: the idempotent-consumer study, replayed on a fresh database.
//!
//! Every scenario runs real handlers against the real database, with crashes injected at the
//! handlers' crash points; each prints one line and says whether it came out as the study
//! predicts. The table at the end runs the four strategies through the four kinds of duplicate.

use crate::faults;
use crate::mail::InMemoryEmailProvider;
use crate::produce::Produce as _;
use crate::readback::Readback as _;
use std::time::Duration;

use crate::consumers::{DetectMode, EMAIL_CONSUMER, EmailConsumer, HandlerKind, NaturalKeyPath};
use crate::fresh::FreshDatabase;
use crate::mistakes::{MistakenConsumer, Strategy, StudyHandler};
use anyhow::{Context, Result};
use inventory_domain::{
    BookId, ConsumerName, DeadLetterReason, DedupKey, Effect, Event, Message, MessageId, OrderId,
    Outcome, Quantity, ReservationStatus, StockEvent, StockEventKind, StockItem,
};
use inventory_infra::CrashPoint;
use inventory_infra::db::{DatabaseConnection, DbBackend};
use inventory_infra::redact::redact_url;
use inventory_infra::{Faults, HandleError, MessageHandler, StockRepository};
use sea_orm::{ConnectionTrait, Statement};

use crate::cache::{DedupCache, PreFiltered};

/// How long the second of two concurrent copies may run on SQLite while the first holds its
/// claim: ample for an unblocked copy to finish, so one still running then is taken as waiting
/// for the first. SQLite shows no lock waits to measure instead.
const CONCURRENT_WATCH: Duration = Duration::from_secs(1);

/// On PostgreSQL, how long the second copy may neither finish nor wait for a lock before the
/// demo gives up: a bound for a broken run, not a measurement.
const LOCK_WAIT_LIMIT: Duration = Duration::from_secs(30);

const DUNE_ON_HAND: i64 = 10;
const ORDER_QUANTITY: i64 = 2;

/// One printed line of the study.
pub struct ScenarioLine {
    pub label: &'static str,
    pub text: String,
    pub as_expected: bool,
}

/// The result of a whole run: the lines, the table, and whether everything came out right.
pub struct StudyReport {
    pub lines: Vec<ScenarioLine>,
    pub table: Vec<TableRow>,
}

pub struct TableRow {
    pub strategy: Strategy,
    /// Dune copies reserved under redelivery, a crash in the window, two copies at once, and a
    /// producer duplicate with a new id; 2 is right.
    pub cells: [i64; 4],
    pub expected: [i64; 4],
}

pub const TABLE_COLUMNS: [&str; 4] = [
    "redelivery",
    "crash in the window",
    "two copies at once",
    "producer duplicate, new id",
];

impl StudyReport {
    pub fn all_as_expected(&self) -> bool {
        self.lines.iter().all(|line| line.as_expected)
            && self.table.iter().all(|row| row.cells == row.expected)
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        for line in &self.lines {
            let label = format!("[{}]", line.label);
            out.push_str(&format!("{label:<20} {}", line.text));
            if !line.as_expected {
                out.push_str("   <-- NOT AS EXPECTED");
            }
            out.push('\n');
        }
        out.push('\n');
        out.push_str(&format!("{:<20}", "strategy"));
        for column in TABLE_COLUMNS {
            out.push_str(&format!("  {column}"));
        }
        out.push('\n');
        for row in &self.table {
            out.push_str(&format!("{:<20}", row.strategy.strategy_name()));
            for ((cell, expected), column) in row.cells.iter().zip(row.expected).zip(TABLE_COLUMNS)
            {
                let mark = if *cell == expected { "" } else { " (!)" };
                let width = column.len();
                out.push_str(&format!("  {:>width$}", format!("{cell}{mark}")));
            }
            out.push('\n');
        }
        out.push_str("(Dune copies reserved for one order of 2; 2 is right)\n");
        out
    }
}

/// Where the demo finds Redis for its cache scenarios unless told (`--redis-url`).
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";

/// Runs the study on a fresh database on the server of `database_url` (SQLite when `None`),
/// removing it afterwards. The cache scenarios run on the Redis at `redis_url`, and say they
/// were skipped when none answers there.
pub async fn run(database_url: Option<&str>, redis_url: &str) -> Result<StudyReport> {
    let fresh = FreshDatabase::create(database_url, "inventory_demo", 8)
        .await
        .context("creating a fresh database for the demo")?;
    let lab = Lab {
        stock: StockRepository::new(fresh.conn.clone()),
        db: fresh.conn.clone(),
        redis_url: redis_url.to_owned(),
    };
    let report = lab.run_all().await;
    fresh.remove().await.context("removing the demo database")?;
    report
}

struct Lab {
    db: DatabaseConnection,
    stock: StockRepository,
    redis_url: String,
}

fn name(value: &str) -> Result<ConsumerName> {
    Ok(ConsumerName::parse(value)?)
}

fn order_placed(book_id: BookId, quantity: i64) -> Result<Message> {
    Ok(Message {
        correlation_id: Some(format!("checkout-{}", OrderId::new_v7())),
        ..Message::placed(OrderId::new_v7(), book_id, Quantity::new(quantity)?)
    })
}

fn crashed_at(result: &Result<Outcome, HandleError>, point: CrashPoint) -> bool {
    matches!(result, Err(HandleError::Crashed(at)) if *at == point)
}

/// Two copies of one message at once: the first is held just after its dedup check (inside
/// its transaction where the strategy has one) while the second starts. Returns both outcomes
/// and whether the second waited for the first: on PostgreSQL its session seen waiting for a
/// lock, on SQLite, which shows no lock waits, still running after [`CONCURRENT_WATCH`].
async fn two_copies_at_once(
    stock: &StockRepository,
    consumer: &StudyHandler,
    message: &Message,
) -> Result<(Outcome, Outcome, bool)> {
    let (faults, mut hold) = faults::hold_once_at(CrashPoint::AfterDedupCheck);
    let first = tokio::spawn({
        let consumer = consumer.with_faults(faults);
        let message = message.clone();
        async move { consumer.handle(&message).await }
    });
    hold.reached().await;
    let mut second = tokio::spawn({
        let consumer = consumer.clone();
        let message = message.clone();
        async move { consumer.handle(&message).await }
    });
    // A strategy without a lock lets the second copy run to its end while the first is parked;
    // one with a lock keeps it waiting until the first commits.
    let early = if stock.sessions_waiting_for_a_lock().await?.is_some() {
        let seen_waiting = async {
            while stock.sessions_waiting_for_a_lock().await? == Some(0) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Ok::<_, anyhow::Error>(())
        };
        tokio::select! {
            finished = &mut second => Some(finished),
            seen = tokio::time::timeout(LOCK_WAIT_LIMIT, seen_waiting) => {
                seen.context("the second copy neither finished nor waited for a lock")??;
                None
            }
        }
    } else {
        tokio::time::timeout(CONCURRENT_WATCH, &mut second)
            .await
            .ok()
    };
    hold.release();
    let first = first.await??;
    let (second, second_waited) = match early {
        Some(finished) => (finished??, false),
        None => (second.await??, true),
    };
    Ok((first, second, second_waited))
}

/// Where the second of two copies at once was seen waiting.
#[derive(Debug, PartialEq, Eq)]
enum Waited {
    /// On PostgreSQL: for a lock, in this statement.
    OnLock(LockWait),
    /// On SQLite, which shows no lock waits: still running after [`CONCURRENT_WATCH`].
    StillRunning,
    No,
}

#[derive(Debug, PartialEq, Eq)]
struct LockWait {
    statement: String,
    tables: String,
}

/// Two copies at once: where the second waited, both outcomes (first, second), and the
/// copies reserved after both.
struct Race {
    waited: Waited,
    outcomes: (Outcome, Outcome),
    reserved: i64,
}

/// A statement as a line can show it: its verb and its table, `SELECT … FROM stock_items …
/// FOR UPDATE`, `INSERT INTO inbox`.
fn statement_summary(sql: &str) -> String {
    let words: Vec<&str> = sql.split_whitespace().collect();
    let after = |keyword: &str| {
        words
            .windows(2)
            .find(|pair| pair[0].eq_ignore_ascii_case(keyword))
            .map_or("?", |pair| pair[1].trim_matches('"'))
    };
    let verb = words.first().map(|verb| verb.to_ascii_uppercase());
    match verb.as_deref() {
        Some("SELECT") if sql.contains("FOR UPDATE") => {
            format!("SELECT … FROM {} … FOR UPDATE", after("FROM"))
        }
        Some("SELECT") => format!("SELECT … FROM {}", after("FROM")),
        Some("INSERT") => format!("INSERT INTO {}", after("INTO")),
        Some("UPDATE") => format!(
            "UPDATE {}",
            words.get(1).map_or("?", |t| t.trim_matches('"'))
        ),
        Some(other) => other.to_owned(),
        None => String::new(),
    }
}

impl Lab {
    async fn dune(&self, on_hand: i64) -> Result<BookId> {
        let book_id = BookId::new_v7();
        self.stock
            .put(&StockItem::new(book_id, "Dune", on_hand)?)
            .await?;
        Ok(book_id)
    }

    async fn reserved(&self, book_id: BookId) -> Result<i64> {
        Ok(self
            .stock
            .get(book_id)
            .await?
            .context("the demo's book vanished")?
            .reserved)
    }

    fn consumer(&self, strategy: impl Into<Strategy>) -> Result<StudyHandler> {
        let strategy = strategy.into();
        self.consumer_named(strategy, strategy.default_consumer())
    }

    fn consumer_named(
        &self,
        strategy: impl Into<Strategy>,
        consumer_name: &str,
    ) -> Result<StudyHandler> {
        Ok(strategy.into().build(&self.db, name(consumer_name)?)?)
    }

    async fn run_all(&self) -> Result<StudyReport> {
        let lines = vec![
            self.naive_twice().await?,
            self.check_then_process_crash().await?,
            self.inbox_twice().await?,
            self.inbox_crash_before_commit().await?,
            self.inbox_two_copies().await?,
            self.email_crash_after_send().await?,
            self.email_reconciled_by_lookup().await?,
            self.natural_twice().await?,
            self.producer_new_id(HandlerKind::Inbox(DetectMode::OnConflict), 4)
                .await?,
            self.producer_new_id(HandlerKind::NaturalKey(NaturalKeyPath::Orm), 2)
                .await?,
            self.record_first().await?,
            self.cache_arbiter().await?,
            self.cache_prefilter().await?,
            self.second_connection().await?,
            self.key_without_consumer().await?,
            self.claim_last().await?,
            self.claim_last_two_at_once().await?,
            self.correlation_id_as_key().await?,
            self.payload_mismatch().await?,
            self.insufficient_stock().await?,
            self.cancel_before_place().await?,
        ];
        let mut table = Vec::new();
        for (strategy, expected) in [
            (Strategy::Naive, [4, 4, 4, 4]),
            (Strategy::CheckThenProcess, [2, 4, 4, 4]),
            (
                HandlerKind::Inbox(DetectMode::OnConflict).into(),
                [2, 2, 2, 4],
            ),
            (
                HandlerKind::NaturalKey(NaturalKeyPath::Orm).into(),
                [2, 2, 2, 2],
            ),
        ] {
            table.push(TableRow {
                strategy,
                cells: self.table_row(strategy).await?,
                expected,
            });
        }
        Ok(StudyReport { lines, table })
    }

    async fn table_row(&self, strategy: Strategy) -> Result<[i64; 4]> {
        let consumer = self.consumer(strategy)?;

        let book = self.dune(DUNE_ON_HAND).await?;
        let message = order_placed(book, ORDER_QUANTITY)?;
        consumer.handle(&message).await?;
        consumer.handle(&message).await?;
        let redelivery = self.reserved(book).await?;

        let book = self.dune(DUNE_ON_HAND).await?;
        let message = order_placed(book, ORDER_QUANTITY)?;
        let crashed = consumer
            .with_faults(faults::crash_once_at(CrashPoint::AfterCommit))
            .handle(&message)
            .await;
        anyhow::ensure!(crashed_at(&crashed, CrashPoint::AfterCommit), "no crash");
        consumer.handle(&message).await?;
        let crash_in_window = self.reserved(book).await?;

        let book = self.dune(DUNE_ON_HAND).await?;
        two_copies_at_once(&self.stock, &consumer, &order_placed(book, ORDER_QUANTITY)?).await?;
        let concurrent = self.reserved(book).await?;

        let book = self.dune(DUNE_ON_HAND).await?;
        let message = order_placed(book, ORDER_QUANTITY)?;
        consumer.handle(&message).await?;
        consumer.handle(&message.resent_with_new_id()).await?;
        let producer_duplicate = self.reserved(book).await?;

        Ok([redelivery, crash_in_window, concurrent, producer_duplicate])
    }

    async fn delivered_twice(&self, strategy: impl Into<Strategy>) -> Result<(bool, bool, i64)> {
        let book = self.dune(DUNE_ON_HAND).await?;
        let consumer = self.consumer(strategy)?;
        let message = order_placed(book, ORDER_QUANTITY)?;
        let first = consumer.handle(&message).await?;
        let second = consumer.handle(&message).await?;
        Ok((
            first.processed(),
            second.processed(),
            self.reserved(book).await?,
        ))
    }

    async fn naive_twice(&self) -> Result<ScenarioLine> {
        let (_, _, reserved) = self.delivered_twice(Strategy::Naive).await?;
        Ok(ScenarioLine {
            label: "naive",
            text: format!("delivered twice -> Dune reserved: {reserved}"),
            as_expected: reserved == 4,
        })
    }

    async fn check_then_process_crash(&self) -> Result<ScenarioLine> {
        let book = self.dune(DUNE_ON_HAND).await?;
        let consumer = self.consumer(Strategy::CheckThenProcess)?;
        let message = order_placed(book, ORDER_QUANTITY)?;
        let crashed = consumer
            .with_faults(faults::crash_once_at(CrashPoint::AfterCommit))
            .handle(&message)
            .await;
        let redelivered = consumer.handle(&message).await?;
        let reserved = self.reserved(book).await?;
        Ok(ScenarioLine {
            label: "check-then-process",
            text: format!("crash after stock commit, redelivered -> Dune reserved: {reserved}"),
            as_expected: crashed_at(&crashed, CrashPoint::AfterCommit)
                && redelivered.processed()
                && reserved == 4,
        })
    }

    async fn inbox_twice(&self) -> Result<ScenarioLine> {
        let (first, second, reserved) = self
            .delivered_twice(HandlerKind::Inbox(DetectMode::OnConflict))
            .await?;
        Ok(ScenarioLine {
            label: "inbox",
            text: format!(
                "delivered twice -> processed: {first}, {second}; Dune reserved: {reserved}"
            ),
            as_expected: first && !second && reserved == 2,
        })
    }

    async fn inbox_crash_before_commit(&self) -> Result<ScenarioLine> {
        let book = self.dune(DUNE_ON_HAND).await?;
        let consumer = self.consumer(HandlerKind::Inbox(DetectMode::OnConflict))?;
        let message = order_placed(book, ORDER_QUANTITY)?;
        let crashed = consumer
            .with_faults(faults::crash_once_at(CrashPoint::BeforeCommit))
            .handle(&message)
            .await;
        let after_crash = self.reserved(book).await?;
        let redelivered = consumer.handle(&message).await?;
        let reserved = self.reserved(book).await?;
        Ok(ScenarioLine {
            label: "inbox",
            text: format!(
                "crash before commit -> reserved {after_crash}; redelivered -> Dune reserved: {reserved}"
            ),
            as_expected: crashed_at(&crashed, CrashPoint::BeforeCommit)
                && after_crash == 0
                && redelivered.processed()
                && reserved == 2,
        })
    }

    async fn inbox_two_copies(&self) -> Result<ScenarioLine> {
        let book = self.dune(DUNE_ON_HAND).await?;
        let consumer = self.consumer(HandlerKind::Inbox(DetectMode::OnConflict))?;
        let message = order_placed(book, ORDER_QUANTITY)?;
        let (first, second, waited) = two_copies_at_once(&self.stock, &consumer, &message).await?;
        let reserved = self.reserved(book).await?;
        let (first, second) = (first.processed(), second.processed());
        let how = if self.db.get_database_backend() == DbBackend::Sqlite {
            format!(
                "second still running after {}s, so waiting for the first",
                CONCURRENT_WATCH.as_secs()
            )
        } else {
            "second waited for the first".to_owned()
        };
        Ok(ScenarioLine {
            label: "inbox",
            text: format!(
                "two copies at once -> processed: {first}, {second}; Dune reserved: {reserved}; {how}: {waited}"
            ),
            as_expected: first && !second && reserved == 2 && waited,
        })
    }

    /// An email consumer on `provider` dies right after its send; the message is redelivered.
    /// Whether it died there, the redelivery's outcome, and the message.
    async fn email_crashed_after_send_then_redelivered(
        &self,
        provider: &InMemoryEmailProvider,
    ) -> Result<(bool, Outcome, Message)> {
        let book = self.dune(DUNE_ON_HAND).await?;
        let consumer = EmailConsumer::new(self.db.clone(), name(EMAIL_CONSUMER)?, provider.clone());
        // What the notifier consumes: Inventory's event that it reserved the order's copies.
        let message = Message::stock_reserved(&StockEvent::new(
            StockEventKind::Reserved,
            OrderId::new_v7(),
            book,
            Quantity::new(ORDER_QUANTITY)?,
            "an OrderPlaced",
        ));
        let crashed = consumer
            .with_faults(faults::crash_once_at(CrashPoint::AfterSend))
            .handle(&message)
            .await;
        let second = consumer.handle(&message).await?;
        Ok((crashed_at(&crashed, CrashPoint::AfterSend), second, message))
    }

    async fn email_crash_after_send(&self) -> Result<ScenarioLine> {
        let provider = InMemoryEmailProvider::without_lookup();
        let (crashed_after_send, second, _) = self
            .email_crashed_after_send_then_redelivered(&provider)
            .await?;
        let sent = provider.sent_count();
        let needs_reconciliation = matches!(&second, Outcome::Refused(refusal)
            if refusal.reason == DeadLetterReason::NeedsReconciliation);
        let second_label = if needs_reconciliation {
            "NeedsReconciliation".to_owned()
        } else {
            second.to_string()
        };
        Ok(ScenarioLine {
            label: "email",
            text: format!(
                "crash after send, redelivered -> emails sent: {sent}, second delivery: {second_label}"
            ),
            // The provider drops a repeat under a delivered key: one call means no resend.
            as_expected: crashed_after_send
                && sent == 1
                && provider.send_calls() == 1
                && needs_reconciliation,
        })
    }

    /// The same crash, with a provider that can say whether mail under a key went out: the
    /// redelivery completes the record instead of asking a person.
    async fn email_reconciled_by_lookup(&self) -> Result<ScenarioLine> {
        let provider = InMemoryEmailProvider::with_lookup();
        let (crashed_after_send, second, message) = self
            .email_crashed_after_send_then_redelivered(&provider)
            .await?;
        let sent = provider.sent_count();
        let completed = self
            .stock
            .inbox_entry(&message.key.storage_key(), EMAIL_CONSUMER)
            .await?
            .is_some_and(|record| record.completed);
        Ok(ScenarioLine {
            label: "email",
            text: format!(
                "provider answers lookups by idempotency key: crash after send, redelivered -> emails sent: {sent}, second delivery: {}",
                second.label()
            ),
            as_expected: crashed_after_send
                && sent == 1
                && provider.send_calls() == 1
                && second == Outcome::Processed(Effect::EmailReconciled)
                && completed,
        })
    }

    async fn natural_twice(&self) -> Result<ScenarioLine> {
        let (first, second, reserved) = self
            .delivered_twice(HandlerKind::NaturalKey(NaturalKeyPath::Orm))
            .await?;
        Ok(ScenarioLine {
            label: "natural key",
            text: format!(
                "delivered twice -> processed: {first}, {second}; Dune reserved: {reserved}"
            ),
            as_expected: first && !second && reserved == 2,
        })
    }

    async fn producer_new_id(&self, strategy: HandlerKind, expected: i64) -> Result<ScenarioLine> {
        let book = self.dune(DUNE_ON_HAND).await?;
        let consumer = self.consumer(strategy)?;
        let message = order_placed(book, ORDER_QUANTITY)?;
        let first = consumer.handle(&message).await?.processed();
        let second = consumer
            .handle(&message.resent_with_new_id())
            .await?
            .processed();
        let reserved = self.reserved(book).await?;
        Ok(ScenarioLine {
            label: strategy.strategy_name(),
            text: format!(
                "producer resent the order with a NEW message id -> processed: {first}, {second}; Dune reserved: {reserved}"
            ),
            as_expected: reserved == expected,
        })
    }

    fn mistaken(&self, consumer_name: &str) -> Result<MistakenConsumer> {
        Ok(MistakenConsumer::new(
            self.db.clone(),
            name(consumer_name)?,
            Faults::none(),
        ))
    }

    fn crashing(&self, consumer_name: &str, point: CrashPoint) -> Result<MistakenConsumer> {
        Ok(MistakenConsumer::new(
            self.db.clone(),
            name(consumer_name)?,
            faults::crash_once_at(point),
        ))
    }

    async fn record_first(&self) -> Result<ScenarioLine> {
        let book = self.dune(DUNE_ON_HAND).await?;
        let message = order_placed(book, ORDER_QUANTITY)?;
        let crashed = self
            .crashing("record-first", CrashPoint::AfterDedupCheck)?
            .record_first_in_separate_transactions(&message)
            .await;
        let redelivered = self
            .mistaken("record-first")?
            .record_first_in_separate_transactions(&message)
            .await?;
        let reserved = self.reserved(book).await?;
        Ok(ScenarioLine {
            label: "record first",
            text: format!(
                "record and work in separate transactions, crash between, redelivered -> skipped: {}; Dune reserved: {reserved} (at-most-once)",
                redelivered == Outcome::Duplicate
            ),
            as_expected: crashed_at(&crashed, CrashPoint::AfterDedupCheck)
                && redelivered == Outcome::Duplicate
                && reserved == 0,
        })
    }

    /// A cache of the demo's own on the Redis at `redis_url`, its keys under `scenario`; `None`
    /// when no Redis answers there.
    async fn cache(&self, scenario: &str) -> Option<DedupCache> {
        let prefix = format!(
            "inventory-demo:{scenario}:{}",
            uuid::Uuid::new_v4().simple()
        );
        DedupCache::connect(&self.redis_url, &prefix).await.ok()
    }

    fn without_redis(&self, label: &'static str) -> ScenarioLine {
        ScenarioLine {
            label,
            text: format!(
                "skipped: no Redis at {} (start redis-server, or pass --redis-url)",
                redact_url(&self.redis_url)
            ),
            as_expected: true,
        }
    }

    async fn cache_arbiter(&self) -> Result<ScenarioLine> {
        let Some(cache) = self.cache("cache-arbiter").await else {
            return Ok(self.without_redis("cache arbiter"));
        };
        let book = self.dune(DUNE_ON_HAND).await?;
        let message = order_placed(book, ORDER_QUANTITY)?;
        let crashed = self
            .crashing("cache-arbiter", CrashPoint::BeforeCommit)?
            .claim_in_cache(&cache, &message)
            .await;
        let redelivered = self
            .mistaken("cache-arbiter")?
            .claim_in_cache(&cache, &message)
            .await?;
        let reserved = self.reserved(book).await?;
        cache.clear().await?;
        Ok(ScenarioLine {
            label: "cache arbiter",
            text: format!(
                "key set in a cache, crash before the database commit, redelivered -> skipped by the cache: {}; Dune reserved: {reserved}",
                redelivered == Outcome::Duplicate
            ),
            as_expected: crashed_at(&crashed, CrashPoint::BeforeCommit)
                && redelivered == Outcome::Duplicate
                && reserved == 0,
        })
    }

    /// The cache done right: read before the transaction, written after the commit, the
    /// database's key still the arbiter. A crash between the commit and the cache write leaves
    /// the cache without the key, and the redelivery is refused by the database instead.
    async fn cache_prefilter(&self) -> Result<ScenarioLine> {
        let Some(cache) = self.cache("cache-prefilter").await else {
            return Ok(self.without_redis("cache pre-filter"));
        };
        let book = self.dune(DUNE_ON_HAND).await?;
        let message = order_placed(book, ORDER_QUANTITY)?;
        let natural = self.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm))?;
        let crashing = PreFiltered {
            cache: cache.clone(),
            handler: natural.with_faults(faults::crash_once_at(CrashPoint::AfterCommit)),
        };
        let crashed = crashing.handle(&message).await;
        let cached_after_crash = cache.seen(&message).await;
        let filtered = PreFiltered {
            cache: cache.clone(),
            handler: natural,
        };
        let redelivered = filtered.handle(&message).await?;
        let cached_after_redelivery = cache.seen(&message).await;
        let third = filtered.handle(&message).await?;
        let reserved = self.reserved(book).await?;
        cache.clear().await?;
        Ok(ScenarioLine {
            label: "cache pre-filter",
            text: format!(
                "key cached only after the commit, crash between the commit and the cache write, redelivered -> in the cache: {cached_after_crash}; refused by the database: {}; the next copy skipped by the cache: {cached_after_redelivery}; Dune reserved: {reserved}",
                redelivered == Outcome::Duplicate
            ),
            as_expected: crashed_at(&crashed, CrashPoint::AfterCommit)
                && !cached_after_crash
                && redelivered == Outcome::Duplicate
                && cached_after_redelivery
                && third == Outcome::Duplicate
                && reserved == ORDER_QUANTITY,
        })
    }

    async fn second_connection(&self) -> Result<ScenarioLine> {
        let book = self.dune(DUNE_ON_HAND).await?;
        let message = order_placed(book, ORDER_QUANTITY)?;
        let crashed = self
            .crashing("second-connection", CrashPoint::BeforeCommit)?
            .write_through_second_connection(&message)
            .await;
        let kept = self.reserved(book).await?;
        let redelivered = self
            .mistaken("second-connection")?
            .write_through_second_connection(&message)
            .await?;
        let reserved = self.reserved(book).await?;
        Ok(ScenarioLine {
            label: "second connection",
            text: format!(
                "work written outside the inbox transaction, crash before commit -> kept {kept}; redelivered -> Dune reserved: {reserved}"
            ),
            as_expected: crashed_at(&crashed, CrashPoint::BeforeCommit)
                && kept == 2
                && redelivered.processed()
                && reserved == 4,
        })
    }

    /// Two consumers of one OrderPlaced sharing an inbox: the stock reservation and a second
    /// one (an analytics feed keeping its own log). Returns whether the second processed it.
    async fn shared_inbox(&self, stock_name: &str, second_name: &str) -> Result<bool> {
        let book = self.dune(DUNE_ON_HAND).await?;
        let message = order_placed(book, ORDER_QUANTITY)?;
        self.consumer_named(HandlerKind::Inbox(DetectMode::OnConflict), stock_name)?
            .handle(&message)
            .await?;
        let second = self
            .consumer_named(HandlerKind::Inbox(DetectMode::OnConflict), second_name)?
            .handle(&message)
            .await?;
        Ok(second.processed())
    }

    async fn key_without_consumer(&self) -> Result<ScenarioLine> {
        // Keying by message id alone is the same as every consumer writing one shared name.
        let silenced = self.shared_inbox("orders-inbox", "orders-inbox").await?;
        let keyed = self
            .shared_inbox("inventory-reserve-stock-inbox", "analytics-orders-inbox")
            .await?;
        Ok(ScenarioLine {
            label: "key without consumer",
            text: format!(
                "two consumers of one message share an inbox keyed by message id alone -> the second processed: {silenced}; keyed (message id, consumer) -> the second processed: {keyed}"
            ),
            as_expected: !silenced && keyed,
        })
    }

    async fn claim_last(&self) -> Result<ScenarioLine> {
        let book = self.dune(DUNE_ON_HAND).await?;
        let message = order_placed(book, ORDER_QUANTITY)?;
        let consumer = self.mistaken("claim-last")?;
        let first = consumer.claim_last(&message).await?;
        let second = consumer.claim_last(&message).await?;
        let reserved = self.reserved(book).await?;
        Ok(ScenarioLine {
            label: "claim last",
            text: format!(
                "inbox row written after the work, delivered twice -> processed: {}, {}; Dune reserved: {reserved}; but the second copy locked and wrote the stock row before losing: {}",
                first.outcome.processed(),
                second.outcome.processed(),
                second.wrote_stock_before_claim
            ),
            as_expected: first.outcome.processed()
                && second.outcome == Outcome::Duplicate
                && reserved == 2
                && second.wrote_stock_before_claim,
        })
    }

    /// Two copies at once, the first held just before its commit with all its work done, in
    /// both orders of claim and work: where the second copy waits, and what it holds then.
    async fn claim_last_two_at_once(&self) -> Result<ScenarioLine> {
        let last = self.held_race(true).await?;
        let first = self.held_race(false).await?;
        let outcomes_right = [&last, &first].iter().all(|race| {
            race.outcomes.0.processed()
                && race.outcomes.1 == Outcome::Duplicate
                && race.reserved == ORDER_QUANTITY
        });
        let (text, waited_where_expected) = match (&last.waited, &first.waited) {
            (Waited::OnLock(last_wait), Waited::OnLock(first_wait)) => (
                format!(
                    "two copies at once -> inbox row last: the second waited in {} holding locks on {}; inbox row first: it waited in {} holding locks on {}; Dune reserved: {} and {}",
                    last_wait.statement,
                    last_wait.tables,
                    first_wait.statement,
                    first_wait.tables,
                    last.reserved,
                    first.reserved
                ),
                last_wait.statement.contains("stock_items")
                    && first_wait.statement.contains("inbox")
                    && !first_wait.tables.contains("stock_items"),
            ),
            (last_wait, first_wait) => (
                format!(
                    "two copies at once -> on SQLite's one writer the second waits before its first statement, claim last or first (still running after {}s: {}, {}); Dune reserved: {} and {}; PostgreSQL shows where each waits",
                    CONCURRENT_WATCH.as_secs(),
                    *last_wait == Waited::StillRunning,
                    *first_wait == Waited::StillRunning,
                    last.reserved,
                    first.reserved
                ),
                *last_wait == Waited::StillRunning && *first_wait == Waited::StillRunning,
            ),
        };
        Ok(ScenarioLine {
            label: "claim last",
            text,
            as_expected: outcomes_right && waited_where_expected,
        })
    }

    /// Two copies of one order at once, under the inbox with its claim last (`claim_last`) or
    /// first (the inbox handler), the first held before its commit until the second is seen
    /// waiting: on PostgreSQL for a lock, on SQLite still running after [`CONCURRENT_WATCH`].
    async fn held_race(&self, claim_last: bool) -> Result<Race> {
        let book = self.dune(DUNE_ON_HAND).await?;
        let message = order_placed(book, ORDER_QUANTITY)?;
        let consumer = if claim_last {
            "claim-last-race"
        } else {
            "claim-first-race"
        };
        let start = |faults: Faults| -> Result<_> {
            let message = message.clone();
            Ok(if claim_last {
                let copy = MistakenConsumer::new(self.db.clone(), name(consumer)?, faults);
                tokio::spawn(async move { copy.claim_last(&message).await.map(|r| r.outcome) })
            } else {
                let copy = self
                    .consumer_named(HandlerKind::Inbox(DetectMode::OnConflict), consumer)?
                    .with_faults(faults);
                tokio::spawn(async move { copy.handle(&message).await })
            })
        };
        let (faults, mut hold) = faults::hold_once_at(CrashPoint::BeforeCommit);
        let first = start(faults)?;
        hold.reached().await;
        let mut second = start(Faults::none())?;
        let waited = if self.db.get_database_backend() == DbBackend::Postgres {
            Waited::OnLock(self.lock_wait().await?)
        } else if tokio::time::timeout(CONCURRENT_WATCH, &mut second)
            .await
            .is_err()
        {
            Waited::StillRunning
        } else {
            Waited::No
        };
        hold.release();
        let outcomes = (first.await??, second.await??);
        Ok(Race {
            waited,
            outcomes,
            reserved: self.reserved(book).await?,
        })
    }

    /// The statement a session of this database waits in for a lock, and the tables it holds
    /// locks on meanwhile (`pg_stat_activity`, `pg_locks`), once one is seen waiting.
    async fn lock_wait(&self) -> Result<LockWait> {
        const WAITING: &str = "\
SELECT a.query AS statement,
       coalesce((SELECT string_agg(DISTINCT c.relname, ', ' ORDER BY c.relname)
                 FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
                 WHERE l.pid = a.pid AND l.granted AND c.relkind = 'r'
                   AND c.relnamespace <> 'pg_catalog'::regnamespace), '') AS tables
FROM pg_stat_activity a
WHERE a.datname = current_database() AND a.wait_event_type = 'Lock'
LIMIT 1";
        let seen = async {
            loop {
                let row = self
                    .db
                    .query_one_raw(Statement::from_string(DbBackend::Postgres, WAITING))
                    .await?;
                if let Some(row) = row {
                    let statement: String = row.try_get("", "statement")?;
                    return Ok::<_, anyhow::Error>(LockWait {
                        statement: statement_summary(&statement),
                        tables: row.try_get("", "tables")?,
                    });
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(LOCK_WAIT_LIMIT, seen)
            .await
            .context("the second copy never waited for a lock")?
    }

    async fn correlation_id_as_key(&self) -> Result<ScenarioLine> {
        // The mistake: the consumer builds its dedup key from the correlation id, which the
        // OrderPlaced and its OrderCancelled share.
        let keyed_by_correlation = |message: &Message| -> Result<Message> {
            let correlation = message
                .correlation_id
                .clone()
                .context("no correlation id")?;
            Ok(Message {
                key: DedupKey::MessageId(MessageId::parse(correlation)?),
                ..message.clone()
            })
        };
        let mut reserved_after = Vec::new();
        let mut cancel_processed = Vec::new();
        for mistaken in [true, false] {
            let book = self.dune(DUNE_ON_HAND).await?;
            let consumer = self.consumer(HandlerKind::Inbox(DetectMode::OnConflict))?;
            let placed = order_placed(book, ORDER_QUANTITY)?;
            let cancelled = placed.cancellation();
            let (placed, cancelled) = if mistaken {
                (
                    keyed_by_correlation(&placed)?,
                    keyed_by_correlation(&cancelled)?,
                )
            } else {
                (placed, cancelled)
            };
            consumer.handle(&placed).await?;
            let outcome = consumer.handle(&cancelled).await?;
            cancel_processed.push(outcome.processed());
            reserved_after.push(self.reserved(book).await?);
        }
        Ok(ScenarioLine {
            label: "correlation id as key",
            text: format!(
                "placed then cancelled, one correlation id -> cancellation processed: {}; Dune reserved: {} (keyed by message id: processed: {}, reserved: {})",
                cancel_processed[0], reserved_after[0], cancel_processed[1], reserved_after[1]
            ),
            as_expected: cancel_processed == [false, true] && reserved_after == [2, 0],
        })
    }

    async fn payload_mismatch(&self) -> Result<ScenarioLine> {
        let book = self.dune(DUNE_ON_HAND).await?;
        let consumer = self.consumer(HandlerKind::Inbox(DetectMode::OnConflict))?;
        let message = order_placed(book, ORDER_QUANTITY)?;
        let mut altered = message.clone();
        if let Event::Placed(placed) = &mut altered.event {
            placed.quantity = Quantity::new(3)?;
        }
        consumer.handle(&message).await?;
        let second = consumer.handle(&altered).await?;
        let reserved = self.reserved(book).await?;
        Ok(ScenarioLine {
            label: "payload mismatch",
            text: format!(
                "same message id, quantity 2 then 3 -> second: {}; Dune reserved: {reserved}",
                second.label()
            ),
            as_expected: second.label() == DeadLetterReason::PayloadMismatch.as_str()
                && reserved == 2,
        })
    }

    async fn insufficient_stock(&self) -> Result<ScenarioLine> {
        let book = self.dune(1).await?;
        let consumer = self.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm))?;
        let message = order_placed(book, ORDER_QUANTITY)?;
        let first = consumer.handle(&message).await?;
        self.stock
            .put(&StockItem::new(book, "Dune", DUNE_ON_HAND)?)
            .await?;
        let second = consumer.handle(&message).await?;
        let status = self
            .stock
            .reservation(message.event.order_id(), book)
            .await?
            .map(|reservation| reservation.status);
        let reserved = self.reserved(book).await?;
        Ok(ScenarioLine {
            label: "insufficient stock",
            text: format!(
                "1 on hand, order for 2 -> {}; restocked to 10, redelivered -> {}, status: {}; Dune reserved: {reserved}",
                first.label(),
                second.label(),
                status.map_or("none", ReservationStatus::as_str)
            ),
            as_expected: matches!(first, Outcome::Processed(Effect::Rejected { .. }))
                && second == Outcome::Duplicate
                && status == Some(ReservationStatus::Rejected)
                && reserved == 0,
        })
    }

    async fn cancel_before_place(&self) -> Result<ScenarioLine> {
        let book = self.dune(DUNE_ON_HAND).await?;
        let consumer = self.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm))?;
        let placed = order_placed(book, ORDER_QUANTITY)?;
        let cancelled = consumer.handle(&placed.cancellation()).await?;
        let late = consumer.handle(&placed).await?;
        let reserved = self.reserved(book).await?;
        Ok(ScenarioLine {
            label: "cancel first",
            text: format!(
                "OrderCancelled arrives before its OrderPlaced -> placement: {}; Dune reserved: {reserved}",
                match late {
                    Outcome::Processed(Effect::ArrivedAfterCancellation) =>
                        "reserved nothing (already cancelled)".to_owned(),
                    ref other => other.to_string(),
                }
            ),
            as_expected: cancelled.processed()
                && late == Outcome::Processed(Effect::ArrivedAfterCancellation)
                && reserved == 0,
        })
    }
}
