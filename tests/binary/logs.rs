//! `--log-format json`: one JSON object a line on stderr, each with its level, target and
//! message, and each line of a message's handling with the message span's fields (its id, its
//! stream sequence, its delivery count), as a log collector indexes them.

use inventory_tests::binary::{BinaryRun, stop};

const BOOK: &str = "0190f5c4-3c2e-7b4a-9d3e-eeeeeeeeeeee";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_are_one_object_a_line_with_the_message_span() {
    let run = BinaryRun::new("inventory_logs", "info,sqlx=warn").await;
    run.put_stock(BOOK, "Dune", 10);
    let service = run.spawn(&["serve", "--strategy", "natural", "--log-format", "json"]);
    run.run(&[
        "publish",
        "placed",
        "--book-id",
        BOOK,
        "--quantity",
        "2",
        "--message-id",
        "json-log-1",
    ]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while run
        .db
        .reserved(inventory_domain::BookId::parse(BOOK).unwrap())
        .await
        != 2
    {
        assert!(std::time::Instant::now() < deadline, "never reserved");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let (status, log) = stop(service);
    assert!(status.success(), "{log}");
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|error| panic!("{error}: {line:?}")))
        .collect();
    assert!(lines.len() > 5, "{log}");
    for line in &lines {
        for key in ["timestamp", "level", "target", "message"] {
            assert!(line[key].is_string(), "no {key}: {line}");
        }
    }
    let acked = lines
        .iter()
        .find(|line| line["message"] == "acked")
        .unwrap_or_else(|| panic!("no ack logged:\n{log}"));
    let span = acked["spans"]
        .as_array()
        .and_then(|spans| spans.iter().find(|span| span["name"] == "message"))
        .unwrap_or_else(|| panic!("no message span: {acked}"));
    assert_eq!(span["message_id"], "json-log-1", "{acked}");
    assert_eq!(span["stream_seq"], 1, "{acked}");
    assert_eq!(span["delivered"], 1, "{acked}");
    assert_eq!(acked["outcome"], "processed", "{acked}");
}
