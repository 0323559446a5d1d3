//! Failed uploads leave a trace on the run: a failure count, the last error and the last failed
//! path, as run tags. An asynchronous client that never reads the response (MLflow's async
//! artifact logging) still leaves the failure visible in the UI.

use http::{HeaderMap, Method};

use crate::proxy::Forwarder;
use crate::store::Store;

pub const TAG_FAILURES: &str = "mlscope.artifacts.upload_failures";
pub const TAG_LAST_ERROR: &str = "mlscope.artifacts.last_upload_error";
pub const TAG_LAST_PATH: &str = "mlscope.artifacts.last_failed_path";
/// MLflow accepts tag values up to 8000 characters; errors are cut well below.
const MAX_ERROR_CHARS: usize = 2000;

#[derive(Clone)]
pub struct FailureRecorder {
    forwarder: Forwarder,
    store: Store,
}

impl FailureRecorder {
    pub fn new(forwarder: Forwarder, store: Store) -> Self {
        Self { forwarder, store }
    }

    /// The client's credentials, kept to tag the run as that client (MLflow's authorization).
    pub fn credentials(headers: &HeaderMap) -> HeaderMap {
        let mut kept = HeaderMap::new();
        for name in [
            http::header::AUTHORIZATION,
            http::header::COOKIE,
            http::HeaderName::from_static(crate::workspace::HEADER),
        ] {
            if let Some(v) = headers.get(&name) {
                kept.insert(name, v.clone());
            }
        }
        kept
    }

    /// Counts the failure in the shared store (so replicas agree on the count) and tags the run.
    /// Failures to record are logged, never raised: the client already gets the upload's error.
    pub async fn record(&self, run_id: &str, path: &str, error: &str, credentials: &HeaderMap) {
        let error: String = error.chars().take(MAX_ERROR_CHARS).collect();
        let count = match self.store.record_upload_failure(run_id, path, &error).await {
            Ok(count) => count,
            Err(e) => {
                tracing::warn!(run_id, error = %e, "counting an upload failure in the state store failed");
                return;
            }
        };
        let body = serde_json::json!({
            "run_id": run_id,
            "tags": [
                { "key": TAG_FAILURES, "value": count.to_string() },
                { "key": TAG_LAST_ERROR, "value": error },
                { "key": TAG_LAST_PATH, "value": path },
            ],
        });
        match self
            .forwarder
            .call(
                Method::POST,
                "/api/2.0/mlflow/runs/log-batch",
                credentials,
                Some(body),
            )
            .await
        {
            Ok((status, _)) if status.is_success() => tracing::info!(
                run_id,
                path,
                failures = count,
                "upload failure recorded on the run"
            ),
            Ok((status, body)) => {
                tracing::warn!(run_id, status = status.as_u16(), body = %String::from_utf8_lossy(&body), "MLflow refused the upload-failure tags")
            }
            Err(e) => {
                tracing::warn!(run_id, error = %e, "tagging the run with an upload failure failed")
            }
        }
    }
}
