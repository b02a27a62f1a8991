//! One configuration: every setting of the service's commands from the environment
//! (`INVENTORY_<FLAG>`, a secret from a file), `--print-config` with
//! every secret masked, one reading of booleans, and the embedded database refused or announced.
//! Each run starts from an empty environment, so that nothing of the test's own leaks in.

use std::process::{Command, Output};

use inventory_tests::binary::inventory;

/// `inventory <args>` with only `env` (and `PATH`) in its environment, in the temporary
/// directory (where an embedded database would land).
fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(inventory())
        .args(args)
        .current_dir(std::env::temp_dir())
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .envs(env.iter().copied())
        .output()
        .expect("the inventory binary runs")
}

fn stdout(output: &Output) -> String {
    assert!(output.status.success(), "{output:?}");
    String::from_utf8(output.stdout.clone()).expect("UTF-8")
}

/// `--print-config`'s line for `long`.
fn setting<'a>(printed: &'a str, long: &str) -> &'a str {
    printed
        .lines()
        .find(|line| line.starts_with(&format!("{long} =")))
        .unwrap_or_else(|| panic!("no {long} in\n{printed}"))
}

/// Every option `--help` lists (but `--help`, `--version`, `--print-config` and `--config`'s own
/// global flag, which has its variable too) with the environment variables it names.
fn options_and_variables(help: &str) -> Vec<(String, Option<String>)> {
    let mut options: Vec<(String, Option<String>)> = Vec::new();
    for line in help.lines() {
        let line = line.trim_start();
        if let Some(rest) = line.strip_prefix("--") {
            let flag = rest.split([' ', '=']).next().unwrap_or_default().to_owned();
            options.push((flag, None));
        }
        // Beside the option in a short help, on a line of its own in a long one.
        if let Some((_, rest)) = line.split_once("[env: ") {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || *c == '_')
                .collect();
            if let Some(last) = options.last_mut() {
                last.1 = Some(name);
            }
        }
    }
    // What decides one run is no setting: never from the environment (service/src/config.rs).
    options.retain(|(flag, _)| {
        ![
            "help",
            "version",
            "print-config",
            "force",
            "dry-run",
            "seq",
            "reason",
            "older-than",
            "json",
        ]
        .contains(&flag.as_str())
    });
    options
}

#[test]
fn every_option_of_the_service_commands_names_its_environment_variable() {
    // The program's own help lists the NATS and stream flags, once for every command.
    for command in [
        &[][..],
        &["serve"],
        &["relay"],
        &["inbox", "purge"],
        &["dlq", "list"],
        &["dlq", "replay"],
        &["dlq", "delete"],
    ] {
        let help = stdout(&run(&[command, &["--help"]].concat(), &[]));
        let options = options_and_variables(&help);
        assert!(options.len() > 1, "{command:?}: {help}");
        for (flag, variable) in options {
            let expected = match flag.as_str() {
                "database-url" | "nats-url" | "orders-database-url" => {
                    flag.to_uppercase().replace('-', "_")
                }
                flag => format!("INVENTORY_{}", flag.to_uppercase().replace('-', "_")),
            };
            assert_eq!(variable, Some(expected), "{command:?} --{flag}");
        }
    }
}

#[test]
fn print_config_masks_every_form_of_secret() {
    let secret = "Zq7-s3cret";
    let database =
        format!("postgres://inventory:{secret}@db:5432/stock?password={secret}&sslmode=require");
    let nats = format!("nats://inventory:{secret}@nats-1:4222,nats://{secret}@nats-2:4222");
    let password_file = std::env::temp_dir().join(format!("inventory-pw-{}", uuid::Uuid::new_v4()));
    std::fs::write(&password_file, format!("{secret}\n")).unwrap();
    let printed = stdout(&run(
        &[
            "relay",
            "--source",
            "orders",
            "--print-config",
            "--nats-token",
            secret,
        ],
        &[
            ("DATABASE_URL", &database),
            ("ORDERS_DATABASE_URL", &database),
            ("NATS_URL", &nats),
            ("INVENTORY_NATS_USER", "inventory"),
            (
                "INVENTORY_NATS_PASSWORD_FILE",
                password_file.to_str().unwrap(),
            ),
        ],
    ));
    let _ = std::fs::remove_file(&password_file);
    assert!(!printed.contains(secret), "{printed}");
    assert!(
        setting(&printed, "database-url")
            .contains("postgres://***@db:5432/stock?password=***&sslmode=require"),
        "{printed}"
    );
    assert!(
        setting(&printed, "orders-database-url").contains("***@db:5432"),
        "{printed}"
    );
    assert!(
        setting(&printed, "nats-url").contains("nats://***@nats-1:4222,nats://***@nats-2:4222"),
        "{printed}"
    );
    let password = setting(&printed, "nats-password");
    assert!(password.contains("\"***\""), "{printed}");
    assert!(
        password.ends_with("# env INVENTORY_NATS_PASSWORD_FILE"),
        "{printed}"
    );
    assert!(
        setting(&printed, "nats-token").ends_with("# command line"),
        "{printed}"
    );
}

/// Which dead letters a replay or a delete takes is the command line's alone: a variable left in
/// the environment must not choose them for every run, as it must not force or dry-run them.
#[test]
fn the_dead_letters_a_command_takes_are_never_read_from_the_environment() {
    for (command, variable) in [
        ("replay", ("INVENTORY_REASON", "malformed")),
        ("delete", ("INVENTORY_REASON", "malformed")),
        ("delete", ("INVENTORY_SEQ", "7")),
    ] {
        let output = run(&["dlq", command, "--dry-run"], &[variable]);
        assert_eq!(output.status.code(), Some(2), "{output:?}");
        let error = String::from_utf8_lossy(&output.stderr);
        assert!(error.contains("--seq"), "{error}");
    }
}

/// The names some flags read before the prefix was the rule were never in a release: they are
/// not read.
#[test]
fn names_without_the_prefix_are_not_read() {
    let printed = stdout(&run(
        &["serve", "--strategy", "natural", "--print-config"],
        &[("METRICS_ADDR", "127.0.0.1:9191"), ("ACK_WAIT", "5m")],
    ));
    assert!(
        setting(&printed, "metrics-addr").ends_with("# default"),
        "{printed}"
    );
    assert!(
        setting(&printed, "ack-wait").ends_with("# default"),
        "{printed}"
    );
}

#[test]
fn the_environment_is_over_the_file_and_the_command_line_over_both() {
    let file = std::env::temp_dir().join(format!("inventory-{}.toml", uuid::Uuid::new_v4()));
    std::fs::write(
        &file,
        "ack-wait = \"41s\"\nmax-deliver = 4\nreplicas = 3\nstrategy = \"inbox\"\n",
    )
    .unwrap();
    let printed = stdout(&run(
        &["serve", "--print-config", "--max-deliver", "6"],
        &[
            ("INVENTORY_CONFIG", file.to_str().unwrap()),
            ("INVENTORY_ACK_WAIT", "42s"),
        ],
    ));
    let _ = std::fs::remove_file(&file);
    assert!(
        setting(&printed, "ack-wait").contains("\"42s\""),
        "{printed}"
    );
    assert!(
        setting(&printed, "max-deliver").contains("\"6\""),
        "{printed}"
    );
    assert!(setting(&printed, "replicas").contains("\"3\""), "{printed}");
    assert!(
        setting(&printed, "replicas").contains("# file "),
        "{printed}"
    );
    assert!(
        setting(&printed, "strategy").contains("\"inbox\""),
        "{printed}"
    );
}

#[test]
fn booleans_read_the_same_words_from_every_variable() {
    for word in ["1", "yes", "true", "on"] {
        let printed = stdout(&run(
            &["serve", "--strategy", "natural", "--print-config"],
            &[
                ("INVENTORY_NATS_REQUIRE_TLS", word),
                ("INVENTORY_SKIP_MIGRATIONS", word),
                ("INVENTORY_UPDATE_CONSUMER", word),
            ],
        ));
        for long in ["nats-require-tls", "skip-migrations", "update-consumer"] {
            assert!(
                setting(&printed, long).starts_with(&format!("{long} = true ")),
                "{word}: {printed}"
            );
        }
    }
    let printed = stdout(&run(
        &["serve", "--strategy", "natural", "--print-config"],
        &[("INVENTORY_SKIP_MIGRATIONS", "0")],
    ));
    assert!(
        setting(&printed, "skip-migrations").starts_with("skip-migrations = false "),
        "{printed}"
    );
}

#[test]
fn a_secret_given_twice_or_a_bad_value_is_a_usage_error() {
    let file = std::env::temp_dir().join(format!("inventory-url-{}", uuid::Uuid::new_v4()));
    std::fs::write(&file, "postgres://db/stock\n").unwrap();
    let twice = run(
        &["serve", "--strategy", "natural", "--print-config"],
        &[
            ("DATABASE_URL", "postgres://db/other"),
            ("INVENTORY_DATABASE_URL_FILE", file.to_str().unwrap()),
        ],
    );
    let _ = std::fs::remove_file(&file);
    assert_eq!(twice.status.code(), Some(2), "{twice:?}");
    assert!(
        String::from_utf8_lossy(&twice.stderr).contains("give the secret once"),
        "{twice:?}"
    );
    let bad = run(
        &["serve", "--strategy", "natural"],
        &[("INVENTORY_REPLAY_ALLOWANCE", "a week")],
    );
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert!(
        stderr.contains("'a week'") && stderr.contains("--replay-allowance"),
        "{stderr}"
    );
}

#[test]
fn serve_refuses_the_embedded_database_when_told_to_require_one() {
    // Were the refusal missing, no NATS at this address stops the process all the same.
    let refused = run(
        &["serve", "--strategy", "natural", "--metrics-addr", "off"],
        &[
            ("INVENTORY_REQUIRE_DATABASE_URL", "true"),
            ("NATS_URL", "nats://127.0.0.1:1"),
        ],
    );
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("no database named: set DATABASE_URL"),
        "{refused:?}"
    );
    let named = run(
        &["serve", "--strategy", "natural", "--print-config"],
        &[
            ("INVENTORY_REQUIRE_DATABASE_URL", "true"),
            ("DATABASE_URL", "sqlite://elsewhere.db"),
        ],
    );
    assert!(named.status.success(), "{named:?}");
}

/// Without DATABASE_URL, `serve` says at start which file it uses and that it is its own.
#[test]
fn serve_on_the_embedded_database_warns_that_it_is_its_own() {
    let dir = std::env::temp_dir().join(format!("inventory-embedded-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    // No NATS at this address: the process stops at its connection, after the warning.
    let output = Command::new(inventory())
        .args(["serve", "--strategy", "natural", "--metrics-addr", "off"])
        .args([
            "--nats-url",
            "nats://127.0.0.1:1",
            "--nats-connect-timeout",
            "1s",
        ])
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .current_dir(&dir)
        .output()
        .expect("the inventory binary runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(stderr.contains("WARN"), "{stderr}");
    assert!(stderr.contains("no DATABASE_URL"), "{stderr}");
    assert!(
        stderr.contains(&dir.join("inventory.db").display().to_string()),
        "{stderr}"
    );
    assert!(stderr.contains("this process's own"), "{stderr}");
    assert!(!output.status.success(), "no NATS there: {stderr}");
}

/// `--force` and `--dry-run` decide one run of an operator's command: a variable left in the
/// environment never decides them.
#[test]
fn force_and_dry_run_are_never_read_from_the_environment() {
    for command in [
        &["inbox", "purge"][..],
        &["dlq", "replay"],
        &["dlq", "delete"],
    ] {
        let help = stdout(&run(&[command, &["--help"]].concat(), &[]));
        assert!(!help.contains("INVENTORY_FORCE"), "{command:?}: {help}");
        assert!(!help.contains("INVENTORY_DRY_RUN"), "{command:?}: {help}");
    }
}

/// `serve` with a study handler runs in the study binary, which reads its settings from the
/// same layers: its own flags (`--inbox-retention`) and the service's (`--ack-wait`) alike.
#[test]
fn serve_with_a_study_handler_reads_the_same_layers() {
    let printed = stdout(&run(
        &["serve", "--strategy", "inbox", "--print-config"],
        &[
            ("INVENTORY_INBOX_RETENTION", "30days"),
            ("INVENTORY_ACK_WAIT", "45s"),
        ],
    ));
    assert!(
        setting(&printed, "strategy").starts_with("strategy = \"inbox\""),
        "{printed}"
    );
    for (long, value, variable) in [
        ("inbox-retention", "30days", "INVENTORY_INBOX_RETENTION"),
        ("ack-wait", "45s", "INVENTORY_ACK_WAIT"),
    ] {
        let line = setting(&printed, long);
        assert!(line.contains(&format!("\"{value}\"")), "{printed}");
        assert!(line.ends_with(&format!("# env {variable}")), "{printed}");
    }
}
