//! `serve` for the study's handlers: the inbox, the email notifier and the natural key through
//! sea-orm. `inventory serve --strategy inbox|email` (or with a `--natural-handler`) runs this
//! binary's `serve` in its place, which is the service's own `serve` (its flags, lanes, relay,
//! health and shutdown) with a study handler, plus what only an inbox needs: the background
//! purge of its completed rows, checked against the redelivery horizon.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::builder::{PossibleValuesParser, TypedValueParser};
use inventory_service::consumer::Reads;
use inventory_service::serve::{Served, Setup};

use crate::consumers::{DetectMode, Handler, HandlerKind, NaturalKeyPath};
use crate::mailbox::FileMailbox;
use crate::retention::{self, PURGE_BATCH_SIZE, PurgeMetrics, PurgeSettings};

/// The strategy the study's `serve` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StrategyArg {
    /// The natural key `(order_id, book_id)`: consumer `inventory-reserve-stock`.
    Natural,
    /// The inbox `(message_id, consumer)`: consumer `inventory-reserve-stock-inbox`.
    Inbox,
    /// The two-phase stock-reserved email: consumer `notifications-stock-reserved-email`, mail
    /// kept in the `--mailbox` file.
    Email,
}

#[derive(Debug, Clone, clap::Args)]
pub struct StudyServeArgs {
    /// Which handler runs.
    #[arg(long, value_enum, default_value = "natural")]
    pub strategy: StrategyArg,
    /// The natural-key handler: the backend's fast path (the service's own), or the sea-orm
    /// entity transaction on the pool, the reference.
    #[arg(long, default_value = "one-statement", value_parser = natural_key_path(), help_heading = "Consumer")]
    pub natural_handler: NaturalKeyPath,
    /// Duplicate detection of the inbox strategy.
    #[arg(long, default_value = "on-conflict", value_parser = detect_mode(), help_heading = "Consumer")]
    pub inbox_detect: DetectMode,
    /// The email strategy's provider: sent mail as JSON lines in this file, looked up by
    /// idempotency key to reconcile an interrupted send.
    #[arg(
        long,
        default_value = "inventory-mailbox.jsonl",
        help_heading = "Consumer"
    )]
    pub mailbox: PathBuf,
    /// Completed inbox rows older than this are purged in the background (the inbox and email
    /// strategies; the natural key keeps no inbox rows). Must cover the redelivery horizon
    /// (redeliveries + duplicate window + the stream's max_age or the lag allowance + replay
    /// allowance).
    #[arg(long, default_value = "14days", value_parser = humantime::parse_duration, help_heading = "Retention and the redelivery horizon")]
    pub inbox_retention: Duration,
    /// Time between background purges; 0s turns the purge (and its horizon check) off.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration, help_heading = "Retention and the redelivery horizon")]
    pub purge_interval: Duration,
    /// Rows per purge batch; each batch is one short transaction.
    #[arg(long, default_value_t = PURGE_BATCH_SIZE, help_heading = "Retention and the redelivery horizon")]
    pub purge_batch_size: u64,
    /// Starts even when --inbox-retention is shorter than the redelivery horizon (a warning
    /// instead of a refusal).
    #[arg(long, help_heading = "Retention and the redelivery horizon")]
    pub accept_short_retention: bool,
    #[command(flatten)]
    pub serve: inventory_service::serve::ServeArgs,
}

fn detect_mode() -> impl TypedValueParser<Value = DetectMode> {
    one_of(&DetectMode::ALL, DetectMode::as_str)
}

/// `--natural-handler`: the batch path is chosen by a batch size, not by name.
pub fn natural_key_path() -> impl TypedValueParser<Value = NaturalKeyPath> {
    const ON_THE_COMMAND_LINE: [NaturalKeyPath; 2] =
        [NaturalKeyPath::OneStatement, NaturalKeyPath::Orm];
    one_of(&ON_THE_COMMAND_LINE, NaturalKeyPath::as_str)
}

impl StudyServeArgs {
    /// The handler these flags choose: `--batch-size` above 1 makes the natural key's fast
    /// path its batch path.
    pub fn handler(&self) -> HandlerKind {
        match self.strategy {
            StrategyArg::Natural => {
                HandlerKind::natural_key(self.natural_handler, usize::from(self.serve.batch_size))
            }
            StrategyArg::Inbox => HandlerKind::Inbox(self.inbox_detect),
            StrategyArg::Email => HandlerKind::Email,
        }
    }
}

/// A study handler, served.
struct StudyServed {
    kind: HandlerKind,
    args: StudyServeArgs,
}

impl Served for StudyServed {
    type Handler = Handler;

    fn label(&self) -> &'static str {
        self.kind.label()
    }

    fn default_consumer(&self) -> &'static str {
        self.kind.default_consumer()
    }

    fn reads(&self) -> Reads {
        match self.kind {
            HandlerKind::Email => Reads::Reservations,
            _ => Reads::Orders,
        }
    }

    fn takes_batches(&self) -> bool {
        self.kind.takes_batches()
    }

    fn writes_events(&self) -> bool {
        matches!(self.kind, HandlerKind::NaturalKey(_))
    }

    async fn prepare(self, setup: Setup<'_>) -> anyhow::Result<Handler> {
        // Only an inbox has rows to keep past the horizon and to purge: the natural key's are
        // the business record.
        if self.kind.writes_inbox_rows() && !self.args.purge_interval.is_zero() {
            let consumer = setup.consumer.as_str().to_owned();
            // The server's values rule, whatever this process would have set.
            let horizon = retention::horizon(
                setup.runtime.server_consumer(),
                setup.runtime.duplicate_window(),
                setup.runtime.stream_max_age(),
                &setup.args.horizon,
            );
            retention::guard(
                &consumer,
                &horizon,
                self.args.inbox_retention,
                self.args.accept_short_retention,
            )?;
            let settings = PurgeSettings {
                retention: self.args.inbox_retention,
                interval: self.args.purge_interval,
                batch_size: self.args.purge_batch_size,
            };
            let purge = retention::purge_every(
                setup.db.clone(),
                consumer,
                settings,
                Some(PurgeMetrics::register(
                    setup.metrics,
                    setup.consumer.as_str(),
                )?),
                setup.background.graceful(),
            )?;
            setup.background.spawn("purge", purge);
        }
        let mailbox = match self.kind {
            HandlerKind::Email => Some(
                FileMailbox::open(&self.args.mailbox)
                    .await
                    .with_context(|| {
                        format!("opening the mailbox {}", self.args.mailbox.display())
                    })?,
            ),
            _ => None,
        };
        Ok(self.kind.build(setup.db, setup.consumer, mailbox)?)
    }
}

/// The study's `serve`: the service's, with the handler these flags choose.
pub async fn start(args: StudyServeArgs) -> anyhow::Result<bool> {
    let served = StudyServed {
        kind: args.handler(),
        args: args.clone(),
    };
    inventory_service::serve::start_with(args.serve, served).await
}

/// A flag whose values are the labels of `all`.
fn one_of<T: Copy + Send + Sync + 'static>(
    all: &'static [T],
    label: fn(T) -> &'static str,
) -> impl TypedValueParser<Value = T> {
    PossibleValuesParser::new(all.iter().map(|value| label(*value))).try_map(move |given| {
        all.iter()
            .copied()
            .find(|value| label(*value) == given)
            .ok_or("not one of the possible values")
    })
}
