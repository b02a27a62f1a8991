use std::process::ExitCode;

use clap::Parser;
use inventory_service::cli::{self, Cli, Command};
use inventory_service::telemetry;

#[tokio::main]
async fn main() -> ExitCode {
    // Usage errors exit with 2 inside `parse`.
    let cli = Cli::parse();
    // A long-running service says what it does; one-shot commands speak only of trouble.
    let default_filter = match cli.command {
        Command::Serve(_) | Command::Relay(_) => "info,sqlx=warn,sea_orm_migration=warn",
        _ => "warn",
    };
    telemetry::init(default_filter);
    cli::exit_code(cli::run(cli).await)
}
