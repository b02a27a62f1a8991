//! A durable email provider for serve mode: [`FileMailbox`] keeps every sent email as one JSON
//! line in a local file, so "sent" survives a crash and a restarted consumer can reconcile a
//! "processing" record by looking its idempotency key up.
//!
//! A send is acknowledged only after its line is on disk (`fsync`), and a key already in the file
//! is not written again. Since that hides a consumer sending twice, every call is logged (at info:
//! written, or a repeat not written) and counted by the process. At open, the lines are read back into an index of keys; a corrupt last
//! line is the torn write of a send that never returned, so it is cut off with a warning. A
//! corrupt line elsewhere is not a torn write, and opening fails rather than guessing. One
//! mailbox owns the file at a time: the file is locked while it is open.

use std::collections::HashSet;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::consumers::{EmailProvider, ProviderError, SentLookup, StockReservedEmail};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;
use uuid::Uuid;

/// Why the mailbox could not open or send. A send's error reaches the consumer as a
/// `ProviderError`, which is retried: nothing was acknowledged as sent.
#[derive(Debug, thiserror::Error)]
pub enum MailboxError {
    #[error("{action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Another mailbox holds the file's lock: two owners would each index only their own sends.
    #[error("{} is already open in another mailbox (this process or another)", path.display())]
    InUse { path: PathBuf },
    /// An unreadable line before the last: damage, not a torn write, so nothing is guessed.
    #[error(
        "{} line {line} is not a sent-mail record (and not a torn last line): {source}",
        path.display()
    )]
    Corrupt {
        path: PathBuf,
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    #[error("encoding a sent-mail record: {0}")]
    Encode(#[source] serde_json::Error),
    /// A failed append left a fragment that could not be cut off; more lines would bury it.
    #[error(
        "{}: a failed append could not be cut off, so nothing more is written; reopen it",
        path.display()
    )]
    Unwritable { path: PathBuf },
    #[error("the mailbox's file task ended abnormally: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// One line of the file.
#[derive(Debug, Serialize, Deserialize)]
struct SentMail {
    idempotency_key: String,
    order_id: Uuid,
    book_id: Uuid,
    quantity: u32,
    sent_at: DateTime<Utc>,
}

/// An email provider whose "sent" folder is an append-only file of JSON lines. Clones share one
/// open file; every send and lookup is serialized on it.
#[derive(Clone)]
pub struct FileMailbox {
    path: Arc<Path>,
    state: Arc<Mutex<State>>,
    /// Calls to `send` since this mailbox was opened, repeats included.
    send_calls: Arc<AtomicUsize>,
}

struct State {
    /// Opened for appending and locked for the lifetime of the mailbox.
    file: File,
    keys: HashSet<String>,
    /// The length of the file's complete lines: where a failed append is cut back to.
    len: u64,
    /// A failed append could not be cut off: writing more would bury a torn line mid-file.
    broken: bool,
}

impl FileMailbox {
    /// Opens (or creates) the mailbox at `path` and reads back the mail it already sent.
    pub async fn open(path: impl Into<PathBuf>) -> Result<Self, MailboxError> {
        let path: Arc<Path> = path.into().into();
        let state = tokio::task::spawn_blocking({
            let path = Arc::clone(&path);
            move || State::load(&path)
        })
        .await??;
        Ok(Self {
            path,
            state: Arc::new(Mutex::new(state)),
            send_calls: Arc::default(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Distinct emails that went out (kept in the file).
    pub async fn sent_count(&self) -> usize {
        self.state.lock().await.keys.len()
    }

    /// Calls to `send` since this mailbox was opened, those under a key already sent included.
    pub fn send_calls(&self) -> usize {
        self.send_calls.load(Ordering::SeqCst)
    }

    async fn append(
        &self,
        idempotency_key: &str,
        email: &StockReservedEmail,
    ) -> Result<(), MailboxError> {
        // An owned guard moves into the blocking task: if this future is dropped mid-write, the
        // task still finishes the append and updates the index before anyone else gets in.
        let mut state = Arc::clone(&self.state).lock_owned().await;
        self.send_calls.fetch_add(1, Ordering::SeqCst);
        if state.keys.contains(idempotency_key) {
            tracing::info!(
                key = idempotency_key,
                "mailbox: a send under a key already sent; not written again"
            );
            return Ok(());
        }
        let record = SentMail {
            idempotency_key: idempotency_key.to_owned(),
            order_id: email.order_id.as_uuid(),
            book_id: email.book_id.as_uuid(),
            quantity: email.quantity.get(),
            sent_at: Utc::now(),
        };
        let mut line = serde_json::to_vec(&record).map_err(MailboxError::Encode)?;
        line.push(b'\n');
        let path = Arc::clone(&self.path);
        tokio::task::spawn_blocking(move || state.append(&path, record.idempotency_key, &line))
            .await??;
        tracing::info!(key = idempotency_key, "mailbox: mail written");
        Ok(())
    }
}

impl EmailProvider for FileMailbox {
    async fn send(
        &self,
        idempotency_key: &str,
        email: &StockReservedEmail,
    ) -> Result<(), ProviderError> {
        self.append(idempotency_key, email)
            .await
            .map_err(|error| ProviderError(error.to_string()))
    }

    async fn lookup(&self, idempotency_key: &str) -> Result<SentLookup, ProviderError> {
        // Waits for an append in flight, so a key is Sent only once its line is on disk.
        Ok(if self.state.lock().await.keys.contains(idempotency_key) {
            SentLookup::Sent
        } else {
            SentLookup::NotSent
        })
    }
}

impl State {
    fn load(path: &Path) -> Result<Self, MailboxError> {
        let io_error = |action: &'static str| {
            move |source: io::Error| MailboxError::Io {
                action,
                path: path.to_owned(),
                source,
            }
        };
        let (mut file, created) = open_or_create(path).map_err(io_error("opening"))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                return Err(MailboxError::InUse {
                    path: path.to_owned(),
                });
            }
            Err(TryLockError::Error(source)) => return Err(io_error("locking")(source)),
        }
        if created {
            // The new directory entry must survive a crash too, or the file with it is lost.
            sync_parent_dir(path).map_err(io_error("syncing the directory of"))?;
        }
        let mut contents = Vec::new();
        file.read_to_end(&mut contents)
            .map_err(io_error("reading"))?;
        let (keys, good_len) = read_lines(path, &contents)?;
        let len = good_len as u64;
        if good_len < contents.len() {
            tracing::warn!(
                path = %path.display(),
                dropped_bytes = contents.len() - good_len,
                "cutting off a torn last line: a send that never returned"
            );
            file.set_len(len)
                .and_then(|()| file.sync_data())
                .map_err(io_error("cutting the torn last line off"))?;
        }
        Ok(Self {
            file,
            keys,
            len,
            broken: false,
        })
    }

    fn append(&mut self, path: &Path, key: String, line: &[u8]) -> Result<(), MailboxError> {
        if self.broken {
            return Err(MailboxError::Unwritable {
                path: path.to_owned(),
            });
        }
        match self
            .file
            .write_all(line)
            .and_then(|()| self.file.sync_data())
        {
            Ok(()) => {
                self.len += line.len() as u64;
                self.keys.insert(key);
                Ok(())
            }
            Err(source) => {
                // Not acknowledged, so not sent: cut a partial line off so the next append starts
                // on a clean line instead of gluing itself to the fragment.
                if self
                    .file
                    .set_len(self.len)
                    .and_then(|()| self.file.sync_data())
                    .is_err()
                {
                    self.broken = true;
                }
                Err(MailboxError::Io {
                    action: "appending to",
                    path: path.to_owned(),
                    source,
                })
            }
        }
    }
}

/// Opens `path` for reading and appending; true when this call created it.
fn open_or_create(path: &Path) -> io::Result<(File, bool)> {
    let mut options = OpenOptions::new();
    options.read(true).append(true);
    match options.clone().create_new(true).open(path) {
        Ok(file) => Ok((file, true)),
        Err(error) if error.kind() == io::ErrorKind::AlreadyExists => {
            Ok((options.open(path)?, false))
        }
        Err(error) => Err(error),
    }
}

#[cfg(unix)]
fn sync_parent_dir(path: &Path) -> io::Result<()> {
    let parent = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    File::open(parent)?.sync_all()
}

#[cfg(not(unix))]
fn sync_parent_dir(_path: &Path) -> io::Result<()> {
    // Directories cannot be opened for syncing here; the file's own sync is what is available.
    Ok(())
}

/// The keys of the file's records and the length of its good prefix. Only the last line may be
/// unreadable (a torn write); it is left out of the prefix.
fn read_lines(path: &Path, contents: &[u8]) -> Result<(HashSet<String>, usize), MailboxError> {
    let mut keys = HashSet::new();
    let mut good_len = 0;
    let mut lines = contents.split_inclusive(|byte| *byte == b'\n').peekable();
    let mut number = 0;
    while let Some(line) = lines.next() {
        number += 1;
        let is_last = lines.peek().is_none();
        let Some(body) = line.strip_suffix(b"\n") else {
            // No newline: the write stopped inside the line. Only the last line can lack one.
            break;
        };
        if body.iter().all(u8::is_ascii_whitespace) {
            good_len += line.len();
            continue;
        }
        match serde_json::from_slice::<SentMail>(body) {
            Ok(record) => {
                keys.insert(record.idempotency_key);
                good_len += line.len();
            }
            Err(_) if is_last => break,
            Err(source) => {
                return Err(MailboxError::Corrupt {
                    path: path.to_owned(),
                    line: number,
                    source,
                });
            }
        }
    }
    Ok((keys, good_len))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"idempotency_key":"a","order_id":"0190f5c4-3c2e-7b4a-9d3e-aaaaaaaaaaaa","book_id":"0190f5c4-3c2e-7b4a-9d3e-bbbbbbbbbbbb","quantity":2,"sent_at":"2025-01-01T00:00:00Z"}"#;

    #[test]
    fn a_torn_last_line_is_left_out_of_the_good_prefix() -> Result<(), MailboxError> {
        let contents = format!("{GOOD}\n{{\"idempotency_key\":\"b\",\"ord");
        let (keys, good_len) = read_lines(Path::new("sent.jsonl"), contents.as_bytes())?;
        assert_eq!(keys, HashSet::from(["a".to_owned()]));
        assert_eq!(good_len, GOOD.len() + 1);
        Ok(())
    }

    #[test]
    fn an_unreadable_last_line_with_its_newline_is_torn_too() -> Result<(), MailboxError> {
        let contents = format!("{GOOD}\n\0\0\0\n");
        let (keys, good_len) = read_lines(Path::new("sent.jsonl"), contents.as_bytes())?;
        assert_eq!(keys.len(), 1);
        assert_eq!(good_len, GOOD.len() + 1);
        Ok(())
    }

    #[test]
    fn a_corrupt_line_before_the_last_is_an_error() {
        let contents = format!("{GOOD}\nnot json\n{GOOD}\n");
        let result = read_lines(Path::new("sent.jsonl"), contents.as_bytes());
        assert!(matches!(result, Err(MailboxError::Corrupt { line: 2, .. })));
    }
}
