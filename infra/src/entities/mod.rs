//! sea-orm models of the tables. They stay in this crate: repositories map them to domain types.

pub(crate) mod inbox;
pub(crate) mod order_lines;
pub(crate) mod order_states;
pub(crate) mod orders;
pub(crate) mod reservation_log;
pub(crate) mod stock_items;
pub(crate) mod stock_reservations;
