//! `inventory bench hand-written`: the consumer one would write by hand around the service's
//! statement, as the bound of what the service's own loop costs per message. tokio-postgres and
//! async-nats, nothing else: N lanes, each with its own connection and the statement prepared
//! once, take the next message of one JetStream pull stream, decode the OrderPlaced body, run
//! [`RESERVE_SQL`] and ack after it returned. No retry policy, dead letters, spans, metrics or
//! outage handling: a failure ends the run. Cancellations are not part of the workload.
//!
//! With `--driver sqlx` the same loop runs the statement through sqlx, the service's driver, on
//! a connection of its own: the service's CPU per message against both loops parts what the
//! driver costs from what the service's own loop costs.
//!
//! The workload, the report and the wait for the last ack are `inventory bench end-to-end`'s
//! ([`crate::bench_e2e`]); this module only consumes.

use std::str::FromStr as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use futures::StreamExt;
use inventory_domain::OrderId;
use inventory_domain::outbox::partition;
use inventory_infra::consumers::natural_pg::RESERVE_SQL;
use inventory_infra::jetstream::{Context, Topology};
use sea_orm::sqlx::postgres::{PgConnectOptions, PgSslMode};
use sea_orm::sqlx::{self, ConnectOptions as _, Row as _};
use serde::Deserialize;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::bench_e2e::PublishClock;

/// The fields of a plain OrderPlaced body the statement needs.
#[derive(Deserialize)]
pub(crate) struct Placed {
    pub(crate) message_id: String,
    pub(crate) order_id: Uuid,
    pub(crate) book_id: Uuid,
    pub(crate) quantity: i32,
}

/// A tokio-postgres connection without TLS, its connection task spawned (it ends when the
/// client is dropped).
pub(crate) async fn connect(database_url: &str) -> Result<tokio_postgres::Client> {
    let (client, connection) = tokio_postgres::connect(database_url, tokio_postgres::NoTls)
        .await
        .context("connecting")?;
    tokio::spawn(connection);
    Ok(client)
}

/// Runs [`RESERVE_SQL`], prepared as `statement` on `client`, for `placed` with a fresh event
/// id: the statement's one row.
pub(crate) async fn reserve(
    client: &tokio_postgres::Client,
    statement: &tokio_postgres::Statement,
    placed: &Placed,
) -> Result<tokio_postgres::Row> {
    Ok(client
        .query_one(
            statement,
            &[
                &placed.order_id,
                &placed.book_id,
                &placed.quantity,
                &placed.message_id,
                &Uuid::now_v7(),
                &partition(OrderId::from(placed.order_id)),
            ],
        )
        .await?)
}

/// The PostgreSQL driver a lane runs the statement through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Driver {
    TokioPostgres,
    Sqlx,
}

/// A lane's connection, the statement prepared on it (sqlx prepares on first use and keeps it).
enum Lane {
    TokioPostgres(tokio_postgres::Client, tokio_postgres::Statement),
    Sqlx(sqlx::PgConnection),
}

impl Lane {
    async fn open(driver: Driver, database_url: &str) -> Result<Self> {
        Ok(match driver {
            Driver::TokioPostgres => {
                let client = connect(database_url).await.context("connecting a lane")?;
                let statement = client.prepare(RESERVE_SQL).await?;
                Self::TokioPostgres(client, statement)
            }
            // Without TLS, as tokio-postgres connects here and the service by default.
            Driver::Sqlx => Self::Sqlx(
                PgConnectOptions::from_str(database_url)?
                    .ssl_mode(PgSslMode::Disable)
                    .connect()
                    .await
                    .context("connecting a lane")?,
            ),
        })
    }

    /// Runs [`RESERVE_SQL`] for `placed`: whether it inserted the reservation.
    async fn reserve(&mut self, placed: &Placed) -> Result<bool> {
        Ok(match self {
            Self::TokioPostgres(client, statement) => reserve(client, statement, placed)
                .await?
                .try_get::<_, Option<&str>>("inserted_status")?
                .is_some(),
            Self::Sqlx(connection) => {
                let row = sqlx::query(RESERVE_SQL)
                    .bind(placed.order_id)
                    .bind(placed.book_id)
                    .bind(placed.quantity)
                    .bind(&placed.message_id)
                    .bind(Uuid::now_v7())
                    .bind(partition(OrderId::from(placed.order_id)))
                    .fetch_one(&mut *connection)
                    .await?;
                row.try_get::<Option<&str>, _>("inserted_status")?.is_some()
            }
        })
    }
}

/// What the lanes counted.
#[derive(Debug, Default)]
pub(crate) struct Counts {
    pub(crate) acked: AtomicU64,
    /// Acked, the statement having found the order's reservation already there.
    pub(crate) duplicates: AtomicU64,
}

/// The lanes, running.
pub(crate) struct HandWritten {
    pub(crate) counts: Arc<Counts>,
    pub(crate) consumer: PullConsumer,
    stop: CancellationToken,
    lanes: JoinSet<Result<()>>,
}

/// Creates the durable pull consumer on the orders stream; [`HandWritten::start`] consumes.
pub(crate) async fn prepare(js: &Context, topology: &Topology) -> Result<PullConsumer> {
    let stream = js.get_stream(&topology.stream).await?;
    let name = "inventory-bench-hand-written";
    let config = pull::Config {
        durable_name: Some(name.into()),
        filter_subject: format!("{}.>", topology.subject_prefix),
        ack_policy: AckPolicy::Explicit,
        max_ack_pending: 20_000,
        ..Default::default()
    };
    Ok(stream.get_or_create_consumer(name, config).await?)
}

impl HandWritten {
    /// Starts `lanes` lanes on `consumer`; each opens its connection through `driver` and
    /// prepares the statement first, as the service's lanes open theirs on their first message.
    pub(crate) async fn start(
        database_url: &str,
        driver: Driver,
        consumer: PullConsumer,
        lanes: usize,
        clock: Option<Arc<PublishClock>>,
    ) -> Result<Self> {
        // As the service pulls: twice what the lanes hold, asked again when half is used.
        let messages = consumer
            .stream()
            .max_messages_per_batch((2 * lanes).max(32))
            .heartbeat(Duration::from_secs(5))
            .expires(Duration::from_secs(30))
            .messages()
            .await?;
        let messages = Arc::new(tokio::sync::Mutex::new(messages));
        let counts = Arc::new(Counts::default());
        let stop = CancellationToken::new();
        let mut running = JoinSet::new();
        for _ in 0..lanes {
            let failed = stop.clone();
            let (messages, counts, stop, clock) = (
                messages.clone(),
                counts.clone(),
                stop.clone(),
                clock.clone(),
            );
            let database_url = database_url.to_owned();
            let lane = async move {
                let mut connection = Lane::open(driver, &database_url).await?;
                loop {
                    let next = {
                        let mut messages = messages.lock().await;
                        tokio::select! {
                            () = stop.cancelled() => return Ok(()),
                            next = messages.next() => next,
                        }
                    };
                    let message = next.context("the pull stream ended")??;
                    let placed: Placed = serde_json::from_slice(&message.payload)?;
                    let inserted = connection.reserve(&placed).await?;
                    message.ack().await.map_err(anyhow::Error::from_boxed)?;
                    if let Some(clock) = &clock {
                        clock.handled(&placed.message_id, Instant::now());
                    }
                    let counter = if inserted {
                        &counts.acked
                    } else {
                        &counts.duplicates
                    };
                    counter.fetch_add(1, Relaxed);
                }
            };
            running.spawn(async move {
                let result: Result<()> = lane.await;
                if result.is_err() {
                    failed.cancel();
                }
                result
            });
        }
        Ok(Self {
            counts,
            consumer,
            stop,
            lanes: running,
        })
    }

    /// A lane failed, and the others were told to stop (the error is [`stop`](Self::stop)'s).
    pub(crate) fn is_finished(&self) -> bool {
        self.stop.is_cancelled()
    }

    /// Stops the lanes and returns the first lane's error, if one failed.
    pub(crate) async fn stop(mut self) -> Result<()> {
        self.stop.cancel();
        while let Some(lane) = self.lanes.join_next().await {
            lane??;
        }
        Ok(())
    }
}
