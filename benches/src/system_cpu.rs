//! Where the machine's CPU goes during a run: this process, the NATS server, PostgreSQL (its
//! postmaster and every backend) and the rest of the machine, read from /proc at two instants.
//! On two cores a consumer shares the machine with the servers it leans on, so its own CPU per
//! message says little about what limits it; this says what the whole system spends per message.

use anyhow::{Context as _, Result};
use serde::Serialize;

/// Clock ticks per second in /proc (USER_HZ), 100 on Linux.
const TICKS: f64 = 100.0;

/// CPU seconds used so far, by whom.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CpuSnapshot {
    this_user: f64,
    this_system: f64,
    nats_server: f64,
    postgres: f64,
    /// Every CPU's busy time (user, nice, system, irq, softirq, steal) from /proc/stat.
    machine: f64,
}

/// CPU µs per message between two snapshots, by whom. `rest`: the machine's busy time less the
/// others' (other processes, interrupts; a few µs either way from the ticks' resolution).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CpuSplit {
    pub this_process: f64,
    pub nats_server: f64,
    pub postgres: f64,
    pub rest: f64,
    pub machine: f64,
}

/// One /proc/<pid>/stat line's fields after the command name, and the command name.
struct ProcStat {
    command: String,
    parent: u32,
    user: u64,
    system: u64,
    /// cutime + cstime: its children that ended and were waited for.
    children: u64,
}

impl ProcStat {
    fn parse(line: &str) -> Option<Self> {
        // The command name, in parentheses, may hold spaces and parentheses: it ends at the
        // last ')'. The fields after it start with the state (field 3 of proc(5)).
        let (head, tail) = line.rsplit_once(')')?;
        let command = head.split_once('(')?.1.to_owned();
        let fields: Vec<&str> = tail.split_whitespace().collect();
        let number = |index: usize| fields.get(index)?.parse::<u64>().ok();
        Some(Self {
            command,
            parent: u32::try_from(number(1)?).ok()?,
            user: number(11)?,
            system: number(12)?,
            children: number(13)? + number(14)?,
        })
    }
}

/// The busy ticks of every CPU, from /proc/stat's first line.
fn machine_busy(stat: &str) -> Option<u64> {
    let fields: Vec<u64> = stat
        .lines()
        .next()?
        .strip_prefix("cpu ")?
        .split_whitespace()
        .map(|field| field.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal (guest time is inside user already).
    let busy = [0, 1, 2, 5, 6, 7];
    Some(busy.iter().filter_map(|index| fields.get(*index)).sum())
}

fn this_process() -> Result<ProcStat> {
    ProcStat::parse(&std::fs::read_to_string("/proc/self/stat").context("reading /proc/self/stat")?)
        .context("parsing /proc/self/stat")
}

/// The other processes' ticks and the machine's, so far.
struct Others {
    nats_server: u64,
    postgres: u64,
    machine: u64,
}

impl Others {
    fn read() -> Result<Self> {
        let mut processes = Vec::new();
        for entry in std::fs::read_dir("/proc").context("listing /proc")? {
            let entry = entry?;
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            // A process may end between the listing and the read: it is simply not counted.
            if let Ok(line) = std::fs::read_to_string(entry.path().join("stat"))
                && let Some(stat) = ProcStat::parse(&line)
            {
                processes.push((pid, stat));
            }
        }
        let postgres_pids: Vec<u32> = processes
            .iter()
            .filter(|(_, stat)| stat.command == "postgres")
            .map(|(pid, _)| *pid)
            .collect();
        let (mut nats, mut postgres) = (0, 0);
        for (_, stat) in &processes {
            match stat.command.as_str() {
                "nats-server" => nats += stat.user + stat.system,
                "postgres" => {
                    postgres += stat.user + stat.system;
                    // The postmaster: the backends that ended during the run are in its
                    // children's time.
                    if !postgres_pids.contains(&stat.parent) {
                        postgres += stat.children;
                    }
                }
                _ => {}
            }
        }
        let machine =
            machine_busy(&std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?)
                .context("parsing /proc/stat")?;
        Ok(Self {
            nats_server: nats,
            postgres,
            machine,
        })
    }
}

impl CpuSnapshot {
    /// At the start of what is measured: this process's time is read last, so that reading
    /// every process's stat file is not counted in it.
    pub fn before() -> Result<Self> {
        let others = Others::read()?;
        Ok(Self::of(&this_process()?, &others))
    }

    /// At the end of what is measured: this process's time is read first.
    pub fn after() -> Result<Self> {
        let this = this_process()?;
        Ok(Self::of(&this, &Others::read()?))
    }

    fn of(this: &ProcStat, others: &Others) -> Self {
        let seconds = |ticks: u64| ticks as f64 / TICKS;
        Self {
            this_user: seconds(this.user),
            this_system: seconds(this.system),
            nats_server: seconds(others.nats_server),
            postgres: seconds(others.postgres),
            machine: seconds(others.machine),
        }
    }

    /// This process's CPU seconds from `before` to this snapshot: user, system.
    pub fn this_process_since(&self, before: &Self) -> (f64, f64) {
        (
            self.this_user - before.this_user,
            self.this_system - before.this_system,
        )
    }

    /// What was spent from `before` to this snapshot, per message of `messages`.
    pub fn since(&self, before: &Self, messages: u64) -> CpuSplit {
        let per_message = |after: f64, before: f64| (after - before) * 1e6 / messages.max(1) as f64;
        let (user, system) = self.this_process_since(before);
        let this_process = per_message(user + system, 0.0);
        let nats_server = per_message(self.nats_server, before.nats_server);
        let postgres = per_message(self.postgres, before.postgres);
        let machine = per_message(self.machine, before.machine);
        CpuSplit {
            this_process,
            nats_server,
            postgres,
            rest: machine - this_process - nats_server - postgres,
            machine,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_is_read_after_the_last_parenthesis() {
        let line = "4242 (a (b) c) S 17 4242 4242 0 -1 4194560 100 0 0 0 250 75 12 3 20 0 1 0";
        let stat = ProcStat::parse(line).expect("parsed");
        assert_eq!(stat.command, "a (b) c");
        assert_eq!(
            (stat.parent, stat.user, stat.system, stat.children),
            (17, 250, 75, 15)
        );
    }

    #[test]
    fn the_machine_is_busy_for_all_but_idle_and_iowait() {
        let stat = "cpu  100 2 30 5000 40 6 7 8 0 0\ncpu0 50 1 15 2500 20 3 3 4 0 0\n";
        assert_eq!(machine_busy(stat), Some(100 + 2 + 30 + 6 + 7 + 8));
    }

    #[test]
    fn the_split_is_per_message_and_the_rest_is_the_machine_less_the_others() {
        let before = CpuSnapshot::default();
        let after = CpuSnapshot {
            this_user: 0.75,
            this_system: 0.25,
            nats_server: 0.5,
            postgres: 2.0,
            machine: 4.0,
        };
        let split = after.since(&before, 10_000);
        assert_eq!(
            (split.this_process, split.nats_server, split.postgres),
            (100.0, 50.0, 200.0)
        );
        assert_eq!((split.rest, split.machine), (50.0, 400.0));
    }
}
