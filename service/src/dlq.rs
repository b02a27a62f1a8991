//! `inventory dlq list` and `inventory dlq replay`: what is in the dead-letter stream, and
//! putting a dead letter back on its original subject once its cause is fixed. The format
//! (headers, ids, reading a stored dead letter) is infra's [`DeadLetter`]; this is the commands.
//!
//! A replay republishes the original body to the subject in `Dlq-Subject`, so the consumer's
//! dedup applies as to any copy: the dedup key is the message id in the body (or the
//! CloudEvents source and id), which the replay leaves untouched. A copy already handled is
//! acked as a duplicate; one refused before (an unknown book since added) is processed.
//!
//! The replay's `Nats-Msg-Id` ([`DeadLetter::replay_message_id`]) is stable per dead letter, so
//! a replay retried after a crash (published, not yet deleted from the DLQ) is stored once.
//! Only after the orders stream stored it is the dead letter deleted.

use anyhow::bail;
use inventory_infra::jetstream::{Context, DeadLetterStream, Topology, dlq_headers};
use serde::Serialize;

pub use inventory_infra::jetstream::DeadLetter;

/// The dead letters in the DLQ stream, oldest first; only those with `reason` if given.
pub async fn list(
    js: &Context,
    topology: &Topology,
    reason: Option<&str>,
) -> anyhow::Result<Vec<DeadLetter>> {
    let now = chrono::Utc::now().timestamp();
    let letters = DeadLetterStream::new(js.clone(), topology.clone())
        .read_all(now)
        .await?;
    Ok(letters
        .into_iter()
        .filter(|letter| reason.is_none_or(|reason| letter.reason == reason))
        .collect())
}

/// One dead letter put back.
#[derive(Debug, Clone, Serialize)]
pub struct Replayed {
    pub seq: u64,
    pub subject: String,
    pub message_id: String,
    /// Its sequence in the orders stream.
    pub stream_sequence: u64,
    /// The orders stream had stored this replay already (a retried replay).
    pub duplicate: bool,
}

/// Republishes `letter` to its original subject, then deletes it from the DLQ.
pub async fn replay(
    js: &Context,
    topology: &Topology,
    letter: &DeadLetter,
) -> anyhow::Result<Replayed> {
    let Some(subject) = letter.original_subject.clone() else {
        bail!(
            "dead letter {} has no {} header: its original subject is unknown",
            letter.seq,
            dlq_headers::SUBJECT
        );
    };
    let receipt = DeadLetterStream::new(js.clone(), topology.clone())
        .replay(letter, &subject)
        .await?;
    Ok(Replayed {
        seq: letter.seq,
        subject,
        message_id: letter.replay_message_id(),
        stream_sequence: receipt.sequence,
        duplicate: receipt.duplicate,
    })
}

/// Which dead letters `dlq replay` takes.
#[derive(Debug, Clone)]
pub enum Selection {
    Sequences(Vec<u64>),
    Reason(String),
}

/// What `dlq replay` did.
#[derive(Debug, Clone, Default)]
pub struct ReplayReport {
    pub replayed: Vec<Replayed>,
    /// Sequences asked for that are not in the DLQ (replayed already, or never there).
    pub missing: Vec<u64>,
}

/// Replays the selected dead letters, oldest first.
pub async fn replay_selected(
    js: &Context,
    topology: &Topology,
    selection: &Selection,
) -> anyhow::Result<ReplayReport> {
    let mut report = ReplayReport::default();
    let chosen = match selection {
        Selection::Reason(reason) => list(js, topology, Some(reason)).await?,
        Selection::Sequences(wanted) => {
            let letters = list(js, topology, None).await?;
            report.missing = wanted
                .iter()
                .copied()
                .filter(|seq| !letters.iter().any(|letter| letter.seq == *seq))
                .collect();
            letters
                .into_iter()
                .filter(|letter| wanted.contains(&letter.seq))
                .collect()
        }
    };
    for letter in &chosen {
        report.replayed.push(replay(js, topology, letter).await?);
    }
    Ok(report)
}

/// How long ago, for the table: `42s`, `5m`, `3h`, `2d`.
pub fn short_age(seconds: i64) -> String {
    match seconds {
        s if s < 60 => format!("{s}s"),
        s if s < 3_600 => format!("{}m", s / 60),
        s if s < 86_400 => format!("{}h", s / 3_600),
        s => format!("{}d", s / 86_400),
    }
}

#[cfg(test)]
mod tests {
    use super::short_age;

    #[test]
    fn ages_are_short() {
        assert_eq!(short_age(5), "5s");
        assert_eq!(short_age(125), "2m");
        assert_eq!(short_age(7_200), "2h");
        assert_eq!(short_age(200_000), "2d");
    }
}
