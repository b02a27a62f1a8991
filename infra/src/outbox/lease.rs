//! Partition leases: how several relays share an outbox without a leader.
//!
//! The outbox's rows fall into [`PARTITIONS`] partitions by order. A relay publishes only the
//! partitions it leases (`outbox_leases`, one row per outbox and partition: holder, expiry).
//! Each relay also keeps a heartbeat row (`outbox_relays`); the live heartbeats say how many
//! relays there are, and each aims at its fair share, `ceil(16 / live relays)`: it takes free
//! or expired partitions up to it and releases what it holds beyond it. Nobody hands
//! partitions out, so there is no leader to lose or to split: every step is one conditional
//! statement that the database serializes (taking a partition succeeds only while it is free
//! or expired; renewing only while this relay is still its holder).
//!
//! Expiry is measured by the database's clock (milliseconds since the epoch), the one clock
//! every relay shares. A relay's own view of its lease is measured by its monotonic clock
//! from just *before* it sent the renewal, so it always believes its lease ends no later than
//! the database says it does.
//!
//! The rounds run on a timer of their own (the relay's lease keeper), not between passes: a
//! pass lasts as long as its slowest chain, which can outlast the lease. The partitions held
//! and their deadlines are shared with the passes through [`Held`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use inventory_domain::outbox::PARTITIONS;
use sea_orm::sea_query::{
    Asterisk, Expr, ExprTrait, Func, OnConflict, Order, Query, UpdateStatement,
};
use sea_orm::{ConnectionTrait, DbBackend, DbErr};

use crate::db::column_of_rows;

/// The partitions' leases and the relays' heartbeats, one table of each for every outbox.
const LEASES: &str = "outbox_leases";
const RELAYS: &str = "outbox_relays";

/// The database's clock in milliseconds since the epoch. sea-query has no portable expression
/// for it, so each backend's is a fixed fragment, which names no column and holds no value.
fn now_ms(backend: DbBackend) -> Expr {
    Expr::cust(match backend {
        DbBackend::Postgres => "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
        _ => "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
    })
}

/// A lease row nobody holds, or whose holder let it expire.
fn free_or_expired(backend: DbBackend) -> Expr {
    Expr::col("holder")
        .is_null()
        .or(Expr::col("expires_at").lte(now_ms(backend)))
}

/// The partitions one relay should hold when `live` relays share `partitions`: the fair
/// share, rounded up so that the shares cover every partition.
pub(crate) fn fair_share(partitions: usize, live: usize) -> usize {
    partitions.div_ceil(live.max(1))
}

/// The lease decisions, apart from the statements that carry them out: which partitions a
/// relay holds and until when (its local, monotonic instant) it may publish each. The relay
/// runs them on the database's answers; the protocol's model (`model.rs`) runs the same code on
/// a simulated database, network and clocks.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub(crate) struct Deadlines(BTreeMap<i16, Instant>);

impl Deadlines {
    /// The partitions this relay may start a publish in now: held, with at least `margin`
    /// of the lease left, so a publish started now ends (or gives up) while the lease holds.
    pub(crate) fn usable(&self, now: Instant, margin: Duration) -> Vec<i16> {
        self.0
            .iter()
            .filter(|(_, deadline)| now + margin < **deadline)
            .map(|(partition, _)| *partition)
            .collect()
    }

    /// Whether `partition` is usable now (see [`Self::usable`]).
    pub(crate) fn still_usable(&self, partition: i16, now: Instant, margin: Duration) -> bool {
        self.0
            .get(&partition)
            .is_some_and(|deadline| now + margin < *deadline)
    }

    /// After a renewal: `renewed` (the partitions the database still has this relay hold) are
    /// held `until`, measured from before the renewal was sent; returns those held before and
    /// not renewed, which another relay took after they expired.
    pub(crate) fn renewed(&mut self, renewed: &[i16], until: Instant) -> Vec<i16> {
        let lost = self
            .0
            .keys()
            .filter(|partition| !renewed.contains(partition))
            .copied()
            .collect();
        self.0 = renewed
            .iter()
            .map(|partition| (*partition, until))
            .collect();
        lost
    }

    /// The partitions held beyond the fair share, the highest first: those to give back.
    pub(crate) fn beyond(&self, fair: usize) -> Vec<i16> {
        let extra = self.0.len().saturating_sub(fair);
        self.0.keys().rev().take(extra).copied().collect()
    }

    /// How many more partitions it should take to reach the fair share.
    pub(crate) fn wanted(&self, fair: usize) -> usize {
        fair.saturating_sub(self.0.len())
    }

    pub(crate) fn took(&mut self, partition: i16, until: Instant) {
        self.0.insert(partition, until);
    }

    /// Forgets a partition before it is given back, so that nothing starts in it meanwhile.
    pub(crate) fn release(&mut self, partition: i16) {
        self.0.remove(&partition);
    }

    pub(crate) fn clear(&mut self) {
        self.0.clear();
    }

    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }
}

/// When a lease round is due: every fifth of the lease, so a relay renews several times before
/// its lease can run out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct RoundTimer {
    every: Duration,
    last: Option<Instant>,
}

impl RoundTimer {
    pub(crate) fn new(lease: Duration) -> Self {
        Self {
            every: lease / 5,
            last: None,
        }
    }

    pub(crate) fn due(&self, now: Instant) -> bool {
        self.last
            .is_none_or(|last| now.duration_since(last) >= self.every)
    }

    /// When the next round is due; `now` before the first.
    pub(crate) fn next(&self, now: Instant) -> Instant {
        self.last.map_or(now, |last| last + self.every)
    }

    /// A round made (or skipped) at `now`.
    pub(crate) fn made(&mut self, now: Instant) {
        self.last = Some(now);
    }
}

/// A statement of a lease round, as [`LeaseRound`] asks for it. Each stands alone and is
/// conditional where another relay may race it, so the database serializes the decisions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum RoundStatement {
    /// Writes this relay's heartbeat: it counts among the live relays for one lease.
    Heartbeat,
    /// Counts the live heartbeats.
    CountLive,
    /// Extends every lease this relay still holds by one lease from the database's now, and
    /// returns their partitions.
    Renew,
    /// Gives a partition back, if this relay still holds it.
    Release(i16),
    /// Lists the partitions free or expired now.
    FindFree,
    /// Takes a partition, if it is still free or expired when the statement runs: of two
    /// relays racing for it, one wins.
    Take(i16),
    /// Removes heartbeats of relays gone for a hundred leases.
    Sweep,
}

/// One lease round's decisions, without I/O: which statement comes next, given the answers to
/// those before. Heartbeat, count the live relays, renew what is still this relay's, then move
/// towards the fair share: release the partitions beyond it (the highest first), or take free
/// and expired ones up to it. [`Leases::round`] runs its statements on the database; the
/// protocol's model (`model.rs`) on a simulated one, one statement a step.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct LeaseRound {
    partitions: usize,
    /// Until when what is renewed or taken may be published in: the lease, from before the
    /// round's first statement was sent.
    until: Instant,
    fair: usize,
    /// The statement to run now; `None` once the round is over.
    next: Option<RoundStatement>,
    /// Statements decided and still to run after `next`.
    then: Vec<RoundStatement>,
    /// Free partitions not yet tried.
    free: Vec<i16>,
    round: Round,
}

impl LeaseRound {
    /// A round over `partitions`, its first statement sent at `sent`.
    pub(crate) fn new(partitions: usize, sent: Instant, lease: Duration) -> Self {
        Self {
            partitions,
            until: sent + lease,
            fair: partitions,
            next: Some(RoundStatement::Heartbeat),
            then: Vec::new(),
            free: Vec::new(),
            round: Round::default(),
        }
    }

    /// The statement to run now, `None` once the round is over.
    pub(crate) fn next(&self) -> Option<RoundStatement> {
        self.next
    }

    /// The statement ran, with nothing to report (a heartbeat, a release, the sweep).
    pub(crate) fn ran(&mut self) {
        self.next = match self.next {
            Some(RoundStatement::Heartbeat) => Some(RoundStatement::CountLive),
            _ => self.then.pop(),
        };
    }

    /// [`RoundStatement::CountLive`]'s answer.
    pub(crate) fn live(&mut self, live: usize) {
        let live = live.max(1);
        self.fair = fair_share(self.partitions, live);
        self.round.live_relays = live;
        self.round.fair_share = self.fair;
        self.next = Some(RoundStatement::Renew);
    }

    /// [`RoundStatement::Renew`]'s answer: the partitions the database still has this relay
    /// hold. What it held and is not among them, another relay took after it expired.
    pub(crate) fn renewed(&mut self, deadlines: &mut Deadlines, renewed: &[i16]) {
        self.round.lost = deadlines.renewed(renewed, self.until);
        let beyond = deadlines.beyond(self.fair);
        self.then = vec![RoundStatement::Sweep];
        if !beyond.is_empty() {
            // Forgotten before they are given back, so that no publish starts in them.
            for partition in &beyond {
                deadlines.release(*partition);
            }
            self.round.released.clone_from(&beyond);
            self.then
                .extend(beyond.iter().rev().map(|p| RoundStatement::Release(*p)));
        } else if deadlines.wanted(self.fair) > 0 {
            self.then.push(RoundStatement::FindFree);
        }
        self.next = self.then.pop();
    }

    /// [`RoundStatement::FindFree`]'s answer, in partition order.
    pub(crate) fn found_free(&mut self, deadlines: &Deadlines, free: &[i16]) {
        self.free = free.iter().rev().copied().collect();
        self.next = self.next_take(deadlines);
    }

    /// [`RoundStatement::Take`]'s answer: whether it took the partition.
    pub(crate) fn took(&mut self, deadlines: &mut Deadlines, partition: i16, took: bool) {
        if took {
            deadlines.took(partition, self.until);
            self.round.taken.push(partition);
        }
        self.next = self.next_take(deadlines);
    }

    fn next_take(&mut self, deadlines: &Deadlines) -> Option<RoundStatement> {
        match self.free.pop() {
            Some(partition) if deadlines.wanted(self.fair) > 0 => {
                Some(RoundStatement::Take(partition))
            }
            _ => self.then.pop(),
        }
    }

    /// What the round did, once it is over.
    pub(crate) fn finish(self) -> Round {
        self.round
    }
}

/// A relay's [`Deadlines`], written by the lease rounds, read by the passes while they publish.
#[derive(Debug, Clone, Default)]
pub(crate) struct Held(Arc<Mutex<Deadlines>>);

impl Held {
    fn lock(&self) -> MutexGuard<'_, Deadlines> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// See [`Deadlines::usable`].
    pub(crate) fn usable(&self, now: Instant, margin: Duration) -> Vec<i16> {
        self.lock().usable(now, margin)
    }

    /// See [`Deadlines::still_usable`].
    pub(crate) fn still_usable(&self, partition: i16, now: Instant, margin: Duration) -> bool {
        self.lock().still_usable(partition, now, margin)
    }

    pub(crate) fn count(&self) -> usize {
        self.lock().len()
    }
}

/// One relay's leases on one outbox.
#[derive(Debug)]
pub(crate) struct Leases {
    outbox: String,
    holder: String,
    lease: Duration,
    held: Held,
    timer: RoundTimer,
}

/// What one round of [`Leases::round`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub(crate) struct Round {
    pub(crate) live_relays: usize,
    pub(crate) fair_share: usize,
    pub(crate) taken: Vec<i16>,
    pub(crate) released: Vec<i16>,
    /// Held before and no longer this relay's: another relay took it after it expired.
    pub(crate) lost: Vec<i16>,
}

impl Leases {
    pub(crate) fn new(outbox: &str, holder: &str, lease: Duration) -> Self {
        Self {
            outbox: outbox.to_owned(),
            holder: holder.to_owned(),
            lease,
            held: Held::default(),
            timer: RoundTimer::new(lease),
        }
    }

    /// The partitions held, as the passes see them.
    pub(crate) fn held(&self) -> Held {
        self.held.clone()
    }

    fn lease_ms(&self) -> i64 {
        i64::try_from(self.lease.as_millis()).unwrap_or(i64::MAX)
    }

    /// One lease from the database's now: when a lease renewed or taken now runs out.
    fn lease_end(&self, backend: DbBackend) -> Expr {
        now_ms(backend).add(self.lease_ms())
    }

    /// This outbox's rows (of either table).
    fn this_outbox(&self) -> Expr {
        Expr::col("outbox").eq(self.outbox.as_str())
    }

    /// This relay's rows of this outbox: its heartbeat, the leases it holds.
    fn mine(&self) -> Expr {
        self.this_outbox()
            .and(Expr::col("holder").eq(self.holder.as_str()))
    }

    /// Makes the outbox's partition rows exist and writes this relay's heartbeat, so the
    /// relays already running count it at their next round.
    pub(crate) async fn register(&self, db: &impl ConnectionTrait) -> Result<(), DbErr> {
        let partitions = Query::insert()
            .into_table(LEASES)
            .columns(["outbox", "relay_partition", "holder", "expires_at"])
            .values_from_panic((0..PARTITIONS).map(|partition| {
                [
                    self.outbox.as_str().into(),
                    i16::from(partition).into(),
                    Expr::null(),
                    0_i64.into(),
                ]
            }))
            .on_conflict(
                OnConflict::columns(["outbox", "relay_partition"])
                    .do_nothing()
                    .to_owned(),
            )
            .to_owned();
        db.execute(&partitions).await?;
        self.heartbeat(db).await
    }

    async fn heartbeat(&self, db: &impl ConnectionTrait) -> Result<(), DbErr> {
        let heartbeat = Query::insert()
            .into_table(RELAYS)
            .columns(["outbox", "holder", "expires_at"])
            .values_panic([
                self.outbox.as_str().into(),
                self.holder.as_str().into(),
                self.lease_end(db.get_database_backend()),
            ])
            .on_conflict(
                OnConflict::columns(["outbox", "holder"])
                    .update_column("expires_at")
                    .to_owned(),
            )
            .to_owned();
        db.execute(&heartbeat).await.map(drop)
    }

    /// Whether a round is due (see [`RoundTimer`]).
    pub(crate) fn due(&self, now: Instant) -> bool {
        self.timer.due(now)
    }

    /// Counts a round as made at `now` without making it: a relay standing aside holds
    /// nothing to renew, and asks again a round later.
    pub(crate) fn skip_round(&mut self, now: Instant) {
        self.timer.made(now);
    }

    /// When the next round is due.
    pub(crate) fn next_round(&self) -> Instant {
        self.timer.next(Instant::now())
    }

    /// One round (see [`LeaseRound`]), its statements run on `db`.
    pub(crate) async fn round(&mut self, db: &impl ConnectionTrait) -> Result<Round, DbErr> {
        let sent = Instant::now();
        self.timer.made(sent);
        let mut round = LeaseRound::new(usize::from(PARTITIONS), sent, self.lease);
        while let Some(next) = round.next() {
            match next {
                RoundStatement::Heartbeat => {
                    self.heartbeat(db).await?;
                    round.ran();
                }
                RoundStatement::CountLive => round.live(self.count_live(db).await?),
                RoundStatement::Renew => {
                    let renewed = self.renew(db).await?;
                    round.renewed(&mut self.held.lock(), &renewed);
                }
                RoundStatement::Release(partition) => {
                    self.release_one(db, partition).await?;
                    round.ran();
                }
                RoundStatement::FindFree => {
                    let free = self.find_free(db).await?;
                    round.found_free(&self.held.lock(), &free);
                }
                RoundStatement::Take(partition) => {
                    let took = self.take(db, partition).await?;
                    round.took(&mut self.held.lock(), partition, took);
                }
                RoundStatement::Sweep => {
                    self.sweep(db).await?;
                    round.ran();
                }
            }
        }
        Ok(round.finish())
    }

    async fn count_live(&self, db: &impl ConnectionTrait) -> Result<usize, DbErr> {
        let count = Query::select()
            .expr_as(Func::count(Expr::col(Asterisk)), "live")
            .from(RELAYS)
            .and_where(self.this_outbox())
            .and_where(Expr::col("expires_at").gt(now_ms(db.get_database_backend())))
            .to_owned();
        let live = db
            .query_one(&count)
            .await?
            .map(|row| row.try_get::<i64>("", "live"))
            .transpose()?
            .unwrap_or(1);
        Ok(usize::try_from(live).unwrap_or(1))
    }

    /// Renewed only where this relay is still the holder: a partition someone else took after
    /// it expired is theirs.
    async fn renew(&self, db: &impl ConnectionTrait) -> Result<Vec<i16>, DbErr> {
        let renew = Query::update()
            .table(LEASES)
            .value("expires_at", self.lease_end(db.get_database_backend()))
            .and_where(self.mine())
            .returning_col("relay_partition")
            .to_owned();
        column_of_rows(db, &renew, "relay_partition").await
    }

    async fn find_free(&self, db: &impl ConnectionTrait) -> Result<Vec<i16>, DbErr> {
        let free = Query::select()
            .column("relay_partition")
            .from(LEASES)
            .and_where(self.this_outbox())
            .and_where(free_or_expired(db.get_database_backend()))
            .order_by("relay_partition", Order::Asc)
            .to_owned();
        column_of_rows(db, &free, "relay_partition").await
    }

    /// Taken only if still free or expired when the database gets to it: of two relays
    /// racing for it, one wins.
    async fn take(&self, db: &impl ConnectionTrait, partition: i16) -> Result<bool, DbErr> {
        let backend = db.get_database_backend();
        let take = Query::update()
            .table(LEASES)
            .values([
                ("holder", self.holder.as_str().into()),
                ("expires_at", self.lease_end(backend)),
            ])
            .and_where(self.this_outbox())
            .and_where(Expr::col("relay_partition").eq(partition))
            .and_where(free_or_expired(backend))
            .to_owned();
        let took = db.execute(&take).await?.rows_affected();
        Ok(took == 1)
    }

    /// Heartbeats of relays gone for a long time are only clutter.
    async fn sweep(&self, db: &impl ConnectionTrait) -> Result<(), DbErr> {
        let gone_since = now_ms(db.get_database_backend()).sub(self.lease_ms() * 100);
        let sweep = Query::delete()
            .from_table(RELAYS)
            .and_where(self.this_outbox())
            .and_where(Expr::col("expires_at").lt(gone_since))
            .to_owned();
        db.execute(&sweep).await.map(drop)
    }

    /// Frees the leases this relay holds, at once (expiry 0).
    fn give_back(&self) -> UpdateStatement {
        Query::update()
            .table(LEASES)
            .values([("holder", Expr::null()), ("expires_at", 0_i64.into())])
            .and_where(self.mine())
            .to_owned()
    }

    /// Gives `partition` back if this relay still holds it (already forgotten by the round).
    async fn release_one(&self, db: &impl ConnectionTrait, partition: i16) -> Result<(), DbErr> {
        let release = self
            .give_back()
            .and_where(Expr::col("relay_partition").eq(partition))
            .to_owned();
        db.execute(&release).await.map(drop)
    }

    /// Gives every partition back and removes the heartbeat, so the other relays take over
    /// at their next round instead of waiting for the leases to expire.
    pub(crate) async fn release_all(&mut self, db: &impl ConnectionTrait) -> Result<(), DbErr> {
        self.held.lock().clear();
        db.execute(&self.give_back()).await?;
        let heartbeat = Query::delete()
            .from_table(RELAYS)
            .and_where(self.mine())
            .to_owned();
        db.execute(&heartbeat).await.map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::fair_share;

    #[test]
    fn the_fair_shares_cover_every_partition() {
        for live in 1..=20 {
            let share = fair_share(16, live);
            assert!(share * live >= 16, "{live} relays");
            assert!(
                share * (live) < 16 + live,
                "{live} relays: no more than needed"
            );
        }
        assert_eq!(fair_share(16, 1), 16);
        assert_eq!(fair_share(16, 2), 8);
        assert_eq!(fair_share(16, 3), 6);
        assert_eq!(fair_share(16, 0), 16);
    }
}
