//! The local stack behind the README's quick start: SeaweedFS, MLflow and mlscope-proxy on fixed
//! loopback ports (a busy port is replaced by a free one), until Ctrl-C or SIGTERM. A demo run
//! gets mlscope-collector's scoped series (through the proxy) beside MLflow's own system metrics
//! (posted straight to MLflow), so the difference shows in the MLflow UI.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, ExitCode};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use clap::Parser;
use mlscope_tests::{
    find_collector_binary, free_port, repo_root, venv, Process, ProxyProcess, S3Store,
    StackOptions, StackPorts, TestStack,
};
use serde_json::{json, Value};

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
    /// Forward artifact requests to MLflow instead of serving them from SeaweedFS in the proxy.
    #[arg(long, env = "MLSCOPE_STACK_NO_ARTIFACT_GATEWAY")]
    no_artifact_gateway: bool,
    /// Do not start the demo run (mlscope-collector and MLflow's own monitor).
    #[arg(long, env = "MLSCOPE_STACK_NO_DEMO")]
    no_demo: bool,
    /// Sampling interval of the demo's collector and MLflow monitor, in seconds.
    #[arg(long, env = "MLSCOPE_STACK_DEMO_INTERVAL", default_value_t = 5)]
    demo_interval: u32,
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
    // A missing environment or binary is one line that says what to run, before anything starts.
    mlscope_tests::preflight(false)?;
    let ports = StackPorts {
        s3: preferred_or_free(args.s3_port),
        mlflow: preferred_or_free(args.mlflow_port),
        proxy: preferred_or_free(args.proxy_port),
        admin: preferred_or_free(args.admin_port),
    };
    // The proxy serves the artifact API from the same bucket and prefix MLflow writes to.
    let mut proxy_args = Vec::new();
    if !args.no_artifact_gateway {
        proxy_args.extend([
            "--artifacts-destination".to_owned(),
            format!("s3://{}/{}", S3Store::BUCKET, S3Store::PREFIX),
            "--s3-endpoint-url".to_owned(),
            format!("http://127.0.0.1:{}", ports.s3),
            "--s3-quirks".to_owned(),
            "seaweedfs".to_owned(),
        ]);
    }
    proxy_args.extend(args.proxy_args);
    let options = StackOptions {
        proxy: true,
        proxy_args,
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
    let demo = if args.no_demo {
        None
    } else {
        match Demo::start(&stack, proxy, args.demo_interval) {
            Ok(demo) => Some(demo),
            Err(error) => {
                eprintln!("mlscope-stack: no demo run: {error:#}");
                None
            }
        }
    };
    println!("export MLFLOW_TRACKING_URI={}", proxy.url);
    println!("press Ctrl-C to stop");
    wait_for_shutdown_signal()?;
    eprintln!("stopping");
    // The collector flushes its last sample through the proxy before the proxy stops.
    drop(demo);
    drop(stack);
    Ok(())
}

/// The demo run: one rank measured twice. `mlscope-collector` posts through the proxy
/// (`system/<node>/node_*`, `system/rank-0/container_*`, ...); MLflow's own monitor posts
/// straight to MLflow, under the names MLflow gives them (`system/cpu_utilization_percentage`).
struct Demo {
    _collector: Process,
    _mlflow_monitor: Process,
}

impl Demo {
    const EXPERIMENT: &'static str = "mlscope-demo";
    /// MLflow's monitor gives up after this long; the collector runs until the stack stops.
    const MONITOR_SECONDS: u32 = 7 * 24 * 3600;

    fn start(stack: &TestStack, proxy: &ProxyProcess, interval: u32) -> Result<Demo> {
        let collector_binary = find_collector_binary()?;
        let client = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()?;
        let experiment_id = match mlflow_post(
            &client,
            &proxy.url,
            "experiments/create",
            json!({ "name": Self::EXPERIMENT }),
        ) {
            Ok(created) => created["experiment_id"].clone(),
            // A persistent backend (--mlflow-backend) already has it.
            Err(_) => client
                .get(format!(
                    "{}/api/2.0/mlflow/experiments/get-by-name",
                    proxy.url
                ))
                .query(&[("experiment_name", Self::EXPERIMENT)])
                .send()?
                .json::<Value>()?["experiment"]["experiment_id"]
                .clone(),
        };
        let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as u64;
        let run = mlflow_post(
            &client,
            &proxy.url,
            "runs/create",
            json!({ "experiment_id": experiment_id, "start_time": now, "run_name": "rank-0-collector-and-mlflow-monitor" }),
        )?;
        let run_id = run["run"]["info"]["run_id"]
            .as_str()
            .context("runs/create answered no run id")?
            .to_owned();
        let dir: &Path = stack.dir.path();

        let mut collector = Command::new(collector_binary);
        collector
            .env("MLFLOW_TRACKING_URI", &proxy.url)
            .env("MLFLOW_RUN_ID", &run_id)
            .env("RANK", "0")
            .args(["--interval", &interval.to_string()]);
        let collector = Process::spawn(
            "mlscope-collector",
            &collector,
            &dir.join("demo-collector.log"),
        )?;
        let mut monitor = Command::new(venv().join("bin/python"));
        monitor
            .arg(repo_root().join("tests/python/demo_monitor.py"))
            .args([run_id.as_str(), &Self::MONITOR_SECONDS.to_string()])
            .env("MLFLOW_TRACKING_URI", &stack.mlflow.url)
            .env(
                "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL",
                interval.to_string(),
            );
        let monitor = Process::spawn(
            "MLflow system-metrics monitor",
            &monitor,
            &dir.join("demo-mlflow-monitor.log"),
        )?;

        // A checkpoint through the proxy: with the gateway it goes straight to SeaweedFS.
        let artifact = format!(
            "{}/api/2.0/mlflow-artifacts/artifacts/{}/{run_id}/artifacts/checkpoints/epoch_0.txt",
            proxy.url,
            json_id(&experiment_id)
        );
        if let Err(error) = client
            .put(&artifact)
            .body("demo checkpoint\n")
            .send()
            .and_then(|r| r.error_for_status())
        {
            eprintln!("mlscope-stack: the demo checkpoint was not stored: {error}");
        }
        println!(
            "demo run ({}):                     {}/#/experiments/{}/runs/{run_id}",
            Self::EXPERIMENT,
            proxy.url,
            json_id(&experiment_id)
        );
        println!("  system/<node>/node_*, rootfs_* and system/rank-0/container_*, network_*: mlscope-collector (through the proxy)");
        println!("  system/cpu_utilization_percentage, system_memory_*, disk_*, network_*: MLflow's own monitor (straight to MLflow)");
        println!("  artifacts/checkpoints/epoch_0.txt: uploaded through the proxy");
        Ok(Demo {
            _collector: collector,
            _mlflow_monitor: monitor,
        })
    }
}

fn mlflow_post(
    client: &reqwest::blocking::Client,
    base: &str,
    path: &str,
    body: Value,
) -> Result<Value> {
    let response = client
        .post(format!("{base}/api/2.0/mlflow/{path}"))
        .json(&body)
        .send()?;
    let status = response.status();
    let answer: Value = response.json().unwrap_or(Value::Null);
    if !status.is_success() {
        bail!("{path}: {status} {answer}");
    }
    Ok(answer)
}

fn json_id(id: &Value) -> String {
    id.as_str().map_or_else(|| id.to_string(), str::to_owned)
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
