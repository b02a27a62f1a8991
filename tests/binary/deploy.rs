//! What `deploy/` ships for operators: the Prometheus alerting rules, checked and unit-tested
//! by promtool, and every metric the rules and the Grafana dashboard name exported by a live
//! `serve`; the Kustomize base (`deploy/kubernetes`, rendered by `kubectl kustomize`) and the
//! systemd unit (`deploy/systemd`, checked by `systemd-analyze`), held to what the binary's
//! `--help` says it reads and defaults to.

use std::collections::BTreeSet;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use inventory_tests::binary::{BinaryRun, free_port, http_get, inventory, stop};
use serde_json::Value;

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
    // The service, and the study's inbox beside it for the inbox purge's series.
    let ports = [free_port(), free_port()];
    let addrs = ports.map(|port| format!("127.0.0.1:{port}"));
    let services = [
        run.spawn(&[
            "serve",
            "--strategy",
            "natural",
            "--metrics-addr",
            &addrs[0],
        ]),
        run.spawn(&["serve", "--strategy", "inbox", "--metrics-addr", &addrs[1]]),
    ];
    // A reservation (messages, handling time, the relay's counts) and a dead letter, so the
    // labelled families have a series to show.
    run.run(&["publish", "placed", "--book-id", BOOK, "--quantity", "1"]);
    run.publish_for_unknown_book();

    let deadline = Instant::now() + Duration::from_secs(30);
    let missing = loop {
        let exported: BTreeSet<String> = ports
            .iter()
            .filter_map(|port| http_get(*port, "/metrics"))
            .flat_map(|(_, scrape)| families(&scrape))
            .collect();
        let missing: Vec<&String> = named.difference(&exported).collect();
        if missing.is_empty() || Instant::now() > deadline {
            break missing.into_iter().cloned().collect::<Vec<_>>();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for service in services {
        let (status, log) = stop(service);
        assert!(status.success(), "{log}");
    }
    assert!(
        missing.is_empty(),
        "named in deploy/ but not exported: {missing:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// The binary's own word: `--help` names every environment variable a command reads
// (`[env: NAME=]`) and every default (`[default: …]`).

/// `inventory <command…> --help`, with an empty environment (so no value is shown and none
/// changes a default).
fn help(command: &[&str]) -> String {
    let output = Command::new(inventory())
        .args(command)
        .arg("--help")
        .env_clear()
        .output()
        .expect("the inventory binary runs");
    assert!(output.status.success(), "{command:?} --help: {output:?}");
    String::from_utf8(output.stdout).unwrap()
}

/// The variables `--help` names, `[env: NAME]` or `[env: NAME=value]`.
fn env_names(help: &str) -> BTreeSet<String> {
    help.match_indices("[env: ")
        .map(|(at, tag)| {
            help[at + tag.len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}

/// The `[default: …]` that `--help` prints under the option `flag` (`--metrics-addr`).
fn help_default(help: &str, flag: &str) -> String {
    let mut in_flag = false;
    for line in help.lines() {
        // An option's first line is indented by at most 6 spaces and starts with '-'; its
        // description lines are indented further.
        let indent = line.len() - line.trim_start().len();
        if line.trim_start().starts_with('-') && indent <= 6 {
            in_flag = line.split([',', ' ', '=']).any(|word| word == flag);
            continue;
        }
        if in_flag && let Some(rest) = line.trim().strip_prefix("[default: ") {
            return rest.trim_end_matches(']').to_owned();
        }
    }
    panic!("`--help` prints no default for {flag}:\n{help}")
}

/// Seconds in a duration as the binary writes them (humantime: `20s`, `1m 30s`, `500ms`).
fn seconds(duration: &str) -> f64 {
    let mut total = 0.0;
    for part in duration.split_whitespace() {
        let digits = part
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(part.len());
        let (number, unit) = part.split_at(digits);
        let number: f64 = number
            .parse()
            .unwrap_or_else(|_| panic!("a duration: {duration:?}"));
        let scale = match unit {
            "ms" | "msec" => 0.001,
            "s" | "sec" | "secs" | "second" | "seconds" => 1.0,
            "m" | "min" | "mins" | "minute" | "minutes" => 60.0,
            "h" | "hr" | "hrs" | "hour" | "hours" => 3600.0,
            _ => panic!("a duration unit this test knows: {duration:?}"),
        };
        total += number * scale;
    }
    total
}

/// Whether a variable the deployment sets is one the command reads: named by `--help`, or
/// `NAME_FILE` for a `NAME` it reads (`INVENTORY_DATABASE_URL_FILE` for `DATABASE_URL` too).
/// `RUST_LOG` is read by every command without being a flag.
fn read_by(name: &str, known: &BTreeSet<String>) -> bool {
    if name == "RUST_LOG" || known.contains(name) {
        return true;
    }
    name.strip_suffix("_FILE").is_some_and(|base| {
        known.contains(base)
            || base
                .strip_prefix("INVENTORY_")
                .is_some_and(|bare| known.contains(bare))
    })
}

/// The time a stop may take past `--shutdown-timeout` before the supervisor's SIGKILL: the
/// process exits at once when the bound runs out, so this is slack for a loaded node.
const STOP_MARGIN_SECONDS: f64 = 5.0;

// ---------------------------------------------------------------------------------------------
// The Kustomize base.

/// `kubectl`, or the one `KUBECTL` names (e.g. Debian bookworm's 1.20, unpacked elsewhere).
fn kubectl() -> Command {
    Command::new(std::env::var_os("KUBECTL").unwrap_or_else(|| "kubectl".into()))
}

const KUBECTL_MISSING: &str =
    "kubectl, from Debian's kubernetes-client package (scripts/test.sh installs it when absent)";

/// Kubernetes objects in YAML (several documents) as JSON, read by kubectl itself and offline:
/// `kubectl annotate --local -o json` prints each object it reads, with an annotation this
/// takes off again. No YAML parser of our own: the objects are what kubectl makes of them.
fn objects(yaml: &[u8]) -> Vec<Value> {
    const MARK: &str = "inventory.test/read";
    let mut child = kubectl()
        .args(["annotate", "--local", "-f", "-", "-o", "json"])
        .arg(format!("{MARK}=yes"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect(KUBECTL_MISSING);
    let mut stdin = child.stdin.take().unwrap();
    let yaml = yaml.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&yaml));
    let output = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    assert!(
        output.status.success(),
        "kubectl annotate --local: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let mut objects = Vec::new();
    for object in serde_json::Deserializer::from_slice(&output.stdout).into_iter::<Value>() {
        let object = object.expect("kubectl prints JSON");
        let items = match object["kind"].as_str() {
            Some("List") => object["items"].as_array().cloned().unwrap_or_default(),
            _ => vec![object],
        };
        for mut item in items {
            let metadata = item["metadata"].as_object_mut().unwrap();
            let annotations = metadata["annotations"].as_object_mut().unwrap();
            annotations.remove(MARK);
            if annotations.is_empty() {
                metadata.remove("annotations");
            }
            objects.push(item);
        }
    }
    objects
}

/// `kubectl kustomize deploy/kubernetes`, as objects.
fn rendered_base() -> Vec<Value> {
    let output = kubectl()
        .arg("kustomize")
        .arg(deploy_dir().join("kubernetes"))
        .output()
        .expect(KUBECTL_MISSING);
    assert!(
        output.status.success(),
        "kubectl kustomize deploy/kubernetes:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let objects = objects(&output.stdout);
    assert!(!objects.is_empty(), "the base renders no object");
    objects
}

fn the<'a>(objects: &'a [Value], kind: &str) -> &'a Value {
    let mut of_kind = objects.iter().filter(|object| object["kind"] == kind);
    let object = of_kind
        .next()
        .unwrap_or_else(|| panic!("the base has no {kind}"));
    assert!(of_kind.next().is_none(), "the base has several of {kind}");
    object
}

fn containers(workload: &Value) -> Vec<&Value> {
    let pod = &workload["spec"]["template"]["spec"];
    ["initContainers", "containers"]
        .iter()
        .filter_map(|field| pod[field].as_array())
        .flatten()
        .collect()
}

/// The serving container: the one running `serve`.
fn serving_container(deployment: &Value) -> &Value {
    containers(deployment)
        .into_iter()
        .find(|container| container["args"][0] == "serve")
        .expect("a container of the Deployment runs `serve`")
}

fn args(container: &Value) -> Vec<&str> {
    container["args"]
        .as_array()
        .map(|args| args.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// What `container` sets `flag` (`--shutdown-timeout`) to: its argument, else its variable
/// `env` set to a literal value, else the default `serve --help` prints.
fn effective(container: &Value, flag: &str, env: &str, serve_help: &str) -> String {
    let args = args(container);
    for (i, arg) in args.iter().enumerate() {
        if let Some(value) = arg.strip_prefix(&format!("{flag}=")) {
            return value.to_owned();
        }
        if *arg == flag {
            return args.get(i + 1).expect("a value after the flag").to_string();
        }
    }
    let set = container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|var| var["name"] == env);
    if let Some(var) = set {
        return var["value"]
            .as_str()
            .unwrap_or_else(|| panic!("{env} is a literal value in the manifest"))
            .to_owned();
    }
    help_default(serve_help, flag)
}

fn port_of(addr: &str) -> u64 {
    addr.rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .unwrap_or_else(|| panic!("an address with a port: {addr}"))
}

#[test]
fn the_kubernetes_base_probes_livez_and_readyz_on_the_metrics_port() {
    let base = rendered_base();
    let deployment = the(&base, "Deployment");
    let container = serving_container(deployment);
    assert_eq!(
        args(container),
        ["serve", "--strategy", "natural"],
        "the Deployment runs the natural key's consumer and its relay"
    );

    let serve_help = help(&["serve"]);
    let default_port = port_of(&help_default(&serve_help, "--metrics-addr"));
    let port = port_of(&effective(
        container,
        "--metrics-addr",
        "INVENTORY_METRICS_ADDR",
        &serve_help,
    ));
    let metrics_port = container["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|port| port["name"] == "metrics")
        .expect("a container port named metrics");
    assert_eq!(metrics_port["containerPort"], port, "{metrics_port}");
    assert_eq!(
        port, default_port,
        "the manifests keep --metrics-addr's default port"
    );

    for (probe, paths) in [
        ("startupProbe", &["/livez", "/readyz"][..]),
        ("livenessProbe", &["/livez"]),
        ("readinessProbe", &["/readyz"]),
    ] {
        let get = &container[probe]["httpGet"];
        let path = get["path"].as_str().unwrap_or_default();
        assert!(
            paths.contains(&path),
            "{probe} asks {path:?}, not {paths:?}"
        );
        assert!(
            get["port"] == "metrics" || get["port"] == port,
            "{probe} asks port {}, not the metrics port {port}",
            get["port"]
        );
    }

    let service = the(&base, "Service");
    let service_port = &service["spec"]["ports"][0];
    assert!(
        service_port["targetPort"] == "metrics" || service_port["targetPort"] == port,
        "{service}"
    );
    let monitor = the(&base, "ServiceMonitor");
    assert_eq!(
        monitor["spec"]["endpoints"][0]["port"], service_port["name"],
        "{monitor}"
    );
    assert_eq!(monitor["spec"]["endpoints"][0]["path"], "/metrics");
}

#[test]
fn the_kubernetes_grace_period_outlasts_the_shutdown_timeout() {
    let base = rendered_base();
    let deployment = the(&base, "Deployment");
    let container = serving_container(deployment);
    let shutdown = seconds(&effective(
        container,
        "--shutdown-timeout",
        "INVENTORY_SHUTDOWN_TIMEOUT",
        &help(&["serve"]),
    ));
    let grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        .as_f64()
        .unwrap_or(30.0); // Kubernetes' default
    assert!(
        grace >= shutdown + STOP_MARGIN_SECONDS,
        "terminationGracePeriodSeconds {grace} leaves less than {STOP_MARGIN_SECONDS} s beyond \
         the shutdown timeout ({shutdown} s): a stop would be SIGKILLed before its bound"
    );
}

#[test]
fn the_kubernetes_pods_run_locked_down_without_ddl() {
    let base = rendered_base();
    for kind in ["Deployment", "Job"] {
        let workload = the(&base, kind);
        let pod = &workload["spec"]["template"]["spec"];
        assert_eq!(pod["securityContext"]["runAsNonRoot"], true, "{kind}");
        assert_eq!(
            pod["securityContext"]["seccompProfile"]["type"], "RuntimeDefault",
            "{kind}"
        );
        for container in containers(workload) {
            let context = &container["securityContext"];
            assert_eq!(context["allowPrivilegeEscalation"], false, "{kind}");
            assert_eq!(context["readOnlyRootFilesystem"], true, "{kind}");
            assert_eq!(
                context["capabilities"]["drop"],
                serde_json::json!(["ALL"]),
                "{kind}"
            );
            for quantity in ["requests/cpu", "requests/memory", "limits/memory"] {
                let (kind_of, resource) = quantity.split_once('/').unwrap();
                assert!(
                    container["resources"][kind_of][resource].is_string(),
                    "{kind}: resources.{kind_of}.{resource}"
                );
            }
        }
    }
    let container = serving_container(the(&base, "Deployment"));
    let skip = container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|var| var["name"] == "INVENTORY_SKIP_MIGRATIONS")
        .expect("the Deployment sets INVENTORY_SKIP_MIGRATIONS");
    assert_eq!(skip["value"], "true");
    let job = the(&base, "Job");
    assert_eq!(args(containers(job)[0]), ["migrate"]);
}

#[test]
fn every_variable_the_kubernetes_base_sets_is_one_the_binary_reads() {
    let base = rendered_base();
    let mut unknown = Vec::new();
    for (kind, command) in [("Deployment", "serve"), ("Job", "migrate")] {
        let known = env_names(&(help(&[]) + &help(&[command])));
        assert!(!known.is_empty(), "`{command} --help` names no variable");
        for container in containers(the(&base, kind)) {
            assert!(
                container["envFrom"].is_null(),
                "{kind}: envFrom hides which variables are set: name each in env"
            );
            for var in container["env"].as_array().into_iter().flatten() {
                let name = var["name"].as_str().unwrap();
                if !read_by(name, &known) {
                    unknown.push(format!(
                        "{kind} sets {name}, which `{command} --help` does not name"
                    ));
                }
            }
        }
    }
    assert!(unknown.is_empty(), "{unknown:#?}");
}

/// `inventory <args> --print-config` with nothing in the environment but `env`: it parses every
/// setting as `serve` would, from the command line and the environment, and exits 0 only if
/// each value is one the flag takes (a usage error is exit 2).
fn print_config(args: &[&str], env: &[(String, String)]) -> String {
    let output = Command::new(inventory())
        .args(args)
        .arg("--print-config")
        .env_clear()
        .envs(env.iter().map(|(name, value)| (name, value)))
        .output()
        .expect("the inventory binary runs");
    assert!(
        output.status.success(),
        "{args:?} --print-config with {:?} refuses a setting:\n{}",
        env.iter().map(|(name, _)| name).collect::<Vec<_>>(),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

#[test]
fn the_kubernetes_deployment_settings_are_values_serve_takes() {
    let base = rendered_base();
    let container = serving_container(the(&base, "Deployment"));
    // A Secret's value stands in as something of its kind.
    let env: Vec<(String, String)> = container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|var| {
            let name = var["name"].as_str().unwrap().to_owned();
            let value = match var["value"].as_str() {
                Some(value) => value.to_owned(),
                None if name.ends_with("DATABASE_URL") => {
                    "postgres://inventory_service:secret@db:5432/inventory".to_owned()
                }
                None if name.ends_with("NATS_URL") => "nats://nats:4222".to_owned(),
                None => "secret".to_owned(),
            };
            (name, value)
        })
        .collect();
    let config = print_config(&args(container), &env);
    assert!(config.contains("skip-migrations = true"), "{config}");
}

#[test]
fn the_prometheus_rule_is_alerts_yml() {
    let alerts = std::fs::read_to_string(deploy_dir().join("prometheus/alerts.yml")).unwrap();
    // alerts.yml read as it is, as the top level of an object kubectl reads (it keeps the
    // fields of a kind it does not know).
    let wrapped = format!(
        "apiVersion: inventory.test/v1\nkind: AlertsFile\nmetadata:\n  name: alerts\n{alerts}"
    );
    let source = objects(wrapped.as_bytes());
    assert_eq!(source.len(), 1, "alerts.yml is one YAML document");
    let groups = &source[0]["groups"];
    assert!(groups.as_array().is_some_and(|groups| !groups.is_empty()));

    let base = rendered_base();
    let rule = the(&base, "PrometheusRule");
    assert!(
        rule["spec"]["groups"] == *groups,
        "the PrometheusRule's groups differ from deploy/prometheus/alerts.yml's: run \
         scripts/deploy-kubernetes.sh"
    );
}

#[test]
fn the_dashboard_config_map_is_inventory_json() {
    let dashboard = std::fs::read_to_string(deploy_dir().join("grafana/inventory.json")).unwrap();
    let base = rendered_base();
    let config_map = base
        .iter()
        .find(|object| {
            object["kind"] == "ConfigMap"
                && object["metadata"]["labels"]["grafana_dashboard"] == "1"
        })
        .expect("a ConfigMap labelled grafana_dashboard: \"1\"");
    let held = config_map["data"]["inventory.json"]
        .as_str()
        .expect("the ConfigMap holds inventory.json");
    assert!(
        serde_json::from_str::<Value>(held).unwrap()
            == serde_json::from_str::<Value>(&dashboard).unwrap()
            && held == dashboard,
        "the dashboard ConfigMap differs from deploy/grafana/inventory.json: run \
         scripts/deploy-kubernetes.sh"
    );
}

// ---------------------------------------------------------------------------------------------
// The systemd unit.

fn unit_text() -> String {
    std::fs::read_to_string(deploy_dir().join("systemd/inventory.service")).unwrap()
}

/// The values of `key=` in the unit's `[Service]` section, in order.
fn service_values(unit: &str, key: &str) -> Vec<String> {
    let mut section = "";
    let mut values = Vec::new();
    for line in unit.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line;
        } else if section == "[Service]"
            && let Some(value) = line
                .strip_prefix(key)
                .and_then(|rest| rest.strip_prefix('='))
        {
            values.push(value.trim().to_owned());
        }
    }
    values
}

fn service_value(unit: &str, key: &str) -> String {
    let values = service_values(unit, key);
    assert_eq!(values.len(), 1, "{key}= once in [Service]: {values:?}");
    values[0].clone()
}

const SYSTEMD_MISSING: &str =
    "systemd-analyze, from Debian's systemd package (scripts/test.sh installs it when absent)";

/// The unit as an administrator installs it, with ExecStart's `/usr/local/bin/inventory` made
/// the binary under test: `systemd-analyze verify` wants the program to exist, and needs no
/// running systemd.
fn installed_unit() -> (PathBuf, PathBuf) {
    let unit = unit_text();
    let exec_start = service_value(&unit, "ExecStart");
    assert!(
        exec_start.starts_with("/usr/local/bin/inventory "),
        "{exec_start}"
    );
    let dir = std::env::temp_dir().join(format!("inventory-unit-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("inventory.service");
    let binary = inventory();
    std::fs::write(
        &path,
        unit.replace("/usr/local/bin/inventory", binary.to_str().unwrap()),
    )
    .unwrap();
    (dir, path)
}

#[test]
fn the_systemd_unit_passes_systemd_analyze_verify_and_security() {
    let (dir, unit) = installed_unit();
    let verify = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&unit)
        .output()
        .expect(SYSTEMD_MISSING);
    let security = Command::new("systemd-analyze")
        .args(["security", "--offline=yes", "--no-pager"])
        .arg(&unit)
        .output()
        .expect(SYSTEMD_MISSING);
    std::fs::remove_dir_all(dir).unwrap();
    // verify exits 0 on an unknown key or a value it cannot parse, and says so on stderr.
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&verify.stdout),
        String::from_utf8_lossy(&verify.stderr)
    );
    assert!(
        verify.status.success() && said.trim().is_empty(),
        "systemd-analyze verify:\n{said}"
    );

    let report = String::from_utf8_lossy(&security.stdout);
    let exposure: f64 = report
        .lines()
        .find_map(|line| line.split_once("Overall exposure level for inventory.service: "))
        .and_then(|(_, rest)| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("systemd-analyze security:\n{report}{security:?}"));
    assert!(
        exposure <= 2.0,
        "the unit's exposure is {exposure} (\"OK\" is below 2.0 on systemd's scale):\n{report}"
    );
}

#[test]
fn the_systemd_unit_restarts_on_failure_and_outlasts_the_shutdown_timeout() {
    let unit = unit_text();
    assert_eq!(service_value(&unit, "Restart"), "on-failure");
    // 2 is the binary's usage error: a wrong flag or value, which a restart does not cure.
    assert_eq!(service_value(&unit, "RestartPreventExitStatus"), "2");
    assert_eq!(service_value(&unit, "KillSignal"), "SIGTERM");
    assert_eq!(service_value(&unit, "StateDirectory"), "inventory");
    assert!(!service_values(&unit, "EnvironmentFile").is_empty());
    assert!(
        service_value(&unit, "DynamicUser") == "yes" || !service_values(&unit, "User").is_empty(),
        "the service runs as a user of its own"
    );

    let set_in_env_file = env_file()
        .into_iter()
        .find(|(name, _, commented)| name == "INVENTORY_SHUTDOWN_TIMEOUT" && !commented);
    let shutdown = seconds(&set_in_env_file.map_or_else(
        || help_default(&help(&["serve"]), "--shutdown-timeout"),
        |(_, value, _)| value,
    ));
    let stop = seconds(&service_value(&unit, "TimeoutStopSec"));
    assert!(
        stop >= shutdown + STOP_MARGIN_SECONDS,
        "TimeoutStopSec {stop} s leaves less than {STOP_MARGIN_SECONDS} s beyond the shutdown \
         timeout ({shutdown} s)"
    );
}

/// The assignments of `deploy/systemd/inventory.env`: (name, value, commented out).
fn env_file() -> Vec<(String, String, bool)> {
    let text = std::fs::read_to_string(deploy_dir().join("systemd/inventory.env")).unwrap();
    text.lines()
        .filter_map(|line| {
            let (commented, line) = match line.strip_prefix('#') {
                Some(rest) => (true, rest.trim_start()),
                None => (false, line.trim()),
            };
            let (name, value) = line.split_once('=')?;
            let is_name = !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
            is_name.then(|| (name.to_owned(), value.to_owned(), commented))
        })
        .collect()
}

#[test]
fn the_systemd_environment_file_holds_values_serve_takes() {
    let exec_start = service_value(&unit_text(), "ExecStart");
    let args: Vec<&str> = exec_start.split_whitespace().skip(1).collect();
    let env: Vec<(String, String)> = env_file()
        .into_iter()
        .filter(|(_, _, commented)| !commented)
        .map(|(name, value, _)| (name, value))
        .collect();
    let config = print_config(&args, &env);
    assert!(config.contains("skip-migrations = true"), "{config}");
}

#[test]
fn every_variable_of_the_systemd_environment_file_is_one_the_binary_reads() {
    let known = env_names(&(help(&[]) + &help(&["serve"])));
    let vars = env_file();
    assert!(
        vars.iter().any(|(name, _, _)| name == "DATABASE_URL"),
        "{vars:?}"
    );
    let unknown: Vec<&String> = vars
        .iter()
        .map(|(name, _, _)| name)
        .filter(|name| !read_by(name, &known))
        .collect();
    assert!(
        unknown.is_empty(),
        "deploy/systemd/inventory.env sets what `serve --help` does not name: {unknown:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// The Grafana dashboard, as provisioned from a file (Grafana's file provider, the Helm chart's
// sidecar loading the ConfigMap, grafana-operator): nothing fills `__inputs` there, so the data
// source is a variable of the dashboard's own, and every query is narrowed by its variables.

fn grafana_dashboard() -> Value {
    let text = std::fs::read_to_string(deploy_dir().join("grafana/inventory.json")).unwrap();
    serde_json::from_str(&text).expect("the dashboard is JSON")
}

/// Every panel, those a collapsed row holds in its own `panels` too.
fn dashboard_panels(dashboard: &Value) -> Vec<&Value> {
    let mut panels = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        panels.push(panel);
        panels.extend(panel["panels"].as_array().into_iter().flatten());
    }
    panels
}

/// Every value held under a key named `key`, at any depth.
fn values_under<'a>(value: &'a Value, key: &str, found: &mut Vec<&'a Value>) {
    match value {
        Value::Object(map) => {
            for (name, inner) in map {
                if name == key {
                    found.push(inner);
                }
                values_under(inner, key, found);
            }
        }
        Value::Array(items) => items.iter().for_each(|item| values_under(item, key, found)),
        _ => {}
    }
}

/// The metric families with a `consumer` label (service/src/metrics.rs).
const CONSUMER_LABELLED: &[&str] = &[
    "inventory_messages_total",
    "inventory_dead_letters_total",
    "inventory_message_handling_seconds",
    "inventory_messages_in_flight",
    "inventory_oldest_in_flight_seconds",
    "inventory_consumer_pending_messages",
    "inventory_consumer_ack_pending_messages",
    "inventory_consumer_max_ack_pending",
    "inventory_consumer_not_owned",
    "inventory_lanes",
    "inventory_dead_letters_waiting",
    "inventory_dead_letters_oldest_age_seconds",
    "inventory_dead_letters_past_replay_allowance",
    "inventory_inbox_processing_older_than_retention",
    "inventory_inbox_purge_failing",
];

/// The units (Grafana's ids) a panel of this dashboard may use.
const GRAFANA_UNITS: &[&str] = &[
    "none",
    "short",
    "percentunit",
    "s",
    "ms",
    "bytes",
    "ops",
    "opm",
    "reqps",
    "cps",
];

/// A selector's label matchers: {label: (operator, value)}.
type Matchers = std::collections::BTreeMap<String, (String, String)>;

/// The vector selectors of a PromQL expression: (metric name, its matchers).
/// Enough PromQL for the dashboard's queries: string literals, grouping lists (`by (…)`),
/// ranges (`[…]`), numbers and binary keywords are skipped; an identifier followed by `(` is a
/// function or an aggregation.
fn selectors(expr: &str) -> Vec<(String, Matchers)> {
    const KEYWORDS: &[&str] = &["and", "or", "unless", "bool", "offset"];
    const GROUPING: &[&str] = &[
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    let chars: Vec<char> = expr.chars().collect();
    let skip_to = |from: usize, close: char| {
        let mut i = from;
        let mut quote = None;
        while i < chars.len() {
            match (quote, chars[i]) {
                (Some(_), '\\') => i += 1,
                (Some(q), c) if c == q => quote = None,
                (None, '"' | '\'' | '`') => quote = Some(chars[i]),
                (None, c) if c == close => return i,
                _ => {}
            }
            i += 1;
        }
        panic!("unclosed {close:?} in {expr}")
    };
    let mut found = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            // A string outside a selector (e.g. label_replace's): skip it whole.
            let mut j = i + 1;
            while j < chars.len() && chars[j] != c {
                j += if chars[j] == '\\' { 2 } else { 1 };
            }
            i = j + 1;
        } else if c == '[' {
            i = skip_to(i + 1, ']') + 1;
        } else if c.is_ascii_digit()
            || (c == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit))
        {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' || c == '{' {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || "_:".contains(chars[i])) {
                i += 1;
            }
            let name: String = chars[start..i].iter().collect();
            let mut next = i;
            while next < chars.len() && chars[next].is_whitespace() {
                next += 1;
            }
            let following = chars.get(next).copied();
            let next_word: String = chars[next..]
                .iter()
                .take_while(|c| c.is_ascii_alphanumeric() || **c == '_')
                .collect();
            if GROUPING.contains(&name.as_str()) {
                if following == Some('(') {
                    i = skip_to(next + 1, ')') + 1;
                }
            } else if KEYWORDS.contains(&name.as_str())
                || following == Some('(')
                || next_word == "by"
                || next_word == "without"
            {
                // An operator, a function, an aggregation (`sum by (…) (…)` too).
            } else if following == Some('{') {
                let end = skip_to(next + 1, '}');
                let matchers: String = chars[next + 1..end].iter().collect();
                found.push((name, matchers_of(&matchers, expr)));
                i = end + 1;
            } else {
                found.push((name, Matchers::new()));
            }
        } else {
            i += 1;
        }
    }
    found
}

/// `a="x", b=~"y"` as {a: ("=", "x"), b: ("=~", "y")}.
fn matchers_of(text: &str, expr: &str) -> Matchers {
    let mut matchers = Matchers::new();
    let mut rest = text.trim();
    while !rest.is_empty() {
        let label_end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or_else(|| panic!("a matcher in {expr}"));
        let label = rest[..label_end].to_owned();
        let after = rest[label_end..].trim_start();
        let operator_end = after
            .find(['"', '\'', '`'])
            .unwrap_or_else(|| panic!("a quoted value in {expr}"));
        let operator = after[..operator_end].trim().to_owned();
        let quote = after[operator_end..].chars().next().unwrap();
        let value_text = &after[operator_end + 1..];
        let value_end = value_text
            .find(quote)
            .unwrap_or_else(|| panic!("an unclosed value in {expr}"));
        matchers.insert(label, (operator, value_text[..value_end].to_owned()));
        rest = value_text[value_end + 1..].trim_start();
        rest = rest.strip_prefix(',').unwrap_or(rest).trim_start();
    }
    matchers
}

/// A variable's query: a string, or the object of Grafana 10's Prometheus query editor.
fn variable_query(variable: &Value) -> &str {
    variable["query"]
        .as_str()
        .or_else(|| variable["query"]["query"].as_str())
        .unwrap_or_else(|| panic!("variable {} has no query", variable["name"]))
}

#[test]
fn the_dashboard_is_safe_to_provision_and_filtered_by_its_variables() {
    let dashboard = grafana_dashboard();
    let text = std::fs::read_to_string(deploy_dir().join("grafana/inventory.json")).unwrap();
    let provisioned = serde_json::json!({"type": "prometheus", "uid": "${datasource}"});

    // Provisioning: nothing to fill in at import.
    assert_eq!(
        dashboard["uid"], "inventory-service",
        "links and bookmarks use the uid"
    );
    assert_eq!(dashboard["title"], "Inventory service");
    assert_eq!(dashboard["refresh"], "30s");
    assert!(
        dashboard.get("__inputs").is_none() && dashboard.get("__requires").is_none(),
        "__inputs and __requires are filled by the interactive import only: provisioned from a \
         file, every panel reports a missing data source"
    );
    assert!(
        !text.contains("${DS_"),
        "an import placeholder (${{DS_…}}) is left in the dashboard"
    );

    // The variables, chained: datasource, namespace, job, instance, consumer.
    let variables = dashboard["templating"]["list"]
        .as_array()
        .expect("templating.list");
    let variable = |name: &str| {
        variables
            .iter()
            .find(|variable| variable["name"] == name)
            .unwrap_or_else(|| panic!("no template variable {name}"))
    };
    let datasource = variable("datasource");
    assert_eq!(datasource["type"], "datasource", "{datasource}");
    assert_eq!(datasource["query"], "prometheus", "{datasource}");
    let chain = [
        ("namespace", &[][..]),
        ("job", &["$namespace"][..]),
        ("instance", &["$namespace", "$job"][..]),
        ("consumer", &["$namespace", "$job", "$instance"][..]),
    ];
    for (name, narrowed_by) in chain {
        let variable = variable(name);
        assert_eq!(variable["type"], "query", "{variable}");
        assert_eq!(variable["datasource"], provisioned, "{variable}");
        let query = variable_query(variable);
        assert!(query.starts_with("label_values("), "{name}: {query}");
        for earlier in narrowed_by {
            assert!(
                query.contains(earlier),
                "{name}'s query ignores {earlier}: {query}"
            );
        }
    }
    let namespace = variable("namespace");
    assert!(
        namespace["includeAll"] == true && namespace["allValue"] == ".*",
        "namespace's All must be .*, which also matches a series without the label (a \
         Prometheus outside Kubernetes): {namespace}"
    );
    for name in ["instance", "consumer"] {
        let variable = variable(name);
        assert!(
            variable["multi"] == true && variable["includeAll"] == true,
            "{variable}"
        );
    }

    // Every data source the dashboard names is the variable.
    let mut named = Vec::new();
    values_under(&dashboard, "datasource", &mut named);
    for value in named {
        assert_eq!(
            *value, provisioned,
            "a data source other than ${{datasource}}"
        );
    }

    let panels = dashboard_panels(&dashboard);
    let mut ids = BTreeSet::new();
    let mut exprs = 0;
    for panel in &panels {
        let title = panel["title"].as_str().unwrap_or_default();
        assert!(
            ids.insert(panel["id"].to_string()),
            "panel id {} twice",
            panel["id"]
        );
        if panel["type"] == "row" {
            assert!(panel["targets"].is_null(), "row {title:?} has queries");
            continue;
        }
        assert_eq!(panel["datasource"], provisioned, "panel {title:?}");

        // One unit per panel: its default, which no override changes.
        let unit = panel["fieldConfig"]["defaults"]["unit"]
            .as_str()
            .unwrap_or_else(|| panic!("panel {title:?} sets no unit"));
        assert!(
            GRAFANA_UNITS.contains(&unit),
            "panel {title:?}: unit {unit:?} is not one of {GRAFANA_UNITS:?}"
        );
        let overrides = panel["fieldConfig"]["overrides"].as_array();
        for property in overrides
            .into_iter()
            .flatten()
            .filter_map(|o| o["properties"].as_array())
            .flatten()
        {
            assert!(
                property["id"] != "unit" || property["value"] == unit,
                "panel {title:?} plots a second unit through an override: {property}"
            );
        }

        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "panel {title:?} has no query");
        for target in targets {
            assert_eq!(
                target["datasource"], provisioned,
                "panel {title:?}: {target}"
            );
            let expr = target["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("panel {title:?}: a query without expr"));
            exprs += 1;
            assert!(
                !(expr.contains("increase(")
                    && (expr.contains("$__rate_interval") || expr.contains("$__interval"))),
                "panel {title:?} plots an increase over the step, which changes with the zoom: \
                 plot rate() instead: {expr}"
            );
            let selectors = selectors(expr);
            assert!(
                !selectors.is_empty(),
                "panel {title:?}: no metric in {expr}"
            );
            for (metric, matchers) in selectors {
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|suffix| metric.strip_suffix(suffix))
                    .unwrap_or(&metric);
                let mut wanted = vec!["namespace", "job", "instance"];
                if CONSUMER_LABELLED.contains(&family) {
                    wanted.push("consumer");
                }
                for label in wanted {
                    let expected = ("=~".to_owned(), format!("${label}"));
                    assert_eq!(
                        matchers.get(label),
                        Some(&expected),
                        "panel {title:?}: {metric} is not narrowed by {label}=~\"${label}\" in \
                         {expr}"
                    );
                }
            }
        }
    }
    assert!(exprs >= 20, "{exprs} queries");
}

/// Every query of the dashboard is PromQL that Prometheus parses: promtool checks them as
/// recording rules, with the variables set as Grafana sets them (All is `.*`).
#[test]
fn the_dashboard_queries_parse_as_promql() {
    let dashboard = grafana_dashboard();
    let variables: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|variable| variable["name"].as_str())
        .collect();
    let mut rules = Vec::new();
    for panel in dashboard_panels(&dashboard) {
        for (i, target) in panel["targets"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let mut expr = target["expr"].as_str().unwrap_or_default().to_owned();
            for interval in ["$__rate_interval", "$__interval", "$__range"] {
                expr = expr.replace(interval, "2m");
            }
            for name in &variables {
                expr = expr
                    .replace(&format!("${{{name}}}"), ".*")
                    .replace(&format!("${name}"), ".*");
            }
            rules.push(serde_json::json!({
                "record": format!("dashboard:panel_{}_{i}", panel["id"]),
                "expr": expr,
            }));
        }
    }
    assert!(!rules.is_empty());
    let dir = std::env::temp_dir().join(format!("inventory-dashboard-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("dashboard-queries.yml");
    // JSON is YAML.
    let groups = serde_json::json!({"groups": [{"name": "dashboard", "rules": rules}]});
    std::fs::write(&file, groups.to_string()).unwrap();
    let output = Command::new("promtool")
        .args(["check", "rules"])
        .arg(&file)
        .output()
        .expect(
            "promtool, from Debian's prometheus package (scripts/test.sh installs it when absent)",
        );
    std::fs::remove_dir_all(dir).unwrap();
    assert!(
        output.status.success(),
        "a dashboard query is not PromQL:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}
