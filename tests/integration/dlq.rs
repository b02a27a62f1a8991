//! Dead letters listed, replayed and deleted: a replay goes back to its original subject with
//! its original body, so the consumer's dedup applies: a fixed message is processed, a copy of
//! one already handled is skipped. A delete takes exactly what it selects; a dry run of either
//! changes nothing; a dead letter older than the replay allowance is replayed only when forced.

use std::time::Duration;

use async_nats::HeaderMap;
use inventory_benches::consumers::HandlerKind;
use inventory_benches::consumers::NaturalKeyPath;
use inventory_domain::{DeadLetterReason, StockItem};
use inventory_infra::jetstream::Origin;
use inventory_service::dlq::{self, ReplayOptions, ReplayRefused, Selection};
use inventory_tests::broker::{Broker, RunningService, eventually};
use inventory_tests::{Backend, TestDb, placed};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_listed_by_reason_and_replayed_through_the_consumers_dedup() {
    let db = TestDb::new(Backend::Postgres).await;
    let broker = Broker::new().await;
    let known = db.dune(10).await;
    let unknown = inventory_domain::BookId::new_v7();
    let publisher = broker.publisher();
    let for_unknown = placed(unknown, 3);
    let unknown_receipt = publisher.publish(&for_unknown).await.unwrap();
    broker
        .publish_raw("placed", &b"{not json"[..], Some("poison-1"))
        .await;
    let good = placed(known, 2);
    let good_receipt = publisher.publish(&good).await.unwrap();

    let service = RunningService::start(
        &broker,
        db.consumer(HandlerKind::NaturalKey(NaturalKeyPath::Orm)),
        db.conn.clone(),
        broker.settings(2, 5),
    )
    .await;
    eventually("two dead letters and one processed", || async {
        service.metrics.dead_lettered() == 2 && service.metrics.acked() == 1
    })
    .await;

    // Listing, whole and by reason.
    let all = dlq::list(&broker.js, &broker.topology, None).await.unwrap();
    assert_eq!(all.len(), 2);
    let unknown_books = dlq::list(&broker.js, &broker.topology, Some("unknown-book"))
        .await
        .unwrap();
    assert_eq!(unknown_books.len(), 1);
    let letter = &unknown_books[0];
    assert_eq!(
        letter.original_subject.as_deref(),
        Some(broker.topology.subject_of(&for_unknown.event).as_str())
    );
    assert_eq!(letter.original_sequence, Some(unknown_receipt.sequence));
    let original_id = for_unknown.key.storage_key();
    assert_eq!(
        letter.original_message_id.as_deref(),
        Some(original_id.as_ref())
    );
    assert_eq!(letter.consumer, broker.consumer_name);
    assert!(
        letter.detail.contains(&unknown.to_string()),
        "{}",
        letter.detail
    );
    let json = serde_json::to_value(&unknown_books).unwrap();
    assert_eq!(json[0]["reason"], "unknown-book");
    assert_eq!(json[0]["original_sequence"], unknown_receipt.sequence);
    assert!(json[0]["age_seconds"].as_i64().unwrap() >= 0);
    let malformed = dlq::list(&broker.js, &broker.topology, Some("malformed"))
        .await
        .unwrap();
    assert_eq!(malformed.len(), 1);

    // Fixed: the book now exists. The replay, seconds after the dead letter and so inside the
    // stream's duplicate window, is stored (it carries a replay id), processed, and removed.
    db.stock
        .put(&StockItem::new(unknown, "Arrakis", 5).unwrap())
        .await
        .unwrap();
    let report = dlq::replay(
        &broker.js,
        &broker.topology,
        &Selection::Reason {
            reason: "unknown-book".into(),
            older_than: None,
        },
        ReplayOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(report.replayed.len(), 1);
    assert!(!report.replayed[0].duplicate);
    assert_eq!(
        report.replayed[0].message_id,
        format!("{original_id}:replay:{}", letter.seq)
    );
    eventually("the replayed order reserved", || async {
        db.reserved(unknown).await == 3
    })
    .await;
    let left = dlq::list(&broker.js, &broker.topology, None).await.unwrap();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].reason, "malformed");

    // A dead letter of a message that was in fact handled (its commit made it, its ack did
    // not): the replay is a duplicate to the consumer and reserves nothing more.
    let mut headers = HeaderMap::new();
    headers.insert(
        async_nats::header::NATS_MESSAGE_ID,
        good.key.storage_key().as_ref(),
    );
    let subject = broker.topology.subject(inventory_domain::EventKind::Placed);
    let origin = Origin {
        subject: &subject,
        stream: &broker.topology.stream,
        stream_sequence: good_receipt.sequence,
        deliveries: 5,
    };
    broker
        .dead_letter_publisher()
        .publish(
            &origin,
            Some(&headers),
            good.to_plain_json().unwrap().into(),
            DeadLetterReason::MaxDeliveries,
            "last of 5 deliveries failed",
        )
        .await
        .unwrap();
    let handled_letter = dlq::list(&broker.js, &broker.topology, Some("max-deliveries"))
        .await
        .unwrap()
        .remove(0);
    let report = dlq::replay(
        &broker.js,
        &broker.topology,
        &Selection::Sequences(vec![handled_letter.seq, 9_999]),
        ReplayOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(report.replayed.len(), 1);
    assert_eq!(report.missing, [9_999]);
    eventually("the replayed copy acked as a duplicate", || async {
        service.metrics.duplicates() == 1
    })
    .await;
    assert_eq!(db.reserved(known).await, 2);
    assert_eq!(service.metrics.acked(), 2);

    // Replayed once: it is gone from the DLQ, so a second replay finds nothing.
    let again = dlq::replay(
        &broker.js,
        &broker.topology,
        &Selection::Sequences(vec![handled_letter.seq]),
        ReplayOptions::default(),
    )
    .await
    .unwrap();
    assert!(again.replayed.is_empty());
    assert_eq!(again.missing, [handled_letter.seq]);
    service.stop().await;
}

/// Stores a dead letter of `reason` as the consumer would, for an OrderPlaced at
/// `original_sequence` of the orders stream (no message there: the DLQ is all these tests read);
/// its DLQ sequence.
async fn dead_letter(broker: &Broker, reason: DeadLetterReason, original_sequence: u64) -> u64 {
    let message = placed(inventory_domain::BookId::new_v7(), 1);
    let mut headers = HeaderMap::new();
    headers.insert(
        async_nats::header::NATS_MESSAGE_ID,
        message.key.storage_key().as_ref(),
    );
    let subject = broker.topology.subject(inventory_domain::EventKind::Placed);
    let origin = Origin {
        subject: &subject,
        stream: &broker.topology.stream,
        stream_sequence: original_sequence,
        deliveries: 1,
    };
    broker
        .dead_letter_publisher()
        .publish(
            &origin,
            Some(&headers),
            message.to_plain_json().unwrap().into(),
            reason,
            "a test's dead letter",
        )
        .await
        .unwrap()
        .sequence
}

/// The DLQ's sequences, oldest first.
async fn dlq_seqs(broker: &Broker) -> Vec<u64> {
    dlq::list(&broker.js, &broker.topology, None)
        .await
        .unwrap()
        .iter()
        .map(|letter| letter.seq)
        .collect()
}

fn seqs(letters: &[inventory_service::dlq::DeadLetter]) -> Vec<u64> {
    letters.iter().map(|letter| letter.seq).collect()
}

/// `dlq delete --reason malformed --older-than 1s`: the reason's older dead letters only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reason_with_an_age_takes_only_its_older_dead_letters() {
    let broker = Broker::new().await;
    let old = dead_letter(&broker, DeadLetterReason::Malformed, 1).await;
    tokio::time::sleep(std::time::Duration::from_millis(2_100)).await;
    let young = dead_letter(&broker, DeadLetterReason::Malformed, 2).await;
    let older = Selection::Reason {
        reason: "malformed".into(),
        older_than: Some(std::time::Duration::from_secs(1)),
    };
    let report = dlq::delete(&broker.js, &broker.topology, &older, false)
        .await
        .unwrap();
    assert_eq!(seqs(&report.deleted), [old]);
    assert_eq!(dlq_seqs(&broker).await, [young]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_deleted_by_seq_and_by_reason_and_a_dry_run_deletes_nothing() {
    let broker = Broker::new().await;
    let malformed_1 = dead_letter(&broker, DeadLetterReason::Malformed, 1).await;
    let invalid = dead_letter(&broker, DeadLetterReason::Invalid, 2).await;
    let malformed_2 = dead_letter(&broker, DeadLetterReason::Malformed, 3).await;
    let unknown = dead_letter(&broker, DeadLetterReason::UnknownBook, 4).await;
    let all = vec![malformed_1, invalid, malformed_2, unknown];
    assert_eq!(dlq_seqs(&broker).await, all);
    let orders_before = broker.stream_messages(&broker.topology.stream).await;

    // A dry run selects as the delete would, and deletes nothing.
    let by_reason = Selection::Reason {
        reason: "malformed".into(),
        older_than: None,
    };
    let dry = dlq::delete(&broker.js, &broker.topology, &by_reason, true)
        .await
        .unwrap();
    assert!(dry.dry_run);
    assert_eq!(seqs(&dry.deleted), [malformed_1, malformed_2]);
    assert_eq!(dry.deleted[0].consumer, broker.consumer_name);
    assert_eq!(dlq_seqs(&broker).await, all, "a dry run deleted");
    let dry = dlq::delete(
        &broker.js,
        &broker.topology,
        &Selection::Sequences(vec![invalid, 9_999]),
        true,
    )
    .await
    .unwrap();
    assert_eq!(
        (seqs(&dry.deleted), dry.missing),
        (vec![invalid], vec![9_999])
    );
    assert_eq!(dlq_seqs(&broker).await, all, "a dry run deleted");

    // By reason: exactly that reason's.
    let report = dlq::delete(&broker.js, &broker.topology, &by_reason, false)
        .await
        .unwrap();
    assert_eq!(seqs(&report.deleted), [malformed_1, malformed_2]);
    assert!(report.missing.is_empty() && report.gone.is_empty());
    assert_eq!(dlq_seqs(&broker).await, [invalid, unknown]);

    // By sequence: exactly those; one not in the DLQ (deleted already) is reported missing.
    let report = dlq::delete(
        &broker.js,
        &broker.topology,
        &Selection::Sequences(vec![invalid, malformed_1]),
        false,
    )
    .await
    .unwrap();
    assert_eq!(seqs(&report.deleted), [invalid]);
    assert_eq!(report.missing, [malformed_1]);
    assert_eq!(dlq_seqs(&broker).await, [unknown]);

    // Nothing was published anywhere.
    assert_eq!(
        broker.stream_messages(&broker.topology.stream).await,
        orders_before
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_dry_run_publishes_and_deletes_nothing() {
    let broker = Broker::new().await;
    let first = dead_letter(&broker, DeadLetterReason::UnknownBook, 1).await;
    let second = dead_letter(&broker, DeadLetterReason::UnknownBook, 2).await;
    let other = dead_letter(&broker, DeadLetterReason::Invalid, 3).await;
    let orders_before = broker.stream_messages(&broker.topology.stream).await;
    let letters = dlq::list(&broker.js, &broker.topology, Some("unknown-book"))
        .await
        .unwrap();

    let options = ReplayOptions {
        dry_run: true,
        ..ReplayOptions::default()
    };
    let report = dlq::replay(
        &broker.js,
        &broker.topology,
        &Selection::Reason {
            reason: "unknown-book".into(),
            older_than: None,
        },
        options,
    )
    .await
    .unwrap();
    assert!(report.dry_run);
    assert!(report.replayed.is_empty());
    let planned: Vec<(u64, String, String, bool)> = report
        .planned
        .iter()
        .map(|p| (p.letter.seq, p.subject.clone(), p.message_id(), p.forced))
        .collect();
    let subject = broker.topology.subject(inventory_domain::EventKind::Placed);
    assert_eq!(
        planned,
        [
            (
                first,
                subject.clone(),
                letters[0].replay_message_id(),
                false
            ),
            (second, subject, letters[1].replay_message_id(), false),
        ]
    );
    assert!(
        letters[0]
            .replay_message_id()
            .ends_with(&format!(":replay:{first}"))
    );

    assert_eq!(dlq_seqs(&broker).await, [first, second, other]);
    assert_eq!(
        broker.stream_messages(&broker.topology.stream).await,
        orders_before,
        "a dry run published"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_older_than_the_replay_allowance_is_refused_unless_forced() {
    let broker = Broker::new().await;
    let old = dead_letter(&broker, DeadLetterReason::UnknownBook, 1).await;
    // Real time: older than the allowance below by the time the replay looks.
    tokio::time::sleep(std::time::Duration::from_secs(4)).await;
    let fresh = dead_letter(&broker, DeadLetterReason::UnknownBook, 2).await;
    let orders_before = broker.stream_messages(&broker.topology.stream).await;
    let allowance = std::time::Duration::from_secs(3);
    let both = Selection::Reason {
        reason: "unknown-book".into(),
        older_than: None,
    };
    let guarded = ReplayOptions {
        allowance,
        force: false,
        dry_run: false,
    };

    // One letter too old refuses the whole selection: nothing replayed, the old one named.
    let error = dlq::replay(&broker.js, &broker.topology, &both, guarded)
        .await
        .expect_err("an old dead letter replayed without --force");
    let refused = error
        .downcast_ref::<ReplayRefused>()
        .unwrap_or_else(|| panic!("not a refusal: {error:#}"));
    let ReplayRefused::TooOld {
        letters,
        allowance: named,
    } = refused
    else {
        panic!("{refused:?}");
    };
    assert_eq!(*named, allowance);
    assert_eq!(
        letters.iter().map(|letter| letter.seq).collect::<Vec<_>>(),
        [old]
    );
    assert!(letters[0].age_seconds > 3, "{letters:?}");
    let message = error.to_string();
    assert!(
        message.contains(&format!("dead letter {old} (unknown-book, "))
            && message.contains("older than the replay allowance 3s")
            && message.contains("--force"),
        "{message}"
    );
    assert_eq!(dlq_seqs(&broker).await, [old, fresh]);
    assert_eq!(
        broker.stream_messages(&broker.topology.stream).await,
        orders_before
    );

    // The fresh one alone is inside the allowance.
    let report = dlq::replay(
        &broker.js,
        &broker.topology,
        &Selection::Sequences(vec![fresh]),
        guarded,
    )
    .await
    .unwrap();
    assert_eq!(report.replayed.len(), 1);
    assert!(!report.replayed[0].forced);

    // Forced: replayed, and said so.
    let forced = ReplayOptions {
        force: true,
        ..guarded
    };
    let report = dlq::replay(&broker.js, &broker.topology, &both, forced)
        .await
        .unwrap();
    assert_eq!(report.replayed.len(), 1);
    assert_eq!(report.replayed[0].seq, old);
    assert!(report.replayed[0].forced);
    assert!(dlq_seqs(&broker).await.is_empty());
    assert_eq!(
        broker.stream_messages(&broker.topology.stream).await,
        orders_before + 2
    );
}

/// Requests that reached `subscription` until it has been quiet for a moment.
async fn requests_seen(subscription: &mut async_nats::Subscriber) -> usize {
    use futures::StreamExt as _;
    let mut seen = 0;
    while let Ok(Some(_)) =
        tokio::time::timeout(Duration::from_millis(300), subscription.next()).await
    {
        seen += 1;
    }
    seen
}

/// The dead letters' gauges cost the same two requests a look whatever waits: the count from
/// the stream's subject index, the oldest by one get. Reading every dead letter, as they once
/// did, cost a request per dead letter every 30 s on every instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_look_at_the_dead_letters_costs_as_much_at_a_hundred_thousand_as_at_ten() {
    let broker = Broker::new().await;
    let consumer = broker.consumer_name.clone();
    let subject = broker.topology.dlq_subject(&consumer);
    let dlq = broker.topology.dlq_stream.clone();
    let mut requests = broker
        .client
        .subscribe(format!("$JS.API.STREAM.*.{dlq}"))
        .await
        .unwrap();
    let mut gets = broker
        .client
        .subscribe(format!("$JS.API.STREAM.MSG.GET.{dlq}"))
        .await
        .unwrap();
    let letters = inventory_infra::jetstream::DeadLetterStream::new(
        broker.js.clone(),
        broker.topology.clone(),
    );
    let mut stored = 0;
    let mut cost = Vec::new();
    for waiting in [10, 100_000] {
        for _ in stored..waiting {
            broker
                .client
                .publish(subject.clone(), "a dead letter".into())
                .await
                .unwrap();
        }
        broker.client.flush().await.unwrap();
        stored = waiting;
        eventually(&format!("{waiting} dead letters stored"), || async {
            broker.stream_messages(&dlq).await == waiting
        })
        .await;
        requests_seen(&mut requests).await;
        requests_seen(&mut gets).await;
        let look = letters.waiting(&consumer).await.unwrap();
        assert_eq!(look.count, waiting);
        assert!(look.oldest_stored_at.is_some());
        cost.push(requests_seen(&mut requests).await + requests_seen(&mut gets).await);
    }
    assert_eq!(
        cost,
        [2, 2],
        "requests a look at 10 and at 100,000 dead letters"
    );
}
