//! The orders producer with its outbox: an order and its message in one transaction; a retry
//! of a command writes nothing new and reports the message made the first time, id and all.

use inventory_benches::entities::orders;
use inventory_benches::orders::{
    CancelMessage, Cancellation, OrdersError, OrdersRepository, Placement,
};
use inventory_benches::produce::Produce as _;
use inventory_domain::{Event, EventKind, Message, MessageId, OrderId, Quantity};
use inventory_tests::{Backend, TestDb};
use sea_orm::{ActiveModelTrait, ConnectionTrait, Set, Statement, TransactionTrait};

/// The messages waiting in `orders_outbox`, in write order, decoded as a consumer of ORDERS
/// decodes them; each row's event id must be its message id.
async fn waiting(db: &TestDb) -> Vec<Message> {
    let rows = db
        .conn
        .query_all_raw(Statement::from_string(
            db.conn.get_database_backend(),
            "SELECT event_id, subject, payload FROM orders_outbox ORDER BY seq",
        ))
        .await
        .unwrap();
    rows.iter()
        .map(|row| {
            let event_id: uuid::Uuid = row.try_get("", "event_id").unwrap();
            let subject: String = row.try_get("", "subject").unwrap();
            let payload: String = row.try_get("", "payload").unwrap();
            let kind = EventKind::from_subject(&format!("orders.{subject}")).unwrap();
            let message = Message::decode(kind, payload.as_bytes()).unwrap();
            assert_eq!(message.key.storage_key(), event_id.to_string());
            message
        })
        .collect()
}

fn quantity(n: i64) -> Quantity {
    Quantity::new(n).unwrap()
}

async fn an_order_and_its_message_once(db: TestDb) {
    let orders = OrdersRepository::new(db.conn.clone());
    let (order, book) = (OrderId::new_v7(), db.dune(5).await);
    let Placement::Placed { message_id } = orders.place(order, book, quantity(2)).await.unwrap()
    else {
        panic!("a new line is placed");
    };
    // The retry after an unclear failure: the same message, nothing new.
    assert_eq!(
        orders.place(order, book, quantity(2)).await.unwrap(),
        Placement::AlreadyPlaced {
            message_id: message_id.clone()
        }
    );
    assert!(matches!(
        orders.place(order, book, quantity(3)).await,
        Err(OrdersError::OtherQuantity { .. })
    ));
    let second_book = db.dune(5).await;
    let Placement::Placed {
        message_id: second_id,
    } = orders.place(order, second_book, quantity(1)).await.unwrap()
    else {
        panic!("a second line is placed");
    };
    // One cancellation per line, on its book's subject, in book order.
    let Cancellation::Cancelled { messages } = orders.cancel(order).await.unwrap() else {
        panic!("an open order is cancelled");
    };
    let mut books = [book, second_book];
    books.sort_by_key(|book| book.as_uuid());
    assert_eq!(
        messages.iter().map(|m| m.book_id).collect::<Vec<_>>(),
        books.map(Some)
    );
    assert_eq!(
        orders.cancel(order).await.unwrap(),
        Cancellation::AlreadyCancelled {
            messages: messages.clone()
        }
    );
    let other_book = db.dune(5).await;
    assert!(matches!(
        orders.place(order, other_book, quantity(1)).await,
        Err(OrdersError::Cancelled(_))
    ));
    assert!(matches!(
        orders.cancel(OrderId::new_v7()).await,
        Err(OrdersError::UnknownOrder(_))
    ));

    let waiting = waiting(&db).await;
    let placed = [
        Message::placed(order, book, quantity(2)).resent_as(message_id),
        Message::placed(order, second_book, quantity(1)).resent_as(second_id),
    ];
    let cancelled = messages.iter().map(|cancel| {
        Message::cancelled_line(order, cancel.book_id.unwrap()).resent_as(cancel.message_id.clone())
    });
    let expected: Vec<Message> = placed.into_iter().chain(cancelled).collect();
    assert_eq!(waiting, expected);

    // An order cancelled before lines had messages of their own, under one for the whole
    // order: a retry reports that one.
    let (legacy, whole_order) = (OrderId::new_v7(), MessageId::generate());
    orders.place(legacy, book, quantity(1)).await.unwrap();
    orders::ActiveModel {
        order_id: Set(legacy.as_uuid()),
        cancelled_at: Set(Some(chrono::Utc::now())),
        cancel_message_id: Set(Some(whole_order.as_str().to_owned())),
        ..Default::default()
    }
    .update(&db.conn)
    .await
    .unwrap();
    assert_eq!(
        orders.cancel(legacy).await.unwrap(),
        Cancellation::AlreadyCancelled {
            messages: vec![CancelMessage {
                book_id: None,
                message_id: whole_order
            }]
        }
    );
}

inventory_tests::on_both_backends!(an_order_and_its_message_once);

/// Two places of one line at once (both seen waiting for the order's row, then let go): one
/// is placed, the other finds it, and the outbox holds one message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_places_of_one_line_write_one_message() {
    let db = TestDb::new(Backend::Postgres).await;
    let orders = OrdersRepository::new(db.conn.clone());
    let (order, book) = (OrderId::new_v7(), db.dune(5).await);
    // The order exists before the race, so both places queue on its row.
    let first_book = db.dune(5).await;
    orders.place(order, first_book, quantity(1)).await.unwrap();
    let holder = db.conn.begin().await.unwrap();
    holder
        .execute_unprepared(&format!(
            "SELECT 1 FROM orders WHERE order_id = '{order}' FOR UPDATE"
        ))
        .await
        .unwrap();
    let place = || {
        let orders = orders.clone();
        tokio::spawn(async move { orders.place(order, book, quantity(2)).await.unwrap() })
    };
    let (a, b) = (place(), place());
    db.wait_for_lock_waiters(2).await;
    holder.rollback().await.unwrap();
    let mut results = [a.await.unwrap(), b.await.unwrap()];
    results.sort_by_key(|placement| matches!(placement, Placement::AlreadyPlaced { .. }));
    let [
        Placement::Placed { message_id },
        Placement::AlreadyPlaced { message_id: again },
    ] = results
    else {
        panic!("one placed and one already placed: {results:?}");
    };
    assert_eq!(message_id, again);
    let placed_for_book: Vec<Message> = waiting(&db)
        .await
        .into_iter()
        .filter(|m| matches!(&m.event, Event::Placed(p) if p.book_id == book))
        .collect();
    assert_eq!(
        placed_for_book,
        [Message::placed(order, book, quantity(2)).resent_as(message_id)]
    );
}
