//! The MLflow REST calls the end-to-end tests make to set up runs and read back what MLflow stored,
//! and the scoped names they expect to find there.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

/// The contract's node-wide names, written out here (not taken from the table under test) so a
/// wrong table fails the tests.
pub(crate) const NODE_WIDE_NAMES: [&str; 6] = [
    "node_cpu_utilization_percentage",
    "node_memory_usage_megabytes",
    "node_memory_usage_percentage",
    "rootfs_usage_megabytes",
    "rootfs_usage_percentage",
    "rootfs_available_megabytes",
];

pub(crate) fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// The Prometheus text a proxy's admin listener serves on `/metrics`.
pub(crate) async fn scrape(admin_url: &str) -> String {
    http()
        .get(format!("{admin_url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Sends `request` and returns its body as JSON, whatever the status.
pub(crate) async fn response_json(request: reqwest::RequestBuilder) -> Value {
    request.send().await.unwrap().json().await.unwrap()
}

/// POSTs to `/api/2.0/mlflow/<path>` and asserts success.
pub(crate) async fn post(base: &str, path: &str, body: Value) -> Value {
    let response = http()
        .post(format!("{base}/api/2.0/mlflow/{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status();
    let json: Value = response.json().await.unwrap_or(Value::Null);
    assert!(status.is_success(), "{path}: {status} {json}");
    json
}

/// A fresh run in an experiment of its own, created directly in MLflow.
pub(crate) async fn create_run(mlflow: &str, prefix: &str) -> String {
    create_experiment_and_run(mlflow, prefix).await.1
}

/// A fresh run in an experiment of its own, created directly in MLflow: `(experiment_id, run_id)`,
/// for tests that address the run's artifacts as `<experiment_id>/<run_id>/artifacts`.
pub(crate) async fn create_experiment_and_run(mlflow: &str, prefix: &str) -> (String, String) {
    let name = format!("{prefix}-{}", uuid::Uuid::new_v4().simple());
    let experiment = post(mlflow, "experiments/create", json!({ "name": name })).await;
    let experiment_id = experiment["experiment_id"].as_str().unwrap().to_owned();
    let run = post(
        mlflow,
        "runs/create",
        json!({ "experiment_id": experiment_id, "start_time": now_ms() }),
    )
    .await;
    (
        experiment_id,
        run["run"]["info"]["run_id"].as_str().unwrap().to_owned(),
    )
}

pub(crate) async fn get_run(mlflow: &str, run_id: &str) -> Value {
    response_json(http().get(format!("{mlflow}/api/2.0/mlflow/runs/get?run_id={run_id}"))).await
}

/// The run's tags, key to value.
pub(crate) async fn run_tags(mlflow: &str, run_id: &str) -> BTreeMap<String, String> {
    let run = get_run(mlflow, run_id).await;
    run["run"]["data"]["tags"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["key"].as_str().unwrap().to_owned(),
                t["value"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

pub(crate) async fn metric_keys(mlflow: &str, run_id: &str) -> BTreeSet<String> {
    let run = get_run(mlflow, run_id).await;
    run["run"]["data"]["metrics"]
        .as_array()
        .map(|m| {
            m.iter()
                .map(|m| m["key"].as_str().unwrap().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// `(timestamp, value, step)` of every point of a series MLflow stored, in timestamp order.
pub(crate) async fn points(mlflow: &str, run_id: &str, key: &str) -> Vec<(i64, f64, i64)> {
    let page = response_json(
        http()
            .get(format!("{mlflow}/api/2.0/mlflow/metrics/get-history"))
            .query(&[
                ("run_id", run_id),
                ("metric_key", key),
                ("max_results", "25000"),
            ]),
    )
    .await;
    let mut points: Vec<(i64, f64, i64)> = page["metrics"]
        .as_array()
        .map(|m| {
            m.iter()
                .map(|p| {
                    (
                        p["timestamp"].as_i64().unwrap(),
                        p["value"].as_f64().unwrap_or(f64::NAN),
                        p["step"].as_i64().unwrap_or(0),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    points.sort_by_key(|&(ts, _, step)| (ts, step));
    points
}

/// `(step, timestamp)` of every point of a series, in timestamp order.
pub(crate) async fn history(mlflow: &str, run_id: &str, key: &str) -> Vec<(i64, i64)> {
    points(mlflow, run_id, key)
        .await
        .into_iter()
        .map(|(ts, _, step)| (step, ts))
        .collect()
}
