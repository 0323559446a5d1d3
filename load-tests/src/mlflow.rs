//! The few MLflow REST calls the benchmarks make besides the measured ones: creating experiments
//! and runs, reading what a run stored, asking for the version.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context as _};
use serde_json::{json, Value};

use crate::http;
use crate::stack::Target;

/// Time limit for each of these calls; none of them is measured.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Creates the experiment benchmark runs live in, through `target` (normally direct MLflow).
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

/// Creates a run named `run_name` in `experiment_id` through `target` and returns its id.
pub(crate) async fn create_run(
    client: &reqwest::Client,
    target: &Target,
    experiment_id: &str,
    run_name: &str,
) -> anyhow::Result<String> {
    let created = post_json(
        client,
        &format!("{}/api/2.0/mlflow/runs/create", target.base_url),
        &json!({
            "experiment_id": experiment_id,
            "run_name": run_name,
            "start_time": unix_millis(),
        }),
    )
    .await
    .with_context(|| format!("creating the benchmark run through {}", target.kind))?;
    created
        .pointer("/run/info/run_id")
        .and_then(Value::as_str)
        .map(str::to_string)
        .with_context(|| {
            format!(
                "runs/create through {} returned no run id: {created}",
                target.kind
            )
        })
}

/// `GET /version` of MLflow, with how it serves (workers, job runner), for the report: e.g.
/// "3.17.2 · `mlflow server` defaults (4 workers, job runner on)". `None` when it does not
/// answer.
pub(crate) async fn version(target: &Target) -> Option<String> {
    let version = bare_version(target).await?;
    Some(match crate::stack::serving() {
        Some(serving) => format!("{version} · {serving}"),
        None => version,
    })
}

async fn bare_version(target: &Target) -> Option<String> {
    let client = http::client(1).ok()?;
    let response = client
        .get(format!("{}/version", target.base_url))
        .timeout(CALL_TIMEOUT)
        .send()
        .await
        .ok()?;
    if !response.status().is_success() {
        return None;
    }
    response.text().await.ok().map(|v| v.trim().to_string())
}

pub(crate) async fn post_json(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
) -> anyhow::Result<Value> {
    let response = client
        .post(url)
        .json(body)
        .timeout(CALL_TIMEOUT)
        .send()
        .await
        .with_context(|| format!("POST {url}"))?;
    answer_json(response, "POST", url).await
}

pub(crate) async fn get_json(
    client: &reqwest::Client,
    url: &str,
    query: &[(&str, &str)],
) -> anyhow::Result<Value> {
    let response = client
        .get(url)
        .query(query)
        .timeout(CALL_TIMEOUT)
        .send()
        .await
        .with_context(|| format!("GET {url}"))?;
    answer_json(response, "GET", url).await
}

async fn answer_json(
    response: reqwest::Response,
    method: &str,
    url: &str,
) -> anyhow::Result<Value> {
    let status = response.status();
    let text = response
        .text()
        .await
        .with_context(|| format!("reading the answer of {method} {url}"))?;
    if !status.is_success() {
        bail!("{method} {url} answered {status}: {text}");
    }
    serde_json::from_str(&text)
        .with_context(|| format!("{method} {url} answered with invalid JSON: {text}"))
}

/// Milliseconds since the Unix epoch, MLflow's timestamp unit.
pub(crate) fn unix_millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
