//! The dead-letter commands as an operator runs them, as the NATS user of
//! `deploy/nats/inventory-operator.conf`, on a nats-server of the test's own with that user
//! beside an administrator: `dlq list`, `dlq delete` (and its dry run) and `dlq replay` (its dry
//! run, the replay allowance's refusal, `--force`) work end to end and print what they did; what
//! the operator has no business doing (publishing elsewhere, deleting from the orders stream) is
//! refused.

use std::process::{Command, Output};
use std::time::Duration;

use async_nats::HeaderMap;
use inventory_domain::{DeadLetterReason, EventKind};
use inventory_infra::jetstream::{self, Context, DeadLetters, NatsSecurity, Origin, Topology};
use inventory_tests::binary::inventory;
use inventory_tests::nats::{NatsServer, stream_messages};

const OPERATOR_USER: &str = include_str!("../../deploy/nats/inventory-operator.conf");
const OPERATOR: &str = "inventory-operator";
const PASSWORD: &str = "operator-pa55";
const ADMIN_PASSWORD: &str = "admin-pa55";
const EMAIL_CONSUMER: &str = "notifications-stock-reserved-email";

async fn connect(server: &NatsServer, name: &str, password: &str) -> Context {
    let security = NatsSecurity {
        user: Some(name.into()),
        password: Some(password.into()),
        ..NatsSecurity::default()
    };
    let timeouts = jetstream::NatsTimeouts {
        request: Duration::from_secs(2),
        ..Default::default()
    };
    let client = jetstream::connect_with(&server.url(), "dlq operator test", &security, timeouts)
        .await
        .unwrap();
    jetstream::context(client)
}

/// `inventory dlq <args>` as the operator against this server, with the default stream names
/// the user's permissions name, and `env` set.
fn dlq(server: &NatsServer, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(inventory());
    command
        .arg("dlq")
        .args(args)
        .env("NATS_URL", server.url())
        .env("INVENTORY_NATS_USER", OPERATOR)
        .env("INVENTORY_NATS_PASSWORD", PASSWORD)
        .env("RUST_LOG", "info");
    for (name, value) in env {
        command.env(name, value);
    }
    let output = command.output().unwrap();
    let text = text(&output);
    assert!(
        !text.to_lowercase().contains("permissions violation"),
        "dlq {args:?}: {text}"
    );
    output
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Whether a line of `output` is `start`, an age, `end`.
fn has_line(output: &str, start: &str, end: &str) -> bool {
    output
        .lines()
        .any(|line| line.starts_with(start) && line.ends_with(end))
}

fn succeeded(output: &Output) -> String {
    assert!(output.status.success(), "{}", text(output));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn failed(output: &Output) -> String {
    assert_eq!(output.status.code(), Some(1), "{}", text(output));
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A dead letter of `consumer` as the service would store it; its DLQ sequence.
async fn dead_letter(
    admin: &Context,
    topology: &Topology,
    consumer: &str,
    subject: &str,
    reason: DeadLetterReason,
    original_sequence: u64,
) -> u64 {
    let mut headers = HeaderMap::new();
    let id = format!("m-{original_sequence}");
    headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
    let origin = Origin {
        subject,
        stream: &topology.stream,
        stream_sequence: original_sequence,
        deliveries: 1,
    };
    DeadLetters::new(admin.clone(), topology, consumer)
        .publish(
            &origin,
            Some(&headers),
            format!("{{\"message_id\": \"{id}\"}}").into(),
            reason,
            "a test's dead letter",
        )
        .await
        .unwrap()
        .sequence
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_user_lists_deletes_and_replays_and_may_not_publish_elsewhere() {
    let config = format!(
        "authorization {{\n  users = [\n    {{ user: admin, password: \"{ADMIN_PASSWORD}\" }}\n{}\n  ]\n}}\n",
        OPERATOR_USER.replace(
            "$INVENTORY_OPERATOR_NATS_PASSWORD",
            &format!("\"{PASSWORD}\"")
        )
    );
    let server = NatsServer::start_with_config(&config).await;
    let admin = connect(&server, "admin", ADMIN_PASSWORD).await;
    let topology = Topology::default();
    jetstream::ensure_streams(&admin, &topology).await.unwrap();
    jetstream::ensure_prefix_stream(&admin, &topology.events_stream())
        .await
        .unwrap();
    let placed = topology.subject(EventKind::Placed);
    // As producers publish a placement now: on its book's subject.
    let placed_by_book = format!("{placed}.0190f5c4-3c2e-7b4a-9d3e-bbbbbbbbbbbb");
    let consumer = "inventory-reserve-stock";
    let unknown = dead_letter(
        &admin,
        &topology,
        consumer,
        &placed_by_book,
        DeadLetterReason::UnknownBook,
        1,
    )
    .await;
    let malformed = dead_letter(
        &admin,
        &topology,
        consumer,
        &placed,
        DeadLetterReason::Malformed,
        2,
    )
    .await;
    let invalid = dead_letter(
        &admin,
        &topology,
        consumer,
        &topology.subject(EventKind::Cancelled),
        DeadLetterReason::Invalid,
        3,
    )
    .await;
    let email = dead_letter(
        &admin,
        &topology,
        EMAIL_CONSUMER,
        "inventory.stock.reserved",
        DeadLetterReason::NeedsReconciliation,
        4,
    )
    .await;
    let counts = || async {
        (
            stream_messages(&admin, &topology.dlq_stream).await,
            stream_messages(&admin, &topology.stream).await,
            stream_messages(&admin, &topology.events_stream).await,
        )
    };
    assert_eq!(counts().await, (4, 0, 0));

    // Listing.
    let listed: serde_json::Value =
        serde_json::from_str(&succeeded(&dlq(&server, &["list", "--json"], &[]))).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 4, "{listed}");
    assert_eq!(listed[0]["body"], "{\"message_id\": \"m-1\"}", "{listed}");
    assert_eq!(
        listed[0]["headers"]["Dlq-Reason"], "unknown-book",
        "{listed}"
    );

    // Deleting: a dry run first, then the delete; one line per letter and a total.
    let dry = succeeded(&dlq(
        &server,
        &["delete", "--reason", "malformed", "--dry-run"],
        &[],
    ));
    assert!(
        has_line(
            &dry,
            &format!("would delete dead letter {malformed} (malformed, "),
            &format!(" old): consumer {consumer}, original subject {placed}")
        ),
        "{dry}"
    );
    assert!(
        dry.contains("would delete 1 dead letter; --dry-run: nothing deleted"),
        "{dry}"
    );
    assert_eq!(counts().await, (4, 0, 0));
    let deleted = succeeded(&dlq(
        &server,
        &["delete", "--seq", &malformed.to_string()],
        &[],
    ));
    assert!(
        has_line(
            &deleted,
            &format!("deleted dead letter {malformed} (malformed, "),
            &format!(" old): consumer {consumer}, original subject {placed}")
        ),
        "{deleted}"
    );
    assert!(deleted.contains("deleted 1 dead letter\n"), "{deleted}");
    assert_eq!(counts().await, (3, 0, 0));
    let missing = failed(&dlq(
        &server,
        &["delete", "--seq", &malformed.to_string()],
        &[],
    ));
    assert!(
        missing.contains(&format!(
            "no dead letter with sequence [{malformed}] in the DLQ"
        )),
        "{missing}"
    );

    // A replay's dry run: what it would publish, under which id; nothing published.
    let dry = succeeded(&dlq(
        &server,
        &["replay", "--reason", "unknown-book", "--dry-run"],
        &[],
    ));
    assert!(
        has_line(
            &dry,
            &format!("would replay dead letter {unknown} (unknown-book, "),
            &format!(" old) to {placed_by_book} as m-1:replay:{unknown}")
        ),
        "{dry}"
    );
    assert!(
        dry.contains("would replay 1 dead letter; --dry-run: nothing published or deleted"),
        "{dry}"
    );
    assert_eq!(counts().await, (3, 0, 0));

    // Past the replay allowance (from the environment, as every flag of dlq): refused whole.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let both = [
        "replay",
        "--seq",
        &unknown.to_string(),
        "--seq",
        &email.to_string(),
    ];
    let refused = failed(&dlq(
        &server,
        &both,
        &[("INVENTORY_REPLAY_ALLOWANCE", "1s")],
    ));
    assert!(
        refused.contains(&format!(
            "refusing to replay: dead letters {unknown} (unknown-book, "
        )) && refused.contains(&format!("{email} (needs-reconciliation, "))
            && refused.contains("older than the replay allowance 1s")
            && refused.contains("Nothing was replayed")
            && refused.contains("--force"),
        "{refused}"
    );
    assert_eq!(counts().await, (3, 0, 0));

    // Forced: both replayed, to their own subjects, and said so.
    let mut forced = both.to_vec();
    forced.extend(["--replay-allowance", "1s", "--force"]);
    let replayed = succeeded(&dlq(&server, &forced, &[]));
    assert!(
        replayed.contains(&format!("replayed dead letter {unknown} (unknown-book, "))
            && replayed.contains(&format!(
                "to {placed_by_book} as m-1:replay:{unknown} -> stored as sequence 1"
            ))
            && replayed.contains("to inventory.stock.reserved as m-4:replay:")
            && replayed
                .matches(" (forced: past the replay allowance 1s)\n")
                .count()
                == 2
            && replayed.contains("replayed 2 dead letters"),
        "{replayed}"
    );
    assert_eq!(counts().await, (1, 1, 1));
    let left: serde_json::Value =
        serde_json::from_str(&succeeded(&dlq(&server, &["list", "--json"], &[]))).unwrap();
    assert_eq!(left[0]["seq"], invalid, "{left}");

    // What the operator may not do: publish anywhere else, or touch the orders stream.
    let operator = connect(&server, OPERATOR, PASSWORD).await;
    for subject in [
        "dlq.inventory-reserve-stock",
        "inventory.stock.released",
        "orders.other",
    ] {
        let published = async {
            operator
                .publish(subject, "{}".into())
                .await?
                .await
                .map(drop)
                .map_err(|error| error.to_string().into())
        };
        let refused: Result<(), Box<dyn std::error::Error>> = published.await;
        assert!(refused.is_err(), "the operator published to {subject}");
    }
    let orders = operator.get_stream_no_info(&topology.stream).await.unwrap();
    assert!(
        orders.delete_message(1).await.is_err(),
        "the operator deleted a message of the orders stream"
    );
    assert!(
        operator.get_stream(&topology.stream).await.is_err(),
        "the operator read the orders stream's info"
    );
    assert_eq!(counts().await, (1, 1, 1));
}
