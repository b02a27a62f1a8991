//! Routing by book: the Rust twin of nats-server's `partition(P, …)` mapping function
//! (`inventory_domain::shard::partition_of`) puts every book in the partition the server's own
//! mapping puts it in.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt as _;
use inventory_domain::BookId;
use inventory_domain::shard::{DEFAULT_PARTITIONS, partition_of};
use inventory_tests::nats::NatsServer;
use uuid::Uuid;

const BOOKS: u64 = 100_000;
/// Published, then read back, this many at a time: below the subscription's buffer, so the
/// server never drops a message for a slow reader.
const CHUNK: u64 = 10_000;

/// 100,000 book ids, the same on every run (so a failure names a book that fails again).
fn books() -> impl Iterator<Item = BookId> {
    let mut state = 0x5eed_u64;
    (0..BOOKS).map(move |_| {
        let mut next = || {
            // splitmix64
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        let bits = (u128::from(next()) << 64) | u128::from(next());
        BookId::from(uuid::Builder::from_random_bytes(bits.to_be_bytes()).into_uuid())
    })
}

#[tokio::test]
async fn the_partition_of_a_book_is_the_servers_for_100000_books() {
    // The account's mapping, as nats-server 2.8+ has it (a stream's subject transform, 2.10+,
    // runs the same function).
    let server = NatsServer::start_with_config(&format!(
        "mappings = {{ \"orders.placed.*\": \"partitioned.{{{{partition({},1)}}}}.{{{{wildcard(1)}}}}\" }}\n",
        DEFAULT_PARTITIONS
    ))
    .await;
    let client = async_nats::connect(server.url()).await.unwrap();
    let mut mapped = client.subscribe("partitioned.*.*").await.unwrap();
    client.flush().await.unwrap();

    let books: Vec<BookId> = books().collect();
    let mut wrong = BTreeMap::new();
    let mut per_partition = vec![0u64; DEFAULT_PARTITIONS.get() as usize];
    for chunk in books.chunks(CHUNK as usize) {
        for book in chunk {
            client
                .publish(format!("orders.placed.{book}"), "".into())
                .await
                .unwrap();
        }
        client.flush().await.unwrap();
        for _ in chunk {
            let message = tokio::time::timeout(Duration::from_secs(10), mapped.next())
                .await
                .expect("every book published comes back mapped")
                .unwrap();
            let mut tokens = message.subject.as_str().split('.').skip(1);
            let servers: u32 = tokens.next().unwrap().parse().unwrap();
            let book = BookId::from(Uuid::parse_str(tokens.next().unwrap()).unwrap());
            per_partition[servers as usize] += 1;
            let ours = partition_of(book, DEFAULT_PARTITIONS);
            if ours != servers {
                wrong.insert(book, (ours, servers));
            }
        }
    }
    assert_eq!(per_partition.iter().sum::<u64>(), BOOKS);
    assert!(
        wrong.is_empty(),
        "{} of {BOOKS} books in another partition than the server's (ours, the server's), e.g. \
         {:?}",
        wrong.len(),
        wrong.iter().take(5).collect::<Vec<_>>()
    );
    // Every partition holds books: the hash spreads them (about 1,562 each).
    assert!(
        per_partition.iter().all(|books| *books > 1_000),
        "{per_partition:?}"
    );
}
