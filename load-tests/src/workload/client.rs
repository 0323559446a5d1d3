//! `client-fleet`: the MLflow Python client's own `log_metric` from many rank threads into one
//! run (`load-tests/python/client_fleet.py`): the calls every rank of a training job makes.

use std::time::Duration;

use anyhow::{bail, Context as _};
use serde_json::Value;

use super::{Load, Outcome};
use crate::cli::ClientFleetArgs;
use crate::stack::{BenchStack, Target};
use crate::Report;

/// One number of rank threads.
struct Ranks<'a> {
    args: &'a ClientFleetArgs,
    threads: u32,
}

pub(crate) async fn run(
    args: &ClientFleetArgs,
    stack: &BenchStack,
    command_line: &str,
) -> anyhow::Result<Report> {
    let loads: Vec<Ranks> = args
        .threads
        .iter()
        .map(|&threads| Ranks { args, threads })
        .collect();
    let title = format!(
        "client-fleet: MlflowClient.log_metric from rank threads, {} s per run",
        args.duration.as_secs()
    );
    super::compare(
        stack,
        &loads,
        args.rounds,
        &title,
        "log_metric calls/s",
        command_line,
    )
    .await
}

impl Load for Ranks<'_> {
    fn label(&self) -> String {
        format!("{} ranks", self.threads)
    }

    async fn run(&self, target: &Target, run_id: &str) -> anyhow::Result<Outcome> {
        let python = mlscope_tests::venv().join("bin/python");
        let output = tokio::process::Command::new(&python)
            .arg(mlscope_tests::repo_root().join("load-tests/python/client_fleet.py"))
            .env("MLFLOW_TRACKING_URI", &target.base_url)
            .env("RUN_ID", run_id)
            .env("THREADS", self.threads.to_string())
            .env("DURATION", self.args.duration.as_secs_f64().to_string())
            .env("NO_PROXY", "127.0.0.1,localhost")
            .env_remove("HTTP_PROXY")
            .env_remove("http_proxy")
            .current_dir(std::env::temp_dir())
            .kill_on_drop(true)
            .output();
        let output = tokio::time::timeout(self.args.duration + Duration::from_secs(600), output)
            .await
            .context("the client fleet did not finish")?
            .with_context(|| format!("starting {}", python.display()))?;
        if !output.status.success() {
            bail!(
                "the client fleet against {} exited with {}: {}",
                target.kind,
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let stdout = String::from_utf8_lossy(&output.stdout);
        let line = stdout.lines().last().unwrap_or_default();
        let summary: Value = serde_json::from_str(line)
            .with_context(|| format!("the client fleet printed no summary: {stdout}"))?;
        let acknowledged = summary["acknowledged"].as_u64().unwrap_or(0);
        let elapsed = summary["elapsed_s"].as_f64().unwrap_or(1.0);
        Ok(Outcome {
            requests: acknowledged + summary["failed"].as_u64().unwrap_or(0),
            rate: acknowledged as f64 / elapsed,
            p95_ms: None,
            failed: summary["failed"].as_u64().unwrap_or(0),
            acknowledged,
            keys: summary["keys"]
                .as_array()
                .map(|k| {
                    k.iter()
                        .filter_map(|k| k.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default(),
            stored: 0,
        })
    }
}
