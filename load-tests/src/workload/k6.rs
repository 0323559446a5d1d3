//! `k6-log-batch`: MLflow's own log-batch benchmark workload on k6 (`load-tests/k6/log-batch.js`):
//! every virtual user posting `runs/log-batch` into one run.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context as _};
use serde_json::Value;

use super::{Load, Outcome};
use crate::cli::K6LogBatchArgs;
use crate::stack::{BenchStack, Target};
use crate::Report;

/// One batch shape (tags, params, metrics) of the k6 workload.
struct Shape<'a> {
    args: &'a K6LogBatchArgs,
    k6: PathBuf,
    tags: u32,
    params: u32,
    metrics: u32,
}

pub(crate) async fn run(
    args: &K6LogBatchArgs,
    stack: &BenchStack,
    command_line: &str,
) -> anyhow::Result<Report> {
    let k6 = args
        .k6
        .clone()
        .unwrap_or_else(|| mlscope_tests::venv().join("bin/k6"));
    if !k6.exists() {
        bail!(
            "{} not found: run scripts/setup first (it installs k6)",
            k6.display()
        );
    }
    let shapes: Vec<Shape> = args
        .shapes
        .iter()
        .map(|&(tags, params, metrics)| Shape {
            args,
            k6: k6.clone(),
            tags,
            params,
            metrics,
        })
        .collect();
    let title = format!(
        "k6-log-batch: {} virtual users, {} s per run, load = tags/params/metrics per batch",
        args.vus,
        args.duration.as_secs()
    );
    super::compare(
        stack,
        &shapes,
        args.rounds,
        &title,
        "log-batch/s",
        command_line,
    )
    .await
}

impl Load for Shape<'_> {
    fn label(&self) -> String {
        format!("{}/{}/{}", self.tags, self.params, self.metrics)
    }

    async fn run(&self, target: &Target, run_id: &str) -> anyhow::Result<Outcome> {
        let dir = tempfile::tempdir().context("a directory for k6's summary")?;
        let summary = dir.path().join("summary.json");
        let output = tokio::process::Command::new(&self.k6)
            .arg("run")
            .arg("--quiet")
            .arg("--no-usage-report")
            .args(["--vus", &self.args.vus.to_string()])
            .args(["--duration", &format!("{}s", self.args.duration.as_secs())])
            .args(["--summary-trend-stats", "avg,med,p(95),p(99),max"])
            .arg("--summary-export")
            .arg(&summary)
            .env("BASE_URL", &target.base_url)
            .env("RUN_ID", run_id)
            .env("TAGS", self.tags.to_string())
            .env("PARAMS", self.params.to_string())
            .env("METRICS", self.metrics.to_string())
            .env("K6_NO_USAGE_REPORT", "true")
            .arg(mlscope_tests::repo_root().join("load-tests/k6/log-batch.js"))
            .kill_on_drop(true)
            .output();
        let output = tokio::time::timeout(self.args.duration + Duration::from_secs(180), output)
            .await
            .context("k6 did not finish")?
            .context("starting k6")?;
        if !output.status.success() {
            bail!(
                "k6 against {} exited with {}: {}",
                target.kind,
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let text = std::fs::read_to_string(&summary).context("reading k6's summary")?;
        let summary: Value = serde_json::from_str(&text).context("k6's summary is not JSON")?;
        let metric =
            |name: &str, field: &str| summary["metrics"][name][field].as_f64().unwrap_or(0.0);
        Ok(Outcome {
            requests: metric("http_reqs", "count") as u64,
            rate: metric("http_reqs", "rate"),
            p95_ms: Some(metric("http_req_duration", "p(95)")),
            failed: metric("requests_failed", "count") as u64,
            acknowledged: metric("samples_acknowledged", "count") as u64,
            keys: (0..self.metrics).map(|i| format!("metric_{i}")).collect(),
            stored: 0,
        })
    }
}
