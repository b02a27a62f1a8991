//! The slow tier: the real `inventory` binary against real servers under faults and load.
//!
//! Every test here is `#[ignore]`d so a plain `cargo test` stays quick; `scripts/test.sh` runs
//! them after the fast suite (`cargo test --workspace --test reliability -- --ignored`). Each
//! prints its figures (seed, kills, counts, throughput, memory) to stderr: add `--nocapture`.
//!
//! # Layout
//! - `support`: running `inventory serve` (or any command) as a process, killing and restarting it; `Served`,
//!   the strategy a scenario runs and the promise checked after it.
//! - `kill9`: instances SIGKILLed and restarted at random moments under a producer: the natural
//!   key (one statement, and batches of 16), the inbox, the email.
//! - `outages`: PostgreSQL and NATS stopped or killed and restarted mid-stream, under the
//!   natural key, the inbox and the email.
//! - `network`: a fault-injecting proxy between two natural-key instances and PostgreSQL and
//!   NATS: latency, connections cut mid-statement and right after a commit, blackholes.
//! - `cluster`: a three-node JetStream cluster losing its stream leader mid-stream.
//! - `failover`: the PostgreSQL primary SIGKILLed behind HAProxy, its synchronous standby
//!   promoted and HAProxy switched to it, under two natural-key instances.
//! - `patroni`: the leader of a Patroni pair (synchronous replication, HAProxy following the
//!   primary by health checks) SIGKILLed under a writer: no acknowledged commit lost; and the
//!   same with the standby cut off, which loses some.
//! - `patroni_service`: the same failover as one shard of two on a sharded stream, its two
//!   `serve --shard` instances reaching the pair through HAProxy, never restarted: every order
//!   reserved exactly once on its book's shard, the other shard acking throughout; and the same
//!   with the standby cut off, which loses reservations the failed shard acked.
//! - `patroni_move`: `inventory shard move` of a partition onto a shard on the Patroni pair,
//!   whose leader is killed during the copy: the move finishes (on its own, or run again) with
//!   every reservation on the new shard exactly once.
//! - `load`: 100,000 messages through one instance; throughput and memory.
//! - `moving`: partitions moved back and forth between two shards under load, the mover
//!   SIGKILLed at each step and run again, an instance of the old shard SIGSTOPped through the
//!   fence, two movers and an abort at once: every line decided once, on the shard that holds it.
//! - `relay_outage`: NATS away for over a minute under two `inventory relay` processes while
//!   decisions keep being committed.
//! - `stall`: the database silent for longer than the delivery cap allows, the instance
//!   SIGKILLed as it comes back: no order neither reserved nor dead-lettered.
//! - `chain`: every process of the chain (orders relays, natural instances, Inventory's relay,
//!   the email notifier) SIGKILLed and restarted at random under 5,000 orders.
#![expect(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test fails by panicking"
)]

mod chain;
mod cluster;
mod failover;
mod kill9;
mod load;
mod moving;
mod network;
mod outages;
mod patroni;
mod patroni_move;
mod patroni_service;
mod relay_outage;
mod stall;
mod support;
