//! What `deploy/` ships for operators: the Prometheus alerting rules, checked and unit-tested
//! by promtool, and every metric the rules and the Grafana dashboard name exported by a live
//! `serve`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use inventory_tests::binary::{BinaryRun, free_port, http_get, stop};

const BOOK: &str = "0190f5c4-3c2e-7b4a-9d3e-aaaaaaaaaaaa";

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// `promtool <args>` in `deploy/prometheus`; it must succeed.
fn promtool(args: &[&str]) {
    let output = Command::new("promtool")
        .args(args)
        .current_dir(deploy_dir().join("prometheus"))
        .output()
        .expect(
            "promtool, from Debian's prometheus package (scripts/test.sh installs it when absent)",
        );
    assert!(
        output.status.success(),
        "promtool {args:?}:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn the_alerting_rules_pass_promtool_check_and_their_unit_tests() {
    promtool(&["check", "rules", "alerts.yml"]);
    promtool(&["test", "rules", "alerts_test.yml"]);
}

/// Every `inventory_…` metric family the files under `deploy/` name; a histogram's series
/// (`_bucket`, `_sum`, `_count`) count as their family.
fn metrics_named_in_deploy() -> BTreeSet<String> {
    let files = [
        "prometheus/alerts.yml",
        "prometheus/alerts_test.yml",
        "grafana/inventory.json",
    ];
    let mut names = BTreeSet::new();
    for file in files {
        let text = std::fs::read_to_string(deploy_dir().join(file)).unwrap();
        if file.ends_with(".json") {
            serde_json::from_str::<serde_json::Value>(&text).expect("the dashboard is JSON");
        }
        let mut rest = text.as_str();
        while let Some(start) = rest.find("inventory_") {
            let name: String = rest[start..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            rest = &rest[start + name.len()..];
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix))
                .unwrap_or(&name);
            names.insert(family.to_owned());
        }
    }
    names
}

/// The metric families a scrape declares (`# TYPE <name> <type>`).
fn families(scrape: &str) -> BTreeSet<String> {
    scrape
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_rules_and_the_dashboard_name_is_exported() {
    let named = metrics_named_in_deploy();
    assert!(named.len() >= 10, "{named:?}");

    let run = BinaryRun::new("inventory_deploy", "info,sqlx=warn").await;
    run.put_stock(BOOK, "Dune", 10);
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let service = run.spawn(&["serve", "--strategy", "natural", "--metrics-addr", &addr]);
    // A reservation (messages, handling time, the relay's counts) and a dead letter, so the
    // labelled families have a series to show.
    run.run(&["publish", "placed", "--book-id", BOOK, "--quantity", "1"]);
    run.publish_for_unknown_book();

    let deadline = Instant::now() + Duration::from_secs(30);
    let missing = loop {
        let exported = http_get(port, "/metrics")
            .map(|(_, scrape)| families(&scrape))
            .unwrap_or_default();
        let missing: Vec<&String> = named.difference(&exported).collect();
        if missing.is_empty() || Instant::now() > deadline {
            break missing.into_iter().cloned().collect::<Vec<_>>();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let (status, log) = stop(service);
    assert!(status.success(), "{log}");
    assert!(
        missing.is_empty(),
        "named in deploy/ but not exported: {missing:?}"
    );
}
