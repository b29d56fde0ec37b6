//! `llm-sidecar`: the executable. Parses flags into checked settings, sets up
//! logging, builds the runtime and hands over to the IO layer; each subcommand
//! lives in `commands/`.

/// `println!` that never panics: a closed pipe (`llm-sidecar instances | head`)
/// means the reader is gone, so the rest of the output is dropped quietly.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// `print!` that never panics (see `outln!`).
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stdout(), $($arg)*);
    }};
}

mod cli;
mod commands;
mod runtime;
mod shared;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    runtime::init_logging(cli.log_format());
    let exit = match cli.command {
        cli::Command::Run(args) => commands::run::run(*args),
        cli::Command::MockEngine(args) => commands::mock_engine::run(*args),
        cli::Command::Instances(args) => commands::instances::run(args),
        cli::Command::Probe(args) => commands::probe::run(args),
        cli::Command::CopyBinary(args) => commands::copy_binary::run(args),
        cli::Command::Bench(args) => commands::bench::run(args),
        cli::Command::Demo(args) => commands::demo::run(args),
    };
    exit.into()
}
