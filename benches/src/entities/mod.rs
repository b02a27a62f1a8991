//! sea-orm models of the tables the study's sea-orm handlers and its orders producer write
//! through, and its read-backs read: the inbox, the reservations, their log, the cancellations
//! and the orders producer's own tables. The stock's model is the service's
//! (`inventory_infra::entities::stock_items`).

pub mod inbox;
pub mod order_lines;
pub mod order_states;
pub mod orders;
pub mod reservation_log;
pub mod stock_reservations;
