//! What the criterion benchmarks and `inventory bench` share: the modes measured, the messages
//! they handle, and the chart drawn from criterion's results.
//!
//! # Layout
//! - [`workload`]: the dedup modes and strategies as handlers, stock that never runs out, and a
//!   deterministic stream of fresh messages and copies of already-handled ones.
//! - [`chart`]: reads criterion's estimates (`target/criterion/<group>/<function>/<parameter>`)
//!   and draws the median per-message cost against the parameter as an SVG line chart.
//!
//! The benchmarks themselves are in `benches/`: `dedup_cost` (the inbox's three detection modes
//! and the natural key at 0–90 % duplicates) and `strategies` (fresh messages on 1, 4 and 16
//! connections).

pub mod chart;
pub mod workload;
