//! The study's and the tests' email provider, in memory.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::consumers::{EmailProvider, ProviderError, SentLookup, StockReservedEmail};

/// A provider that keeps sent mail in memory and honours the idempotency key, for the demo and
/// the tests. It comes in two kinds: with a lookup by key, and without one (like a provider with
/// no lookup API), which answers [`SentLookup::Unknown`]. It counts every call to `send` beside
/// the mail delivered, since its deduplication would hide a consumer that sends twice.
#[derive(Clone)]
pub struct InMemoryEmailProvider {
    sent: Arc<Mutex<HashMap<String, StockReservedEmail>>>,
    send_calls: Arc<AtomicUsize>,
    answers_lookups: bool,
}

impl Default for InMemoryEmailProvider {
    /// Without lookups: the conservative provider, which leaves a half-done send to a person.
    fn default() -> Self {
        Self::without_lookup()
    }
}

impl InMemoryEmailProvider {
    /// A provider that answers lookups by idempotency key (Sent / NotSent).
    pub fn with_lookup() -> Self {
        Self {
            sent: Arc::default(),
            send_calls: Arc::default(),
            answers_lookups: true,
        }
    }

    /// A provider without a lookup API: every lookup answers Unknown.
    pub fn without_lookup() -> Self {
        Self {
            sent: Arc::default(),
            send_calls: Arc::default(),
            answers_lookups: false,
        }
    }

    /// Distinct emails delivered: one per idempotency key, however often it was sent.
    pub fn sent_count(&self) -> usize {
        self.sent
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .len()
    }

    /// Every call to `send`, repeats under a key already delivered included.
    pub fn send_calls(&self) -> usize {
        self.send_calls.load(Ordering::SeqCst)
    }
}

impl EmailProvider for InMemoryEmailProvider {
    async fn send(
        &self,
        idempotency_key: &str,
        email: &StockReservedEmail,
    ) -> Result<(), ProviderError> {
        self.send_calls.fetch_add(1, Ordering::SeqCst);
        self.sent
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .entry(idempotency_key.to_owned())
            .or_insert_with(|| email.clone());
        Ok(())
    }

    async fn lookup(&self, idempotency_key: &str) -> Result<SentLookup, ProviderError> {
        if !self.answers_lookups {
            return Ok(SentLookup::Unknown);
        }
        let sent = self
            .sent
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .contains_key(idempotency_key);
        Ok(if sent {
            SentLookup::Sent
        } else {
            SentLookup::NotSent
        })
    }
}
