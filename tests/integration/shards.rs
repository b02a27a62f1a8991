//! Sharding the orders stream (`inventory_infra::jetstream::init`), on a nats-server of the
//! test's own: the transform puts each book in the partition `partition_of` says, the consumers
//! and the bucket are made once, and the unsharded consumer hands over without a message decided
//! on both sides of the cut-over. Stream subject transforms need nats-server 2.10: with none here
//! these tests say so and return.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::time::Duration;

use async_nats::jetstream::consumer::{self, AckPolicy, DeliverPolicy};
use futures::StreamExt as _;
use inventory_domain::BookId;
use inventory_domain::shard::partition_of;
use inventory_infra::jetstream::{
    self, Claim, Context, InitError, InitSettings, Shards, Topology, partition_consumer,
    partition_filter, unroutable_consumer, unroutable_filters,
};
use inventory_tests::nats::{
    NatsServer, TestNames, binary_before_2_10, binary_since_2_10, unique_names,
};

const P: NonZeroU32 = NonZeroU32::new(16).unwrap();

/// A nats-server 2.10 or later of the test's own, its JetStream and names for the test's
/// streams (`label`), or `None` after saying why there is no such server.
async fn current_server(label: &str) -> Option<(NatsServer, Context, TestNames)> {
    match binary_since_2_10() {
        Ok(bin) => {
            let server = NatsServer::start_binary(&bin).await;
            let js = context(&server).await;
            Some((server, js, unique_names(label)))
        }
        Err(why) => {
            eprintln!("{label}: skipped: {why}");
            None
        }
    }
}

async fn context(server: &NatsServer) -> Context {
    jetstream::context(async_nats::connect(server.url()).await.unwrap())
}

fn settings(names: &TestNames, partitions: NonZeroU32) -> InitSettings {
    InitSettings {
        partitions,
        consumer: names.consumer.clone(),
        ack_wait: Duration::from_secs(30),
        max_ack_pending: 1_000,
        drain_timeout: Duration::from_secs(10),
    }
}

async fn consumer_info(js: &Context, topology: &Topology, name: &str) -> Option<consumer::Info> {
    let stream = js.get_stream(&topology.stream).await.unwrap();
    stream.consumer_info(name).await.ok()
}

/// The streams, and the unsharded durable consumer as `serve` makes it (`<prefix>.>`).
async fn unsharded_consumer(js: &Context, names: &TestNames) -> consumer::PullConsumer {
    let (stream, _) = jetstream::ensure_streams(js, &names.topology())
        .await
        .unwrap();
    stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some(names.consumer.clone()),
            filter_subject: names.subjects(),
            ack_policy: AckPolicy::Explicit,
            deliver_policy: DeliverPolicy::All,
            ..Default::default()
        })
        .await
        .unwrap()
}

async fn publish(js: &Context, subject: String) {
    js.publish(subject, "{}".into())
        .await
        .unwrap()
        .await
        .unwrap();
}

#[tokio::test]
async fn shard_init_maps_each_book_to_its_partition_and_sets_up_the_bucket_and_consumers() {
    let Some((_server, js, names)) = current_server("shard_init").await else {
        return;
    };
    let topology = names.topology();
    let settings = settings(&names, P);

    let report = jetstream::init(&js, &topology, &settings).await.unwrap();
    assert!(report.bucket_created && report.transform_set && report.unroutable_created);
    assert_eq!(report.partition_consumers_created, P.get());
    let shards = Shards::open(&js, &topology)
        .await
        .unwrap()
        .expect("the bucket exists");
    assert_eq!(shards.partitions(), P, "P read back from the transform");
    for partition in 0..P.get() {
        let name = partition_consumer(&names.consumer, partition, P);
        let info = consumer_info(&js, &topology, &name)
            .await
            .unwrap_or_else(|| panic!("consumer {name}"));
        assert_eq!(
            info.config.filter_subject,
            partition_filter(&topology, partition)
        );
        assert_eq!(info.config.ack_policy, AckPolicy::Explicit);
    }
    let unroutable = consumer_info(&js, &topology, &unroutable_consumer(&names.consumer))
        .await
        .expect("the unroutable consumer");
    assert_eq!(
        unroutable.config.filter_subjects,
        unroutable_filters(&topology)
    );

    let books: Vec<BookId> = (0..2_000)
        .map(|_| BookId::from(uuid::Uuid::new_v4()))
        .collect();
    let mut expected = BTreeMap::<u32, u64>::new();
    for book in &books {
        publish(&js, format!("{}.placed.{book}", names.subject_prefix)).await;
        *expected.entry(partition_of(*book, P)).or_default() += 1;
    }
    // Stored under the partition `partition_of` names, and so counted by that partition's
    // consumer and no other.
    let stream = js.get_stream(&topology.stream).await.unwrap();
    let reader = stream
        .create_consumer(consumer::pull::Config {
            filter_subject: names.subjects(),
            // Read, not handled: nothing to ack, and no ack-pending cap on one fetch.
            ack_policy: AckPolicy::None,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut messages = reader.fetch().max_messages(2_000).messages().await.unwrap();
    let mut read = 0;
    while let Some(message) = messages.next().await {
        let message = message.unwrap();
        let book: BookId = message.subject.rsplit('.').next().unwrap().parse().unwrap();
        assert_eq!(
            message.subject.as_str(),
            format!(
                "{}.placed.{}.{book}",
                names.subject_prefix,
                partition_of(book, P)
            )
        );
        read += 1;
    }
    assert_eq!(read, books.len());
    for partition in 0..P.get() {
        let name = partition_consumer(&names.consumer, partition, P);
        let pending = consumer_info(&js, &topology, &name)
            .await
            .unwrap()
            .num_pending;
        assert_eq!(
            pending,
            expected.get(&partition).copied().unwrap_or(0),
            "{name}"
        );
    }
    assert_eq!(
        consumer_info(&js, &topology, &unroutable_consumer(&names.consumer))
            .await
            .unwrap()
            .num_pending,
        0
    );
}

#[tokio::test]
async fn shard_init_again_resumes_and_another_partition_count_is_refused() {
    let Some((_server, js, names)) = current_server("shard_again").await else {
        return;
    };
    let topology = names.topology();
    let first = jetstream::init(&js, &topology, &settings(&names, P))
        .await
        .unwrap();

    let again = jetstream::init(&js, &topology, &settings(&names, P))
        .await
        .unwrap();
    assert!(!again.bucket_created && !again.transform_set && !again.unroutable_created);
    assert_eq!(again.partition_consumers_created, 0);
    assert_eq!(again.partitions_start, first.partitions_start);
    assert_eq!(again.unroutable_start, first.unroutable_start);

    let other = NonZeroU32::new(32).unwrap();
    let refused = jetstream::init(&js, &topology, &settings(&names, other))
        .await
        .expect_err("another P");
    assert!(
        matches!(refused, InitError::OtherPartitions { existing, asked, .. } if existing == P && asked == other),
        "{refused}"
    );
    let shards = Shards::open(&js, &topology).await.unwrap().unwrap();
    assert_eq!(shards.partitions(), P);
}

/// The hand-over: what the unsharded consumer holds before the cut-over it finishes, what comes
/// after goes to the partitions (or, without a book, to the unroutable consumer), and the
/// unsharded consumer never delivers a message the partitions deliver.
#[tokio::test]
async fn shard_init_hands_over_from_the_unsharded_consumer_without_a_second_arbiter() {
    let Some((_server, js, names)) = current_server("shard_handover").await else {
        return;
    };
    let topology = names.topology();
    let unsharded = unsharded_consumer(&js, &names).await;
    let before: Vec<BookId> = (0..20)
        .map(|_| BookId::from(uuid::Uuid::new_v4()))
        .collect();
    for book in &before {
        publish(&js, format!("{}.placed.{book}", names.subject_prefix)).await;
    }
    publish(&js, names.placed_subject()).await;

    // The unsharded serve, still running: it takes what its consumer gives and acks it.
    let handled = tokio::spawn(async move {
        let mut subjects = Vec::new();
        let mut messages = unsharded.messages().await.unwrap();
        while let Ok(Some(Ok(message))) =
            tokio::time::timeout(Duration::from_secs(3), messages.next()).await
        {
            subjects.push(message.subject.to_string());
            message.ack().await.unwrap();
        }
        subjects
    });
    let report = jetstream::init(&js, &topology, &settings(&names, P))
        .await
        .unwrap();
    assert!(report.narrowed && report.unsharded_deleted, "{report:?}");
    assert!(
        consumer_info(&js, &topology, &names.consumer)
            .await
            .is_none()
    );

    let after = BookId::from(uuid::Uuid::new_v4());
    publish(&js, format!("{}.placed.{after}", names.subject_prefix)).await;
    publish(&js, names.cancelled_subject()).await;
    let handled = handled.await.unwrap();
    assert_eq!(handled.len(), before.len() + 1, "{handled:?}");
    // `<prefix>.placed.<book>` at most: a transformed subject has a partition token more.
    let untransformed = names.subject_prefix.split('.').count() + 2;
    assert!(
        handled
            .iter()
            .all(|subject| subject.split('.').count() <= untransformed),
        "the unsharded consumer took only untransformed subjects: {handled:?}"
    );
    let partition = partition_consumer(&names.consumer, partition_of(after, P), P);
    assert_eq!(
        consumer_info(&js, &topology, &partition)
            .await
            .unwrap()
            .num_pending,
        1,
        "the book published after the cut-over is its partition's"
    );
    assert_eq!(
        consumer_info(&js, &topology, &unroutable_consumer(&names.consumer))
            .await
            .unwrap()
            .num_pending,
        1,
        "the order-level cancellation after the cut-over is the unroutable consumer's"
    );
}

#[tokio::test]
async fn shard_claims_are_compare_and_set_and_the_watch_sees_them() {
    let Some((_server, js, names)) = current_server("shard_claims").await else {
        return;
    };
    let topology = names.topology();
    assert!(Shards::open(&js, &topology).await.unwrap().is_none());
    jetstream::init(&js, &topology, &settings(&names, P))
        .await
        .unwrap();
    let shards = Shards::open(&js, &topology).await.unwrap().unwrap();
    let mut watch = Box::pin(shards.watch().await.unwrap());
    let first = watch.next().await.unwrap().unwrap();
    assert!(first.owners.is_empty());

    assert!(matches!(
        shards.claim(3, "a").await.unwrap(),
        Claim::Created { .. }
    ));
    let Claim::Held(owner) = shards.claim(3, "b").await.unwrap() else {
        panic!("a second claim of partition 3 won");
    };
    assert_eq!(owner.shard, "a");
    let seen = tokio::time::timeout(Duration::from_secs(5), watch.next())
        .await
        .expect("the watch saw the claim")
        .unwrap()
        .unwrap();
    assert_eq!(seen.shard_of(3), Some("a"));
    assert_eq!(seen.partitions_of("a"), [3]);
    assert_eq!(shards.assignment().await.unwrap(), seen);
}

#[tokio::test]
async fn shard_init_refuses_a_server_before_2_10() {
    let bin = match binary_before_2_10() {
        Ok(bin) => bin,
        Err(why) => {
            eprintln!("shard_init_refuses_a_server_before_2_10: skipped: {why}");
            return;
        }
    };
    let server = NatsServer::start_binary(&bin).await;
    let js = context(&server).await;
    let names = unique_names("shard_old");
    let refused = jetstream::init(&js, &names.topology(), &settings(&names, P))
        .await
        .expect_err("no subject transforms before 2.10");
    assert!(
        matches!(refused, InitError::ServerTooOld { .. }),
        "{refused}"
    );
    assert!(refused.to_string().contains("2.10"), "{refused}");
    assert!(
        js.get_stream(&names.stream).await.is_err(),
        "nothing was created"
    );
}

/// With a message before the cut-over delivered and not yet acked (an unsharded serve still at
/// work on it), init stops after its drain timeout, saying so, and leaves what it set up; run
/// again once the message is acked, it resumes.
#[tokio::test]
async fn shard_init_that_cannot_drain_exits_with_its_work_kept_and_resumes() {
    let Some((_server, js, names)) = current_server("shard_drain").await else {
        return;
    };
    let topology = names.topology();
    let unsharded = unsharded_consumer(&js, &names).await;
    let book = BookId::from(uuid::Uuid::new_v4());
    publish(&js, format!("{}.placed.{book}", names.subject_prefix)).await;
    let mut messages = unsharded.fetch().max_messages(1).messages().await.unwrap();
    let in_flight = messages.next().await.unwrap().unwrap();

    let impatient = InitSettings {
        drain_timeout: Duration::from_secs(1),
        ..settings(&names, P)
    };
    let stopped = jetstream::init(&js, &topology, &impatient)
        .await
        .expect_err("nobody finishes the message before the cut-over");
    assert!(
        matches!(&stopped, InitError::NotDrained { ack_pending: 1, .. }),
        "{stopped}"
    );
    assert!(
        Shards::open(&js, &topology).await.unwrap().is_some(),
        "the bucket and the transform stay"
    );

    in_flight.double_ack().await.unwrap();
    let resumed = jetstream::init(&js, &topology, &impatient).await.unwrap();
    assert!(
        resumed.unsharded_deleted && !resumed.transform_set,
        "{resumed:?}"
    );
    assert_eq!(resumed.partition_consumers_created, 0);
}
