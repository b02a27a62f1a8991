//! The documents and `--help` agree: every flag a document gives an `inventory` command (in code,
//! as `inventory <command> … --flag`, or through the runbooks' `inv_service` and `inv_operator`
//! wrappers) is in that command's `--help`, and every `INVENTORY_…` variable a document names is
//! one the help names (or the configuration file's, or a secret's `_FILE`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use inventory_tests::binary::inventory;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// README.md and every document under docs/, by name.
fn documents() -> Vec<(String, String)> {
    let mut paths = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    docs.sort();
    paths.extend(docs);
    paths
        .into_iter()
        .map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read_to_string(&path).unwrap())
        })
        .collect()
}

/// The pieces of code a document shows: each line of a fenced block, each inline span.
fn code(text: &str) -> Vec<String> {
    let mut pieces = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if fenced {
            pieces.push(line.to_owned());
        } else {
            pieces.extend(line.split('`').skip(1).step_by(2).map(str::to_owned));
        }
    }
    pieces
}

/// `inventory <path…> --help`, once per path.
#[derive(Default)]
struct Helps(BTreeMap<Vec<String>, String>);

impl Helps {
    fn of(&mut self, path: &[String]) -> &str {
        self.0.entry(path.to_vec()).or_insert_with(|| {
            let output = Command::new(inventory())
                .args(path)
                .arg("--help")
                .env_clear()
                .env("PATH", std::env::var_os("PATH").unwrap_or_default())
                .output()
                .unwrap();
            String::from_utf8_lossy(&output.stdout).into_owned()
        })
    }

    /// The subcommands the help of `path` lists.
    fn commands(&mut self, path: &[String]) -> BTreeSet<String> {
        let help = self.of(path);
        let Some((_, listed)) = help.split_once("Commands:\n") else {
            return BTreeSet::new();
        };
        listed
            .lines()
            .take_while(|line| line.starts_with("  "))
            .filter_map(|line| line.split_whitespace().next())
            .filter(|command| *command != "help")
            .map(str::to_owned)
            .collect()
    }

    /// The long flags the help of `path` lists; for a command that takes the NATS and stream
    /// flags, those the program's help lists once for every command.
    fn flags(&mut self, path: &[String]) -> BTreeSet<String> {
        let mut flags = Self::listed(self.of(path));
        if self.of(path).contains(SHARED) {
            flags.extend(Self::listed(self.of(&[])));
        }
        flags
    }

    fn listed(help: &str) -> BTreeSet<String> {
        help.lines()
            .filter_map(|line| line.trim_start().split_once("--"))
            .filter(|(before, _)| before.is_empty() || before.ends_with(", "))
            .map(|(_, flag)| {
                flag.split([' ', '=', '\n', ',', '['])
                    .next()
                    .unwrap_or_default()
                    .to_owned()
            })
            .collect()
    }
}

/// What the help of a command that takes the shared NATS and stream flags says of them.
const SHARED: &str = "Also takes the NATS and stream flags";

/// The command a piece of code runs and the flags it gives it, if it runs one of ours.
fn invocation(helps: &mut Helps, piece: &str) -> Option<(Vec<String>, Vec<String>)> {
    // `a \| b` in a table is a choice between two flags, not a pipe.
    let piece = piece.replace("\\|", " ");
    let mut words = piece
        .split(['|', ';', '&', '(', ')', '$'])
        .find_map(|part| {
            let mut words = part.split_whitespace().peekable();
            while let Some(word) = words.next() {
                if ["inventory", "inv_service", "inv_operator"].contains(&word) {
                    return Some(words.map(str::to_owned).collect::<Vec<_>>());
                }
            }
            None
        })?
        .into_iter()
        .peekable();
    let mut path = Vec::new();
    while let Some(word) = words.peek() {
        if !helps.commands(&path).contains(word) {
            break;
        }
        path.push(words.next().unwrap_or_default());
    }
    if path.is_empty() {
        return None;
    }
    let flags = words
        .filter_map(|word| {
            word.trim_start_matches('[')
                .strip_prefix("--")
                .map(str::to_owned)
        })
        .map(|flag| {
            flag.split(['=', ',', '.', ':', ']'])
                .next()
                .unwrap_or_default()
                .to_owned()
        })
        .filter(|flag| !flag.is_empty())
        .collect();
    Some((path, flags))
}

#[test]
fn every_flag_a_document_gives_a_command_is_in_its_help() {
    let mut helps = Helps::default();
    let mut unknown = Vec::new();
    let mut checked = 0;
    for (document, text) in documents() {
        for piece in code(&text) {
            let Some((path, flags)) = invocation(&mut helps, &piece) else {
                continue;
            };
            let known = helps.flags(&path);
            for flag in flags {
                checked += 1;
                if !known.contains(&flag) {
                    unknown.push(format!(
                        "{document}: `inventory {} --{flag}` (in `{}`)",
                        path.join(" "),
                        piece.trim()
                    ));
                }
            }
        }
    }
    assert!(checked > 100, "only {checked} flags found in the documents");
    assert!(unknown.is_empty(), "not in --help:\n{}", unknown.join("\n"));
}

/// The `INVENTORY_…` names in `text`.
fn variables(text: &str) -> impl Iterator<Item = String> + '_ {
    text.match_indices("INVENTORY_").map(|(at, _)| {
        text[at..]
            .chars()
            .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
            .collect()
    })
}

/// Variables the documents name that are no setting of a command: the scripts' and the tests'
/// own, the NATS server configuration's, and those testing.md names as never read.
const NOT_SETTINGS: [&str; 7] = [
    "INVENTORY_BIN",
    "INVENTORY_TESTS_OWN_SERVERS_IN_OTHER_PASS",
    "INVENTORY_IMAGE_PROFILE",
    "INVENTORY_MODEL_SECONDS",
    "INVENTORY_OPERATOR_NATS_PASSWORD",
    "INVENTORY_BOGUS",
    "INVENTORY_FORCE",
];

#[test]
fn every_variable_a_document_names_is_one_the_help_names() {
    let mut helps = Helps::default();
    let mut named = BTreeSet::new();
    let mut paths = vec![Vec::new()];
    while let Some(path) = paths.pop() {
        for command in helps.commands(&path) {
            let mut sub = path.clone();
            sub.push(command);
            paths.push(sub);
        }
        named.extend(variables(helps.of(&path)));
    }
    assert!(named.contains("INVENTORY_ACK_WAIT"), "{named:?}");
    let mut unknown = BTreeSet::new();
    for (document, text) in documents() {
        // `INVENTORY_<FLAG>` names the rule, not a variable.
        for name in variables(&text).filter(|name| !name.ends_with('_')) {
            if !named.contains(&name) && !NOT_SETTINGS.contains(&name.as_str()) {
                unknown.insert(format!("{document}: {name}"));
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "named by no --help:\n{}",
        unknown.into_iter().collect::<Vec<_>>().join("\n")
    );
}
