//! One reservation rule, written several times: the sea-orm reference handler, which decides with
//! `StockItem::decide_reservation`; on PostgreSQL the one-statement SQL and the batch statement;
//! on SQLite the writer's statements, a message or a batch per transaction. Random sequences
//! of messages run through each, on a database of its own, and through a pure model that
//! decides with the domain's functions: every outcome and every row must come out the same,
//! the outbox's events included (one per decision, none for a copy or a resend).
//!
//! `DIFFERENTIAL_SEED=n` replays one sequence; `DIFFERENTIAL_SEQUENCES=n` runs more of them.

use std::collections::{BTreeMap, HashSet};
use std::fmt;

use futures::future::{join_all, try_join_all};
use inventory_benches::consumers::{Handler, HandlerKind, NaturalKeyPath};
use inventory_domain::stock::second_request_for_reservation;
use inventory_domain::{
    BookId, DeadLetterReason, DedupKey, Effect, Event, Message, MessageId, OrderCancelled, OrderId,
    OrderPlaced, Outcome, Quantity, ReservationDecision, ReservationStatus, StockItem,
};
use inventory_infra::db::DatabaseConnection;
use inventory_infra::{HandleError, MessageHandler, StockRepository};
use inventory_tests::{Backend, TestDb};
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use sea_orm::{ConnectionTrait, DbBackend, Statement};
use uuid::Uuid;

const SEQUENCES: u64 = 60;
const BATCH_SIZES: [usize; 3] = [1, 3, 16];
/// Sequences run at once.
const LANES: usize = 4;
/// Books in stock at the start; one more is not, until a restock may put it.
const BOOKS: usize = 3;
const ORDERS: usize = 4;

/// What a step is, for the report and the replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Placement,
    PlacementOfUnknownBook,
    ExactCopy,
    NewMessageId,
    CancellationBeforePlacement,
    CancellationAfterPlacement,
    LineCancellationBeforePlacement,
    LineCancellationAfterPlacement,
    Restock,
}

#[derive(Debug, Clone)]
enum Step {
    Deliver(Message),
    Restock { book: BookId, on_hand: i64 },
}

struct Sequence {
    seed: u64,
    /// `books[BOOKS]` is the one not in stock at the start.
    books: Vec<BookId>,
    orders: Vec<OrderId>,
    on_hand: Vec<i64>,
    steps: Vec<(Kind, Step)>,
}

impl Sequence {
    /// Small stock and quantities, so that rejections happen; few orders and books, so that
    /// keys repeat (copies, resends, conflicting quantities, multi-book orders).
    fn generate(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        // Ids of one sequence share their first half, so its rows can be read back by range.
        let books: Vec<BookId> = (0..=BOOKS as u64)
            .map(|i| Uuid::from_u64_pair(seed, i).into())
            .collect();
        let orders: Vec<OrderId> = (0..ORDERS as u64)
            .map(|i| Uuid::from_u64_pair(seed, 100 + i).into())
            .collect();
        let on_hand = (0..BOOKS).map(|_| rng.random_range(0..=5)).collect();
        let mut sent: Vec<Message> = Vec::new();
        let mut placed = HashSet::new();
        let mut steps = Vec::new();
        let message_id =
            |n: usize| DedupKey::MessageId(MessageId::parse(format!("s{seed}-m{n}")).unwrap());
        for _ in 0..rng.random_range(6..=30) {
            let roll = rng.random_range(0..100);
            let step = if roll < 12 && !sent.is_empty() {
                let message = sent.choose(&mut rng).unwrap().clone();
                (Kind::ExactCopy, Step::Deliver(message))
            } else if roll < 24 && !sent.is_empty() {
                let message = Message {
                    key: message_id(sent.len()),
                    ..sent.choose(&mut rng).unwrap().clone()
                };
                sent.push(message.clone());
                (Kind::NewMessageId, Step::Deliver(message))
            } else if roll < 38 {
                let order_id = *orders.choose(&mut rng).unwrap();
                // Half of them cancel one line of the order, by its book: only that line.
                let book_id = rng
                    .random_bool(0.5)
                    .then(|| books[rng.random_range(0..BOOKS)]);
                let kind = match (book_id, placed.contains(&order_id)) {
                    (None, true) => Kind::CancellationAfterPlacement,
                    (None, false) => Kind::CancellationBeforePlacement,
                    (Some(_), true) => Kind::LineCancellationAfterPlacement,
                    (Some(_), false) => Kind::LineCancellationBeforePlacement,
                };
                let message = Message {
                    key: message_id(sent.len()),
                    correlation_id: None,
                    occurred_at: None,
                    event: Event::Cancelled(OrderCancelled { order_id, book_id }),
                };
                sent.push(message.clone());
                (kind, Step::Deliver(message))
            } else if roll < 48 {
                let book = if rng.random_ratio(1, 8) {
                    books[BOOKS]
                } else {
                    books[rng.random_range(0..BOOKS)]
                };
                let on_hand = rng.random_range(0..=6);
                (Kind::Restock, Step::Restock { book, on_hand })
            } else {
                let (kind, book_id) = if rng.random_ratio(1, 8) {
                    (Kind::PlacementOfUnknownBook, books[BOOKS])
                } else {
                    (Kind::Placement, books[rng.random_range(0..BOOKS)])
                };
                let order_id = *orders.choose(&mut rng).unwrap();
                placed.insert(order_id);
                let message = Message {
                    key: message_id(sent.len()),
                    correlation_id: None,
                    occurred_at: None,
                    event: Event::Placed(OrderPlaced {
                        order_id,
                        book_id,
                        quantity: Quantity::new(rng.random_range(1..=3)).unwrap(),
                    }),
                };
                sent.push(message.clone());
                (kind, Step::Deliver(message))
            };
            steps.push(step);
        }
        Self {
            seed,
            books,
            orders,
            on_hand,
            steps,
        }
    }

    fn stock(&self, book: BookId, on_hand: i64) -> StockItem {
        StockItem::new(book, "Dune", on_hand).unwrap()
    }

    fn initial_stock(&self) -> impl Iterator<Item = StockItem> + '_ {
        self.books
            .iter()
            .zip(&self.on_hand)
            .map(|(&book, &on_hand)| self.stock(book, on_hand))
    }

    fn deliveries(&self) -> impl Iterator<Item = &Message> {
        self.steps.iter().filter_map(|(_, step)| match step {
            Step::Deliver(message) => Some(message),
            Step::Restock { .. } => None,
        })
    }

    /// `b0`…, `o0`…: the sequence's ids as the replay prints them.
    fn labels(&self) -> Vec<(String, String)> {
        let books = self.books.iter().enumerate().map(|(i, book)| {
            let label = if i == BOOKS {
                format!("b{i}?")
            } else {
                format!("b{i}")
            };
            (book.to_string(), label)
        });
        let orders =
            (self.orders.iter().enumerate()).map(|(i, order)| (order.to_string(), format!("o{i}")));
        books.chain(orders).collect()
    }

    fn relabel(&self, text: &str) -> String {
        self.labels()
            .into_iter()
            .fold(text.to_owned(), |text, (id, label)| {
                text.replace(&id, &label)
            })
    }

    fn describe(&self, step: &Step) -> String {
        let text = match step {
            Step::Deliver(message) => match &message.event {
                Event::Placed(placed) => format!(
                    "{} place {} {} x{}",
                    message.key, placed.order_id, placed.book_id, placed.quantity
                ),
                Event::Cancelled(cancelled) => match cancelled.book_id {
                    None => format!("{} cancel {}", message.key, cancelled.order_id),
                    Some(book) => {
                        format!("{} cancel line {} {book}", message.key, cancelled.order_id)
                    }
                },
                Event::StockReserved(reserved) => {
                    format!("{} stock reserved {}", message.key, reserved.order_id)
                }
            },
            Step::Restock { book, on_hand } => format!("restock {book} to {on_hand}"),
        };
        self.relabel(&text)
    }
}

impl fmt::Display for Sequence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seed {}, stock:", self.seed)?;
        for (i, on_hand) in self.on_hand.iter().enumerate() {
            write!(f, " b{i} {on_hand},")?;
        }
        writeln!(f, " b{BOOKS}? none")?;
        for (n, (kind, step)) in self.steps.iter().enumerate() {
            writeln!(f, "  {n:>2}. {:<40} ({kind:?})", self.describe(step))?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
struct Reservation {
    quantity: Quantity,
    status: ReservationStatus,
    message_id: String,
}

/// The rule as the domain states it, applied one message at a time to plain values.
#[derive(Default)]
struct Model {
    stock: BTreeMap<BookId, StockItem>,
    reservations: BTreeMap<(OrderId, BookId), Reservation>,
    /// An `order_states` row, written by a cancellation only: the cancelling message's key.
    cancelled: BTreeMap<OrderId, String>,
    /// A `line_cancellations` row, written by a line's first cancellation: its key.
    lines_cancelled: BTreeMap<(OrderId, BookId), String>,
    /// The outbox: one event per decision, as [`ROWS_SQL`] prints it.
    events: Vec<String>,
}

impl Model {
    fn restock(&mut self, item: StockItem) {
        self.stock
            .entry(item.book_id)
            .and_modify(|stock| stock.on_hand = item.on_hand)
            .or_insert(item);
    }

    fn deliver(&mut self, message: &Message) -> Outcome {
        let key = message.key.storage_key().into_owned();
        match &message.event {
            Event::Placed(placed) => self.place(key, placed),
            Event::Cancelled(cancelled) => self.cancel(key, cancelled),
            // Inventory's own event is not a stock consumer's.
            Event::StockReserved(_) => Outcome::refused(DeadLetterReason::Invalid, ""),
        }
    }

    /// The reservation key first, then the book, then the order's cancellation, then stock.
    fn place(&mut self, key: String, placed: &OrderPlaced) -> Outcome {
        let reservation_key = (placed.order_id, placed.book_id);
        if let Some(existing) = self.reservations.get(&reservation_key) {
            return second_request_for_reservation(existing.quantity, placed.quantity);
        }
        let Some(stock) = self.stock.get_mut(&placed.book_id) else {
            return Outcome::refused(DeadLetterReason::UnknownBook, "");
        };
        let (status, effect) = if self.cancelled.contains_key(&placed.order_id)
            || self.lines_cancelled.contains_key(&reservation_key)
        {
            (
                ReservationStatus::Released,
                Effect::ArrivedAfterCancellation,
            )
        } else {
            let decision = stock.decide_reservation(placed.quantity);
            let subject = match decision {
                ReservationDecision::Reserve { reserved_after } => {
                    stock.reserved = reserved_after;
                    "reserved".to_owned()
                }
                ReservationDecision::Reject { available, .. } => {
                    format!("rejected available {available}")
                }
            };
            self.events.push(format!(
                "event {subject} {} {} {} caused by {key}",
                placed.order_id, placed.book_id, placed.quantity
            ));
            (decision.status(), decision.effect(placed.quantity))
        };
        self.reservations.insert(
            reservation_key,
            Reservation {
                quantity: placed.quantity,
                status,
                message_id: key,
            },
        );
        Outcome::Processed(effect)
    }

    /// Cancelled once; what the order holds goes back to stock. A line: cancelled once, and
    /// only what the line holds goes back.
    fn cancel(&mut self, key: String, cancelled: &OrderCancelled) -> Outcome {
        let order = cancelled.order_id;
        // Marked once, by the first cancellation's key: a later one changes nothing.
        let first = match cancelled.book_id {
            None => !self.cancelled.contains_key(&order),
            Some(book) => !self.lines_cancelled.contains_key(&(order, book)),
        };
        if !first {
            return Outcome::Duplicate;
        }
        match cancelled.book_id {
            None => self.cancelled.insert(order, key.clone()),
            Some(book) => self.lines_cancelled.insert((order, book), key.clone()),
        };
        let mut copies = 0;
        for ((_, book), reservation) in self.reservations.iter_mut().filter(|((o, b), r)| {
            *o == order
                && cancelled.book_id.is_none_or(|line| line == *b)
                && r.status == ReservationStatus::Reserved
        }) {
            reservation.status = ReservationStatus::Released;
            let quantity = i64::from(reservation.quantity.get());
            if let Some(stock) = self.stock.get_mut(book) {
                stock.reserved -= quantity;
            }
            copies += quantity;
            self.events.push(format!(
                "event released {order} {book} {quantity} caused by {key}"
            ));
        }
        Outcome::Processed(Effect::Released { copies })
    }

    /// The rows as [`ROWS_SQL`] prints them.
    fn rows(&self) -> Vec<String> {
        let stock = self.stock.values().map(|item| {
            format!(
                "stock {} on_hand {} reserved {}",
                item.book_id, item.on_hand, item.reserved
            )
        });
        let reservations = self.reservations.iter().map(|((order, book), r)| {
            format!(
                "reservation {order} {book} {} {} {}",
                r.quantity,
                r.status.as_str(),
                r.message_id
            )
        });
        let orders =
            (self.cancelled.iter()).map(|(order, key)| format!("order {order} cancelled by {key}"));
        let lines = (self.lines_cancelled.iter())
            .map(|((order, book), key)| format!("line {order} {book} cancelled by {key}"));
        stock
            .chain(reservations)
            .chain(orders)
            .chain(lines)
            .chain(self.events.iter().cloned())
            .collect()
    }
}

/// A sequence's rows (its ids lie between $1 and $2), one line each; created_at is left out.
/// The message ids are compared: handled in sequence, a key's first message writes its row on
/// every path, and the first cancellation its order's. An order's state row is compared once
/// it is cancelled: whether a placement leaves one behind is no part of the rule.
const ROWS_SQL: &str = "\
SELECT 'stock ' || book_id || ' on_hand ' || on_hand || ' reserved ' || reserved
FROM stock_items WHERE book_id BETWEEN $1 AND $2
UNION ALL
SELECT 'reservation ' || order_id || ' ' || book_id || ' ' || quantity || ' ' || status || ' '
       || message_id
FROM stock_reservations WHERE order_id BETWEEN $1 AND $2
UNION ALL
/* Every row: a placement writes none, so an open one is a difference. */
SELECT 'order ' || order_id || coalesce(' cancelled by ' || cancel_message_id, ' open')
FROM order_states WHERE order_id BETWEEN $1 AND $2
UNION ALL
SELECT 'line ' || order_id || ' ' || book_id || ' cancelled by ' || cancel_message_id
FROM line_cancellations WHERE order_id BETWEEN $1 AND $2
UNION ALL
SELECT 'event ' || substr(subject, length('stock.') + 1)
       || coalesce(' available ' || (payload::jsonb ->> 'available'), '') || ' '
       || (payload::jsonb ->> 'order_id') || ' ' || (payload::jsonb ->> 'book_id') || ' '
       || (payload::jsonb ->> 'quantity') || ' caused by ' || (payload::jsonb ->> 'caused_by')
       /* The columns the relay reads beside the body must agree with it. */
       || CASE WHEN event_id::text = payload::jsonb ->> 'event_id'
                    AND order_id::text = payload::jsonb ->> 'order_id'
                    AND relay_partition = get_byte(uuid_send(order_id), 15) % 16
                    AND subject LIKE 'stock.%'
               THEN '' ELSE ' (columns disagree with the body)' END
FROM outbox WHERE order_id BETWEEN $1 AND $2";

/// [`ROWS_SQL`] on SQLite, where a uuid is 16 bytes (printed here as PostgreSQL prints it) and
/// the body is read with `json_extract`.
fn sqlite_rows_sql() -> String {
    let uuid = |column: &str| {
        let hex = format!("lower(hex({column}))");
        format!(
            "(substr({hex}, 1, 8) || '-' || substr({hex}, 9, 4) || '-' || substr({hex}, 13, 4) \
             || '-' || substr({hex}, 17, 4) || '-' || substr({hex}, 21))"
        )
    };
    let (order, book, event) = (uuid("order_id"), uuid("book_id"), uuid("event_id"));
    format!(
        "SELECT 'stock ' || {book} || ' on_hand ' || on_hand || ' reserved ' || reserved
         FROM stock_items WHERE book_id BETWEEN $1 AND $2
         UNION ALL
         SELECT 'reservation ' || {order} || ' ' || {book} || ' ' || quantity || ' ' || status
                || ' ' || message_id
         FROM stock_reservations WHERE order_id BETWEEN $1 AND $2
         UNION ALL
         SELECT 'order ' || {order} || coalesce(' cancelled by ' || cancel_message_id, ' open')
         FROM order_states WHERE order_id BETWEEN $1 AND $2
         UNION ALL
         SELECT 'line ' || {order} || ' ' || {book} || ' cancelled by ' || cancel_message_id
         FROM line_cancellations WHERE order_id BETWEEN $1 AND $2
         UNION ALL
         SELECT 'event ' || substr(subject, length('stock.') + 1)
                || coalesce(' available ' || json_extract(payload, '$.available'), '') || ' '
                || json_extract(payload, '$.order_id') || ' '
                || json_extract(payload, '$.book_id') || ' '
                || json_extract(payload, '$.quantity') || ' caused by '
                || json_extract(payload, '$.caused_by')
                || CASE WHEN {event} = json_extract(payload, '$.event_id')
                             AND {order} = json_extract(payload, '$.order_id')
                             AND relay_partition
                                 = instr('0123456789abcdef', substr(lower(hex(order_id)), 32, 1)) - 1
                             AND subject LIKE 'stock.%'
                        THEN '' ELSE ' (columns disagree with the body)' END
         FROM outbox WHERE order_id BETWEEN $1 AND $2"
    )
}

/// Refusals compared by reason: their detail is prose.
fn comparable(outcome: Outcome) -> Outcome {
    match outcome {
        Outcome::Refused(refusal) => Outcome::refused(refusal.reason, ""),
        other => other,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant {
    Reference,
    OneStatement,
    Batch(usize),
}

/// One implementation on a database of its own. A clone is another lane: on PostgreSQL the
/// statements get a connection of their own, on SQLite the clones share the one writer.
#[derive(Clone)]
struct Implementation {
    variant: Variant,
    stock: StockRepository,
    conn: DatabaseConnection,
    reference: Handler,
    statements: Handler,
}

impl Implementation {
    fn new(variant: Variant, db: &TestDb) -> Self {
        let reference = db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm));
        Self {
            variant,
            stock: db.stock.clone(),
            conn: db.conn.clone(),
            statements: db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Batch)),
            reference,
        }
    }

    fn batch_size(&self) -> usize {
        match self.variant {
            Variant::Batch(size) => size,
            Variant::Reference | Variant::OneStatement => 1,
        }
    }

    async fn deliver(&self, messages: &[Message]) -> Vec<Result<Outcome, HandleError>> {
        if messages.is_empty() {
            return Vec::new();
        }
        match self.variant {
            Variant::Reference => MessageHandler::handle_batch(&self.reference, messages).await,
            Variant::OneStatement => {
                let mut outcomes = Vec::new();
                for message in messages {
                    outcomes.push(self.statements.handle(message).await);
                }
                outcomes
            }
            Variant::Batch(_) => self.statements.handle_batch(messages).await,
        }
    }

    /// The sequence's outcomes, one per delivery, and then its rows.
    async fn run(&self, sequence: &Sequence) -> Result<(Vec<Outcome>, Vec<String>), String> {
        for item in sequence.initial_stock() {
            self.stock.put(&item).await.map_err(|e| e.to_string())?;
        }
        let mut outcomes = Vec::new();
        let mut batch: Vec<Message> = Vec::new();
        for (_, step) in &sequence.steps {
            match step {
                Step::Deliver(message) => batch.push(message.clone()),
                Step::Restock { book, on_hand } => {
                    // A batch holds only messages already there: a restock ends it.
                    outcomes.extend(self.deliver(&batch).await);
                    batch.clear();
                    let item = sequence.stock(*book, *on_hand);
                    self.stock.put(&item).await.map_err(|e| e.to_string())?;
                }
            }
            if batch.len() == self.batch_size() {
                outcomes.extend(self.deliver(&batch).await);
                batch.clear();
            }
        }
        outcomes.extend(self.deliver(&batch).await);
        let outcomes = outcomes
            .into_iter()
            .map(|result| result.map(comparable).map_err(|e| e.to_string()))
            .collect::<Result<_, _>>()?;
        let (first, last) = sequence.seed_range();
        let backend = self.conn.get_database_backend();
        let sql = match backend {
            DbBackend::Sqlite => sqlite_rows_sql(),
            _ => ROWS_SQL.to_owned(),
        };
        let rows = self
            .conn
            .query_all_raw(Statement::from_sql_and_values(
                backend,
                sql,
                [first.into(), last.into()],
            ))
            .await
            .map_err(|e| e.to_string())?
            .iter()
            .map(|row| row.try_get_by_index::<String>(0))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        Ok((outcomes, rows))
    }
}

impl Sequence {
    fn seed_range(&self) -> (Uuid, Uuid) {
        (
            Uuid::from_u64_pair(self.seed, 0),
            Uuid::from_u64_pair(self.seed, u64::MAX),
        )
    }

    /// What the model says: one outcome per delivery, and the rows.
    fn expected(&self) -> (Vec<Outcome>, Vec<String>) {
        let mut model = Model::default();
        for item in self.initial_stock() {
            model.restock(item);
        }
        let mut outcomes = Vec::new();
        for (_, step) in &self.steps {
            match step {
                Step::Deliver(message) => outcomes.push(comparable(model.deliver(message))),
                Step::Restock { book, on_hand } => model.restock(self.stock(*book, *on_hand)),
            }
        }
        (outcomes, model.rows())
    }

    /// The differences between what `variant` did and what the model says, relabelled.
    fn differences(
        &self,
        variant: Variant,
        (expected_outcomes, expected_rows): &(Vec<Outcome>, Vec<String>),
        (outcomes, rows): (Vec<Outcome>, Vec<String>),
    ) -> Option<String> {
        let mut report = String::new();
        let deliveries = self
            .deliveries()
            .zip(expected_outcomes.iter().zip(&outcomes));
        for (n, (message, (expected, got))) in deliveries.enumerate() {
            if expected != got {
                let step = self.describe(&Step::Deliver(message.clone()));
                report += &format!(
                    "  delivery {n} ({step}): the model says {expected:?}, {variant:?} {got:?}\n"
                );
            }
        }
        let sorted = |rows: Vec<String>| {
            let mut rows: Vec<String> = rows.iter().map(|row| self.relabel(row)).collect();
            rows.sort();
            rows
        };
        let (expected_rows, rows) = (sorted(expected_rows.clone()), sorted(rows));
        if expected_rows != rows {
            report += &format!(
                "  rows, the model's:\n    {}\n  rows, {variant:?}'s:\n    {}\n",
                expected_rows.join("\n    "),
                rows.join("\n    ")
            );
        }
        (!report.is_empty()).then(|| format!("{variant:?} disagrees with the model:\n{report}"))
    }
}

fn seeds() -> Vec<u64> {
    let number = |name: &str| std::env::var(name).ok().map(|value| value.parse().unwrap());
    match number("DIFFERENTIAL_SEED") {
        Some(seed) => vec![seed],
        None => (0..number("DIFFERENTIAL_SEQUENCES").unwrap_or(SEQUENCES)).collect(),
    }
}

/// The report's name for an outcome.
fn name(outcome: &Outcome) -> &'static str {
    match outcome {
        Outcome::Processed(Effect::Reserved { .. }) => "reserved",
        Outcome::Processed(Effect::Released { .. }) => "released",
        Outcome::Processed(Effect::ArrivedAfterCancellation) => "arrived after cancellation",
        other => other.label(),
    }
}

/// Runs `seed`'s sequence through every implementation: `Err` says what disagreed.
async fn check(implementations: &[Implementation], seed: u64) -> Result<(), String> {
    let sequence = Sequence::generate(seed);
    let replay = |report: String| format!("{report}replay: DIFFERENTIAL_SEED={seed}\n{sequence}");
    let results = try_join_all(implementations.iter().map(|i| i.run(&sequence)))
        .await
        .map_err(|error| replay(format!("{error}\n")))?;
    let expected = sequence.expected();
    let differences: String = (implementations.iter().zip(results))
        .filter_map(|(i, result)| sequence.differences(i.variant, &expected, result))
        .collect();
    if differences.is_empty() {
        Ok(())
    } else {
        Err(replay(differences))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_implementation_of_the_reservation_rule_agrees_with_the_domain() {
    differential(Backend::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_implementation_of_the_reservation_rule_on_sqlite_agrees_with_the_domain() {
    differential(Backend::Sqlite).await;
}

/// Every variant on `backend`, each on a database of its own, against the model.
async fn differential(backend: Backend) {
    let variants: Vec<Variant> = [Variant::Reference, Variant::OneStatement]
        .into_iter()
        .chain(BATCH_SIZES.map(Variant::Batch))
        .collect();
    let databases = join_all(
        variants
            .iter()
            .map(|_| TestDb::labelled(backend, "inventory_differential")),
    )
    .await;
    let implementations: Vec<Implementation> = (variants.iter().zip(&databases))
        .map(|(&variant, db)| Implementation::new(variant, db))
        .collect();
    let seeds = seeds();
    // Sequences touch ids of their own, so several can run at once.
    let lanes = (0..LANES).map(|lane| {
        let implementations = implementations.clone();
        let seeds = seeds.iter().skip(lane).step_by(LANES).copied();
        async move {
            for seed in seeds {
                check(&implementations, seed).await?;
            }
            Ok::<_, String>(())
        }
    });
    if let Err(report) = try_join_all(lanes).await {
        panic!("{report}");
    }

    let mut kinds: BTreeMap<Kind, usize> = BTreeMap::new();
    let mut outcomes: BTreeMap<&str, usize> = BTreeMap::new();
    for &seed in &seeds {
        let sequence = Sequence::generate(seed);
        for (kind, _) in &sequence.steps {
            *kinds.entry(*kind).or_default() += 1;
        }
        for outcome in &sequence.expected().0 {
            *outcomes.entry(name(outcome)).or_default() += 1;
        }
    }
    println!(
        "{backend:?}: {} sequences, {} steps: {kinds:?}; the model's outcomes: {outcomes:?}; \
         each through the reference handler, the fast path and batches of {BATCH_SIZES:?}",
        seeds.len(),
        kinds.values().sum::<usize>()
    );
}
