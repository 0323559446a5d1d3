//! The two calls about the run itself, made directly (not queued): `runs/get` before the
//! command starts (does the run exist, is it `RUNNING`, where do its artifacts go) and for the
//! run's latest step when data changes, and `runs/update` to end a run whose pre-flight failed.

use std::time::Duration;

use serde_json::{json, Value};

use super::mlflow::{endpoint, error_message, http_agent, request_headers};
use super::HttpConfig;

/// The largest `runs/get` answer read (a run with thousands of metrics stays well below).
const MAX_RUN_BODY: u64 = 16 * 1024 * 1024;

/// What `runs/get` said about the run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunInfo {
    /// `RUNNING`, `FINISHED`, `FAILED`, `KILLED`, `SCHEDULED`.
    pub status: String,
    pub artifact_uri: String,
    /// The highest step of the run's metrics outside `system/`: how far the training got.
    pub latest_step: Option<i64>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RunLookup {
    Found(RunInfo),
    /// MLflow answered `RESOURCE_DOES_NOT_EXIST`.
    NotFound,
    /// Another refusal (authentication, permissions): MLflow's message.
    Refused(String),
    /// No answer, or 5xx/408/429.
    Unavailable(String),
}

/// Blocking calls about one run, with the collector's identity headers.
pub struct RunClient {
    agent: ureq::Agent,
    get: String,
    update: String,
    run_id: String,
    headers: Vec<(&'static str, String)>,
}

impl std::fmt::Debug for RunClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunClient")
            .field("get", &self.get)
            .finish_non_exhaustive()
    }
}

/// A call about the run waits at most this long per phase (or `--request-timeout`, if
/// shorter): the command's start and the watch never wait long on the network.
pub(super) const RUN_CALL_LIMIT: Duration = Duration::from_secs(5);

impl RunClient {
    pub fn new(settings: &HttpConfig) -> Self {
        let mut limited = settings.clone();
        limited.request_timeout = settings.request_timeout.min(RUN_CALL_LIMIT);
        RunClient {
            agent: http_agent(&limited),
            get: endpoint(settings, "runs/get"),
            update: endpoint(settings, "runs/update"),
            run_id: settings.run_id.clone(),
            headers: request_headers(settings),
        }
    }

    pub fn get(&self) -> RunLookup {
        let mut request = self.agent.get(&self.get).query("run_id", &self.run_id);
        for (name, value) in &self.headers {
            request = request.header(*name, value);
        }
        let mut response = match request.call() {
            Ok(response) => response,
            Err(error) => return RunLookup::Unavailable(error.to_string()),
        };
        let status = response.status().as_u16();
        let text = response
            .body_mut()
            .with_config()
            .limit(MAX_RUN_BODY)
            .read_to_string()
            .unwrap_or_default();
        match status {
            200..=299 => match serde_json::from_str::<Value>(&text) {
                Ok(body) if body["run"]["info"].is_object() => RunLookup::Found(run_info(&body)),
                Ok(_) => RunLookup::Unavailable("runs/get answered without a run".to_owned()),
                Err(error) => RunLookup::Unavailable(format!("runs/get answered no JSON: {error}")),
            },
            404 => RunLookup::NotFound,
            400 if text.contains("RESOURCE_DOES_NOT_EXIST") => RunLookup::NotFound,
            408 | 429 | 500..=599 => {
                RunLookup::Unavailable(format!("HTTP {status}: {}", error_message(&text)))
            }
            _ => RunLookup::Refused(format!("HTTP {status}: {}", error_message(&text))),
        }
    }

    /// Ends the run with `status` (`FAILED`) now.
    pub fn end(&self, status: &str) -> Result<(), String> {
        let body = json!({
            "run_id": self.run_id,
            "status": status,
            "end_time": crate::sample::now_ms(),
        });
        let mut request = self
            .agent
            .post(&self.update)
            .header("Content-Type", "application/json");
        for (name, value) in &self.headers {
            request = request.header(*name, value);
        }
        let mut response = request
            .send(&serde_json::to_vec(&body).expect("JSON values always serialize")[..])
            .map_err(|e| e.to_string())?;
        let code = response.status().as_u16();
        let text = response.body_mut().read_to_string().unwrap_or_default();
        if (200..300).contains(&code) {
            Ok(())
        } else {
            Err(format!("HTTP {code}: {}", error_message(&text)))
        }
    }
}

/// The parts of a `runs/get` answer the pre-flight and the watch use.
pub(super) fn run_info(body: &Value) -> RunInfo {
    let info = &body["run"]["info"];
    let latest_step = body["run"]["data"]["metrics"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| {
            !m["key"]
                .as_str()
                .unwrap_or("system/")
                .starts_with("system/")
        })
        .filter_map(|m| {
            m["step"]
                .as_i64()
                .or_else(|| m["step"].as_str()?.parse().ok())
        })
        .max();
    RunInfo {
        status: info["status"].as_str().unwrap_or("unknown").to_owned(),
        artifact_uri: info["artifact_uri"].as_str().unwrap_or_default().to_owned(),
        latest_step,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_step_is_the_trainings_not_the_system_metrics() {
        let body = json!({"run": {
            "info": {"status": "RUNNING", "artifact_uri": "mlflow-artifacts:/1/abc/artifacts"},
            "data": {"metrics": [
                {"key": "loss", "value": 0.1, "step": 41200},
                {"key": "val/acc", "value": 0.9, "step": "40000"},
                {"key": "system/rank-0/container_cpu_utilization_percentage", "value": 1.0, "step": 99999},
            ]},
        }});
        assert_eq!(
            run_info(&body),
            RunInfo {
                status: "RUNNING".into(),
                artifact_uri: "mlflow-artifacts:/1/abc/artifacts".into(),
                latest_step: Some(41200),
            }
        );
        let bare = run_info(&json!({"run": {"info": {"status": "FINISHED"}, "data": {}}}));
        assert_eq!((bare.status.as_str(), bare.latest_step), ("FINISHED", None));
    }
}
