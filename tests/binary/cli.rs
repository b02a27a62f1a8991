//! The binary's outside contract: commands, exit codes, output.

use std::path::PathBuf;
use std::process::{Command, Output};

fn inventory(args: &[&str], database_url: &str) -> Output {
    Command::new(inventory_tests::binary::inventory())
        .args(args)
        .env("DATABASE_URL", database_url)
        .env_remove("RUST_LOG")
        .output()
        .expect("the inventory binary runs")
}

struct SqliteFile(PathBuf);

impl SqliteFile {
    fn new() -> Self {
        Self(std::env::temp_dir().join(format!("inventory-cli-{}.db", uuid::Uuid::new_v4())))
    }

    fn url(&self) -> String {
        format!("sqlite://{}?mode=rwc", self.0.display())
    }
}

impl Drop for SqliteFile {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let mut path = self.0.clone().into_os_string();
            path.push(suffix);
            let _ = std::fs::remove_file(path);
        }
    }
}

#[test]
fn usage_errors_exit_with_2() {
    let db = SqliteFile::new();
    let output = inventory(&["stock", "put", "--book-id", "not-a-uuid"], &db.url());
    assert_eq!(output.status.code(), Some(2));
    let output = inventory(&["no-such-command"], &db.url());
    assert_eq!(output.status.code(), Some(2));
}

#[test]
fn stock_put_then_list_as_json() {
    let db = SqliteFile::new();
    let book = "0190f5c4-3c2e-7b4a-9d3e-aaaaaaaaaaaa";
    let put = inventory(
        &[
            "stock",
            "put",
            "--book-id",
            book,
            "--title",
            "Dune",
            "--on-hand",
            "10",
        ],
        &db.url(),
    );
    assert!(put.status.success(), "{put:?}");
    let list = inventory(&["stock", "list", "--json"], &db.url());
    assert!(list.status.success(), "{list:?}");
    let rows: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(
        rows,
        serde_json::json!([{
            "book_id": book, "title": "Dune", "on_hand": 10, "reserved": 0, "available": 10
        }])
    );
    let table = inventory(&["stock", "list"], &db.url());
    let table = String::from_utf8(table.stdout).unwrap();
    assert!(table.lines().nth(1).unwrap().contains("Dune"), "{table}");
}

#[test]
fn invalid_stock_is_a_runtime_error_with_a_message() {
    let db = SqliteFile::new();
    let output = inventory(
        &[
            "stock",
            "put",
            "--book-id",
            "0190f5c4-3c2e-7b4a-9d3e-aaaaaaaaaaaa",
            "--title",
            "Dune",
            "--on-hand=-1",
        ],
        &db.url(),
    );
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(stderr.contains("on_hand"), "{stderr}");
}

#[test]
fn migrate_applies_the_schema() {
    let db = SqliteFile::new();
    let output = inventory(&["migrate"], &db.url());
    assert!(output.status.success(), "{output:?}");
    // A second run finds nothing to do.
    assert!(inventory(&["migrate"], &db.url()).status.success());
}

#[test]
fn demo_exits_zero_on_embedded_sqlite() {
    let output = Command::new(inventory_tests::binary::inventory())
        .arg("demo")
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(output.status.success(), "{stdout}");
    assert_eq!(
        documented_demo_output(),
        stdout,
        "docs/study.md's demo output is not the binary's: update it"
    );
    let natural_row = stdout
        .lines()
        .find(|line| line.starts_with("natural key  "))
        .expect("the table's natural key row");
    let cells: Vec<&str> = natural_row["natural key".len()..]
        .split_whitespace()
        .collect();
    assert_eq!(cells, ["2", "2", "2", "2"], "{stdout}");
}

/// The block docs/study.md shows as the output of `inventory demo`: the first `text` block
/// after the line that says so.
fn documented_demo_output() -> String {
    let study = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/study.md"))
        .expect("docs/study.md");
    let (_, after) = study
        .split_once("Output of `target/release/inventory demo`")
        .expect("docs/study.md shows the demo's output");
    let (_, block) = after.split_once("```text\n").expect("a text block");
    let (output, _) = block.split_once("```").expect("the block ends");
    output.to_owned()
}

#[test]
fn help_never_shows_a_secret_from_the_environment() {
    let output = inventory(
        &["stock", "list", "--help"],
        "postgres://inventory:s3cret@db/stock",
    );
    let help = String::from_utf8(output.stdout).unwrap();
    assert!(help.contains("DATABASE_URL"), "{help}");
    assert!(!help.contains("s3cret"), "{help}");
}

#[test]
fn inbox_purge_reports_what_it_did() {
    let db = SqliteFile::new();
    let dry = inventory(
        &["inbox", "purge", "--older-than", "7d", "--dry-run"],
        &db.url(),
    );
    assert!(dry.status.success(), "{dry:?}");
    let stdout = String::from_utf8(dry.stdout).unwrap();
    assert!(
        stdout.starts_with("would delete 0 completed inbox rows older than 7days"),
        "{stdout}"
    );
    let real = inventory(
        &[
            "inbox",
            "purge",
            "--older-than",
            "36h",
            "--batch-size",
            "500",
        ],
        &db.url(),
    );
    assert!(
        String::from_utf8(real.stdout)
            .unwrap()
            .starts_with("deleted 0")
    );
    let bad = inventory(&["inbox", "purge", "--older-than", "soon"], &db.url());
    assert_eq!(bad.status.code(), Some(2));
}

/// `--version` names the release, the commit the binary was built from and the build's date,
/// so a running instance can be traced to its source.
#[test]
fn version_names_the_commit_and_the_build_date() {
    let output = Command::new(inventory_tests::binary::inventory())
        .arg("--version")
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let version = String::from_utf8(output.stdout).unwrap();
    let head = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let head = String::from_utf8(head.stdout).unwrap();
    let (_, date) = version
        .trim_end()
        .strip_suffix(')')
        .and_then(|rest| rest.rsplit_once(", built "))
        .unwrap_or_else(|| panic!("no build date in {version:?}"));
    assert!(
        version.starts_with(&format!(
            "inventory {} (commit {}, built ",
            env!("CARGO_PKG_VERSION"),
            head.trim()
        )),
        "{version:?}, HEAD {head:?}"
    );
    assert!(
        date.len() == 10 && date.as_bytes()[4] == b'-' && date.as_bytes()[7] == b'-',
        "{date:?}"
    );
}
