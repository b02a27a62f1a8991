//! The schema of the inventory service, as sea-orm-migration modules that run on PostgreSQL and
//! SQLite alike. The contract's tables keep the contract's names and keys.
//!
//! # Layout
//! - `m20261130_000001_create_stock_items`: `stock_items`, one row per book.
//! - `m20261130_000002_create_stock_reservations`: the natural key, `(order_id, book_id)`.
//! - `m20261130_000003_create_inbox`: the dedup record, `(message_id, consumer)`, indexed by
//!   `completed_at` for the retention purge.
//! - `m20261130_000004_create_order_states`: one row per cancelled order, so a cancellation
//!   that arrives before its placement still wins. (Before migration 10 placements wrote a row
//!   too; those rows stay, with no cancellation, and mean nothing.)
//! - `m20261130_000005_create_reservation_log`: the reservations of the strategies without a
//!   natural key (naive, check-then-process, inbox), where an order can be reserved twice.
//! - `m20261201_000006_create_outbox`: the events of reservation decisions, written in the
//!   decision's transaction, until the relay has published them.
//! - `m20261201_000007_create_outbox_leases`: the relays' partition leases and heartbeats.
//! - `m20261201_000008_create_orders`: the orders producer's tables, `orders` (one row per
//!   order, the row its place and cancel lock), `order_lines` and its outbox `orders_outbox`.
//!   They live in the orders database (`ORDERS_DATABASE_URL`), by default the same one; a
//!   separate orders database gets the whole schema and uses these three.
//! - `m20261201_000009_index_parked_outbox_rows`: on both outbox tables, parked rows by order,
//!   which the relay looks up to hold an order's later rows behind a parked one.
//! - `m20261201_000010_create_lock_order`: `lock_order(order_id)` on PostgreSQL, the order's
//!   lock that placement and cancellation take instead of writing a row (natural.rs).
//! - `m20261206_000011_create_partition_owner`: on a shard, the partitions of the orders stream
//!   its database owns, and `owns_partition(partition_id)` on PostgreSQL, which a placement
//!   asks under its stock rows' locks (docs/scaling.md).
//! - `m20261206_000012_create_line_cancellations`: one row per cancelled order line, and
//!   `lock_line(order_id, book_id)` on PostgreSQL, the order's lock that a placement takes,
//!   reading whether its order or its line is cancelled.
//! - `m20261206_000013_add_line_cancel_message_ids`: `order_lines.cancel_message_id`, the
//!   line's OrderCancelled, made once: the orders producer cancels an order line by line.
//! - `m20261206_000014_add_outbox_shard_partition`: on both outbox tables, each event's
//!   partition of the orders stream on a shard (NULL unsharded).
//! - `m20261207_000015_index_reservations_by_book`: `stock_reservations` by book then order,
//!   which a partition's move reads, copies and deletes by.

pub use sea_orm_migration::prelude::*;

/// What a role that serves needs of the schema these migrations make, and nothing more: it
/// reads and writes rows, it changes no schema. `deploy/grants.sql` grants exactly this; the
/// commands run with `--skip-migrations` check it at start (infra's `db::open`).
pub mod grants {
    /// SELECT, INSERT, UPDATE and DELETE on each.
    pub const TABLES: [&str; 13] = [
        "stock_items",
        "stock_reservations",
        "inbox",
        "order_states",
        "reservation_log",
        "outbox",
        "outbox_leases",
        "outbox_relays",
        "orders",
        "order_lines",
        "orders_outbox",
        "partition_owner",
        "line_cancellations",
    ];
    /// SELECT only: which migrations are applied.
    pub const MIGRATIONS_TABLE: &str = "seaql_migrations";
    /// USAGE: the outboxes' `seq` (bigserial) columns take their next value from these.
    pub const SEQUENCES: [&str; 2] = ["outbox_seq_seq", "orders_outbox_seq_seq"];
    /// EXECUTE (PUBLIC holds it unless revoked).
    pub const FUNCTIONS: [&str; 3] = [
        "lock_order(uuid)",
        "owns_partition(smallint)",
        "lock_line(uuid, uuid)",
    ];
}

mod m20261130_000001_create_stock_items;
mod m20261130_000002_create_stock_reservations;
mod m20261130_000003_create_inbox;
mod m20261130_000004_create_order_states;
mod m20261130_000005_create_reservation_log;
mod m20261201_000006_create_outbox;
mod m20261201_000007_create_outbox_leases;
mod m20261201_000008_create_orders;
mod m20261201_000009_index_parked_outbox_rows;
mod m20261201_000010_create_lock_order;
mod m20261206_000011_create_partition_owner;
mod m20261206_000012_create_line_cancellations;
mod m20261206_000013_add_line_cancel_message_ids;
mod m20261206_000014_add_outbox_shard_partition;
mod m20261207_000015_index_reservations_by_book;
mod outbox_table;

pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![
            Box::new(m20261130_000001_create_stock_items::Migration),
            Box::new(m20261130_000002_create_stock_reservations::Migration),
            Box::new(m20261130_000003_create_inbox::Migration),
            Box::new(m20261130_000004_create_order_states::Migration),
            Box::new(m20261130_000005_create_reservation_log::Migration),
            Box::new(m20261201_000006_create_outbox::Migration),
            Box::new(m20261201_000007_create_outbox_leases::Migration),
            Box::new(m20261201_000008_create_orders::Migration),
            Box::new(m20261201_000009_index_parked_outbox_rows::Migration),
            Box::new(m20261201_000010_create_lock_order::Migration),
            Box::new(m20261206_000011_create_partition_owner::Migration),
            Box::new(m20261206_000012_create_line_cancellations::Migration),
            Box::new(m20261206_000013_add_line_cancel_message_ids::Migration),
            Box::new(m20261206_000014_add_outbox_shard_partition::Migration),
            Box::new(m20261207_000015_index_reservations_by_book::Migration),
        ]
    }
}
