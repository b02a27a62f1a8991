//! One pass's publication decisions, without I/O: the order the rows go out in, which row goes
//! out next, what a PubAck, a timeout or a parked row does to its order's chain and to the
//! rest of the pass, and which rows the pass deletes at its end.
//!
//! The relay (`relay.rs`) sends the publishes [`Pass::next`] hands it, runs the statements,
//! and tells the pass how each publish [`Settled`]; the protocol's model (`model.rs`) runs the
//! same decisions on a simulated stream, network and database, and the tests below on plain
//! instants.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

use uuid::Uuid;

use super::source::PendingRow;

/// An outbox row as a pass sees it.
pub(crate) trait Chained {
    type Order: Eq + Hash + Clone;
    fn seq(&self) -> i64;
    fn order(&self) -> Self::Order;
    fn partition(&self) -> i16;
}

impl Chained for PendingRow {
    type Order = Uuid;
    fn seq(&self) -> i64 {
        self.seq
    }
    fn order(&self) -> Uuid {
        self.order_id
    }
    fn partition(&self) -> i16 {
        self.relay_partition
    }
}

/// The rows grouped by order, each order's rows in seq order (the order they were read in),
/// the orders in the order of their first row.
pub(crate) fn chains<R: Chained>(rows: Vec<R>) -> Vec<VecDeque<R>> {
    let mut index: HashMap<R::Order, usize> = HashMap::new();
    let mut chains: Vec<VecDeque<R>> = Vec::new();
    for row in rows {
        match index.entry(row.order()) {
            Entry::Occupied(at) => chains[*at.get()].push_back(row),
            Entry::Vacant(slot) => {
                slot.insert(chains.len());
                chains.push(VecDeque::from([row]));
            }
        }
    }
    chains
}

/// What one pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct PassReport {
    /// Rows read.
    pub read: usize,
    /// Acknowledged as new by the stream.
    pub published: usize,
    /// Acknowledged as duplicates: the stream had the event already.
    pub duplicates: usize,
    pub parked: usize,
    /// Publishes that failed and will be tried again.
    pub failed: usize,
    /// Rows not tried: behind a failed row of their order, after a broker failure, or in a
    /// partition whose lease was too close to its end.
    pub held_back: usize,
    /// Acknowledged rows removed.
    pub deleted: u64,
    /// The batch was full: more rows are probably waiting.
    pub more: bool,
}

/// Rows acknowledged by the stream and not yet removed: what `Relay::publish_pending`
/// leaves for `Relay::delete_published`.
#[derive(Debug, Default)]
pub struct Published {
    pub report: PassReport,
    pub(crate) seqs: Vec<i64>,
    /// The first failure of the pass, for the log and the health check.
    pub(crate) failure: Option<String>,
}

/// How one publish ended.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Settled {
    /// The stream has it; `duplicate`: it had it already.
    Acked { duplicate: bool },
    /// It can never be published as it is, and it is parked.
    Parked,
    /// The broker failed it (no connection, no PubAck in time, a refusal that is not the
    /// row's fault): nothing more goes out in this pass.
    BrokerFailed(String),
    /// Parking it failed: its order's later rows wait, the other orders go on.
    ParkFailed(String),
}

/// One pass over the rows read: one chain per order, up to `max_in_flight` chains at once,
/// an order's rows one after the other, each only after its predecessor [`Settled`] as
/// acknowledged. So a relay never has two publishes of one order in flight, and an order's
/// later rows are never sent after an earlier one failed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Pass<R> {
    /// Each order's rows not yet sent.
    chains: Vec<VecDeque<R>>,
    /// Per chain: the seq of the row sent and not yet settled.
    out: Vec<Option<i64>>,
    /// Chains begun: they begin in order, as earlier ones end.
    begun: usize,
    /// Chains begun and not yet ended.
    running: usize,
    max_in_flight: usize,
    /// A publish failed for the broker's sake: the rest of the pass is held back.
    broker_failing: bool,
    report: PassReport,
    acked: Vec<i64>,
    failure: Option<String>,
}

impl<R: Chained> Pass<R> {
    /// A pass over `rows` (read in seq order); `full`: the read filled its batch.
    pub(crate) fn new(rows: Vec<R>, max_in_flight: usize, full: bool) -> Self {
        let report = PassReport {
            read: rows.len(),
            more: full,
            ..PassReport::default()
        };
        let chains = chains(rows);
        Self {
            out: vec![None; chains.len()],
            chains,
            begun: 0,
            running: 0,
            max_in_flight: max_in_flight.max(1),
            broker_failing: false,
            report,
            acked: Vec::new(),
            failure: None,
        }
    }

    /// Nothing is sent: the broker is known to be failing before the pass starts (`error`).
    pub(crate) fn hold_back_all(&mut self, error: String) {
        self.broker_failing = true;
        self.report.failed += 1;
        self.failure.get_or_insert(error);
        while self.next(|_| true).is_some() {}
    }

    /// The next row to publish, and its chain's index for [`Self::settled`]; `None` when
    /// every chain that may go on waits for a PubAck, or the pass is over. `usable`: whether
    /// a publish may start now in a partition (enough of its lease left). A chain whose row
    /// may not go out ends here, its rows held back for a later pass.
    pub(crate) fn next(&mut self, usable: impl Fn(i16) -> bool) -> Option<(usize, R)> {
        loop {
            let idle = (0..self.begun)
                .find(|&chain| self.out[chain].is_none() && !self.chains[chain].is_empty());
            let chain = match idle {
                Some(chain) => chain,
                None if self.running < self.max_in_flight && self.begun < self.chains.len() => {
                    self.begun += 1;
                    self.running += 1;
                    self.begun - 1
                }
                None => return None,
            };
            let front = self.chains[chain].front()?;
            if self.broker_failing || !usable(front.partition()) {
                self.end_chain(chain);
                continue;
            }
            let row = self.chains[chain].pop_front()?;
            self.out[chain] = Some(row.seq());
            return Some((chain, row));
        }
    }

    /// How the publish out on `chain` ended.
    pub(crate) fn settled(&mut self, chain: usize, settled: Settled) {
        let Some(seq) = self.out[chain].take() else {
            return;
        };
        match settled {
            Settled::Acked { duplicate } => {
                self.acked.push(seq);
                if duplicate {
                    self.report.duplicates += 1;
                } else {
                    self.report.published += 1;
                }
                if self.chains[chain].is_empty() {
                    self.running -= 1;
                }
                return;
            }
            Settled::Parked => self.report.parked += 1,
            Settled::BrokerFailed(error) => {
                self.broker_failing = true;
                self.fail(error);
            }
            Settled::ParkFailed(error) => self.fail(format!("parking a row: {error}")),
        }
        self.end_chain(chain);
    }

    fn fail(&mut self, error: String) {
        self.report.failed += 1;
        self.failure.get_or_insert(error);
    }

    /// Ends `chain` (idle) before its end: its rows wait for a later pass.
    fn end_chain(&mut self, chain: usize) {
        self.report.held_back += self.chains[chain].len();
        self.chains[chain].clear();
        self.running -= 1;
    }

    /// The seq of the row out on `chain`, waiting to be settled (the model matches PubAcks to
    /// publishes by it; the relay awaits each publish's own future).
    #[cfg(test)]
    pub(crate) fn out(&self, chain: usize) -> Option<i64> {
        self.out[chain]
    }

    /// Every chain ended: what is left is the DELETE.
    pub(crate) fn over(&self) -> bool {
        self.running == 0 && self.begun == self.chains.len()
    }

    /// The pass's outcome: the rows the stream acknowledged, to delete.
    pub(crate) fn finish(self) -> Published {
        let mut report = self.report;
        if self.failure.is_some() {
            report.more = false;
        }
        Published {
            report,
            seqs: self.acked,
            failure: self.failure,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (seq, order, partition)
    type Row = (i64, u8, i16);

    impl Chained for Row {
        type Order = u8;
        fn seq(&self) -> i64 {
            self.0
        }
        fn order(&self) -> u8 {
            self.1
        }
        fn partition(&self) -> i16 {
            self.2
        }
    }

    fn seqs(sent: &[(usize, Row)]) -> Vec<i64> {
        sent.iter().map(|(_, row)| row.0).collect()
    }

    /// Takes every row that may go out now.
    fn sends(pass: &mut Pass<Row>, usable: impl Fn(i16) -> bool + Copy) -> Vec<(usize, Row)> {
        std::iter::from_fn(|| pass.next(usable)).collect()
    }

    #[test]
    fn chains_keep_each_orders_rows_in_seq_order() {
        let rows = vec![
            (1, 0, 0),
            (2, 1, 0),
            (3, 0, 0),
            (4, 2, 0),
            (5, 1, 0),
            (6, 0, 0),
        ];
        let seqs: Vec<Vec<i64>> = chains(rows)
            .iter()
            .map(|chain| chain.iter().map(|row| row.0).collect())
            .collect();
        assert_eq!(seqs, [vec![1, 3, 6], vec![2, 5], vec![4]]);
    }

    #[test]
    fn an_orders_next_row_goes_out_only_after_the_pubacks_of_those_before() {
        let mut pass = Pass::new(vec![(1, 0, 0), (2, 1, 0), (3, 0, 0)], 8, false);
        let first = sends(&mut pass, |_| true);
        assert_eq!(seqs(&first), [1, 2], "one row per order at a time");
        pass.settled(first[1].0, Settled::Acked { duplicate: false });
        assert!(sends(&mut pass, |_| true).is_empty(), "order 0 waits");
        pass.settled(first[0].0, Settled::Acked { duplicate: true });
        let second = sends(&mut pass, |_| true);
        assert_eq!(seqs(&second), [3]);
        pass.settled(second[0].0, Settled::Acked { duplicate: false });
        assert!(pass.over());
        let published = pass.finish();
        assert_eq!(published.seqs, [2, 1, 3]);
        assert_eq!(
            (published.report.published, published.report.duplicates),
            (2, 1)
        );
    }

    #[test]
    fn no_more_than_max_in_flight_orders_at_once() {
        let rows = (0..5).map(|order| (i64::from(order), order, 0)).collect();
        let mut pass = Pass::new(rows, 2, false);
        let first = sends(&mut pass, |_| true);
        assert_eq!(seqs(&first), [0, 1]);
        pass.settled(first[0].0, Settled::Acked { duplicate: false });
        assert_eq!(
            seqs(&sends(&mut pass, |_| true)),
            [2],
            "a slot freed, one more"
        );
    }

    #[test]
    fn a_broker_failure_holds_back_the_rest_of_the_pass() {
        let rows = vec![(1, 0, 0), (2, 1, 0), (3, 0, 0), (4, 2, 0)];
        let mut pass = Pass::new(rows, 2, true);
        let first = sends(&mut pass, |_| true);
        pass.settled(first[0].0, Settled::BrokerFailed("timed out".into()));
        pass.settled(first[1].0, Settled::Acked { duplicate: false });
        assert!(sends(&mut pass, |_| true).is_empty());
        assert!(pass.over());
        let published = pass.finish();
        assert_eq!(published.seqs, [2]);
        assert_eq!(published.failure.as_deref(), Some("timed out"));
        let report = published.report;
        assert_eq!(
            (report.failed, report.held_back, report.more),
            (1, 2, false)
        );
    }

    #[test]
    fn a_parked_row_holds_back_only_its_own_orders_later_rows() {
        let rows = vec![(1, 0, 0), (2, 0, 0), (3, 1, 0)];
        let mut pass = Pass::new(rows, 8, false);
        let first = sends(&mut pass, |_| true);
        pass.settled(first[0].0, Settled::Parked);
        pass.settled(first[1].0, Settled::Acked { duplicate: false });
        assert!(pass.over());
        let report = pass.finish().report;
        assert_eq!(
            (report.parked, report.held_back, report.published),
            (1, 1, 1)
        );
    }

    #[test]
    fn a_partition_without_enough_lease_left_sends_nothing() {
        let rows = vec![(1, 0, 0), (2, 1, 1), (3, 1, 1)];
        let mut pass = Pass::new(rows, 8, false);
        let sent = sends(&mut pass, |partition| partition == 0);
        assert_eq!(seqs(&sent), [1]);
        pass.settled(sent[0].0, Settled::Acked { duplicate: false });
        assert!(pass.over());
        assert_eq!(pass.finish().report.held_back, 2);
    }

    #[test]
    fn a_pass_that_cannot_reach_the_broker_sends_nothing() {
        let mut pass = Pass::new(vec![(1, 0, 0), (2, 1, 0)], 8, true);
        pass.hold_back_all("NATS is not connected".into());
        assert!(pass.over());
        let published = pass.finish();
        assert_eq!(
            (published.report.held_back, published.report.failed),
            (2, 1)
        );
        assert!(!published.report.more);
    }
}
