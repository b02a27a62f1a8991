//! The NATS users of `deploy/nats/inventory-user.conf` and `inventory-shard-user.conf`, each on
//! a nats-server of the test's own beside an administrator: `serve --strategy natural`, and
//! `serve --shard` on a sharded stream, work end to end as them (a reservation, a dead letter,
//! the relay's event), and what the service has no business doing (publishing orders, deleting
//! a stream) is refused.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use inventory_domain::{BookId, OrderId};
use inventory_infra::jetstream::{self, Context, NatsSecurity, Topology};
use inventory_tests::binary::{BinaryRun, free_port, http_get, inventory, sample, stop};
use inventory_tests::nats::{NatsServer, binary_since_2_10, stream_messages};

const BOOK: &str = "0190f5c4-3c2e-7b4a-9d3e-aaaaaaaaaaaa";
const INVENTORY_USER: &str = include_str!("../../deploy/nats/inventory-user.conf");
const SHARD_USER: &str = include_str!("../../deploy/nats/inventory-shard-user.conf");
const PASSWORD: &str = "inventory-pa55";
const ADMIN_PASSWORD: &str = "admin-pa55";

fn user(name: &str, password: &str) -> NatsSecurity {
    NatsSecurity {
        user: Some(name.into()),
        password: Some(password.into()),
        ..NatsSecurity::default()
    }
}

async fn connect(server: &NatsServer, security: &NatsSecurity) -> Context {
    let client = jetstream::connect_with(
        &server.url(),
        "permissions test",
        security,
        Default::default(),
    )
    .await
    .unwrap();
    jetstream::context(client)
}

/// `inventory <args>` against the test's database and this server, as `name`, with the
/// default stream names the user's permissions name.
fn command(run: &BinaryRun, server: &NatsServer, name: &str, password: &str) -> Command {
    let mut command = Command::new(inventory());
    command
        .env("DATABASE_URL", &run.database_url)
        .env("NATS_URL", server.url())
        .env("INVENTORY_NATS_USER", name)
        .env("INVENTORY_NATS_PASSWORD", password)
        .env("INVENTORY_METRICS_ADDR", "127.0.0.1:0")
        .env("RUST_LOG", "info,sqlx=warn");
    command
}

fn publish(run: &BinaryRun, server: &NatsServer, book: &str) {
    let output = command(run, server, "admin", ADMIN_PASSWORD)
        .args(["publish", "placed", "--book-id", book, "--quantity", "2"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
}

/// A server configuration with an administrator and `service_user`, the password set.
fn config(service_user: &str) -> String {
    format!(
        "authorization {{\n  users = [\n    {{ user: admin, password: \"{ADMIN_PASSWORD}\" }}\n{}\n  ]\n}}\n",
        service_user.replace("$INVENTORY_NATS_PASSWORD", &format!("\"{PASSWORD}\""))
    )
}

/// The administrator's connection, once it created the streams: the service only looks them
/// up.
async fn streams_created(server: &NatsServer) -> Context {
    let admin = connect(server, &user("admin", ADMIN_PASSWORD)).await;
    let topology = Topology::default();
    jetstream::ensure_streams(&admin, &topology).await.unwrap();
    jetstream::ensure_prefix_stream(&admin, &topology.events_stream())
        .await
        .unwrap();
    admin
}

/// The service under test, as a process.
struct Service(Option<Child>);

impl Service {
    /// Waits until the service has reserved `reserved` copies of [`BOOK`] and the DLQ and the
    /// events stream hold `dead_letters` and `events`; on a timeout, stops it and fails with
    /// its log.
    async fn until_settled(&mut self, run: &BinaryRun, admin: &Context, expected: (i64, u64, u64)) {
        let topology = Topology::default();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let seen = (
                run.db.reserved(BookId::parse(BOOK).unwrap()).await,
                stream_messages(admin, &topology.dlq_stream).await,
                stream_messages(admin, &topology.events_stream).await,
            );
            if seen == expected {
                return;
            }
            if Instant::now() > deadline {
                let (_, log) = stop(self.0.take().expect("running"));
                panic!(
                    "(reserved, dead letters, events) {seen:?}, not {expected:?}; the service's \
                     log:\n{log}"
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops the service: it must have drained and met no permissions violation.
    fn stop_cleanly(mut self) {
        let (status, log) = stop(self.0.take().expect("running"));
        assert!(status.success(), "{log}");
        assert!(
            !log.to_lowercase().contains("permissions violation"),
            "{log}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_user_serves_end_to_end_and_may_not_publish_orders_or_delete_streams() {
    let server = NatsServer::start_with_config(&config(INVENTORY_USER)).await;
    let admin = streams_created(&server).await;
    let topology = Topology::default();

    let run = BinaryRun::new("nats_permissions", "info,sqlx=warn").await;
    run.put_stock(BOOK, "Dune", 10);
    let metrics_port = free_port();
    let metrics_addr = format!("127.0.0.1:{metrics_port}");
    let mut service = Service(Some(
        command(&run, &server, "inventory", PASSWORD)
            .args(["serve", "--strategy", "natural", "--ack-wait", "2s"])
            .args(["--metrics-addr", &metrics_addr])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    publish(&run, &server, BOOK);
    publish(&run, &server, &BookId::new_v7().to_string());

    // The dead letter as the service's metrics see it in the DLQ (read every 30 s): the user
    // may read what its alarms stay on for.
    let waiting = "inventory_dead_letters_waiting{consumer=\"inventory-reserve-stock\"}";
    let deadline = Instant::now() + Duration::from_secs(45);
    while http_get(metrics_port, "/metrics").map_or(0.0, |(_, scrape)| sample(&scrape, waiting))
        != 1.0
    {
        assert!(Instant::now() < deadline, "{waiting} never 1");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    let service_user = connect(&server, &user("inventory", PASSWORD)).await;
    let published = async {
        service_user
            .publish("orders.placed", "{}".into())
            .await?
            .await
            .map(drop)
            .map_err(|error| error.to_string().into())
    };
    let refused: Result<(), Box<dyn std::error::Error>> = published.await;
    assert!(refused.is_err(), "the service user published an order");
    assert!(
        service_user.delete_stream(&topology.stream).await.is_err(),
        "the service user deleted the stream"
    );
    assert_eq!(stream_messages(&admin, &topology.stream).await, 2);
    service.until_settled(&run, &admin, (2, 1, 1)).await;
    service.stop_cleanly();
}

/// A shard's instance as the shard user, on a stream an administrator sharded and assigned: it
/// reads the assignment and watches it, serves its partitions' consumers and the unroutable
/// one, dead-letters on their subjects and publishes its relay's events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shard_user_serves_a_shard_end_to_end() {
    let bin = match binary_since_2_10() {
        Ok(bin) => bin,
        Err(why) => {
            eprintln!("the_shard_user_serves_a_shard_end_to_end: skipped: {why}");
            return;
        }
    };
    let server = NatsServer::start_binary_with_config(&bin, &config(SHARD_USER)).await;
    let admin = streams_created(&server).await;
    let run = BinaryRun::new("nats_permissions_shard", "info,sqlx=warn").await;
    let as_admin = |args: &[&str]| {
        let output = command(&run, &server, "admin", ADMIN_PASSWORD)
            .args(args)
            .output()
            .unwrap();
        assert!(output.status.success(), "{args:?}: {output:?}");
    };
    as_admin(&["shard", "init", "--partitions", "4"]);
    as_admin(&["shard", "assign", "--partitions", "0-3", "--to", "a"]);
    run.put_stock(BOOK, "Dune", 10);
    let mut service = Service(Some(
        command(&run, &server, "inventory-shard", PASSWORD)
            .args(["serve", "--shard", "a", "--ack-wait", "2s"])
            .args(["--concurrency", "2", "--db-pool-size", "2"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    let order = OrderId::new_v7().to_string();
    as_admin(&[
        "publish",
        "placed",
        "--book-id",
        BOOK,
        "--quantity",
        "2",
        "--order-id",
        &order,
    ]);
    // An unknown book's placement, and a cancellation of a whole order, which no shard takes.
    publish(&run, &server, &BookId::new_v7().to_string());
    as_admin(&[
        "publish",
        "cancelled",
        "--order-id",
        &OrderId::new_v7().to_string(),
    ]);
    service.until_settled(&run, &admin, (2, 2, 1)).await;
    // The line's cancellation, on its book's subject: released, with its event.
    as_admin(&[
        "publish",
        "cancelled",
        "--order-id",
        &order,
        "--book-id",
        BOOK,
    ]);
    service.until_settled(&run, &admin, (0, 2, 2)).await;
    service.stop_cleanly();
}
