//! Failed uploads leave a trace on the run: a failure count, the last error and the last failed
//! path, as run tags. An asynchronous client that never reads the response (MLflow's async
//! artifact logging) still leaves the failure visible in the UI.
//!
//! The tags are written as the client that uploaded (MLflow's authorization applies), through the
//! run's write queue like every tag the proxy writes: they keep their order with that client's own
//! writes to the run.

use http::HeaderMap;

use crate::capabilities::coalesce::Coalescer;
use crate::plumbing::mlflow::{Caller, RunTag};
use crate::plumbing::store::Store;

pub const TAG_FAILURES: &str = "mlscope.artifacts.upload_failures";
pub const TAG_LAST_ERROR: &str = "mlscope.artifacts.last_upload_error";
pub const TAG_LAST_PATH: &str = "mlscope.artifacts.last_failed_path";
/// MLflow accepts tag values up to 8000 characters; errors are cut well below.
const MAX_ERROR_CHARS: usize = 2000;

#[derive(Clone)]
pub struct FailureRecorder {
    coalescer: Coalescer,
    store: Store,
}

impl FailureRecorder {
    pub fn new(coalescer: Coalescer, store: Store) -> Self {
        Self { coalescer, store }
    }

    /// The client's credentials and workspace, kept to tag the run as that client (MLflow's
    /// authorization).
    pub fn credentials(headers: &HeaderMap) -> HeaderMap {
        Caller::client(headers).headers().clone()
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
        let tags = [
            (TAG_FAILURES, count.to_string()),
            (TAG_LAST_ERROR, error),
            (TAG_LAST_PATH, path.to_owned()),
        ]
        .map(|(key, value)| RunTag::from((key.to_owned(), value)));
        let caller = Caller::client(credentials);
        match self.coalescer.set_tags(&caller, run_id, &tags).await {
            Ok(()) => tracing::info!(
                run_id,
                path,
                failures = count,
                "upload failure recorded on the run"
            ),
            Err(e) => match e.status() {
                Some(status) => {
                    tracing::warn!(run_id, status = status.as_u16(), error = %e, "MLflow refused the upload-failure tags")
                }
                None => {
                    tracing::warn!(run_id, error = %e, "tagging the run with an upload failure failed")
                }
            },
        }
    }
}
