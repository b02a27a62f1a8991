use std::process::ExitCode;

use clap::Parser;
use inventory_benches::cli::{self, Cli, Command};
use inventory_service::telemetry;

#[tokio::main]
async fn main() -> ExitCode {
    // Usage errors exit with 2 inside `parse`.
    let cli = Cli::parse();
    let default_filter = match cli.command {
        // The comparison's crashes are planned: the loop's warning for each would be noise.
        Command::Compare(_) => "warn,inventory_service::runtime=error",
        _ => "warn",
    };
    telemetry::init(default_filter, telemetry::LogFormat::Text);
    inventory_service::cli::exit_code(cli::run(cli).await)
}
