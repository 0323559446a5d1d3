//! What run health asks of MLflow, as whom, and how a failure counts: every call speaks for the
//! service credential in the run's workspace; tags go through the run's write queue.

use super::store::RankRow;
use super::Health;
use crate::plumbing::mlflow::{Caller, MlflowError, Run, RunTag};

impl Health {
    /// Writes run tags through the run's write queue.
    pub(super) async fn write_tags(
        &self,
        run_id: &str,
        caller: &Caller,
        tags: &[(String, String)],
    ) -> Result<(), (&'static str, String)> {
        let tags: Vec<RunTag> = tags.iter().cloned().map(RunTag::from).collect();
        self.inner
            .coalescer
            .set_tags(caller, run_id, &tags)
            .await
            .map_err(failure)
    }

    /// The service credential, and the workspace the run's ranks wrote in (MLflow finds the run
    /// only there).
    pub(super) fn run_caller(&self, ranks: &[RankRow]) -> Caller {
        Caller::service(&self.inner.config.credential)
            .in_workspace(ranks.iter().find_map(|r| r.workspace.as_deref()))
    }

    pub(super) async fn get_run(
        &self,
        caller: &Caller,
        run_id: &str,
    ) -> Result<Run, (&'static str, String)> {
        self.inner
            .mlflow
            .get_run(caller, run_id)
            .await
            .map_err(failure)
    }
}

/// A failed call to MLflow as the sweep counts it (`refused`: the service credential;
/// [`REJECTED`]: for good; `mlflow`: anything else) and logs it.
pub(super) fn failure(error: MlflowError) -> (&'static str, String) {
    if error.refused_credential() {
        if let MlflowError::Refused { path, status, .. } = &error {
            return (
                "refused",
                format!(
                    "MLflow answered {status} to {path}: give the proxy a service credential that may edit runs (--mlflow-service-token, or --mlflow-service-username and --mlflow-service-password)"
                ),
            );
        }
    }
    let reason = if error.refused_for_good() {
        REJECTED
    } else {
        "mlflow"
    };
    (reason, error.to_string())
}

/// The reason of an answer that asking again will not change (see
/// [`MlflowError::refused_for_good`]).
pub(super) const REJECTED: &str = "rejected";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_answers_that_asking_again_cannot_change_are_refusals_for_good() {
        let reason = |status, body: &[u8]| {
            failure(
                crate::plumbing::mlflow::answer::<serde_json::Value>(status, "/runs/get", body)
                    .unwrap_err(),
            )
            .0
        };
        let gone = br#"{"error_code":"RESOURCE_DOES_NOT_EXIST","message":"Run 'x' not found"}"#;
        assert_eq!(reason(http::StatusCode::NOT_FOUND, gone), REJECTED);
        let deleted = br#"{"error_code":"INVALID_PARAMETER_VALUE","message":"must be active"}"#;
        assert_eq!(reason(http::StatusCode::BAD_REQUEST, deleted), REJECTED);
        assert_eq!(reason(http::StatusCode::NOT_FOUND, b"not json"), REJECTED);
        for (status, body) in [
            (http::StatusCode::UNAUTHORIZED, &b""[..]),
            (http::StatusCode::FORBIDDEN, gone),
            (http::StatusCode::TOO_MANY_REQUESTS, b""),
            (http::StatusCode::CONFLICT, b""),
            (http::StatusCode::SERVICE_UNAVAILABLE, gone),
            (http::StatusCode::INTERNAL_SERVER_ERROR, deleted),
        ] {
            assert_ne!(reason(status, body), REJECTED);
        }
        assert_eq!(reason(http::StatusCode::FORBIDDEN, gone), "refused");
    }
}
