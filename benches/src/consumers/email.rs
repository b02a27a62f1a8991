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

use super::{EmailProvider, SentLookup, StockReservedEmail};
use chrono::Utc;
use inventory_domain::{ConsumerName, DeadLetterReason, Effect, Event, Message, Outcome};
use sea_orm::sea_query::Expr;
use sea_orm::{ColumnTrait, DatabaseConnection, DbErr, EntityTrait, QueryFilter};

use crate::entities::inbox;
use crate::payload_hash::PayloadHash;
use crate::readback::find_inbox_entry;
use inventory_infra::{CrashPoint, Faults, HandleError};

use super::compare_payload;
use super::inbox::claim_on_conflict;

/// The contract's durable consumer for the email handler.
pub const EMAIL_CONSUMER: &str = "notifications-stock-reserved-email";

#[derive(Clone)]
pub struct EmailConsumer<P> {
    db: DatabaseConnection,
    consumer: ConsumerName,
    provider: P,
    faults: Faults,
}

impl<P: EmailProvider + Clone> EmailConsumer<P> {
    pub fn new(db: DatabaseConnection, consumer: ConsumerName, provider: P) -> Self {
        Self {
            db,
            consumer,
            provider,
            faults: Faults::none(),
        }
    }

    pub fn consumer(&self) -> &ConsumerName {
        &self.consumer
    }

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
        let hash = PayloadHash::of(message);
        let email = StockReservedEmail {
            order_id: reserved.order_id,
            book_id: reserved.book_id,
            quantity: reserved.quantity,
        };
        if !claim_on_conflict(&self.db, &key, &self.consumer, &hash, false).await? {
            return self.judge_earlier_claim(&key, &hash, &email).await;
        }
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
                self.faults.pass(CrashPoint::AfterDedupCheck).await?;
                // On a refusal the row stays "processing": the retry looks up again.
                self.provider.send(key, email).await?;
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
