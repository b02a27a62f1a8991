use std::process::ExitCode;

use inventory_benches::cli::{self, CONFIGURED, Cli, Command};
use inventory_service::config::{self, Parsed};
use inventory_service::telemetry;

#[tokio::main]
async fn main() -> ExitCode {
    // Usage errors, in a flag or in any layer of `serve`'s settings, exit with 2 here.
    let args = std::env::args_os().collect();
    let cli = match config::parse_program::<Cli>(args, CONFIGURED) {
        Ok(Parsed::Run(cli)) => *cli,
        Ok(Parsed::Print(settings)) => {
            print!("{settings}");
            return ExitCode::SUCCESS;
        }
        Err(error) => error.exit(),
    };
    let default_filter = match cli.command {
        // The comparison's crashes are planned: the loop's warning for each would be noise.
        Command::Compare(_) => "warn,inventory_service::runtime=error",
        // A long-running service says what it does.
        Command::Serve(_) => "info,sqlx=warn,sea_orm_migration=warn",
        _ => "warn",
    };
    telemetry::init(default_filter, cli.program.log_format);
    inventory_service::cli::exit_code(cli::run(cli).await)
}
