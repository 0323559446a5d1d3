//! Authorization parity with MLflow for what the proxy does itself: the artifact requests the
//! gateway answers from the store, and the deduplication state a metric write changes.
//!
//! MLflow's authentication apps (`--app-name basic-auth`, plugins such as mlflow-oidc-auth)
//! authorize every request before its handler runs: reading artifacts needs READ, writing them
//! and multipart need EDIT, deleting needs MANAGE, judged on the experiment and the tier (run,
//! logged model, trace) the path names; logging to a run needs EDIT on it. The proxy cannot
//! re-implement those rules — plugins and future versions change them — so it asks MLflow itself,
//! with the client's own headers, a question whose answer is that decision and whose handler
//! changes nothing:
//!
//! | the client asks | the proxy asks MLflow | MLflow answers when allowed |
//! |---|---|---|
//! | download, presigned, list of `P` | `GET artifacts?path=P/<probe>` (lists a directory that does not exist) | 200 `{}` |
//! | `HEAD` of `P` | `HEAD artifacts/P/<probe>` (MLflow's auth refuses HEAD to non-admins) | 404 (no such file) |
//! | PUT, `mpu/create|complete|abort` of `P` | `POST mpu/create/P` with `{}` (refused before anything is created: no `path`) | 400 |
//! | DELETE of `P` | `DELETE artifacts/P/<probe>` (a subtree that does not exist) | 200 |
//! | node-wide system metrics for run `R` (they elect or renew a reporter lease) | `POST runs/log-batch` with `{"run_id": R}` (a batch of nothing) | 200 |
//!
//! MLflow judges `P/<probe>` exactly as `P` for every path the gateway lets through: the probe's
//! name is no experiment id, no tier folder (`models`, `traces`, `artifacts`) and no run id, so it
//! changes neither the experiment nor the tier of the path. (The one path where it would — a
//! recursive delete of an experiment's root — is refused by the gateway before it asks.) A 401 or
//! 403 (or a redirect to a login page) is relayed to the client as MLflow sent it.
//!
//! Whether MLflow authenticates at all is detected, not configured: an anonymous probe every
//! few seconds. While MLflow answers it, nothing is asked per request. A 401 seen on any
//! forwarded request switches checking on at once.
//!
//! Allowed answers are cached per credential for a short time; denials are never cached.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use sha2::{Digest, Sha256};

use crate::plumbing::aged::AgedMap;
use crate::plumbing::error::Error;
use crate::plumbing::mlflow::{MlflowClient, MlflowError};
use crate::plumbing::proxy::{AnsweredBy, Forwarder};

/// The name the probes append to a path. Not a number (experiment id), not a tier folder, not 32
/// hex digits (a run id), and random per process so that it never names an existing object.
fn probe_name() -> String {
    format!(
        ".mlscope-authz-probe-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// MLflow's "allowed" answers by (credential, action, path): when given, and MLflow's CORS
/// headers.
type Decisions = AgedMap<[u8; 32], (Instant, HeaderMap)>;

/// Entries kept in the decision cache at most.
const MAX_CACHED: usize = 10_000;
/// How often MLflow is asked whether it authenticates at all.
pub(crate) const DETECT_INTERVAL: Duration = Duration::from_secs(10);
const API: &str = crate::plumbing::mlflow::ARTIFACTS_API;
/// MLflow's refusal of a multipart create without `path` (`missing_value` in
/// `mlflow/utils/validation.py`): the update probe's answer when the client may write.
const MISSING_PATH: &str = "Missing value for required parameter 'path'";

/// The permission tier an artifact request needs in MLflow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    Read,
    /// `HEAD` of a file. MLflow's auth maps no permission to HEAD: it refuses it (403) to every
    /// user but an admin, so it gets its own question.
    Head,
    Update,
    Manage,
    /// Logging to a run (the raw text is its id): MLflow's EDIT on the run. Asked before a
    /// client's node-wide samples may elect or renew a reporter lease, so that a client MLflow
    /// refuses cannot silence the run's real reporter.
    WriteRun,
}

/// What MLflow says about one request.
#[derive(Debug)]
pub enum Decision {
    /// Go ahead; the headers are MLflow's CORS answer for the client's `Origin` (empty when the
    /// request has none), to be put on the gateway's response as MLflow would.
    Allowed(HeaderMap),
    /// MLflow's own refusal (401 with `WWW-Authenticate`, 403), to be sent to the client as is.
    Denied(Response),
    /// MLflow refused the question before its handler ran, for a reason of the request itself
    /// (a workspace it does not have, a path it does not take), which says nothing about the
    /// client's permission: MLflow answers the client's own request, as without the gateway.
    MlflowAnswers,
    /// MLflow could not be asked: the proxy's own error ([`Error::Unavailable`], 503), which
    /// the client retries.
    Unverifiable(Error),
}

/// Whether the upstream authenticates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Mode {
    /// Not known yet: every request is checked (fail closed).
    Unknown = 0,
    /// MLflow answers anonymous artifact requests: nothing is checked.
    Open = 1,
    /// MLflow authenticates: every gateway request is checked.
    Enforced = 2,
}

/// Whether MLflow authenticates, shared by the authorizer and the layer that watches forwarded
/// answers for a 401; cheap to clone.
#[derive(Clone, Default)]
pub struct AuthMode(Arc<AtomicU8>);

impl AuthMode {
    pub fn get(&self) -> Mode {
        match self.0.load(Ordering::Relaxed) {
            1 => Mode::Open,
            2 => Mode::Enforced,
            _ => Mode::Unknown,
        }
    }

    fn set(&self, mode: Mode) {
        let before = self.0.swap(mode as u8, Ordering::Relaxed);
        if before != mode as u8 {
            tracing::info!(mode = ?mode, "MLflow authentication detected: artifact requests are {}", if mode == Mode::Open { "not checked (MLflow answers anonymous requests)" } else { "authorized by MLflow per client" });
        }
    }

    /// A forwarded request was answered 401: MLflow authenticates, whatever the last probe said.
    pub fn saw_unauthorized(&self) {
        if self.get() == Mode::Open {
            self.set(Mode::Enforced);
        }
    }
}

#[derive(Clone)]
pub struct Authorizer {
    forwarder: Forwarder,
    mlflow: MlflowClient,
    mode: AuthMode,
    /// Whether MLflow has workspaces on, learned with every authentication probe.
    workspaces: crate::plumbing::workspace::Support,
    /// MLflow's "allowed" per (credential, action, path), with when it was given; at most
    /// [`MAX_CACHED`] entries, the least recently used forgotten first, so no client can empty
    /// it for the others.
    cache: Arc<Mutex<Decisions>>,
    ttl: Duration,
    probe: Arc<str>,
}

impl Authorizer {
    pub fn new(forwarder: Forwarder, ttl: Duration) -> Self {
        Self {
            mlflow: MlflowClient::new(forwarder.clone()),
            forwarder,
            mode: AuthMode::default(),
            workspaces: crate::plumbing::workspace::Support::default(),
            cache: Arc::new(Mutex::new(AgedMap::new(MAX_CACHED))),
            ttl,
            probe: probe_name().into(),
        }
    }

    /// The shared handle on whether MLflow authenticates.
    pub fn mode(&self) -> &AuthMode {
        &self.mode
    }

    /// The shared handle on whether MLflow has workspaces on.
    pub fn workspaces(&self) -> &crate::plumbing::workspace::Support {
        &self.workspaces
    }

    /// Asks MLflow, without credentials, whether it authenticates and whether it has workspaces
    /// on; keeps the last answers when MLflow cannot be reached.
    pub async fn detect(&self) {
        self.learn_workspaces().await;
        let mut headers = HeaderMap::new();
        if let Ok(host) = HeaderValue::from_str(self.forwarder.upstream().authority.as_str()) {
            headers.insert(header::HOST, host);
        }
        let (method, uri, body) = self.probe_request(Action::Read, "");
        match self.forwarder.ask(method, &uri, headers, body).await {
            Ok(answer) if answer.status().is_success() => self.mode.set(Mode::Open),
            Ok(answer) if is_refusal(answer.status()) => self.mode.set(Mode::Enforced),
            Ok(answer) => tracing::debug!(
                status = answer.status().as_u16(),
                "authentication probe inconclusive"
            ),
            Err(e) => tracing::debug!(error = %e, "authentication probe failed"),
        }
    }

    /// Asks MLflow's `server-info` (answered without credentials) whether it has workspaces on.
    async fn learn_workspaces(&self) {
        let answer = self.mlflow.server_info().await;
        match crate::plumbing::workspace::Support::from_server_info(&answer) {
            Some(enabled) => self.workspaces.set(enabled),
            None => match answer {
                Err(MlflowError::Unanswered(e)) => {
                    tracing::debug!(error = %e, "server-info probe failed")
                }
                _ => tracing::debug!(
                    status = answer.err().and_then(|e| e.status()).map(|s| s.as_u16()),
                    "server-info probe inconclusive"
                ),
            },
        }
    }

    /// Detects at once, then every [`DETECT_INTERVAL`], until the task is dropped.
    pub fn spawn_detector(&self) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(DETECT_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                this.detect().await;
            }
        })
    }

    /// Would MLflow allow `action` on `raw` (the path as the client wrote it, still encoded;
    /// for a listing, the raw value of its `path` query parameter; for [`Action::WriteRun`] the
    /// run id) for the client that sent
    /// `client`? `peer` and `request_id` shape the headers as forwarding would.
    pub async fn check(
        &self,
        action: Action,
        raw: &str,
        client: &HeaderMap,
        peer: SocketAddr,
        request_id: &HeaderValue,
    ) -> Decision {
        // A browser's request (it carries `Origin`) is always asked: MLflow's security middleware
        // refuses state-changing requests from foreign origins and answers CORS, with or without
        // authentication. Other clients cost nothing while MLflow does not authenticate.
        // A request in another workspace than the default one is asked too: MLflow refuses a
        // workspace it does not have (404) before any handler runs, with or without
        // authentication.
        let other_workspace = crate::plumbing::workspace::of_request(client)
            .map_or(true, |named| {
                named.is_some_and(|w| w != crate::plumbing::workspace::DEFAULT)
            });
        // Logging to a run is asked too: MLflow's answer says whether the run exists at all, and
        // nothing (a reporter lease) is kept for a run MLflow does not have.
        if self.mode.get() == Mode::Open
            && !client.contains_key(header::ORIGIN)
            && !other_workspace
            && action != Action::WriteRun
        {
            return Decision::Allowed(HeaderMap::new());
        }
        let key = cache_key(action, raw, client);
        if !self.ttl.is_zero() {
            if let Some((at, cors)) = self.cache.lock().expect("authz cache").get_mut(&key) {
                if at.elapsed() < self.ttl {
                    return Decision::Allowed(cors.clone());
                }
            }
        }
        let mut headers = self
            .forwarder
            .upstream_headers(client, peer, None, request_id);
        let drop: Vec<_> = headers
            .keys()
            .filter(|n| crate::plumbing::credential::not_identifying(n))
            .cloned()
            .collect();
        for name in drop {
            headers.remove(name);
        }
        let (method, uri, body) = self.probe_request(action, raw);
        if !body.is_empty() {
            headers.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
        }
        let answer = match self.forwarder.ask(method, &uri, headers, body).await {
            Ok(answer) => answer,
            Err(e) => return Decision::Unverifiable(unverifiable(&e.to_string())),
        };
        let status = answer.status();
        // MLflow refuses the empty batch for its own reasons too (no such run, a deleted run):
        // it refuses the client's real batch the same way, so nothing may change for it.
        let refused =
            is_refusal(status) || (action == Action::WriteRun && status.is_client_error());
        if refused {
            if status == StatusCode::UNAUTHORIZED {
                self.mode.set(Mode::Enforced);
            }
            return Decision::Denied(relay(answer));
        }
        // Only the answer the probe means is a permission: MLflow answers other requests before
        // it authenticates too (400 for a workspace name it does not take, 404 for a workspace
        // it does not have), and those say nothing about the client.
        let allowed = match action {
            // The listing of a directory that does not exist, the delete of a subtree that does
            // not exist.
            Action::Read | Action::Manage => status.is_success(),
            // The create handler ran and refused the body that names no file.
            Action::Update => {
                status == StatusCode::BAD_REQUEST
                    && String::from_utf8_lossy(answer.body()).contains(MISSING_PATH)
            }
            Action::WriteRun => status.is_success(),
            // The download handler ran on a file that does not exist: 404, or 500 from MLflow
            // versions that do not tell a missing file apart. (A HEAD's answer has no body, so a
            // workspace MLflow does not have cannot be told apart: the gateway then answers from
            // that workspace's directory, which MLflow never fills.)
            Action::Head => {
                status.is_success()
                    || matches!(
                        status,
                        StatusCode::NOT_FOUND | StatusCode::INTERNAL_SERVER_ERROR
                    )
            }
        };
        if !allowed && status.is_client_error() {
            // MLflow refused the probe before its handler ran (MLflow's routes check workspaces
            // and authentication in different orders, so the client's own request may get
            // another refusal): MLflow answers that request itself.
            return Decision::MlflowAnswers;
        }
        if !allowed {
            let reason = format!(
                "MLflow answered HTTP {} to the authorization check: {}",
                status.as_u16(),
                String::from_utf8_lossy(&answer.body()[..answer.body().len().min(300)])
            );
            return Decision::Unverifiable(unverifiable(&reason));
        }
        let cors = cors_headers(answer.headers());
        if !self.ttl.is_zero() {
            let mut cache = self.cache.lock().expect("authz cache");
            cache.insert(&key, (Instant::now(), cors.clone()));
        }
        Decision::Allowed(cors)
    }

    /// The side-effect-free request that MLflow authorizes exactly as `action` on `raw`.
    fn probe_request(&self, action: Action, raw: &str) -> (Method, String, Bytes) {
        let child = |raw: &str| {
            if raw.is_empty() || raw.ends_with('/') {
                format!("{raw}{}", self.probe)
            } else {
                format!("{raw}/{}", self.probe)
            }
        };
        match action {
            Action::Read => (
                Method::GET,
                format!("{API}artifacts?path={}", child(&query_safe(raw))),
                Bytes::new(),
            ),
            Action::Update => (
                Method::POST,
                format!("{API}mpu/create/{raw}"),
                Bytes::from_static(b"{}"),
            ),
            Action::Head => (
                Method::HEAD,
                format!("{API}artifacts/{}", child(raw)),
                Bytes::new(),
            ),
            Action::Manage => (
                Method::DELETE,
                format!("{API}artifacts/{}", child(raw)),
                Bytes::new(),
            ),
            Action::WriteRun => (
                Method::POST,
                crate::plumbing::mlflow::LOG_BATCH.to_owned(),
                Bytes::from(serde_json::json!({ "run_id": raw }).to_string()),
            ),
        }
    }
}

/// MLflow's CORS answer: the `Access-Control-*` headers of the probe's response.
fn cors_headers(answer: &HeaderMap) -> HeaderMap {
    answer
        .iter()
        .filter(|(name, _)| name.as_str().starts_with("access-control-"))
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect()
}

/// 401, 403, or a redirect (to a login page): MLflow refused the client.
fn is_refusal(status: StatusCode) -> bool {
    status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN || status.is_redirection()
}

fn unverifiable(reason: &str) -> Error {
    tracing::warn!(reason, "could not ask MLflow whether a request is allowed");
    Error::Unavailable(format!(
        "mlscope-proxy could not ask MLflow whether this request is allowed ({reason}); retry."
    ))
}

/// MLflow's refusal as the client would have had it: status, the headers that matter, body.
fn relay(answer: http::Response<Bytes>) -> Response {
    let (parts, body) = answer.into_parts();
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = parts.status;
    for name in [
        header::WWW_AUTHENTICATE,
        header::CONTENT_TYPE,
        header::LOCATION,
        header::SET_COOKIE,
    ] {
        for value in parts.headers.get_all(&name) {
            response.headers_mut().append(name.clone(), value.clone());
        }
    }
    response.extensions_mut().insert(AnsweredBy::UPSTREAM);
    response
}

/// A path segment (percent-encoded as in a URL path) written as a query value that decodes to
/// the same text: only `+` and `&` mean something else in a query.
fn query_safe(raw: &str) -> String {
    raw.replace('+', "%2B").replace('&', "%26")
}

fn cache_key(action: Action, raw: &str, client: &HeaderMap) -> [u8; 32] {
    let mut hash = Sha256::new();
    hash.update(crate::plumbing::credential::fingerprint(client));
    hash.update([action as u8]);
    hash.update(raw.as_bytes());
    hash.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| {
                (
                    http::HeaderName::from_static(k),
                    HeaderValue::from_static(v),
                )
            })
            .collect()
    }

    #[test]
    fn cache_keys_separate_actions_and_paths() {
        let alice = headers(&[("authorization", "Basic YWxpY2U6eA==")]);
        assert_ne!(
            cache_key(Action::Read, "1/r/artifacts/a", &alice),
            cache_key(Action::Update, "1/r/artifacts/a", &alice)
        );
        assert_ne!(
            cache_key(Action::Read, "1/r/artifacts/a", &alice),
            cache_key(Action::Read, "2/r/artifacts/a", &alice)
        );
        // One credential in two workspaces: MLflow may answer each differently.
        let in_team_a = headers(&[
            ("authorization", "Basic YWxpY2U6eA=="),
            ("x-mlflow-workspace", "team-a"),
        ]);
        let in_team_b = headers(&[
            ("authorization", "Basic YWxpY2U6eA=="),
            ("x-mlflow-workspace", "team-b"),
        ]);
        let read = |h| cache_key(Action::Read, "1/r/artifacts/a", h);
        assert_ne!(read(&in_team_a), read(&in_team_b));
        assert_ne!(read(&in_team_a), read(&alice));
    }

    #[test]
    fn the_cache_keeps_its_bound_and_the_recent_answers_when_one_client_fills_it() {
        let authorizer = Authorizer::new(
            Forwarder::new(
                &crate::plumbing::proxy::ForwarderConfig::default(),
                crate::plumbing::telemetry::Metrics::new(),
            ),
            Duration::from_secs(10),
        );
        let alice = headers(&[("authorization", "Basic YWxpY2U6eA==")]);
        let hers = cache_key(Action::Read, "1/r/artifacts/a", &alice);
        let mut cache = authorizer.cache.lock().unwrap();
        cache.insert(&hers, (Instant::now(), HeaderMap::new()));
        // Another client asks about paths without end, alice keeps using hers.
        for i in 0..3 * MAX_CACHED {
            let key = cache_key(
                Action::Read,
                &format!("1/r/artifacts/{i}"),
                &HeaderMap::new(),
            );
            cache.insert(&key, (Instant::now(), HeaderMap::new()));
            if i % 1000 == 0 {
                assert!(
                    cache.get_mut(&hers).is_some(),
                    "alice's answer forgotten at {i}"
                );
            }
            assert!(cache.len() <= MAX_CACHED);
        }
    }

    #[tokio::test]
    async fn probes_keep_the_path_and_add_a_child_that_names_no_tier() {
        let authorizer = Authorizer::new(
            Forwarder::new(
                &crate::plumbing::proxy::ForwarderConfig::default(),
                crate::plumbing::telemetry::Metrics::new(),
            ),
            Duration::ZERO,
        );
        let probe = authorizer.probe.to_string();
        assert!(
            !probe.chars().all(|c| c.is_ascii_digit())
                && probe.len() != 32
                && !["models", "traces", "artifacts"].contains(&probe.as_str())
        );
        let (m, uri, body) = authorizer.probe_request(Action::Read, "1/r%2Bx/artifacts/a+b&c");
        assert_eq!((m, body.is_empty()), (Method::GET, true));
        assert_eq!(
            uri,
            format!("{API}artifacts?path=1/r%2Bx/artifacts/a%2Bb%26c/{probe}")
        );
        let (m, uri, _) = authorizer.probe_request(Action::Read, "");
        assert_eq!(
            (m, uri),
            (Method::GET, format!("{API}artifacts?path={probe}"))
        );
        let (m, uri, body) = authorizer.probe_request(Action::Update, "1/r/artifacts/model.pt");
        assert_eq!(
            (m, uri, &body[..]),
            (
                Method::POST,
                format!("{API}mpu/create/1/r/artifacts/model.pt"),
                &b"{}"[..]
            )
        );
        let (m, uri, _) = authorizer.probe_request(Action::Manage, "1/r/artifacts/dir/");
        assert_eq!(
            (m, uri),
            (
                Method::DELETE,
                format!("{API}artifacts/1/r/artifacts/dir/{probe}")
            )
        );
    }
}
