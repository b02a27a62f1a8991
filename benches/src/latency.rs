//! Latency from publish to handling, for the end-to-end runs at a steady rate: the publisher
//! notes when each message went out, the consumer (the service's or the hand-written loop's)
//! when it was handled.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    pub samples: usize,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

/// When each message was published and how long each took from then to its handling.
#[derive(Debug, Default)]
pub struct PublishClock {
    sent: Mutex<HashMap<String, Instant>>,
    took: Mutex<Vec<Duration>>,
}

impl PublishClock {
    pub(crate) fn sent(&self, key: String) {
        lock(&self.sent).insert(key, Instant::now());
    }

    /// The message of dedup key `key` was handled `at`: counted once, at its first handling.
    pub(crate) fn handled(&self, key: &str, at: Instant) {
        if let Some(sent) = lock(&self.sent).remove(key) {
            lock(&self.took).push(at.saturating_duration_since(sent));
        }
    }

    pub(crate) fn latency(&self) -> Option<Latency> {
        let mut took = std::mem::take(&mut *lock(&self.took));
        took.sort_unstable();
        let last = took.len().checked_sub(1)?;
        let at = |q: f64| took[(last as f64 * q).round() as usize].as_secs_f64() * 1e3;
        Some(Latency {
            samples: took.len(),
            p50_ms: at(0.5),
            p90_ms: at(0.9),
            p99_ms: at(0.99),
            max_ms: at(1.0),
        })
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
