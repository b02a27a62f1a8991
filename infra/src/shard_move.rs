//! Moving a partition from one shard to another, as decisions without I/O: what `inventory shard
//! move --partition P --to NAME` does at each step, given what it read. The command that runs
//! them (the statements, the bucket's compare-and-sets, the consumer's pause) is not built yet;
//! `model` (tests only) runs these decisions against a simulated world of two shards, the
//! assignment and the stream, and checks that no interleaving decides a placement twice.
//!
//! The move's state is a [`MoveRecord`] in the assignment bucket: created
//! when the move begins (a create, so one move per partition), then advanced by compare-and-set
//! at the revision read, once per step. A mover reads the record and what its step needs
//! ([`Seen`]), asks [`MoveRecord::next`], does the action, then records the next record. A
//! mover that crashed, or whose compare-and-set lost, reads the record again and goes on from
//! it: every action is conditional, in the statement or compare-and-set that does it, on what
//! the move left, so an action repeated, or run late by a mover that lost, changes nothing it
//! should not. An action refused while the record still holds the step it was taken for means
//! the world is not what the move left: the mover stops for a person.
//!
//! The steps, in order: pause the partition's consumer; fence the partition on the old shard
//! (its owner row `fenced`, under the locks of its stock rows); copy its rows to the new shard
//! (`incoming`, owned by nobody yet); wait until the old shard's relay has published the
//! partition's events; hand over (the assignment's compare-and-set); activate the new shard's
//! rows; resume the consumer; remove the rows from the old shard. An abort
//! ([`MoveRecord::abort`]) is refused once the hand-over may have happened; it cancels the
//! hand-over by a compare-and-set of the assignment at the same revision, so of the two exactly
//! one happens, then unfences the old shard, drops the copy and resumes the consumer.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::jetstream::Owner;

#[cfg(test)]
mod model;
mod rows;

pub use rows::{Moved, RowsError, ShardRows, Unpublished};

/// A move under way, as its record holds it: `move.<partition>` in the assignment bucket, JSON.
/// The assignment's readers take only `partition.<n>` keys, so a move record routes nothing.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MoveRecord {
    pub partition: u32,
    pub from: String,
    pub to: String,
    /// The revision of the partition's key in the assignment when the move began. The
    /// hand-over and an abort's cancellation are both compare-and-sets at it, so exactly one
    /// of them succeeds.
    pub assigned_revision: u64,
    /// The partition's epoch on the old shard; the new shard takes it at [`Self::new_epoch`].
    pub epoch: i64,
    pub step: Step,
    /// What the step waits for, as its mover last saw it (a drain's unpublished events): for
    /// `inventory shard status`. Cleared by the next step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_for: Option<String>,
}

/// What a move does next; the record holds the step not yet known to be done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Step {
    Pause,
    Fence,
    Copy,
    Drain,
    HandOver,
    Activate,
    Resume,
    Remove,
    Done,
    /// An abort's first step: the assignment's compare-and-set that makes the hand-over fail.
    CancelHandOver,
    Unfence,
    DropCopy,
    ResumeAborted,
    Aborted,
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Pause => "pause",
            Self::Fence => "fence",
            Self::Copy => "copy",
            Self::Drain => "drain",
            Self::HandOver => "hand over",
            Self::Activate => "activate",
            Self::Resume => "resume",
            Self::Remove => "remove",
            Self::Done => "done",
            Self::CancelHandOver => "abort: cancel the hand-over",
            Self::Unfence => "abort: unfence",
            Self::DropCopy => "abort: drop the copy",
            Self::ResumeAborted => "abort: resume",
            Self::Aborted => "aborted",
        })
    }
}

/// An owner row of `partition_owner`, as a step reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OwnerRow {
    pub epoch: i64,
    pub state: OwnerState,
}

/// A partition's state in a shard's database; only `active` decides placements
/// (`owns_partition`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OwnerState {
    Active,
    /// Given up by a move: the old shard holds the rows but decides nothing.
    Fenced,
    /// Copied in by a move, not handed over yet: decides nothing.
    Incoming,
}

/// What a mover reads before a step. Each step looks only at what it needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    /// The partition's owner in the assignment and its key's revision; `None` when it has
    /// none.
    pub assigned: Option<Owner>,
    /// Events of the partition's books the old shard's outbox still holds.
    pub unpublished: u64,
}

/// What a mover does at a step. Each is conditional on what the move left, as its doc says,
/// and does nothing when that is not so (a repeat, or a late mover's): the epochs and the
/// revision are the record's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Pause the partition's durable consumer: less traffic while it moves. Nothing relies on
    /// it; the owner rows decide.
    PauseConsumer,
    /// On the old shard: the partition's stock rows locked in book order (an UPDATE, as the
    /// statements lock them, so placements in flight finish first), then its owner row set
    /// `fenced` if it is `active` at the record's epoch. A placement that waited for those
    /// locks reads the owner row after them and is "not owned".
    Fence,
    /// On the new shard, in one transaction, unless its owner row there is `active`: delete
    /// what an earlier attempt left, insert the old shard's rows of the partition (stock,
    /// reservations, line cancellations; read while the old shard's row is `fenced` at the
    /// record's epoch, else refused), check them ([`books_out_of_balance`]), owner row
    /// `incoming` at the new epoch.
    Copy,
    /// The assignment's compare-and-set: the partition's key names the new shard, at the
    /// record's `assigned_revision`. Lost when an abort cancelled it.
    HandOver,
    /// On the new shard: its owner row `incoming` at the new epoch becomes `active`.
    Activate,
    ResumeConsumer,
    /// On the old shard: the partition's rows and owner row deleted, if that row is `fenced`
    /// at the record's epoch.
    Remove,
    /// The assignment's compare-and-set: the key names the old shard again, at the record's
    /// `assigned_revision`, so a hand-over at that revision fails. Lost when the hand-over
    /// happened first.
    CancelHandOver,
    /// On the old shard: its owner row at the record's epoch (`fenced`, or still `active` when
    /// the abort came before the fence) becomes `active` at the new epoch, so that a fence or a
    /// copy of this move still in flight matches nothing.
    Unfence,
    /// On the new shard: the partition's rows and owner row deleted, if that row is not
    /// `active`.
    DropCopy,
}

/// What [`MoveRecord::next`] decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Do the action, then record `then` by compare-and-set at the revision read.
    Do { action: Action, then: MoveRecord },
    /// Nothing to do at this step any more: record `then`.
    Advance(MoveRecord),
    /// Not yet (the old shard's relay still holds events): read again later.
    Wait,
    /// The move is over: done or aborted.
    Over,
    /// The assignment names a shard the move did not put there: a person must look.
    Stuck { assigned: Option<String> },
}

/// Why a move cannot begin.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BeginRefused {
    #[error("partition {partition} has no owner in the assignment")]
    Unassigned { partition: u32 },
    #[error("partition {partition} is on shard {to} already")]
    AlreadyThere { partition: u32, to: String },
    #[error("the database of shard {from} does not own partition {partition} as active")]
    NotActive { partition: u32, from: String },
}

/// Why an abort is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AbortRefused {
    #[error("partition {partition} may have been handed over to {to} already: finish the move")]
    HandedOver { partition: u32, to: String },
    #[error("the move of partition {partition} is over")]
    Over { partition: u32 },
}

impl MoveRecord {
    /// The record that begins moving `partition` to `to`, from what the assignment says of it
    /// and the owner row the assigned shard's database holds.
    pub fn begin(
        partition: u32,
        to: &str,
        assigned: Option<Owner>,
        owner_row: Option<OwnerRow>,
    ) -> Result<Self, BeginRefused> {
        let assigned = assigned.ok_or(BeginRefused::Unassigned { partition })?;
        if assigned.shard == to {
            return Err(BeginRefused::AlreadyThere {
                partition,
                to: to.to_owned(),
            });
        }
        let Some(OwnerRow {
            epoch,
            state: OwnerState::Active,
        }) = owner_row
        else {
            return Err(BeginRefused::NotActive {
                partition,
                from: assigned.shard,
            });
        };
        Ok(Self {
            partition,
            from: assigned.shard,
            to: to.to_owned(),
            assigned_revision: assigned.revision,
            epoch,
            step: Step::Pause,
            waiting_for: None,
        })
    }

    /// The partition's epoch on the new shard once copied, and on the old one once unfenced.
    pub fn new_epoch(&self) -> i64 {
        self.epoch + 1
    }

    /// What to do at this record's step, given what was read.
    pub fn next(&self, seen: &Seen) -> Next {
        let then = |step| Self {
            step,
            waiting_for: None,
            ..self.clone()
        };
        let act = |action, step| Next::Do {
            action,
            then: then(step),
        };
        match self.step {
            Step::Pause => act(Action::PauseConsumer, Step::Fence),
            Step::Fence => act(Action::Fence, Step::Copy),
            Step::Copy => act(Action::Copy, Step::Drain),
            // The fence committed before: the old shard writes no new event of the partition,
            // so once its relay has published these, the new shard's events come after them.
            Step::Drain if seen.unpublished > 0 => Next::Wait,
            Step::Drain => Next::Advance(then(Step::HandOver)),
            // Whether the hand-over or its cancellation happened is the assignment's to say:
            // the key names the new shard, or the old one at another revision.
            Step::HandOver | Step::CancelHandOver => match self.hand_over(seen) {
                HandOver::Happened => Next::Advance(then(Step::Activate)),
                HandOver::Cancelled => Next::Advance(then(Step::Unfence)),
                HandOver::Open if self.step == Step::HandOver => {
                    act(Action::HandOver, Step::Activate)
                }
                HandOver::Open => act(Action::CancelHandOver, Step::Unfence),
                HandOver::Unknown => Next::Stuck {
                    assigned: seen.assigned.as_ref().map(|a| a.shard.clone()),
                },
            },
            Step::Activate => act(Action::Activate, Step::Resume),
            Step::Resume => act(Action::ResumeConsumer, Step::Remove),
            Step::Remove => act(Action::Remove, Step::Done),
            // Unfenced first: the old shard's row then has a new epoch, so a copy still in flight
            // from a mover that lost is refused, and cannot land after the drop.
            Step::Unfence => act(Action::Unfence, Step::DropCopy),
            Step::DropCopy => act(Action::DropCopy, Step::ResumeAborted),
            Step::ResumeAborted => act(Action::ResumeConsumer, Step::Aborted),
            Step::Done | Step::Aborted => Next::Over,
        }
    }

    /// The record an abort writes (by compare-and-set at the revision read): refused once the
    /// hand-over may have happened. At [`Step::HandOver`] it may have, unrecorded, so the abort
    /// leads to [`Step::CancelHandOver`], whose compare-and-set tells which came first.
    pub fn abort(&self) -> Result<Self, AbortRefused> {
        let step = match self.step {
            Step::Pause | Step::Fence | Step::Copy | Step::Drain | Step::HandOver => {
                Step::CancelHandOver
            }
            Step::CancelHandOver | Step::Unfence | Step::DropCopy | Step::ResumeAborted => {
                self.step
            }
            Step::Activate | Step::Resume | Step::Remove => {
                return Err(AbortRefused::HandedOver {
                    partition: self.partition,
                    to: self.to.clone(),
                });
            }
            Step::Done | Step::Aborted => {
                return Err(AbortRefused::Over {
                    partition: self.partition,
                });
            }
        };
        Ok(Self {
            step,
            waiting_for: None,
            ..self.clone()
        })
    }

    /// Whether the move is over, done or aborted.
    pub fn is_over(&self) -> bool {
        matches!(self.step, Step::Done | Step::Aborted)
    }

    fn hand_over(&self, seen: &Seen) -> HandOver {
        match &seen.assigned {
            Some(assigned) if assigned.shard == self.to => HandOver::Happened,
            Some(assigned) if assigned.shard == self.from => {
                if assigned.revision == self.assigned_revision {
                    HandOver::Open
                } else {
                    HandOver::Cancelled
                }
            }
            _ => HandOver::Unknown,
        }
    }
}

/// What the assignment says of the hand-over.
enum HandOver {
    Happened,
    Cancelled,
    /// Neither yet: the key is as the move found it.
    Open,
    /// It names neither shard.
    Unknown,
}

/// The books whose `reserved` is not the sum of their `reserved` reservations' quantities: a
/// copy that finds one is rolled back. `stock` is each book's `reserved`; `reservations` the
/// book and quantity of each reservation whose status is `reserved`.
pub fn books_out_of_balance<B: Ord + Copy>(
    stock: &[(B, i64)],
    reservations: &[(B, i64)],
) -> Vec<B> {
    let mut held: BTreeMap<B, i64> = BTreeMap::new();
    for (book, quantity) in reservations {
        *held.entry(*book).or_default() += quantity;
    }
    stock
        .iter()
        .filter(|(book, reserved)| held.get(book).copied().unwrap_or_default() != *reserved)
        .map(|(book, _)| *book)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assigned(shard: &str, revision: u64) -> Option<Owner> {
        Some(Owner {
            shard: shard.to_owned(),
            revision,
        })
    }

    fn active(epoch: i64) -> Option<OwnerRow> {
        Some(OwnerRow {
            epoch,
            state: OwnerState::Active,
        })
    }

    fn record(step: Step) -> MoveRecord {
        MoveRecord {
            step,
            ..MoveRecord::begin(7, "b", assigned("a", 3), active(1)).expect("a move")
        }
    }

    fn seen(shard: &str, revision: u64) -> Seen {
        Seen {
            assigned: assigned(shard, revision),
            unpublished: 0,
        }
    }

    #[test]
    fn a_move_begins_only_from_the_active_owner_to_another_shard() {
        let begun = MoveRecord::begin(7, "b", assigned("a", 3), active(1)).expect("a move");
        assert_eq!((begun.from.as_str(), begun.assigned_revision), ("a", 3));
        assert_eq!(
            (begun.epoch, begun.new_epoch(), begun.step),
            (1, 2, Step::Pause)
        );
        assert!(matches!(
            MoveRecord::begin(7, "a", assigned("a", 3), active(1)),
            Err(BeginRefused::AlreadyThere { .. })
        ));
        assert!(matches!(
            MoveRecord::begin(7, "b", None, active(1)),
            Err(BeginRefused::Unassigned { .. })
        ));
        let fenced = Some(OwnerRow {
            epoch: 1,
            state: OwnerState::Fenced,
        });
        assert!(matches!(
            MoveRecord::begin(7, "b", assigned("a", 3), fenced),
            Err(BeginRefused::NotActive { .. })
        ));
    }

    #[test]
    fn the_drain_waits_for_the_old_shards_events() {
        let draining = record(Step::Drain);
        let waiting = Seen {
            unpublished: 2,
            ..seen("a", 3)
        };
        assert_eq!(draining.next(&waiting), Next::Wait);
        assert_eq!(
            draining.next(&seen("a", 3)),
            Next::Advance(record(Step::HandOver))
        );
    }

    #[test]
    fn the_assignment_says_whether_the_hand_over_or_the_abort_came_first() {
        for step in [Step::HandOver, Step::CancelHandOver] {
            let at = record(step);
            assert_eq!(
                at.next(&seen("b", 4)),
                Next::Advance(record(Step::Activate))
            );
            assert_eq!(at.next(&seen("a", 4)), Next::Advance(record(Step::Unfence)));
            assert_eq!(
                at.next(&seen("c", 4)),
                Next::Stuck {
                    assigned: Some("c".to_owned())
                }
            );
        }
        assert_eq!(
            record(Step::HandOver).next(&seen("a", 3)),
            Next::Do {
                action: Action::HandOver,
                then: record(Step::Activate)
            }
        );
        assert_eq!(
            record(Step::CancelHandOver).next(&seen("a", 3)),
            Next::Do {
                action: Action::CancelHandOver,
                then: record(Step::Unfence)
            }
        );
    }

    #[test]
    fn an_abort_is_refused_once_the_hand_over_may_have_happened() {
        for step in [
            Step::Pause,
            Step::Fence,
            Step::Copy,
            Step::Drain,
            Step::HandOver,
        ] {
            assert_eq!(record(step).abort(), Ok(record(Step::CancelHandOver)));
        }
        for step in [Step::Activate, Step::Resume, Step::Remove] {
            assert!(matches!(
                record(step).abort(),
                Err(AbortRefused::HandedOver { .. })
            ));
        }
        assert_eq!(record(Step::Unfence).abort(), Ok(record(Step::Unfence)));
        assert!(matches!(
            record(Step::Done).abort(),
            Err(AbortRefused::Over { .. })
        ));
    }

    #[test]
    fn the_record_reads_back_as_written() {
        let written = serde_json::to_string(&record(Step::HandOver)).expect("json");
        assert!(written.contains(r#""step":"hand_over""#), "{written}");
        let read: MoveRecord = serde_json::from_str(&written).expect("a record");
        assert_eq!(read, record(Step::HandOver));
    }

    #[test]
    fn a_copy_is_out_of_balance_where_reserved_is_not_its_reservations_sum() {
        let stock = [(1, 3), (2, 0), (3, 1)];
        let reservations = [(1, 2), (1, 1), (3, 2)];
        assert_eq!(books_out_of_balance(&stock, &reservations), vec![3]);
    }
}
