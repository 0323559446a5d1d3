//! The route table is the operation table: one handler per artifact operation, registered under
//! both API prefixes. Each handler hands its operation to [`Gateway::serve`], which authorizes
//! and places it the same way for all of them; any other method on these paths (`POST
//! artifacts/x`, `OPTIONS`, `HEAD` of a listing) goes to MLflow, as before the gateway.
//!
//! Paths are matched still percent-encoded and handed on as they came (from the request's URI,
//! not from a decoding extractor): the gateway decodes them as MLflow does.

use axum::extract::{Request, State};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;

use super::handlers::{first_query_value, Gateway};
use crate::capabilities::authz::Action;

/// The artifact API's prefixes: the REST API and its `/ajax-api` twin (the UI's).
pub(crate) const PREFIXES: [&str; 2] = [
    "/api/2.0/mlflow-artifacts/",
    "/ajax-api/2.0/mlflow-artifacts/",
];

/// The routes the gateway answers from the store, under both API prefixes; every other method
/// on them is forwarded to MLflow.
pub fn router<S: Clone + Send + Sync + 'static>(gateway: Gateway) -> Router<S> {
    let mut router = Router::new();
    for prefix in PREFIXES {
        router = router
            .route(&format!("{prefix}artifacts"), get(list).head(forward))
            .route(&format!("{prefix}artifacts/"), get(list).head(forward))
            .route(
                &format!("{prefix}artifacts/{{*path}}"),
                get(download).head(head).put(upload).delete(delete),
            )
            .route(
                &format!("{prefix}presigned/{{*path}}"),
                get(presigned).head(forward),
            )
            .route(&format!("{prefix}mpu/create/{{*path}}"), post(mpu_create))
            .route(
                &format!("{prefix}mpu/complete/{{*path}}"),
                post(mpu_complete),
            )
            .route(&format!("{prefix}mpu/abort/{{*path}}"), post(mpu_abort));
    }
    router
        .method_not_allowed_fallback(forward)
        .with_state(gateway)
}

/// One artifact operation: its name in metrics and logs, the permission MLflow requires for it
/// and where its route names its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Op {
    List,
    Download,
    Head,
    Upload,
    Delete,
    MpuCreate,
    MpuComplete,
    MpuAbort,
    Presigned,
}

impl Op {
    /// The permission MLflow requires for this operation.
    pub(super) fn action(self) -> Action {
        match self {
            Op::List | Op::Download | Op::Presigned => Action::Read,
            Op::Head => Action::Head,
            Op::Upload | Op::MpuCreate | Op::MpuComplete | Op::MpuAbort => Action::Update,
            Op::Delete => Action::Manage,
        }
    }

    /// The `op` label of the gateway's metrics.
    pub(super) fn name(self) -> &'static str {
        match self {
            Op::List => "list",
            Op::Download => "download",
            Op::Head => "head",
            Op::Upload => "upload",
            Op::Delete => "delete",
            Op::MpuCreate => "mpu_create",
            Op::MpuComplete => "mpu_complete",
            Op::MpuAbort => "mpu_abort",
            Op::Presigned => "presigned",
        }
    }

    /// What follows the API prefix in this operation's route, before the path; `None` for the
    /// listing, whose path is a query parameter.
    fn route_segment(self) -> Option<&'static str> {
        match self {
            Op::List => None,
            Op::Download | Op::Head | Op::Upload | Op::Delete => Some("artifacts/"),
            Op::Presigned => Some("presigned/"),
            Op::MpuCreate => Some("mpu/create/"),
            Op::MpuComplete => Some("mpu/complete/"),
            Op::MpuAbort => Some("mpu/abort/"),
        }
    }

    /// The still-encoded path a request for this operation names: what follows the route's
    /// segment, or the listing's first `path` query parameter (where `+` is a space, `%20` in a
    /// path).
    pub(super) fn raw_path(self, uri: &http::Uri) -> String {
        match self.route_segment() {
            None => first_query_value(uri.query().unwrap_or(""), "path")
                .unwrap_or("")
                .replace('+', "%20"),
            Some(segment) => PREFIXES
                .iter()
                .find_map(|p| uri.path().strip_prefix(p))
                .and_then(|rest| rest.strip_prefix(segment))
                .unwrap_or_default()
                .to_owned(),
        }
    }
}

// === the handlers, one per operation ===

async fn list(State(gateway): State<Gateway>, request: Request) -> Response {
    // The listing reads and places its query's path itself.
    gateway
        .serve(Op::List, request, |_, request| gateway.list(request))
        .await
}

async fn download(State(gateway): State<Gateway>, request: Request) -> Response {
    gateway
        .serve(Op::Download, request, |path, request| {
            gateway.download(path, request, false)
        })
        .await
}

async fn head(State(gateway): State<Gateway>, request: Request) -> Response {
    gateway
        .serve(Op::Head, request, |path, request| {
            gateway.download(path, request, true)
        })
        .await
}

async fn upload(State(gateway): State<Gateway>, request: Request) -> Response {
    gateway
        .serve(Op::Upload, request, |path, request| {
            gateway.upload(path, request)
        })
        .await
}

async fn delete(State(gateway): State<Gateway>, request: Request) -> Response {
    gateway
        .serve(Op::Delete, request, |path, request| {
            gateway.delete(path, request)
        })
        .await
}

async fn mpu_create(State(gateway): State<Gateway>, request: Request) -> Response {
    gateway
        .serve(Op::MpuCreate, request, |path, request| {
            gateway.mpu_create(path, request)
        })
        .await
}

async fn mpu_complete(State(gateway): State<Gateway>, request: Request) -> Response {
    gateway
        .serve(Op::MpuComplete, request, |path, request| {
            gateway.mpu_complete(path, request)
        })
        .await
}

async fn mpu_abort(State(gateway): State<Gateway>, request: Request) -> Response {
    gateway
        .serve(Op::MpuAbort, request, |path, request| {
            gateway.mpu_abort(path, request)
        })
        .await
}

async fn presigned(State(gateway): State<Gateway>, request: Request) -> Response {
    gateway
        .serve(Op::Presigned, request, |path, _| gateway.presigned(path))
        .await
}

/// Any other method on the gateway's paths: MLflow answers it.
async fn forward(State(gateway): State<Gateway>, request: Request) -> Response {
    gateway.forward(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::time::Duration;

    use axum::body::Body;
    use tower::ServiceExt;

    use super::super::metrics::ArtifactLabels;
    use crate::plumbing::proxy::{Forwarder, ForwarderConfig, Upstream};
    use crate::plumbing::telemetry::Metrics;

    const OPS: [Op; 9] = [
        Op::List,
        Op::Download,
        Op::Head,
        Op::Upload,
        Op::Delete,
        Op::MpuCreate,
        Op::MpuComplete,
        Op::MpuAbort,
        Op::Presigned,
    ];

    /// MLflow and the store at an address where nothing listens: an operation is still answered
    /// by its own handler (MLflow's check fails, so the store is never asked) and counted under
    /// its name; a forwarded request is counted under none.
    #[tokio::test]
    async fn each_operation_has_its_route_and_other_methods_on_them_go_to_mlflow() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let metrics = Metrics::new();
        let settings = ForwarderConfig {
            upstream: Upstream::parse(&format!("http://{closed}")).unwrap(),
            ..ForwarderConfig::default()
        };
        let forwarder = Forwarder::new(&settings, metrics.clone());
        let dir = tempfile::tempdir().unwrap();
        let store =
            crate::plumbing::store::Store::open(&format!("sqlite://{}/s.db", dir.path().display()))
                .await
                .unwrap();
        let config = super::super::ArtifactsConfig {
            destination: Some(super::super::Destination::parse("s3://b/p").unwrap()),
            s3: super::super::S3Config {
                endpoint_url: Some(format!("http://{closed}")),
                ..Default::default()
            },
            ..Default::default()
        };
        let authz = crate::capabilities::authz::Authorizer::new(forwarder.clone(), Duration::ZERO);
        let coalescer = crate::capabilities::coalesce::Coalescer::new(
            crate::capabilities::coalesce::CoalesceConfig::default(),
            forwarder.clone(),
            metrics.clone(),
        );
        let gateway_metrics = super::super::GatewayMetrics::new(&metrics);
        let gateway = Gateway::new(
            &config,
            forwarder,
            store,
            authz,
            coalescer,
            gateway_metrics.clone(),
            crate::plumbing::mlflow_version::LearnedVersion::default(),
            crate::plumbing::client::TrustedProxies::default(),
        )
        .await
        .unwrap();
        let app: Router = router(gateway);
        let counted = |status: u16| -> Vec<u64> {
            OPS.iter()
                .map(|op| {
                    gateway_metrics
                        .requests
                        .get_or_create(&ArtifactLabels {
                            op: op.name(),
                            status,
                        })
                        .get()
                })
                .collect()
        };
        let cases: &[(&str, &str, Option<Op>)] = &[
            (
                "GET",
                "/api/2.0/mlflow-artifacts/artifacts?path=1/r",
                Some(Op::List),
            ),
            (
                "GET",
                "/ajax-api/2.0/mlflow-artifacts/artifacts/",
                Some(Op::List),
            ),
            (
                "GET",
                "/ajax-api/2.0/mlflow-artifacts/artifacts/1/r/artifacts/a%20b.txt",
                Some(Op::Download),
            ),
            (
                "HEAD",
                "/api/2.0/mlflow-artifacts/artifacts/x",
                Some(Op::Head),
            ),
            (
                "PUT",
                "/api/2.0/mlflow-artifacts/artifacts/x",
                Some(Op::Upload),
            ),
            (
                "DELETE",
                "/api/2.0/mlflow-artifacts/artifacts/x",
                Some(Op::Delete),
            ),
            (
                "POST",
                "/api/2.0/mlflow-artifacts/mpu/create/1/r/artifacts/big",
                Some(Op::MpuCreate),
            ),
            (
                "POST",
                "/ajax-api/2.0/mlflow-artifacts/mpu/complete/x",
                Some(Op::MpuComplete),
            ),
            (
                "POST",
                "/api/2.0/mlflow-artifacts/mpu/abort/x",
                Some(Op::MpuAbort),
            ),
            (
                "GET",
                "/api/2.0/mlflow-artifacts/presigned/x",
                Some(Op::Presigned),
            ),
            ("POST", "/api/2.0/mlflow-artifacts/artifacts/x", None),
            (
                "OPTIONS",
                "/ajax-api/2.0/mlflow-artifacts/artifacts/x",
                None,
            ),
            ("HEAD", "/api/2.0/mlflow-artifacts/artifacts", None),
            ("HEAD", "/api/2.0/mlflow-artifacts/presigned/x", None),
            ("GET", "/api/2.0/mlflow-artifacts/mpu/create/x", None),
        ];
        for (method, uri, op) in cases {
            let request = http::Request::builder()
                .method(*method)
                .uri(*uri)
                .body(Body::empty())
                .unwrap();
            let before = (counted(502), counted(503));
            let response = app.clone().oneshot(request).await.unwrap();
            let status = response.status().as_u16();
            let after = (counted(502), counted(503));
            let mut expected = before.clone();
            if let Some(op) = op {
                let at = OPS.iter().position(|o| o == op).unwrap();
                match status {
                    502 => expected.0[at] += 1,
                    503 => expected.1[at] += 1,
                    other => panic!("{method} {uri}: {other}"),
                }
            } else {
                assert_eq!(status, 502, "{method} {uri}: MLflow's address is closed");
            }
            assert_eq!(after, expected, "{method} {uri} answered as {op:?}");
        }
        // Not the gateway's: the app's fallback forwards it.
        let request = http::Request::get("/api/2.0/mlflow/artifacts/list")
            .body(Body::empty())
            .unwrap();
        let response = app.oneshot(request).await.unwrap();
        assert_eq!(response.status(), http::StatusCode::NOT_FOUND);
    }

    #[test]
    fn operations_take_their_still_encoded_paths_from_the_uri_under_both_prefixes() {
        let path = |op: Op, uri: &str| op.raw_path(&uri.parse().unwrap());
        assert_eq!(path(Op::List, "/api/2.0/mlflow-artifacts/artifacts"), "");
        assert_eq!(
            path(
                Op::List,
                "/api/2.0/mlflow-artifacts/artifacts?path=1/r/a+b&path=other"
            ),
            "1/r/a%20b"
        );
        assert_eq!(
            path(
                Op::Download,
                "/ajax-api/2.0/mlflow-artifacts/artifacts/1/r/artifacts/a%20b.txt"
            ),
            "1/r/artifacts/a%20b.txt"
        );
        assert_eq!(
            path(Op::Upload, "/api/2.0/mlflow-artifacts/artifacts/x"),
            "x"
        );
        assert_eq!(
            path(
                Op::MpuCreate,
                "/api/2.0/mlflow-artifacts/mpu/create/1/r/artifacts/big"
            ),
            "1/r/artifacts/big"
        );
        assert_eq!(
            path(
                Op::Presigned,
                "/ajax-api/2.0/mlflow-artifacts/presigned/1/r/artifacts/%2Fx"
            ),
            "1/r/artifacts/%2Fx"
        );
    }
}
