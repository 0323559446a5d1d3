//! MLflow's `runs/log-batch` over HTTP(S), with the identity headers the proxy deduplicates by
//! and MLflow's own authentication.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use ureq::tls::{Certificate, RootCerts, TlsConfig};

use super::Auth;
use super::{DatasetInput, Payload, SendError, Transport};

/// How to reach MLflow.
#[derive(Clone, Debug)]
pub struct HttpConfig {
    /// `MLFLOW_TRACKING_URI`, without a trailing `/`.
    pub tracking_uri: String,
    pub run_id: String,
    pub node: String,
    pub rank: u32,
    pub auth: Auth,
    /// `MLFLOW_WORKSPACE`: MLflow finds a run of a workspace only when the request names it.
    pub workspace: Option<String>,
    /// Whole-request limit.
    pub request_timeout: Duration,
    /// `MLFLOW_TRACKING_INSECURE_TLS`.
    pub insecure_tls: bool,
    /// `MLFLOW_TRACKING_SERVER_CERT_PATH`, parsed.
    pub ca_certificates: Option<Vec<Certificate<'static>>>,
}

/// The largest error body read for its message.
const MAX_ERROR_BODY: u64 = 64 * 1024;

pub struct MlflowTransport {
    agent: ureq::Agent,
    endpoint: String,
    inputs_endpoint: String,
    run_id: String,
    headers: Vec<(&'static str, String)>,
}

impl std::fmt::Debug for MlflowTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MlflowTransport")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

/// A blocking HTTP(S) client with MLflow's TLS settings and per-phase limits.
pub(super) fn http_agent(settings: &HttpConfig) -> ureq::Agent {
    let mut tls = TlsConfig::builder().disable_verification(settings.insecure_tls);
    if let Some(certs) = &settings.ca_certificates {
        tls = tls.root_certs(RootCerts::Specific(Arc::new(certs.clone())));
    }
    // Limits per phase, not `timeout_global`: with a global limit ureq resolves the host on
    // a new thread for every request. Resolving on the sender thread blocks nothing else.
    let limit = Some(settings.request_timeout);
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .max_redirects(0)
        .timeout_connect(Some(settings.request_timeout.min(Duration::from_secs(5))))
        .timeout_send_request(limit)
        .timeout_send_body(limit)
        .timeout_recv_response(limit)
        .timeout_recv_body(limit)
        .user_agent(concat!("mlscope-collector/", env!("CARGO_PKG_VERSION")))
        .tls_config(tls.build())
        .build()
        .into()
}

/// The identity headers the proxy deduplicates by, and MLflow's authentication and workspace.
pub(super) fn request_headers(settings: &HttpConfig) -> Vec<(&'static str, String)> {
    let mut headers = vec![
        ("X-Mlscope-Node", settings.node.clone()),
        ("X-Mlscope-Rank", settings.rank.to_string()),
    ];
    if let Some(value) = settings.auth.header_value() {
        headers.push(("Authorization", value));
    }
    if let Some(workspace) = &settings.workspace {
        headers.push(("X-MLFLOW-WORKSPACE", workspace.clone()));
    }
    headers
}

/// `<tracking uri>/api/2.0/mlflow/<call>`.
pub(super) fn endpoint(settings: &HttpConfig, call: &str) -> String {
    format!(
        "{}/api/2.0/mlflow/{call}",
        settings.tracking_uri.trim_end_matches('/')
    )
}

impl MlflowTransport {
    pub fn new(settings: &HttpConfig) -> Self {
        MlflowTransport {
            agent: http_agent(settings),
            endpoint: endpoint(settings, "runs/log-batch"),
            inputs_endpoint: endpoint(settings, "runs/log-inputs"),
            run_id: settings.run_id.clone(),
            headers: request_headers(settings),
        }
    }
}

impl Transport for MlflowTransport {
    fn send(&mut self, payload: &Payload) -> Result<(), SendError> {
        let (endpoint, body) = match payload {
            Payload::Dataset(input) => {
                (&self.inputs_endpoint, log_inputs_body(&self.run_id, input))
            }
            _ => (&self.endpoint, log_batch_body(&self.run_id, payload)),
        };
        let mut request = self
            .agent
            .post(endpoint)
            .header("Content-Type", "application/json");
        for (name, value) in &self.headers {
            request = request.header(*name, value);
        }
        let mut response = request
            .send(&body[..])
            .map_err(|e| SendError::Unavailable(e.to_string()))?;
        let status = response.status().as_u16();
        // Read the whole body, so the connection goes back to the pool.
        let text = response
            .body_mut()
            .with_config()
            .limit(MAX_ERROR_BODY)
            .read_to_string()
            .unwrap_or_default();
        match status {
            200..=299 => Ok(()),
            408 | 429 | 500..=599 => Err(SendError::Unavailable(format!(
                "HTTP {status}: {}",
                error_message(&text)
            ))),
            _ => Err(SendError::Rejected {
                status,
                message: error_message(&text),
            }),
        }
    }
}

/// `runs/log-inputs` JSON for one dataset.
pub fn log_inputs_body(run_id: &str, input: &DatasetInput) -> Vec<u8> {
    let mut dataset = json!({
        "name": input.name,
        "digest": input.digest,
        "source_type": input.source_type,
        "source": input.source,
    });
    if let Some(profile) = &input.profile {
        dataset["profile"] = json!(profile);
    }
    let body = json!({
        "run_id": run_id,
        "datasets": [{
            "dataset": dataset,
            "tags": [{"key": "mlflow.data.context", "value": input.context}],
        }],
    });
    serde_json::to_vec(&body).expect("JSON values always serialize")
}

/// `runs/log-batch` JSON for a payload (a dataset's body is `runs/log-inputs`').
pub fn log_batch_body(run_id: &str, payload: &Payload) -> Vec<u8> {
    let body = match payload {
        Payload::Sample(sample) => {
            let metrics: Vec<Value> = sample
                .metrics
                .iter()
                .map(|(key, value)| json!({"key": &**key, "value": value, "timestamp": sample.timestamp_ms, "step": sample.step}))
                .collect();
            json!({"run_id": run_id, "metrics": metrics})
        }
        Payload::Dataset(input) => return log_inputs_body(run_id, input),
        Payload::Tags(tags) => {
            let tags: Vec<Value> = tags
                .iter()
                .map(|(key, value)| json!({"key": key, "value": value}))
                .collect();
            json!({"run_id": run_id, "tags": tags})
        }
    };
    serde_json::to_vec(&body).expect("JSON values always serialize")
}

/// MLflow's `error_code: message`, or the start of a body that is not MLflow's error JSON.
pub(super) fn error_message(body: &str) -> String {
    match serde_json::from_str::<Value>(body) {
        Ok(error) if error.get("message").is_some() => {
            let code = error["error_code"].as_str().unwrap_or("ERROR");
            format!("{code}: {}", error["message"].as_str().unwrap_or_default())
        }
        _ => body.chars().take(300).collect::<String>().trim().to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::Sample;

    #[test]
    fn a_sample_is_one_batch_with_one_timestamp_and_step() {
        let sample = Sample {
            timestamp_ms: 1_700_000_000_123,
            step: 4,
            metrics: vec![
                (Arc::from("system/n/a"), 1.5),
                (Arc::from("system/rank-0/b"), 2.0),
            ],
        };
        let body: Value =
            serde_json::from_slice(&log_batch_body("r1", &Payload::Sample(sample))).unwrap();
        assert_eq!(
            body,
            json!({"run_id": "r1", "metrics": [
                {"key": "system/n/a", "value": 1.5, "timestamp": 1_700_000_000_123i64, "step": 4},
                {"key": "system/rank-0/b", "value": 2.0, "timestamp": 1_700_000_000_123i64, "step": 4},
            ]})
        );
        let tags: Value = serde_json::from_slice(&log_batch_body(
            "r1",
            &Payload::Tags(vec![("k".into(), "v".into())]),
        ))
        .unwrap();
        assert_eq!(
            tags,
            json!({"run_id": "r1", "tags": [{"key": "k", "value": "v"}]})
        );
    }

    #[test]
    fn a_dataset_is_one_log_inputs_body_with_its_context_tag() {
        let input = DatasetInput {
            name: "val".into(),
            digest: "sha256:0123456789abcdef".into(),
            source_type: "local".into(),
            source: r#"{"uri": "/data/val"}"#.into(),
            profile: Some(r#"{"files": 2}"#.into()),
            context: "val".into(),
        };
        let body: Value = serde_json::from_slice(&log_inputs_body("r1", &input)).unwrap();
        assert_eq!(
            body,
            json!({"run_id": "r1", "datasets": [{
                "dataset": {"name": "val", "digest": "sha256:0123456789abcdef", "source_type": "local",
                            "source": "{\"uri\": \"/data/val\"}", "profile": "{\"files\": 2}"},
                "tags": [{"key": "mlflow.data.context", "value": "val"}],
            }]})
        );
    }

    #[test]
    fn error_messages_come_from_mlflows_error_json() {
        assert_eq!(
            error_message(
                r#"{"error_code":"RESOURCE_DOES_NOT_EXIST","message":"Run 'x' not found"}"#
            ),
            "RESOURCE_DOES_NOT_EXIST: Run 'x' not found"
        );
        assert_eq!(
            error_message("<html>Bad Gateway</html>\n"),
            "<html>Bad Gateway</html>"
        );
    }
}
