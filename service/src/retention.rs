//! The settings of the redelivery horizon: how long after its first delivery a copy of a
//! message may still come, from the consumer and its stream as the server has them and the
//! service's own cap, retry and allowances. What keeps per-message records (the study's inbox)
//! must keep each that long; the study's `serve` and `inventory inbox purge` compute the
//! horizon from these flags (`inventory_benches::retention::horizon`) and check their retention
//! against it.

use std::time::Duration;

use crate::args::shown;
use crate::consumer::RuntimeSettings;

/// What the redelivery horizon takes beside the server's settings: shared by `serve` and
/// `inbox purge`, so that both check the same horizon from the same settings (one file, the
/// same environment).
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Retention and the redelivery horizon")]
pub struct HorizonArgs {
    /// Deliveries of one message this service handles: the last failing is a max-deliveries
    /// dead letter, a later one is dead-lettered unhandled; -1 (any value below 1) for unlimited. The consumer it
    /// creates has no cap of its own, so the server never drops a message; an existing
    /// consumer's lower cap lowers this one. Part of the horizon.
    #[arg(long, default_value_t = RuntimeSettings::MAX_DELIVER, allow_negative_numbers = true, help_heading = "Consumer")]
    pub max_deliver: i64,
    /// The longest delay between retries of a message that failed transiently (serve's nak
    /// delay doubles per delivery up to this); part of the horizon.
    #[arg(long, default_value = shown(RuntimeSettings::MAX_RETRY_DELAY), value_parser = humantime::parse_duration)]
    pub max_retry_delay: Duration,
    /// How long after a dead letter operators may still replay it; part of the horizon.
    #[arg(long, default_value = crate::args::REPLAY_ALLOWANCE, value_parser = humantime::parse_duration)]
    pub replay_allowance: Duration,
    /// How far the consumer may fall behind its stream, when the stream has no max_age: a copy
    /// stored meanwhile waits that long for its first delivery. Part of the horizon; a stream's
    /// max_age takes its place.
    #[arg(long, default_value = "1day", value_parser = humantime::parse_duration)]
    pub lag_allowance: Duration,
}
