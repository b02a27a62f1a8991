//! Dead letters listed and replayed: a replay goes back to its original subject with its
//! original body, so the consumer's dedup applies: a fixed message is processed, a copy of one
//! already handled is skipped.

use std::sync::atomic::Ordering;

use async_nats::HeaderMap;
use inventory_domain::{DeadLetterReason, StockItem};
use inventory_infra::HandlerKind;
use inventory_infra::NaturalKeyPath;
use inventory_infra::jetstream::Origin;
use inventory_service::dlq::{self, Selection};
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
        service.stats.dead_lettered.load(Ordering::Relaxed) == 2
            && service.stats.acked.load(Ordering::Relaxed) == 1
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
        Some(
            broker
                .topology
                .subject(inventory_domain::EventKind::Placed)
                .as_str()
        )
    );
    assert_eq!(letter.original_sequence, Some(unknown_receipt.sequence));
    let original_id = for_unknown.key.storage_key();
    assert_eq!(
        letter.original_message_id.as_deref(),
        Some(original_id.as_str())
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
    let report = dlq::replay_selected(
        &broker.js,
        &broker.topology,
        &Selection::Reason("unknown-book".into()),
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
        good.key.storage_key().as_str(),
    );
    let origin = Origin {
        subject: broker.topology.subject(inventory_domain::EventKind::Placed),
        stream: broker.topology.stream.clone(),
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
    let report = dlq::replay_selected(
        &broker.js,
        &broker.topology,
        &Selection::Sequences(vec![handled_letter.seq, 9_999]),
    )
    .await
    .unwrap();
    assert_eq!(report.replayed.len(), 1);
    assert_eq!(report.missing, [9_999]);
    eventually("the replayed copy acked as a duplicate", || async {
        service.stats.duplicates.load(Ordering::Relaxed) == 1
    })
    .await;
    assert_eq!(db.reserved(known).await, 2);
    assert_eq!(service.stats.acked.load(Ordering::Relaxed), 2);

    // Replayed once: it is gone from the DLQ, so a second replay finds nothing.
    let again = dlq::replay_selected(
        &broker.js,
        &broker.topology,
        &Selection::Sequences(vec![handled_letter.seq]),
    )
    .await
    .unwrap();
    assert!(again.replayed.is_empty());
    assert_eq!(again.missing, [handled_letter.seq]);
    service.stop().await;
}
