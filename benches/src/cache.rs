//! A dedup cache on a real Redis, the two ways the study uses it: as a pre-filter in front of
//! the database, which is safe ([`PreFiltered`]), and as the arbiter that claims a message
//! before the work, which loses messages (`MistakenConsumer::claim_in_cache`).
//!
//! The pre-filter reads the cache before the transaction and writes the key only after the
//! database committed (or found the key taken), so the cache never knows more than the
//! database: a crash between the commit and the cache write costs the redelivery one trip to
//! the database, which refuses it by its own key. Each key's value is the message's payload
//! hash, so a message id reused for other content misses the cache and meets the database's
//! refusal.

use std::time::Duration;

use crate::mistakes::CacheClaim;
use crate::payload_hash::PayloadHash;
use inventory_domain::{Message, Outcome};
use inventory_infra::{HandleError, MessageHandler};
use redis::aio::MultiplexedConnection;

/// How long a key stays in the cache. It bounds only how long duplicates are turned away
/// cheaply: past it the database still refuses them, so it need not cover the redelivery
/// horizon.
const KEY_TTL: Duration = Duration::from_secs(3600);

/// The dedup keys of one consumer in Redis, under a prefix of their own.
#[derive(Clone)]
pub struct DedupCache {
    connection: MultiplexedConnection,
    prefix: String,
}

impl DedupCache {
    /// Connects to the Redis at `url`; the keys are `<prefix>:<dedup key>`.
    pub async fn connect(url: &str, prefix: &str) -> redis::RedisResult<Self> {
        let connection = redis::Client::open(url)?
            .get_multiplexed_async_connection()
            .await?;
        Ok(Self {
            connection,
            prefix: prefix.to_owned(),
        })
    }

    fn key(&self, message: &Message) -> String {
        format!("{}:{}", self.prefix, message.key.storage_key())
    }

    /// Whether the database settled `message` already, as far as the cache knows: its key is
    /// there with the same payload hash. A cache that does not answer knows nothing.
    pub async fn seen(&self, message: &Message) -> bool {
        let stored: redis::RedisResult<Option<String>> = redis::cmd("GET")
            .arg(self.key(message))
            .query_async(&mut self.connection.clone())
            .await;
        match stored {
            Ok(stored) => stored.as_deref() == Some(PayloadHash::of(message).as_str()),
            Err(error) => {
                tracing::warn!(%error, "dedup cache unavailable: asking the database");
                false
            }
        }
    }

    /// Notes that the database settled `message`. A failure only costs a later copy a trip to
    /// the database.
    pub async fn remember(&self, message: &Message) {
        let written: redis::RedisResult<()> = redis::cmd("SET")
            .arg(self.key(message))
            .arg(PayloadHash::of(message).as_str())
            .arg("EX")
            .arg(KEY_TTL.as_secs())
            .query_async(&mut self.connection.clone())
            .await;
        if let Err(error) = written {
            tracing::warn!(%error, "dedup cache not written");
        }
    }

    /// Removes every key under this cache's prefix.
    pub async fn clear(&self) -> redis::RedisResult<()> {
        let mut connection = self.connection.clone();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}:*", self.prefix))
            .query_async(&mut connection)
            .await?;
        if !keys.is_empty() {
            redis::cmd("DEL")
                .arg(keys)
                .query_async::<()>(&mut connection)
                .await?;
        }
        Ok(())
    }
}

impl CacheClaim for DedupCache {
    /// `SET key NX`: true if the key was not there yet. An unreachable cache claims nothing.
    async fn claim(&self, message: &Message) -> bool {
        redis::cmd("SET")
            .arg(self.key(message))
            .arg(PayloadHash::of(message).as_str())
            .arg("NX")
            .arg("EX")
            .arg(KEY_TTL.as_secs())
            .query_async::<Option<String>>(&mut self.connection.clone())
            .await
            .is_ok_and(|set| set.is_some())
    }
}

/// A handler behind the cache as a pre-filter: the cache turns away copies it knows were
/// settled, the handler's own key decides everything else.
#[derive(Clone)]
pub struct PreFiltered<H> {
    pub cache: DedupCache,
    pub handler: H,
}

impl<H: MessageHandler> MessageHandler for PreFiltered<H> {
    async fn handle(&self, message: &Message) -> Result<Outcome, HandleError> {
        // Read before the transaction: a key the cache holds was committed.
        if self.cache.seen(message).await {
            return Ok(Outcome::Duplicate);
        }
        let outcome = self.handler.handle(message).await?;
        // Written only after the commit, and only for what the database settled for good: a
        // refusal may be replayed once its cause is fixed (a book stocked later).
        if matches!(outcome, Outcome::Processed(_) | Outcome::Duplicate) {
            self.cache.remember(message).await;
        }
        Ok(outcome)
    }
}
