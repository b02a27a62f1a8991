//! Workloads for the fault scenarios and the checks of the promise after them.
//!
//! A [`Workload`] is a run of distinct orders with the producer's faults mixed in: some resent
//! under a new message id (the natural key's catch), some resent with the same id. [`settle`]
//! waits until the consumer has nothing left, and [`check`] computes the [`Report`] whose
//! [`Report::assert_holds`] is the promise: every order exactly one reservation row with its
//! quantity, `reserved` the sum of the distinct orders' quantities, and every stream message
//! accounted for.

use inventory_benches::produce::Produce as _;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::context::Context;
use async_nats::jetstream::message::PublishMessage;
use futures::StreamExt;
use inventory_benches::publish::OrderPublisher;
use inventory_benches::workload::SplitMix64;
use inventory_domain::{BookId, Event, EventKind, Message, OrderId, StockEvent, StockEventKind};
use inventory_infra::db::DatabaseConnection;
use inventory_infra::jetstream::{DeadLetterStream, Topology};
use sea_orm::{ConnectionTrait, DbBackend, Statement};

use crate::placed;

/// How one message of a workload is published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendKind {
    /// The order's first message.
    Original,
    /// The same order under a new message id: a producer that retried without keeping its id.
    NewId,
    /// The same message, same id, published without `Nats-Msg-Id` so the stream keeps it, as
    /// a resend arriving after the duplicate window would be: the consumer must catch it.
    SameId,
}

#[derive(Debug, Clone)]
pub struct Send {
    pub message: Message,
    pub kind: SendKind,
}

/// Distinct orders spread over some books, plus the producer's duplicates, in publishing
/// order.
#[derive(Debug, Clone)]
pub struct Workload {
    pub books: Vec<BookId>,
    /// Each distinct order's book and quantity.
    pub orders: HashMap<OrderId, (BookId, i64)>,
    pub sends: Vec<Send>,
}

impl Workload {
    /// `orders` OrderPlaced, round robin over `books` (quantities 1 to 4); exactly `new_ids`
    /// of the orders are resent under a new message id and `same_ids` with the same id, each
    /// resend 1 to 50 messages after its original. The same seed gives the same choices.
    pub fn new(
        books: &[BookId],
        orders: usize,
        new_ids: usize,
        same_ids: usize,
        seed: u64,
    ) -> Self {
        assert!(new_ids + same_ids <= orders, "more resends than orders");
        let mut random = SplitMix64::new(seed);
        let mut indices: Vec<usize> = (0..orders).collect();
        random.shuffle(&mut indices);
        let mut resend = vec![None; orders];
        for &i in &indices[..new_ids] {
            resend[i] = Some(SendKind::NewId);
        }
        for &i in &indices[new_ids..new_ids + same_ids] {
            resend[i] = Some(SendKind::SameId);
        }

        let mut sends = Vec::with_capacity(orders + new_ids + same_ids);
        let mut due: Vec<(usize, Send)> = Vec::new();
        let mut quantities = HashMap::with_capacity(orders);
        for (i, kind) in resend.into_iter().enumerate() {
            let quantity = 1 + (i % 4) as i64;
            let book = books[i % books.len()];
            let message = placed(book, quantity);
            quantities.insert(message.event.order_id(), (book, quantity));
            if let Some(kind) = kind {
                let copy = match kind {
                    SendKind::NewId => message.resent_with_new_id(),
                    _ => message.clone(),
                };
                due.push((
                    i + 1 + usize::try_from(random.below(50)).unwrap_or(0),
                    Send {
                        message: copy,
                        kind,
                    },
                ));
            }
            sends.push(Send {
                message,
                kind: SendKind::Original,
            });
            let (ready, later): (Vec<_>, Vec<_>) = due.into_iter().partition(|(at, _)| *at <= i);
            sends.extend(ready.into_iter().map(|(_, send)| send));
            due = later;
        }
        sends.extend(due.into_iter().map(|(_, send)| send));
        Self {
            books: books.to_vec(),
            orders: quantities,
            sends,
        }
    }

    /// Copies each book must have reserved: the sum of its distinct orders' quantities.
    pub fn expected_reserved(&self) -> HashMap<BookId, i64> {
        let mut reserved: HashMap<BookId, i64> = self.books.iter().map(|&book| (book, 0)).collect();
        for &(book, quantity) in self.orders.values() {
            *reserved.entry(book).or_default() += quantity;
        }
        reserved
    }

    /// The part of the workload on `books`, e.g. a shard's: their orders and messages.
    pub fn on_books(&self, books: &[BookId]) -> Self {
        let orders: HashMap<OrderId, (BookId, i64)> = self
            .orders
            .iter()
            .filter(|(_, (book, _))| books.contains(book))
            .map(|(&order, &line)| (order, line))
            .collect();
        let sends = self
            .sends
            .iter()
            .filter(|send| orders.contains_key(&send.message.event.order_id()))
            .cloned()
            .collect();
        Self {
            books: books.to_vec(),
            orders,
            sends,
        }
    }

    pub fn count(&self, kind: SendKind) -> usize {
        self.sends.iter().filter(|send| send.kind == kind).count()
    }
}

/// Publishes every send, `in_flight` at a time, pausing `pause` after each `chunk` messages
/// so a run lasts long enough for faults to land mid-stream. A publish that fails (the broker
/// restarting) is retried with the same message id until it is stored, for up to two minutes.
pub async fn publish(
    js: &Context,
    topology: &Topology,
    sends: &[Send],
    in_flight: usize,
    chunk: usize,
    pause: Duration,
) {
    let publisher = OrderPublisher::new(js.clone(), topology.clone());
    for part in sends.chunks(chunk.max(1)) {
        // Owned per publish: a future borrowing across `buffer_unordered` is not `Send` enough
        // for `tokio::spawn`.
        futures::stream::iter(part.to_vec())
            .map(|send| {
                let (js, publisher, topology) = (js.clone(), publisher.clone(), topology.clone());
                async move { publish_one(&js, &publisher, &topology, &send).await }
            })
            .buffer_unordered(in_flight.max(1))
            .collect::<Vec<()>>()
            .await;
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
    }
}

/// The sends as the email notifier receives them: each OrderPlaced as Inventory's StockReserved
/// for it, the event id its message id, so a same-id resend is the same event again.
pub fn as_reserved_events(sends: &[Send]) -> Vec<Send> {
    sends
        .iter()
        .map(|send| Send {
            message: Message::stock_reserved(&reserved_event(&send.message)),
            kind: send.kind,
        })
        .collect()
}

/// The StockReserved of a placement message, or the event a StockReserved message carries.
pub fn reserved_event(message: &Message) -> StockEvent {
    let (order_id, book_id, quantity) = match &message.event {
        Event::Placed(placed) => (placed.order_id, placed.book_id, placed.quantity),
        Event::StockReserved(reserved) => (reserved.order_id, reserved.book_id, reserved.quantity),
        Event::Cancelled(_) => panic!("a cancellation reserves nothing"),
    };
    StockEvent {
        event_id: message
            .key
            .storage_key()
            .parse()
            .expect("a UUID message id"),
        kind: StockEventKind::Reserved,
        order_id,
        book_id,
        quantity,
        occurred_at: chrono::Utc::now(),
        caused_by: "a placement".into(),
    }
}

async fn publish_one(js: &Context, publisher: &OrderPublisher, topology: &Topology, send: &Send) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let result = match (send.kind, &send.message.event) {
            (SendKind::Original | SendKind::NewId, Event::StockReserved(_)) => publisher
                .publish_event(&reserved_event(&send.message))
                .await
                .map(drop)
                .map_err(|error| error.to_string()),
            (SendKind::SameId, Event::StockReserved(_)) => {
                let event = reserved_event(&send.message);
                let subject = format!(
                    "{}.{}",
                    topology.events_subject_prefix,
                    event.subject_token()
                );
                match js
                    .send_publish(
                        subject,
                        PublishMessage::build().payload(event.body().into()),
                    )
                    .await
                {
                    Ok(ack) => ack.await.map(drop).map_err(|error| error.to_string()),
                    Err(error) => Err(error.to_string()),
                }
            }
            _ => match send.kind {
                SendKind::Original | SendKind::NewId => publisher
                    .publish(&send.message)
                    .await
                    .map(drop)
                    .map_err(|error| error.to_string()),
                SendKind::SameId => {
                    let body = send.message.to_plain_json().expect("a plain JSON body");
                    let subject = topology.subject_of(&send.message.event);
                    match js
                        .send_publish(subject, PublishMessage::build().payload(body.into()))
                        .await
                    {
                        Ok(ack) => ack.await.map(drop).map_err(|error| error.to_string()),
                        Err(error) => Err(error.to_string()),
                    }
                }
            },
        };
        match result {
            Ok(()) => return,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(error) => panic!("publish never succeeded: {error}"),
        }
    }
}

/// Where the consumer and its streams stand.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamState {
    pub stream_messages: u64,
    pub stream_last_seq: u64,
    /// The highest stream sequence below which every message was acked or terminated.
    pub ack_floor: u64,
    pub pending: u64,
    pub ack_pending: usize,
    pub redelivered: usize,
    pub dead_letters: u64,
}

impl StreamState {
    /// Every message acked or terminated and nothing waiting.
    pub fn settled(&self) -> bool {
        self.pending == 0 && self.ack_pending == 0 && self.ack_floor == self.stream_last_seq
    }
}

/// Reads the consumer's and streams' state; `None` while the broker cannot answer (a node or
/// the server restarting).
pub async fn stream_state(
    js: &Context,
    topology: &Topology,
    consumer: &str,
) -> Option<StreamState> {
    let state = consumers_state(js, topology, &[consumer.to_owned()]).await?;
    Some(state.combined(0..1))
}

/// One durable consumer's place in its stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConsumerState {
    /// The highest stream sequence below which every message it takes was acked or terminated.
    pub ack_floor: u64,
    pub pending: u64,
    pub ack_pending: usize,
    pub redelivered: usize,
}

/// The streams and some consumers of the orders stream read together, e.g. a sharded stream's
/// partition consumers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConsumersState {
    pub stream_messages: u64,
    /// Read before the consumers: none of them can have a message past it undelivered.
    pub stream_last_seq: u64,
    pub dead_letters: u64,
    pub consumers: Vec<ConsumerState>,
}

impl ConsumersState {
    /// The consumers `which` as one: their counts summed, and as ack floor the lowest of their
    /// floors. A consumer with nothing pending or unacked counts as acked up to the stream's
    /// last sequence: a filtered consumer's own floor stops at its last message.
    pub fn combined(&self, which: std::ops::Range<usize>) -> StreamState {
        let consumers = &self.consumers[which];
        let floor = |consumer: &ConsumerState| {
            if consumer.pending == 0 && consumer.ack_pending == 0 {
                consumer.ack_floor.max(self.stream_last_seq)
            } else {
                consumer.ack_floor
            }
        };
        StreamState {
            stream_messages: self.stream_messages,
            stream_last_seq: self.stream_last_seq,
            ack_floor: consumers.iter().map(floor).min().unwrap_or(0),
            pending: consumers.iter().map(|consumer| consumer.pending).sum(),
            ack_pending: consumers.iter().map(|consumer| consumer.ack_pending).sum(),
            redelivered: consumers.iter().map(|consumer| consumer.redelivered).sum(),
            dead_letters: self.dead_letters,
        }
    }
}

/// Reads the streams' state and that of each of `consumers`, in their order; `None` while the
/// broker cannot answer.
pub async fn consumers_state(
    js: &Context,
    topology: &Topology,
    consumers: &[String],
) -> Option<ConsumersState> {
    let read = async {
        let mut stream = js.get_stream(&topology.stream).await.ok()?;
        let stream_info = stream.info().await.ok()?.state.clone();
        let mut states = Vec::with_capacity(consumers.len());
        for name in consumers {
            let mut consumer: PullConsumer = stream.get_consumer(name).await.ok()?;
            let info = consumer.info().await.ok()?.clone();
            states.push(ConsumerState {
                ack_floor: info.ack_floor.stream_sequence,
                pending: info.num_pending,
                ack_pending: info.num_ack_pending,
                redelivered: info.num_redelivered,
            });
        }
        let mut dlq = js.get_stream(&topology.dlq_stream).await.ok()?;
        let dead_letters = dlq.info().await.ok()?.state.messages;
        Some(ConsumersState {
            stream_messages: stream_info.messages,
            stream_last_seq: stream_info.last_sequence,
            dead_letters,
            consumers: states,
        })
    };
    tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .ok()
        .flatten()
}

/// Waits until the consumer has settled with at least `min_messages` in the stream; panics
/// with the last state seen after `limit`.
pub async fn settle(
    js: &Context,
    topology: &Topology,
    consumer: &str,
    min_messages: u64,
    limit: Duration,
) -> StreamState {
    settle_all(js, topology, &[consumer.to_owned()], min_messages, limit).await
}

/// [`settle`] for `consumers` together (see [`ConsumersState::combined`]).
pub async fn settle_all(
    js: &Context,
    topology: &Topology,
    consumers: &[String],
    min_messages: u64,
    limit: Duration,
) -> StreamState {
    wait_for_consumers(js, topology, consumers, min_messages, limit, false).await
}

/// [`settle`], or until the consumer has nothing left to deliver (nothing pending, nothing
/// unacked) for five seconds although its ack floor lags: what the server will never deliver
/// again, which a check then finds lost.
pub async fn quiesce(
    js: &Context,
    topology: &Topology,
    consumer: &str,
    min_messages: u64,
    limit: Duration,
) -> StreamState {
    wait_for_consumers(
        js,
        topology,
        &[consumer.to_owned()],
        min_messages,
        limit,
        true,
    )
    .await
}

async fn wait_for_consumers(
    js: &Context,
    topology: &Topology,
    consumers: &[String],
    min_messages: u64,
    limit: Duration,
    or_quiet: bool,
) -> StreamState {
    let deadline = Instant::now() + limit;
    let mut quiet_since = None;
    let mut last = None;
    loop {
        let state = consumers_state(js, topology, consumers).await;
        if let Some(state) = state.map(|state| state.combined(0..consumers.len())) {
            if state.settled() && state.stream_last_seq >= min_messages {
                return state;
            }
            let quiet = or_quiet && state.pending == 0 && state.ack_pending == 0;
            let since = *quiet_since.get_or_insert_with(Instant::now);
            if !quiet {
                quiet_since = None;
            } else if since.elapsed() > Duration::from_secs(5) {
                return state;
            }
            last = Some(state);
        }
        assert!(
            Instant::now() < deadline,
            "the consumer did not settle within {limit:?}; last state: {last:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What a fault scenario left behind, against what the workload asked for.
#[derive(Debug, Clone)]
pub struct Report {
    pub orders: usize,
    /// Orders with exactly one `reserved` row of the right quantity.
    pub orders_exact: usize,
    pub orders_missing: usize,
    /// Rows whose quantity or status is not the order's.
    pub rows_wrong: usize,
    /// Rows for orders the workload never placed.
    pub rows_unknown: usize,
    /// Books whose `reserved` is not the sum of their distinct orders' quantities.
    pub books_wrong: Vec<String>,
    pub reserved: i64,
    pub expected_reserved: i64,
    pub stream: StreamState,
}

impl Report {
    pub fn summary(&self) -> String {
        format!(
            "{} orders, {} exactly once; reserved {} of {}; stream {} messages (last seq {}), \
             ack floor {}, pending {}, unacked {}, redelivered {}, dead letters {}",
            self.orders,
            self.orders_exact,
            self.reserved,
            self.expected_reserved,
            self.stream.stream_messages,
            self.stream.stream_last_seq,
            self.stream.ack_floor,
            self.stream.pending,
            self.stream.ack_pending,
            self.stream.redelivered,
            self.stream.dead_letters
        )
    }

    /// The promise: exactly one reservation per order, `reserved` their sum, and every message
    /// processed or skipped as a duplicate (acked: the ack floor is the stream's last
    /// sequence, nothing pending or unacked) with none dead-lettered.
    pub fn assert_holds(&self) {
        let summary = self.summary();
        assert_eq!(self.orders_exact, self.orders, "{summary}");
        assert_eq!(self.orders_missing, 0, "{summary}");
        assert_eq!(self.rows_wrong, 0, "{summary}");
        assert_eq!(self.rows_unknown, 0, "{summary}");
        assert_eq!(self.reserved, self.expected_reserved, "{summary}");
        assert!(
            self.books_wrong.is_empty(),
            "{:?}; {summary}",
            self.books_wrong
        );
        assert!(self.stream.settled(), "{summary}");
        assert_eq!(self.stream.dead_letters, 0, "{summary}");
    }
}

/// Where a strategy's reservations are read back from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ledger {
    /// The natural key's own rows, one per `(order_id, book_id)`.
    Reservations,
    /// `reservation_log`: one row per reservation made, written by the strategies without a
    /// natural key (the inbox), so an order reserved twice has two rows.
    Log,
}

/// [`check_ledger`] on the natural key's rows.
pub async fn check(db: &DatabaseConnection, workload: &Workload, stream: StreamState) -> Report {
    check_ledger(db, workload, stream, Ledger::Reservations).await
}

/// Compares the database (PostgreSQL, the scenario's own) and the consumer with what
/// `workload` asked for. Every row of `ledger` is looked at, so a row for an order the
/// workload never placed shows up too.
pub async fn check_ledger(
    db: &DatabaseConnection,
    workload: &Workload,
    stream: StreamState,
    ledger: Ledger,
) -> Report {
    let table = match ledger {
        Ledger::Reservations => "stock_reservations",
        Ledger::Log => "reservation_log",
    };
    let rows = db
        .query_all_raw(Statement::from_string(
            DbBackend::Postgres,
            format!(
                "SELECT order_id, book_id, count(*) AS n, min(quantity) AS quantity, \
                 bool_and(status = 'reserved') AS reserved \
                 FROM {table} GROUP BY order_id, book_id"
            ),
        ))
        .await
        .expect("the reservation rows");
    let expected = workload.expected_reserved();
    let mut report = Report {
        orders: workload.orders.len(),
        orders_exact: 0,
        orders_missing: 0,
        rows_wrong: 0,
        rows_unknown: 0,
        books_wrong: Vec::new(),
        reserved: 0,
        expected_reserved: expected.values().sum(),
        stream,
    };
    let mut seen = 0;
    for row in rows {
        let order: uuid::Uuid = row.try_get("", "order_id").expect("order_id");
        let book: uuid::Uuid = row.try_get("", "book_id").expect("book_id");
        let count: i64 = row.try_get("", "n").expect("count");
        let quantity: i32 = row.try_get("", "quantity").expect("quantity");
        let reserved: bool = row.try_get("", "reserved").expect("status");
        match workload.orders.get(&OrderId::from(order)) {
            Some(&(wanted_book, wanted)) if wanted_book.as_uuid() == book => {
                seen += 1;
                if count == 1 && i64::from(quantity) == wanted && reserved {
                    report.orders_exact += 1;
                } else {
                    report.rows_wrong += 1;
                }
            }
            _ => report.rows_unknown += 1,
        }
    }
    report.orders_missing = workload.orders.len() - seen;
    for (book, wanted) in expected {
        let row = db
            .query_one_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "SELECT reserved FROM stock_items WHERE book_id = $1",
                [book.as_uuid().into()],
            ))
            .await
            .expect("the stock row")
            .expect("the book");
        let reserved: i64 = row.try_get::<i32>("", "reserved").expect("reserved").into();
        report.reserved += reserved;
        if reserved != wanted {
            report
                .books_wrong
                .push(format!("{book}: reserved {reserved}, expected {wanted}"));
        }
    }
    report
}

/// The orders whose OrderPlaced stands in the dead-letter stream of `topology`.
pub async fn dead_lettered_orders(js: &Context, topology: &Topology) -> HashSet<OrderId> {
    let letters = DeadLetterStream::new(js.clone(), topology.clone())
        .read_all(chrono::Utc::now().timestamp())
        .await
        .expect("the dead letters");
    letters
        .iter()
        .filter_map(|letter| Message::decode(EventKind::Placed, &letter.body).ok())
        .map(|message| message.event.order_id())
        .collect()
}

/// The weaker promise when messages may have been dead-lettered: every order of `workload`
/// has exactly its one reservation, or none and its OrderPlaced stands in `dead_lettered`; no
/// wrong or unknown rows, every book's
/// `reserved` the sum of its reservations, and every stream message settled. Panics with a
/// summary otherwise; returns it.
pub async fn assert_reserved_once_or_dead_lettered(
    db: &DatabaseConnection,
    workload: &Workload,
    state: StreamState,
    dead_lettered: &HashSet<OrderId>,
) -> String {
    let report = check(db, workload, state).await;
    let rows = db
        .query_all_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT DISTINCT order_id FROM stock_reservations".to_owned(),
        ))
        .await
        .expect("the reservation rows");
    let with_row: HashSet<OrderId> = rows
        .iter()
        .map(|row| OrderId::from(row.try_get::<uuid::Uuid>("", "order_id").expect("order_id")))
        .collect();
    let lost: Vec<&OrderId> = workload
        .orders
        .keys()
        .filter(|order| !with_row.contains(*order) && !dead_lettered.contains(*order))
        .collect();
    let books_off = db
        .query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT count(*) AS n FROM stock_items s WHERE reserved <> \
               (SELECT COALESCE(SUM(quantity), 0) FROM stock_reservations r \
                WHERE r.book_id = s.book_id AND r.status = 'reserved')"
                .to_owned(),
        ))
        .await
        .expect("the stock rows")
        .expect("a count")
        .try_get::<i64>("", "n")
        .expect("n");
    let summary = format!(
        "{}; {} orders dead-lettered, {} neither reserved nor dead-lettered (e.g. {:?})",
        report.summary(),
        dead_lettered.len(),
        lost.len(),
        lost.first()
    );
    assert!(lost.is_empty(), "{summary}");
    assert_eq!(report.rows_wrong, 0, "{summary}");
    assert_eq!(report.rows_unknown, 0, "{summary}");
    assert_eq!(
        books_off, 0,
        "a book's reserved is not the sum of its reservations; {summary}"
    );
    assert!(report.stream.settled(), "{summary}");
    summary
}
