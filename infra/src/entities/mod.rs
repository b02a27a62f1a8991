//! sea-orm models of the tables: the repositories here map them to domain types, and the
//! study's sea-orm handlers (`inventory_benches::consumers`) write through them.

pub mod inbox;
pub mod order_lines;
pub mod order_states;
pub mod orders;
pub mod reservation_log;
pub mod stock_items;
pub mod stock_reservations;
