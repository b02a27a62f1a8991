//! One configuration for the commands that run as a service (`serve`, `relay`) and those an
//! operator runs beside them (`dlq`): each of their flags is a setting, taken from, in rising
//! precedence, its default, the configuration file, the environment and the command line. The
//! study binary reads its own (`serve` with a study handler, `inbox purge`) the same way
//! ([`parse_program`] with its [`Configured`]).
//!
//! - The environment: `INVENTORY_<FLAG>` (`--ack-wait` → `INVENTORY_ACK_WAIT`), except the URLs
//!   that keep the names every tool of their kind reads (`DATABASE_URL`, `NATS_URL`,
//!   `ORDERS_DATABASE_URL`). A secret ([`SECRETS`]) may be given as a file:
//!   `INVENTORY_<FLAG>_FILE` holds its path.
//! - The file: TOML, named by `--config` or `INVENTORY_CONFIG`, with the flags' long names as
//!   its keys (`ack-wait = "30s"`), read with figment.
//! - clap stays the one parser. The file's values and the secrets' files become
//!   the flags' defaults before clap parses: each value goes through its flag's own parser
//!   whichever layer it came from, and clap's environment and command line rank above them.
//!
//! The same flag of another command (`stock`, `outbox`, `migrate`; the study's `orders` and
//! `publish`) reads the same names: a setting has one name everywhere.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::builder::BoolishValueParser;
use clap::error::ErrorKind;
use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Args as _, Command, CommandFactory, FromArgMatches};
use figment::Figment;
use figment::providers::{Format, Toml};
use figment::value::Value;
use inventory_infra::redact::redact_url;

use crate::args::{NatsArgs, TopologyArgs};

/// Which commands of a program take their flags as settings.
#[derive(Debug, Clone, Copy)]
pub struct Configured {
    /// The commands each of whose flags is a setting.
    pub commands: &'static [&'static [&'static str]],
    /// The commands whose flags other commands share by name.
    pub services: &'static [&'static [&'static str]],
    /// The commands that share them; `None`: every other command.
    pub shared_by: Option<&'static [&'static [&'static str]]>,
}

/// The `inventory` binary's.
pub const INVENTORY: Configured = Configured {
    commands: &CONFIGURED,
    services: &SERVICES,
    shared_by: None,
};

/// The commands each of whose flags is a setting.
const CONFIGURED: [&[&str]; 5] = [
    &["serve"],
    &["relay"],
    &["dlq", "list"],
    &["dlq", "replay"],
    &["dlq", "delete"],
];

/// The commands whose flags other commands share by name: a flag of `stock` or `orders` reads
/// the environment and the file when `serve` or `relay` has it too.
const SERVICES: [&[&str]; 2] = [&["serve"], &["relay"]];

/// Flags that are not settings: they say what to do with the settings, or decide one run of an
/// operator's command (`--force`, `--dry-run`, which dead letters `--seq`, `--reason` and
/// `--older-than` take or which inbox rows a purge deletes, `--json` output), which a variable
/// left in the environment or a line of a shared file must never decide for every run.
const NOT_SETTINGS: [&str; 10] = [
    "config",
    "print-config",
    "help",
    "version",
    "force",
    "dry-run",
    "seq",
    "reason",
    "older-than",
    "json",
];

/// The settings whose environment variables keep the names every tool of their kind reads.
const OWN_NAMES: [&str; 3] = ["database-url", "nats-url", "orders-database-url"];

/// The environment variable of the setting `long`: `--ack-wait` → `INVENTORY_ACK_WAIT`,
/// `--database-url` → `DATABASE_URL`.
pub fn env_name(long: &str) -> String {
    let name = long.to_uppercase().replace('-', "_");
    if OWN_NAMES.contains(&long) {
        name
    } else {
        format!("INVENTORY_{name}")
    }
}

/// How a secret is masked wherever it is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Secret {
    /// A URL: its user information and secret parameters masked, the rest shown.
    Url,
    /// Nothing of it shown.
    Opaque,
}

/// The settings that are secrets: held in `secrecy` types, never echoed by `--help`, masked by
/// `--print-config`, and accepted from a file (`INVENTORY_<FLAG>_FILE`).
pub const SECRETS: [(&str, Secret); 5] = [
    ("database-url", Secret::Url),
    ("orders-database-url", Secret::Url),
    ("nats-url", Secret::Url),
    ("nats-password", Secret::Opaque),
    ("nats-token", Secret::Opaque),
];

fn secret(long: &str) -> Option<Secret> {
    SECRETS
        .iter()
        .find(|(name, _)| *name == long)
        .map(|(_, kind)| *kind)
}

/// What the command line asks for.
#[derive(Debug)]
pub enum Parsed<P> {
    /// Run this command.
    Run(Box<P>),
    /// Print the settings in effect (`--print-config`), as this text.
    Print(String),
}

/// The command line `args` (the program's name first) of program `P` with this process's
/// environment and the file under it, the flags of `configured`'s commands taken as settings. A
/// usage error (a flag, a value of any layer, an unreadable file) is clap's, which prints and
/// exits with 2.
pub fn parse_program<P: CommandFactory + FromArgMatches>(
    args: Vec<OsString>,
    configured: Configured,
) -> Result<Parsed<P>, clap::Error> {
    let file = config_file(&args);
    let command = P::command();
    let settings = setting_names(&command, configured);
    let defaults = Layers::read(file.as_deref(), &settings)?;
    let mut command = show_shared_once(configure(command, &mut Vec::new(), &settings, &defaults)?);
    // Built, so that each command shows the program's own flags (`--log-format`) among its
    // settings.
    command.build();
    let matches = command.clone().try_get_matches_from(args)?;
    let (run, run_matches) = innermost(&command, &matches);
    require_database_url(run_matches)?;
    if let Ok(Some(true)) = run_matches.try_get_one::<bool>("print_config") {
        return Ok(Parsed::Print(print_config(
            run,
            run_matches,
            &defaults,
            file.as_deref(),
        )));
    }
    Ok(Parsed::Run(Box::new(P::from_arg_matches(&matches)?)))
}

/// The values of the settings `longs` as the layers give them, each from the command line first
/// (`--long VALUE` or `--long=VALUE`), then the environment, then the configuration file (read
/// once); read before clap parses, to tell which program a command line is for.
pub fn settings<const N: usize>(args: &[OsString], longs: [&str; N]) -> [Option<String>; N] {
    let file: Option<BTreeMap<String, Value>> =
        config_file(args).and_then(|path| Figment::from(Toml::file_exact(path)).extract().ok());
    longs.map(|long| {
        given(args, long)
            .map(|value| value.to_string_lossy().into_owned())
            .or_else(|| {
                std::env::var_os(env_name(long))
                    .filter(|value| !value.is_empty())
                    .map(|value| value.to_string_lossy().into_owned())
            })
            .or_else(|| file.as_ref()?.get(long).and_then(scalar))
    })
}

/// `--long VALUE` or `--long=VALUE` on the command line.
fn given(args: &[OsString], long: &str) -> Option<OsString> {
    let flag = format!("--{long}");
    let mut args = args.iter().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--" {
            break;
        }
        if *arg == *flag {
            return args.next().cloned();
        }
        if let Some(value) = arg
            .to_str()
            .and_then(|arg| arg.strip_prefix(&format!("{flag}=")))
        {
            return Some(value.into());
        }
    }
    None
}

/// `--config FILE` (or `--config=FILE`) on the command line, else `INVENTORY_CONFIG`: looked up
/// before clap parses, since the file's values are the defaults clap parses with.
fn config_file(args: &[OsString]) -> Option<PathBuf> {
    given(args, "config")
        .or_else(|| std::env::var_os("INVENTORY_CONFIG").filter(|path| !path.is_empty()))
        .map(PathBuf::from)
}

/// The long names of every setting, and of those the services share with other commands.
struct SettingNames {
    configured: Configured,
    all: BTreeSet<String>,
    shared: BTreeSet<String>,
}

fn setting_names(root: &Command, configured: Configured) -> SettingNames {
    let longs = |paths: &[&[&str]]| -> BTreeSet<String> {
        paths
            .iter()
            .filter_map(|path| find(root, path))
            .flat_map(|command| command.get_arguments().filter_map(Arg::get_long))
            .filter(|long| !NOT_SETTINGS.contains(long))
            .map(str::to_owned)
            .collect()
    };
    // The program's own flags (`--log-format`) are every command's.
    let global: BTreeSet<String> = root
        .get_arguments()
        .filter_map(Arg::get_long)
        .filter(|long| !NOT_SETTINGS.contains(long))
        .map(str::to_owned)
        .collect();
    SettingNames {
        configured,
        all: longs(configured.commands).union(&global).cloned().collect(),
        shared: longs(configured.services).union(&global).cloned().collect(),
    }
}

fn find<'a>(root: &'a Command, path: &[&str]) -> Option<&'a Command> {
    path.iter()
        .try_fold(root, |command, name| command.find_subcommand(name))
}

/// Values that become flags' defaults, with where each came from.
struct Layers(BTreeMap<String, Layered>);

struct Layered {
    values: Vec<String>,
    from: String,
}

impl Layers {
    /// The file's values, then the secrets' files over them.
    fn read(file: Option<&Path>, settings: &SettingNames) -> Result<Self, clap::Error> {
        let mut layers = BTreeMap::new();
        if let Some(path) = file {
            for (long, values) in read_file(path, &settings.all)? {
                let from = format!("file {}", path.display());
                layers.insert(long, Layered { values, from });
            }
        }
        for (long, _) in SECRETS {
            let name = format!("INVENTORY_{}_FILE", long.to_uppercase().replace('-', "_"));
            let Some(path) = std::env::var_os(&name).filter(|path| !path.is_empty()) else {
                continue;
            };
            if std::env::var_os(env_name(long)).is_some_and(|value| !value.is_empty()) {
                return Err(usage(format!(
                    "both {} and {name} are set: give the secret once",
                    env_name(long)
                )));
            }
            let text = std::fs::read_to_string(&path).map_err(|error| {
                usage(format!(
                    "{name}: cannot read {}: {error}",
                    Path::new(&path).display()
                ))
            })?;
            // A file written by `echo` or an editor ends with a newline that is not the secret's.
            let value = text.trim_end_matches(['\n', '\r']).to_owned();
            let from = format!("env {name}");
            layers.insert(
                long.to_owned(),
                Layered {
                    values: vec![value],
                    from,
                },
            );
        }
        Ok(Self(layers))
    }

    fn get(&self, long: &str) -> Option<&Layered> {
        self.0.get(long)
    }
}

/// The file's settings by long name; a key that is no setting is an error, so a typo is not
/// silently ignored.
fn read_file(
    path: &Path,
    settings: &BTreeSet<String>,
) -> Result<Vec<(String, Vec<String>)>, clap::Error> {
    let table: BTreeMap<String, Value> = Figment::from(Toml::file_exact(path))
        .extract()
        .map_err(|error| usage(format!("configuration file {}: {error}", path.display())))?;
    table
        .into_iter()
        .map(|(key, value)| {
            if !settings.contains(&key) {
                return Err(usage(format!(
                    "configuration file {}: {key} is not a setting (the keys are the flags' long \
                     names, such as ack-wait; `inventory serve --help` lists them)",
                    path.display()
                )));
            }
            let values = match value {
                Value::Array(_, items) => items.iter().map(scalar).collect(),
                value => scalar(&value).map(|value| vec![value]),
            }
            .ok_or_else(|| {
                usage(format!(
                    "configuration file {}: {key} must be a string, a number, a boolean or a \
                     list of them",
                    path.display()
                ))
            })?;
            Ok((key, values))
        })
        .collect()
}

/// A value as it would be written on the command line.
fn scalar(value: &Value) -> Option<String> {
    match value {
        Value::String(_, text) => Some(text.clone()),
        Value::Char(_, c) => Some(c.to_string()),
        Value::Bool(_, flag) => Some(flag.to_string()),
        Value::Num(_, number) => number
            .to_i128()
            .map(|n| n.to_string())
            .or_else(|| number.to_f64().map(|n| n.to_string())),
        Value::Empty(..) | Value::Dict(..) | Value::Array(..) => None,
    }
}

fn usage(message: String) -> clap::Error {
    clap::Error::raw(ErrorKind::InvalidValue, format!("{message}\n"))
}

/// Gives every setting of `command` and its subcommands its environment variable, one boolean
/// parser, its secrecy, and the layers' value as its default.
fn configure(
    command: Command,
    path: &mut Vec<String>,
    settings: &SettingNames,
    layers: &Layers,
) -> Result<Command, clap::Error> {
    let is_command = |commands: &[&[&str]]| {
        commands
            .iter()
            .any(|command| command.iter().eq(path.iter()))
    };
    let configured = is_command(settings.configured.commands);
    let sharing = settings
        .configured
        .shared_by
        .is_none_or(|sharing| path.is_empty() || is_command(sharing));
    let mut failure = None;
    let command = command.mut_args(|arg| {
        let Some(long) = arg.get_long().map(str::to_owned) else {
            return arg;
        };
        let is_setting = if configured {
            settings.all.contains(&long)
        } else {
            sharing && settings.shared.contains(&long)
        };
        if !is_setting {
            return arg;
        }
        let arg = as_setting(arg, &long);
        match layers
            .get(&long)
            .map(|layered| layered_values(&arg, &long, layered))
        {
            None => arg,
            Some(Ok(values)) => with_default(arg, values),
            Some(Err(error)) => {
                failure.get_or_insert(error);
                arg
            }
        }
    });
    if let Some(error) = failure {
        return Err(error);
    }
    let mut failure = None;
    let command = command.mut_subcommands(|sub| {
        path.push(sub.get_name().to_owned());
        let configured = configure(sub.clone(), path, settings, layers);
        path.pop();
        configured.unwrap_or_else(|error| {
            failure.get_or_insert(error);
            sub
        })
    });
    failure.map_or(Ok(command), Err)
}

/// Lists the shared flags once, in the program's `--help`, rather than under every command: each
/// command that takes them still does, and its help says so and where they are listed.
fn show_shared_once(root: Command) -> Command {
    let program = root.get_name().to_owned();
    let ids = TopologyArgs::augment_args(NatsArgs::augment_args(Command::new(&program)))
        .get_arguments()
        .map(|arg| arg.get_id().clone())
        .collect();
    let mut shared = Shared {
        ids,
        args: Vec::new(),
    };
    let root = root.mut_subcommands(|command| hide_shared(command, &program, &mut shared));
    if shared.args.is_empty() {
        return root;
    }
    let listed = Command::new(&program)
        .help_template("{all-args}")
        .disable_help_flag(true)
        .args(shared.args)
        .render_long_help();
    root.after_help(format!(
        "The NATS and stream flags of the commands that reach NATS: `{program} --help`."
    ))
    .after_long_help(format!(
        "The NATS and stream flags of every command that reaches NATS, listed here once:\n\n{listed}"
    ))
}

/// The flags of [`NatsArgs`] and [`TopologyArgs`], each as the first command that takes it has
/// it (with its environment variable and the layers' default).
struct Shared {
    ids: Vec<clap::Id>,
    args: Vec<Arg>,
}

/// Hides the shared flags from the help of `command` and its subcommands, each of which then
/// points to the program's.
fn hide_shared(command: Command, program: &str, shared: &mut Shared) -> Command {
    let mut takes_them = false;
    let command = command.mut_args(|arg| {
        if !shared.ids.contains(arg.get_id()) {
            return arg;
        }
        if !shared.args.iter().any(|seen| seen.get_id() == arg.get_id()) {
            shared.args.push(arg.clone());
        }
        takes_them = true;
        arg.hide(true)
    });
    let command = command.mut_subcommands(|sub| hide_shared(sub, program, shared));
    if takes_them {
        command.after_help(format!(
            "Also takes the NATS and stream flags (--nats-url, --stream, …): `{program} --help` \
             lists them."
        ))
    } else {
        command
    }
}

/// A setting's environment variable, its boolean parser, its secrecy.
fn as_setting(mut arg: Arg, long: &str) -> Arg {
    if arg.get_env().is_none() {
        arg = arg.env(env_name(long));
    }
    if matches!(arg.get_action(), ArgAction::SetTrue) {
        // `1`, `yes`, `on` as well as `true`, from the environment as from the file.
        arg = arg.value_parser(BoolishValueParser::new());
    }
    if secret(long).is_some() {
        arg = arg.hide_env_values(true);
    }
    arg
}

/// `layered`'s values for `arg`, each checked by the flag's own parser.
fn layered_values(arg: &Arg, long: &str, layered: &Layered) -> Result<Vec<String>, clap::Error> {
    let values: Vec<String> = match arg.get_value_delimiter() {
        Some(delimiter) => layered
            .values
            .iter()
            .flat_map(|value| value.split(delimiter))
            .map(str::to_owned)
            .collect(),
        None => layered.values.clone(),
    };
    for value in &values {
        if let Err(error) = check(arg, value) {
            let shown = match secret(long) {
                Some(_) => "***".to_owned(),
                None => format!("{value:?}"),
            };
            return Err(usage(format!(
                "{}: {long} = {shown}: {error}",
                layered.from
            )));
        }
    }
    Ok(values)
}

/// `values` as `arg`'s default, shown nowhere: `--help` gives the flag's own default, and a
/// secret is never echoed.
fn with_default(arg: Arg, values: Vec<String>) -> Arg {
    let takes_value = !matches!(arg.get_action(), ArgAction::SetTrue);
    let arg = arg.default_values(values).required(false);
    if takes_value {
        arg.hide_default_value(true)
    } else {
        arg
    }
}

/// Runs `value` through `arg`'s parser, as clap will: the error, if any, as its parser says it.
fn check(arg: &Arg, value: &str) -> Result<(), String> {
    let probe = Arg::new("value")
        .long("value")
        .num_args(1)
        .value_parser(arg.get_value_parser().clone());
    Command::new("check")
        .no_binary_name(true)
        .arg(probe)
        .try_get_matches_from(["--value", value])
        .map(|_| ())
        .map_err(|error| match std::error::Error::source(&error) {
            Some(cause) => cause.to_string(),
            None => error
                .render()
                .to_string()
                .lines()
                .next()
                .unwrap_or_default()
                .trim_start_matches("error: ")
                .to_owned(),
        })
}

/// The command that runs, and its matches.
fn innermost<'a>(root: &'a Command, matches: &'a ArgMatches) -> (&'a Command, &'a ArgMatches) {
    let (mut command, mut matches) = (root, matches);
    while let Some((name, sub_matches)) = matches.subcommand() {
        match command.find_subcommand(name) {
            Some(sub) => (command, matches) = (sub, sub_matches),
            None => break,
        }
    }
    (command, matches)
}

/// `--require-database-url` without a database named: a usage error, so that a supervisor
/// does not restart what cannot start.
fn require_database_url(matches: &ArgMatches) -> Result<(), clap::Error> {
    let required = matches!(
        matches.try_get_one::<bool>("require_database_url"),
        Ok(Some(true))
    );
    // Named on the command line, in the environment, the file or a secret's file.
    let named = matches!(matches.try_get_raw("database_url"), Ok(Some(_)));
    if required && !named {
        return Err(clap::Error::raw(
            ErrorKind::MissingRequiredArgument,
            "no database named: set DATABASE_URL (or --database-url). \
             --require-database-url (INVENTORY_REQUIRE_DATABASE_URL) refuses the embedded \
             SQLite file, which would be this process's own\n",
        ));
    }
    Ok(())
}

/// `--print-config`: every setting of `command` in effect, as the file would hold it, each with
/// where it came from; secrets masked.
fn print_config(
    command: &Command,
    matches: &ArgMatches,
    layers: &Layers,
    file: Option<&Path>,
) -> String {
    let mut out = format!(
        "# The settings of `{}` in effect, each with where it came from; secrets masked.\n",
        command.get_bin_name().unwrap_or(command.get_name())
    );
    if let Some(file) = file {
        out.push_str(&format!("# configuration file: {}\n", file.display()));
    }
    let mut heading = None;
    for arg in command.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if NOT_SETTINGS.contains(&long) {
            continue;
        }
        if arg.get_help_heading() != heading {
            heading = arg.get_help_heading();
            out.push_str(&format!("\n# {}\n", heading.unwrap_or("Options")));
        }
        let id = arg.get_id().as_str();
        let values: Vec<String> = matches
            .get_raw(id)
            .into_iter()
            .flatten()
            .map(|value| mask(long, &value.to_string_lossy()))
            .collect();
        let from = match matches.value_source(id) {
            Some(ValueSource::CommandLine) => "command line".to_owned(),
            Some(ValueSource::EnvVariable) => format!(
                "env {}",
                arg.get_env()
                    .map(|name| name.to_string_lossy())
                    .unwrap_or_default()
            ),
            Some(ValueSource::DefaultValue) => layers
                .get(long)
                .map_or_else(|| "default".to_owned(), |layered| layered.from.clone()),
            _ => "default".to_owned(),
        };
        let line = match (values.as_slice(), arg.get_action()) {
            ([], _) => {
                out.push_str(&format!("# {long} is unset\n"));
                continue;
            }
            // As parsed: `1` and `yes` are true.
            (_, ArgAction::SetTrue) => {
                let set = matches!(matches.try_get_one::<bool>(id), Ok(Some(true)));
                format!("{long} = {set}")
            }
            (many, ArgAction::Append) => format!(
                "{long} = [{}]",
                many.iter()
                    .map(|value| quoted(value))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            (values, _) => format!("{long} = {}", quoted(&values.join(","))),
        };
        out.push_str(&format!("{line:<60} # {from}\n"));
    }
    out
}

fn mask(long: &str, value: &str) -> String {
    match secret(long) {
        Some(Secret::Url) => redact_url(value),
        Some(Secret::Opaque) => "***".to_owned(),
        None => value.to_owned(),
    }
}

/// A TOML basic string.
fn quoted(value: &str) -> String {
    serde_json::to_string(value).unwrap_or_else(|_| format!("{value:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::Cli;

    fn parse_from(args: Vec<OsString>) -> Result<Parsed<Cli>, clap::Error> {
        parse_program(args, INVENTORY)
    }

    fn parse(args: &[&str]) -> Result<Parsed<Cli>, clap::Error> {
        parse_from(args.iter().map(OsString::from).collect())
    }

    /// A configuration file of the test's own, removed when dropped.
    struct ConfigFile(PathBuf);

    impl ConfigFile {
        fn arg(&self) -> String {
            format!("--config={}", self.0.display())
        }
    }

    impl Drop for ConfigFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn file(text: &str) -> ConfigFile {
        let path =
            std::env::temp_dir().join(format!("inventory-config-{}.toml", uuid::Uuid::new_v4()));
        std::fs::write(&path, text).expect("the temporary directory is writable");
        ConfigFile(path)
    }

    fn printed(args: &[&str]) -> String {
        match parse(args) {
            Ok(Parsed::Print(text)) => text,
            other => panic!("not printed: {other:?}"),
        }
    }

    fn line<'a>(text: &'a str, long: &str) -> &'a str {
        text.lines()
            .find(|line| line.starts_with(&format!("{long} =")))
            .unwrap_or_else(|| panic!("no {long} in\n{text}"))
    }

    #[test]
    fn the_file_is_under_the_command_line_and_over_the_defaults() {
        let config = file(
            "ack-wait = \"45s\"\nmax-deliver = 7\nbackoff = [\"1s\", \"5s\"]\nconsumer = \"mine\"\n\
             log-format = \"json\"\n",
        );
        let text = printed(&[
            "inventory",
            "serve",
            &config.arg(),
            "--max-deliver",
            "3",
            "--print-config",
        ]);
        assert!(line(&text, "ack-wait").contains("\"45s\""), "{text}");
        assert!(line(&text, "ack-wait").contains("# file "), "{text}");
        assert!(line(&text, "max-deliver").contains("\"3\""), "{text}");
        assert!(
            line(&text, "max-deliver").ends_with("# command line"),
            "{text}"
        );
        assert!(
            line(&text, "backoff").contains("[\"1s\", \"5s\"]"),
            "{text}"
        );
        assert!(line(&text, "consumer").contains("\"mine\""), "{text}");
        assert!(
            line(&text, "max-ack-pending").ends_with("# default"),
            "{text}"
        );
        assert!(line(&text, "log-format").contains("\"json\""), "{text}");
    }

    #[test]
    fn a_key_that_is_no_setting_is_refused() {
        let config = file("ack_wait = \"45s\"\n");
        let error = parse(&["inventory", "serve", "--strategy", "natural", &config.arg()])
            .expect_err("a typo is refused");
        assert!(
            error.to_string().contains("ack_wait is not a setting"),
            "{error}"
        );
    }

    #[test]
    fn a_bad_value_in_the_file_names_the_file_and_the_key() {
        let config = file("ack-wait = \"30x\"\n");
        let error = parse(&["inventory", "serve", "--strategy", "natural", &config.arg()])
            .expect_err("the value is refused");
        let text = error.to_string();
        assert!(text.contains("ack-wait = \"30x\""), "{text}");
        assert!(text.contains(&config.0.display().to_string()), "{text}");
        assert_eq!(error.exit_code(), 2);
    }

    #[test]
    fn a_secret_from_the_file_is_masked_in_what_is_printed() {
        // Keys the test's environment leaves unset (scripts/test.sh exports DATABASE_URL and
        // NATS_URL, which rank above the file).
        let config = file(
            "orders-database-url = \"postgres://inventory:s3cret@db/stock?password=s3cret\"\n\
             nats-password = \"s3cret\"\nnats-user = \"inventory\"\n",
        );
        let text = printed(&[
            "inventory",
            "relay",
            "--source",
            "orders",
            &config.arg(),
            "--print-config",
        ]);
        assert!(!text.contains("s3cret"), "{text}");
        assert!(
            line(&text, "orders-database-url").contains("postgres://***@db/stock?password=***"),
            "{text}"
        );
        assert!(line(&text, "nats-password").contains("\"***\""), "{text}");
    }

    #[test]
    fn a_file_value_for_a_boolean_takes_the_words_the_environment_takes() {
        let config = file("skip-migrations = \"yes\"\nnats-require-tls = true\n");
        let text = printed(&[
            "inventory",
            "serve",
            "--strategy",
            "natural",
            &config.arg(),
            "--print-config",
        ]);
        assert!(
            line(&text, "skip-migrations").starts_with("skip-migrations = true "),
            "{text}"
        );
        let Ok(Parsed::Run(cli)) =
            parse(&["inventory", "serve", "--strategy", "natural", &config.arg()])
        else {
            panic!("serve runs");
        };
        let crate::cli::Command::Serve(serve) = cli.command else {
            panic!("serve");
        };
        assert!(serve.args.database.skip_migrations);
        assert!(serve.args.nats.nats_require_tls);
    }

    #[test]
    fn every_setting_of_serve_and_relay_names_its_environment_variable() {
        let command = configure(
            Cli::command(),
            &mut Vec::new(),
            &setting_names(&Cli::command(), INVENTORY),
            &Layers(BTreeMap::new()),
        )
        .expect("no layer, no error");
        for path in CONFIGURED {
            let sub = find(&command, path).expect("a configured command exists");
            for arg in sub.get_arguments() {
                let Some(long) = arg.get_long() else { continue };
                if NOT_SETTINGS.contains(&long) {
                    continue;
                }
                let env = arg
                    .get_env()
                    .map(|name| name.to_string_lossy().into_owned());
                assert_eq!(env, Some(env_name(long)), "{path:?} --{long}");
            }
        }
    }
}
