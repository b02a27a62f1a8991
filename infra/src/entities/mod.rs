//! sea-orm models of the tables the serving path and the shard commands read through sea-orm:
//! the repositories here map them to domain types. The study's models of the other tables are
//! in `inventory_benches::entities`.

pub mod partition_owner;
pub mod stock_items;
