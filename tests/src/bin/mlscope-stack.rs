//! The local stack behind the README's quick start: SeaweedFS, MLflow and mlscope-proxy on fixed
//! loopback ports (a busy port is replaced by a free one), until Ctrl-C or SIGTERM.

use std::net::TcpListener;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;
use mlscope_tests::{free_port, StackOptions, StackPorts, TestStack};

#[derive(Debug, Parser)]
#[command(about = "Runs SeaweedFS, MLflow and mlscope-proxy locally until Ctrl-C")]
struct Args {
    /// Port of the proxy, the URL to give MLflow clients and browsers.
    #[arg(long, env = "MLSCOPE_STACK_PROXY_PORT", default_value_t = 5001)]
    proxy_port: u16,
    /// Port of the proxy's admin listener (/healthz, /readyz, /metrics).
    #[arg(long, env = "MLSCOPE_STACK_ADMIN_PORT", default_value_t = 9464)]
    admin_port: u16,
    /// Port of MLflow itself.
    #[arg(long, env = "MLSCOPE_STACK_MLFLOW_PORT", default_value_t = 5000)]
    mlflow_port: u16,
    /// Port of the S3 endpoint (SeaweedFS).
    #[arg(long, env = "MLSCOPE_STACK_S3_PORT", default_value_t = 8333)]
    s3_port: u16,
    /// MLflow's backend store URI [default: an SQLite file in the stack's temporary directory].
    #[arg(long, env = "MLSCOPE_STACK_MLFLOW_BACKEND")]
    mlflow_backend: Option<String>,
    /// Extra arguments for mlscope-proxy, e.g. `--proxy-arg=--log-format=text`.
    #[arg(long = "proxy-arg", allow_hyphen_values = true)]
    proxy_args: Vec<String>,
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("mlscope-stack: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<()> {
    let ports = StackPorts {
        s3: preferred_or_free(args.s3_port),
        mlflow: preferred_or_free(args.mlflow_port),
        proxy: preferred_or_free(args.proxy_port),
        admin: preferred_or_free(args.admin_port),
    };
    let options = StackOptions {
        proxy: true,
        proxy_args: args.proxy_args,
        mlflow_backend: args.mlflow_backend,
    };
    let dir = tempfile::Builder::new()
        .prefix("mlscope-stack-")
        .tempdir()
        .context("creating the stack directory")?;
    eprintln!(
        "starting SeaweedFS, MLflow (15–25 s) and mlscope-proxy in {}",
        dir.path().display()
    );
    let stack = TestStack::start_in(dir, &options, ports)?;
    let proxy = stack
        .proxy
        .as_ref()
        .expect("the stack was started with a proxy");
    println!("MLflow UI and API (through mlscope): {}", proxy.url);
    println!("MLflow directly:                     {}", stack.mlflow.url);
    println!(
        "S3 endpoint (bucket {}):         {}",
        stack.s3.bucket, stack.s3.url
    );
    println!(
        "mlscope admin metrics:               {}/metrics",
        proxy.admin_url
    );
    println!(
        "logs and data:                       {}",
        stack.dir.path().display()
    );
    println!("export MLFLOW_TRACKING_URI={}", proxy.url);
    println!("press Ctrl-C to stop");
    wait_for_shutdown_signal()?;
    eprintln!("stopping");
    drop(stack);
    Ok(())
}

/// `port` if it can be bound on loopback now, else a free one, so a second stack or a local
/// MLflow on 5000 does not keep the quick start from working.
fn preferred_or_free(port: u16) -> u16 {
    match TcpListener::bind(("127.0.0.1", port)) {
        Ok(_) => port,
        Err(_) => {
            let free = free_port();
            eprintln!("port {port} is busy, using {free}");
            free
        }
    }
}

fn wait_for_shutdown_signal() -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building the signal runtime")?;
    runtime.block_on(async {
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .context("listening for SIGTERM")?;
        tokio::select! {
            result = tokio::signal::ctrl_c() => result.context("listening for Ctrl-C"),
            _ = terminate.recv() => Ok(()),
        }
    })
}
