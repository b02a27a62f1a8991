//! The shipped alerting rules in a real Prometheus (Debian's, which `scripts/test.sh` installs)
//! scraping a real `serve` every second: the same-key alarm fires on the first conflicting
//! reservation, and `InventoryDown` once the process is gone. promtool's unit tests cannot show
//! the first: a counter whose series appears at 1 has no increase, and only a live scrape of the
//! process says where its series start.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use inventory_tests::binary::{BinaryRun, free_port, http_get};

const BOOK: &str = "0190f5c4-3c2e-7b4a-9d3e-cccccccccccc";
const ORDER: &str = "0190f5c4-3c2e-7b4a-9d3e-dddddddddddd";

/// A Prometheus of the test's own, with a data directory removed when it is dropped.
struct Prometheus {
    process: Child,
    port: u16,
    dir: PathBuf,
}

impl Prometheus {
    /// Scrapes `target` as job `inventory` every second and evaluates `rules` every second.
    fn start(target: &str, rules: &Path) -> Self {
        let dir =
            std::env::temp_dir().join(format!("inventory-prometheus-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\n\
                 scrape_configs:\n  - job_name: inventory\n    static_configs:\n      - targets: ['{target}']\n",
                rules.display()
            ),
        )
        .unwrap();
        let port = free_port();
        let process = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus, from Debian's prometheus package (scripts/test.sh installs it)");
        Self { process, port, dir }
    }

    /// `GET /api/v1/<path>`'s `data`, once Prometheus answers.
    fn api(&self, path: &str) -> Option<serde_json::Value> {
        let (status, body) = http_get(self.port, &format!("/api/v1/{path}"))?;
        let body: serde_json::Value = serde_json::from_str(&body).ok()?;
        (status == 200).then(|| body["data"].clone())
    }

    /// The instant query's result vector (empty while Prometheus starts).
    fn query(&self, promql: &str) -> Vec<serde_json::Value> {
        let encoded: String = promql
            .bytes()
            .map(|byte| match byte {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'.' | b'-' => {
                    char::from(byte).to_string()
                }
                byte => format!("%{byte:02X}"),
            })
            .collect();
        self.api(&format!("query?query={encoded}"))
            .and_then(|data| data["result"].as_array().cloned())
            .unwrap_or_default()
    }

    /// The alerts named `name` in state `firing`.
    fn firing(&self, name: &str) -> Vec<serde_json::Value> {
        self.api("alerts")
            .and_then(|data| data["alerts"].as_array().cloned())
            .unwrap_or_default()
            .into_iter()
            .filter(|alert| alert["labels"]["alertname"] == name && alert["state"] == "firing")
            .collect()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Polls `check` every 250 ms until it gives `Some`, or fails the test after `limit`.
async fn within<T>(limit: Duration, what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(found) = check() {
            return found;
        }
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_fires_the_same_key_alarm_at_once_and_inventory_down_when_it_is_gone() {
    let rules = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/prometheus/alerts.yml");
    let run = BinaryRun::new("inventory_prometheus", "info,sqlx=warn").await;
    run.put_stock(BOOK, "Dune", 10);
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut service = run.spawn(&["serve", "--strategy", "natural", "--metrics-addr", &addr]);
    let prometheus = Prometheus::start(&addr, &rules);
    // A scrape during serve's set-up finds no dependency checked yet (`/readyz` says
    // "starting"); on a loaded machine the first scrapes can all come then.
    within(Duration::from_secs(60), "the first scrape of serve once set up", || {
        prometheus
            .query("up{job=\"inventory\"} == 1 and on() inventory_dependency_up{dependency=\"database\"} == 1")
            .first()
            .cloned()
    })
    .await;
    // The counter's series exists at 0 before anything happened.
    let before = prometheus.query(
        "inventory_dead_letters_total{reason=\"conflicting-reservation\",consumer=\"inventory-reserve-stock\"}",
    );
    assert_eq!(before.len(), 1, "{before:?}");
    assert!(prometheus.firing("InventoryDown").is_empty());
    // What an on-call reads beside the alerts: the build, the process, the dependencies.
    for present in [
        "inventory_build_info{version!=\"\",commit!=\"\"} == 1",
        "process_resident_memory_bytes > 0",
        "process_open_fds > 0",
        "inventory_dependency_up{dependency=\"database\"} == 1",
        "inventory_dependency_up{dependency=\"nats\"} == 1",
        "inventory_lanes > 0",
        "inventory_consumer_max_ack_pending == 1000",
    ] {
        let found = prometheus.query(present);
        assert_eq!(found.len(), 1, "{present}: {found:?}");
    }

    // An order of 2, then the same order resent under a new message id with 3: the natural key
    // refuses it as a conflicting reservation, a dead letter.
    let placed = ["publish", "placed", "--book-id", BOOK, "--order-id", ORDER];
    run.run(&[&placed[..], &["--quantity", "2"]].concat());
    run.run(&[&placed[..], &["--quantity", "3"]].concat());
    // Seen as an increase at once: the series was there, at 0, before its first event.
    within(Duration::from_secs(20), "the dead letter's increase", || {
        prometheus
            .query("increase(inventory_dead_letters_total{reason=\"conflicting-reservation\"}[1m]) > 0")
            .first()
            .cloned()
    })
    .await;
    let alarm = within(
        Duration::from_secs(20),
        "InventorySameKeyDifferentContent firing",
        || {
            prometheus
                .firing("InventorySameKeyDifferentContent")
                .first()
                .cloned()
        },
    )
    .await;
    assert_eq!(
        alarm["labels"]["reason"], "conflicting-reservation",
        "{alarm}"
    );
    assert_eq!(
        alarm["labels"]["consumer"], "inventory-reserve-stock",
        "{alarm}"
    );
    assert_eq!(alarm["labels"]["job"], "inventory", "{alarm}");
    assert_eq!(alarm["labels"]["severity"], "critical", "{alarm}");

    // The process gone: no target of the job is up, and after the rule's minute it fires.
    let _ = service.kill();
    let _ = service.wait();
    within(Duration::from_secs(120), "InventoryDown firing", || {
        prometheus.firing("InventoryDown").first().cloned()
    })
    .await;
}

/// The rules follow the conventions of kube-prometheus's mixins: each alert has a severity of
/// `critical` or `warning`, a `runbook_url` whose anchor is a heading of docs/runbooks.md, and
/// every aggregation keeps `cluster`, `namespace` and `job`.
#[test]
fn every_alert_has_a_severity_a_runbook_that_exists_and_keeps_its_environment_labels() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let rules = std::fs::read_to_string(root.join("deploy/prometheus/alerts.yml")).unwrap();
    let runbooks = std::fs::read_to_string(root.join("docs/runbooks.md")).unwrap();
    // GitHub's anchors: the heading lowercased, punctuation dropped, spaces to hyphens.
    let anchors: Vec<String> = runbooks
        .lines()
        .filter_map(|line| {
            line.trim_start_matches('#')
                .strip_prefix(' ')
                .filter(|_| line.starts_with('#'))
        })
        .map(|heading| {
            heading
                .to_lowercase()
                .chars()
                .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
                .map(|c| if c == ' ' { '-' } else { c })
                .collect()
        })
        .collect();
    let alerts: Vec<&str> = rules.split("- alert: ").skip(1).collect();
    assert!(alerts.len() >= 15, "{} alerts", alerts.len());
    for alert in alerts {
        let name = alert.lines().next().unwrap_or_default().trim();
        let field = |key: &str| {
            alert
                .lines()
                .find_map(|line| line.trim().strip_prefix(key))
                .map(str::trim)
                .unwrap_or_else(|| panic!("{name} has no {key}"))
        };
        assert!(
            ["critical", "warning"].contains(&field("severity:")),
            "{name}"
        );
        let runbook = field("runbook_url:");
        let anchor = runbook
            .strip_prefix("docs/runbooks.md#")
            .unwrap_or_else(|| panic!("{name}: {runbook}"));
        assert_eq!(anchor, name.to_lowercase(), "{name}: its own section");
        assert!(
            anchors.iter().any(|known| known == anchor),
            "{name}: no heading for #{anchor}"
        );
        for (at, _) in alert.match_indices(" by (") {
            let labels = &alert[at + 5..];
            let labels = &labels[..labels.find(')').unwrap_or(labels.len())];
            for kept in ["cluster", "namespace", "job"] {
                assert!(labels.contains(kept), "{name}: by ({labels}) drops {kept}");
            }
        }
    }
}
