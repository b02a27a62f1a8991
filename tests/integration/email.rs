//! The two-phase record around a side effect outside the transaction.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use inventory_domain::{
    ConsumerName, CrashPoint, DeadLetterReason, EmailProvider, Outcome, ProviderError,
    StockReservedEmail,
};
use inventory_infra::{EMAIL_CONSUMER, EmailConsumer, Faults, HandleError, InMemoryEmailProvider};
use inventory_tests::{TestDb, on_both_backends, placed};

fn email_consumer<P: EmailProvider + Clone>(
    db: &TestDb,
    name: &str,
    provider: P,
) -> EmailConsumer<P> {
    EmailConsumer::new(
        db.conn.clone(),
        ConsumerName::parse(name).unwrap(),
        provider,
    )
}

fn needs_reconciliation(outcome: &Outcome) -> bool {
    matches!(outcome, Outcome::Refused(refusal) if refusal.reason == DeadLetterReason::NeedsReconciliation)
}

async fn email_is_sent_once_and_a_redelivery_skipped(db: TestDb) {
    let provider = InMemoryEmailProvider::default();
    let consumer = email_consumer(&db, EMAIL_CONSUMER, provider.clone());
    let message = placed(db.dune(10).await, 2);
    assert!(consumer.handle(&message).await.unwrap().processed());
    assert_eq!(consumer.handle(&message).await.unwrap(), Outcome::Duplicate);
    assert_eq!(provider.sent_count(), 1);
    let record = db
        .stock
        .inbox_entry(&message.key.storage_key(), EMAIL_CONSUMER)
        .await
        .unwrap()
        .unwrap();
    assert!(record.completed);
}

async fn email_crash_after_send_needs_reconciliation_not_a_resend(db: TestDb) {
    let provider = InMemoryEmailProvider::default();
    let consumer = email_consumer(&db, EMAIL_CONSUMER, provider.clone());
    let message = placed(db.dune(10).await, 2);
    let crashed = consumer
        .with_faults(Faults::crash_once_at(CrashPoint::AfterSend))
        .handle(&message)
        .await;
    assert!(matches!(
        crashed,
        Err(HandleError::Crashed(CrashPoint::AfterSend))
    ));
    let record = db
        .stock
        .inbox_entry(&message.key.storage_key(), EMAIL_CONSUMER)
        .await
        .unwrap()
        .unwrap();
    assert!(!record.completed, "the record still says processing");
    for _ in 0..2 {
        assert!(needs_reconciliation(
            &consumer.handle(&message).await.unwrap()
        ));
    }
    assert_eq!(provider.sent_count(), 1);
}

/// A provider that refuses its first call, then sends.
#[derive(Clone, Default)]
struct FailsOnce {
    failed: Arc<AtomicBool>,
    inner: InMemoryEmailProvider,
}

impl EmailProvider for FailsOnce {
    async fn send(&self, key: &str, email: &StockReservedEmail) -> Result<(), ProviderError> {
        if !self.failed.swap(true, Ordering::SeqCst) {
            return Err(ProviderError("503 from the provider".into()));
        }
        self.inner.send(key, email).await
    }
}

async fn email_provider_refusal_frees_the_claim_for_the_retry(db: TestDb) {
    let provider = FailsOnce::default();
    let consumer = email_consumer(&db, EMAIL_CONSUMER, provider.clone());
    let message = placed(db.dune(10).await, 2);
    assert!(matches!(
        consumer.handle(&message).await,
        Err(HandleError::Provider(_))
    ));
    let record = db
        .stock
        .inbox_entry(&message.key.storage_key(), EMAIL_CONSUMER)
        .await
        .unwrap();
    assert_eq!(record, None);
    assert!(consumer.handle(&message).await.unwrap().processed());
    assert_eq!(provider.inner.sent_count(), 1);
}

async fn email_each_consumer_name_has_its_own_record(db: TestDb) {
    let first = InMemoryEmailProvider::default();
    let second = InMemoryEmailProvider::default();
    let message = placed(db.dune(10).await, 2);
    let one = email_consumer(&db, "emails-a", first.clone());
    let two = email_consumer(&db, "emails-b", second.clone());
    assert!(one.handle(&message).await.unwrap().processed());
    assert!(two.handle(&message).await.unwrap().processed());
    assert_eq!((first.sent_count(), second.sent_count()), (1, 1));
}

on_both_backends!(
    email_is_sent_once_and_a_redelivery_skipped,
    email_crash_after_send_needs_reconciliation_not_a_resend,
    email_provider_refusal_frees_the_claim_for_the_retry,
    email_each_consumer_name_has_its_own_record,
);
