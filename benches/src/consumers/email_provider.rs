//! What the email consumer needs of an email provider: a send that honours an idempotency
//! key, and a lookup by that key. The study's providers: `crate::mailbox::FileMailbox` for its
//! `serve`, `crate::mail::InMemoryEmailProvider` for the demo and the tests.

use std::future::Future;

use inventory_domain::{BookId, OrderId, Quantity};
use inventory_infra::HandleError;

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

impl From<ProviderError> for HandleError {
    /// The provider did not take the call: retried later, as any dependency that did not answer.
    fn from(error: ProviderError) -> Self {
        Self::Unavailable(error.to_string())
    }
}
