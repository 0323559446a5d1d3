//! Benchmarks for mlscope: what mlscope-proxy adds to MLflow requests (next to nginx, the usual
//! alternative), and how it streams large artifacts.
//!
//! Every benchmark starts its own stack through the `mlscope-tests` harness — loopback only, free
//! ports, one temporary directory — and bounds every request loop in count and time.

mod artifact;
mod cli;
mod http;
mod markdown;
mod passthrough;
mod progress;
mod stack;
mod units;

pub use cli::{ArtifactArgs, Cli, Command, Endpoint, PassthroughArgs, StackArgs};
pub use markdown::shell_words;
pub use units::ByteSize;

use anyhow::Context as _;

use stack::BenchStack;

/// A finished benchmark: the markdown for stdout, and what made it a failure (empty when nothing).
pub struct Report {
    pub markdown: String,
    pub problems: Vec<String>,
}

/// Starts the stack the command needs, runs the benchmark and tears the stack down again.
/// `command_line` is quoted into the report as the way to reproduce it.
pub fn run(cli: &Cli, command_line: &str) -> anyhow::Result<Report> {
    let (stack_args, with_nginx) = match &cli.command {
        Command::Passthrough(args) => (&args.stack, true),
        Command::Artifact(args) => (&args.stack, false),
    };
    let starting = progress::spinner(if with_nginx {
        "starting S3 store, MLflow, mlscope-proxy and nginx"
    } else {
        "starting S3 store, MLflow and mlscope-proxy"
    });
    let stack = BenchStack::start(stack_args, with_nginx);
    starting.finish_and_clear();
    let stack = stack?;

    // One thread: the load generator should take as little as possible of the two cores it shares
    // with MLflow, nginx and the proxy, and the rates involved need far less than one.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        match &cli.command {
            Command::Passthrough(args) => passthrough::run(args, &stack, command_line).await,
            Command::Artifact(args) => artifact::run(args, &stack, command_line).await,
        }
    })
}
