//! NATS JetStream adapters: the streams and durable consumers of the contract, what the stream
//! said to a publish ([`PublishReceipt`]), the dead letters (their format, writer and
//! reader in `dead_letter`), the backstop that dead-letters what a consumer's own delivery
//! cap made the server give up on (`backstop`), and stock sharded by book: the partition
//! transform, the assignment bucket ([`Shards`]) and `shard init` (`shards`).

mod backstop;
mod dead_letter;
mod shards;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

pub use async_nats::Client;
use async_nats::HeaderMap;
pub use async_nats::jetstream::Context;
use async_nats::jetstream::consumer::FromConsumer as _;
use async_nats::jetstream::context::{
    ConsumerInfoError, ConsumerInfoErrorKind, CreateStreamError, CreateStreamErrorKind,
    GetStreamError, GetStreamErrorKind, RequestError, RequestErrorKind,
};
use async_nats::jetstream::stream::{
    ConsumerCreateStrictError, ConsumerCreateStrictErrorKind, ConsumerUpdateError,
    ConsumerUpdateErrorKind,
};
use async_nats::jetstream::{self, ErrorCode, consumer, stream};
use backon::{ExponentialBuilder, Retryable as _};
use inventory_domain::{Event, EventKind};
use secrecy::{ExposeSecret as _, SecretString};

pub use backstop::{Backstop, advisories_stream};
pub use dead_letter::{DeadLetter, DeadLetterStream, DeadLetters, Origin, Waiting, dlq_headers};
pub use shards::{
    Assignment, Claim, InitError, InitReport, InitSettings, Owner, Partitioning, Shards,
    StoredMove, consumer_states, init, move_key, partition_consumer, partition_filter,
    partition_key, partition_transform, partitioning, pause_consumer, server_version,
    shards_bucket, unroutable_consumer, unroutable_filters,
};

/// A NATS or JetStream call that failed, with what was being done.
#[derive(Debug, thiserror::Error)]
#[error("{doing}: {source}")]
pub struct NatsError {
    doing: String,
    #[source]
    source: async_nats::Error,
}

impl NatsError {
    /// What this service found on the server and refuses to work with, as an error of what was
    /// being done.
    pub(crate) fn found(doing: impl Into<String>, what: impl Into<String>) -> Self {
        Self {
            doing: doing.into(),
            source: what.into().into(),
        }
    }
}

/// Wraps an async-nats error with what was being done.
pub(crate) fn nats_error<E>(doing: impl Into<String>) -> impl FnOnce(E) -> NatsError
where
    E: Into<async_nats::Error>,
{
    let doing = doing.into();
    move |error| NatsError {
        doing,
        source: error.into(),
    }
}

fn is_stream_not_found(error: &jetstream::Error) -> bool {
    error.error_code() == ErrorCode::STREAM_NOT_FOUND
}

/// A stream lookup that failed because the server has no such stream.
fn is_missing_stream(error: &GetStreamError) -> bool {
    matches!(error.kind(), GetStreamErrorKind::JetStream(ref js) if is_stream_not_found(js))
}

/// Whether a set-up request that failed is worth asking again: the server did not answer in
/// time (a cluster electing the stream's or the consumer's leader answers nothing, or that it
/// is not available yet), or could not store the stream or consumer it was creating (a full
/// disk, or a race in its storage directory: nats-server 2.9 removes an account's empty
/// `streams` directory while another create needs it). Anything else is the answer.
fn worth_asking_again(error: &NatsError) -> bool {
    let source = error.source.as_ref();
    let refused = |error: &jetstream::Error, code: ErrorCode| error.error_code() == code;
    if let Some(error) = source.downcast_ref::<GetStreamError>() {
        // The request's own error says whether it timed out.
        return std::error::Error::source(error)
            .and_then(|source| source.downcast_ref::<RequestError>())
            .is_some_and(|request| request.kind() == RequestErrorKind::TimedOut);
    }
    if let Some(error) = source.downcast_ref::<CreateStreamError>() {
        return match error.kind() {
            CreateStreamErrorKind::TimedOut => true,
            CreateStreamErrorKind::JetStream(js) => refused(&js, ErrorCode::STREAM_STORE_FAILED),
            _ => false,
        };
    }
    if let Some(error) = source.downcast_ref::<ConsumerInfoError>() {
        return match error.kind() {
            ConsumerInfoErrorKind::TimedOut | ConsumerInfoErrorKind::Offline => true,
            ConsumerInfoErrorKind::JetStream(js) => refused(&js, ErrorCode::CLUSTER_NOT_AVAILABLE),
            _ => false,
        };
    }
    if let Some(error) = source.downcast_ref::<ConsumerCreateStrictError>() {
        return match error.kind() {
            ConsumerCreateStrictErrorKind::TimedOut => true,
            ConsumerCreateStrictErrorKind::JetStream(js) => {
                refused(&js, ErrorCode::CONSUMER_STORE_FAILED)
            }
            _ => false,
        };
    }
    if let Some(error) = source.downcast_ref::<ConsumerUpdateError>() {
        return error.kind() == ConsumerUpdateErrorKind::TimedOut;
    }
    false
}

/// Names of the streams and subjects, the contract's by default; tests use their own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    pub stream: String,
    /// `orders`: the stream holds `orders.>`, OrderPlaced goes to `orders.placed`.
    pub subject_prefix: String,
    pub dlq_stream: String,
    /// `dlq`: a consumer's dead letters go to `dlq.<consumer>`.
    pub dlq_subject_prefix: String,
    /// The stream of Inventory's own events, which the outbox relay publishes to.
    pub events_stream: String,
    /// `inventory`: the events stream holds `inventory.>`, a reservation goes to
    /// `inventory.stock.reserved`.
    pub events_subject_prefix: String,
    /// How long each stream drops a resend with a `Nats-Msg-Id` it has seen.
    pub duplicate_window: Duration,
    pub replicas: usize,
}

impl Default for Topology {
    fn default() -> Self {
        Self {
            stream: "ORDERS".into(),
            subject_prefix: "orders".into(),
            dlq_stream: "ORDERS_DLQ".into(),
            dlq_subject_prefix: "dlq".into(),
            events_stream: "INVENTORY".into(),
            events_subject_prefix: "inventory".into(),
            duplicate_window: Duration::from_secs(120),
            replicas: 1,
        }
    }
}

impl Topology {
    /// The subject of `kind` that names no book: `orders.placed`, `orders.cancelled`.
    pub fn subject(&self, kind: EventKind) -> String {
        format!("{}.{}", self.subject_prefix, kind.subject_token())
    }

    /// The subject a producer publishes `event` on: a placement's names its book
    /// (`orders.placed.<book_id>`), for a sharded stream to route it by.
    pub fn subject_of(&self, event: &Event) -> String {
        format!("{}.{}", self.subject_prefix, event.subject_below_prefix())
    }

    pub fn dlq_subject(&self, consumer: &str) -> String {
        format!("{}.{consumer}", self.dlq_subject_prefix)
    }

    /// The orders stream: `<subject_prefix>.>`.
    pub fn orders_stream(&self) -> PrefixStream {
        PrefixStream {
            name: self.stream.clone(),
            subject_prefix: self.subject_prefix.clone(),
            duplicate_window: self.duplicate_window,
            replicas: self.replicas,
        }
    }

    /// Inventory's events stream: `<events_subject_prefix>.>`, with the orders stream's
    /// duplicate window and replicas.
    pub fn events_stream(&self) -> PrefixStream {
        PrefixStream {
            name: self.events_stream.clone(),
            subject_prefix: self.events_subject_prefix.clone(),
            duplicate_window: self.duplicate_window,
            replicas: self.replicas,
        }
    }

    pub fn stream_config(&self) -> stream::Config {
        self.orders_stream().config()
    }

    fn dlq_stream_config(&self) -> stream::Config {
        stream::Config {
            name: self.dlq_stream.clone(),
            subjects: vec![format!("{}.>", self.dlq_subject_prefix)],
            storage: stream::StorageType::File,
            // Dead letters are published with an id derived from their origin: a republish
            // after a crash is stored once.
            duplicate_window: self.duplicate_window,
            num_replicas: self.replicas,
            ..Default::default()
        }
    }
}

/// A stream holding every subject below one prefix (`<prefix>.>`), in files: the orders
/// stream and the events stream are both of this shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixStream {
    pub name: String,
    pub subject_prefix: String,
    pub duplicate_window: Duration,
    pub replicas: usize,
}

impl PrefixStream {
    fn config(&self) -> stream::Config {
        stream::Config {
            name: self.name.clone(),
            subjects: vec![format!("{}.>", self.subject_prefix)],
            storage: stream::StorageType::File,
            duplicate_window: self.duplicate_window,
            num_replicas: self.replicas,
            ..Default::default()
        }
    }
}

/// Creates `wanted` if absent; reports how an existing one differs (and keeps it).
pub async fn ensure_prefix_stream(
    js: &Context,
    wanted: &PrefixStream,
) -> Result<(stream::Stream, Vec<ConfigDrift>), NatsError> {
    ensure_stream(js, wanted.config()).await
}

/// One setting of an existing stream or consumer that differs from what this process would
/// have created. The existing one is kept unless this process was told otherwise: a shared
/// stream or consumer is never changed behind its operators' backs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigDrift {
    pub object: String,
    pub setting: &'static str,
    pub existing: String,
    pub wanted: String,
    /// The existing value stays; false when this process was told to set its own.
    pub kept: bool,
}

impl std::fmt::Display for ConfigDrift {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.kept {
            write!(
                f,
                "{} has {} = {} where this service would set {}; keeping the existing value",
                self.object, self.setting, self.existing, self.wanted
            )
        } else {
            write!(
                f,
                "{} had {} = {}; set to {} as asked",
                self.object, self.setting, self.existing, self.wanted
            )
        }
    }
}

/// The drifts of `object`: each listed setting whose `existing` value differs from the
/// `wanted` one, kept as it is.
macro_rules! drifts {
    ($object:expr, $existing:expr, $wanted:expr, [$($setting:ident),+ $(,)?]) => {{
        let mut drifts = Vec::new();
        $(
            if $existing.$setting != $wanted.$setting {
                drifts.push(ConfigDrift {
                    object: $object.to_owned(),
                    setting: stringify!($setting),
                    existing: format!("{:?}", $existing.$setting),
                    wanted: format!("{:?}", $wanted.$setting),
                    kept: true,
                });
            }
        )+
        drifts
    }};
}

/// How long setting up a stream or a consumer keeps asking while JetStream does not answer.
/// A cluster answers no request about a stream while it elects the stream's new leader (a node
/// lost: seconds), and a process starting then should wait that out, not exit.
const SET_UP_PATIENCE: Duration = Duration::from_secs(60);

/// The pauses between set-up requests: 250 ms, doubling up to 5 s.
const SET_UP_PAUSES: ExponentialBuilder = ExponentialBuilder::new()
    .with_min_delay(Duration::from_millis(250))
    .with_max_delay(Duration::from_secs(5))
    .without_max_times();

/// `step` again, after a growing pause, while it times out or the server fails to store what
/// it creates, and [`SET_UP_PATIENCE`] lasts. The set-up steps look before they create, so one
/// whose request reached the server and whose answer was lost finds its own work the next time.
pub(crate) async fn patiently<T, Fut>(step: impl FnMut() -> Fut) -> Result<T, NatsError>
where
    Fut: Future<Output = Result<T, NatsError>>,
{
    let started = std::time::Instant::now();
    step.retry(SET_UP_PAUSES)
        .when(|error| worth_asking_again(error) && started.elapsed() < SET_UP_PATIENCE)
        .notify(|error, pause| tracing::warn!(retry_in = ?pause, "{error}; asking again"))
        .await
}

/// Creates `wanted` if absent; reports how an existing one differs (and keeps it).
async fn ensure_stream(
    js: &Context,
    wanted: stream::Config,
) -> Result<(stream::Stream, Vec<ConfigDrift>), NatsError> {
    patiently(|| ensure_stream_once(js, &wanted)).await
}

async fn ensure_stream_once(
    js: &Context,
    wanted: &stream::Config,
) -> Result<(stream::Stream, Vec<ConfigDrift>), NatsError> {
    let doing = format!("setting up stream {}", wanted.name);
    let stream = match js.get_stream(&wanted.name).await {
        Ok(stream) => stream,
        Err(error) if is_missing_stream(&error) => {
            match js.create_stream(wanted.clone()).await {
                Ok(stream) => return Ok((stream, Vec::new())),
                // Another instance created it in between: use theirs. If there is none, the
                // create's own failure says why (a timeout, then, is asked again).
                Err(create_error) => match js.get_stream(&wanted.name).await {
                    Ok(stream) => stream,
                    Err(_) => return Err(nats_error(doing)(create_error)),
                },
            }
        }
        Err(error) => return Err(nats_error(doing)(error)),
    };
    // As the lookup just read it.
    let existing = &stream.cached_info().config;
    let drifts = drifts!(
        format!("stream {}", wanted.name),
        existing,
        wanted,
        [subjects, storage, duplicate_window, num_replicas]
    );
    Ok((stream, drifts))
}

/// Creates the orders stream and the dead-letter stream if absent; reports how existing ones
/// differ from this configuration.
pub async fn ensure_streams(
    js: &Context,
    topology: &Topology,
) -> Result<(stream::Stream, Vec<ConfigDrift>), NatsError> {
    let (orders, mut drifts) = ensure_stream(js, topology.stream_config()).await?;
    let (_, dlq_drifts) = ensure_stream(js, topology.dlq_stream_config()).await?;
    drifts.extend(dlq_drifts);
    Ok((orders, drifts))
}

/// The settings of the durable consumer `name` as the server has them, and of its stream, from
/// the first of `streams` that holds it; `None` when none does.
pub async fn find_consumer(
    js: &Context,
    streams: &[String],
    name: &str,
) -> Result<Option<(consumer::Config, stream::Config)>, NatsError> {
    for stream_name in streams {
        let doing = format!("looking up consumer {name} on stream {stream_name}");
        let stream = match js.get_stream(stream_name).await {
            Ok(stream) => stream,
            Err(error) if is_missing_stream(&error) => continue,
            Err(error) => return Err(nats_error(doing)(error)),
        };
        match stream.consumer_info(name).await {
            Ok(info) => return Ok(Some((info.config, stream.cached_info().config.clone()))),
            Err(error) if is_consumer_not_found(&error) => {}
            Err(error) => return Err(nats_error(doing)(error)),
        }
    }
    Ok(None)
}

fn is_consumer_not_found(error: &ConsumerInfoError) -> bool {
    match error.kind() {
        ConsumerInfoErrorKind::NotFound => true,
        ConsumerInfoErrorKind::JetStream(error) => {
            error.error_code() == ErrorCode::CONSUMER_NOT_FOUND
        }
        _ => false,
    }
}

/// The settings of a durable pull consumer.
#[derive(Debug, Clone, PartialEq)]
pub struct ConsumerSettings {
    pub durable_name: String,
    /// The subjects it reads: one, as every server takes it, or several (nats-server 2.10+).
    pub filters: Vec<String>,
    pub ack_wait: Duration,
    pub max_deliver: i64,
    /// Redelivery delays after an ack wait runs out (JetStream `backoff`); empty for none.
    pub backoff: Vec<Duration>,
    pub max_ack_pending: i64,
}

/// The durable pull consumer, created only when the server says it does not exist. An
/// existing one keeps its settings, each that differs from `settings` reported, unless `update`
/// says to set them: a consumer an operator tuned (`nats consumer edit`) is never reset behind
/// their back, nor because a lookup failed (a leader election, a timeout), which is asked
/// again patiently instead.
pub async fn ensure_consumer(
    js: &Context,
    stream: &stream::Stream,
    settings: &ConsumerSettings,
    update: bool,
) -> Result<(consumer::PullConsumer, Vec<ConfigDrift>), NatsError> {
    patiently(|| ensure_consumer_once(js, stream, settings, update)).await
}

async fn ensure_consumer_once(
    js: &Context,
    stream: &stream::Stream,
    settings: &ConsumerSettings,
    update: bool,
) -> Result<(consumer::PullConsumer, Vec<ConfigDrift>), NatsError> {
    let doing = format!("setting up consumer {}", settings.durable_name);
    // One filter in the field every server knows; several where only 2.10 and later look.
    let (filter_subject, filter_subjects) = match settings.filters.as_slice() {
        [one] => (one.clone(), Vec::new()),
        several => (String::new(), several.to_vec()),
    };
    let wanted = consumer::pull::Config {
        durable_name: Some(settings.durable_name.clone()),
        filter_subject,
        filter_subjects,
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: settings.ack_wait,
        max_deliver: settings.max_deliver,
        backoff: settings.backoff.clone(),
        max_ack_pending: settings.max_ack_pending,
        ..Default::default()
    };
    let info = match stream.consumer_info(&settings.durable_name).await {
        Ok(info) => info,
        Err(error) if is_consumer_not_found(&error) => {
            // Create, not create-or-update: a consumer made meanwhile by another instance is
            // looked at as any existing one (nats-server before 2.10 ignores the difference and
            // updates; the settings are the same flags then).
            match stream.create_consumer_strict(wanted.clone()).await {
                Ok(consumer) => return Ok((consumer, Vec::new())),
                Err(error)
                    if matches!(error.kind(), ConsumerCreateStrictErrorKind::AlreadyExists) =>
                {
                    stream
                        .consumer_info(&settings.durable_name)
                        .await
                        .map_err(nats_error(doing.clone()))?
                }
                Err(error) => return Err(nats_error(doing)(error)),
            }
        }
        Err(error) => return Err(nats_error(doing)(error)),
    };
    let existing = &info.config;
    let mut drifts = drifts!(
        format!("consumer {}", settings.durable_name),
        existing,
        wanted,
        [
            filter_subject,
            filter_subjects,
            ack_policy,
            ack_wait,
            max_deliver,
            backoff,
            max_ack_pending
        ]
    );
    if update && !drifts.is_empty() {
        let updated = stream
            .update_consumer(wanted)
            .await
            .map_err(nats_error(doing))?;
        for drift in &mut drifts {
            drift.kept = false;
        }
        return Ok((updated, drifts));
    }
    let config = consumer::pull::Config::try_from_consumer_config(info.config.clone()).map_err(
        nats_error(format!("reading consumer {}", settings.durable_name)),
    )?;
    Ok((consumer::Consumer::new(config, info, js.clone()), drifts))
}

/// Whether the server says `consumer` no longer exists (deleted under the process); a look
/// that fails otherwise says nothing.
pub async fn consumer_is_gone(consumer: &consumer::PullConsumer) -> bool {
    matches!(consumer.get_info().await, Err(error) if is_consumer_not_found(&error))
}

/// What the stream said to one publish.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublishReceipt {
    pub sequence: u64,
    /// The stream had seen this `Nats-Msg-Id` inside its duplicate window and dropped the copy.
    pub duplicate: bool,
}

/// Counts of a consumer's state, for tests and operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConsumerState {
    pub pending: u64,
    pub ack_pending: usize,
    pub redelivered: usize,
}

pub async fn consumer_state(
    consumer: &mut consumer::PullConsumer,
) -> Result<ConsumerState, NatsError> {
    let info = consumer
        .info()
        .await
        .map_err(nats_error("reading consumer info"))?;
    Ok(ConsumerState {
        pending: info.num_pending,
        ack_pending: info.num_ack_pending,
        redelivered: info.num_redelivered,
    })
}

/// Header names and values of a message, for logs and tests.
pub fn header_map(headers: Option<&HeaderMap>) -> BTreeMap<String, String> {
    headers
        .map(|headers| {
            headers
                .iter()
                .filter_map(|(name, values)| {
                    values
                        .first()
                        .map(|value| (name.to_string(), value.as_str().to_owned()))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// How to authenticate to NATS and secure the connection; all empty by default (no auth, TLS
/// only if the URL says `tls://` or the server requires it). The secrets are `secrecy`'s:
/// `Debug` never prints them.
#[derive(Debug, Clone, Default)]
pub struct NatsSecurity {
    /// A `.creds` file (JWT and NKey seed).
    pub credentials_file: Option<PathBuf>,
    pub user: Option<String>,
    pub password: Option<SecretString>,
    pub token: Option<SecretString>,
    /// PEM file of the CA that signed the server's certificate.
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate and key, for servers that verify clients.
    pub tls_client_cert: Option<(PathBuf, PathBuf)>,
    /// Refuse a connection without TLS.
    pub require_tls: bool,
}

/// How long NATS may stay silent before the client acts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NatsTimeouts {
    /// Dialling a server until it answered the handshake, at start and on each reconnect.
    pub connect: Duration,
    /// The client pings the server this often; after two pings unanswered it drops the
    /// connection and reconnects. A connection that went silent without closing is noticed
    /// after two to three of these.
    pub ping_interval: Duration,
    /// A request's (JetStream API calls, the PubAck of a publish) wait for its answer.
    pub request: Duration,
}

impl Default for NatsTimeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(5),
            ping_interval: Duration::from_secs(10),
            request: Duration::from_secs(10),
        }
    }
}

/// Connects to NATS under `name`, reconnecting for as long as the process runs; connection
/// events are logged. `url` may list several servers of a cluster, comma separated.
pub async fn connect(url: &str, name: &str) -> Result<async_nats::Client, NatsError> {
    connect_with(url, name, &NatsSecurity::default(), NatsTimeouts::default()).await
}

/// [`connect`] with credentials, TLS and timeouts.
pub async fn connect_with(
    url: &str,
    name: &str,
    security: &NatsSecurity,
    timeouts: NatsTimeouts,
) -> Result<async_nats::Client, NatsError> {
    let reading_url = || format!("reading the NATS URL {}", crate::redact::redact_url(url));
    let parsed: Vec<async_nats::ServerAddr> = url
        .split(',')
        .map(str::trim)
        .filter(|server| !server.is_empty())
        .map(str::parse)
        .collect::<Result<_, _>>()
        .map_err(nats_error(reading_url()))?;
    // Credentials in a URL move into the options: async-nats logs the server addresses it
    // dials at debug, password and all.
    let mut url_credentials = None;
    let servers: Vec<async_nats::ServerAddr> = parsed
        .into_iter()
        .map(|server| {
            let username = server.username().unwrap_or_default().to_owned();
            let password = server.password().map(str::to_owned);
            if url_credentials.is_none() && !username.is_empty() {
                url_credentials = Some((username, password));
            }
            let mut bare = server.into_inner();
            // Fails only for URLs that cannot have credentials, which then have none.
            let _ = bare.set_password(None);
            let _ = bare.set_username("");
            async_nats::ServerAddr::from_url(bare)
        })
        .collect::<Result<_, _>>()
        .map_err(nats_error(reading_url()))?;
    let mut options = async_nats::ConnectOptions::new();
    match url_credentials {
        Some((user, Some(password))) => options = options.user_and_password(user, password),
        // nats://<token>@host
        Some((token, None)) => options = options.token(token),
        None => {}
    }
    if let Some(path) = &security.credentials_file {
        options = options
            .credentials_file(path)
            .await
            .map_err(nats_error(format!(
                "reading the NATS credentials file {}",
                path.display()
            )))?;
    }
    if let Some(user) = &security.user {
        options = options.user_and_password(
            user.clone(),
            security
                .password
                .as_ref()
                .map(|password| password.expose_secret().to_owned())
                .unwrap_or_default(),
        );
    }
    if let Some(token) = &security.token {
        options = options.token(token.expose_secret().to_owned());
    }
    if let Some(ca) = &security.tls_ca {
        options = options.add_root_certificates(ca.clone());
    }
    if let Some((cert, key)) = &security.tls_client_cert {
        options = options.add_client_certificate(cert.clone(), key.clone());
    }
    if security.require_tls {
        options = options.require_tls(true);
    }
    options
        .name(name)
        .max_reconnects(None)
        .connection_timeout(timeouts.connect)
        .ping_interval(timeouts.ping_interval)
        .request_timeout(Some(timeouts.request))
        .event_callback(|event| async move {
            match event {
                async_nats::Event::Connected => tracing::info!("NATS connected"),
                async_nats::Event::Disconnected => tracing::warn!("NATS disconnected"),
                other => tracing::info!(event = %other, "NATS"),
            }
        })
        .connect(servers.as_slice())
        .await
        .map_err(nats_error(format!(
            "connecting to NATS at {}",
            crate::redact::redact_url(url)
        )))
}

/// The JetStream context of a client.
pub fn context(client: async_nats::Client) -> Context {
    jetstream::new(client)
}

/// Whether the client holds a connection to a server now (it reconnects on its own).
pub fn is_connected(client: &Client) -> bool {
    client.connection_state() == async_nats::connection::State::Connected
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_connection_that_cannot_be_made_says_what_was_being_done() {
        for (url, doing) in [
            (
                "nats://127.0.0.1:1",
                "connecting to NATS at nats://127.0.0.1:1",
            ),
            ("nats://exa mple:4222", "reading the NATS URL"),
        ] {
            let error = connect(url, "kind test")
                .await
                .expect_err("nothing to connect to");
            assert!(error.to_string().starts_with(doing), "{error}");
        }
    }

    fn refused(err_code: u64, description: &str) -> jetstream::Error {
        serde_json::from_value(serde_json::json!({
            "code": 500, "err_code": err_code, "description": description
        }))
        .expect("the server's error as it sends it")
    }

    fn creating(error: CreateStreamError) -> NatsError {
        nats_error("setting up")(error)
    }

    fn timed_out() -> NatsError {
        creating(CreateStreamError::new(CreateStreamErrorKind::TimedOut))
    }

    /// nats-server 2.9 says 10077 when a stream's directory cannot be made (a race with the
    /// deletion of the last stream, or a full disk): set-up asks again.
    fn store_failed() -> NatsError {
        creating(refused(10077, "could not create storage directory").into())
    }

    /// Other refusals of a create are final.
    fn name_in_use() -> NatsError {
        creating(refused(10058, "stream name already in use").into())
    }

    #[test]
    fn a_timeout_or_a_store_failure_is_worth_asking_again_and_other_refusals_are_not() {
        assert!(worth_asking_again(&timed_out()));
        assert!(worth_asking_again(&store_failed()));
        assert!(!worth_asking_again(&name_in_use()));
        assert!(!worth_asking_again(&nats_error("acking")(
            async_nats::Error::from("refused")
        )));
    }

    #[tokio::test]
    async fn set_up_asks_again_after_a_timeout_or_a_store_failure_and_stops_at_anything_else() {
        type Failure = fn() -> NatsError;
        let mut answers: Vec<Result<&str, Failure>> =
            vec![Ok("created"), Err(store_failed), Err(timed_out)];
        let mut asked = 0;
        let result = patiently(|| {
            asked += 1;
            let answer = answers.pop().expect("asked no more than answered");
            async move { answer.map_err(|failure| failure()) }
        })
        .await;
        assert_eq!(
            (result.expect("created on the third try"), asked),
            ("created", 3)
        );

        let mut asked = 0;
        let result: Result<(), _> = patiently(|| {
            asked += 1;
            async { Err(name_in_use()) }
        })
        .await;
        let error = result.expect_err("refused for good");
        assert!(error.to_string().contains("already in use"), "{error}");
        assert_eq!(asked, 1);
    }
}
