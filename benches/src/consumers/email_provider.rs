//! What the domain needs from the outside world, as traits the infrastructure implements.

use std::future::Future;

use crate::ids::{BookId, OrderId, Quantity};

/// The mail a reservation triggers: a side effect no database transaction can contain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StockReservedEmail {
    pub order_id: OrderId,
    pub book_id: BookId,
    pub quantity: Quantity,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("email provider unavailable: {0}")]
pub struct ProviderError(pub String);

/// What a provider knows about an idempotency key: whether mail under it went out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SentLookup {
    /// Mail under this key went out.
    Sent,
    /// Nothing went out under this key: sending it now is the first send.
    NotSent,
    /// The provider cannot say (it has no lookup API), so only a person can reconcile.
    Unknown,
}

/// An email provider that honours an idempotency key, as real ones do (`Idempotency-Key`): a
/// second send under a key that already went out sends nothing.
pub trait EmailProvider: Send + Sync {
    fn send(
        &self,
        idempotency_key: &str,
        email: &StockReservedEmail,
    ) -> impl Future<Output = Result<(), ProviderError>> + Send;

    /// Whether mail under `idempotency_key` went out. The default is a provider without a lookup
    /// API, which can only answer [`SentLookup::Unknown`].
    fn lookup(
        &self,
        idempotency_key: &str,
    ) -> impl Future<Output = Result<SentLookup, ProviderError>> + Send {
        let _ = idempotency_key;
        async { Ok(SentLookup::Unknown) }
    }
}
