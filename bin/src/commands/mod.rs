//! One file per subcommand: its flags and its entry point, `run(args) -> exit code`.

pub mod bench;
pub mod copy_binary;
pub mod demo;
pub mod instances;
pub mod mock_engine;
pub mod probe;
pub mod run;
