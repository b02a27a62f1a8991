//! The two-phase record around a side effect outside the transaction.

use inventory_benches::faults;
use inventory_benches::mail::InMemoryEmailProvider;
use inventory_benches::readback::Readback as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use inventory_benches::consumers::{EMAIL_CONSUMER, EmailConsumer};
use inventory_benches::consumers::{EmailProvider, ProviderError, SentLookup, StockReservedEmail};
use inventory_benches::mailbox::{FileMailbox, MailboxError};
use inventory_domain::{
    BookId, ConsumerName, DeadLetterReason, Effect, MessageId, OrderId, Outcome, Quantity,
};
use inventory_infra::CrashPoint;
use inventory_infra::HandleError;
use inventory_tests::{TestDb, crash_at, on_both_backends, stock_reserved};

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

/// Emails delivered, and calls to `send`: the provider drops a repeat under a delivered key, so
/// only the calls show a consumer that sent twice.
fn sent_and_calls(provider: &InMemoryEmailProvider) -> (usize, usize) {
    (provider.sent_count(), provider.send_calls())
}

fn needs_reconciliation(outcome: &Outcome) -> bool {
    matches!(outcome, Outcome::Refused(refusal) if refusal.reason == DeadLetterReason::NeedsReconciliation)
}

async fn email_is_sent_once_and_a_redelivery_skipped(db: TestDb) {
    let provider = InMemoryEmailProvider::default();
    let consumer = email_consumer(&db, EMAIL_CONSUMER, provider.clone());
    let message = stock_reserved(db.dune(10).await, 2);
    assert!(consumer.handle(&message).await.unwrap().processed());
    assert_eq!(consumer.handle(&message).await.unwrap(), Outcome::Duplicate);
    assert_eq!(sent_and_calls(&provider), (1, 1));
    let record = db
        .stock
        .inbox_entry(&message.key.storage_key(), EMAIL_CONSUMER)
        .await
        .unwrap()
        .unwrap();
    assert!(record.completed);
}

async fn email_crash_after_send_needs_reconciliation_not_a_resend(db: TestDb) {
    // No lookup API: the redelivery cannot tell whether the mail went out.
    let provider = InMemoryEmailProvider::without_lookup();
    let consumer = email_consumer(&db, EMAIL_CONSUMER, provider.clone());
    let message = stock_reserved(db.dune(10).await, 2);
    crash_at(&message, CrashPoint::AfterSend, |faults| {
        consumer.with_faults(faults)
    })
    .await;
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
    assert_eq!(sent_and_calls(&provider), (1, 1));
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
    let message = stock_reserved(db.dune(10).await, 2);
    assert!(matches!(
        consumer.handle(&message).await,
        Err(HandleError::Unavailable(_))
    ));
    let record = db
        .stock
        .inbox_entry(&message.key.storage_key(), EMAIL_CONSUMER)
        .await
        .unwrap();
    assert_eq!(record, None);
    assert!(consumer.handle(&message).await.unwrap().processed());
    assert_eq!(sent_and_calls(&provider.inner), (1, 1));
}

async fn email_each_consumer_name_has_its_own_record(db: TestDb) {
    let first = InMemoryEmailProvider::default();
    let second = InMemoryEmailProvider::default();
    let message = stock_reserved(db.dune(10).await, 2);
    let one = email_consumer(&db, "emails-a", first.clone());
    let two = email_consumer(&db, "emails-b", second.clone());
    assert!(one.handle(&message).await.unwrap().processed());
    assert!(two.handle(&message).await.unwrap().processed());
    assert_eq!(
        (sent_and_calls(&first), sent_and_calls(&second)),
        ((1, 1), (1, 1))
    );
}

async fn completed(db: &TestDb, key: &str) -> bool {
    db.stock
        .inbox_entry(key, EMAIL_CONSUMER)
        .await
        .unwrap()
        .expect("an inbox record")
        .completed
}

async fn email_crash_after_send_with_lookup_is_reconciled_without_a_resend(db: TestDb) {
    let provider = InMemoryEmailProvider::with_lookup();
    let consumer = email_consumer(&db, EMAIL_CONSUMER, provider.clone());
    let message = stock_reserved(db.dune(10).await, 2);
    let key = message.key.storage_key();
    crash_at(&message, CrashPoint::AfterSend, |faults| {
        consumer.with_faults(faults)
    })
    .await;
    assert!(!completed(&db, &key).await);
    assert_eq!(
        consumer.handle(&message).await.unwrap(),
        Outcome::Processed(Effect::EmailReconciled)
    );
    assert!(completed(&db, &key).await);
    assert_eq!(consumer.handle(&message).await.unwrap(), Outcome::Duplicate);
    assert_eq!(sent_and_calls(&provider), (1, 1));
}

async fn email_crash_after_claim_with_lookup_sends_once_on_redelivery(db: TestDb) {
    let provider = InMemoryEmailProvider::with_lookup();
    let consumer = email_consumer(&db, EMAIL_CONSUMER, provider.clone());
    let message = stock_reserved(db.dune(10).await, 2);
    let key = message.key.storage_key();
    crash_at(&message, CrashPoint::AfterDedupCheck, |faults| {
        consumer.with_faults(faults)
    })
    .await;
    assert_eq!(sent_and_calls(&provider), (0, 0));
    assert!(!completed(&db, &key).await, "claimed, nothing sent");
    assert_eq!(
        consumer.handle(&message).await.unwrap(),
        Outcome::Processed(Effect::EmailSent)
    );
    assert_eq!(sent_and_calls(&provider), (1, 1));
    assert!(completed(&db, &key).await);
    assert_eq!(consumer.handle(&message).await.unwrap(), Outcome::Duplicate);
    assert_eq!(sent_and_calls(&provider), (1, 1));
}

/// The reconciling delivery passes the same crash points as a first one: dying after its own
/// send leaves the record processing, and the next delivery reconciles it.
async fn email_crash_after_a_reconciling_send_is_reconciled_next(db: TestDb) {
    let provider = InMemoryEmailProvider::with_lookup();
    let consumer = email_consumer(&db, EMAIL_CONSUMER, provider.clone());
    let message = stock_reserved(db.dune(10).await, 2);
    let key = message.key.storage_key();
    crash_at(&message, CrashPoint::AfterDedupCheck, |faults| {
        consumer.with_faults(faults)
    })
    .await;
    crash_at(&message, CrashPoint::AfterSend, |faults| {
        consumer.with_faults(faults)
    })
    .await;
    assert_eq!(sent_and_calls(&provider), (1, 1));
    assert!(!completed(&db, &key).await);
    assert_eq!(
        consumer.handle(&message).await.unwrap(),
        Outcome::Processed(Effect::EmailReconciled)
    );
    assert!(completed(&db, &key).await);
    assert_eq!(sent_and_calls(&provider), (1, 1));
}

/// A provider with lookups whose first lookup fails.
#[derive(Clone)]
struct LookupFailsOnce {
    failed: Arc<AtomicBool>,
    inner: InMemoryEmailProvider,
}

impl EmailProvider for LookupFailsOnce {
    async fn send(&self, key: &str, email: &StockReservedEmail) -> Result<(), ProviderError> {
        self.inner.send(key, email).await
    }

    async fn lookup(&self, key: &str) -> Result<SentLookup, ProviderError> {
        if !self.failed.swap(true, Ordering::SeqCst) {
            return Err(ProviderError("lookup timed out".into()));
        }
        self.inner.lookup(key).await
    }
}

async fn email_lookup_failure_is_retryable_and_keeps_the_record(db: TestDb) {
    let provider = LookupFailsOnce {
        failed: Arc::default(),
        inner: InMemoryEmailProvider::with_lookup(),
    };
    let consumer = email_consumer(&db, EMAIL_CONSUMER, provider.clone());
    let message = stock_reserved(db.dune(10).await, 2);
    let key = message.key.storage_key();
    let crashed = consumer
        .with_faults(faults::crash_once_at(CrashPoint::AfterSend))
        .handle(&message)
        .await;
    assert!(crashed.is_err());
    assert!(matches!(
        consumer.handle(&message).await,
        Err(HandleError::Unavailable(_))
    ));
    assert!(
        !completed(&db, &key).await,
        "still processing after the error"
    );
    assert_eq!(
        consumer.handle(&message).await.unwrap(),
        Outcome::Processed(Effect::EmailReconciled)
    );
    assert_eq!(sent_and_calls(&provider.inner), (1, 1));
}

/// Two copies at once: the first is held between its claim and its send, the second finds the
/// record processing, looks up NotSent and sends. When the first goes on it sends under the same
/// idempotency key, which the provider drops: two calls, one email. A third copy finds the record
/// completed and calls nothing.
async fn email_two_copies_at_once_send_one_email(db: TestDb) {
    let provider = InMemoryEmailProvider::with_lookup();
    let consumer = email_consumer(&db, EMAIL_CONSUMER, provider.clone());
    let message = stock_reserved(db.dune(10).await, 2);
    let (faults, mut hold) = faults::hold_once_at(CrashPoint::AfterDedupCheck);
    let first = tokio::spawn({
        let consumer = consumer.with_faults(faults);
        let message = message.clone();
        async move { consumer.handle(&message).await }
    });
    hold.reached().await;
    let second = consumer.handle(&message).await.unwrap();
    assert_eq!(second, Outcome::Processed(Effect::EmailSent));
    hold.release();
    let first = first.await.unwrap().unwrap();
    assert_eq!(first, Outcome::Processed(Effect::EmailSent));
    assert_eq!(sent_and_calls(&provider), (1, 2));
    assert!(completed(&db, &message.key.storage_key()).await);
    assert_eq!(consumer.handle(&message).await.unwrap(), Outcome::Duplicate);
    assert_eq!(sent_and_calls(&provider), (1, 2));
}

/// A file path of its own under the temporary directory, removed when the test ends.
struct TempFile(PathBuf);

impl TempFile {
    fn new() -> Self {
        Self(
            std::env::temp_dir().join(format!("inventory-mailbox-{}.jsonl", MessageId::generate())),
        )
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn lines_in(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

fn an_email() -> StockReservedEmail {
    StockReservedEmail {
        order_id: OrderId::new_v7(),
        book_id: BookId::new_v7(),
        quantity: Quantity::new(2).unwrap(),
    }
}

async fn email_with_a_file_mailbox_is_reconciled_after_a_restart(db: TestDb) {
    let file = TempFile::new();
    let message = stock_reserved(db.dune(10).await, 2);
    let key = message.key.storage_key();
    {
        let mailbox = FileMailbox::open(&file.0).await.unwrap();
        let consumer = email_consumer(&db, EMAIL_CONSUMER, mailbox);
        crash_at(&message, CrashPoint::AfterSend, |faults| {
            consumer.with_faults(faults)
        })
        .await;
        // The process dies here: the consumer and its mailbox go away.
    }
    assert!(!completed(&db, &key).await);
    let mailbox = FileMailbox::open(&file.0).await.unwrap();
    let consumer = email_consumer(&db, EMAIL_CONSUMER, mailbox.clone());
    assert_eq!(
        consumer.handle(&message).await.unwrap(),
        Outcome::Processed(Effect::EmailReconciled)
    );
    assert!(completed(&db, &key).await);
    assert_eq!(mailbox.sent_count().await, 1);
    assert_eq!(
        mailbox.send_calls(),
        0,
        "reconciled by the lookup, not sent again"
    );
    let lines = lines_in(&file.0);
    assert_eq!(lines.len(), 1);
    assert!(lines[0].contains(key.as_ref()));
}

on_both_backends!(
    email_is_sent_once_and_a_redelivery_skipped,
    email_crash_after_send_needs_reconciliation_not_a_resend,
    email_provider_refusal_frees_the_claim_for_the_retry,
    email_each_consumer_name_has_its_own_record,
    email_crash_after_send_with_lookup_is_reconciled_without_a_resend,
    email_crash_after_claim_with_lookup_sends_once_on_redelivery,
    email_crash_after_a_reconciling_send_is_reconciled_next,
    email_lookup_failure_is_retryable_and_keeps_the_record,
    email_two_copies_at_once_send_one_email,
    email_with_a_file_mailbox_is_reconciled_after_a_restart,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_mailbox_keeps_sent_mail_across_a_reopen() {
    let file = TempFile::new();
    let mailbox = FileMailbox::open(&file.0).await.unwrap();
    assert_eq!(
        mailbox.lookup("order-1").await.unwrap(),
        SentLookup::NotSent
    );
    mailbox.send("order-1", &an_email()).await.unwrap();
    assert_eq!(mailbox.lookup("order-1").await.unwrap(), SentLookup::Sent);
    drop(mailbox);

    let reopened = FileMailbox::open(&file.0).await.unwrap();
    assert_eq!(reopened.sent_count().await, 1);
    assert_eq!(reopened.lookup("order-1").await.unwrap(), SentLookup::Sent);
    assert_eq!(
        reopened.lookup("order-2").await.unwrap(),
        SentLookup::NotSent
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_mailbox_sends_once_per_idempotency_key() {
    let file = TempFile::new();
    let mailbox = FileMailbox::open(&file.0).await.unwrap();
    let email = an_email();
    mailbox.send("order-1", &email).await.unwrap();
    mailbox.send("order-1", &email).await.unwrap();
    assert_eq!(mailbox.sent_count().await, 1);
    assert_eq!(
        mailbox.send_calls(),
        2,
        "the repeat is counted, not written"
    );
    assert_eq!(lines_in(&file.0).len(), 1);
    drop(mailbox);

    // The index is rebuilt from the file: a send after the reopen is still a repeat.
    let reopened = FileMailbox::open(&file.0).await.unwrap();
    reopened.send("order-1", &email).await.unwrap();
    reopened.send("order-2", &an_email()).await.unwrap();
    assert_eq!(reopened.sent_count().await, 2);
    assert_eq!(lines_in(&file.0).len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_mailbox_concurrent_sends_of_one_key_write_one_line() {
    let file = TempFile::new();
    let mailbox = FileMailbox::open(&file.0).await.unwrap();
    let email = an_email();
    let sends: Vec<_> = (0..8)
        .map(|_| {
            let mailbox = mailbox.clone();
            let email = email.clone();
            tokio::spawn(async move { mailbox.send("order-1", &email).await })
        })
        .collect();
    for send in sends {
        send.await.unwrap().unwrap();
    }
    assert_eq!(mailbox.sent_count().await, 1);
    assert_eq!(lines_in(&file.0).len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_mailbox_cuts_off_a_torn_last_line() {
    let file = TempFile::new();
    let mailbox = FileMailbox::open(&file.0).await.unwrap();
    mailbox.send("order-1", &an_email()).await.unwrap();
    drop(mailbox);
    // A crash in the middle of writing the next line.
    let mut contents = std::fs::read(&file.0).unwrap();
    contents.extend_from_slice(br#"{"idempotency_key":"order-2","ord"#);
    std::fs::write(&file.0, contents).unwrap();

    let reopened = FileMailbox::open(&file.0).await.unwrap();
    assert_eq!(reopened.sent_count().await, 1);
    assert_eq!(
        reopened.lookup("order-2").await.unwrap(),
        SentLookup::NotSent
    );
    reopened.send("order-2", &an_email()).await.unwrap();
    let lines = lines_in(&file.0);
    assert_eq!(lines.len(), 2, "the new line starts on a clean line");
    assert!(lines.iter().all(|line| line.ends_with('}')));
    drop(reopened);

    let again = FileMailbox::open(&file.0).await.unwrap();
    assert_eq!(again.lookup("order-2").await.unwrap(), SentLookup::Sent);
    assert_eq!(again.sent_count().await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_mailbox_refuses_a_corrupt_line_before_the_last() {
    let file = TempFile::new();
    let mailbox = FileMailbox::open(&file.0).await.unwrap();
    mailbox.send("order-1", &an_email()).await.unwrap();
    drop(mailbox);
    let good = std::fs::read_to_string(&file.0).unwrap();
    std::fs::write(&file.0, format!("{good}not a record\n{good}")).unwrap();
    assert!(matches!(
        FileMailbox::open(&file.0).await,
        Err(MailboxError::Corrupt { line: 2, .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_mailbox_is_owned_by_one_opener_at_a_time() {
    let file = TempFile::new();
    let first = FileMailbox::open(&file.0).await.unwrap();
    assert!(matches!(
        FileMailbox::open(&file.0).await,
        Err(MailboxError::InUse { .. })
    ));
    drop(first);
    assert!(FileMailbox::open(&file.0).await.is_ok());
}
