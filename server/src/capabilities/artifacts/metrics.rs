//! The gateway's metrics: the artifact requests it answered from the store, the bytes it stored,
//! and the writes its policy and MLflow's authentication refused. Registered into the proxy's
//! registry whether or not the gateway is on, so `/metrics` names the same families either way.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::plumbing::telemetry::Metrics;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ArtifactLabels {
    pub(crate) op: &'static str,
    pub(crate) status: u16,
}

/// The gateway's handles on its families; cheap to clone.
#[derive(Clone)]
pub struct GatewayMetrics {
    pub(crate) requests: Family<ArtifactLabels, Counter>,
    pub(crate) bytes_uploaded: Counter,
    pub(crate) policy_violations: Counter,
    pub(crate) authz_denials: Counter,
}

impl GatewayMetrics {
    /// The gateway's families, registered into `registry`.
    pub fn new(registry: &Metrics) -> Self {
        let artifact_requests = Family::<ArtifactLabels, Counter>::default();
        registry.register(
            "artifact_requests",
            "Artifact API requests the gateway answered from the store, by operation and status",
            artifact_requests.clone(),
        );
        let artifact_bytes_uploaded = Counter::default();
        registry.register(
            "artifact_uploaded_bytes",
            "Bytes the gateway stored",
            artifact_bytes_uploaded.clone(),
        );
        let artifact_policy_violations = Counter::default();
        registry.register(
            "artifact_policy_violations",
            "Artifact writes outside the artifact root of an existing run, model or trace (refused under enforce, logged under warn)",
            artifact_policy_violations.clone(),
        );
        let artifact_authz_denials = Counter::default();
        registry.register(
            "artifact_authz_denials",
            "Artifact requests MLflow's authentication refused for the client (401/403 relayed by the gateway)",
            artifact_authz_denials.clone(),
        );
        GatewayMetrics {
            requests: artifact_requests,
            bytes_uploaded: artifact_bytes_uploaded,
            policy_violations: artifact_policy_violations,
            authz_denials: artifact_authz_denials,
        }
    }
}
