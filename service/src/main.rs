use std::process::ExitCode;

use clap::Parser;
use inventory_service::cli::{self, Cli};
use inventory_service::telemetry;

#[tokio::main]
async fn main() -> ExitCode {
    // Usage errors exit with 2 inside `parse`.
    let cli = Cli::parse();
    telemetry::init("warn");
    match cli::run(cli).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
