//! Flags shared by several commands. Each default is the one its settings type gives
//! (`DbTimeouts::default()`, `NatsTimeouts::default()`, `Topology::default()`, …), shown by
//! `--help`; the environment variables and the configuration file are [`crate::config`]'s.

use std::path::PathBuf;
use std::time::Duration;

use inventory_infra::db::{DEFAULT_DATABASE_URL, DbTimeouts, SchemaPolicy};
use inventory_infra::jetstream::{self, NatsSecurity, NatsTimeouts, Topology};
use secrecy::{ExposeSecret as _, SecretString};

use crate::shutdown::Shutdown;
use crate::telemetry::LogFormat;

/// A default `--help` can show: a duration as it is written (`30s`, `2m`).
pub fn shown(duration: Duration) -> String {
    humantime::format_duration(duration).to_string()
}

/// `--replay-allowance`'s default: how long after a dead letter operators may still replay it,
/// the last part of the inbox's redelivery horizon. One value for `serve`, `inbox purge` and
/// `dlq replay`, which must agree on it.
pub const REPLAY_ALLOWANCE: &str = "7days";

/// A secret's flag: the value held so that `Debug` never prints it.
pub fn secret(value: &str) -> Result<SecretString, std::convert::Infallible> {
    Ok(SecretString::from(value))
}

/// The flags of every command of both binaries (`inventory` and `inventory-study`).
#[derive(Debug, Clone, clap::Args)]
pub struct ProgramArgs {
    /// A TOML file of settings, keyed by the flags' long names (`ack-wait = "30s"`): above the
    /// defaults, below the environment and the command line.
    #[arg(long, global = true, env = "INVENTORY_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// How logs are written to stderr: `text` for a person, `json` (one object a line) for a
    /// collector.
    #[arg(
        long,
        global = true,
        env = "INVENTORY_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    pub log_format: LogFormat,
}

/// Which database, and whether it must be named.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Database")]
pub struct DatabaseUrlArgs {
    /// Database URL: postgres://… or sqlite://…. Unset: an embedded SQLite file, inventory.db
    /// in the working directory, which is this process's own. Or INVENTORY_DATABASE_URL_FILE:
    /// a file that holds it (a mounted secret).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, value_parser = secret)]
    pub database_url: Option<SecretString>,
    /// Refuses to run unless the database is named (DATABASE_URL), rather than use the
    /// embedded SQLite file: for an image or a unit, where that file would be one instance's
    /// alone and a restart may lose it.
    #[arg(long)]
    pub require_database_url: bool,
}

impl DatabaseUrlArgs {
    /// The URL named, or the embedded SQLite file's.
    pub fn url(&self) -> &str {
        self.database_url
            .as_ref()
            .map_or(DEFAULT_DATABASE_URL, |url| url.expose_secret())
    }

    /// Logs, at WARN, that no database was named and which file is used instead: a long-running
    /// command says so at start, since another instance would keep stock of its own.
    pub fn warn_if_implicit(&self) {
        if self.database_url.is_none() {
            let file = std::env::current_dir()
                .unwrap_or_default()
                .join(embedded_file());
            tracing::warn!(
                file = %file.display(),
                "no DATABASE_URL: using the embedded SQLite file {}, this process's own; another \
                 instance keeps its own stock, and a container loses it when it is replaced",
                file.display()
            );
        }
    }
}

/// The file of [`DEFAULT_DATABASE_URL`].
fn embedded_file() -> &'static str {
    let path = DEFAULT_DATABASE_URL.trim_start_matches("sqlite://");
    path.split_once('?').map_or(path, |(path, _)| path)
}

#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Database")]
pub struct DatabaseArgs {
    #[command(flatten)]
    pub url: DatabaseUrlArgs,
    /// Runs no DDL: checks that every migration is applied and that the role holds the grants
    /// of deploy/grants.sql, and refuses to start otherwise (for a role that may not change the
    /// schema; `inventory migrate` applies them).
    #[arg(long)]
    pub skip_migrations: bool,
    /// How long opening a database connection may take (TCP, TLS, start-up, authentication);
    /// a connection from the pool is waited for twice as long.
    #[arg(long, default_value = shown(DbTimeouts::default().connect), value_parser = humantime::parse_duration)]
    pub db_connect_timeout: Duration,
    /// PostgreSQL's statement_timeout on every connection, and the client's own bound (this
    /// plus 1 s) on a message's database work, which alone catches a server that went silent:
    /// past it the work is abandoned, its connection closed, and the message retried. 0s: no
    /// bound. Migrations are never bounded.
    #[arg(long, default_value = shown(DbTimeouts::default().statement), value_parser = humantime::parse_duration)]
    pub db_statement_timeout: Duration,
}

impl DatabaseArgs {
    pub fn url(&self) -> &str {
        self.url.url()
    }

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

/// The orders producer's database; the inventory database unless named.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Database")]
pub struct OrdersDatabaseArgs {
    /// The orders database URL: postgres://… or sqlite://…; DATABASE_URL's by default. Or
    /// INVENTORY_ORDERS_DATABASE_URL_FILE: a file that holds it.
    #[arg(long, env = "ORDERS_DATABASE_URL", hide_env_values = true, value_parser = secret)]
    pub orders_database_url: Option<SecretString>,
    #[command(flatten)]
    pub database: DatabaseArgs,
}

impl OrdersDatabaseArgs {
    pub fn url(&self) -> &str {
        self.orders_database_url
            .as_ref()
            .map_or_else(|| self.database.url(), |url| url.expose_secret())
    }
}

/// The NATS server and how to reach it.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "NATS")]
pub struct NatsArgs {
    /// NATS server URL; several servers of a cluster, comma separated. Or
    /// INVENTORY_NATS_URL_FILE: a file that holds it.
    #[arg(
        long,
        env = "NATS_URL",
        hide_env_values = true,
        default_value = "nats://127.0.0.1:4222",
        value_parser = secret
    )]
    pub nats_url: SecretString,
    /// NATS credentials file (JWT and NKey seed).
    #[arg(long)]
    pub nats_creds: Option<PathBuf>,
    /// NATS user, with --nats-password.
    #[arg(long)]
    pub nats_user: Option<String>,
    /// NATS password; prefer the environment variable or its file (INVENTORY_NATS_PASSWORD_FILE)
    /// to the flag, which `ps` shows.
    #[arg(long, requires = "nats_user", value_parser = secret)]
    pub nats_password: Option<SecretString>,
    /// NATS token; prefer the environment variable or its file (INVENTORY_NATS_TOKEN_FILE) to
    /// the flag, which `ps` shows.
    #[arg(long, value_parser = secret)]
    pub nats_token: Option<SecretString>,
    /// PEM file of the CA that signed the NATS server's certificate.
    #[arg(long)]
    pub nats_tls_ca: Option<PathBuf>,
    /// PEM client certificate, for a NATS server that verifies clients (with --nats-tls-key).
    #[arg(long, requires = "nats_tls_key")]
    pub nats_tls_cert: Option<PathBuf>,
    /// PEM key of the client certificate.
    #[arg(long, requires = "nats_tls_cert")]
    pub nats_tls_key: Option<PathBuf>,
    /// Refuse to connect to NATS without TLS.
    #[arg(long)]
    pub nats_require_tls: bool,
    /// How long dialling a NATS server may take, at start and on each reconnect.
    #[arg(long, default_value = shown(NatsTimeouts::default().connect), value_parser = humantime::parse_duration)]
    pub nats_connect_timeout: Duration,
    /// How often the client pings the NATS server; two pings unanswered and it reconnects, so
    /// a connection gone silent without closing is given up after two to three of these.
    #[arg(long, default_value = shown(NatsTimeouts::default().ping_interval), value_parser = humantime::parse_duration)]
    pub nats_ping_interval: Duration,
    /// How long a JetStream API request or a publish waits for its answer.
    #[arg(long, default_value = shown(NatsTimeouts::default().request), value_parser = humantime::parse_duration)]
    pub nats_request_timeout: Duration,
}

impl NatsArgs {
    pub fn url(&self) -> &str {
        self.nats_url.expose_secret()
    }

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
        jetstream::connect_with(self.url(), name, &self.security(), self.timeouts()).await
    }
}

/// Stream and subject names; the contract's by default.
#[derive(Debug, Clone, clap::Args)]
#[command(next_help_heading = "Streams")]
pub struct TopologyArgs {
    /// The orders stream.
    #[arg(long, global = true, default_value = Topology::default().stream)]
    pub stream: String,
    /// Subjects of the orders stream: `<prefix>.placed`, `<prefix>.cancelled`.
    #[arg(long, global = true, default_value = Topology::default().subject_prefix)]
    pub subject_prefix: String,
    /// The dead-letter stream.
    #[arg(long, global = true, default_value = Topology::default().dlq_stream)]
    pub dlq_stream: String,
    /// Subjects of the dead-letter stream: `<prefix>.<consumer>`.
    #[arg(long, global = true, default_value = Topology::default().dlq_subject_prefix)]
    pub dlq_subject_prefix: String,
    /// The stream of Inventory's events, which the outbox relay publishes to.
    #[arg(long, global = true, default_value = Topology::default().events_stream)]
    pub events_stream: String,
    /// Subjects of the events stream: `<prefix>.stock.reserved`, `.rejected`, `.released`.
    #[arg(long, global = true, default_value = Topology::default().events_subject_prefix)]
    pub events_subject_prefix: String,
    /// How long the stream drops a resend of a `Nats-Msg-Id` it has stored (when it creates the
    /// streams).
    #[arg(long, global = true, default_value = shown(Topology::default().duplicate_window), value_parser = humantime::parse_duration)]
    pub duplicate_window: Duration,
    /// Stream replicas (when it creates the streams); 3 on a JetStream cluster.
    #[arg(long, global = true, default_value_t = Topology::default().replicas)]
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

/// The stop of `serve` and `relay`.
#[derive(Debug, Clone, clap::Args)]
pub struct StopArgs {
    /// How long the whole stop may take after SIGINT or SIGTERM: the in-flight messages, the
    /// relay's last pass and the NATS drain. What has not finished by then is left for
    /// redelivery or for the next relay, and the process exits 1.
    #[arg(long, default_value = shown(Shutdown::TIMEOUT), value_parser = humantime::parse_duration)]
    pub shutdown_timeout: Duration,
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
#[command(next_help_heading = "Health and metrics")]
pub struct MetricsArgs {
    /// Serves /metrics, /livez, /readyz and /healthz at this address, from before the set-up
    /// begins; `off` serves none of them.
    #[arg(long, default_value = DEFAULT_METRICS_ADDR)]
    pub metrics_addr: MetricsAddr,
}
