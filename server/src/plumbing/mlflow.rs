//! MLflow's REST API as the proxy speaks it for its own needs: one typed client, [`MlflowClient`],
//! for every call the proxy makes of its own (run health's lookups and run ends, the write
//! policy's owner lookups, the version and `server-info` probes, the relocate tool's run lookup).
//! Each call says whom it speaks for ([`Caller`]: nobody, the proxy's service credential, or a
//! client's own credentials) and in which workspace; its answer is a typed value or one error,
//! [`MlflowError`]. Run tags are not written here: they join their run's write queue (the
//! coalescer), for which [`tags_request`] builds the request and [`answer_of`] reads the answer.
//!
//! Answers are read leniently, field by field, as the callers always read them: a field of an
//! unexpected type is absent, and a time may be a JSON number or a decimal string. Only an answer
//! that is not a JSON object at all is [`MlflowError::Unreadable`].
//!
//! The paths here are the ones the proxy calls; the ones it routes are in `route` and `app`.

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use http_body_util::BodyExt;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize};

use crate::plumbing::credential::ServiceCredential;
use crate::plumbing::proxy::{AskError, Forwarder};

/// MLflow's tracking API, version 2.0.
const API: &str = "/api/2.0/mlflow";
/// MLflow's tracking API, version 3.0 (traces, `server-info`).
const API_3: &str = "/api/3.0/mlflow";
/// MLflow's artifact API: the authorizer's probes ask it.
pub(crate) const ARTIFACTS_API: &str = "/api/2.0/mlflow-artifacts/";
/// `runs/log-batch`: the write queue's tag writes, and the authorizer's write probe.
pub(crate) const LOG_BATCH: &str = "/api/2.0/mlflow/runs/log-batch";
/// The header a client names its MLflow workspace in (HTTP header names are case-insensitive).
pub(crate) const WORKSPACE_HEADER: &str = "x-mlflow-workspace";
/// The longest answer of MLflow read back from the write queue.
const MAX_ANSWER_BYTES: usize = 1 << 20;
/// How much of a refusal's body an error shows.
const SHOWN_CHARS: usize = 300;

/// `text`, percent-encoded for a path segment or a query value (every byte but ASCII letters and
/// digits).
pub(crate) fn percent_encode(text: &str) -> String {
    percent_encoding::utf8_percent_encode(text, percent_encoding::NON_ALPHANUMERIC).to_string()
}

// === Caller ===

/// Whom one of the proxy's own calls speaks for: the headers MLflow authorizes it by (its
/// credential) and finds things by (its workspace). Nothing else of a client's request is sent.
#[derive(Debug, Clone, Default)]
pub(crate) struct Caller {
    headers: HeaderMap,
}

impl Caller {
    /// Nobody: what MLflow answers to anyone (`/version`, `server-info`).
    pub(crate) fn anonymous() -> Self {
        Self::default()
    }

    /// The proxy's own service credential, when it has one that a header can carry.
    pub(crate) fn service(credential: &ServiceCredential) -> Self {
        let mut headers = HeaderMap::new();
        if let Some(value) = credential.header() {
            headers.insert(header::AUTHORIZATION, value);
        }
        Self { headers }
    }

    /// A client's own credentials (`Authorization`, `Cookie`) and workspace, from its request's
    /// headers, so that MLflow's own authorization applies to what the proxy does for it.
    pub(crate) fn client(request: &HeaderMap) -> Self {
        let mut headers = HeaderMap::new();
        for name in [
            header::AUTHORIZATION,
            header::COOKIE,
            http::HeaderName::from_static(WORKSPACE_HEADER),
        ] {
            if let Some(value) = request.get(&name) {
                headers.insert(name, value.clone());
            }
        }
        Self { headers }
    }

    /// The same caller in `workspace` (MLflow finds a run only in its own workspace); `None`, or
    /// a name a header cannot carry: as it was.
    pub(crate) fn in_workspace(mut self, workspace: Option<&str>) -> Self {
        if let Some(value) = workspace.and_then(|w| HeaderValue::from_str(w).ok()) {
            self.headers.insert(WORKSPACE_HEADER, value);
        }
        self
    }

    /// The headers the call carries for it.
    pub(crate) fn headers(&self) -> &HeaderMap {
        &self.headers
    }
}

// === MlflowError ===

/// Why a call of the proxy's own got no answer it could use.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum MlflowError {
    /// MLflow did not answer (or the request could not be built); the kind says whether it is
    /// worth sending again.
    #[error(transparent)]
    Unanswered(#[from] AskError),
    /// MLflow answered with a status other than a success.
    #[error("MLflow answered {status} to {path}: {shown}")]
    Refused {
        path: String,
        status: StatusCode,
        /// MLflow's `error_code`, when its answer is MLflow's error JSON.
        error_code: Option<String>,
        /// MLflow's `message`, when its answer is MLflow's error JSON.
        message: Option<String>,
        /// The start of the answer's body, as text.
        shown: String,
    },
    /// MLflow answered with a success the proxy could not read (not a JSON object, or not a
    /// version).
    #[error("MLflow's answer {status} to {path} could not be read: {reason}")]
    Unreadable {
        path: String,
        status: StatusCode,
        reason: String,
    },
}

impl MlflowError {
    /// The status MLflow answered with, when it answered.
    pub(crate) fn status(&self) -> Option<StatusCode> {
        match self {
            MlflowError::Unanswered(_) => None,
            MlflowError::Refused { status, .. } | MlflowError::Unreadable { status, .. } => {
                Some(*status)
            }
        }
    }

    /// MLflow's `error_code` of a refusal.
    pub(crate) fn error_code(&self) -> Option<&str> {
        match self {
            MlflowError::Refused { error_code, .. } => error_code.as_deref(),
            _ => None,
        }
    }

    /// Whether MLflow refused the caller's credential (401, 403).
    pub(crate) fn refused_credential(&self) -> bool {
        matches!(
            self.status(),
            Some(StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN)
        )
    }

    /// Whether asking again cannot change MLflow's answer: the thing asked about does not exist
    /// (any more), or the request is one MLflow will never take, e.g. a write to a deleted run. A
    /// refused credential (401, 403), a conflict, throttling and 5xx may pass.
    pub(crate) fn refused_for_good(&self) -> bool {
        let MlflowError::Refused {
            status, error_code, ..
        } = self
        else {
            return false;
        };
        status.is_client_error()
            && !self.refused_credential()
            && (matches!(*status, StatusCode::BAD_REQUEST | StatusCode::NOT_FOUND)
                || matches!(
                    error_code.as_deref(),
                    Some("RESOURCE_DOES_NOT_EXIST" | "INVALID_PARAMETER_VALUE")
                ))
    }
}

/// MLflow's answer `status`, `body` to `path` as a `T`: a success read leniently, anything else
/// an error.
pub(crate) fn answer<T: DeserializeOwned>(
    status: StatusCode,
    path: &str,
    body: &[u8],
) -> Result<T, MlflowError> {
    checked(status, path, body)?;
    let unreadable = |reason: String| MlflowError::Unreadable {
        path: path.to_owned(),
        status,
        reason,
    };
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| unreadable(e.to_string()))?;
    T::deserialize(value).map_err(|e| unreadable(e.to_string()))
}

/// `Ok` for a success; a refusal with what MLflow said otherwise.
fn checked(status: StatusCode, path: &str, body: &[u8]) -> Result<(), MlflowError> {
    if status.is_success() {
        return Ok(());
    }
    #[derive(Default, Deserialize)]
    struct ErrorJson {
        #[serde(default, deserialize_with = "lenient")]
        error_code: Option<String>,
        #[serde(default, deserialize_with = "lenient")]
        message: Option<String>,
    }
    let said: ErrorJson = serde_json::from_slice(body).unwrap_or_default();
    Err(MlflowError::Refused {
        path: path.to_owned(),
        status,
        error_code: said.error_code,
        message: said.message,
        shown: String::from_utf8_lossy(body)
            .chars()
            .take(SHOWN_CHARS)
            .collect(),
    })
}

// === answers ===

/// `runs/get`'s answer `status`, `body` to `path`: the run it describes.
pub(crate) fn run_answer(status: StatusCode, path: &str, body: &[u8]) -> Result<Run, MlflowError> {
    answer::<GetRun>(status, path, body).map(|answer| answer.run)
}

/// `runs/get`'s answer.
#[derive(Debug, Clone, Default, Deserialize)]
struct GetRun {
    #[serde(default, deserialize_with = "lenient_or_default")]
    run: Run,
}

/// A run, as `runs/get` describes it.
#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct Run {
    #[serde(default, deserialize_with = "lenient_or_default")]
    pub(crate) info: RunInfo,
    #[serde(default, deserialize_with = "lenient_or_default")]
    pub(crate) data: RunData,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct RunInfo {
    #[serde(default, deserialize_with = "lenient")]
    pub(crate) run_id: Option<String>,
    #[serde(default, deserialize_with = "lenient")]
    pub(crate) experiment_id: Option<String>,
    /// `RUNNING`, `FINISHED`, `FAILED`, `KILLED`, `SCHEDULED`.
    #[serde(default, deserialize_with = "lenient")]
    pub(crate) status: Option<String>,
    #[serde(default, deserialize_with = "millis")]
    pub(crate) start_time: Option<i64>,
    #[serde(default, deserialize_with = "millis")]
    pub(crate) end_time: Option<i64>,
    #[serde(default, deserialize_with = "lenient")]
    pub(crate) artifact_uri: Option<String>,
    #[serde(default, deserialize_with = "lenient")]
    pub(crate) lifecycle_stage: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct RunData {
    #[serde(default, deserialize_with = "lenient_or_default")]
    pub(crate) tags: Vec<RunTag>,
}

impl Run {
    /// The value of the run's tag `key`.
    pub(crate) fn tag(&self, key: &str) -> Option<&str> {
        self.data
            .tags
            .iter()
            .find(|t| t.key == key)
            .map(|t| t.value.as_str())
    }
}

/// One run tag, as MLflow writes and reads it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RunTag {
    #[serde(default)]
    pub(crate) key: String,
    #[serde(default)]
    pub(crate) value: String,
}

impl From<(String, String)> for RunTag {
    fn from((key, value): (String, String)) -> Self {
        RunTag { key, value }
    }
}

/// `logged-models/{id}`'s answer: the model's experiment.
#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct LoggedModel {
    #[serde(default, deserialize_with = "lenient")]
    model: Option<ModelInfoHolder>,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct ModelInfoHolder {
    #[serde(default, deserialize_with = "lenient")]
    info: Option<ExperimentOf>,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct ExperimentOf {
    #[serde(default, deserialize_with = "lenient")]
    experiment_id: Option<String>,
}

impl LoggedModel {
    pub(crate) fn experiment_id(&self) -> Option<&str> {
        self.model.as_ref()?.info.as_ref()?.experiment_id.as_deref()
    }
}

/// `traces/{id}`'s answer (API 3.0): the trace's experiment.
#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct Trace {
    #[serde(default, deserialize_with = "lenient")]
    trace: Option<TraceHolder>,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct TraceHolder {
    #[serde(default, deserialize_with = "lenient")]
    trace_info: Option<TraceInfo>,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct TraceInfo {
    #[serde(default, deserialize_with = "lenient")]
    trace_location: Option<TraceLocation>,
}

#[derive(Debug, Clone, Default, Deserialize)]
struct TraceLocation {
    #[serde(default, deserialize_with = "lenient")]
    mlflow_experiment: Option<ExperimentOf>,
}

impl Trace {
    pub(crate) fn experiment_id(&self) -> Option<&str> {
        self.trace
            .as_ref()?
            .trace_info
            .as_ref()?
            .trace_location
            .as_ref()?
            .mlflow_experiment
            .as_ref()?
            .experiment_id
            .as_deref()
    }
}

/// `server-info`'s answer (API 3.0, MLflow 3.10 and later).
#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct ServerInfo {
    #[serde(default, deserialize_with = "lenient")]
    workspaces_enabled: Option<bool>,
}

impl ServerInfo {
    /// Whether MLflow has workspaces on (`workspaces_enabled: true`).
    pub(crate) fn workspaces_enabled(&self) -> bool {
        self.workspaces_enabled == Some(true)
    }
}

/// `runs/update`'s answer: the run as MLflow updated it.
#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct UpdatedRun {
    #[serde(default, deserialize_with = "lenient_or_default")]
    pub(crate) run_info: RunInfo,
}

/// What a client's `runs/update` asks, as MLflow reads it: the status by name or by its
/// protobuf number, the end as an integer or a decimal string.
#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct RunUpdate {
    #[serde(default, deserialize_with = "run_status")]
    pub(crate) status: Option<String>,
    #[serde(default, deserialize_with = "millis")]
    pub(crate) end_time: Option<i64>,
}

/// A `runs/update`: the run's new status, and its end.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct UpdateRun<'a> {
    pub(crate) run_id: &'a str,
    /// MLflow before 2.0 reads the run from this field.
    pub(crate) run_uuid: &'a str,
    pub(crate) status: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) end_time: Option<i64>,
}

#[derive(Serialize)]
struct LogTags<'a> {
    run_id: &'a str,
    tags: &'a [RunTag],
}

#[derive(Serialize)]
struct DeleteTag<'a> {
    run_id: &'a str,
    key: &'a str,
}

// === MlflowClient ===

/// The proxy's own calls to MLflow, through the forwarder; cheap to clone.
#[derive(Clone)]
pub(crate) struct MlflowClient {
    forwarder: Forwarder,
}

impl MlflowClient {
    pub(crate) fn new(forwarder: Forwarder) -> Self {
        Self { forwarder }
    }

    /// `runs/get`.
    pub(crate) async fn get_run(&self, caller: &Caller, run_id: &str) -> Result<Run, MlflowError> {
        let path = format!("{API}/runs/get?run_id={}", percent_encode(run_id));
        let response = self.send(Method::GET, &path, caller, None).await?;
        run_answer(response.status(), &path, response.body())
    }

    /// `logged-models/{model_id}`.
    pub(crate) async fn get_logged_model(
        &self,
        caller: &Caller,
        model_id: &str,
    ) -> Result<LoggedModel, MlflowError> {
        let path = format!("{API}/logged-models/{}", percent_encode(model_id));
        self.call(Method::GET, &path, caller, None).await
    }

    /// `traces/{trace_id}` (API 3.0).
    pub(crate) async fn get_trace(
        &self,
        caller: &Caller,
        trace_id: &str,
    ) -> Result<Trace, MlflowError> {
        let path = format!("{API_3}/traces/{}", percent_encode(trace_id));
        self.call(Method::GET, &path, caller, None).await
    }

    /// `runs/update`.
    pub(crate) async fn update_run(
        &self,
        caller: &Caller,
        update: &UpdateRun<'_>,
    ) -> Result<(), MlflowError> {
        let body = serde_json::to_vec(update).map_err(request_error)?;
        self.post(&format!("{API}/runs/update"), caller, body).await
    }

    /// `runs/delete-tag`.
    pub(crate) async fn delete_tag(
        &self,
        caller: &Caller,
        run_id: &str,
        key: &str,
    ) -> Result<(), MlflowError> {
        let body = serde_json::to_vec(&DeleteTag { run_id, key }).map_err(request_error)?;
        self.post(&format!("{API}/runs/delete-tag"), caller, body)
            .await
    }

    /// `PUT mlflow-artifacts/artifacts/{path}`: a file of `content_type` into MLflow's proxied
    /// artifact store (`path` as MLflow's artifact API names it, its segments not yet encoded).
    pub(crate) async fn put_artifact(
        &self,
        caller: &Caller,
        path: &str,
        content_type: &'static str,
        body: Bytes,
    ) -> Result<(), MlflowError> {
        let path = artifact_request_path(path);
        let mut headers = caller.headers().clone();
        headers.insert(
            header::HOST,
            HeaderValue::from_str(self.forwarder.upstream().authority.as_str())
                .map_err(request_error)?,
        );
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
        let response = self
            .forwarder
            .ask(Method::PUT, &path, headers, body)
            .await?;
        checked(response.status(), &path, response.body())
    }

    /// `server-info` (API 3.0), answered to anyone.
    pub(crate) async fn server_info(&self) -> Result<ServerInfo, MlflowError> {
        let path = format!("{API_3}/server-info");
        self.call(Method::GET, &path, &Caller::anonymous(), None)
            .await
    }

    /// `/version`, answered to anyone: MLflow's version (an answer that names none is
    /// [`MlflowError::Unreadable`]).
    pub(crate) async fn version(&self) -> Result<MlflowVersion, MlflowError> {
        let path = "/version";
        let response = self
            .send(Method::GET, path, &Caller::anonymous(), None)
            .await?;
        let status = response.status();
        checked(status, path, response.body())?;
        let text = String::from_utf8_lossy(response.body());
        MlflowVersion::parse(&text).ok_or_else(|| MlflowError::Unreadable {
            path: path.to_owned(),
            status,
            reason: "not a version".into(),
        })
    }

    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        caller: &Caller,
        json: Option<Vec<u8>>,
    ) -> Result<T, MlflowError> {
        let response = self.send(method, path, caller, json).await?;
        answer(response.status(), path, response.body())
    }

    /// A change whose answer says nothing the proxy reads: only its status counts.
    async fn post(&self, path: &str, caller: &Caller, json: Vec<u8>) -> Result<(), MlflowError> {
        let response = self.send(Method::POST, path, caller, Some(json)).await?;
        checked(response.status(), path, response.body())
    }

    /// The request with exactly the caller's headers, `Host` the upstream's, and a JSON body
    /// when given, answered in full.
    async fn send(
        &self,
        method: Method,
        path: &str,
        caller: &Caller,
        json: Option<Vec<u8>>,
    ) -> Result<http::Response<Bytes>, MlflowError> {
        let mut headers = caller.headers().clone();
        headers.insert(
            header::HOST,
            HeaderValue::from_str(self.forwarder.upstream().authority.as_str())
                .map_err(request_error)?,
        );
        let body = match json {
            Some(body) => {
                headers.insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
                Bytes::from(body)
            }
            None => Bytes::new(),
        };
        Ok(self.forwarder.ask(method, path, headers, body).await?)
    }
}

/// The request path of an artifact `path` in MLflow's artifact API, each segment encoded.
pub(crate) fn artifact_request_path(path: &str) -> String {
    let segments: Vec<String> = path
        .trim_matches('/')
        .split('/')
        .map(percent_encode)
        .collect();
    format!("{ARTIFACTS_API}artifacts/{}", segments.join("/"))
}

fn request_error(error: impl std::fmt::Display) -> MlflowError {
    MlflowError::Unanswered(AskError::Request(error.to_string()))
}

// === run tags, through the write queue ===

/// A `runs/log-batch` of `tags` (at most `writes::MAX_BATCH_TAGS`) for `run_id`, as the caller,
/// for the run's write queue.
pub(crate) fn tags_request(caller: &Caller, run_id: &str, tags: &[RunTag]) -> Request {
    let body = serde_json::to_vec(&LogTags { run_id, tags }).unwrap_or_default();
    let mut request = Request::new(Body::from(body.clone()));
    *request.method_mut() = Method::POST;
    *request.uri_mut() = http::Uri::from_static(LOG_BATCH);
    *request.headers_mut() = caller.headers().clone();
    request.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    request
        .headers_mut()
        .insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
    request
}

/// The write queue's answer to a [`tags_request`]: `Ok` for a success. An answer that cannot be
/// read whole is judged by its status alone.
pub(crate) async fn answer_of(response: Response) -> Result<(), MlflowError> {
    let status = response.status();
    let body = http_body_util::Limited::new(response.into_body(), MAX_ANSWER_BYTES)
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    checked(status, LOG_BATCH, &body)
}

// === MlflowVersion ===

/// An MLflow release, `major.minor.patch`; ordered as releases are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct MlflowVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl MlflowVersion {
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        Self {
            major,
            minor,
            patch,
        }
    }

    /// `3.17.2`, `2.22.5`, `3.18.0rc0`, `3.16.1.dev0` (pre-release and local parts are ignored);
    /// `None` for anything else.
    pub fn parse(text: &str) -> Option<Self> {
        let mut parts = text.trim().split('.');
        let number = |part: Option<&str>| -> Option<u32> {
            let digits: String = part?.chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        };
        let major = number(parts.next())?;
        let minor = number(parts.next())?;
        let patch = number(parts.next()).unwrap_or(0);
        Some(Self::new(major, minor, patch))
    }
}

impl std::fmt::Display for MlflowVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

// === lenient fields ===

/// A field of the type it should be, else absent.
fn lenient<'de, D: Deserializer<'de>, T: DeserializeOwned>(d: D) -> Result<Option<T>, D::Error> {
    let value = serde_json::Value::deserialize(d)?;
    Ok(serde_json::from_value(value).ok())
}

/// A field of the type it should be, else its default.
fn lenient_or_default<'de, D: Deserializer<'de>, T: DeserializeOwned + Default>(
    d: D,
) -> Result<T, D::Error> {
    Ok(lenient(d)?.unwrap_or_default())
}

/// Milliseconds: a JSON integer, or a string of one (protobuf's JSON of an int64).
fn millis<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    Ok(match serde_json::Value::deserialize(d)? {
        serde_json::Value::Number(n) => n.as_i64(),
        serde_json::Value::String(s) => s.parse().ok(),
        _ => None,
    })
}

/// A run status: its name, or its number in MLflow's protobuf (`RunStatus`).
fn run_status<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(match serde_json::Value::deserialize(d)? {
        serde_json::Value::String(s) => Some(s),
        serde_json::Value::Number(n) => match n.as_i64() {
            Some(1) => Some("RUNNING".to_owned()),
            Some(3) => Some("FINISHED".to_owned()),
            Some(4) => Some("FAILED".to_owned()),
            Some(5) => Some("KILLED".to_owned()),
            _ => None,
        },
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_percent_encoded_in_paths_and_queries() {
        assert_eq!(percent_encode("abc12"), "abc12");
        assert_eq!(percent_encode("a b&c"), "a%20b%26c");
        assert_eq!(percent_encode("m-1/x"), "m%2D1%2Fx");
    }

    #[test]
    fn a_run_is_read_leniently_field_by_field() {
        let body = br#"{"run": {"info": {"run_id": "r", "status": "RUNNING", "start_time": "1000",
            "end_time": 2000, "experiment_id": 7}, "data": {"tags": [
            {"key": "mlflow.note.content", "value": "note"}, {"key": "k"}]}}}"#;
        let run: GetRun = answer(StatusCode::OK, "/p", body).unwrap();
        let info = &run.run.info;
        assert_eq!(info.status.as_deref(), Some("RUNNING"));
        assert_eq!((info.start_time, info.end_time), (Some(1000), Some(2000)));
        // An experiment id that is not text is no experiment id.
        assert_eq!(info.experiment_id, None);
        assert_eq!(run.run.tag("mlflow.note.content"), Some("note"));
        assert_eq!(run.run.tag("k"), Some(""));
        // Tags that are not a list are none.
        let odd: GetRun =
            answer(StatusCode::OK, "/p", br#"{"run": {"data": {"tags": 3}}}"#).unwrap();
        assert!(odd.run.data.tags.is_empty());
        assert!(matches!(
            answer::<GetRun>(StatusCode::OK, "/p", b"<html>"),
            Err(MlflowError::Unreadable { .. })
        ));
    }

    #[test]
    fn models_traces_and_server_info_name_what_they_are_asked_for() {
        let model: LoggedModel = answer(
            StatusCode::OK,
            "/p",
            br#"{"model": {"info": {"experiment_id": "3"}}}"#,
        )
        .unwrap();
        assert_eq!(model.experiment_id(), Some("3"));
        let trace: Trace = answer(StatusCode::OK, "/p", br#"{"trace": {"trace_info": {"trace_location": {"mlflow_experiment": {"experiment_id": "4"}}}}}"#).unwrap();
        assert_eq!(trace.experiment_id(), Some("4"));
        let none: Trace = answer(StatusCode::OK, "/p", b"{}").unwrap();
        assert_eq!(none.experiment_id(), None);
        let info: ServerInfo =
            answer(StatusCode::OK, "/p", br#"{"workspaces_enabled": "yes"}"#).unwrap();
        assert!(!info.workspaces_enabled());
    }

    #[test]
    fn only_answers_that_asking_again_cannot_change_are_refusals_for_good() {
        let refusal = |status: StatusCode, body: &[u8]| {
            answer::<serde_json::Value>(status, "/runs/get", body).unwrap_err()
        };
        let gone = br#"{"error_code":"RESOURCE_DOES_NOT_EXIST","message":"Run 'x' not found"}"#;
        let not_found = refusal(StatusCode::NOT_FOUND, gone);
        assert!(not_found.refused_for_good());
        assert_eq!(not_found.error_code(), Some("RESOURCE_DOES_NOT_EXIST"));
        assert_eq!(
            not_found.to_string(),
            format!(
                "MLflow answered 404 Not Found to /runs/get: {}",
                String::from_utf8_lossy(gone)
            )
        );
        let deleted = br#"{"error_code":"INVALID_PARAMETER_VALUE","message":"must be active"}"#;
        assert!(refusal(StatusCode::BAD_REQUEST, deleted).refused_for_good());
        assert!(refusal(StatusCode::NOT_FOUND, b"not json").refused_for_good());
        for (status, body) in [
            (StatusCode::UNAUTHORIZED, &b""[..]),
            (StatusCode::FORBIDDEN, gone),
            (StatusCode::TOO_MANY_REQUESTS, b""),
            (StatusCode::CONFLICT, b""),
            (StatusCode::SERVICE_UNAVAILABLE, gone),
            (StatusCode::INTERNAL_SERVER_ERROR, deleted),
        ] {
            assert!(!refusal(status, body).refused_for_good(), "{status}");
        }
        assert!(refusal(StatusCode::FORBIDDEN, gone).refused_credential());
    }

    #[tokio::test]
    async fn tags_go_as_one_log_batch_with_the_callers_headers_only() {
        let mut client = HeaderMap::new();
        client.insert(header::AUTHORIZATION, "Bearer t".parse().unwrap());
        client.insert("x-other", "no".parse().unwrap());
        let caller = Caller::client(&client).in_workspace(Some("team-a"));
        let request = tags_request(
            &caller,
            "r",
            &[RunTag::from(("k".to_owned(), "v".to_owned()))],
        );
        assert_eq!(request.uri().path(), LOG_BATCH);
        let headers = request.headers();
        assert_eq!(headers[header::AUTHORIZATION], "Bearer t");
        assert_eq!(headers[WORKSPACE_HEADER], "team-a");
        assert!(!headers.contains_key("x-other"));
        let body = request.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&body).unwrap(),
            serde_json::json!({"run_id": "r", "tags": [{"key": "k", "value": "v"}]})
        );
    }

    #[test]
    fn versions_parse_and_order_as_releases() {
        let v = |s| MlflowVersion::parse(s).unwrap();
        assert_eq!(v("3.17.2"), MlflowVersion::new(3, 17, 2));
        assert_eq!(v(" 2.22.5\n"), MlflowVersion::new(2, 22, 5));
        assert_eq!(v("3.18.0rc0"), MlflowVersion::new(3, 18, 0));
        assert_eq!(v("3.16.1.dev0"), MlflowVersion::new(3, 16, 1));
        assert_eq!(v("4.0"), MlflowVersion::new(4, 0, 0));
        assert!(v("3.9.0") < v("3.10.0"));
        assert!(v("2.22.5") < v("3.5.1"));
        for garbage in ["", "garbage", "3", "<html>", "v3.17.2"] {
            assert_eq!(MlflowVersion::parse(garbage), None, "{garbage:?}");
        }
    }
}
