//! The gateway: each artifact operation answered from the store, after MLflow authorized it and
//! its path was placed in the request's workspace. Which request is which operation is the route
//! table's business ([`super::routes`]); what the store is asked goes through the object-store
//! facade ([`super::objects`]).

use std::future::Future;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use http::{header, HeaderMap, HeaderValue, StatusCode};
use http_body_util::{BodyExt, Limited};
use serde::Deserialize;
use tokio::sync::Semaphore;

use super::failures::FailureRecorder;
use super::listing;
use super::metrics::GatewayMetrics;
use super::objects::{Bucket, ContentHeaders, Part, PresignError, StoreError};
use super::path::{self, Owner};
use super::policy::{OwnerCheck, Verdict};
use super::routes::Op;
use super::upload::{self, UploadError, UploadLimits};
use super::{ArtifactsConfig, WritePolicy};
use crate::capabilities::authz::{Authorizer, Decision};
use crate::plumbing::error::Error;
use crate::plumbing::mlflow::MlflowVersion;
use crate::plumbing::mlflow_version::LearnedVersion;
use crate::plumbing::proxy::{AnsweredBy, Forwarder};

/// Longest object key S3 (and every S3-compatible store) accepts.
const MAX_KEY_BYTES: usize = 1024;
/// Largest JSON body of an mpu request.
const MAX_JSON_BODY: usize = 4 << 20;
/// Validity of presigned download URLs, as MLflow's default.
const PRESIGNED_DOWNLOAD_TTL: std::time::Duration = std::time::Duration::from_secs(300);

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
    metrics: GatewayMetrics,
    /// Whether MLflow has workspaces on (learned by the authorizer's probe).
    workspaces: crate::plumbing::workspace::Support,
    /// The version of the MLflow behind the gateway: the gateway answers as it does.
    upstream: LearnedVersion,
    /// Upload slots held per client address.
    upload_shares: Arc<ClientShares>,
}

/// How many of something each client address holds, up to `per_client`.
struct ClientShares {
    per_client: usize,
    held: std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>,
    trusted_proxies: crate::plumbing::client::TrustedProxies,
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

/// An operation's answer: the response the client gets, or the proxy's own error, which
/// [`Gateway::serve`] turns into MLflow's error JSON.
type Answer = Result<Response, Error>;

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

/// What MLflow said about an artifact request the gateway would answer.
enum Authorized {
    /// Go ahead; MLflow's CORS answer for the client's origin.
    Allowed(HeaderMap),
    /// MLflow's own refusal of the client (401, 403, a redirect to a login page), relayed as the
    /// client's answer.
    Denied(Response),
    /// MLflow answers the request itself (it refused the question for a reason of the request).
    MlflowAnswers,
}

fn invalid_path() -> Error {
    Error::InvalidParameter("Invalid path".into())
}

impl Gateway {
    // What the gateway shares with the rest of the proxy, each handed in once at start.
    #[allow(clippy::too_many_arguments)]
    pub async fn new(
        config: &ArtifactsConfig,
        forwarder: Forwarder,
        store: crate::plumbing::store::Store,
        authz: Authorizer,
        coalescer: crate::capabilities::coalesce::Coalescer,
        metrics: GatewayMetrics,
        upstream: LearnedVersion,
        trusted_proxies: crate::plumbing::client::TrustedProxies,
    ) -> Option<Gateway> {
        let destination = config.destination.clone()?;
        let bucket = Bucket::connect(&config.s3, destination, forwarder.pools()).await;
        Some(Gateway {
            workspaces: authz.workspaces().clone(),
            forwarder: forwarder.clone(),
            owners: OwnerCheck::new(forwarder.clone(), config.owner_cache_ttl),
            authz,
            failures: FailureRecorder::new(coalescer, store),
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
        match tokio::time::timeout(limit, self.bucket.check()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(format!(
                "HeadBucket {} at {}: {e}",
                self.bucket.name(),
                self.bucket.endpoint()
            )),
            Err(_) => Err(format!(
                "HeadBucket {} at {} took longer than {limit:?}",
                self.bucket.name(),
                self.bucket.endpoint()
            )),
        }
    }

    /// Answers one artifact operation: MLflow authorizes it first (when MLflow authenticates),
    /// its path is placed in the request's workspace, then `work` answers it from the store with
    /// that path (still encoded; for a listing, the query's path, which it places itself). Every
    /// error is MLflow's error JSON, and the answer is counted under the operation's name.
    pub(super) async fn serve<F>(
        &self,
        op: Op,
        request: Request,
        work: impl FnOnce(String, Request) -> F,
    ) -> Response
    where
        F: Future<Output = Answer>,
    {
        if crate::plumbing::workspace::of_request(request.headers()).is_err() {
            // MLflow refuses a workspace name it does not take before it authenticates, and
            // nothing of such a header may reach an object key: MLflow answers the request.
            return self.forward(request).await;
        }
        let raw = op.raw_path(request.uri());
        let peer = peer_of(&request);
        let mut cors = HeaderMap::new();
        let answer = match self.authorize(op, &raw, request.headers(), peer).await {
            // MLflow refused the question for a reason of the request itself. A path the gateway
            // refuses anyway (control characters, traversal) is refused here as it is while
            // MLflow does not authenticate, and never handed on: MLflow 3.17 under uvicorn routes
            // no path with a line break (404 `{"detail":"Not Found"}` to the probe and to the
            // request alike) but stores one with a tab as it is.
            Ok(Authorized::MlflowAnswers) if path::validate(&raw).is_err() => Err(invalid_path()),
            Ok(Authorized::MlflowAnswers) => return self.forward(request).await,
            // MLflow's own refusal of the client is the client's answer, as MLflow sent it.
            Ok(Authorized::Denied(refusal)) => Ok(refusal),
            Ok(Authorized::Allowed(allowed_cors)) => {
                cors = allowed_cors;
                match self.place(op, raw, request.headers()) {
                    Err(error) => Err(error),
                    Ok(path) => work(path, request).await,
                }
            }
            Err(error) => Err(error),
        };
        let mut response = answer.unwrap_or_else(IntoResponse::into_response);
        // MLflow's CORS answer for the client's origin, as MLflow would have sent it.
        response.headers_mut().extend(cors);
        self.metrics
            .requests
            .get_or_create(&super::metrics::ArtifactLabels {
                op: op.name(),
                status: response.status().as_u16(),
            })
            .inc();
        // MLflow's refusal of the client, relayed by the authorizer, stays marked as MLflow's.
        if response.extensions().get::<AnsweredBy>().is_none() {
            response.extensions_mut().insert(AnsweredBy::ARTIFACT_STORE);
        }
        response
    }

    /// A request on the gateway's paths that is no artifact operation (e.g. `POST` to
    /// `artifacts/...`): MLflow answers it, as before the gateway.
    pub(super) async fn forward(&self, request: Request) -> Response {
        let peer = peer_of(&request);
        self.forwarder.forward(request, peer).await
    }

    /// Whether workspaces apply to a request with these headers, and its workspace.
    fn workspace<'h>(&self, headers: &'h HeaderMap) -> (bool, Option<&'h str>) {
        // [`Gateway::serve`] has sent a header MLflow refuses to MLflow.
        let workspace = crate::plumbing::workspace::of_request(headers)
            .ok()
            .flatten();
        (self.workspaces.apply(workspace), workspace)
    }

    /// `raw`, the path `op` names, where MLflow's artifact API places it for this request's
    /// workspace (see [`crate::plumbing::workspace::artifact_path`]); a path naming another workspace is
    /// refused with MLflow's message, and so is a workspace sent to an MLflow without
    /// workspaces. A path that is not valid is left for the operation to refuse, and a listing's
    /// path is left for the listing to place.
    fn place(&self, op: Op, raw: String, headers: &HeaderMap) -> Result<String, Error> {
        let (on, workspace) = self.workspace(headers);
        if workspace.is_some() && self.workspaces.enabled() == Some(false) {
            // MLflow answers this with a 500; the client's mistake is a 400 here.
            return Err(Error::AsMlflow {
                status: StatusCode::BAD_REQUEST,
                error_code: "FEATURE_DISABLED",
                message:
                    "Workspace APIs are not available: workspaces are not enabled on this server"
                        .into(),
            });
        }
        if !on || op == Op::List {
            return Ok(raw);
        }
        let Ok(path) = path::validate(&raw) else {
            return Ok(raw);
        };
        let placed = placed_path(&path, workspace)?;
        // Encoded again for the operation, which validates (decodes) it once more.
        Ok(percent_encoding::utf8_percent_encode(&placed, PATH_SEGMENT).to_string())
    }

    /// `path` (placed) below its workspace's directory when workspaces apply: where the artifact
    /// roots of runs, logged models and traces begin.
    fn below_workspace<'p>(&self, path: &'p str, headers: &HeaderMap) -> &'p str {
        match self.workspace(headers) {
            (true, _) => crate::plumbing::workspace::split_artifact_path(path).1,
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

    /// Asks MLflow whether this client may do `op` on the still-encoded path `raw` (see
    /// [`crate::capabilities::authz`]); `Err` when MLflow could not be asked.
    async fn authorize(
        &self,
        op: Op,
        raw: &str,
        headers: &HeaderMap,
        peer: std::net::SocketAddr,
    ) -> Result<Authorized, Error> {
        let id = crate::plumbing::proxy::request_id(headers);
        match self.authz.check(op.action(), raw, headers, peer, &id).await {
            Decision::Allowed(cors) => Ok(Authorized::Allowed(cors)),
            Decision::Denied(answer) => {
                self.metrics.authz_denials.inc();
                tracing::info!(
                    op = op.name(),
                    status = answer.status().as_u16(),
                    "MLflow refused the artifact request for this client"
                );
                Ok(Authorized::Denied(answer))
            }
            Decision::MlflowAnswers => Ok(Authorized::MlflowAnswers),
            Decision::Unverifiable(error) => Err(error),
        }
    }

    /// The object key of a validated path; S3 keys hold at most 1024 bytes.
    fn key(&self, path: &str) -> Result<String, Error> {
        let key = self.bucket.destination().key(path);
        if key.len() > MAX_KEY_BYTES {
            return Err(Error::InvalidParameter(format!("Invalid path: the object key would be {} bytes long; S3-compatible stores take at most {MAX_KEY_BYTES}.", key.len())));
        }
        Ok(key)
    }

    fn store_error(&self, what: &str, path: &str, error: &StoreError) -> Error {
        // The store refusing the client's own input (a made-up upload id, parts out of order or
        // too small) is the client's mistake: a 4xx it must not retry.
        match error.code.as_deref() {
            Some(listing::TOO_MANY_ENTRIES) => {
                return Error::InvalidParameter(error.message.clone());
            }
            Some("NoSuchUpload") => {
                return Error::NotFound(format!("the store knows no such multipart upload for {path}: it was completed, aborted or never created. Start a new upload."))
            }
            Some(code @ ("InvalidPart" | "InvalidPartOrder" | "EntityTooSmall" | "KeyTooLongError" | "InvalidArgument")) => {
                let message = format!("the artifact store refused to {what} {path} ({code}: {}). Check the request's parts and path.", error.message.trim_end_matches('.'));
                return Error::InvalidParameter(message);
            }
            _ => {}
        }
        let message = format!(
            "the artifact store {} at {} failed to {what} {path}: {}. The object was not changed; retry, and check the store if this persists.",
            self.bucket.destination(),
            self.bucket.endpoint(),
            error.to_string().trim_end_matches('.')
        );
        // A store that could not be reached or asked to slow down: 503, retried; else 502.
        let answer = if error.is_transient() {
            Error::Unavailable(message)
        } else {
            Error::StoreFailed(message)
        };
        tracing::warn!(path, error = %error, status = answer.status().as_u16(), "artifact store operation failed");
        answer
    }

    /// `GET artifacts?path=`: the directory's entries, as MLflow lists them.
    pub(super) async fn list(&self, request: Request) -> Answer {
        // MLflow takes the first of repeated `path` parameters.
        let path = match first_query_value(request.uri().query().unwrap_or(""), "path") {
            Some(p) => path::validate(&p.replace('+', "%20")).map_err(|_| invalid_path())?,
            None => String::new(),
        };
        let path = match self.workspace(request.headers()) {
            (true, workspace) => placed_path(&path, workspace)?,
            (false, _) => path,
        };
        let prefix = self.bucket.destination().dir_prefix(&path);
        let entries = listing::list_dir(&self.bucket, &prefix)
            .await
            .map_err(|e| self.store_error("list", &path, &e))?;
        Ok(listing::pretty(&listing::to_mlflow_json(&entries)))
    }

    /// `GET artifacts/<path>` (ranged when asked), or with `head_only` `HEAD artifacts/<path>`.
    pub(super) async fn download(&self, raw: String, request: Request, head_only: bool) -> Answer {
        let headers = request.headers();
        let path = path::validate(&raw).map_err(|_| invalid_path())?;
        let key = self.key(&path)?;
        let range = headers
            .get(header::RANGE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        if head_only {
            let meta = match self.bucket.head(&key).await {
                Ok(meta) => meta,
                Err(e) => return Err(self.missing_or_dir(&path, &key, e).await),
            };
            let mut response = Response::new(Body::empty());
            let h = response.headers_mut();
            h.insert(
                header::CONTENT_LENGTH,
                HeaderValue::from(meta.size.unwrap_or(0)),
            );
            self.download_headers(h, &path, meta.etag.as_deref(), meta.last_modified);
            return Ok(response);
        }
        let object = match self.bucket.get(&key, range.as_deref()).await {
            Ok(object) => object,
            Err(e) => return Err(self.missing_or_dir(&path, &key, e).await),
        };
        let status = if object.content_range.is_some() {
            StatusCode::PARTIAL_CONTENT
        } else {
            StatusCode::OK
        };
        let length = object.meta.size.unwrap_or(0);
        let mut response = Response::new(Body::empty());
        *response.status_mut() = status;
        let h = response.headers_mut();
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
        if let Some(cr) = object
            .content_range
            .as_deref()
            .and_then(|v| HeaderValue::from_str(v).ok())
        {
            h.insert(header::CONTENT_RANGE, cr);
        }
        self.download_headers(
            h,
            &path,
            object.meta.etag.as_deref(),
            object.meta.last_modified,
        );
        *response.body_mut() = object.body;
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
    async fn missing_or_dir(&self, path: &str, key: &str, error: StoreError) -> Error {
        if error.is_not_found() {
            let probe = self.bucket.has_objects_under(&format!("{key}/")).await;
            if matches!(probe, Ok(true)) {
                return Error::InvalidParameter(format!(
                    "Artifact path refers to a directory, not a file: '{path}'"
                ));
            }
        }
        self.read_error(path, error)
    }

    fn read_error(&self, path: &str, error: StoreError) -> Error {
        if error.is_not_found() {
            return Error::NotFound(format!(
                "artifact {path} does not exist in {}",
                self.bucket.destination()
            ));
        }
        if error.status == Some(416) || error.code.as_deref() == Some("InvalidRange") {
            return Error::AsMlflow {
                status: StatusCode::RANGE_NOT_SATISFIABLE,
                error_code: "INVALID_PARAMETER_VALUE",
                message: format!("the requested range is not satisfiable for {path}"),
            };
        }
        self.store_error("read", path, &error)
    }

    /// Applies the write policy to `path`; `Ok` lets the write go ahead.
    async fn check_write(&self, path: &str, headers: &HeaderMap) -> Result<Option<Owner>, Error> {
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
                return Err(Error::Unavailable(format!("mlscope-proxy could not check with MLflow that {} exists ({reason}); retry.", owner.as_ref().map(ToString::to_string).unwrap_or_default())))
            }
            Verdict::Stray => format!(
                "Artifact writes are only accepted inside an MLflow artifact root: <experiment_id>/<run_id>/artifacts/..., <experiment_id>/models/<model_id>/artifacts/... or <experiment_id>/traces/<trace_id>/artifacts/... (in an MLflow workspace, below workspaces/<workspace>/). '{path}' is outside them, so MLflow would never show it. Log the file to the run instead, e.g. mlflow.log_artifact(local_path, artifact_path=\"checkpoints\") inside the run, which stores it under <experiment_id>/<run_id>/artifacts/checkpoints/."
            ),
            Verdict::Missing(detail) => format!(
                "Artifact path '{path}' names {}, but {detail}. Files must go under <experiment_id>/<run_id>/artifacts/... (or <experiment_id>/models/<model_id>/artifacts/..., <experiment_id>/traces/<trace_id>/artifacts/...) of a run, model or trace that exists in that experiment; use the run's artifact_uri, e.g. through mlflow.log_artifact inside the run.",
                owner.as_ref().map(ToString::to_string).unwrap_or_default()
            ),
        };
        self.metrics.policy_violations.inc();
        if self.config.write_policy == WritePolicy::Warn {
            tracing::warn!(path, reason = %refusal, "write outside MLflow's artifact roots allowed (write policy: warn)");
            return Ok(owner);
        }
        tracing::info!(
            path,
            "write outside MLflow's artifact roots refused (write policy: enforce)"
        );
        Err(Error::PermissionDenied(refusal))
    }

    /// `PUT artifacts/<path>`: the body, streamed to the store.
    pub(super) async fn upload(&self, raw: String, request: Request) -> Answer {
        let path = path::validate(&raw).map_err(|_| invalid_path())?;
        if path.is_empty() || path.ends_with('/') {
            return Err(invalid_path());
        }
        let owner = self.check_write(&path, request.headers()).await?;
        let credentials = FailureRecorder::credentials(request.headers());
        // The last quarter of the upload slots is kept for clients that hold less than a quarter
        // of them, so that slow clients of one address cannot take them all; the slots
        // themselves bound what the gateway holds.
        let peer = crate::plumbing::client::peer_of(request.extensions()).ip();
        let client = self
            .upload_shares
            .trusted_proxies
            .client(peer, request.headers());
        let in_use = self.config.max_concurrent_uploads - self.uploads.available_permits();
        let _share = self
            .upload_shares
            .take(client, in_use, self.config.max_concurrent_uploads)
            .ok_or_else(|| {
            Error::OverShare {
                message: format!("this client has {} or more artifact uploads in progress, the most one client may have while the upload slots are nearly all taken; retry with backoff.", self.upload_shares.per_client),
                retry_after: 1,
            }
        })?;
        let _slot = self.uploads.clone().try_acquire_owned().map_err(|_| {
            Error::Overloaded(format!("mlscope-proxy is handling its limit of {} concurrent artifact uploads; retry with backoff.", self.config.max_concurrent_uploads))
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
                self.metrics.bytes_uploaded.inc_by(bytes);
                tracing::info!(path, bytes, "artifact stored");
                Ok(upload_answer(self.upstream.get()))
            }
            Err(UploadError::Client(reason)) => {
                tracing::info!(path, reason, "upload abandoned by the client; nothing was stored");
                Err(Error::BadRequest(format!("the upload of {path} was not completed: {reason}. Nothing was stored; retry the upload.")))
            }
            Err(UploadError::ClientSlow(received)) => {
                tracing::info!(path, received, "upload too slow; nothing was stored");
                Err(Error::TooSlow(format!("the upload of {path} came slower than {} KiB/s on average ({received} bytes in all); nothing was stored. Check the client's connection and retry.", upload::MIN_BODY_RATE >> 10)))
            }
            Err(UploadError::ClientIdle(after)) => {
                tracing::info!(path, ?after, "upload stalled; nothing was stored");
                Err(crate::plumbing::error::ProxyError::ClientBodyIdle { after }.into())
            }
            Err(UploadError::TooLarge { max }) => Err(Error::AsMlflow { status: StatusCode::PAYLOAD_TOO_LARGE, error_code: "INVALID_PARAMETER_VALUE", message: format!("{path} is larger than the {max} bytes a multipart upload of this part size can hold; raise --artifact-part-size.") }),
            Err(UploadError::Store(error)) => {
                let failed = self.store_error("store", &path, &error);
                if let Some(Owner::Run { run, .. }) = &owner {
                    self.failures.record(run, &path, &error.to_string(), &credentials).await;
                }
                Err(failed)
            }
        }
    }

    /// `DELETE artifacts/<path>`: the file, or the directory with everything in it.
    pub(super) async fn delete(&self, raw: String, request: Request) -> Answer {
        let headers = request.headers();
        let path = path::validate(&raw).map_err(|_| invalid_path())?;
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
            self.metrics.policy_violations.inc();
            if self.config.write_policy == WritePolicy::Enforce {
                tracing::info!(
                    path,
                    "delete above an artifact root refused (write policy: enforce)"
                );
                return Err(Error::PermissionDenied(refusal));
            }
            tracing::warn!(
                path,
                "delete above an artifact root allowed (write policy: warn)"
            );
        }
        let key = self.key(&path)?;
        self.bucket
            .delete_tree(&key)
            .await
            .map_err(|e| self.store_error("delete", &path, &e))?;
        Ok(axum::Json(serde_json::json!({})).into_response())
    }

    async fn json_body<T: serde::de::DeserializeOwned>(request: Request) -> Result<T, Error> {
        let body = Limited::new(request.into_body(), MAX_JSON_BODY)
            .collect()
            .await
            .map_err(|e| Error::BadRequest(format!("the request body could not be read: {e}")))?
            .to_bytes();
        serde_json::from_slice(&body).map_err(|e| Error::AsMlflow {
            status: StatusCode::BAD_REQUEST,
            error_code: "MALFORMED_REQUEST",
            message: format!("the request body is not valid JSON for this endpoint: {e}"),
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

    /// `POST mpu/create/<dir>`: a multipart upload, with a presigned URL for each part.
    pub(super) async fn mpu_create(&self, raw: String, request: Request) -> Answer {
        #[derive(Deserialize)]
        struct Create {
            path: String,
            #[serde(default)]
            num_parts: i64,
        }
        let headers = request.headers().clone();
        let create: Create = Self::json_body(request).await?;
        let path = Self::mpu_target(&raw, &create.path).map_err(|_| invalid_path())?;
        self.check_write(&path, &headers).await?;
        if !(1..=upload::MAX_PARTS as i64).contains(&create.num_parts) {
            return Err(Error::InvalidParameter(format!(
                "num_parts must be between 1 and 10000, not {}",
                create.num_parts
            )));
        }
        let key = self.key(&path)?;
        let upload_id = self
            .bucket
            .start_multipart(&key, &ContentHeaders::of_type(path::content_type(&path)))
            .await
            .map_err(|e| self.store_error("start a multipart upload of", &path, &e))?
            .unwrap_or_default();
        let mut credentials = Vec::with_capacity(create.num_parts as usize);
        for part_number in 1..=create.num_parts as i32 {
            let url = self
                .bucket
                .presign_part(&key, &upload_id, part_number, self.config.presign_expiry)
                .await
                .map_err(|e| {
                    let message = match e {
                        PresignError::Expiry(message) => message,
                        PresignError::Signing(message) => {
                            format!("presigning part {part_number}: {message}")
                        }
                    };
                    Error::Internal(message)
                })?;
            credentials.push(Credential { url, part_number });
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

    /// `POST mpu/complete/<dir>`: the upload's parts, joined into the object.
    pub(super) async fn mpu_complete(&self, raw: String, request: Request) -> Answer {
        #[derive(Deserialize)]
        struct SentPart {
            part_number: i64,
            etag: String,
        }
        #[derive(Deserialize)]
        struct Complete {
            path: String,
            upload_id: String,
            parts: Vec<SentPart>,
        }
        let credentials = FailureRecorder::credentials(request.headers());
        let complete: Complete = Self::json_body(request).await?;
        let path = Self::mpu_target(&raw, &complete.path).map_err(|_| invalid_path())?;
        check_upload_id(&complete.upload_id)?;
        if complete.parts.is_empty() || complete.parts.len() as u64 > upload::MAX_PARTS {
            return Err(Error::InvalidParameter(format!(
                "a multipart upload is completed with 1 to {} parts, not {}",
                upload::MAX_PARTS,
                complete.parts.len()
            )));
        }
        if let Some(bad) = complete.parts.iter().find(|p| {
            !(1..=upload::MAX_PARTS as i64).contains(&p.part_number) || p.etag.len() > 1024
        }) {
            return Err(Error::InvalidParameter(format!("part_number must be between 1 and {} with an ETag of at most 1024 characters, not {}", upload::MAX_PARTS, bad.part_number)));
        }
        let key = self.key(&path)?;
        let parts: Vec<Part> = complete
            .parts
            .iter()
            .map(|p| Part {
                number: p.part_number as i32,
                etag: Some(p.etag.clone()),
            })
            .collect();
        let done = self
            .bucket
            .finish_multipart(&key, &complete.upload_id, parts)
            .await;
        if let Err(error) = done {
            if let Some(Owner::Run { run, .. }) = self.owner_of(&path, &credentials) {
                self.failures
                    .record(&run, &path, &error.to_string(), &credentials)
                    .await;
            }
            return Err(self.store_error("complete the multipart upload of", &path, &error));
        }
        Ok(listing::pretty(&serde_json::json!({})))
    }

    /// `POST mpu/abort/<dir>`: the upload, abandoned.
    pub(super) async fn mpu_abort(&self, raw: String, request: Request) -> Answer {
        #[derive(Deserialize)]
        struct Abort {
            path: String,
            upload_id: String,
        }
        let abort: Abort = Self::json_body(request).await?;
        let path = Self::mpu_target(&raw, &abort.path).map_err(|_| invalid_path())?;
        check_upload_id(&abort.upload_id)?;
        let key = self.key(&path)?;
        self.bucket
            .abort_multipart(&key, &abort.upload_id)
            .await
            .map_err(|e| self.store_error("abort the multipart upload of", &path, &e))?;
        Ok(listing::pretty(&serde_json::json!({})))
    }

    /// `GET presigned/<path>`: a presigned GET URL for a direct download (what MLflow's 3.16+
    /// client asks for before ranged downloads straight from the store).
    pub(super) async fn presigned(&self, raw: String) -> Answer {
        let path = path::validate(&raw).map_err(|_| invalid_path())?;
        let key = self.key(&path)?;
        let head = match self.bucket.head(&key).await {
            Ok(head) => head,
            Err(e) => return Err(self.missing_or_dir(&path, &key, e).await),
        };
        let base = path.rsplit('/').next().unwrap_or(&path);
        let url = self
            .bucket
            .presign_get(
                &key,
                format!("attachment; filename=\"{base}\""),
                PRESIGNED_DOWNLOAD_TTL,
            )
            .await
            .map_err(|e| {
                let message = match e {
                    PresignError::Expiry(message) => message,
                    PresignError::Signing(message) => {
                        format!("presigning the download of {path}: {message}")
                    }
                };
                Error::Internal(message)
            })?;
        let body =
            serde_json::json!({ "url": url, "headers": {}, "file_size": head.size.unwrap_or(0) });
        Ok(axum::Json(body).into_response())
    }
}

/// A validated path where MLflow's artifact API places it for a request in `workspace`, with
/// workspaces on; a path naming another workspace is MLflow's 400.
fn placed_path(path: &str, workspace: Option<&str>) -> Result<String, Error> {
    crate::plumbing::workspace::artifact_path(path, workspace, true)
        .map_err(Error::InvalidParameter)
}

/// An upload id as stores hand them out: 1 to 1024 printable ASCII characters and no path
/// separator (the ids stores hand out are URL-safe tokens; SeaweedFS keeps an upload in a
/// directory named after its id, and failed on `/` or `\`, which the client then retried).
/// Anything else never names an upload, and an overlong one would not fit in a request URI.
fn check_upload_id(id: &str) -> Result<(), Error> {
    let printable = id
        .bytes()
        .all(|b| b.is_ascii_graphic() && b != b'/' && b != b'\\');
    // `.` and `..` name a directory, not an upload, to a store that keeps uploads in directories.
    if id.is_empty() || id.len() > 1024 || !printable || id == "." || id == ".." {
        return Err(Error::InvalidParameter("upload_id must be the id mpu/create returned (1 to 1024 printable ASCII characters, no '/' or '\\', not '.' or '..')".into()));
    }
    Ok(())
}

fn peer_of(request: &Request) -> std::net::SocketAddr {
    crate::plumbing::client::peer_of(request.extensions())
}

/// The raw (still percent-encoded) value of the first `name` parameter of a query string.
pub(super) fn first_query_value<'q>(query: &'q str, name: &str) -> Option<&'q str> {
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
    fn http_dates_are_imf_fixdates() {
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(784_111_777);
        assert_eq!(httpdate::fmt_http_date(t), "Sun, 06 Nov 1994 08:49:37 GMT");
    }
}
