//! `mlscope-bench`: measures what mlscope-proxy costs compared with talking to MLflow directly.
//!
//! The report (markdown) goes to stdout; progress and notes go to stderr.

use std::process::ExitCode;

use clap::Parser;
use mlscope_load::Cli;

/// `EX_USAGE`: the arguments parse but make no sense (a zero rate, an empty object...).
const EXIT_BAD_ARGUMENTS: u8 = 64;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(problem) = cli.validate() {
        eprintln!("mlscope-bench: {problem}");
        return ExitCode::from(EXIT_BAD_ARGUMENTS);
    }
    let command_line = mlscope_load::shell_words(std::env::args());
    match mlscope_load::run(&cli, &command_line) {
        Ok(report) => {
            print!("{}", report.markdown);
            if report.problems.is_empty() {
                return ExitCode::SUCCESS;
            }
            for problem in &report.problems {
                eprintln!("mlscope-bench: {problem}");
            }
            ExitCode::FAILURE
        }
        Err(error) => {
            eprintln!("mlscope-bench: {error:#}");
            ExitCode::FAILURE
        }
    }
}
