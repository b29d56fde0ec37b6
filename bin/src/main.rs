//! `llm-sidecar`: the executable. Parses flags into checked settings, sets up
//! logging, builds the runtime and hands over to the IO layer.

mod cli;
mod demo;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    cli::init_logging(cli.log_format());
    let code = match cli.command {
        cli::Command::Run(args) => cli::run(*args),
        cli::Command::MockEngine(args) => cli::mock_engine(args),
        cli::Command::Instances(args) => cli::instances(args),
        cli::Command::Bench(args) => cli::bench(args),
        cli::Command::Demo => demo::run(),
    };
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
