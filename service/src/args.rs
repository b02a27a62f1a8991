//! Flags shared by several commands.

use std::path::PathBuf;
use std::time::Duration;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use inventory_infra::db::{DEFAULT_DATABASE_URL, DbTimeouts, SchemaPolicy};
use inventory_infra::jetstream::{self, NatsSecurity, NatsTimeouts, Topology};
use inventory_infra::{DetectMode, NaturalKeyPath};

/// `Debug` masks the URL's password.
#[derive(Clone, clap::Args)]
pub struct DatabaseArgs {
    /// Database URL: postgres://… or sqlite://….
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, default_value = DEFAULT_DATABASE_URL)]
    pub database_url: String,
    /// Runs no DDL: checks that every migration is applied and that the role holds the grants
    /// of deploy/grants.sql, and refuses to start otherwise (for a role that may not change the
    /// schema; `inventory migrate` applies them).
    #[arg(long, env = "INVENTORY_SKIP_MIGRATIONS", value_parser = clap::builder::BoolishValueParser::new())]
    pub skip_migrations: bool,
    /// How long opening a database connection may take (TCP, TLS, start-up, authentication);
    /// a connection from the pool is waited for twice as long.
    #[arg(long, env = "DB_CONNECT_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
    pub db_connect_timeout: Duration,
    /// PostgreSQL's statement_timeout on every connection, and the client's own bound (this
    /// plus 1 s) on a message's database work, which alone catches a server that went silent:
    /// past it the work is abandoned, its connection closed, and the message retried. 0s: no
    /// bound. Migrations are never bounded.
    #[arg(long, env = "DB_STATEMENT_TIMEOUT", default_value = "15s", value_parser = humantime::parse_duration)]
    pub db_statement_timeout: Duration,
}

impl DatabaseArgs {
    pub fn timeouts(&self) -> DbTimeouts {
        DbTimeouts {
            connect: self.db_connect_timeout,
            statement: self.db_statement_timeout,
        }
    }

    pub fn schema(&self) -> SchemaPolicy {
        if self.skip_migrations {
            SchemaPolicy::Check
        } else {
            SchemaPolicy::Migrate
        }
    }
}

/// The database `inventory migrate` changes. `Debug` masks the URL's password.
#[derive(Clone, clap::Args)]
pub struct MigrateArgs {
    /// Database URL: postgres://… or sqlite://….
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, default_value = DEFAULT_DATABASE_URL)]
    pub database_url: String,
}

/// The orders producer's database; the inventory database unless named. `Debug` masks the
/// URLs' passwords.
#[derive(Clone, clap::Args)]
pub struct OrdersDatabaseArgs {
    /// The orders database URL: postgres://… or sqlite://…; DATABASE_URL's by default.
    #[arg(long, env = "ORDERS_DATABASE_URL", hide_env_values = true)]
    pub orders_database_url: Option<String>,
    #[command(flatten)]
    pub database: DatabaseArgs,
}

impl OrdersDatabaseArgs {
    pub fn url(&self) -> &str {
        self.orders_database_url
            .as_deref()
            .unwrap_or(&self.database.database_url)
    }
}

/// The NATS server and how to reach it. `Debug` is not derived: it would print the secrets.
#[derive(Clone, clap::Args)]
pub struct NatsArgs {
    /// NATS server URL.
    #[arg(
        long,
        env = "NATS_URL",
        hide_env_values = true,
        default_value = "nats://127.0.0.1:4222"
    )]
    pub nats_url: String,
    /// NATS credentials file (JWT and NKey seed).
    #[arg(long, env = "NATS_CREDS", hide_env_values = true)]
    pub nats_creds: Option<PathBuf>,
    /// NATS user, with --nats-password.
    #[arg(long, env = "NATS_USER", hide_env_values = true)]
    pub nats_user: Option<String>,
    /// NATS password; prefer the environment variable to the flag, which `ps` shows.
    #[arg(
        long,
        env = "NATS_PASSWORD",
        hide_env_values = true,
        requires = "nats_user"
    )]
    pub nats_password: Option<String>,
    /// NATS token; prefer the environment variable to the flag, which `ps` shows.
    #[arg(long, env = "NATS_TOKEN", hide_env_values = true)]
    pub nats_token: Option<String>,
    /// PEM file of the CA that signed the NATS server's certificate.
    #[arg(long, env = "NATS_TLS_CA", hide_env_values = true)]
    pub nats_tls_ca: Option<PathBuf>,
    /// PEM client certificate, for a NATS server that verifies clients (with --nats-tls-key).
    #[arg(
        long,
        env = "NATS_TLS_CERT",
        hide_env_values = true,
        requires = "nats_tls_key"
    )]
    pub nats_tls_cert: Option<PathBuf>,
    /// PEM key of the client certificate.
    #[arg(
        long,
        env = "NATS_TLS_KEY",
        hide_env_values = true,
        requires = "nats_tls_cert"
    )]
    pub nats_tls_key: Option<PathBuf>,
    /// Refuse to connect to NATS without TLS.
    #[arg(long, env = "NATS_REQUIRE_TLS", hide_env_values = true)]
    pub nats_require_tls: bool,
    /// How long dialling a NATS server may take, at start and on each reconnect.
    #[arg(long, env = "NATS_CONNECT_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
    pub nats_connect_timeout: Duration,
    /// How often the client pings the NATS server; two pings unanswered and it reconnects, so
    /// a connection gone silent without closing is given up after two to three of these.
    #[arg(long, env = "NATS_PING_INTERVAL", default_value = "10s", value_parser = humantime::parse_duration)]
    pub nats_ping_interval: Duration,
    /// How long a JetStream API request or a publish waits for its answer.
    #[arg(long, env = "NATS_REQUEST_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub nats_request_timeout: Duration,
}

impl NatsArgs {
    pub fn security(&self) -> NatsSecurity {
        NatsSecurity {
            credentials_file: self.nats_creds.clone(),
            user: self.nats_user.clone(),
            password: self.nats_password.clone(),
            token: self.nats_token.clone(),
            tls_ca: self.nats_tls_ca.clone(),
            tls_client_cert: self.nats_tls_cert.clone().zip(self.nats_tls_key.clone()),
            require_tls: self.nats_require_tls,
        }
    }

    pub fn timeouts(&self) -> NatsTimeouts {
        NatsTimeouts {
            connect: self.nats_connect_timeout,
            ping_interval: self.nats_ping_interval,
            request: self.nats_request_timeout,
        }
    }

    /// Connects with these flags' URL, credentials, TLS and timeouts.
    pub async fn connect(&self, name: &str) -> Result<jetstream::Client, jetstream::NatsError> {
        jetstream::connect_with(&self.nats_url, name, &self.security(), self.timeouts()).await
    }
}

/// Stream and subject names; the contract's by default.
#[derive(Debug, Clone, clap::Args)]
pub struct TopologyArgs {
    /// The orders stream.
    #[arg(long, global = true, default_value = "ORDERS")]
    pub stream: String,
    /// Subjects of the orders stream: `<prefix>.placed`, `<prefix>.cancelled`.
    #[arg(long, global = true, default_value = "orders")]
    pub subject_prefix: String,
    /// The dead-letter stream.
    #[arg(long, global = true, default_value = "ORDERS_DLQ")]
    pub dlq_stream: String,
    /// Subjects of the dead-letter stream: `<prefix>.<consumer>`.
    #[arg(long, global = true, default_value = "dlq")]
    pub dlq_subject_prefix: String,
    /// The stream of Inventory's events, which the outbox relay publishes to.
    #[arg(long, global = true, default_value = "INVENTORY")]
    pub events_stream: String,
    /// Subjects of the events stream: `<prefix>.stock.reserved`, `.rejected`, `.released`.
    #[arg(long, global = true, default_value = "inventory")]
    pub events_subject_prefix: String,
    /// How long the stream drops a resend of a `Nats-Msg-Id` it has stored (when it creates the
    /// streams).
    #[arg(long, global = true, default_value = "2m", value_parser = humantime::parse_duration)]
    pub duplicate_window: Duration,
    /// Stream replicas (when it creates the streams); 3 on a JetStream cluster.
    #[arg(long, global = true, default_value_t = 1)]
    pub replicas: usize,
}

impl TopologyArgs {
    pub fn topology(&self) -> Topology {
        Topology {
            stream: self.stream.clone(),
            subject_prefix: self.subject_prefix.clone(),
            dlq_stream: self.dlq_stream.clone(),
            dlq_subject_prefix: self.dlq_subject_prefix.clone(),
            events_stream: self.events_stream.clone(),
            events_subject_prefix: self.events_subject_prefix.clone(),
            duplicate_window: self.duplicate_window,
            replicas: self.replicas,
        }
    }
}

impl std::fmt::Debug for NatsArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsArgs")
            .field(
                "nats_url",
                &inventory_infra::redact::redact_url(&self.nats_url),
            )
            .field("security", &self.security())
            .field("timeouts", &self.timeouts())
            .finish()
    }
}

impl std::fmt::Debug for OrdersDatabaseArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OrdersDatabaseArgs")
            .field(
                "orders_database_url",
                &self
                    .orders_database_url
                    .as_deref()
                    .map(inventory_infra::redact::redact_url),
            )
            .field("database", &self.database)
            .finish()
    }
}

impl std::fmt::Debug for DatabaseArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatabaseArgs")
            .field(
                "database_url",
                &inventory_infra::redact::redact_url(&self.database_url),
            )
            .field("skip_migrations", &self.skip_migrations)
            .field("timeouts", &self.timeouts())
            .finish()
    }
}

impl std::fmt::Debug for MigrateArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MigrateArgs")
            .field(
                "database_url",
                &inventory_infra::redact::redact_url(&self.database_url),
            )
            .finish()
    }
}

/// A flag whose values are the labels of `all`.
pub fn one_of<T: Copy + Send + Sync + 'static>(
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

pub fn detect_mode() -> impl TypedValueParser<Value = DetectMode> {
    one_of(&DetectMode::ALL, DetectMode::as_str)
}

/// `--natural-handler`: the batch statement is chosen by a batch size, not by name.
pub fn natural_key_path() -> impl TypedValueParser<Value = NaturalKeyPath> {
    const ON_THE_COMMAND_LINE: [NaturalKeyPath; 2] =
        [NaturalKeyPath::OneStatement, NaturalKeyPath::Orm];
    one_of(&ON_THE_COMMAND_LINE, NaturalKeyPath::as_str)
}

/// Where `/metrics` and the health endpoints listen: an address, or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricsAddr(pub Option<std::net::SocketAddr>);

/// On every interface, so that an orchestrator's probes reach it.
pub const DEFAULT_METRICS_ADDR: &str = "0.0.0.0:9090";

impl std::str::FromStr for MetricsAddr {
    type Err = std::net::AddrParseError;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        if value.eq_ignore_ascii_case("off") {
            return Ok(Self(None));
        }
        value.parse().map(|addr| Self(Some(addr)))
    }
}

/// The flag of `serve` and `relay`.
#[derive(Debug, Clone, clap::Args)]
pub struct MetricsArgs {
    /// Serves /metrics, /livez, /readyz and /healthz at this address, from before the set-up
    /// begins; `off` serves none of them.
    #[arg(long, env = "METRICS_ADDR", default_value = DEFAULT_METRICS_ADDR)]
    pub metrics_addr: MetricsAddr,
}
