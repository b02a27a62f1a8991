//! The natural-key example (`example/`), run in-process on a fresh database and streams of its
//! own: copies and a resend under a new message id reserve once, a commit that fails after the
//! statement ran brings the message again rather than losing it, the same order with another
//! quantity, an unknown book and an unreadable body are terminated, moving nothing, and every
//! other message is acked.

use std::time::{Duration, Instant};

use futures::StreamExt as _;

use inventory_tests::{Backend, TestDb, nats};
use natural_key_example::Config;
use uuid::Uuid;

/// On the example's tables: the first commit of `order` that inserted its reservation fails, at
/// commit time (a deferred constraint trigger), after the statement itself succeeded. The
/// attempts are counted by a sequence, since a row written by the failing transaction would
/// roll back with it.
fn fail_first_commit_of(order: Uuid) -> String {
    format!(
        "CREATE SEQUENCE commit_attempts;
         CREATE FUNCTION fail_first_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.order_id = '{order}' AND nextval('commit_attempts') = 1 THEN
                 RAISE EXCEPTION 'the first commit of order % fails', NEW.order_id;
             END IF;
             RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER fail_first_commit AFTER INSERT ON stock_reservations
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fail_first_commit();"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_and_a_resend_reserve_once_and_a_failed_commit_comes_again() {
    let db = TestDb::labelled(Backend::Postgres, "example").await;
    let names = nats::unique_names("example");
    let config = Config {
        database_url: db.url.clone(),
        nats_url: nats::shared_url().await,
        stream: names.stream.clone(),
        subject: names.placed_subject(),
        consumer: names.consumer.clone(),
        nak_delay: Duration::from_millis(200),
    };
    let client = natural_key_example::connect(&config.database_url)
        .await
        .unwrap();
    let (order, book) = (Uuid::new_v4(), Uuid::new_v4());
    let (failing_order, other_book) = (Uuid::new_v4(), Uuid::new_v4());
    let unknown_book_order = Uuid::new_v4();
    client
        .execute(
            "INSERT INTO stock_items (book_id, on_hand) VALUES ($1, 10), ($2, 10)",
            &[&book, &other_book],
        )
        .await
        .unwrap();
    client
        .batch_execute(&fail_first_commit_of(failing_order))
        .await
        .unwrap();

    // An order, a copy of it under the same message id, the producer's resend under a new one;
    // another order whose first commit fails; the first order again with another quantity; an
    // order for a book with no stock row; a body that does not parse.
    let (jetstream, stream) = natural_key_example::jetstream(&config).await.unwrap();
    let body = |message_id: &str, order: Uuid, book: Uuid, quantity: i32| {
        serde_json::json!({"message_id": message_id, "order_id": order, "book_id": book,
            "quantity": quantity})
        .to_string()
    };
    let bodies = [
        body("m-1", order, book, 2),
        body("m-1", order, book, 2),
        body("m-2", order, book, 2),
        body("m-3", failing_order, other_book, 3),
        body("m-4", order, book, 5),
        body("m-5", unknown_book_order, Uuid::new_v4(), 1),
        "not json".to_owned(),
    ];
    // The server announces each terminated message: the refusals, by their stream sequence.
    let nats = async_nats::connect(&config.nats_url).await.unwrap();
    let mut terminated = nats
        .subscribe(format!(
            "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{}.{}",
            names.stream, names.consumer
        ))
        .await
        .unwrap();
    nats.flush().await.unwrap();
    for body in &bodies {
        let ack = jetstream
            .publish(config.subject.clone(), body.clone().into())
            .await
            .unwrap();
        ack.await.unwrap();
    }

    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let example = tokio::spawn(async move { natural_key_example::run(&config, stopped).await });
    // Every message acked: all delivered, none pending, none waiting for its ack (a nak'd
    // message waits for one until it comes again and is acked).
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let info = stream.consumer_info(&names.consumer).await;
        if let Ok(info) = &info
            && info.delivered.stream_sequence >= bodies.len() as u64
            && info.num_pending == 0
            && info.num_ack_pending == 0
        {
            break;
        }
        assert!(
            !example.is_finished(),
            "the example ended: {:?}",
            example.await
        );
        assert!(Instant::now() < deadline, "not all acked in time: {info:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.send(()).unwrap();
    example.await.unwrap().unwrap();

    let count = |order: Uuid| {
        let client = &client;
        async move {
            let sql = "SELECT count(*) FROM stock_reservations WHERE order_id = $1";
            client
                .query_one(sql, &[&order])
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    let reserved = |book: Uuid| {
        let client = &client;
        async move {
            let sql = "SELECT reserved FROM stock_items WHERE book_id = $1";
            client
                .query_one(sql, &[&book])
                .await
                .unwrap()
                .get::<_, i32>(0)
        }
    };
    let attempts: i64 = client
        .query_one("SELECT last_value FROM commit_attempts", &[])
        .await
        .unwrap()
        .get(0);
    let (copies, copies_reserved) = (count(order).await, reserved(book).await);
    let (failed, failed_reserved) = (count(failing_order).await, reserved(other_book).await);
    let unknown_book_rows = count(unknown_book_order).await;
    let mut refused = Vec::new();
    while let Ok(Some(advisory)) =
        tokio::time::timeout(Duration::from_millis(500), terminated.next()).await
    {
        let advisory: serde_json::Value = serde_json::from_slice(&advisory.payload).unwrap();
        refused.push(advisory["stream_seq"].as_u64().unwrap());
    }
    refused.sort_unstable();
    let _ = jetstream.delete_stream(&names.stream).await;

    assert_eq!(copies, 1, "the copies and the resend: one reservation");
    assert_eq!(
        copies_reserved, 2,
        "the copies and the resend moved stock once"
    );
    assert_eq!(
        (failed, failed_reserved),
        (1, 3),
        "the order whose first commit failed was reserved once (acked before its commit, it is \
         lost)"
    );
    assert_eq!(
        attempts, 2,
        "the failing order: a failed commit, then one that held"
    );
    assert_eq!(
        unknown_book_rows, 0,
        "an order for an unknown book recorded"
    );
    assert_eq!(
        refused,
        [5, 6, 7],
        "terminated: the other quantity, the unknown book, the unreadable body (by stream sequence)"
    );
}
