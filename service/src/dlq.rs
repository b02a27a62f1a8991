//! `inventory dlq list|replay|delete`: what is in the dead-letter stream, putting a dead letter
//! back on its original subject once its cause is fixed, and deleting one that must never be
//! replayed. The format (headers, ids, reading a stored dead letter) is infra's [`DeadLetter`];
//! this is the commands.
//!
//! A replay republishes the original body to the subject in `Dlq-Subject`, so the consumer's
//! dedup applies as to any copy: the dedup key is the message id in the body (or the
//! CloudEvents source and id), which the replay leaves untouched. A copy already handled is
//! acked as a duplicate; one refused before (an unknown book since added) is processed.
//!
//! The replay's `Nats-Msg-Id` ([`DeadLetter::replay_message_id`]) is stable per dead letter, so
//! a replay retried after a crash (published, not yet deleted from the DLQ) is stored once.
//! Only after the orders stream stored it is the dead letter deleted.
//!
//! That dedup holds only while the consumer still has the key. The inbox's rows are purged once
//! they are older than the redelivery horizon, whose last part is the replay allowance: a dead
//! letter older than the allowance may find its row gone and be applied twice. So a replay
//! refuses the whole selection when one of its letters is older ([`plan_replay`]), unless forced.
//! `--dry-run` runs the same selection and checks, and publishes and deletes nothing.

use std::fmt;
use std::time::Duration;

use humantime::format_duration;
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

/// Which dead letters `dlq replay` and `dlq delete` take.
#[derive(Debug, Clone)]
pub enum Selection {
    Sequences(Vec<u64>),
    /// Those with this Dlq-Reason; only those older than `older_than`, if given.
    Reason {
        reason: String,
        older_than: Option<Duration>,
    },
}

/// What a selection found: its dead letters, oldest first, and the sequences asked for that are
/// not in the DLQ (replayed or deleted already, or never there).
#[derive(Debug, Clone, Default)]
pub struct Selected {
    pub letters: Vec<DeadLetter>,
    pub missing: Vec<u64>,
}

/// The dead letters `selection` takes, as the DLQ holds them now.
pub async fn select(
    js: &Context,
    topology: &Topology,
    selection: &Selection,
) -> anyhow::Result<Selected> {
    Ok(match selection {
        Selection::Reason { reason, older_than } => Selected {
            letters: list(js, topology, Some(reason))
                .await?
                .into_iter()
                .filter(|letter| older_than.is_none_or(|age| is_older(letter, age)))
                .collect(),
            missing: Vec::new(),
        },
        Selection::Sequences(wanted) => {
            let letters = list(js, topology, None).await?;
            let missing = wanted
                .iter()
                .copied()
                .filter(|seq| !letters.iter().any(|letter| letter.seq == *seq))
                .collect();
            Selected {
                letters: letters
                    .into_iter()
                    .filter(|letter| wanted.contains(&letter.seq))
                    .collect(),
                missing,
            }
        }
    })
}

/// The replay allowance `dlq replay` checks by default: [`crate::args::REPLAY_ALLOWANCE`].
pub fn default_replay_allowance() -> Duration {
    // A default that does not parse refuses every replay (zero allowance) rather than none;
    // the unit test below keeps it parsing.
    humantime::parse_duration(crate::args::REPLAY_ALLOWANCE).unwrap_or(Duration::ZERO)
}

/// How `dlq replay` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayOptions {
    /// How long after a dead letter it may still be replayed without `force`.
    pub allowance: Duration,
    /// Replays dead letters older than the allowance too.
    pub force: bool,
    /// Selects and checks, then publishes and deletes nothing.
    pub dry_run: bool,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        Self {
            allowance: default_replay_allowance(),
            force: false,
            dry_run: false,
        }
    }
}

/// Whether `letter` is older than `age`: past the replay allowance, its message's inbox row may
/// be purged.
pub fn is_older(letter: &DeadLetter, age: Duration) -> bool {
    Duration::from_secs(u64::try_from(letter.age_seconds).unwrap_or(0)) > age
}

/// A dead letter a replay takes: where it goes, and whether only `--force` let it through.
#[derive(Debug, Clone)]
pub struct Planned {
    pub letter: DeadLetter,
    /// Its original subject, where the replay goes.
    pub subject: String,
    /// Older than the replay allowance, taken because of `--force`.
    pub forced: bool,
}

impl Planned {
    /// The replay's `Nats-Msg-Id`.
    pub fn message_id(&self) -> String {
        self.letter.replay_message_id()
    }
}

/// A dead letter a refusal names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Named {
    pub seq: u64,
    pub reason: String,
    pub age_seconds: i64,
}

impl Named {
    fn of(letter: &DeadLetter) -> Self {
        Self {
            seq: letter.seq,
            reason: letter.reason.clone(),
            age_seconds: letter.age_seconds,
        }
    }
}

impl fmt::Display for Named {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}, {} old)",
            self.seq,
            self.reason,
            short_age(self.age_seconds)
        )
    }
}

/// Why `dlq replay` replayed nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplayRefused {
    /// Older than the replay allowance, and not forced.
    TooOld {
        letters: Vec<Named>,
        allowance: Duration,
    },
    /// No `Dlq-Subject` header: where the original went is unknown. `--force` does not help.
    NoSubject { letters: Vec<Named> },
}

fn listed(letters: &[Named]) -> String {
    let names: Vec<String> = letters.iter().map(Named::to_string).collect();
    let what = if names.len() == 1 {
        "dead letter"
    } else {
        "dead letters"
    };
    format!("{what} {}", names.join(", "))
}

impl fmt::Display for ReplayRefused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TooOld { letters, allowance } => write!(
                f,
                "refusing to replay: {} {} older than the replay allowance {}. The inbox keeps a \
                 message's key only for the redelivery horizon, which ends with the replay \
                 allowance, so under the inbox strategy a replay this late may find the key \
                 purged and be applied twice. Nothing was replayed. Check that the message was \
                 not applied already (docs/operating.md, \"Dead letters\"), then pass --force",
                listed(letters),
                if letters.len() == 1 { "is" } else { "are" },
                format_duration(*allowance),
            ),
            Self::NoSubject { letters } => write!(
                f,
                "refusing to replay: {} without a {} header, so where it goes is unknown. \
                 Nothing was replayed. Delete them (dlq delete) or leave them out of the \
                 selection",
                listed(letters),
                dlq_headers::SUBJECT,
            ),
        }
    }
}

impl std::error::Error for ReplayRefused {}

/// The decision of a replay, before any I/O: every selected dead letter with its subject, or a
/// refusal of them all. A letter older than `allowance` refuses the whole selection unless
/// `force`, so that a replay is never partial; one without a subject refuses it even then.
pub fn plan_replay(
    letters: Vec<DeadLetter>,
    allowance: Duration,
    force: bool,
) -> Result<Vec<Planned>, ReplayRefused> {
    let no_subject: Vec<Named> = letters
        .iter()
        .filter(|letter| letter.original_subject.is_none())
        .map(Named::of)
        .collect();
    if !no_subject.is_empty() {
        return Err(ReplayRefused::NoSubject {
            letters: no_subject,
        });
    }
    let too_old: Vec<Named> = letters
        .iter()
        .filter(|letter| is_older(letter, allowance))
        .map(Named::of)
        .collect();
    if !too_old.is_empty() && !force {
        return Err(ReplayRefused::TooOld {
            letters: too_old,
            allowance,
        });
    }
    Ok(letters
        .into_iter()
        .map(|letter| Planned {
            forced: is_older(&letter, allowance),
            subject: letter.original_subject.clone().unwrap_or_default(),
            letter,
        })
        .collect())
}

/// One dead letter put back.
#[derive(Debug, Clone, Serialize)]
pub struct Replayed {
    pub seq: u64,
    pub reason: String,
    pub age_seconds: i64,
    pub subject: String,
    pub message_id: String,
    /// Its sequence in the orders stream.
    pub stream_sequence: u64,
    /// The orders stream had stored this replay already (a retried replay).
    pub duplicate: bool,
    /// Older than the replay allowance, replayed because of `--force`.
    pub forced: bool,
}

/// What `dlq replay` did, or with `--dry-run` would do.
#[derive(Debug, Clone, Default)]
pub struct ReplayReport {
    /// What the selection took, in the order replayed.
    pub planned: Vec<Planned>,
    /// What was replayed: empty on a dry run.
    pub replayed: Vec<Replayed>,
    /// Sequences asked for that are not in the DLQ (replayed already, or never there).
    pub missing: Vec<u64>,
    pub dry_run: bool,
}

/// Replays the selected dead letters, oldest first, once [`plan_replay`] accepted them all;
/// on a dry run only plans. A refusal is a [`ReplayRefused`] error.
pub async fn replay(
    js: &Context,
    topology: &Topology,
    selection: &Selection,
    options: ReplayOptions,
) -> anyhow::Result<ReplayReport> {
    let Selected { letters, missing } = select(js, topology, selection).await?;
    let planned = plan_replay(letters, options.allowance, options.force)?;
    let mut report = ReplayReport {
        planned,
        replayed: Vec::new(),
        missing,
        dry_run: options.dry_run,
    };
    if options.dry_run {
        return Ok(report);
    }
    let stream = DeadLetterStream::new(js.clone(), topology.clone());
    for planned in &report.planned {
        let letter = &planned.letter;
        let receipt = stream.replay(letter, &planned.subject).await?;
        report.replayed.push(Replayed {
            seq: letter.seq,
            reason: letter.reason.clone(),
            age_seconds: letter.age_seconds,
            subject: planned.subject.clone(),
            message_id: planned.message_id(),
            stream_sequence: receipt.sequence,
            duplicate: receipt.duplicate,
            forced: planned.forced,
        });
    }
    Ok(report)
}

/// What `dlq delete` did, or with `--dry-run` would do.
#[derive(Debug, Clone, Default)]
pub struct DeleteReport {
    /// Deleted, or on a dry run those it would delete.
    pub deleted: Vec<DeadLetter>,
    /// Sequences asked for that are not in the DLQ.
    pub missing: Vec<u64>,
    /// Selected, then gone before their delete: another operator deleted or replayed them.
    pub gone: Vec<u64>,
    pub dry_run: bool,
}

/// Deletes the selected dead letters, oldest first; on a dry run only selects them.
pub async fn delete(
    js: &Context,
    topology: &Topology,
    selection: &Selection,
    dry_run: bool,
) -> anyhow::Result<DeleteReport> {
    let Selected { letters, missing } = select(js, topology, selection).await?;
    let mut report = DeleteReport {
        missing,
        dry_run,
        ..DeleteReport::default()
    };
    if dry_run {
        report.deleted = letters;
        return Ok(report);
    }
    let stream = DeadLetterStream::new(js.clone(), topology.clone());
    for letter in letters {
        if stream.delete(letter.seq).await? {
            report.deleted.push(letter);
        } else {
            report.gone.push(letter.seq);
        }
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
    use super::*;

    #[test]
    fn ages_are_short() {
        assert_eq!(short_age(5), "5s");
        assert_eq!(short_age(125), "2m");
        assert_eq!(short_age(7_200), "2h");
        assert_eq!(short_age(200_000), "2d");
    }

    #[test]
    fn the_default_allowance_is_seven_days() {
        assert_eq!(default_replay_allowance(), Duration::from_secs(7 * 86_400));
    }

    const DAY: i64 = 86_400;

    fn letter(seq: u64, age_seconds: i64, subject: Option<&str>) -> DeadLetter {
        DeadLetter {
            seq,
            reason: "unknown-book".into(),
            detail: String::new(),
            consumer: "inventory-reserve-stock-inbox".into(),
            original_subject: subject.map(str::to_owned),
            original_stream: Some("ORDERS".into()),
            original_sequence: Some(seq),
            original_message_id: Some(format!("m-{seq}")),
            deliveries: Some(1),
            stored_at: 0,
            age_seconds,
            headers: Default::default(),
            body: Default::default(),
        }
    }

    fn seqs(planned: &[Planned]) -> Vec<(u64, bool)> {
        planned
            .iter()
            .map(|planned| (planned.letter.seq, planned.forced))
            .collect()
    }

    #[test]
    fn a_replay_is_refused_whole_when_one_letter_is_past_the_allowance() {
        let week = Duration::from_secs(7 * 86_400);
        let fresh = || letter(1, DAY, Some("orders.placed"));
        let at_the_edge = || letter(2, 7 * DAY, Some("orders.placed"));
        let old = || letter(3, 7 * DAY + 1, Some("orders.cancelled"));

        // Given letters inside the allowance (its end included), when replayed: all of them.
        let planned =
            plan_replay(vec![fresh(), at_the_edge()], week, false).expect("inside the allowance");
        assert_eq!(seqs(&planned), [(1, false), (2, false)]);
        assert_eq!(planned[0].subject, "orders.placed");
        assert_eq!(planned[0].message_id(), "m-1:replay:1");

        // Given one letter a second past it: none of them, the old one named with its age.
        let refused = plan_replay(vec![fresh(), old()], week, false).expect_err("one is too old");
        assert_eq!(
            refused,
            ReplayRefused::TooOld {
                letters: vec![Named {
                    seq: 3,
                    reason: "unknown-book".into(),
                    age_seconds: 7 * DAY + 1
                }],
                allowance: week
            }
        );
        let message = refused.to_string();
        assert!(
            message.contains(
                "dead letter 3 (unknown-book, 7d old) is older than the replay allowance 7days"
            ),
            "{message}"
        );
        assert!(message.contains("--force"), "{message}");

        // Forced: all of them, the old one marked.
        let planned = plan_replay(vec![fresh(), old()], week, true).expect("forced");
        assert_eq!(seqs(&planned), [(1, false), (3, true)]);
    }

    #[test]
    fn a_letter_without_its_subject_refuses_the_replay_even_forced() {
        let refused = plan_replay(
            vec![letter(1, 0, Some("orders.placed")), letter(2, 0, None)],
            Duration::from_secs(60),
            true,
        )
        .expect_err("no subject");
        assert!(
            matches!(&refused, ReplayRefused::NoSubject { letters } if letters.len() == 1 && letters[0].seq == 2),
            "{refused:?}"
        );
        assert!(refused.to_string().contains("Dlq-Subject"), "{refused}");
    }

    #[test]
    fn nothing_selected_is_nothing_to_refuse() {
        let planned = plan_replay(Vec::new(), Duration::ZERO, false).expect("nothing to refuse");
        assert!(planned.is_empty());
    }
}
