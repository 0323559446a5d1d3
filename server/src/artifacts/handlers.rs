//! The artifact routes, answered from the store.

use std::sync::Arc;

use aws_sdk_s3::presigning::PresigningConfig;
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use http_body_util::{BodyExt, Limited};
use serde::Deserialize;
use tokio::sync::Semaphore;

use super::failures::FailureRecorder;
use super::listing;
use super::path::{self, Owner};
use super::policy::{OwnerCheck, Verdict};
use super::s3::{Bucket, StoreError};
use super::upload::{self, UploadError, UploadLimits};
use super::{ArtifactsConfig, WritePolicy};
use crate::authz::{Action, Authorizer, Decision};
use crate::error::mlflow_error;
use crate::proxy::{AnsweredBy, Forwarder};
use crate::telemetry::Metrics;
use crate::upstream::{MlflowVersion, UpstreamVersion};

const PREFIXES: [&str; 2] = [
    "/api/2.0/mlflow-artifacts/",
    "/ajax-api/2.0/mlflow-artifacts/",
];
/// Longest object key S3 (and every S3-compatible store) accepts.
const MAX_KEY_BYTES: usize = 1024;
/// Largest JSON body of an mpu request.
const MAX_JSON_BODY: usize = 4 << 20;
/// Validity of presigned download URLs, as MLflow's default.
const PRESIGNED_DOWNLOAD_TTL: std::time::Duration = std::time::Duration::from_secs(300);

/// One artifact operation, with the still-encoded path it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArtifactOp {
    List,
    Download(String),
    Head(String),
    Upload(String),
    Delete(String),
    MpuCreate(String),
    MpuComplete(String),
    MpuAbort(String),
    Presigned(String),
}

impl ArtifactOp {
    /// The operation a request asks for, if it is one the gateway serves.
    pub fn of(method: &Method, path: &str) -> Option<ArtifactOp> {
        let rest = PREFIXES.iter().find_map(|p| path.strip_prefix(p))?;
        if rest == "artifacts" || rest == "artifacts/" {
            return (method == Method::GET).then_some(ArtifactOp::List);
        }
        if let Some(p) = rest.strip_prefix("artifacts/") {
            let p = p.to_owned();
            return match *method {
                Method::GET => Some(ArtifactOp::Download(p)),
                Method::HEAD => Some(ArtifactOp::Head(p)),
                Method::PUT => Some(ArtifactOp::Upload(p)),
                Method::DELETE => Some(ArtifactOp::Delete(p)),
                _ => None,
            };
        }
        if let Some(p) = rest.strip_prefix("presigned/") {
            return (method == Method::GET).then(|| ArtifactOp::Presigned(p.to_owned()));
        }
        if method != Method::POST {
            return None;
        }
        let (kind, p) = rest.strip_prefix("mpu/")?.split_once('/')?;
        let p = p.to_owned();
        match kind {
            "create" => Some(ArtifactOp::MpuCreate(p)),
            "complete" => Some(ArtifactOp::MpuComplete(p)),
            "abort" => Some(ArtifactOp::MpuAbort(p)),
            _ => None,
        }
    }

    /// The permission MLflow requires for this operation.
    fn action(&self) -> Action {
        match self {
            ArtifactOp::List | ArtifactOp::Download(_) | ArtifactOp::Presigned(_) => Action::Read,
            ArtifactOp::Head(_) => Action::Head,
            ArtifactOp::Upload(_)
            | ArtifactOp::MpuCreate(_)
            | ArtifactOp::MpuComplete(_)
            | ArtifactOp::MpuAbort(_) => Action::Update,
            ArtifactOp::Delete(_) => Action::Manage,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            ArtifactOp::List => "list",
            ArtifactOp::Download(_) => "download",
            ArtifactOp::Head(_) => "head",
            ArtifactOp::Upload(_) => "upload",
            ArtifactOp::Delete(_) => "delete",
            ArtifactOp::MpuCreate(_) => "mpu_create",
            ArtifactOp::MpuComplete(_) => "mpu_complete",
            ArtifactOp::MpuAbort(_) => "mpu_abort",
            ArtifactOp::Presigned(_) => "presigned",
        }
    }
}

/// The gateway: the store, the write policy and the upload limits.
#[derive(Clone)]
pub struct Gateway {
    bucket: Bucket,
    /// For requests on the gateway's paths that are not artifact operations (e.g. `POST` to
    /// `artifacts/...`): MLflow answers them, as before the gateway.
    forwarder: Forwarder,
    config: Arc<ArtifactsConfig>,
    owners: OwnerCheck,
    authz: Authorizer,
    failures: FailureRecorder,
    uploads: Arc<Semaphore>,
    metrics: Metrics,
    /// Whether MLflow has workspaces on (learned by the authorizer's probe).
    workspaces: crate::workspace::Support,
    /// The version of the MLflow behind the gateway: the gateway answers as it does.
    upstream: UpstreamVersion,
    /// Upload slots held per client address.
    upload_shares: Arc<ClientShares>,
}

/// How many of something each client address holds, up to `per_client`.
struct ClientShares {
    per_client: usize,
    held: std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>,
    trusted_proxies: crate::client::TrustedProxies,
}

/// One held share; given back when dropped.
struct ClientShare {
    shares: Arc<ClientShares>,
    client: std::net::IpAddr,
}

impl ClientShares {
    /// A share for `client`, unless the client holds its quarter already and no more than a
    /// quarter of the `total` slots is free: the last quarter is kept for clients below theirs.
    fn take(
        self: &Arc<Self>,
        client: std::net::IpAddr,
        in_use: usize,
        total: usize,
    ) -> Option<ClientShare> {
        let mut held = self.held.lock().expect("shares lock");
        let count = held.entry(client).or_insert(0);
        if *count >= self.per_client && total - in_use <= total / 4 {
            return None;
        }
        *count += 1;
        Some(ClientShare {
            shares: self.clone(),
            client,
        })
    }
}

impl Drop for ClientShare {
    fn drop(&mut self) {
        let mut held = self.shares.held.lock().expect("shares lock");
        if let Some(count) = held.get_mut(&self.client) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.client);
            }
        }
    }
}

type Answer = Result<Response, Response>;

/// What [`Gateway::place`] encodes of a placed path: everything but `/` and the unreserved
/// characters, so the operation's validation decodes it to exactly the placed path.
const PATH_SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'/')
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// A stored upload's answer, as the MLflow behind the gateway gives it: from 3.15 on, MLflow's
/// server (uvicorn) answers an upload with 200 and nothing else; before, Flask answered `{}` as
/// JSON (the empty `UploadArtifact` response). Until MLflow's version is known: the current shape.
fn upload_answer(version: Option<MlflowVersion>) -> Response {
    match version {
        Some(v) if v < MlflowVersion::new(3, 15, 0) => (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            "{}",
        )
            .into_response(),
        _ => StatusCode::OK.into_response(),
    }
}

fn invalid_path() -> Response {
    mlflow_error(
        StatusCode::BAD_REQUEST,
        "INVALID_PARAMETER_VALUE",
        "Invalid path",
    )
}

impl Gateway {
    pub async fn new(
        config: &ArtifactsConfig,
        forwarder: Forwarder,
        store: crate::store::Store,
        authz: Authorizer,
        metrics: Metrics,
        upstream: UpstreamVersion,
        trusted_proxies: crate::client::TrustedProxies,
    ) -> Option<Gateway> {
        let destination = config.destination.clone()?;
        let bucket = Bucket::connect(&config.s3, destination).await;
        Some(Gateway {
            workspaces: authz.workspaces().clone(),
            forwarder: forwarder.clone(),
            owners: OwnerCheck::new(forwarder.clone(), config.owner_cache_ttl),
            authz,
            failures: FailureRecorder::new(forwarder, store),
            uploads: Arc::new(Semaphore::new(config.max_concurrent_uploads)),
            upload_shares: Arc::new(ClientShares {
                per_client: (config.max_concurrent_uploads / 4).max(1),
                held: Default::default(),
                trusted_proxies,
            }),
            bucket,
            config: Arc::new(config.clone()),
            metrics,
            upstream,
        })
    }

    pub fn bucket(&self) -> &Bucket {
        &self.bucket
    }

    /// Readiness: the bucket answers (HeadBucket) within `limit`.
    pub async fn check_store(&self, limit: std::time::Duration) -> Result<(), String> {
        let head = self
            .bucket
            .client
            .head_bucket()
            .bucket(self.bucket.name())
            .send();
        match tokio::time::timeout(limit, head).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(format!(
                "HeadBucket {} at {}: {}",
                self.bucket.name(),
                self.bucket.endpoint,
                StoreError::from_sdk(e)
            )),
            Err(_) => Err(format!(
                "HeadBucket {} at {} took longer than {limit:?}",
                self.bucket.name(),
                self.bucket.endpoint
            )),
        }
    }

    /// Answers one artifact request: MLflow authorizes it first (when MLflow authenticates),
    /// then the store answers it. Every error is MLflow's error JSON.
    pub async fn serve(&self, op: ArtifactOp, request: Request) -> Response {
        let name = op.name();
        let peer = peer_of(&request);
        let mut cors = HeaderMap::new();
        let result = match self
            .authorize(&op, request.uri(), request.headers(), peer)
            .await
        {
            Err(refusal) => Err(refusal),
            Ok(allowed_cors) => {
                cors = allowed_cors;
                match self.place(op, request.headers()) {
                    Err(refusal) => Err(refusal),
                    Ok(op) => match op {
                        ArtifactOp::List => self.list(request).await,
                        ArtifactOp::Download(p) => {
                            self.download(&p, request.headers(), false).await
                        }
                        ArtifactOp::Head(p) => self.download(&p, request.headers(), true).await,
                        ArtifactOp::Upload(p) => self.upload(&p, request).await,
                        ArtifactOp::Delete(p) => self.delete(&p, request.headers()).await,
                        ArtifactOp::MpuCreate(p) => self.mpu_create(&p, request).await,
                        ArtifactOp::MpuComplete(p) => self.mpu_complete(&p, request).await,
                        ArtifactOp::MpuAbort(p) => self.mpu_abort(&p, request).await,
                        ArtifactOp::Presigned(p) => self.presigned(&p).await,
                    },
                }
            }
        };
        let mut response = result.unwrap_or_else(|e| e);
        // MLflow's CORS answer for the client's origin, as MLflow would have sent it.
        response.headers_mut().extend(cors);
        self.metrics
            .artifact_requests
            .get_or_create(&crate::telemetry::ArtifactLabels {
                op: name,
                status: response.status().as_u16(),
            })
            .inc();
        response
    }

    /// Whether workspaces apply to a request with these headers, and its workspace.
    fn workspace<'h>(&self, headers: &'h HeaderMap) -> (bool, Option<&'h str>) {
        let workspace = crate::workspace::of_request(headers);
        (self.workspaces.apply(workspace), workspace)
    }

    /// `op` with its path where MLflow's artifact API places it for this request's workspace
    /// (see [`crate::workspace::artifact_path`]); a path naming another workspace is refused
    /// with MLflow's message, and so is a workspace sent to an MLflow without workspaces. A path
    /// that is not valid is left for the operation to refuse.
    fn place(&self, op: ArtifactOp, headers: &HeaderMap) -> Result<ArtifactOp, Response> {
        let (on, workspace) = self.workspace(headers);
        if workspace.is_some() && self.workspaces.enabled() == Some(false) {
            // MLflow answers this with a 500; the client's mistake is a 400 here.
            return Err(mlflow_error(
                StatusCode::BAD_REQUEST,
                "FEATURE_DISABLED",
                "Workspace APIs are not available: workspaces are not enabled on this server",
            ));
        }
        if !on {
            return Ok(op);
        }
        let placed = |raw: String| -> Result<String, Response> {
            let Ok(path) = path::validate(&raw) else {
                return Ok(raw);
            };
            let placed = placed_path(&path, workspace)?;
            // Encoded again for the operation, which validates (decodes) it once more.
            Ok(percent_encoding::utf8_percent_encode(&placed, PATH_SEGMENT).to_string())
        };
        Ok(match op {
            ArtifactOp::List => ArtifactOp::List,
            ArtifactOp::Download(p) => ArtifactOp::Download(placed(p)?),
            ArtifactOp::Head(p) => ArtifactOp::Head(placed(p)?),
            ArtifactOp::Upload(p) => ArtifactOp::Upload(placed(p)?),
            ArtifactOp::Delete(p) => ArtifactOp::Delete(placed(p)?),
            ArtifactOp::MpuCreate(p) => ArtifactOp::MpuCreate(placed(p)?),
            ArtifactOp::MpuComplete(p) => ArtifactOp::MpuComplete(placed(p)?),
            ArtifactOp::MpuAbort(p) => ArtifactOp::MpuAbort(placed(p)?),
            ArtifactOp::Presigned(p) => ArtifactOp::Presigned(placed(p)?),
        })
    }

    /// `path` (placed) below its workspace's directory when workspaces apply: where the artifact
    /// roots of runs, logged models and traces begin.
    fn below_workspace<'p>(&self, path: &'p str, headers: &HeaderMap) -> &'p str {
        match self.workspace(headers) {
            (true, _) => crate::workspace::split_artifact_path(path).1,
            (false, _) => path,
        }
    }

    /// The run, logged model or trace whose artifact root holds `path` (placed).
    fn owner_of(&self, path: &str, headers: &HeaderMap) -> Option<Owner> {
        Owner::of(self.below_workspace(path, headers))
    }

    /// As [`Gateway::owner_of`], for what a delete of `path` may remove at most.
    fn owner_of_tree(&self, path: &str, headers: &HeaderMap) -> Option<Owner> {
        Owner::of_tree(self.below_workspace(path, headers))
    }

    /// Asks MLflow whether this client may do `op` (see [`super::authz`]).
    async fn authorize(
        &self,
        op: &ArtifactOp,
        uri: &http::Uri,
        headers: &HeaderMap,
        peer: std::net::SocketAddr,
    ) -> Result<HeaderMap, Response> {
        let raw = match op {
            // A query value: `+` is a space there, `%20` in a path.
            ArtifactOp::List => first_query_value(uri.query().unwrap_or(""), "path")
                .unwrap_or("")
                .replace('+', "%20"),
            ArtifactOp::Download(p)
            | ArtifactOp::Head(p)
            | ArtifactOp::Upload(p)
            | ArtifactOp::Delete(p)
            | ArtifactOp::MpuCreate(p)
            | ArtifactOp::MpuComplete(p)
            | ArtifactOp::MpuAbort(p)
            | ArtifactOp::Presigned(p) => p.clone(),
        };
        let id = crate::proxy::request_id(headers);
        match self
            .authz
            .check(op.action(), &raw, headers, peer, &id)
            .await
        {
            Decision::Allowed(cors) => Ok(cors),
            Decision::Denied(answer) => {
                self.metrics.artifact_authz_denials.inc();
                tracing::info!(
                    op = op.name(),
                    status = answer.status().as_u16(),
                    "MLflow refused the artifact request for this client"
                );
                Err(answer)
            }
            Decision::Unverifiable(answer) => Err(answer),
        }
    }

    /// The object key of a validated path; S3 keys hold at most 1024 bytes.
    fn key(&self, path: &str) -> Result<String, Response> {
        let key = self.bucket.destination.key(path);
        if key.len() > MAX_KEY_BYTES {
            return Err(mlflow_error(
                StatusCode::BAD_REQUEST,
                "INVALID_PARAMETER_VALUE",
                &format!("Invalid path: the object key would be {} bytes long; S3-compatible stores take at most {MAX_KEY_BYTES}.", key.len()),
            ));
        }
        Ok(key)
    }

    fn store_error(&self, what: &str, path: &str, error: &StoreError) -> Response {
        // The store refusing the client's own input (a made-up upload id, parts out of order or
        // too small) is the client's mistake: a 4xx it must not retry.
        match error.code.as_deref() {
            Some(listing::TOO_MANY_ENTRIES) => {
                return mlflow_error(StatusCode::BAD_REQUEST, "INVALID_PARAMETER_VALUE", &error.message);
            }
            Some("NoSuchUpload") => {
                return mlflow_error(
                    StatusCode::NOT_FOUND,
                    "RESOURCE_DOES_NOT_EXIST",
                    &format!("the store knows no such multipart upload for {path}: it was completed, aborted or never created. Start a new upload."),
                )
            }
            Some(code @ ("InvalidPart" | "InvalidPartOrder" | "EntityTooSmall" | "KeyTooLongError" | "InvalidArgument")) => {
                let message = format!("the artifact store refused to {what} {path} ({code}: {}). Check the request's parts and path.", error.message.trim_end_matches('.'));
                return mlflow_error(StatusCode::BAD_REQUEST, "INVALID_PARAMETER_VALUE", &message);
            }
            _ => {}
        }
        let status = if error.is_transient() {
            StatusCode::SERVICE_UNAVAILABLE
        } else {
            StatusCode::BAD_GATEWAY
        };
        let message = format!(
            "the artifact store {} at {} failed to {what} {path}: {}. The object was not changed; retry, and check the store if this persists.",
            self.bucket.destination,
            self.bucket.endpoint,
            error.to_string().trim_end_matches('.')
        );
        tracing::warn!(path, error = %error, status = status.as_u16(), "artifact store operation failed");
        mlflow_error(status, "TEMPORARILY_UNAVAILABLE", &message)
    }

    async fn list(&self, request: Request) -> Answer {
        // MLflow takes the first of repeated `path` parameters.
        let path = match first_query_value(request.uri().query().unwrap_or(""), "path") {
            Some(p) => path::validate(&p.replace('+', "%20")).map_err(|_| invalid_path())?,
            None => String::new(),
        };
        let path = match self.workspace(request.headers()) {
            (true, workspace) => placed_path(&path, workspace)?,
            (false, _) => path,
        };
        let prefix = self.bucket.destination.dir_prefix(&path);
        let entries = listing::list_dir(&self.bucket, &prefix)
            .await
            .map_err(|e| self.store_error("list", &path, &e))?;
        Ok(listing::pretty(&listing::to_mlflow_json(&entries)))
    }

    async fn download(&self, raw: &str, headers: &HeaderMap, head_only: bool) -> Answer {
        let path = path::validate(raw).map_err(|_| invalid_path())?;
        let key = self.key(&path)?;
        let range = headers
            .get(header::RANGE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        if head_only {
            let out = self
                .bucket
                .client
                .head_object()
                .bucket(self.bucket.name())
                .key(&key)
                .send()
                .await;
            let out = match out {
                Ok(out) => out,
                Err(e) => {
                    return Err(self
                        .missing_or_dir(&path, &key, StoreError::from_sdk(e))
                        .await)
                }
            };
            let mut response = Response::new(Body::empty());
            let h = response.headers_mut();
            h.insert(
                header::CONTENT_LENGTH,
                HeaderValue::from(out.content_length().unwrap_or(0).max(0) as u64),
            );
            self.download_headers(h, &path, out.e_tag(), out.last_modified().map(|t| t.secs()));
            return Ok(response);
        }
        let mut get = self
            .bucket
            .client
            .get_object()
            .bucket(self.bucket.name())
            .key(&key);
        if let Some(r) = &range {
            get = get.range(r);
        }
        let out = match get.send().await {
            Ok(out) => out,
            Err(e) => {
                return Err(self
                    .missing_or_dir(&path, &key, StoreError::from_sdk(e))
                    .await)
            }
        };
        let status = if out.content_range().is_some() {
            StatusCode::PARTIAL_CONTENT
        } else {
            StatusCode::OK
        };
        let length = out.content_length().unwrap_or(0).max(0) as u64;
        let mut response = Response::new(Body::empty());
        *response.status_mut() = status;
        let h = response.headers_mut();
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
        if let Some(cr) = out
            .content_range()
            .and_then(|v| HeaderValue::from_str(v).ok())
        {
            h.insert(header::CONTENT_RANGE, cr);
        }
        self.download_headers(h, &path, out.e_tag(), out.last_modified().map(|t| t.secs()));
        let mut stream = out.body;
        let body = futures_util::stream::poll_fn(move |cx| {
            // ByteStream yields the store's chunks as they arrive; nothing is buffered whole.
            std::pin::Pin::new(&mut stream).poll_next(cx)
        });
        *response.body_mut() = Body::from_stream(body);
        Ok(response)
    }

    fn download_headers(
        &self,
        h: &mut HeaderMap,
        path: &str,
        etag: Option<&str>,
        modified: Option<i64>,
    ) {
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(path::content_type(path)),
        );
        h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
        h.insert(
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        );
        if let Ok(v) = HeaderValue::from_str(&path::content_disposition(path)) {
            h.insert(header::CONTENT_DISPOSITION, v);
        }
        if let Some(v) = etag.and_then(|e| HeaderValue::from_str(e).ok()) {
            h.insert(header::ETAG, v);
        }
        if let Some(secs) = modified.and_then(|s| u64::try_from(s).ok()) {
            let when = std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs);
            if let Ok(v) = HeaderValue::from_str(&httpdate::fmt_http_date(when)) {
                h.insert(header::LAST_MODIFIED, v);
            }
        }
    }

    /// A failed read: a directory is told apart from a missing file, as MLflow does.
    async fn missing_or_dir(&self, path: &str, key: &str, error: StoreError) -> Response {
        if error.is_not_found() {
            let probe = self
                .bucket
                .client
                .list_objects_v2()
                .bucket(self.bucket.name())
                .prefix(format!("{key}/"))
                .max_keys(1)
                .send()
                .await;
            if probe.is_ok_and(|page| page.key_count().unwrap_or(0) > 0) {
                return mlflow_error(
                    StatusCode::BAD_REQUEST,
                    "INVALID_PARAMETER_VALUE",
                    &format!("Artifact path refers to a directory, not a file: '{path}'"),
                );
            }
        }
        self.read_error(path, error)
    }

    fn read_error(&self, path: &str, error: StoreError) -> Response {
        if error.is_not_found() {
            return mlflow_error(
                StatusCode::NOT_FOUND,
                "RESOURCE_DOES_NOT_EXIST",
                &format!(
                    "artifact {path} does not exist in {}",
                    self.bucket.destination
                ),
            );
        }
        if error.status == Some(416) || error.code.as_deref() == Some("InvalidRange") {
            return mlflow_error(
                StatusCode::RANGE_NOT_SATISFIABLE,
                "INVALID_PARAMETER_VALUE",
                &format!("the requested range is not satisfiable for {path}"),
            );
        }
        self.store_error("read", path, &error)
    }

    /// Applies the write policy to `path`; `Ok` lets the write go ahead.
    async fn check_write(
        &self,
        path: &str,
        headers: &HeaderMap,
    ) -> Result<Option<Owner>, Response> {
        if self.config.write_policy == WritePolicy::Off {
            return Ok(self.owner_of(path, headers));
        }
        let owner = self.owner_of(path, headers);
        let verdict = match &owner {
            None => Verdict::Stray,
            Some(owner) => self.owners.check(owner, headers).await,
        };
        let refusal = match verdict {
            Verdict::Owned => return Ok(owner),
            Verdict::Unverifiable(reason) => {
                return Err(mlflow_error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "TEMPORARILY_UNAVAILABLE",
                    &format!("mlscope-proxy could not check with MLflow that {} exists ({reason}); retry.", owner.as_ref().map(ToString::to_string).unwrap_or_default()),
                ))
            }
            Verdict::Stray => format!(
                "Artifact writes are only accepted inside an MLflow artifact root: <experiment_id>/<run_id>/artifacts/..., <experiment_id>/models/<model_id>/artifacts/... or <experiment_id>/traces/<trace_id>/artifacts/... (in an MLflow workspace, below workspaces/<workspace>/). '{path}' is outside them, so MLflow would never show it. Log the file to the run instead, e.g. mlflow.log_artifact(local_path, artifact_path=\"checkpoints\") inside the run, which stores it under <experiment_id>/<run_id>/artifacts/checkpoints/."
            ),
            Verdict::Missing(detail) => format!(
                "Artifact path '{path}' names {}, but {detail}. Files must go under <experiment_id>/<run_id>/artifacts/... (or <experiment_id>/models/<model_id>/artifacts/..., <experiment_id>/traces/<trace_id>/artifacts/...) of a run, model or trace that exists in that experiment; use the run's artifact_uri, e.g. through mlflow.log_artifact inside the run.",
                owner.as_ref().map(ToString::to_string).unwrap_or_default()
            ),
        };
        self.metrics.artifact_policy_violations.inc();
        if self.config.write_policy == WritePolicy::Warn {
            tracing::warn!(path, reason = %refusal, "write outside MLflow's artifact roots allowed (write policy: warn)");
            return Ok(owner);
        }
        tracing::info!(
            path,
            "write outside MLflow's artifact roots refused (write policy: enforce)"
        );
        Err(mlflow_error(
            StatusCode::FORBIDDEN,
            "PERMISSION_DENIED",
            &refusal,
        ))
    }

    async fn upload(&self, raw: &str, request: Request) -> Answer {
        let path = path::validate(raw).map_err(|_| invalid_path())?;
        if path.is_empty() || path.ends_with('/') {
            return Err(invalid_path());
        }
        let owner = self.check_write(&path, request.headers()).await?;
        let credentials = FailureRecorder::credentials(request.headers());
        // The last quarter of the upload slots is kept for clients that hold less than a quarter
        // of them, so that slow clients of one address cannot take them all; the slots
        // themselves bound what the gateway holds.
        let peer = crate::client::peer_of(request.extensions()).ip();
        let client = self
            .upload_shares
            .trusted_proxies
            .client(peer, request.headers());
        let in_use = self.config.max_concurrent_uploads - self.uploads.available_permits();
        let _share = self
            .upload_shares
            .take(client, in_use, self.config.max_concurrent_uploads)
            .ok_or_else(|| {
            let mut answer = mlflow_error(
                StatusCode::TOO_MANY_REQUESTS,
                "REQUEST_LIMIT_EXCEEDED",
                &format!("this client has {} or more artifact uploads in progress, the most one client may have while the upload slots are nearly all taken; retry with backoff.", self.upload_shares.per_client),
            );
            answer.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            answer
        })?;
        let _slot = self.uploads.clone().try_acquire_owned().map_err(|_| {
            mlflow_error(
                StatusCode::SERVICE_UNAVAILABLE,
                "TEMPORARILY_UNAVAILABLE",
                &format!("mlscope-proxy is handling its limit of {} concurrent artifact uploads; retry with backoff.", self.config.max_concurrent_uploads),
            )
        })?;
        let length = request
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let key = self.key(&path)?;
        let limits = UploadLimits {
            part_size: self.config.part_size,
            concurrency: self.config.upload_concurrency,
            threshold: self.config.multipart_threshold,
            body_idle: self.config.s3.stall_grace,
        };
        match upload::upload(&self.bucket, &key, path::content_type(&path), request.into_body(), length, limits).await {
            Ok(bytes) => {
                self.metrics.artifact_bytes_uploaded.inc_by(bytes);
                tracing::info!(path, bytes, "artifact stored");
                Ok(upload_answer(self.upstream.get()))
            }
            Err(UploadError::Client(reason)) => {
                tracing::info!(path, reason, "upload abandoned by the client; nothing was stored");
                Err(mlflow_error(StatusCode::BAD_REQUEST, "BAD_REQUEST", &format!("the upload of {path} was not completed: {reason}. Nothing was stored; retry the upload.")))
            }
            Err(UploadError::ClientSlow(received)) => {
                tracing::info!(path, received, "upload too slow; nothing was stored");
                Err(mlflow_error(StatusCode::REQUEST_TIMEOUT, "BAD_REQUEST", &format!("the upload of {path} came slower than {} KiB/s on average ({received} bytes in all); nothing was stored. Check the client's connection and retry.", upload::MIN_BODY_RATE >> 10)))
            }
            Err(UploadError::ClientIdle(after)) => {
                tracing::info!(path, ?after, "upload stalled; nothing was stored");
                Err(crate::error::ProxyError::ClientBodyIdle { after }.into_response())
            }
            Err(UploadError::TooLarge { max }) => Err(mlflow_error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "INVALID_PARAMETER_VALUE",
                &format!("{path} is larger than the {max} bytes a multipart upload of this part size can hold; raise --artifact-part-size."),
            )),
            Err(UploadError::Store(error)) => {
                let response = self.store_error("store", &path, &error);
                if let Some(Owner::Run { run, .. }) = &owner {
                    self.failures.record(run, &path, &error.to_string(), &credentials).await;
                }
                Err(response)
            }
        }
    }

    async fn delete(&self, raw: &str, headers: &HeaderMap) -> Answer {
        let path = path::validate(raw).map_err(|_| invalid_path())?;
        if path.is_empty() {
            return Err(invalid_path());
        }
        // One request removes at most one owner's artifacts: never an experiment, never a
        // directory that holds several runs, models or traces.
        if self.config.write_policy != WritePolicy::Off
            && self.owner_of_tree(&path, headers).is_none()
        {
            let refusal = format!(
                "Deleting '{path}' would remove more than one run's, model's or trace's artifacts. Delete inside one artifact root instead: <experiment_id>/<run_id>/artifacts/..., <experiment_id>/models/<model_id>/artifacts/... or <experiment_id>/traces/<trace_id>/artifacts/...."
            );
            self.metrics.artifact_policy_violations.inc();
            if self.config.write_policy == WritePolicy::Enforce {
                tracing::info!(
                    path,
                    "delete above an artifact root refused (write policy: enforce)"
                );
                return Err(mlflow_error(
                    StatusCode::FORBIDDEN,
                    "PERMISSION_DENIED",
                    &refusal,
                ));
            }
            tracing::warn!(
                path,
                "delete above an artifact root allowed (write policy: warn)"
            );
        }
        let key = self.key(&path)?;
        listing::delete_tree(&self.bucket, &key)
            .await
            .map_err(|e| self.store_error("delete", &path, &e))?;
        Ok(axum::Json(serde_json::json!({})).into_response())
    }

    async fn json_body<T: serde::de::DeserializeOwned>(request: Request) -> Result<T, Response> {
        let body = Limited::new(request.into_body(), MAX_JSON_BODY)
            .collect()
            .await
            .map_err(|e| {
                mlflow_error(
                    StatusCode::BAD_REQUEST,
                    "BAD_REQUEST",
                    &format!("the request body could not be read: {e}"),
                )
            })?
            .to_bytes();
        serde_json::from_slice(&body).map_err(|e| {
            mlflow_error(
                StatusCode::BAD_REQUEST,
                "MALFORMED_REQUEST",
                &format!("the request body is not valid JSON for this endpoint: {e}"),
            )
        })
    }

    /// The key of a multipart upload: MLflow's client names the destination directory in the URL
    /// and the local file in the body's `path`, of which only the base name counts.
    fn mpu_target(raw_dir: &str, file: &str) -> Result<String, path::InvalidPath> {
        let dir = path::validate(raw_dir)?;
        let base = file.rsplit(['/', '\\']).next().unwrap_or(file);
        if base.is_empty() || base == "." || base == ".." {
            return Err(path::InvalidPath);
        }
        let joined = if dir.is_empty() {
            base.to_owned()
        } else {
            format!("{}/{base}", dir.trim_end_matches('/'))
        };
        path::validate(&joined)
    }

    async fn mpu_create(&self, raw: &str, request: Request) -> Answer {
        #[derive(Deserialize)]
        struct Create {
            path: String,
            #[serde(default)]
            num_parts: i64,
        }
        let headers = request.headers().clone();
        let create: Create = Self::json_body(request).await?;
        let path = Self::mpu_target(raw, &create.path).map_err(|_| invalid_path())?;
        self.check_write(&path, &headers).await?;
        if !(1..=upload::MAX_PARTS as i64).contains(&create.num_parts) {
            return Err(mlflow_error(
                StatusCode::BAD_REQUEST,
                "INVALID_PARAMETER_VALUE",
                &format!(
                    "num_parts must be between 1 and 10000, not {}",
                    create.num_parts
                ),
            ));
        }
        let key = self.key(&path)?;
        let created = self
            .bucket
            .client
            .create_multipart_upload()
            .bucket(self.bucket.name())
            .key(&key)
            .content_type(path::content_type(&path))
            .send()
            .await
            .map_err(|e| {
                self.store_error(
                    "start a multipart upload of",
                    &path,
                    &StoreError::from_sdk(e),
                )
            })?;
        let upload_id = created.upload_id().unwrap_or_default().to_owned();
        let presigning = PresigningConfig::expires_in(self.config.presign_expiry).map_err(|e| {
            mlflow_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "INTERNAL_ERROR",
                &e.to_string(),
            )
        })?;
        let mut credentials = Vec::with_capacity(create.num_parts as usize);
        for part_number in 1..=create.num_parts as i32 {
            // Presigned without checksum parameters: a checksum baked into the URL would be the
            // empty body's, and the store would reject the real part.
            let presigned = self
                .bucket
                .presigner
                .upload_part()
                .bucket(self.bucket.name())
                .key(&key)
                .upload_id(&upload_id)
                .part_number(part_number)
                .presigned(presigning.clone())
                .await
                .map_err(|e| {
                    mlflow_error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "INTERNAL_ERROR",
                        &format!("presigning part {part_number}: {e}"),
                    )
                })?;
            credentials.push(Credential {
                url: presigned.uri().to_owned(),
                part_number,
            });
        }
        #[derive(serde::Serialize)]
        struct Created {
            upload_id: String,
            credentials: Vec<Credential>,
        }
        Ok(listing::pretty(&Created {
            upload_id,
            credentials,
        }))
    }

    async fn mpu_complete(&self, raw: &str, request: Request) -> Answer {
        #[derive(Deserialize)]
        struct Part {
            part_number: i64,
            etag: String,
        }
        #[derive(Deserialize)]
        struct Complete {
            path: String,
            upload_id: String,
            parts: Vec<Part>,
        }
        let credentials = FailureRecorder::credentials(request.headers());
        let complete: Complete = Self::json_body(request).await?;
        let path = Self::mpu_target(raw, &complete.path).map_err(|_| invalid_path())?;
        check_upload_id(&complete.upload_id)?;
        if complete.parts.is_empty() || complete.parts.len() as u64 > upload::MAX_PARTS {
            return Err(mlflow_error(
                StatusCode::BAD_REQUEST,
                "INVALID_PARAMETER_VALUE",
                &format!(
                    "a multipart upload is completed with 1 to {} parts, not {}",
                    upload::MAX_PARTS,
                    complete.parts.len()
                ),
            ));
        }
        if let Some(bad) = complete.parts.iter().find(|p| {
            !(1..=upload::MAX_PARTS as i64).contains(&p.part_number) || p.etag.len() > 1024
        }) {
            return Err(mlflow_error(
                StatusCode::BAD_REQUEST,
                "INVALID_PARAMETER_VALUE",
                &format!("part_number must be between 1 and {} with an ETag of at most 1024 characters, not {}", upload::MAX_PARTS, bad.part_number),
            ));
        }
        let key = self.key(&path)?;
        let mut parts: Vec<CompletedPart> = complete
            .parts
            .iter()
            .map(|p| {
                CompletedPart::builder()
                    .part_number(p.part_number as i32)
                    .e_tag(&p.etag)
                    .build()
            })
            .collect();
        parts.sort_by_key(|p| p.part_number());
        let done = self
            .bucket
            .client
            .complete_multipart_upload()
            .bucket(self.bucket.name())
            .key(&key)
            .upload_id(&complete.upload_id)
            .multipart_upload(
                CompletedMultipartUpload::builder()
                    .set_parts(Some(parts))
                    .build(),
            )
            .send()
            .await;
        if let Err(e) = done {
            let error = StoreError::from_sdk(e);
            if let Some(Owner::Run { run, .. }) = self.owner_of(&path, &credentials) {
                self.failures
                    .record(&run, &path, &error.to_string(), &credentials)
                    .await;
            }
            return Err(self.store_error("complete the multipart upload of", &path, &error));
        }
        Ok(listing::pretty(&serde_json::json!({})))
    }

    async fn mpu_abort(&self, raw: &str, request: Request) -> Answer {
        #[derive(Deserialize)]
        struct Abort {
            path: String,
            upload_id: String,
        }
        let abort: Abort = Self::json_body(request).await?;
        let path = Self::mpu_target(raw, &abort.path).map_err(|_| invalid_path())?;
        check_upload_id(&abort.upload_id)?;
        let key = self.key(&path)?;
        self.bucket
            .client
            .abort_multipart_upload()
            .bucket(self.bucket.name())
            .key(&key)
            .upload_id(&abort.upload_id)
            .send()
            .await
            .map_err(|e| {
                self.store_error(
                    "abort the multipart upload of",
                    &path,
                    &StoreError::from_sdk(e),
                )
            })?;
        Ok(listing::pretty(&serde_json::json!({})))
    }

    /// A presigned GET URL for a direct download (what MLflow's 3.16+ client asks for before
    /// ranged downloads straight from the store).
    async fn presigned(&self, raw: &str) -> Answer {
        let path = path::validate(raw).map_err(|_| invalid_path())?;
        let key = self.key(&path)?;
        let head = match self
            .bucket
            .client
            .head_object()
            .bucket(self.bucket.name())
            .key(&key)
            .send()
            .await
        {
            Ok(head) => head,
            Err(e) => {
                return Err(self
                    .missing_or_dir(&path, &key, StoreError::from_sdk(e))
                    .await)
            }
        };
        let base = path.rsplit('/').next().unwrap_or(&path);
        let presigning = PresigningConfig::expires_in(PRESIGNED_DOWNLOAD_TTL).map_err(|e| {
            mlflow_error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "INTERNAL_ERROR",
                &e.to_string(),
            )
        })?;
        let presigned = self
            .bucket
            .presigner
            .get_object()
            .bucket(self.bucket.name())
            .key(&key)
            .response_content_disposition(format!("attachment; filename=\"{base}\""))
            .presigned(presigning)
            .await
            .map_err(|e| {
                mlflow_error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "INTERNAL_ERROR",
                    &format!("presigning the download of {path}: {e}"),
                )
            })?;
        let body = serde_json::json!({ "url": presigned.uri(), "headers": {}, "file_size": head.content_length().unwrap_or(0) });
        Ok(axum::Json(body).into_response())
    }
}

/// Upload ids are the store's opaque tokens: printable and short. Anything else never names an
/// upload, and an overlong one would not fit in a request URI.
/// A validated path where MLflow's artifact API places it for a request in `workspace`, with
/// workspaces on; a path naming another workspace is MLflow's 400.
fn placed_path(path: &str, workspace: Option<&str>) -> Result<String, Response> {
    crate::workspace::artifact_path(path, workspace, true).map_err(|message| {
        mlflow_error(StatusCode::BAD_REQUEST, "INVALID_PARAMETER_VALUE", &message)
    })
}

/// An upload id as stores hand them out: 1 to 1024 printable ASCII characters and no path
/// separator (the ids stores hand out are URL-safe tokens; SeaweedFS keeps an upload in a
/// directory named after its id, and failed on `/` or `\`, which the client then retried).
fn check_upload_id(id: &str) -> Result<(), Response> {
    let printable = id
        .bytes()
        .all(|b| b.is_ascii_graphic() && b != b'/' && b != b'\\');
    if id.is_empty() || id.len() > 1024 || !printable {
        return Err(mlflow_error(
            StatusCode::BAD_REQUEST,
            "INVALID_PARAMETER_VALUE",
            "upload_id must be the id mpu/create returned (1 to 1024 printable ASCII characters, no '/' or '\\')",
        ));
    }
    Ok(())
}

/// The routes the gateway answers from the store, under both API prefixes. Paths are matched
/// still percent-encoded and handed on as they came: the gateway decodes them as MLflow does.
pub fn router<S: Clone + Send + Sync + 'static>(gateway: Gateway) -> Router<S> {
    let mut router = Router::new();
    for prefix in PREFIXES {
        router = router
            .route(&format!("{prefix}artifacts"), get(serve_route))
            .route(&format!("{prefix}artifacts/"), get(serve_route))
            .route(
                &format!("{prefix}artifacts/{{*path}}"),
                get(serve_route)
                    .head(serve_route)
                    .put(serve_route)
                    .delete(serve_route),
            )
            .route(&format!("{prefix}presigned/{{*path}}"), get(serve_route));
        for op in ["create", "complete", "abort"] {
            router = router.route(&format!("{prefix}mpu/{op}/{{*path}}"), post(serve_route));
        }
    }
    router.with_state(gateway)
}

async fn serve_route(State(gateway): State<Gateway>, request: Request) -> Response {
    let Some(op) = ArtifactOp::of(request.method(), request.uri().path()) else {
        let peer = peer_of(&request);
        return gateway.forwarder.forward(request, peer).await;
    };
    let mut response = gateway.serve(op, request).await;
    // MLflow's refusal of the client, relayed by the authorizer, stays marked as MLflow's.
    if response.extensions().get::<AnsweredBy>().is_none() {
        response.extensions_mut().insert(AnsweredBy::ARTIFACT_STORE);
    }
    response
}

fn peer_of(request: &Request) -> std::net::SocketAddr {
    crate::client::peer_of(request.extensions())
}

/// The raw (still percent-encoded) value of the first `name` parameter of a query string.
fn first_query_value<'q>(query: &'q str, name: &str) -> Option<&'q str> {
    query.split('&').find_map(|pair| {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        (key == name).then_some(value)
    })
}

/// A presigned part URL, fields in MLflow's order.
#[derive(serde::Serialize)]
struct Credential {
    url: String,
    part_number: i32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_upload_is_answered_in_the_shape_of_the_mlflow_behind_the_gateway() {
        let answer = |version: Option<MlflowVersion>| async move {
            let response = upload_answer(version);
            let content_type = response.headers().get(header::CONTENT_TYPE).cloned();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (content_type, body)
        };
        for flask in ["2.22.5", "3.5.1", "3.10.1", "3.14.0"] {
            let (content_type, body) = answer(MlflowVersion::parse(flask)).await;
            assert_eq!(
                content_type.as_ref().map(|v| v.as_bytes()),
                Some(&b"application/json"[..]),
                "{flask}"
            );
            assert_eq!(&body[..], b"{}", "{flask}");
        }
        for uvicorn in [Some("3.15.0"), Some("3.17.2"), None] {
            let (content_type, body) = answer(uvicorn.and_then(MlflowVersion::parse)).await;
            assert_eq!(content_type, None, "{uvicorn:?}");
            assert!(body.is_empty(), "{uvicorn:?}");
        }
    }

    #[test]
    fn artifact_routes_are_recognised_under_both_prefixes() {
        let get = Method::GET;
        assert_eq!(
            ArtifactOp::of(&get, "/api/2.0/mlflow-artifacts/artifacts"),
            Some(ArtifactOp::List)
        );
        assert_eq!(
            ArtifactOp::of(
                &get,
                "/ajax-api/2.0/mlflow-artifacts/artifacts/1/r/artifacts/a%20b.txt"
            ),
            Some(ArtifactOp::Download("1/r/artifacts/a%20b.txt".into()))
        );
        assert_eq!(
            ArtifactOp::of(&Method::PUT, "/api/2.0/mlflow-artifacts/artifacts/x"),
            Some(ArtifactOp::Upload("x".into()))
        );
        assert_eq!(
            ArtifactOp::of(
                &Method::POST,
                "/api/2.0/mlflow-artifacts/mpu/create/1/r/artifacts/big"
            ),
            Some(ArtifactOp::MpuCreate("1/r/artifacts/big".into()))
        );
        assert_eq!(
            ArtifactOp::of(&Method::POST, "/api/2.0/mlflow-artifacts/artifacts/x"),
            None
        );
        assert_eq!(ArtifactOp::of(&get, "/api/2.0/mlflow/artifacts/list"), None);
    }

    #[test]
    fn http_dates_are_imf_fixdates() {
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(784_111_777);
        assert_eq!(httpdate::fmt_http_date(t), "Sun, 06 Nov 1994 08:49:37 GMT");
    }
}
