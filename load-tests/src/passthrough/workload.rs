//! The MLflow calls the pass-through benchmark makes, one [`Workload`] per target.
//!
//! Every target logs into a run of its own, created through that target, so all runs grow at the
//! same pace and no target's requests make another's slower (MLflow's cost per log-batch grows with
//! the run's metric history).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde_json::{json, Value};

use super::endpoint_path;
use super::open_loop::RequestError;
use crate::cli::Endpoint;
use crate::http;
use crate::mlflow::{self, unix_millis};
use crate::monitor::MonitoredRank;
use crate::stack::Target;

/// Keys are `bench/metric_<n>`: outside `system/`, so mlscope passes them through untouched.
const METRIC_PREFIX: &str = "bench/metric_";
/// The rank whose monitor `--system-metrics` bodies imitate.
const SYSTEM_METRICS_NODE: &str = "node-a";
const SYSTEM_METRICS_RANK: u32 = 3;
/// GPUs the imitated rank's monitor reports (one per rank, as with one GPU per pod).
pub(crate) const SYSTEM_METRICS_GPUS: u32 = 1;

/// What each log-batch request carries.
#[derive(Debug, Clone)]
pub(crate) enum BatchContent {
    /// `n` metrics `bench/metric_<i>`, which no proxy changes.
    Plain(usize),
    /// One publish of MLflow's system-metrics monitor of one rank (`system/node-a/rank-3/...`),
    /// which mlscope-proxy scopes and deduplicates.
    SystemMetrics(MonitoredRank),
}

/// A target's HTTP client and run.
#[derive(Clone)]
pub(crate) struct Workload {
    client: reqwest::Client,
    base_url: Arc<str>,
    run_id: Arc<str>,
    content: Arc<BatchContent>,
    /// Next `step` for log-batch: unique per request within the run.
    next_step: Arc<AtomicU64>,
}

// === impl BatchContent ===

impl BatchContent {
    pub(crate) fn new(system_metrics: bool, metrics_per_request: usize) -> BatchContent {
        if system_metrics {
            BatchContent::SystemMetrics(MonitoredRank::new(
                SYSTEM_METRICS_NODE,
                SYSTEM_METRICS_RANK,
            ))
        } else {
            BatchContent::Plain(metrics_per_request)
        }
    }

    /// Metrics in each log-batch.
    pub(crate) fn metrics(&self) -> usize {
        match self {
            BatchContent::Plain(n) => *n,
            BatchContent::SystemMetrics(rank) => rank.publish(0, SYSTEM_METRICS_GPUS).len(),
        }
    }

    /// How the report describes the body.
    pub(crate) fn describe(&self) -> String {
        match self {
            BatchContent::Plain(n) => format!("{n} metrics"),
            BatchContent::SystemMetrics(rank) => format!(
                "{} system metrics of one rank, `{}…`",
                self.metrics(),
                rank.key_prefix()
            ),
        }
    }
}

// === impl Workload ===

impl Workload {
    /// Creates a run in `experiment_id` through `target` and a keep-alive client for it.
    pub(crate) async fn prepare(
        target: &Target,
        experiment_id: &str,
        content: &BatchContent,
        max_in_flight: usize,
    ) -> anyhow::Result<Workload> {
        let client = http::client(max_in_flight)?;
        let run_id = mlflow::create_run(
            &client,
            target,
            experiment_id,
            &format!("bench-{}", target.kind.slug()),
        )
        .await?;
        Ok(Workload {
            client,
            base_url: target.base_url.as_str().into(),
            run_id: run_id.into(),
            content: Arc::new(content.clone()),
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
                    .post(format!("{}{}", self.base_url, endpoint_path(endpoint)))
                    .json(&log_batch_body(
                        &self.run_id,
                        &self.content,
                        step,
                        unix_millis(),
                    ))
            }
            Endpoint::RunsGet => self
                .client
                .get(format!("{}{}", self.base_url, endpoint_path(endpoint)))
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

fn log_batch_body(run_id: &str, content: &BatchContent, step: u64, timestamp: u64) -> Value {
    let metrics: Vec<Value> = match content {
        BatchContent::Plain(metrics) => (0..*metrics)
            .map(|n| {
                json!({
                    "key": format!("{METRIC_PREFIX}{n}"),
                    "value": (step as f64) * 0.5 + n as f64,
                    "timestamp": timestamp,
                    "step": step,
                })
            })
            .collect(),
        // The monitor's own step counter: one step per publish, like `step` here.
        BatchContent::SystemMetrics(rank) => rank
            .publish(step, SYSTEM_METRICS_GPUS)
            .into_iter()
            .map(|(key, value)| {
                json!({ "key": key, "value": value, "timestamp": timestamp, "step": step })
            })
            .collect(),
    };
    json!({ "run_id": run_id, "metrics": metrics })
}

fn classify(error: reqwest::Error) -> RequestError {
    if error.is_timeout() {
        RequestError::Timeout
    } else {
        RequestError::Transport
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_batch_body_carries_one_step_and_timestamp_for_all_metrics() {
        let body = log_batch_body("abc", &BatchContent::Plain(3), 7, 1_700_000_000_000);
        assert_eq!(body["run_id"], "abc");
        let metrics = body["metrics"].as_array().expect("metrics array");
        assert_eq!(metrics.len(), 3);
        assert!(metrics
            .iter()
            .all(|m| m["step"] == 7 && m["timestamp"] == 1_700_000_000_000u64));
        assert_eq!(metrics[2]["key"], "bench/metric_2");
    }

    #[test]
    fn a_system_metrics_body_is_one_monitor_publish_of_one_rank() {
        let content = BatchContent::new(true, 10);
        let body = log_batch_body("abc", &content, 5, 1_700_000_000_000);
        let metrics = body["metrics"].as_array().expect("metrics array");
        assert_eq!(metrics.len(), content.metrics());
        assert_eq!(metrics.len(), 13);
        assert!(metrics.iter().all(|m| m["key"]
            .as_str()
            .is_some_and(|k| k.starts_with("system/node-a/rank-3/"))
            && m["step"] == 5));
    }
}
