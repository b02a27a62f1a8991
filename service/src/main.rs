use std::process::ExitCode;

use inventory_service::cli::{self, Command};
use inventory_service::config::{self, INVENTORY, Parsed};
use inventory_service::{study, telemetry};

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<_> = std::env::args_os().collect();
    if study::serves_the_study(&args) {
        return cli::exit_code(study::forward_all(&args));
    }
    // Usage errors, in a flag or in any layer of the settings, exit with 2 inside `parse`.
    let cli = match config::parse_program::<cli::Cli>(args, INVENTORY)
        .unwrap_or_else(|error| error.exit())
    {
        Parsed::Run(cli) => *cli,
        Parsed::Print(settings) => {
            print!("{settings}");
            return ExitCode::SUCCESS;
        }
    };
    // A long-running service says what it does; one-shot commands speak only of trouble.
    let default_filter = match cli.command {
        Command::Serve(_) | Command::Relay(_) => "info,sqlx=warn,sea_orm_migration=warn",
        _ => "warn",
    };
    telemetry::init(default_filter, cli.program.log_format);
    cli::exit_code(cli::run(cli).await)
}
