//! The two-phase record for a side effect that cannot join a transaction: an email, one per
//! StockReserved event Inventory published (`inventory.stock.reserved`), keyed by the event id.
//! A rejection publishes no StockReserved, and a cancellation's StockReleased is not this
//! consumer's, so neither sends mail.
//!
//! Phase one commits an inbox row with `completed_at` NULL ("processing"); the provider is then
//! called with the message id as its idempotency key; phase two sets `completed_at`. A delivery
//! that finds "processing" asks the provider whether mail under that key went out: sent, it
//! completes the record without sending; not sent, it sends now; a provider that cannot say gets
//! NeedsReconciliation instead of a blind resend.
//!
//! Concurrency: the claim row decides which delivery sends first. A redelivery that finds the row
//! "processing" while the first delivery is still between its claim and its send may look up
//! NotSent and send too; both sends carry the same idempotency key, so a provider that honours
//! it (as [`crate::mailbox::FileMailbox`] does) sends one email. A
//! provider with a lookup API but no deduplication by key would not be safe here.

use chrono::Utc;
use inventory_domain::{
    ConsumerName, DeadLetterReason, Effect, EmailProvider, Event, Message, Outcome, PayloadHash,
    SentLookup, StockReservedEmail,
};
use sea_orm::sea_query::Expr;
use sea_orm::{ColumnTrait, DatabaseConnection, DbErr, EntityTrait, QueryFilter};

use super::inbox::claim_on_conflict;
use super::{HandleError, compare_payload};
use crate::entities::inbox;
#[cfg(feature = "harness")]
use crate::faults::{CrashPoint, Faults};
use crate::stock::find_inbox_entry;

/// The contract's durable consumer for the email handler.
pub const EMAIL_CONSUMER: &str = "notifications-stock-reserved-email";

#[derive(Clone)]
pub struct EmailConsumer<P> {
    db: DatabaseConnection,
    consumer: ConsumerName,
    provider: P,
    #[cfg(feature = "harness")]
    faults: Faults,
}

impl<P: EmailProvider + Clone> EmailConsumer<P> {
    pub fn new(db: DatabaseConnection, consumer: ConsumerName, provider: P) -> Self {
        Self {
            db,
            consumer,
            provider,
            #[cfg(feature = "harness")]
            faults: Faults::none(),
        }
    }

    pub fn consumer(&self) -> &ConsumerName {
        &self.consumer
    }

    #[cfg(feature = "harness")]
    pub fn with_faults(&self, faults: Faults) -> Self {
        Self {
            faults,
            ..self.clone()
        }
    }

    #[tracing::instrument(skip_all, fields(consumer = %self.consumer, key = %message.key))]
    pub async fn handle(&self, message: &Message) -> Result<Outcome, HandleError> {
        let Event::StockReserved(reserved) = &message.event else {
            return Ok(Outcome::refused(
                DeadLetterReason::Invalid,
                "the stock-reserved email consumer handles StockReserved only",
            ));
        };
        // The event's id: its two-phase record's key and the provider's idempotency key.
        let key = message.key.storage_key();
        let hash = message.payload_hash();
        let email = StockReservedEmail {
            order_id: reserved.order_id,
            book_id: reserved.book_id,
            quantity: reserved.quantity,
        };
        if !claim_on_conflict(&self.db, &key, &self.consumer, &hash, false).await? {
            return self.judge_earlier_claim(&key, &hash, &email).await;
        }
        #[cfg(feature = "harness")]
        self.faults.pass(CrashPoint::AfterDedupCheck).await?;
        if let Err(error) = self.provider.send(&key, &email).await {
            // The provider refused it, so nothing went out: free the claim for the retry. A row a
            // concurrent reconciliation already completed stays.
            inbox::Entity::delete_many()
                .filter(inbox::Column::MessageId.eq(key.as_ref()))
                .filter(inbox::Column::Consumer.eq(self.consumer.as_str()))
                .filter(inbox::Column::CompletedAt.is_null())
                .exec(&self.db)
                .await?;
            return Err(error.into());
        }
        #[cfg(feature = "harness")]
        self.faults.pass(CrashPoint::AfterSend).await?;
        self.mark_completed(&key, &hash).await?;
        Ok(Outcome::Processed(Effect::EmailSent))
    }

    async fn judge_earlier_claim(
        &self,
        key: &str,
        hash: &PayloadHash,
        email: &StockReservedEmail,
    ) -> Result<Outcome, HandleError> {
        let existing = find_inbox_entry(&self.db, key, self.consumer.as_str())
            .await?
            .ok_or_else(|| DbErr::RecordNotFound(format!("inbox row {key} vanished")))?;
        match compare_payload(&existing.payload_hash, hash) {
            Outcome::Duplicate if existing.completed_at.is_none() => {
                self.reconcile(key, hash, email).await
            }
            outcome => Ok(outcome),
        }
    }

    /// An earlier delivery claimed the key and never completed: ask the provider what happened.
    async fn reconcile(
        &self,
        key: &str,
        hash: &PayloadHash,
        email: &StockReservedEmail,
    ) -> Result<Outcome, HandleError> {
        // A lookup error is the provider being unavailable: retry later, the row stays as it is.
        let answer = self.provider.lookup(key).await?;
        tracing::info!(?answer, "an earlier delivery left the record processing");
        match answer {
            SentLookup::Sent => {
                self.mark_completed(key, hash).await?;
                Ok(Outcome::Processed(Effect::EmailReconciled))
            }
            SentLookup::NotSent => {
                // The lookup is this delivery's dedup check; the same crash points follow it as
                // on a first delivery, so a crash here is reconciled by the next one.
                #[cfg(feature = "harness")]
                self.faults.pass(CrashPoint::AfterDedupCheck).await?;
                // On a refusal the row stays "processing": the retry looks up again.
                self.provider.send(key, email).await?;
                #[cfg(feature = "harness")]
                self.faults.pass(CrashPoint::AfterSend).await?;
                self.mark_completed(key, hash).await?;
                Ok(Outcome::Processed(Effect::EmailSent))
            }
            SentLookup::Unknown => Ok(Outcome::refused(
                DeadLetterReason::NeedsReconciliation,
                "an earlier delivery started sending and never finished, and the provider cannot \
                 say whether it went out; not resending blind",
            )),
        }
    }

    /// Phase two: the email went out, so the record says completed.
    async fn mark_completed(&self, key: &str, hash: &PayloadHash) -> Result<(), DbErr> {
        // Only a processing row: a concurrent delivery that completed first keeps its time.
        let updated = inbox::Entity::update_many()
            .col_expr(inbox::Column::CompletedAt, Expr::value(Some(Utc::now())))
            .filter(inbox::Column::MessageId.eq(key))
            .filter(inbox::Column::Consumer.eq(self.consumer.as_str()))
            .filter(inbox::Column::CompletedAt.is_null())
            .exec(&self.db)
            .await?;
        if updated.rows_affected == 0 {
            // Already completed, or freed by a concurrent delivery whose own send failed: the
            // mail went out, so make sure a completed record exists (a no-op in the first case).
            claim_on_conflict(&self.db, key, &self.consumer, hash, true).await?;
        }
        Ok(())
    }
}

#[cfg(feature = "harness")]
pub use in_memory::InMemoryEmailProvider;

#[cfg(feature = "harness")]
mod in_memory {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use inventory_domain::{EmailProvider, ProviderError, SentLookup, StockReservedEmail};

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
}
