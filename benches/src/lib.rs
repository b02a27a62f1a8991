//! The study and the measurements: everything `inventory demo`, `inventory compare` and
//! `inventory bench …` run, and what the criterion benchmarks share. The serving path
//! (`inventory-service`) knows none of it; this crate depends on it, never the other way round,
//! so the production binary links no study, no chart and no criterion parser. Its binary,
//! `inventory-study`, is what `inventory demo|compare|bench` hand their arguments to.
//!
//! # Layout
//! - [`demo`]: the idempotent-consumer study behind `inventory demo`.
//! - [`compare`]: every strategy end to end through JetStream on one workload.
//! - [`mod@bench`]: `inventory bench`: PostgreSQL's costs per dedup mode, criterion's results as a
//!   chart; [`bench_e2e`]: end to end through JetStream, and the pgbench scripts beside it;
//!   [`guard_cost`]: the placement statement and the statements that bound it, for pgbench;
//!   `bench_hand`: the hand-written consumers of the same statements the service is measured
//!   against, on PostgreSQL and SQLite, per message and batched; [`bench_sqlite`]: SQLite's
//!   own bound, the SQLite handler's statements without NATS; [`bench_pg_bound`]:
//!   PostgreSQL's, the one-statement handler's statements bound as its lanes bind them,
//!   without NATS; [`bench_prefilter`]: a Redis pre-filter in front of the natural key, what
//!   it saves per duplicate and costs per fresh message.
//! - [`faults`]: the crashes, holds and panics the demo and the tests inject at the handlers'
//!   crash points.
//! - [`payload_hash`]: the hash of a message's content that the inbox and the cache store, so
//!   that a message id reused for other content is not taken for a duplicate.
//! - [`cache`]: a dedup cache on Redis, as the pre-filter that is safe and as the arbiter
//!   that is not.
//! - [`consumers`]: the study's handlers: the inbox, the natural key through sea-orm, the
//!   two-phase email consumer; [`consumers::HandlerKind`], the one list of the handlers it runs.
//! - [`entities`]: the sea-orm models of the tables only the study writes through sea-orm (the
//!   inbox, the reservations and their log, the cancellations, the orders producer's tables).
//! - [`mailbox`]: `FileMailbox`, the email consumer's durable provider for `serve` (sent mail as
//!   JSON lines in a local file, looked up by idempotency key).
//! - [`fresh`]: a database of its own per run, created and dropped; [`mod@db`]: connecting as
//!   the study and the tests do (statements unbounded) and the sea-orm handlers' write
//!   transaction.
//! - [`mail`]: the email provider of the demo and the tests, in memory, with or without a
//!   lookup by idempotency key.
//! - [`mistakes`]: naive, check-then-process and the other designs the study shows failing,
//!   built from the inbox's own steps; [`mistakes::Strategy`], a service handler or one of these.
//! - [`latency`]: when each message was published and how long it took to be handled, for the
//!   runs at a steady rate of `bench_e2e` and `bench_hand`.
//! - [`system_cpu`]: the machine's CPU during a run by process (this one, nats-server,
//!   PostgreSQL, the rest), from /proc.
//! - [`workload`]: the handlers per mode, stock that never runs out, the metrics of a runtime
//!   that exports none, and a deterministic stream of fresh messages and copies of
//!   already-handled ones.
//! - [`chart`]: reads criterion's estimates (`target/criterion/<group>/<function>/<parameter>`)
//!   and draws the median per-message cost against the parameter as an SVG line chart.
//! - [`produce`]: the messages a producer sends (a new order, its cancellation, a resend under a
//!   new id), which the service only decodes.
//! - [`publish`]: `inventory publish`, the producer without an outbox; [`orders`]: `inventory
//!   orders place|cancel`, the safe producer, an order and its message in one transaction.
//! - [`readback`]: what the consumers recorded, read back for the study's tables and the tests.
//! - [`horizon`]: how long a dedup record must be kept: the redelivery horizon of a consumer,
//!   the guard against a shorter retention.
//! - [`retention`]: the inbox's purge, in the background of the study's `serve` and by hand
//!   (`inventory inbox purge`), each checked against the redelivery horizon; [`purge`]: its
//!   statements, in bounded batches.
//! - [`serve`]: `serve` for the study's handlers, which `inventory serve --strategy
//!   inbox|email` runs: the service's `serve` with a study handler, and the inbox's purge.
//! - [`cli`]: the `inventory-study` command line.
//!
//! The criterion benchmarks themselves are in `benches/`: `dedup_cost` (the inbox's three
//! detection modes and the natural key at 0–90 % duplicates), `strategies` (fresh messages on 1,
//! 4 and 16 connections) and `end_to_end` (through JetStream and the service's runtime).

pub mod bench;
pub mod bench_e2e;
mod bench_hand;
pub mod bench_pg_bound;
pub mod bench_prefilter;
pub mod bench_publish_rate;
pub mod bench_relay;
pub mod bench_sqlite;
pub mod cache;
pub mod chart;
pub mod cli;
pub mod compare;
pub mod consumers;
pub mod db;
pub mod demo;
pub mod entities;
pub mod faults;
pub mod fresh;
pub mod guard_cost;
pub mod horizon;
pub mod latency;
pub mod mail;
pub mod mailbox;
pub mod mistakes;
pub mod orders;
pub mod payload_hash;
pub mod produce;
pub mod publish;
pub mod purge;
pub mod readback;
pub mod retention;
pub mod serve;
pub mod system_cpu;
pub mod workload;
