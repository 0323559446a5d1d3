//! The MLflow calls the pass-through benchmark makes, one [`Workload`] per target.
//!
//! Every target logs into a run of its own, created through that target, so all runs grow at the
//! same pace and no target's requests make another's slower (MLflow's cost per log-batch grows with
//! the run's metric history).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context as _};
use serde_json::{json, Value};

use super::open_loop::RequestError;
use crate::cli::Endpoint;
use crate::http;
use crate::stack::Target;

/// Keys are `bench/metric_<n>`: outside `system/`, so mlscope passes them through untouched.
const METRIC_PREFIX: &str = "bench/metric_";

/// A target's HTTP client and run.
#[derive(Clone)]
pub(crate) struct Workload {
    client: reqwest::Client,
    base_url: Arc<str>,
    run_id: Arc<str>,
    metrics_per_request: usize,
    /// Next `step` for log-batch: unique per request within the run.
    next_step: Arc<AtomicU64>,
}

impl Workload {
    /// Creates a run in `experiment_id` through `target` and a keep-alive client for it.
    pub(crate) async fn prepare(
        target: &Target,
        experiment_id: &str,
        metrics_per_request: usize,
        max_in_flight: usize,
    ) -> anyhow::Result<Workload> {
        let client = http::client(max_in_flight)?;
        let created = post_json(
            &client,
            &format!("{}/api/2.0/mlflow/runs/create", target.base_url),
            &json!({
                "experiment_id": experiment_id,
                "run_name": format!("bench-{}", target.kind),
                "start_time": unix_millis(),
            }),
        )
        .await
        .with_context(|| format!("creating the benchmark run through {}", target.kind))?;
        let run_id = created
            .pointer("/run/info/run_id")
            .and_then(Value::as_str)
            .with_context(|| {
                format!(
                    "runs/create through {} returned no run id: {created}",
                    target.kind
                )
            })?;
        Ok(Workload {
            client,
            base_url: target.base_url.as_str().into(),
            run_id: run_id.into(),
            metrics_per_request,
            next_step: Arc::new(AtomicU64::new(0)),
        })
    }

    /// One request to `endpoint`; resolves once the whole response body has arrived.
    pub(crate) fn request(
        &self,
        endpoint: Endpoint,
    ) -> impl Future<Output = Result<(), RequestError>> + Send + 'static {
        let builder = match endpoint {
            Endpoint::LogBatch => {
                let step = self.next_step.fetch_add(1, Ordering::Relaxed);
                self.client
                    .post(format!("{}/api/2.0/mlflow/runs/log-batch", self.base_url))
                    .json(&log_batch_body(
                        &self.run_id,
                        self.metrics_per_request,
                        step,
                        unix_millis(),
                    ))
            }
            Endpoint::RunsGet => self
                .client
                .get(format!("{}/api/2.0/mlflow/runs/get", self.base_url))
                .query(&[("run_id", &*self.run_id)]),
        };
        async move {
            let response = builder.send().await.map_err(classify)?;
            let status = response.status();
            // Read the body to the end: the client waits for it too, and a proxy may still be
            // streaming it after the headers went out.
            response.bytes().await.map_err(classify)?;
            if status.is_success() {
                Ok(())
            } else {
                Err(RequestError::Status(status.as_u16()))
            }
        }
    }
}

/// Creates the experiment all benchmark runs live in, through `target` (normally direct MLflow).
pub(crate) async fn create_experiment(target: &Target, name: &str) -> anyhow::Result<String> {
    let client = http::client(1)?;
    let created = post_json(
        &client,
        &format!("{}/api/2.0/mlflow/experiments/create", target.base_url),
        &json!({ "name": name }),
    )
    .await
    .context("creating the benchmark experiment")?;
    created
        .get("experiment_id")
        .and_then(Value::as_str)
        .map(str::to_string)
        .with_context(|| format!("experiments/create returned no experiment id: {created}"))
}

/// `GET /version` of MLflow, for the report. `None` when it does not answer.
pub(crate) async fn mlflow_version(target: &Target) -> Option<String> {
    let client = http::client(1).ok()?;
    let response = client
        .get(format!("{}/version", target.base_url))
        .send()
        .await
        .ok()?;
    if !response.status().is_success() {
        return None;
    }
    response.text().await.ok().map(|v| v.trim().to_string())
}

fn log_batch_body(run_id: &str, metrics: usize, step: u64, timestamp: u64) -> Value {
    let metrics: Vec<Value> = (0..metrics)
        .map(|n| {
            json!({
                "key": format!("{METRIC_PREFIX}{n}"),
                "value": (step as f64) * 0.5 + n as f64,
                "timestamp": timestamp,
                "step": step,
            })
        })
        .collect();
    json!({ "run_id": run_id, "metrics": metrics })
}

async fn post_json(client: &reqwest::Client, url: &str, body: &Value) -> anyhow::Result<Value> {
    let response = client
        .post(url)
        .json(body)
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .with_context(|| format!("POST {url}"))?;
    let status = response.status();
    let text = response
        .text()
        .await
        .with_context(|| format!("reading the answer of POST {url}"))?;
    if !status.is_success() {
        bail!("POST {url} answered {status}: {text}");
    }
    serde_json::from_str(&text)
        .with_context(|| format!("POST {url} answered with invalid JSON: {text}"))
}

fn classify(error: reqwest::Error) -> RequestError {
    if error.is_timeout() {
        RequestError::Timeout
    } else {
        RequestError::Transport
    }
}

fn unix_millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_batch_body_carries_one_step_and_timestamp_for_all_metrics() {
        let body = log_batch_body("abc", 3, 7, 1_700_000_000_000);
        assert_eq!(body["run_id"], "abc");
        let metrics = body["metrics"].as_array().expect("metrics array");
        assert_eq!(metrics.len(), 3);
        assert!(metrics
            .iter()
            .all(|m| m["step"] == 7 && m["timestamp"] == 1_700_000_000_000u64));
        assert_eq!(metrics[2]["key"], "bench/metric_2");
    }
}
