//! The handlers a benchmark compares, and the messages they handle.
//!
//! A [`DuplicateStream`] yields `OrderPlaced` messages of which an exact, evenly spread fraction
//! are copies of messages it yielded before: the same message (same id) for the inbox, the same
//! order and book under a new message id for the natural key, as a producer that resent it would.
//! Which earlier message a copy repeats is drawn from a seeded generator, so the sequence of
//! fresh messages and copies is the same on every run.

use crate::consumers::{BuildError, DetectMode, HandlerKind, NaturalKeyPath};
use crate::mistakes::{Strategy, StudyHandler};
use crate::produce::Produce as _;
use inventory_domain::{
    BookId, ConsumerName, Effect, FieldError, Message, OrderId, Outcome, Quantity, StockItem,
};
use inventory_infra::StockRepository;
use inventory_infra::db::{self, DatabaseConnection};
use inventory_service::metrics::{ConsumerMetrics, Metrics};
use sea_orm::DbErr;

/// The server when `DATABASE_URL` names none: the local one the tests use too.
pub const DEFAULT_POSTGRES_SERVER: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// Copies on hand of every benchmark book: enough that no reservation is ever rejected.
pub const ON_HAND: i64 = 1_000_000_000;

/// The consumer name the benchmark handlers record in the inbox.
pub const CONSUMER: &str = "inventory-reserve-stock-bench";

/// The PostgreSQL server to create benchmark databases on: `DATABASE_URL` when it is a postgres
/// URL, else [`DEFAULT_POSTGRES_SERVER`].
pub fn postgres_server() -> String {
    match std::env::var("DATABASE_URL") {
        Ok(url) if db::is_postgres(&url) => url,
        _ => DEFAULT_POSTGRES_SERVER.to_owned(),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    #[error(transparent)]
    Handler(#[from] BuildError),
    #[error("database error: {0}")]
    Database(#[from] DbErr),
    #[error(transparent)]
    Field(#[from] FieldError),
    #[error("a duplicate stream needs at least one book")]
    NoBooks,
}

/// The handlers of the dedup-cost comparison: the inbox's three detection modes and the natural
/// key's two single-message paths.
pub const DEDUP: [HandlerKind; 5] = [
    HandlerKind::Inbox(DetectMode::CatchViolation),
    HandlerKind::Inbox(DetectMode::PreCheck),
    HandlerKind::Inbox(DetectMode::OnConflict),
    HandlerKind::NaturalKey(NaturalKeyPath::Orm),
    HandlerKind::NaturalKey(NaturalKeyPath::OneStatement),
];

/// The handlers compared on fresh messages.
pub const STRATEGIES: [Strategy; 4] = [
    Strategy::Naive,
    Strategy::Served(HandlerKind::Inbox(DetectMode::OnConflict)),
    Strategy::Served(HandlerKind::NaturalKey(NaturalKeyPath::Orm)),
    Strategy::Served(HandlerKind::NaturalKey(NaturalKeyPath::OneStatement)),
];

/// How a copy of an earlier message is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyKind {
    /// The very same message, id included: a redelivery, what the inbox catches.
    SameMessage,
    /// The same order and book under a new message id: a producer's resend, which only the
    /// natural key catches.
    SameOrderNewId,
}

impl CopyKind {
    /// The duplicate `handler` is there to catch.
    pub fn caught_by(handler: HandlerKind) -> Self {
        match handler {
            HandlerKind::NaturalKey(_) => Self::SameOrderNewId,
            _ => Self::SameMessage,
        }
    }

    /// A copy of `original` of this kind.
    pub fn copy_of(self, original: &Message) -> Message {
        match self {
            Self::SameMessage => original.clone(),
            Self::SameOrderNewId => original.resent_with_new_id(),
        }
    }
}

/// A benchmark's `handler` on `db`, its dedup rows under [`CONSUMER`]. Clones of a one-statement
/// handler each open a connection of their own on first use; the others share `db`'s pool.
pub fn handler(
    kind: impl Into<Strategy>,
    db: &DatabaseConnection,
) -> Result<StudyHandler, WorkloadError> {
    Ok(kind.into().build(db, ConsumerName::parse(CONSUMER)?)?)
}

/// Puts `count` new books with [`ON_HAND`] copies each.
pub async fn stock_books(
    db: &DatabaseConnection,
    count: usize,
) -> Result<Vec<BookId>, WorkloadError> {
    let repository = StockRepository::new(db.clone());
    let mut books = Vec::with_capacity(count);
    for index in 0..count {
        let book_id = BookId::new_v7();
        let item = StockItem::new(book_id, &format!("Benchmark book {index}"), ON_HAND)?;
        repository.put(&item).await?;
        books.push(book_id);
    }
    Ok(books)
}

/// A message to handle, and whether it repeats one handled before.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub message: Message,
    pub is_copy: bool,
}

impl Delivery {
    /// A fresh message reserves; a copy is a duplicate. Anything else means the benchmark
    /// measured something other than what it claims.
    pub fn as_expected(&self, outcome: &Outcome) -> bool {
        if self.is_copy {
            matches!(outcome, Outcome::Duplicate)
        } else {
            matches!(outcome, Outcome::Processed(Effect::Reserved { .. }))
        }
    }
}

/// Fresh messages and copies of earlier ones, `percent` in a hundred of them copies.
pub struct DuplicateStream {
    percent: u64,
    copy: CopyKind,
    books: Vec<BookId>,
    quantity: Quantity,
    yielded: u64,
    fresh: Vec<Message>,
    random: SplitMix64,
}

impl DuplicateStream {
    /// `percent` is capped at 100; fresh messages, each an order for one copy, take the
    /// `books` in turn.
    pub fn new(
        percent: u32,
        copy: CopyKind,
        books: Vec<BookId>,
        seed: u64,
    ) -> Result<Self, WorkloadError> {
        if books.is_empty() {
            return Err(WorkloadError::NoBooks);
        }
        Ok(Self {
            percent: u64::from(percent.min(100)),
            copy,
            books,
            quantity: Quantity::new(1)?,
            yielded: 0,
            fresh: Vec::new(),
            random: SplitMix64::new(seed),
        })
    }

    /// The next delivery. Copies are spread evenly: after `n` deliveries exactly
    /// `floor(n * percent / 100)` were copies (the first is fresh even at 100 %, as there is
    /// nothing to copy yet).
    pub fn next_delivery(&mut self) -> Delivery {
        let index = self.yielded;
        self.yielded += 1;
        let is_copy = (index + 1) * self.percent / 100 > index * self.percent / 100;
        if is_copy && !self.fresh.is_empty() {
            let len = self.fresh.len() as u64;
            let pick = usize::try_from(self.random.below(len)).unwrap_or(0);
            return Delivery {
                message: self.copy.copy_of(&self.fresh[pick]),
                is_copy: true,
            };
        }
        let book = self.books[self.fresh.len() % self.books.len()];
        let message = Message::placed(OrderId::new_v7(), book, self.quantity);
        self.fresh.push(message.clone());
        Delivery {
            message,
            is_copy: false,
        }
    }

    /// The next `count` deliveries.
    pub fn take(&mut self, count: u64) -> Vec<Delivery> {
        (0..count).map(|_| self.next_delivery()).collect()
    }
}

/// SplitMix64: a few lines, and the same numbers for a seed on every platform and release,
/// which a library's generator does not promise across versions.
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number below `bound`; the modulo bias is negligible for the small bounds used here.
    pub fn below(&mut self, bound: u64) -> u64 {
        self.next_u64() % bound.max(1)
    }

    pub fn uuid(&mut self) -> uuid::Uuid {
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&self.next_u64().to_le_bytes());
        bytes[8..].copy_from_slice(&self.next_u64().to_le_bytes());
        uuid::Builder::from_random_bytes(bytes).into_uuid()
    }

    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = usize::try_from(self.below(i as u64 + 1)).unwrap_or(i);
            items.swap(i, j);
        }
    }
}

/// `consumer`'s metrics in a registry of their own, for a runtime that serves none (tests,
/// benchmarks, the study): its counts are still read from them.
pub fn unexported_metrics(consumer: &str) -> Result<ConsumerMetrics, prometheus::Error> {
    Ok(Metrics::new()?.consumer(consumer))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(percent: u32, copy: CopyKind) -> DuplicateStream {
        let Ok(stream) = DuplicateStream::new(percent, copy, vec![BookId::new_v7()], 7) else {
            panic!("a stream on one book");
        };
        stream
    }

    #[test]
    fn copies_are_the_exact_fraction() {
        for percent in [0, 10, 50, 90] {
            let copies = stream(percent, CopyKind::SameMessage)
                .take(1_000)
                .iter()
                .filter(|delivery| delivery.is_copy)
                .count();
            assert_eq!(copies, usize::try_from(percent).unwrap_or(0) * 10);
        }
    }

    #[test]
    fn a_copy_repeats_an_earlier_message_as_its_kind_says() {
        for copy in [CopyKind::SameMessage, CopyKind::SameOrderNewId] {
            let deliveries = stream(50, copy).take(200);
            for (at, delivery) in deliveries.iter().enumerate() {
                if !delivery.is_copy {
                    continue;
                }
                let original = deliveries[..at]
                    .iter()
                    .find(|earlier| {
                        !earlier.is_copy && earlier.message.event == delivery.message.event
                    })
                    .map(|earlier| &earlier.message);
                let Some(original) = original else {
                    panic!("copy {at} repeats nothing before it");
                };
                assert_eq!(
                    original.key == delivery.message.key,
                    copy == CopyKind::SameMessage
                );
            }
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_sequence() {
        let shape = |mut stream: DuplicateStream| {
            let deliveries = stream.take(100);
            let firsts: Vec<&Message> = deliveries
                .iter()
                .filter(|delivery| !delivery.is_copy)
                .map(|delivery| &delivery.message)
                .collect();
            deliveries
                .iter()
                .map(|delivery| {
                    firsts
                        .iter()
                        .position(|first| first.event == delivery.message.event)
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(
            shape(stream(50, CopyKind::SameMessage)),
            shape(stream(50, CopyKind::SameMessage))
        );
    }
}
