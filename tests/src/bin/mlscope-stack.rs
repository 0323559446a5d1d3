//! The local stack behind the README's quick start: SeaweedFS, MLflow and mlscope-proxy on fixed
//! loopback ports (a busy port is replaced by a free one), until Ctrl-C or SIGTERM. A demo run
//! gets mlscope-collector's scoped series (through the proxy) beside MLflow's own system metrics
//! (posted straight to MLflow), so the difference shows in the MLflow UI.
//!
//! MLflow's database, the artifacts (SeaweedFS) and the proxy's state live in one named
//! directory that outlives the stack: clients may be pointed at it, and a restart shows
//! everything logged before. `--fresh` starts from an empty directory.

use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
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
    /// Where MLflow's database, the artifacts, the proxy's state and the logs are kept across
    /// restarts [default: .stack in the repository].
    #[arg(long, env = "MLSCOPE_STACK_DATA_DIR", value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// Throw away everything in the data directory first: start with no experiments, runs or
    /// artifacts.
    #[arg(long)]
    fresh: bool,
    /// MLflow's backend store URI [default: mlflow.db, SQLite, in the data directory].
    #[arg(long, env = "MLSCOPE_STACK_MLFLOW_BACKEND")]
    mlflow_backend: Option<String>,
    /// The Python virtual environment whose MLflow to run, e.g. one with another MLflow version
    /// [default: the project's, scripts/setup's MLSCOPE_VENV].
    #[arg(long, env = "MLSCOPE_STACK_MLFLOW_VENV", value_name = "DIR")]
    mlflow_venv: Option<PathBuf>,
    /// Extra arguments for mlscope-proxy, e.g. `--proxy-arg=--log-format=json`.
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
        mlflow_venv: args.mlflow_venv,
        ..StackOptions::default()
    };
    let dir = args.data_dir.unwrap_or_else(|| repo_root().join(".stack"));
    let _lock = DataLock::take(&dir, args.fresh)?;
    eprintln!(
        "starting SeaweedFS, MLflow (15–25 s) and mlscope-proxy; data in {}",
        dir.display()
    );
    let stack = TestStack::start_kept(&dir, &options, ports)?;
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
        "logs and data (kept; --fresh clears): {}",
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

/// One stack per data directory: `stack.pid` names the stack using it. Removed when the stack
/// stops; one left by a stack that was killed names a pid that is gone (or reused by something
/// else, which `/proc/<pid>/exe` tells apart).
struct DataLock {
    path: PathBuf,
}

impl DataLock {
    fn take(dir: &Path, fresh: bool) -> Result<DataLock> {
        let path = dir.join("stack.pid");
        if let Ok(pid) = fs::read_to_string(&path) {
            let pid = pid.trim();
            let exe = fs::read_link(format!("/proc/{pid}/exe")).ok();
            if exe.is_some() && exe == std::env::current_exe().ok() {
                bail!(
                    "another stack (pid {pid}) is using {}; stop it first, or give this one \
                     another --data-dir",
                    dir.display()
                );
            }
        }
        if fresh && dir.exists() {
            eprintln!("--fresh: removing {}", dir.display());
            fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
        }
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        fs::write(&path, std::process::id().to_string())
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(DataLock { path })
    }
}

impl Drop for DataLock {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

/// The demo run: one rank measured twice. `mlscope-collector` posts through the proxy
/// (`system/<node>/node_*`, `system/rank-0/container_*`, ...); MLflow's own monitor posts
/// straight to MLflow, under the names MLflow gives them (`system/cpu_utilization_percentage`).
/// Stopping the stack ends the run (FINISHED), so the runs of earlier starts do not look alive.
struct Demo {
    collector: Option<Process>,
    mlflow_monitor: Option<Process>,
    client: reqwest::blocking::Client,
    proxy_url: String,
    run_id: String,
}

impl Demo {
    const EXPERIMENT: &'static str = "mlscope-demo";
    /// MLflow 3 opens an experiment without this tag in its GenAI view, where a training run is
    /// shown as an "evaluation run"; this value asks for the classic machine-learning view.
    const EXPERIMENT_KIND: (&'static str, &'static str) =
        ("mlflow.experimentKind", "custom_model_development");
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
            json!({
                "name": Self::EXPERIMENT,
                "tags": [{ "key": Self::EXPERIMENT_KIND.0, "value": Self::EXPERIMENT_KIND.1 }],
            }),
        ) {
            Ok(created) => created["experiment_id"].clone(),
            // A kept data directory already has it.
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
        // An experiment from before the tag was set gets it too.
        mlflow_post(
            &client,
            &proxy.url,
            "experiments/set-experiment-tag",
            json!({
                "experiment_id": experiment_id,
                "key": Self::EXPERIMENT_KIND.0,
                "value": Self::EXPERIMENT_KIND.1,
            }),
        )?;
        let now = now_ms()?;
        // Each start's run has a name of its own: the runs of a kept data directory are numbered.
        let earlier = mlflow_post(
            &client,
            &proxy.url,
            "runs/search",
            json!({ "experiment_ids": [experiment_id], "max_results": 1000 }),
        )
        .ok()
        .and_then(|found| found["runs"].as_array().map(Vec::len))
        .unwrap_or(0);
        let run = mlflow_post(
            &client,
            &proxy.url,
            "runs/create",
            json!({
                "experiment_id": experiment_id,
                "start_time": now,
                "run_name": format!("demo-{}-rank-0-collector-and-mlflow-monitor", earlier + 1),
            }),
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
            // MLflow 3's UI opens an experiment in its GenAI view unless the URL asks for the
            // machine-learning one (the experiment's kind tag alone did not do it).
            "demo run ({}):                     {}/#/experiments/{}/runs/{run_id}?workflowType=machine_learning",
            Self::EXPERIMENT,
            proxy.url,
            json_id(&experiment_id)
        );
        println!("  system/<node>/node_*, rootfs_* and system/rank-0/container_*, network_*: mlscope-collector (through the proxy)");
        println!("  system/cpu_utilization_percentage, system_memory_*, disk_*, network_*: MLflow's own monitor (straight to MLflow)");
        println!("  artifacts/checkpoints/epoch_0.txt: uploaded through the proxy");
        println!(
            "  its report, live (written into the run as mlscope/report.html when it ends): {}/runs/{run_id}/report",
            proxy.admin_url
        );
        Ok(Demo {
            collector: Some(collector),
            mlflow_monitor: Some(monitor),
            client,
            proxy_url: proxy.url.clone(),
            run_id,
        })
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        // The collector flushes its last sample through the proxy, then the run ends.
        if let Some(mut collector) = self.collector.take() {
            collector.terminate();
        }
        self.mlflow_monitor = None;
        let ended = now_ms().map_err(anyhow::Error::from).and_then(|now| {
            mlflow_post(
                &self.client,
                &self.proxy_url,
                "runs/update",
                json!({ "run_id": self.run_id, "status": "FINISHED", "end_time": now }),
            )
        });
        if let Err(error) = ended {
            eprintln!("mlscope-stack: the demo run was not ended: {error:#}");
        }
    }
}

fn now_ms() -> Result<u64, std::time::SystemTimeError> {
    Ok(SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as u64)
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
