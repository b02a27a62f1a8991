//! `inventory demo`, `inventory compare` and `inventory bench …` belong to the study, which this
//! crate does not link: they run the `inventory-study` binary (the `inventory-benches` crate)
//! with the same arguments, as git and cargo run their external subcommands. So does `serve`
//! for the study's handlers ([`serves_the_study`]). Found beside this binary first (a `cargo
//! build` puts both in one directory), else on `PATH`.

use std::ffi::OsString;
use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::Command;

use anyhow::Context as _;

use crate::config;

/// The study binary's name.
pub const STUDY_BINARY: &str = "inventory-study";

/// Everything after the subcommand, `--help` included, untouched.
#[derive(Debug, Clone, clap::Args)]
pub struct Forwarded {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
    pub args: Vec<OsString>,
}

fn study_binary() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.join(STUDY_BINARY)))
        .filter(|beside| beside.exists())
        .unwrap_or_else(|| PathBuf::from(STUDY_BINARY))
}

/// Replaces this process with `inventory-study <command> <args>`: its output, signals and exit
/// code are the command's own. Returns only if it could not be started.
pub fn forward(command: &str, forwarded: Forwarded) -> anyhow::Result<bool> {
    let args = std::iter::once(OsString::from(command)).chain(forwarded.args);
    run_instead(command, args)
}

/// Whether `args` (the program's name first) ask `serve` for one of the study's handlers:
/// `--strategy inbox|email`, or a `--natural-handler` (the sea-orm reference is the study's),
/// on the command line, in the environment or in the configuration file.
pub fn serves_the_study(args: &[OsString]) -> bool {
    if subcommand(args) != Some("serve") {
        return false;
    }
    let [strategy, natural_handler] = config::settings(args, ["strategy", "natural-handler"]);
    matches!(strategy.as_deref(), Some("inbox" | "email")) || natural_handler.is_some()
}

/// `inventory <args>` as `inventory-study <args>`, as [`forward`] does.
pub fn forward_all(args: &[OsString]) -> anyhow::Result<bool> {
    let command = subcommand(args).unwrap_or_default().to_owned();
    run_instead(&command, args.iter().skip(1).cloned())
}

/// The subcommand `args` name: their first word that is neither a flag nor a global flag's
/// value.
fn subcommand(args: &[OsString]) -> Option<&str> {
    let mut words = args.iter().skip(1).filter_map(|arg| arg.to_str());
    while let Some(word) = words.next() {
        match word {
            "--config" | "--log-format" => {
                words.next();
            }
            flag if flag.starts_with('-') => {}
            command => return Some(command),
        }
    }
    None
}

fn run_instead(command: &str, args: impl IntoIterator<Item = OsString>) -> anyhow::Result<bool> {
    let binary = study_binary();
    let error = Command::new(&binary).args(args).exec();
    Err(error).with_context(|| {
        format!(
            "`inventory {command}` runs {} of the inventory-benches crate, which was not found \
             beside this binary or on PATH: build it with `cargo build --release --workspace` \
             (or `cargo install --path benches`)",
            binary.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use std::ffi::OsString;

    use super::serves_the_study;

    fn serves(args: &[&str]) -> bool {
        let args: Vec<OsString> = args.iter().map(OsString::from).collect();
        serves_the_study(&args)
    }

    #[test]
    fn serve_with_a_study_handler_is_the_study_binarys() {
        assert!(serves(&["inventory", "serve", "--strategy", "inbox"]));
        assert!(serves(&["inventory", "serve", "--strategy=email"]));
        assert!(serves(&[
            "inventory",
            "--log-format",
            "json",
            "serve",
            "--natural-handler",
            "orm"
        ]));
        assert!(!serves(&["inventory", "serve", "--strategy", "natural"]));
        assert!(!serves(&["inventory", "serve"]));
        // Another command's flag of the same name, or a value after `--`, is not serve's.
        assert!(!serves(&["inventory", "relay", "--strategy", "inbox"]));
        assert!(!serves(&[
            "inventory",
            "serve",
            "--",
            "--strategy",
            "inbox"
        ]));
    }

    #[test]
    fn the_configuration_file_can_name_a_study_handler() {
        let path =
            std::env::temp_dir().join(format!("inventory-study-{}.toml", uuid::Uuid::new_v4()));
        std::fs::write(&path, "strategy = \"email\"\n")
            .expect("the temporary directory is writable");
        let config = format!("--config={}", path.display());
        let forwarded = serves(&["inventory", "serve", &config]);
        let overridden = serves(&["inventory", "serve", &config, "--strategy", "natural"]);
        std::fs::remove_file(&path).expect("the file was written");
        assert!(forwarded);
        assert!(!overridden, "the command line is over the file");
    }
}
