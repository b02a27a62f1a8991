//! The relay's protocol as a model, checked exhaustively within bounds by stateright: two
//! relays, two partitions, writers appending events per order, the stream with its duplicate
//! window, a network that delays, a database that stalls, crashes and restarts, the database's
//! clock stepping forward, a relay suspended (its monotonic clock stopped while the world goes
//! on). The decisions are the relay's own code: the leases' ([`Deadlines`], [`RoundTimer`],
//! [`fair_share`], [`RelaySettings::check_window`]) and a pass's ([`Pass`]: the chains, what
//! goes out next, what a PubAck or a timeout does); the statements they lead to (conditional
//! updates on the database's clock, the DELETE) are simulated here, each round as one atomic
//! step.
//!
//! Properties: per order, the stream holds the events in commit order; no event is stored
//! twice; no row is deleted before its event is stored; a relay that is running never lets the
//! database's lease of a partition it holds lapse; once the writers stop and the faults end,
//! every event is stored by the horizon.
//!
//! Time moves in steps of a second, and only when nothing is due: a round, a pass that can go
//! on, a message or a delay past its bound. So a run cannot stall by never acting, and the
//! horizon's property is liveness within bounds.
//!
//! The bounded run is a test; a deeper one (longer horizon, more writes and faults) runs with
//! `cargo test -p inventory-infra --lib outbox::model -- --ignored --nocapture`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use stateright::{Checker, HasDiscoveries, Model, Property, UniformChooser};

use super::lease::{Deadlines, LeaseRound, RoundStatement, RoundTimer};
use super::pass::{Chained, Pass, Settled};
use super::relay::RelaySettings;

/// What the model runs: the relay's settings and the bounds of the world around it.
#[derive(Debug, Clone)]
struct Protocol {
    settings: RelaySettings,
    /// The stream's duplicate window.
    window: u64,
    relays: usize,
    partitions: usize,
    /// The order of each event, in commit order: event `i` is written in second `i`.
    writes: Vec<u8>,
    /// The longest a message (a publish, a PubAck) sent while the faults last travels: longer
    /// than the publish timeout, so that a publish can time out and still be stored. Once they
    /// end, a message arrives within the second.
    max_delay: u64,
    /// The longest the database holds back a pass's DELETE, or a lease round's statement,
    /// while the faults last (locks, a slow disk).
    db_stall: u64,
    /// Crashes of relay 0 (the relays are alike, so one stands for any).
    crashes: u8,
    /// Whether a crashed relay comes back, as a new holder.
    restarts: bool,
    /// Suspensions of relay 0.
    suspends: u8,
    /// The longest a relay stays suspended.
    suspend_for: u64,
    /// Steps of the database's clock, forward, of `db_step` seconds.
    db_steps: u8,
    db_step: i64,
    /// Faults start before this second.
    faults_until: u64,
    horizon: u64,
    /// The relay as it was before the lease keeper: rounds only between passes.
    rounds_between_passes: bool,
    /// A lease round's statements run as one step, not interleaved with anything else.
    atomic_rounds: bool,
    /// The local clocks' origin: a relay's instant is `base` plus its seconds.
    base: Instant,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Row {
    seq: u8,
    order: u8,
    event: u8,
    partition: i16,
}

impl Chained for Row {
    type Order = u8;
    fn seq(&self) -> i64 {
        i64::from(self.seq)
    }
    fn order(&self) -> u8 {
        self.order
    }
    fn partition(&self) -> i16 {
        self.partition
    }
}

/// A relay's pass under way: the relay's own [`Pass`], and when each chain's publish went out.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Passing {
    pass: Pass<Row>,
    /// Per chain with a publish out: when it was sent, local and true seconds.
    sent: BTreeMap<usize, (u64, u64)>,
    /// When the DELETE could first run (true seconds), once every chain ended.
    ready_at: Option<u64>,
}

impl Passing {
    fn over_at(&mut self, t: u64) {
        if self.pass.over() && self.ready_at.is_none() {
            self.ready_at = Some(t);
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct RelayState {
    /// Its incarnation: a restarted relay is a new holder.
    holder: u8,
    alive: bool,
    /// Suspended since this true second.
    suspended: Option<u64>,
    /// Its monotonic clock, in seconds.
    local: u64,
    deadlines: Deadlines,
    timer: RoundTimer,
    /// A lease round under way, and when its statement became ready (true seconds).
    round: Option<(LeaseRound, u64)>,
    pass: Option<Passing>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Lease {
    holder: Option<u8>,
    expires: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Message {
    holder: u8,
    row: Row,
    chain: usize,
    /// When the publish was sent (true seconds): it and its PubAck are one request.
    at: u64,
    /// When this leg of the trip began.
    sent: u64,
    /// On a PubAck: the stream had the event already.
    duplicate: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct State {
    t: u64,
    db_offset: i64,
    leases: Vec<Lease>,
    /// Heartbeat expiry per holder, database seconds.
    heartbeats: BTreeMap<u8, i64>,
    rows: Vec<Row>,
    written: usize,
    /// The stream's events, in the order stored.
    stream: Vec<u8>,
    /// When each event id was last stored (true seconds), for the duplicate window.
    stored_at: BTreeMap<u8, u64>,
    publishes: Vec<Message>,
    /// PubAcks on their way back: the publish, and whether it was a duplicate.
    acks: Vec<Message>,
    relays: Vec<RelayState>,
    crashes: u8,
    suspends: u8,
    db_steps: u8,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Action {
    Tick,
    StepDbClock,
    Write,
    Round(usize),
    BeginPass(usize),
    Send(usize),
    Deliver(usize),
    Ack(usize),
    /// A relay's publish on a chain has waited its timeout for a PubAck.
    TimeOut(usize, usize),
    EndPass(usize),
    Crash(usize),
    Restart(usize),
    Suspend(usize),
    Resume(usize),
}

impl Protocol {
    /// The relay's settings as `serve` runs them, scaled to seconds: lease 5 s, publish timeout
    /// 1 s, the narrowest window the start-up check allows.
    fn committed() -> Self {
        let settings = RelaySettings {
            lease: Duration::from_secs(5),
            publish_timeout: Duration::from_secs(1),
            ..RelaySettings::default()
        };
        Self {
            window: 24,
            settings,
            relays: 2,
            partitions: 2,
            writes: vec![0, 0],
            max_delay: 1,
            db_stall: 1,
            crashes: 0,
            restarts: false,
            suspends: 0,
            suspend_for: 3,
            db_steps: 0,
            db_step: 2,
            faults_until: 4,
            horizon: 8,
            rounds_between_passes: false,
            atomic_rounds: true,
            base: Instant::now(),
        }
    }

    fn lease(&self) -> u64 {
        self.settings.lease.as_secs()
    }

    fn margin(&self) -> Duration {
        self.settings.publish_timeout
    }

    fn instant(&self, local: u64) -> Instant {
        self.base + Duration::from_secs(local)
    }

    fn partition(&self, order: u8) -> i16 {
        i16::from(order) % i16::try_from(self.partitions).unwrap_or(1)
    }

    fn fresh_relay(&self, holder: u8, local: u64) -> RelayState {
        RelayState {
            holder,
            alive: true,
            suspended: None,
            local,
            deadlines: Deadlines::default(),
            timer: RoundTimer::new(self.settings.lease),
            round: None,
            pass: None,
        }
    }

    fn running(&self, state: &State, r: usize) -> bool {
        let relay = &state.relays[r];
        relay.alive && relay.suspended.is_none()
    }

    /// A relay was suspended, or the database's clock stepped: a relay's clock and the
    /// database's no longer agree.
    fn clocks_disagreed(&self, state: &State) -> bool {
        state.suspends < self.suspends || state.db_steps < self.db_steps
    }

    fn db_now(&self, state: &State) -> i64 {
        i64::try_from(state.t).unwrap_or(i64::MAX) + state.db_offset
    }

    /// A round under way, or one due to start.
    fn round_enabled(&self, state: &State, r: usize) -> bool {
        let relay = &state.relays[r];
        self.running(state, r)
            && (relay.round.is_some()
                || relay.timer.due(self.instant(relay.local))
                    && !(self.rounds_between_passes && relay.pass.is_some()))
    }

    /// The rows a pass started now would read: those in the partitions usable now.
    fn readable(&self, state: &State, r: usize) -> Vec<Row> {
        let relay = &state.relays[r];
        let usable = relay
            .deadlines
            .usable(self.instant(relay.local), self.margin());
        state
            .rows
            .iter()
            .filter(|row| usable.contains(&self.partition(row.order)))
            .copied()
            .collect()
    }

    /// The chains whose publish has waited its timeout.
    fn timed_out(&self, relay: &RelayState) -> Vec<usize> {
        let timeout = self.settings.publish_timeout.as_secs();
        relay.pass.as_ref().map_or_else(Vec::new, |passing| {
            passing
                .sent
                .iter()
                .filter(|(_, (local, _))| relay.local >= local + timeout)
                .map(|(chain, _)| *chain)
                .collect()
        })
    }

    /// Whether asking the pass for its next row now would do anything: send one, or end a
    /// chain that may not go on. The relay asks after every PubAck and timeout.
    fn would_send(&self, relay: &RelayState, passing: &Passing) -> bool {
        let now = self.instant(relay.local);
        let mut pass = passing.pass.clone();
        pass.next(|partition| relay.deadlines.still_usable(partition, now, self.margin()));
        pass != passing.pass
    }

    /// How long a message sent at `sent` may travel.
    fn delay(&self, sent: u64) -> u64 {
        if sent < self.faults_until {
            self.max_delay
        } else {
            0
        }
    }

    /// When a statement ready to run at `ready` (a pass's DELETE, a round's next statement)
    /// runs at the latest: the database may hold it back while the faults last.
    fn run_by(&self, ready: u64) -> u64 {
        if ready < self.faults_until {
            ready + self.db_stall
        } else {
            ready
        }
    }

    /// Something that must happen before time moves on.
    fn urgent(&self, state: &State) -> bool {
        let overdue = |message: &Message| state.t >= message.sent + self.delay(message.sent);
        if state.publishes.iter().any(overdue) || state.acks.iter().any(overdue) {
            return true;
        }
        if state.written < self.writes.len() && state.t >= state.written as u64 {
            return true;
        }
        (0..state.relays.len()).any(|r| {
            let relay = &state.relays[r];
            if let Some(since) = relay.suspended {
                return state.t >= since + self.suspend_for;
            }
            if !relay.alive {
                return false;
            }
            let round_due = match &relay.round {
                Some((_, ready)) => state.t >= self.run_by(*ready),
                None => self.round_enabled(state, r),
            };
            if round_due || !self.timed_out(relay).is_empty() {
                return true;
            }
            match &relay.pass {
                None => !self.readable(state, r).is_empty(),
                Some(passing) if self.would_send(relay, passing) => true,
                Some(passing) => passing
                    .ready_at
                    .is_some_and(|ready| state.t >= self.run_by(ready)),
            }
        })
    }

    /// The next statement of relay `r`'s lease round (the relay's own [`LeaseRound`]), run
    /// on the simulated database; starts a round if none is under way. With `atomic_rounds`,
    /// the whole round.
    fn round(&self, state: &mut State, r: usize) {
        let now = self.db_now(state);
        let lease = i64::try_from(self.lease()).unwrap_or(i64::MAX);
        let State {
            leases,
            heartbeats,
            relays,
            ..
        } = state;
        let relay = &mut relays[r];
        let holder = relay.holder;
        let (round, ready) = relay.round.get_or_insert_with(|| {
            let sent = self.instant(relay.local);
            relay.timer.made(sent);
            (
                LeaseRound::new(self.partitions, sent, self.settings.lease),
                state.t,
            )
        });
        *ready = state.t;
        let free = |lease: &Lease| lease.holder.is_none() || lease.expires <= now;
        while let Some(statement) = round.next() {
            match statement {
                RoundStatement::Heartbeat => {
                    heartbeats.insert(holder, now + lease);
                    round.ran();
                }
                RoundStatement::CountLive => {
                    round.live(heartbeats.values().filter(|e| **e > now).count());
                }
                RoundStatement::Renew => {
                    let mut renewed = Vec::new();
                    for (partition, row) in leases.iter_mut().enumerate() {
                        if row.holder == Some(holder) {
                            row.expires = now + lease;
                            renewed.push(i16::try_from(partition).unwrap_or(i16::MAX));
                        }
                    }
                    round.renewed(&mut relay.deadlines, &renewed);
                }
                RoundStatement::Release(partition) => {
                    let row = &mut leases[usize::try_from(partition).unwrap_or(0)];
                    if row.holder == Some(holder) {
                        *row = Lease {
                            holder: None,
                            expires: 0,
                        };
                    }
                    round.ran();
                }
                RoundStatement::FindFree => {
                    let found: Vec<i16> = (0..leases.len())
                        .filter(|partition| free(&leases[*partition]))
                        .map(|partition| i16::try_from(partition).unwrap_or(i16::MAX))
                        .collect();
                    round.found_free(&relay.deadlines, &found);
                }
                RoundStatement::Take(partition) => {
                    let row = &mut leases[usize::try_from(partition).unwrap_or(0)];
                    let took = free(row);
                    if took {
                        *row = Lease {
                            holder: Some(holder),
                            expires: now + lease,
                        };
                    }
                    round.took(&mut relay.deadlines, partition, took);
                }
                RoundStatement::Sweep => {
                    heartbeats.retain(|_, expires| *expires >= now - lease * 100);
                    round.ran();
                }
            }
            if !self.atomic_rounds {
                break;
            }
        }
        if round.next().is_none() {
            relay.round = None;
        }
    }
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            t: 0,
            db_offset: 0,
            leases: vec![
                Lease {
                    holder: None,
                    expires: 0
                };
                self.partitions
            ],
            heartbeats: BTreeMap::new(),
            rows: Vec::new(),
            written: 0,
            stream: Vec::new(),
            stored_at: BTreeMap::new(),
            publishes: Vec::new(),
            acks: Vec::new(),
            relays: (0..self.relays)
                .map(|r| self.fresh_relay(u8::try_from(r).unwrap_or(0), 0))
                .collect(),
            crashes: self.crashes,
            suspends: self.suspends,
            db_steps: self.db_steps,
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        if state.t >= self.horizon {
            return;
        }
        if !self.urgent(state) {
            actions.push(Action::Tick);
        }
        let faults = state.t < self.faults_until;
        if faults && state.db_steps > 0 {
            actions.push(Action::StepDbClock);
        }
        if state.written < self.writes.len() && state.t >= state.written as u64 {
            actions.push(Action::Write);
        }
        for i in 0..state.publishes.len() {
            actions.push(Action::Deliver(i));
        }
        for i in 0..state.acks.len() {
            actions.push(Action::Ack(i));
        }
        for r in 0..state.relays.len() {
            let relay = &state.relays[r];
            if relay.suspended.is_some() {
                actions.push(Action::Resume(r));
                continue;
            }
            if !relay.alive {
                if self.restarts {
                    actions.push(Action::Restart(r));
                }
                continue;
            }
            if faults && r == 0 && state.crashes > 0 {
                actions.push(Action::Crash(r));
            }
            if faults && r == 0 && state.suspends > 0 {
                actions.push(Action::Suspend(r));
            }
            if self.round_enabled(state, r) {
                actions.push(Action::Round(r));
            }
            for chain in self.timed_out(relay) {
                actions.push(Action::TimeOut(r, chain));
            }
            match &relay.pass {
                None if !self.readable(state, r).is_empty() => actions.push(Action::BeginPass(r)),
                Some(passing) if self.would_send(relay, passing) => actions.push(Action::Send(r)),
                // The database may run the DELETE as soon as it is ready, or stall it.
                Some(passing) if passing.ready_at.is_some() => actions.push(Action::EndPass(r)),
                _ => {}
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut state = last.clone();
        match action {
            Action::Tick => {
                state.t += 1;
                for relay in &mut state.relays {
                    if relay.alive && relay.suspended.is_none() {
                        relay.local += 1;
                    }
                }
            }
            Action::StepDbClock => {
                state.db_steps -= 1;
                state.db_offset += self.db_step;
            }
            Action::Write => {
                // A writer holds the order's lock: rows of one order commit in seq order.
                let event = u8::try_from(state.written).unwrap_or(u8::MAX);
                let order = self.writes[state.written];
                state.rows.push(Row {
                    seq: event,
                    order,
                    event,
                    partition: self.partition(order),
                });
                state.written += 1;
            }
            Action::Round(r) => self.round(&mut state, r),
            Action::BeginPass(r) => {
                let rows = self.readable(&state, r);
                state.relays[r].pass = Some(Passing {
                    pass: Pass::new(rows, self.settings.max_in_flight, false),
                    sent: BTreeMap::new(),
                    ready_at: None,
                });
            }
            Action::Send(r) => {
                let now = self.instant(state.relays[r].local);
                let RelayState {
                    holder,
                    local,
                    deadlines,
                    pass,
                    ..
                } = &mut state.relays[r];
                let passing = pass.as_mut()?;
                let usable = |partition| deadlines.still_usable(partition, now, self.margin());
                if let Some((chain, row)) = passing.pass.next(usable) {
                    passing.sent.insert(chain, (*local, state.t));
                    state.publishes.push(Message {
                        holder: *holder,
                        row,
                        chain,
                        at: state.t,
                        sent: state.t,
                        duplicate: false,
                    });
                }
                passing.over_at(state.t);
            }
            Action::Deliver(i) => {
                let message = state.publishes.remove(i);
                let event = message.row.event;
                let duplicate = state
                    .stored_at
                    .get(&event)
                    .is_some_and(|stored| state.t < stored + self.window);
                if !duplicate {
                    state.stream.push(event);
                    state.stored_at.insert(event, state.t);
                }
                state.acks.push(Message {
                    sent: state.t,
                    duplicate,
                    ..message
                });
            }
            Action::Ack(i) => {
                let ack = state.acks.remove(i);
                let relay = state
                    .relays
                    .iter_mut()
                    .find(|relay| relay.alive && relay.holder == ack.holder)?;
                let passing = relay.pass.as_mut()?;
                // A PubAck for a publish that timed out, or of an earlier pass, has no one
                // waiting for it.
                if passing
                    .sent
                    .get(&ack.chain)
                    .is_some_and(|(_, at)| *at == ack.at)
                    && passing.pass.out(ack.chain) == Some(ack.row.seq())
                {
                    passing.sent.remove(&ack.chain);
                    let duplicate = ack.duplicate;
                    passing
                        .pass
                        .settled(ack.chain, Settled::Acked { duplicate });
                    passing.over_at(state.t);
                }
            }
            Action::TimeOut(r, chain) => {
                let passing = state.relays[r].pass.as_mut()?;
                passing.sent.remove(&chain)?;
                let error = "no PubAck in time".to_owned();
                passing.pass.settled(chain, Settled::BrokerFailed(error));
                passing.over_at(state.t);
            }
            Action::EndPass(r) => {
                let passing = state.relays[r].pass.take()?;
                let deleted = passing.pass.finish().seqs;
                state.rows.retain(|row| !deleted.contains(&row.seq()));
            }
            Action::Crash(r) => {
                state.crashes -= 1;
                let relay = &mut state.relays[r];
                relay.alive = false;
                relay.round = None;
                relay.pass = None;
                relay.deadlines.clear();
            }
            Action::Restart(r) => {
                let holder = state
                    .relays
                    .iter()
                    .map(|relay| relay.holder)
                    .max()
                    .unwrap_or(0)
                    + 1;
                let local = state.relays[r].local;
                state.relays[r] = self.fresh_relay(holder, local);
            }
            Action::Suspend(r) => {
                state.suspends -= 1;
                state.relays[r].suspended = Some(state.t);
            }
            Action::Resume(r) => state.relays[r].suspended = None,
        }
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "each order's events in commit order",
                |model: &Protocol, state: &State| {
                    model.writes.iter().all(|order| {
                        let events: Vec<u8> = state
                            .stream
                            .iter()
                            .copied()
                            .filter(|event| model.writes[usize::from(*event)] == *order)
                            .collect();
                        events.windows(2).all(|pair| pair[0] < pair[1])
                    })
                },
            ),
            Property::always("no event stored twice", |_, state: &State| {
                let mut seen = state.stream.clone();
                seen.sort_unstable();
                seen.dedup();
                seen.len() == state.stream.len()
            }),
            Property::always(
                "no row deleted before its event is stored",
                |_, state: &State| {
                    (0..state.written).all(|event| {
                        let event = u8::try_from(event).unwrap_or(u8::MAX);
                        state.rows.iter().any(|row| row.event == event)
                            || state.stream.contains(&event)
                    })
                },
            ),
            // While the clocks agree: a suspension (the relay's clock stopped) or a step of the
            // database's clock can make a lease lapse under its holder, which the duplicate
            // window covers; the random walks found the two together doing so.
            Property::always(
                "a running relay's leases do not lapse",
                |model: &Protocol, state: &State| {
                    if model.clocks_disagreed(state) {
                        return true;
                    }
                    let now = model.db_now(state);
                    state.relays.iter().enumerate().all(|(r, relay)| {
                        !model.running(state, r)
                            || state.leases.iter().all(|lease| {
                                lease.holder != Some(relay.holder) || lease.expires > now
                            })
                    })
                },
            ),
            // What lets a relay publish without asking the database: it never believes it has
            // more of a lease left than the database gives it.
            Property::always(
                "a relay sees no more of a lease than the database gives it",
                |model: &Protocol, state: &State| {
                    if model.clocks_disagreed(state) {
                        return true;
                    }
                    let now = model.db_now(state);
                    state.relays.iter().enumerate().all(|(r, relay)| {
                        let local = model.instant(relay.local);
                        !model.running(state, r)
                            || relay
                                .deadlines
                                .usable(local, Duration::ZERO)
                                .into_iter()
                                .all(|partition| {
                                    let lease =
                                        state.leases[usize::try_from(partition).unwrap_or(0)];
                                    let left = u64::try_from(lease.expires - now).unwrap_or(0);
                                    lease.holder == Some(relay.holder)
                                        && !relay.deadlines.still_usable(
                                            partition,
                                            local,
                                            Duration::from_secs(left),
                                        )
                                })
                    })
                },
            ),
            Property::always(
                "every event stored by the horizon",
                |model: &Protocol, state: &State| {
                    state.t < model.horizon
                        || (0..model.writes.len())
                            .all(|event| state.stream.contains(&u8::try_from(event).unwrap_or(0)))
                },
            ),
        ]
    }

    fn within_boundary(&self, state: &State) -> bool {
        state.t <= self.horizon
    }
}

/// Checks `protocol` to the end, or until it breaks `expected`, and returns the properties
/// it found broken, each with the steps that break it.
fn violations(
    protocol: Protocol,
    expected: Option<&'static str>,
) -> BTreeMap<&'static str, String> {
    let mut checker = protocol.checker().threads(2);
    if let Some(name) = expected {
        checker = checker.finish_when(HasDiscoveries::AnyOf([name].into()));
    }
    let checker = checker.spawn_bfs().join();
    println!(
        "{} states, {} unique, depth {}",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth()
    );
    broken(&checker)
}

/// Checks `protocol` to the end and fails, with the steps, on any property it breaks.
fn assert_keeps_every_property(protocol: Protocol, what: &str) {
    let found = violations(protocol, None);
    assert!(found.is_empty(), "{what}: {found:#?}");
}

/// Checks `protocol` until it breaks `property`, and fails unless it does.
fn assert_breaks(protocol: Protocol, property: &'static str) {
    let found = violations(protocol, Some(property));
    assert!(found.contains_key(property), "{found:#?}");
}

/// The properties `checker` found broken, each with the steps that break it.
fn broken(checker: &impl Checker<Protocol>) -> BTreeMap<&'static str, String> {
    checker
        .discoveries()
        .into_iter()
        .map(|(name, path)| (name, format!("{:?}", path.into_actions())))
        .collect()
}

/// The committed protocol with each kind of fault in turn (checked apart: together their
/// interleavings outgrow a test's minute).
fn committed_with_each_fault() -> Vec<(&'static str, Protocol)> {
    let committed = Protocol::committed();
    vec![
        ("delays and a stalled DELETE", committed.clone()),
        (
            "a crash",
            Protocol {
                crashes: 1,
                horizon: 12,
                ..committed.clone()
            },
        ),
        (
            "a suspension",
            Protocol {
                suspends: 1,
                horizon: 12,
                ..committed.clone()
            },
        ),
        (
            "a step of the database's clock",
            Protocol {
                db_steps: 1,
                ..committed
            },
        ),
    ]
}

#[test]
fn the_protocol_as_committed_keeps_every_property() {
    for (fault, protocol) in committed_with_each_fault() {
        let window = Duration::from_secs(protocol.window);
        assert!(protocol.settings.check_window("S", window).is_ok());
        assert_keeps_every_property(protocol, fault);
    }
}

/// The rounds' statements interleaved with everything else (another relay's round, a publish,
/// a PubAck): the relay runs them one by one, not as a transaction. Checked with messages
/// delayed but no statement held back: with a second's stall as well, the checker went
/// through 78 million states in 17 minutes; the random walks below take them all together.
#[test]
fn lease_rounds_interleaved_statement_by_statement_keep_every_property() {
    let interleaved = Protocol {
        atomic_rounds: false,
        db_stall: 0,
        ..Protocol::committed()
    };
    assert_keeps_every_property(interleaved, "the rounds interleaved");
}

/// Three relays on three partitions: the fair share is then one each, and partitions change
/// hands as the relays start. One event, no statement held back: two events took the checker
/// past two and a half minutes; the random walks below take more.
#[test]
fn three_relays_keep_every_property() {
    let three = Protocol {
        relays: 3,
        partitions: 3,
        writes: vec![0],
        db_stall: 0,
        ..Protocol::committed()
    };
    assert_keeps_every_property(three, "three relays");
}

/// The start-up check removed: with a window shorter than a lease, a relay that took over
/// from one that crashed after its PubAck and before its DELETE republishes the event after
/// the window, and the stream stores it twice.
#[test]
fn a_window_the_start_up_check_refuses_lets_an_event_be_stored_twice() {
    let protocol = Protocol {
        window: 4,
        crashes: 1,
        horizon: 14,
        ..Protocol::committed()
    };
    let window = Duration::from_secs(protocol.window);
    assert!(protocol.settings.check_window("S", window).is_err());
    assert_breaks(protocol, "no event stored twice");
}

/// Renewal stopped while a pass runs (the rounds made only between passes, as before the
/// lease keeper): a pass whose DELETE the database holds back for longer than the lease lets
/// the lease lapse under a relay that is running.
#[test]
fn rounds_only_between_passes_let_a_lease_lapse() {
    let stalled = Protocol {
        db_stall: 6,
        horizon: 14,
        ..Protocol::committed()
    };
    let between_passes = Protocol {
        rounds_between_passes: true,
        ..stalled.clone()
    };
    assert_breaks(between_passes, "a running relay's leases do not lapse");
    assert_keeps_every_property(stalled, "with the lease keeper");
}

/// A relay suspended for longer than the duplicate window (its monotonic clock stopped, so it
/// still believes its lease holds) resumes its pass and sends an event the next holder stored
/// a window ago: stored twice. An assumption the relay cannot check: a host is not suspended
/// for longer than the window less the lease.
#[test]
fn a_suspension_longer_than_the_window_lets_an_event_be_stored_twice() {
    let protocol = Protocol {
        suspends: 1,
        suspend_for: 26,
        horizon: 30,
        ..Protocol::committed()
    };
    assert_breaks(protocol, "no event stored twice");
}

/// The deeper run, by random walks rather than exhaustively (the exhaustive checker outgrows
/// memory at these bounds): three relays, three partitions, two orders' events interleaved,
/// every fault at once, a crashed relay restarting as a new holder. For
/// `INVENTORY_MODEL_SECONDS` (default 60).
#[test]
#[ignore = "a minute or more: run with --ignored"]
fn random_walks_through_every_fault_at_once_keep_every_property() {
    let protocol = Protocol {
        relays: 3,
        partitions: 3,
        writes: vec![0, 1, 0, 2, 1],
        crashes: 1,
        restarts: true,
        suspends: 1,
        db_steps: 1,
        horizon: 16,
        atomic_rounds: false,
        ..Protocol::committed()
    };
    let seconds = std::env::var("INVENTORY_MODEL_SECONDS")
        .ok()
        .and_then(|seconds| seconds.parse().ok())
        .unwrap_or(60);
    let checker = protocol
        .checker()
        .threads(2)
        .timeout(Duration::from_secs(seconds))
        .spawn_simulation(0, UniformChooser)
        .join();
    println!("{} states visited", checker.state_count());
    let found = broken(&checker);
    assert!(found.is_empty(), "{found:#?}");
}
