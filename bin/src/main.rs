//! `llm-sidecar`: the executable. Parses flags into checked settings, sets up
//! logging, builds the runtime and hands over to the IO layer; each subcommand
//! lives in `commands/`.

mod cli;
mod commands;
mod runtime;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    runtime::init_logging(cli.log_format());
    let code = match cli.command {
        cli::Command::Run(args) => commands::run::run(*args),
        cli::Command::MockEngine(args) => commands::mock_engine::run(args),
        cli::Command::Instances(args) => commands::instances::run(args),
        cli::Command::Bench(args) => commands::bench::run(args),
        cli::Command::Demo => commands::demo::run(),
    };
    // Every code is one of the documented few; anything else would be a bug,
    // and must never read as 1 ("engine lost").
    ExitCode::from(u8::try_from(code).unwrap_or(u8::MAX))
}
