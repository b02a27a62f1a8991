//! The two-phase record for a side effect that cannot join a transaction: an email.
//!
//! Phase one commits an inbox row with `completed_at` NULL ("processing"); the provider is then
//! called with the message id as its idempotency key; phase two sets `completed_at`. A delivery
//! that finds "processing" cannot know whether the mail went out, so it answers
//! NeedsReconciliation instead of sending blind.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use chrono::Utc;
use inventory_domain::{
    ConsumerName, CrashPoint, DeadLetterReason, Effect, EmailProvider, Event, Message, Outcome,
    ProviderError, StockReservedEmail,
};
use sea_orm::sea_query::Expr;
use sea_orm::{ColumnTrait, DatabaseConnection, DbErr, EntityTrait, QueryFilter};

use super::inbox::claim_on_conflict;
use super::{HandleError, compare_payload};
use crate::entities::inbox;
use crate::faults::Faults;
use crate::stock::find_inbox_entry;

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

    pub fn with_faults(&self, faults: Faults) -> Self {
        Self {
            faults,
            ..self.clone()
        }
    }

    #[tracing::instrument(skip_all, fields(consumer = %self.consumer, key = %message.key))]
    pub async fn handle(&self, message: &Message) -> Result<Outcome, HandleError> {
        let Event::Placed(placed) = &message.event else {
            return Ok(Outcome::refused(
                DeadLetterReason::Invalid,
                "the stock-reserved email consumer handles OrderPlaced only",
            ));
        };
        let key = message.key.storage_key();
        let hash = message.payload_hash();
        if !claim_on_conflict(&self.db, &key, &self.consumer, &hash, false).await? {
            return self.judge_earlier_claim(&key, &hash).await;
        }
        self.faults.pass(CrashPoint::AfterDedupCheck).await?;
        let email = StockReservedEmail {
            order_id: placed.order_id,
            book_id: placed.book_id,
            quantity: placed.quantity,
        };
        if let Err(error) = self.provider.send(&key, &email).await {
            // The provider refused it, so nothing went out: free the claim for the retry.
            inbox::Entity::delete_by_id((key.clone(), self.consumer.as_str().to_owned()))
                .exec(&self.db)
                .await?;
            return Err(error.into());
        }
        self.faults.pass(CrashPoint::AfterSend).await?;
        inbox::Entity::update_many()
            .col_expr(inbox::Column::CompletedAt, Expr::value(Some(Utc::now())))
            .filter(inbox::Column::MessageId.eq(key.as_str()))
            .filter(inbox::Column::Consumer.eq(self.consumer.as_str()))
            .exec(&self.db)
            .await?;
        Ok(Outcome::Processed(Effect::EmailSent))
    }

    async fn judge_earlier_claim(
        &self,
        key: &str,
        hash: &inventory_domain::PayloadHash,
    ) -> Result<Outcome, HandleError> {
        let existing = find_inbox_entry(&self.db, key, self.consumer.as_str())
            .await?
            .ok_or_else(|| DbErr::RecordNotFound(format!("inbox row {key} vanished")))?;
        let same = compare_payload(&existing.payload_hash, hash);
        Ok(match (same, existing.completed_at) {
            (Outcome::Duplicate, None) => Outcome::refused(
                DeadLetterReason::NeedsReconciliation,
                "an earlier delivery started sending and never finished; not resending blind",
            ),
            (outcome, _) => outcome,
        })
    }
}

/// A provider that keeps sent mail in memory and honours the idempotency key, for the demo and
/// the tests.
#[derive(Clone, Default)]
pub struct InMemoryEmailProvider {
    sent: Arc<Mutex<HashMap<String, StockReservedEmail>>>,
}

impl InMemoryEmailProvider {
    /// Distinct emails that went out.
    pub fn sent_count(&self) -> usize {
        self.sent
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .len()
    }
}

impl EmailProvider for InMemoryEmailProvider {
    async fn send(
        &self,
        idempotency_key: &str,
        email: &StockReservedEmail,
    ) -> Result<(), ProviderError> {
        self.sent
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .entry(idempotency_key.to_owned())
            .or_insert_with(|| email.clone());
        Ok(())
    }
}
