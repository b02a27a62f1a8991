//! `inventory demo`, `inventory compare` and `inventory bench …` belong to the study, which this
//! crate does not link: they run the `inventory-study` binary (the `inventory-benches` crate)
//! with the same arguments, as git and cargo run their external subcommands. Found beside this
//! binary first (a `cargo build` puts both in one directory), else on `PATH`.

use std::ffi::OsString;
use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::Command;

use anyhow::Context as _;

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
    let binary = study_binary();
    let error = Command::new(&binary)
        .arg(command)
        .args(forwarded.args)
        .exec();
    Err(error).with_context(|| {
        format!(
            "`inventory {command}` runs {} of the inventory-benches crate, which was not found \
             beside this binary or on PATH: build it with `cargo build --release --workspace` \
             (or `cargo install --path benches`)",
            binary.display()
        )
    })
}
