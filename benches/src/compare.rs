//! `inventory compare`: the four strategies side by side, end to end through JetStream.
//!
//! One workload, generated from a seed, is published to a stream of this run's own with every
//! kind of duplicate in it: resends by a faulty producer under a new message id, resends under
//! the same id (which the stream drops inside its duplicate window), commits whose ack is
//! withheld (so JetStream redelivers after the ack wait), and orders stored twice so that two
//! copies are handled at once. Each strategy then consumes the whole stream through the real
//! consumer loop ([`ConsumerRuntime`], acks after commit) into a fresh database of its own, one
//! strategy after the other so their rates do not compete for the cores, and its figures are set
//! against what the workload predicts for it.

use crate::faults;
use crate::mistakes::{Strategy, StudyHandler};
use crate::produce::Produce as _;
use crate::readback::Readback as _;
use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::consumers::{DetectMode, HandlerKind, NaturalKeyPath};
use crate::db::connect;
use crate::fresh::FreshDatabase;
use crate::publish::OrderPublisher;
use crate::workload::SplitMix64;
use anyhow::{Context as _, Result, bail, ensure};
use inventory_domain::{
    BookId, ConsumerName, Message, MessageId, OrderId, Outcome, Quantity, StockItem,
};
use inventory_infra::CrashPoint;
use inventory_infra::db::{self, DatabaseConnection};
use inventory_infra::jetstream::{self, Context, Topology};
use inventory_infra::{HandleError, MessageHandler, StockRepository};
use serde::Serialize;

use inventory_service::args::NatsArgs;
use inventory_service::consumer::{ConsumerRuntime, Ending, Reads, Running, RuntimeSettings};
use inventory_service::metrics::ConsumerMetrics;
use inventory_service::shutdown::Shutdown;

/// The server `compare` creates its databases on when neither the flag nor `DATABASE_URL` names
/// one: the local PostgreSQL.
pub const LOCAL_POSTGRES: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// The strategies in the order they run and are printed.
pub const STRATEGIES: [Strategy; 4] = [
    Strategy::Naive,
    Strategy::CheckThenProcess,
    Strategy::Served(HandlerKind::Inbox(DetectMode::OnConflict)),
    Strategy::Served(HandlerKind::NaturalKey(NaturalKeyPath::Orm)),
];

/// Copies per order: 1 to 3.
const MAX_QUANTITY: u64 = 3;

/// Deliveries of a message before it is dead-lettered: far more than the two a healthy run
/// needs.
const MAX_DELIVER: i64 = 10;

fn rate(value: &str) -> Result<f64, String> {
    let rate: f64 = value
        .parse()
        .map_err(|_| format!("{value:?} is not a number"))?;
    if (0.0..=1.0).contains(&rate) {
        Ok(rate)
    } else {
        Err(format!("{rate} is not a fraction between 0 and 1"))
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct CompareArgs {
    /// Orders in the workload, each for one book.
    #[arg(long, default_value_t = 3_000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub orders: u32,
    /// Books the orders are spread over; each gets stock enough for every copy any strategy
    /// could reserve.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub books: u32,
    /// Fraction of orders a faulty producer resends under a NEW message id.
    #[arg(long, default_value_t = 0.1, value_parser = rate)]
    pub producer_new_id_rate: f64,
    /// Fraction of orders resent with the SAME message id, which the stream drops.
    #[arg(long, default_value_t = 0.1, value_parser = rate)]
    pub producer_same_id_rate: f64,
    /// Fraction of orders whose first handling commits and withholds its ack, so JetStream
    /// redelivers them after the ack wait.
    #[arg(long, default_value_t = 0.05, value_parser = rate)]
    pub redelivery_rate: f64,
    /// Fraction of orders stored twice in a row (same body, another Nats-Msg-Id), so two copies
    /// are handled at once.
    #[arg(long, default_value_t = 0.05, value_parser = rate)]
    pub concurrent_copies_rate: f64,
    /// Seed of the workload: the same seed gives the same orders and the same duplicates.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Where each strategy's fresh database goes: postgres://… (a new database on that server,
    /// dropped afterwards) or sqlite://… (temporary files; the path is not used); the local
    /// PostgreSQL when unset.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// How long JetStream waits for an ack before redelivering: short, so the withheld acks
    /// come back quickly.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub ack_wait: Duration,
    /// Messages in flight per consumer instance (and database connections per instance).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub concurrency: u32,
    /// Prints the figures as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    // Last: its heading would stick to the flags after it.
    #[command(flatten)]
    pub nats: NatsArgs,
}

/// Everything a comparison needs, without the command line: what the tests build.
#[derive(Debug, Clone)]
pub struct Settings {
    pub orders: u32,
    pub books: u32,
    pub rates: Rates,
    pub seed: u64,
    /// `postgres://…` (the server to create databases on) or `sqlite://…` (temporary files).
    pub database_url: String,
    pub nats_url: String,
    pub ack_wait: Duration,
    pub concurrency: u32,
}

/// Fractions of the orders that get each kind of duplicate.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Rates {
    pub producer_new_id: f64,
    pub producer_same_id: f64,
    pub redelivery: f64,
    pub concurrent_copies: f64,
}

impl CompareArgs {
    pub fn settings(&self) -> Settings {
        Settings {
            orders: self.orders,
            books: self.books,
            rates: Rates {
                producer_new_id: self.producer_new_id_rate,
                producer_same_id: self.producer_same_id_rate,
                redelivery: self.redelivery_rate,
                concurrent_copies: self.concurrent_copies_rate,
            },
            seed: self.seed,
            database_url: self
                .database_url
                .clone()
                .unwrap_or_else(|| LOCAL_POSTGRES.to_owned()),
            nats_url: self.nats.url().to_owned(),
            ack_wait: self.ack_wait,
            concurrency: self.concurrency,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Postgres,
    Sqlite,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Self::Postgres => "PostgreSQL",
            Self::Sqlite => "SQLite",
        }
    }

    /// Two instances share each strategy's durable consumer on PostgreSQL; SQLite has one
    /// writer at a time, so one instance there.
    fn instances(self) -> usize {
        match self {
            Self::Postgres => 2,
            Self::Sqlite => 1,
        }
    }
}

impl Settings {
    /// What is wrong with these settings for a usage error, if anything.
    pub fn problem(&self) -> Option<String> {
        let rates = self.rates;
        let all = [
            rates.producer_new_id,
            rates.producer_same_id,
            rates.redelivery,
            rates.concurrent_copies,
        ];
        if all.iter().any(|rate| !(0.0..=1.0).contains(rate)) {
            return Some("every rate is a fraction between 0 and 1".into());
        }
        // Each order gets at most one fault its consumers see, so each prediction is exact.
        if rates.producer_new_id + rates.redelivery + rates.concurrent_copies > 1.0 + 1e-9 {
            return Some(
                "--producer-new-id-rate, --redelivery-rate and --concurrent-copies-rate add up \
                 to more than 1: each order gets at most one of them"
                    .into(),
            );
        }
        if self.orders == 0 || self.books == 0 || self.concurrency == 0 {
            return Some("--orders, --books and --concurrency are at least 1".into());
        }
        if self.backend().is_none() {
            return Some("--database-url is postgres://… or sqlite://…".into());
        }
        None
    }

    fn backend(&self) -> Option<Backend> {
        if db::is_postgres(&self.database_url) {
            Some(Backend::Postgres)
        } else if self.database_url.starts_with("sqlite:") {
            Some(Backend::Sqlite)
        } else {
            None
        }
    }
}

/// The one fault an order's consumers see, besides the same-id resend the stream drops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    None,
    /// The producer resends the order under a new message id.
    NewIdResend,
    /// The first handling commits, then dies before its ack: JetStream redelivers.
    Redelivered,
    /// The stream stores the message twice in a row: two copies handled at once.
    TwoCopies,
}

#[derive(Debug, Clone)]
pub struct PlannedOrder {
    pub message: Message,
    pub book: usize,
    pub quantity: i64,
    pub fault: Fault,
    /// Also resent with the same `Nats-Msg-Id`, right after the original.
    pub same_id_resend: bool,
}

impl PlannedOrder {
    fn key(&self) -> String {
        self.message.key.storage_key().into_owned()
    }

    /// The faulty producer's resend: the same order under a new message id.
    fn resend(&self) -> Result<Message> {
        let id = MessageId::parse(format!("{}-resent", self.key()))?;
        Ok(self.message.resent_as(id))
    }
}

/// The orders and books of one run, all derived from the seed.
#[derive(Debug, Clone)]
pub struct Workload {
    pub books: Vec<BookId>,
    pub orders: Vec<PlannedOrder>,
}

fn share(rate: f64, orders: usize) -> usize {
    // Rates are checked to lie in 0..=1, so the product is a small non-negative number.
    ((rate * orders as f64).round() as usize).min(orders)
}

impl Workload {
    pub fn generate(settings: &Settings) -> Result<Self> {
        let mut rng = SplitMix64::new(settings.seed);
        let books: Vec<BookId> = (0..settings.books).map(|_| rng.uuid().into()).collect();
        let count = usize::try_from(settings.orders)?;
        let mut orders = Vec::with_capacity(count);
        for i in 0..count {
            let book = usize::try_from(rng.below(books.len() as u64))?;
            let quantity = i64::try_from(1 + rng.below(MAX_QUANTITY))?;
            let message = Message::placed(
                OrderId::from(rng.uuid()),
                books[book],
                Quantity::new(quantity)?,
            )
            .resent_as(MessageId::parse(format!("order-{i}"))?);
            orders.push(PlannedOrder {
                message,
                book,
                quantity,
                fault: Fault::None,
                same_id_resend: false,
            });
        }
        let rates = settings.rates;
        let mut picked: Vec<usize> = (0..count).collect();
        rng.shuffle(&mut picked);
        let mut next = picked.into_iter();
        for (fault, rate) in [
            (Fault::NewIdResend, rates.producer_new_id),
            (Fault::Redelivered, rates.redelivery),
            (Fault::TwoCopies, rates.concurrent_copies),
        ] {
            for index in next.by_ref().take(share(rate, count)) {
                orders[index].fault = fault;
            }
        }
        let mut picked: Vec<usize> = (0..count).collect();
        rng.shuffle(&mut picked);
        for &index in picked.iter().take(share(rates.producer_same_id, count)) {
            orders[index].same_id_resend = true;
        }
        Ok(Self { books, orders })
    }

    fn count(&self, fault: Fault) -> u64 {
        self.orders
            .iter()
            .filter(|order| order.fault == fault)
            .count() as u64
    }

    /// Copies of each book: twice what any strategy could reserve as planned (naive reserves on
    /// every delivery), so no order is rejected for want of stock even after a redelivery the
    /// plan did not foresee.
    fn stock(&self) -> Result<Vec<StockItem>> {
        let mut on_hand = vec![0i64; self.books.len()];
        for order in &self.orders {
            let deliveries = match order.fault {
                Fault::None => 1,
                _ => 2,
            } + i64::from(order.same_id_resend);
            on_hand[order.book] += 2 * order.quantity * deliveries;
        }
        self.books
            .iter()
            .zip(on_hand)
            .enumerate()
            .map(|(n, (book, copies))| Ok(StockItem::new(*book, &format!("Book {n}"), copies)?))
            .collect()
    }
}

/// What the stream did with the workload.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Published {
    /// Messages the stream stored.
    pub stored: u64,
    /// Same-id resends the stream dropped inside its duplicate window.
    pub dropped_same_id: u64,
    /// Orders whose same-id resend the stream stored after all: a further copy of the message.
    #[serde(skip)]
    pub same_id_stored: HashSet<usize>,
}

async fn publish_workload(
    publisher: &OrderPublisher,
    topology: &Topology,
    workload: &Workload,
) -> Result<Published> {
    let subject = topology.subject(inventory_domain::EventKind::Placed);
    let mut published = Published::default();
    let body = |message: &Message| -> Result<Vec<u8>> {
        message
            .to_plain_json()
            .context("a message of the workload has no plain JSON body")
    };
    // One at a time, in order, so a copy lands right after its original.
    for (index, order) in workload.orders.iter().enumerate() {
        let id = order.key();
        let original = body(&order.message)?;
        let mut stored = vec![
            publisher
                .publish_raw(&subject, &id, original.clone().into())
                .await?,
        ];
        if order.same_id_resend {
            let receipt = publisher
                .publish_raw(&subject, &id, original.clone().into())
                .await?;
            if receipt.duplicate {
                published.dropped_same_id += 1;
            } else {
                published.same_id_stored.insert(index);
                published.stored += 1;
            }
        }
        match order.fault {
            Fault::NewIdResend => {
                let resend = order.resend()?;
                let resend_id = resend.key.storage_key();
                stored.push(
                    publisher
                        .publish_raw(&subject, &resend_id, body(&resend)?.into())
                        .await?,
                );
            }
            Fault::TwoCopies => {
                // The same body, so the same message id; another Nats-Msg-Id, so the stream
                // keeps both.
                stored.push(
                    publisher
                        .publish_raw(&subject, &format!("{id}:copy"), original.into())
                        .await?,
                );
            }
            Fault::None | Fault::Redelivered => {}
        }
        for receipt in stored {
            ensure!(
                !receipt.duplicate,
                "the stream dropped a message of {id} it should have stored"
            );
            published.stored += 1;
        }
    }
    Ok(published)
}

/// One handling of a message by one instance, for the record.
#[derive(Debug, Clone, Copy)]
struct Handling {
    instance: usize,
    start: Duration,
    end: Duration,
    crashed: bool,
}

/// What the workload asks of the handlers, and what they did, shared by a strategy's instances.
struct Script {
    started: Instant,
    /// Keys whose next processing dies right after its commit, once each.
    armed: Mutex<HashSet<String>>,
    handled: Mutex<HashMap<String, Vec<Handling>>>,
}

fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // The data is counters and sets: still sound after another thread panicked.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Script {
    fn new(armed: HashSet<String>) -> Self {
        Self {
            started: Instant::now(),
            armed: Mutex::new(armed),
            handled: Mutex::new(HashMap::new()),
        }
    }

    fn handlings(&self) -> usize {
        locked(&self.handled).values().map(Vec::len).sum()
    }

    /// Every planned crash happened, and every crashed message was handled again since.
    fn crashes_redelivered(&self) -> bool {
        if !locked(&self.armed).is_empty() {
            return false;
        }
        locked(&self.handled).values().all(|handlings| {
            handlings
                .iter()
                .rposition(|handling| handling.crashed)
                .is_none_or(|last_crash| last_crash + 1 < handlings.len())
        })
    }
}

/// The strategy's real handler, made to die after its commit for the messages the workload
/// marked for redelivery, the first time each is processed.
///
/// The crash is the handler's own, at its `AfterCommit` crash point, through a per-message
/// `with_faults`: for check-then-process that point lies in its window (the stock committed, the
/// inbox record not yet written), which a wrapper failing after `handle` returned would miss,
/// since by then the record is written. `Faults` itself needs no per-message plan for this.
#[derive(Clone)]
struct Scripted {
    inner: StudyHandler,
    instance: usize,
    script: Arc<Script>,
}

impl MessageHandler for Scripted {
    async fn handle(&self, message: &Message) -> Result<Outcome, HandleError> {
        let key = message.key.storage_key().into_owned();
        let armed = locked(&self.script.armed).remove(&key);
        let handler = if armed {
            self.inner
                .with_faults(faults::crash_once_at(CrashPoint::AfterCommit))
        } else {
            self.inner.clone()
        };
        let start = self.script.started.elapsed();
        let result = handler.handle(message).await;
        let crashed = matches!(result, Err(HandleError::Crashed(_)));
        if armed && !crashed {
            // Not processed (a failure, or a copy that lost): the crash waits for the next.
            locked(&self.script.armed).insert(key.clone());
        }
        let handling = Handling {
            instance: self.instance,
            start,
            end: self.script.started.elapsed(),
            crashed,
        };
        locked(&self.script.handled)
            .entry(key)
            .or_default()
            .push(handling);
        result
    }
}

/// A closed interval of possible values; `min == max` for an exact prediction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Range {
    pub min: i64,
    pub max: i64,
}

impl Range {
    fn exact(value: i64) -> Self {
        Self {
            min: value,
            max: value,
        }
    }

    fn between(min: i64, max: i64) -> Self {
        Self { min, max }
    }

    fn contains(self, value: i64) -> bool {
        (self.min..=self.max).contains(&value)
    }

    fn add(&mut self, other: Self) {
        self.min += other.min;
        self.max += other.max;
    }

    fn signed(self) -> String {
        let one = |value: i64| {
            if value > 0 {
                format!("+{value}")
            } else {
                value.to_string()
            }
        };
        if self.min == self.max {
            one(self.min)
        } else {
            format!("{}..{}", one(self.min), one(self.max))
        }
    }
}

impl std::fmt::Display for Range {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.min == self.max {
            write!(f, "{}", self.min)
        } else {
            write!(f, "{}..{}", self.min, self.max)
        }
    }
}

/// What a strategy's figures must be, given the workload and what the broker delivered.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Prediction {
    pub delivered: Range,
    pub processed: Range,
    pub duplicates: Range,
    pub ack_withheld: Range,
    pub dead_lettered: Range,
    pub difference: Range,
    pub orders_reserved_more_than_once: Range,
}

/// One order as its consumers saw it.
struct Seen {
    quantity: i64,
    /// Copies of the original message id the stream stored (two copies, a same-id resend kept).
    copies: i64,
    /// 1 if its first processing withheld the ack.
    redelivered: i64,
    /// 1 if the producer resent it under a new id.
    resent: i64,
    /// Deliveries beyond the plan (an ack later than the ack wait): one more copy each.
    unplanned: i64,
}

fn predict(strategy: Strategy, seen: &[Seen]) -> Prediction {
    let mut prediction = Prediction::default();
    for order in seen {
        let Seen {
            quantity: q,
            copies: k,
            redelivered: r,
            resent: p,
            unplanned: u,
        } = *order;
        prediction.delivered.add(Range::exact(k + r + p + u));
        prediction.ack_withheld.add(Range::exact(r));
        let (processed, duplicates, extra_reservations) = match strategy {
            // Every delivery reserves; the withheld one reserved too, and its redelivery again.
            Strategy::Naive => (
                Range::exact(k + p + u),
                Range::exact(0),
                Range::exact(k - 1 + r + p + u),
            ),
            // Its check and its late record race: a copy handled while the other is between
            // the two reserves again, and a withheld ack has no record, so the redelivery
            // reserves again.
            Strategy::CheckThenProcess => (
                Range::between(1 + p, k + p + u),
                Range::between(0, k - 1 + u),
                Range::between(r + p, k - 1 + r + p + u),
            ),
            // The claim commits with the work: only the new id gets through. (The email's
            // record is keyed by message id too; the comparison runs the stock handlers.)
            Strategy::Served(HandlerKind::Inbox(_) | HandlerKind::Email) => (
                Range::exact(1 - r + p),
                Range::exact(k - 1 + r + u),
                Range::exact(p),
            ),
            Strategy::Served(HandlerKind::NaturalKey(_)) => (
                Range::exact(1 - r),
                Range::exact(k - 1 + r + p + u),
                Range::exact(0),
            ),
        };
        prediction.processed.add(processed);
        prediction.duplicates.add(duplicates);
        prediction.difference.add(Range::between(
            q * extra_reservations.min,
            q * extra_reservations.max,
        ));
        prediction
            .orders_reserved_more_than_once
            .add(Range::between(
                i64::from(extra_reservations.min > 0),
                i64::from(extra_reservations.max > 0),
            ));
    }
    prediction
}

/// One strategy's figures, its prediction, and how they compare.
#[derive(Debug, Clone, Serialize)]
pub struct StrategyRow {
    pub strategy: &'static str,
    pub delivered: i64,
    pub processed: i64,
    pub duplicates: i64,
    pub ack_withheld: i64,
    pub dead_lettered: i64,
    /// Transient failures nak'ed for a retry; 0 in a healthy run.
    pub retried: i64,
    pub expected_reserved: i64,
    pub actual_reserved: i64,
    pub difference: i64,
    pub orders_reserved_more_than_once: i64,
    /// Deliveries the workload did not plan: an ack later than the ack wait.
    pub unplanned_deliveries: i64,
    /// Pairs of copies whose handlings overlapped in time, and how many of those ran on two
    /// instances.
    pub copies_at_once: i64,
    pub copies_on_two_instances: i64,
    pub seconds: f64,
    pub messages_per_second: f64,
    pub prediction: Prediction,
    /// Figures outside the prediction, as "what: actual (predicted p)".
    pub deviations: Vec<String>,
}

impl StrategyRow {
    pub fn as_predicted(&self) -> bool {
        self.deviations.is_empty()
    }

    fn check(&mut self) {
        let prediction = self.prediction.clone();
        let figures = [
            ("delivered", self.delivered, prediction.delivered),
            ("processed", self.processed, prediction.processed),
            ("duplicates", self.duplicates, prediction.duplicates),
            ("ack withheld", self.ack_withheld, prediction.ack_withheld),
            (
                "dead-lettered",
                self.dead_lettered,
                prediction.dead_lettered,
            ),
            ("difference", self.difference, prediction.difference),
            (
                "orders reserved more than once",
                self.orders_reserved_more_than_once,
                prediction.orders_reserved_more_than_once,
            ),
        ];
        self.deviations = figures
            .into_iter()
            .filter(|(_, actual, predicted)| !predicted.contains(*actual))
            .map(|(what, actual, predicted)| format!("{what}: {actual} (predicted {predicted})"))
            .collect();
    }
}

/// The workload as run.
#[derive(Debug, Clone, Serialize)]
pub struct WorkloadSummary {
    pub orders: u32,
    pub books: u32,
    pub seed: u64,
    pub rates: Rates,
    pub backend: Backend,
    pub instances_per_strategy: usize,
    pub concurrency_per_instance: u32,
    pub ack_wait_ms: u64,
    /// Copies the orders ask for, each order once.
    pub copies_ordered: i64,
    pub resent_with_new_id: u64,
    pub resent_with_same_id: u64,
    pub redelivered: u64,
    pub two_copies: u64,
    pub published: Published,
}

#[derive(Debug, Clone, Serialize)]
pub struct CompareReport {
    pub workload: WorkloadSummary,
    pub strategies: Vec<StrategyRow>,
    /// The inbox and the natural key came out as predicted: what the exit code says.
    pub as_predicted: bool,
}

impl CompareReport {
    pub fn row(&self, strategy: impl Into<Strategy>) -> Option<&StrategyRow> {
        let strategy = strategy.into();
        self.strategies
            .iter()
            .find(|row| row.strategy == strategy.strategy_name())
    }

    pub fn render(&self) -> String {
        let w = &self.workload;
        let mut out = String::new();
        let headers = [
            "strategy",
            "delivered",
            "processed",
            "duplicate",
            "ack withheld",
            "dead-lettered",
            "expected",
            "reserved",
            "difference",
            "predicted",
            "orders >1",
            "msg/s",
        ];
        let rows: Vec<Vec<String>> = self
            .strategies
            .iter()
            .map(|row| {
                let p = &row.prediction;
                let mark = |value: i64, range: Range| {
                    if range.contains(value) {
                        value.to_string()
                    } else {
                        format!("{value} (!)")
                    }
                };
                let difference = Range::exact(row.difference).signed();
                vec![
                    row.strategy.to_owned(),
                    mark(row.delivered, p.delivered),
                    mark(row.processed, p.processed),
                    mark(row.duplicates, p.duplicates),
                    mark(row.ack_withheld, p.ack_withheld),
                    mark(row.dead_lettered, p.dead_lettered),
                    row.expected_reserved.to_string(),
                    row.actual_reserved.to_string(),
                    if p.difference.contains(row.difference) {
                        difference
                    } else {
                        format!("{difference} (!)")
                    },
                    p.difference.signed(),
                    mark(
                        row.orders_reserved_more_than_once,
                        p.orders_reserved_more_than_once,
                    ),
                    format!("{:.0}", row.messages_per_second),
                ]
            })
            .collect();
        let widths: Vec<usize> = headers
            .iter()
            .enumerate()
            .map(|(column, header)| {
                rows.iter()
                    .map(|row| row[column].len())
                    .chain([header.len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let line = |cells: Vec<&str>| {
            let mut text = String::new();
            for (column, cell) in cells.iter().enumerate() {
                let width = widths[column];
                if column == 0 {
                    let _ = write!(text, "{cell:<width$}");
                } else {
                    let _ = write!(text, "  {cell:>width$}");
                }
            }
            text.push('\n');
            text
        };
        out.push_str(&line(headers.to_vec()));
        for row in &rows {
            out.push_str(&line(row.iter().map(String::as_str).collect()));
        }
        out.push('\n');
        let _ = writeln!(
            out,
            "workload: {} orders over {} books (seed {}), {} copies ordered; stream: {} messages",
            w.orders, w.books, w.seed, w.copies_ordered, w.published.stored
        );
        let _ = writeln!(
            out,
            "  producer: {} resent under a new message id, {} under the same id (the stream dropped {})",
            w.resent_with_new_id, w.resent_with_same_id, w.published.dropped_same_id
        );
        let _ = writeln!(
            out,
            "  consumers: {} acks withheld after the commit (redelivered after the {}ms ack wait),\n    \
             {} orders stored as two copies",
            w.redelivered, w.ack_wait_ms, w.two_copies
        );
        let at_once: Vec<String> = self
            .strategies
            .iter()
            .map(|row| {
                format!(
                    "{} {} ({})",
                    row.strategy, row.copies_at_once, row.copies_on_two_instances
                )
            })
            .collect();
        let _ = writeln!(
            out,
            "  pairs handled at the same time (by two instances): {}",
            at_once.join(", ")
        );
        let _ = writeln!(
            out,
            "  each strategy: a fresh {} database, {} on one durable consumer, {} in flight each",
            w.backend.name(),
            match w.instances_per_strategy {
                1 => "1 instance".to_owned(),
                n => format!("{n} instances"),
            },
            w.concurrency_per_instance
        );
        for row in &self.strategies {
            if row.unplanned_deliveries + row.retried > 0 {
                let _ = writeln!(
                    out,
                    "  {}: {} deliveries the workload did not plan (an ack later than the ack wait),\n    \
                     counted in its prediction; {} transient failures retried",
                    row.strategy, row.unplanned_deliveries, row.retried
                );
            }
        }
        out.push_str(
            "predicted difference: naive reserves again for every resend, copy and redelivery;\n  \
             check-then-process for every resend and redelivery, and for a copy when both pass\n  \
             its check before either records; the inbox for every resend under a new id;\n  \
             the natural key never\n",
        );
        out.push_str(
            "msg/s: deliveries handled / wall time from the start of consumption until the\n  \
             consumer had nothing pending or unacked, waiting out the ack wait included\n",
        );
        for row in &self.strategies {
            for deviation in &row.deviations {
                let _ = writeln!(out, "NOT AS PREDICTED: {}: {deviation}", row.strategy);
            }
        }
        out
    }
}

/// The stream, consumers and publisher of one run.
struct Run {
    settings: Settings,
    backend: Backend,
    js: Context,
    topology: Topology,
    workload: Workload,
    published: Published,
}

/// A strategy's consumer loops, running in-process.
struct Instance {
    running: Running,
    /// What became of its deliveries.
    metrics: ConsumerMetrics,
    /// Its own pool; the first instance's is the fresh database's.
    conn: Option<DatabaseConnection>,
}

impl Run {
    fn durable_name(strategy: Strategy) -> String {
        format!("compare-{}", strategy.strategy_name().replace(' ', "-"))
    }

    async fn consume(&self, strategy: Strategy) -> Result<StrategyRow> {
        let fresh = FreshDatabase::create(
            Some(&self.settings.database_url),
            "inventory_compare",
            self.settings.concurrency,
        )
        .await
        .context("creating a fresh database")?;
        let result = self.consume_into(strategy, &fresh).await;
        let removed = fresh.remove().await.context("removing the fresh database");
        let row = result?;
        removed?;
        Ok(row)
    }

    async fn consume_into(&self, strategy: Strategy, fresh: &FreshDatabase) -> Result<StrategyRow> {
        let stock = StockRepository::new(fresh.conn.clone());
        for item in self.workload.stock()? {
            stock.put(&item).await?;
        }
        let durable = Self::durable_name(strategy);
        let mut settings = RuntimeSettings::new(
            self.topology.clone(),
            &durable,
            Reads::Orders,
            usize::try_from(self.settings.concurrency).unwrap_or(1),
        );
        settings.consumer.ack_wait = self.settings.ack_wait;
        settings.max_deliver = MAX_DELIVER;
        settings.consumer.max_ack_pending = 10_000;
        settings.retry_delay = Duration::from_millis(100);
        settings.max_retry_delay = Duration::from_secs(2);
        let armed: HashSet<String> = self
            .workload
            .orders
            .iter()
            .filter(|order| order.fault == Fault::Redelivered)
            .map(PlannedOrder::key)
            .collect();
        let script = Arc::new(Script::new(armed));
        // Every pool, consumer and handler is ready before any loop starts, so a failure here
        // leaves nothing running.
        let mut ready = Vec::new();
        for instance in 0..self.backend.instances() {
            let (pool, conn) = match instance {
                0 => (fresh.conn.clone(), None),
                _ => {
                    let conn = connect(&fresh.url, self.settings.concurrency).await?;
                    (conn.clone(), Some(conn))
                }
            };
            let runtime = ConsumerRuntime::prepare(&self.js, pool.clone(), settings.clone())
                .await
                .context("setting up the strategy's consumer")?;
            let handler = Scripted {
                inner: strategy.build(&pool, ConsumerName::parse(durable.clone())?)?,
                instance,
                script: script.clone(),
            };
            ready.push((runtime, handler, conn));
        }
        let started = Instant::now();
        let instances: Vec<Instance> = ready
            .into_iter()
            .map(|(runtime, handler, conn)| {
                let metrics =
                    crate::workload::unexported_metrics(&runtime.settings().consumer.durable_name)?;
                Ok(Instance {
                    running: runtime.start(
                        handler,
                        metrics.clone(),
                        Shutdown::new(Shutdown::TIMEOUT),
                    ),
                    metrics,
                    conn,
                })
            })
            .collect::<Result<_>>()?;
        let drained = self.wait_until_drained(&script, &instances).await;
        let seconds = started.elapsed().as_secs_f64();
        let mut stats = Vec::new();
        let mut failure = None;
        for instance in instances {
            let stats_of_instance = instance.metrics;
            let ending = instance.running.stop().await;
            if let Some(conn) = instance.conn
                && let Err(error) = conn.close().await
            {
                tracing::warn!(%error, "closing an instance's connections");
            }
            let problem = match ending {
                Ok(Ending::Drained) => None,
                Ok(Ending::Abandoned) => Some(anyhow::anyhow!(
                    "a consumer loop stopped before its messages finished"
                )),
                Err(error) => Some(error.context("a consumer loop failed")),
            };
            if failure.is_none() {
                failure = problem;
            }
            stats.push(stats_of_instance);
        }
        // A loop's own error says more than "it ended early".
        if let Some(failure) = failure {
            return Err(failure);
        }
        drained?;
        let total = |pick: fn(&ConsumerMetrics) -> u64| {
            stats
                .iter()
                .map(|stats| i64::try_from(pick(stats)).unwrap_or(i64::MAX))
                .sum::<i64>()
        };
        let expected_reserved: i64 = self.workload.orders.iter().map(|o| o.quantity).sum();
        let actual_reserved = stock.total_reserved().await?;
        let delivered: i64 = stats
            .iter()
            .map(|stats| i64::try_from(stats.deliveries()).unwrap_or(i64::MAX))
            .sum();
        let (seen, unplanned) = self.seen(&script);
        let (copies_at_once, copies_on_two_instances) = self.copies_at_once(&script);
        let mut row = StrategyRow {
            strategy: strategy.strategy_name(),
            delivered,
            processed: total(ConsumerMetrics::acked),
            duplicates: total(ConsumerMetrics::duplicates),
            ack_withheld: total(ConsumerMetrics::left_for_redelivery),
            dead_lettered: total(ConsumerMetrics::dead_lettered),
            retried: total(ConsumerMetrics::retried),
            expected_reserved,
            actual_reserved,
            difference: actual_reserved - expected_reserved,
            orders_reserved_more_than_once: i64::try_from(
                stock.orders_reserved_more_than_once().await?,
            )?,
            unplanned_deliveries: unplanned,
            copies_at_once,
            copies_on_two_instances,
            seconds,
            messages_per_second: delivered as f64 / seconds.max(f64::EPSILON),
            prediction: predict(strategy, &seen),
            deviations: Vec::new(),
        };
        row.check();
        Ok(row)
    }

    /// Waits until the consumer has nothing pending or unacked and every withheld ack came back
    /// as a redelivery; fails if a loop ends or nothing moves for a long while.
    async fn wait_until_drained(&self, script: &Script, instances: &[Instance]) -> Result<()> {
        let stall_limit = (self.settings.ack_wait * 5).max(Duration::from_secs(30));
        let mut last = (usize::MAX, u64::MAX, usize::MAX);
        let mut last_change = Instant::now();
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if instances
                .iter()
                .any(|instance| instance.running.is_finished())
            {
                bail!("a consumer loop ended before the stream was drained");
            }
            let state = instances[0].running.consumer_state().await?;
            if state.pending == 0 && state.ack_pending == 0 && script.crashes_redelivered() {
                return Ok(());
            }
            let now = (script.handlings(), state.pending, state.ack_pending);
            if now != last {
                last = now;
                last_change = Instant::now();
            } else if last_change.elapsed() > stall_limit {
                bail!(
                    "nothing moved for {stall_limit:?}: {} pending, {} unacked, {} handled",
                    state.pending,
                    state.ack_pending,
                    now.0
                );
            }
        }
    }

    /// Each order as the handlers saw it, and the deliveries beyond the plan.
    fn seen(&self, script: &Script) -> (Vec<Seen>, i64) {
        let handled = locked(&script.handled);
        let calls = |key: &str| handled.get(key).map_or(0, |list| list.len() as i64);
        let mut unplanned_total = 0;
        let seen = self
            .workload
            .orders
            .iter()
            .enumerate()
            .map(|(index, order)| {
                let copies = 1
                    + i64::from(order.fault == Fault::TwoCopies)
                    + i64::from(self.published.same_id_stored.contains(&index));
                let redelivered = i64::from(order.fault == Fault::Redelivered);
                let resent = i64::from(order.fault == Fault::NewIdResend);
                let mut unplanned = (calls(&order.key()) - copies - redelivered).max(0);
                if let Ok(resend) = order.resend()
                    && resent == 1
                {
                    unplanned += (calls(&resend.key.storage_key()) - 1).max(0);
                }
                unplanned_total += unplanned;
                Seen {
                    quantity: order.quantity,
                    copies,
                    redelivered,
                    resent,
                    unplanned,
                }
            })
            .collect();
        (seen, unplanned_total)
    }

    /// Of the orders stored as two copies: how many pairs were handled at the same time, and
    /// how many of those by two instances.
    fn copies_at_once(&self, script: &Script) -> (i64, i64) {
        let handled = locked(&script.handled);
        let mut at_once = 0;
        let mut two_instances = 0;
        for order in &self.workload.orders {
            if order.fault != Fault::TwoCopies {
                continue;
            }
            let Some([first, second, ..]) = handled.get(&order.key()).map(Vec::as_slice) else {
                continue;
            };
            if first.start < second.end && second.start < first.end {
                at_once += 1;
                two_instances += i64::from(first.instance != second.instance);
            }
        }
        (at_once, two_instances)
    }
}

/// Runs the comparison: publishes the workload, consumes it with every strategy, and removes
/// the streams and databases it made.
pub async fn run(settings: &Settings) -> Result<CompareReport> {
    if let Some(problem) = settings.problem() {
        bail!(problem);
    }
    let backend = settings
        .backend()
        .context("--database-url is postgres://… or sqlite://…")?;
    let workload = Workload::generate(settings)?;
    let client = jetstream::connect(&settings.nats_url, "inventory compare").await?;
    let js = jetstream::context(client.clone());
    let suffix = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    let topology = Topology {
        stream: format!("COMPARE_{}", suffix.to_uppercase()),
        subject_prefix: format!("compare_{suffix}.orders"),
        dlq_stream: format!("COMPARE_{}_DLQ", suffix.to_uppercase()),
        dlq_subject_prefix: format!("compare_{suffix}.dlq"),
        // No relay runs in the comparison; named all the same, so nothing shared is touched.
        events_stream: format!("COMPARE_{}_EVENTS", suffix.to_uppercase()),
        events_subject_prefix: format!("compare_{suffix}.inventory"),
        // Far longer than publishing takes: every same-id resend falls inside it.
        duplicate_window: Duration::from_secs(120),
        replicas: 1,
    };
    let result = run_on_streams(settings, backend, workload, &js, &topology).await;
    for name in [&topology.stream, &topology.dlq_stream] {
        if let Err(error) = js.delete_stream(name).await {
            tracing::warn!(%error, stream = %name, "could not delete the comparison's stream");
        }
    }
    client.flush().await?;
    result
}

async fn run_on_streams(
    settings: &Settings,
    backend: Backend,
    workload: Workload,
    js: &Context,
    topology: &Topology,
) -> Result<CompareReport> {
    jetstream::ensure_streams(js, topology)
        .await
        .context("creating the comparison's streams")?;
    let publisher = OrderPublisher::new(js.clone(), topology.clone());
    let published = publish_workload(&publisher, topology, &workload).await?;
    let run = Run {
        settings: settings.clone(),
        backend,
        js: js.clone(),
        topology: topology.clone(),
        workload,
        published,
    };
    let mut strategies = Vec::new();
    for strategy in STRATEGIES {
        let row = run
            .consume(strategy)
            .await
            .with_context(|| format!("running {}", strategy.strategy_name()))?;
        strategies.push(row);
    }
    let as_predicted = strategies
        .iter()
        .filter(|row| {
            row.strategy == HandlerKind::NaturalKey(NaturalKeyPath::Orm).strategy_name()
                || row.strategy == HandlerKind::Inbox(DetectMode::OnConflict).strategy_name()
        })
        .all(StrategyRow::as_predicted);
    let w = &run.workload;
    Ok(CompareReport {
        workload: WorkloadSummary {
            orders: settings.orders,
            books: settings.books,
            seed: settings.seed,
            rates: settings.rates,
            backend,
            instances_per_strategy: backend.instances(),
            concurrency_per_instance: settings.concurrency,
            ack_wait_ms: u64::try_from(settings.ack_wait.as_millis()).unwrap_or(u64::MAX),
            copies_ordered: w.orders.iter().map(|order| order.quantity).sum(),
            resent_with_new_id: w.count(Fault::NewIdResend),
            resent_with_same_id: w.orders.iter().filter(|o| o.same_id_resend).count() as u64,
            redelivered: w.count(Fault::Redelivered),
            two_copies: w.count(Fault::TwoCopies),
            published: run.published.clone(),
        },
        strategies,
        as_predicted,
    })
}

/// `inventory compare`: runs, prints the table (or JSON), and says whether the inbox and the
/// natural key came out as predicted.
pub async fn start(args: CompareArgs) -> Result<bool> {
    let settings = args.settings();
    if let Some(problem) = settings.problem() {
        clap::Error::raw(
            clap::error::ErrorKind::ValueValidation,
            format!("{problem}\n"),
        )
        .exit();
    }
    let report = run(&settings).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.render());
    }
    if !report.as_predicted {
        eprintln!("error: the inbox or the natural key did not come out as the workload predicts");
    }
    Ok(report.as_predicted)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(seed: u64) -> Settings {
        Settings {
            orders: 100,
            books: 7,
            rates: Rates {
                producer_new_id: 0.1,
                producer_same_id: 0.2,
                redelivery: 0.05,
                concurrent_copies: 0.07,
            },
            seed,
            database_url: LOCAL_POSTGRES.into(),
            nats_url: "nats://127.0.0.1:4222".into(),
            ack_wait: Duration::from_secs(1),
            concurrency: 4,
        }
    }

    #[test]
    fn the_workload_follows_the_seed_and_the_rates() -> Result<()> {
        let one = Workload::generate(&settings(7))?;
        let again = Workload::generate(&settings(7))?;
        let other = Workload::generate(&settings(8))?;
        assert_eq!(
            one.orders.iter().map(|o| &o.message).collect::<Vec<_>>(),
            again.orders.iter().map(|o| &o.message).collect::<Vec<_>>()
        );
        assert_ne!(one.books, other.books);
        assert_eq!(one.count(Fault::NewIdResend), 10);
        assert_eq!(one.count(Fault::Redelivered), 5);
        assert_eq!(one.count(Fault::TwoCopies), 7);
        assert_eq!(one.orders.iter().filter(|o| o.same_id_resend).count(), 20);
        assert!(one.orders.iter().all(|o| (1..=3).contains(&o.quantity)));
        Ok(())
    }

    #[test]
    fn rates_that_overlap_are_a_usage_error() {
        let mut wrong = settings(1);
        wrong.rates.redelivery = 0.6;
        wrong.rates.concurrent_copies = 0.6;
        assert!(wrong.problem().is_some());
        assert!(settings(1).problem().is_none());
        wrong = settings(1);
        wrong.database_url = "mysql://db".into();
        assert!(wrong.problem().is_some());
    }

    #[test]
    fn predictions_per_kind_of_duplicate() {
        let order = |copies, redelivered, resent| Seen {
            quantity: 2,
            copies,
            redelivered,
            resent,
            unplanned: 0,
        };
        // Clean, resent under a new id, redelivered, two copies.
        let seen = [
            order(1, 0, 0),
            order(1, 0, 1),
            order(1, 1, 0),
            order(2, 0, 0),
        ];
        let naive = predict(Strategy::Naive, &seen);
        assert_eq!(naive.delivered, Range::exact(7));
        assert_eq!(naive.difference, Range::exact(6));
        assert_eq!(naive.orders_reserved_more_than_once, Range::exact(3));
        let ctp = predict(Strategy::CheckThenProcess, &seen);
        assert_eq!(ctp.difference, Range::between(4, 6));
        let inbox = predict(HandlerKind::Inbox(DetectMode::OnConflict).into(), &seen);
        assert_eq!(inbox.difference, Range::exact(2));
        assert_eq!(inbox.processed, Range::exact(4));
        assert_eq!(inbox.duplicates, Range::exact(2));
        let natural = predict(HandlerKind::NaturalKey(NaturalKeyPath::Orm).into(), &seen);
        assert_eq!(natural.difference, Range::exact(0));
        assert_eq!(natural.processed, Range::exact(3));
        assert_eq!(natural.duplicates, Range::exact(3));
        assert_eq!(natural.ack_withheld, Range::exact(1));
    }

    #[test]
    fn a_figure_outside_its_prediction_is_a_deviation() {
        let seen = [Seen {
            quantity: 3,
            copies: 1,
            redelivered: 0,
            resent: 1,
            unplanned: 0,
        }];
        let mut row = StrategyRow {
            strategy: "inbox",
            delivered: 2,
            processed: 2,
            duplicates: 0,
            ack_withheld: 0,
            dead_lettered: 0,
            retried: 0,
            expected_reserved: 3,
            actual_reserved: 6,
            difference: 3,
            orders_reserved_more_than_once: 1,
            unplanned_deliveries: 0,
            copies_at_once: 0,
            copies_on_two_instances: 0,
            seconds: 1.0,
            messages_per_second: 2.0,
            prediction: predict(HandlerKind::Inbox(DetectMode::OnConflict).into(), &seen),
            deviations: Vec::new(),
        };
        row.check();
        assert!(row.as_predicted(), "{:?}", row.deviations);
        row.actual_reserved = 9;
        row.difference = 6;
        row.check();
        assert_eq!(row.deviations, ["difference: 6 (predicted 3)"]);
    }
}
