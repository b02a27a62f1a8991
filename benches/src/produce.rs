//! What the producers send, which the service only decodes: a new OrderPlaced or
//! OrderCancelled, the cancellation of an order, and a resend of a message under a new id, as
//! the study, the benchmarks and the tests publish or hand to a handler.

use inventory_domain::{
    BookId, DedupKey, Event, Message, MessageId, OrderCancelled, OrderId, OrderPlaced, Quantity,
};

/// A producer's [`Message`]s. In scope (`use inventory_benches::produce::Produce as _`),
/// `Message::placed(..)` and `message.resent_with_new_id()` read as before.
pub trait Produce: Sized {
    /// A new OrderPlaced under a new message id.
    fn placed(order_id: OrderId, book_id: BookId, quantity: Quantity) -> Self;

    /// A new OrderCancelled of `order_id` under a new message id.
    fn cancelled(order_id: OrderId) -> Self;

    /// A new OrderCancelled of one line of `order_id`, by its book.
    fn cancelled_line(order_id: OrderId, book_id: BookId) -> Self;

    /// The cancellation of this message's order, in the same conversation (correlation id).
    fn cancellation(&self) -> Self;

    /// What a faulty producer sends on retry: the same event under a new message id, which no
    /// inbox can tell from a new order. (The same message again, id included, is a `clone`.)
    fn resent_with_new_id(&self) -> Self;

    /// The same event under `id`: a resend whose new id is chosen (a seeded workload's), or the
    /// first send of a message whose id the producer made.
    fn resent_as(&self, id: MessageId) -> Self;
}

impl Produce for Message {
    fn placed(order_id: OrderId, book_id: BookId, quantity: Quantity) -> Self {
        new(Event::Placed(OrderPlaced {
            order_id,
            book_id,
            quantity,
        }))
    }

    fn cancelled(order_id: OrderId) -> Self {
        new(Event::Cancelled(OrderCancelled {
            order_id,
            book_id: None,
        }))
    }

    fn cancelled_line(order_id: OrderId, book_id: BookId) -> Self {
        new(Event::Cancelled(OrderCancelled {
            order_id,
            book_id: Some(book_id),
        }))
    }

    fn cancellation(&self) -> Self {
        Self {
            correlation_id: self.correlation_id.clone(),
            ..Self::cancelled(self.event.order_id())
        }
    }

    fn resent_with_new_id(&self) -> Self {
        self.resent_as(MessageId::generate())
    }

    fn resent_as(&self, id: MessageId) -> Self {
        Self {
            key: DedupKey::MessageId(id),
            ..self.clone()
        }
    }
}

/// `event` under a new message id, with no correlation id or time.
fn new(event: Event) -> Message {
    Message {
        key: DedupKey::MessageId(MessageId::generate()),
        correlation_id: None,
        occurred_at: None,
        event,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resend_keeps_the_event_and_takes_a_new_id_a_cancellation_keeps_the_order() {
        let order = OrderId::new_v7();
        let placed = Message {
            correlation_id: Some("checkout-1".into()),
            ..Message::placed(
                order,
                BookId::new_v7(),
                Quantity::new(2).expect("a valid quantity"),
            )
        };
        let resent = placed.resent_with_new_id();
        assert_eq!(resent.event, placed.event);
        assert_ne!(resent.key, placed.key);
        let chosen = placed.resent_as(MessageId::parse("order-7-resent").expect("a valid id"));
        assert_eq!(chosen.key.storage_key(), "order-7-resent");
        assert_eq!(chosen.event, placed.event);
        let cancellation = placed.cancellation();
        assert_eq!(
            cancellation.event,
            Event::Cancelled(OrderCancelled {
                order_id: order,
                book_id: None,
            })
        );
        assert_eq!(cancellation.correlation_id.as_deref(), Some("checkout-1"));
        assert_ne!(cancellation.key, placed.key);
        assert_ne!(
            Message::placed(
                order,
                BookId::new_v7(),
                Quantity::new(1).expect("a valid quantity")
            )
            .key,
            Message::cancelled(order).key,
            "every new message gets an id of its own"
        );
    }
}
