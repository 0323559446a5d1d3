//! Forwarding: every request that no later layer intercepts goes to the MLflow server unchanged,
//! streamed in both directions over pooled keep-alive connections.

mod body;
mod headers;
mod pool;

use std::error::Error as StdError;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::response::{IntoResponse, Response};
use http::HeaderValue;

pub(crate) use body::read_up_to;
pub use body::{find_idle_timeout, Direction, Guard, Guarded, IdleTimeoutError, StreamingBody};
pub use headers::{is_json, request_id, strip_hop_by_hop, X_REQUEST_ID};

mod settings;

use crate::plumbing::error::ProxyError;
use crate::plumbing::telemetry::{ErrorLabels, Metrics};
use pool::{Pool, SendError};
pub use settings::{ForwarderConfig, ForwarderOptions, HostHeader, Timeouts, Upstream};

type UpstreamBody = StreamingBody<Body>;

/// Who wrote a response, for the request log line's `answered_by`. The forwarder marks every
/// response MLflow sent as it receives it; a response without a mark was made by the proxy
/// itself (its errors when MLflow cannot be reached, its refusals, the coalescer's answers to
/// merged requests), so that none of the proxy's own answers passes for MLflow's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AnsweredBy(pub &'static str);

impl AnsweredBy {
    /// MLflow's own response, forwarded (possibly filtered on the way).
    pub const UPSTREAM: Self = Self("upstream");
    /// The proxy's own response.
    pub const PROXY: Self = Self("proxy");
    /// The artifact gateway's response, served from the object store.
    pub const ARTIFACT_STORE: Self = Self("artifact_store");
}

/// How long MLflow took to answer a forwarded request, from handing it to the connection pool to
/// the answer's head (for a merged batch, to the end of its body): the request log line's
/// `upstream_ms`, so that what the proxy itself adds (`latency_ms` less this) is read per request
/// rather than guessed from end-to-end percentiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpstreamTime(pub Duration);

/// Why one of the proxy's own requests to MLflow ([`Forwarder::ask`]) got no answer; the kind
/// decides whether it is sent again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AskError {
    #[error("the request to MLflow could not be built: {0}")]
    Request(String),
    /// The connection was closed as the request went out: sent once more on a fresh one.
    #[error("MLflow at {upstream} closed the connection before answering: {reason}")]
    Closed { upstream: String, reason: String },
    #[error("MLflow at {upstream} did not answer: {reason}")]
    Exchange { upstream: String, reason: String },
    #[error("MLflow at {upstream} did not answer within {after:?}")]
    Timeout { upstream: String, after: Duration },
}

thread_local! {
    /// Which of a forwarder's connection pools requests made on this thread use.
    static POOL: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Makes requests to MLflow made on this thread use connection pool `index` of every forwarder
/// that has that many (any other thread uses pool 0). A serving thread takes its own, so that a
/// request, its connection to MLflow and that connection's task stay on one thread.
pub fn use_pool(index: usize) {
    POOL.with(|pool| pool.set(index));
}

/// Which of `pools` connection pools requests made on this thread use (see [`use_pool`]).
pub(crate) fn this_threads_pool(pools: usize) -> usize {
    POOL.with(std::cell::Cell::get) % pools.max(1)
}

/// The upstream MLflow server and the pooled clients that reach it.
#[derive(Clone)]
pub struct Forwarder {
    /// One connection pool per serving thread and one for every other thread; see
    /// [`use_pool`].
    pools: Arc<[Arc<Pool>]>,
    upstream: Arc<Upstream>,
    host_header: HostHeader,
    /// The `Host` header naming the upstream ([`headers::upstream_host`]).
    upstream_host: HeaderValue,
    timeouts: Timeouts,
    metrics: Metrics,
}

impl Forwarder {
    /// A forwarder with one connection pool, shared by every thread.
    pub fn new(config: &ForwarderConfig, metrics: Metrics) -> Self {
        Self::with_pools(config, metrics, 1)
    }

    /// A forwarder with `pools` connection pools (at least one): pool 0 for threads that took
    /// none, and one for each serving thread. Each pool keeps up to `max_idle` idle connections.
    pub fn with_pools(config: &ForwarderConfig, metrics: Metrics, pools: usize) -> Self {
        let pools = (0..pools.max(1))
            .map(|_| {
                Arc::new(Pool::new(
                    &config.upstream.authority,
                    config.max_idle,
                    config.timeouts.connect,
                ))
            })
            .collect();
        Self {
            pools,
            upstream: Arc::new(config.upstream.clone()),
            host_header: config.host_header,
            upstream_host: headers::upstream_host(&config.upstream.authority),
            timeouts: config.timeouts,
            metrics,
        }
    }

    /// This thread's connection pool.
    fn pool(&self) -> &Arc<Pool> {
        &self.pools[this_threads_pool(self.pools.len())]
    }

    /// How many connection pools it has: one per serving thread and one for every other thread.
    pub fn pools(&self) -> usize {
        self.pools.len()
    }

    pub fn upstream(&self) -> &Upstream {
        &self.upstream
    }

    /// Sends one request upstream and returns its response with a streaming body. Errors are
    /// classified by the side that failed; the caller turns them into a response.
    pub async fn send(
        &self,
        request: Request,
        peer: SocketAddr,
        request_id: &HeaderValue,
    ) -> Result<Response, ProxyError> {
        // A create's path, kept for the answer when its outcome turns out unknown; a request
        // that repeats safely (every log-batch) copies nothing.
        let create =
            (!crate::plumbing::route::repeats_safely(request.method(), request.uri().path()))
                .then(|| request.uri().path().to_owned());
        let unknown_outcome = |cause: ProxyError| match create {
            None => cause,
            Some(operation) => ProxyError::OutcomeUnknown {
                operation,
                cause: Box::new(cause),
            },
        };
        let (mut parts, body) = request.into_parts();
        let path_and_query = parts
            .uri
            .path_and_query()
            .map(|pq| pq.as_str())
            .unwrap_or("/");
        let uri = self
            .upstream
            .uri_for(path_and_query)
            .map_err(|e| ProxyError::Internal {
                reason: e.to_string(),
            })?;
        headers::to_upstream(
            &mut parts.headers,
            peer,
            parts.uri.authority(),
            self.host_header,
            &self.upstream_host,
            request_id,
        );
        parts.uri = uri;
        parts.version = http::Version::HTTP_11;
        let upstream_request = http::Request::from_parts(
            parts,
            StreamingBody::new(body, self.timeouts.body_idle, Direction::Request),
        );

        let asked = Instant::now();
        let response = match tokio::time::timeout(
            self.timeouts.response_headers,
            self.pool().send(upstream_request),
        )
        .await
        {
            Ok(Ok(response)) => response,
            Ok(Err(e)) => {
                return Err(match self.classify(&e) {
                    // Sent, or partly: MLflow may have applied it.
                    reset @ ProxyError::UpstreamReset { .. } => unknown_outcome(reset),
                    other => other,
                });
            }
            Err(_) => {
                return Err(unknown_outcome(ProxyError::UpstreamResponseTimeout {
                    upstream: self.upstream.url(),
                    after: self.timeouts.response_headers,
                }))
            }
        };
        let (mut parts, body) = response.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        parts.extensions.insert(AnsweredBy::UPSTREAM);
        parts.extensions.insert(UpstreamTime(asked.elapsed()));
        let body = StreamingBody::new(body, self.timeouts.body_idle, Direction::Response);
        Ok(Response::from_parts(parts, Body::new(body)))
    }

    /// Sends a request of the proxy's own with exactly `headers` and a small body, and reads the
    /// whole answer (at most 16 MiB) within the response timeout. The proxy's own requests change
    /// nothing or the same thing twice (lookups, authorization probes, tags, a run's end), so one
    /// that met a connection MLflow was closing is sent once more on a fresh one.
    pub async fn ask(
        &self,
        method: http::Method,
        path_and_query: &str,
        headers: http::HeaderMap,
        body: bytes::Bytes,
    ) -> Result<http::Response<bytes::Bytes>, AskError> {
        match self
            .ask_once(
                method.clone(),
                path_and_query,
                headers.clone(),
                body.clone(),
            )
            .await
        {
            Err(AskError::Closed { .. }) => {
                self.ask_once(method, path_and_query, headers, body).await
            }
            other => other,
        }
    }

    async fn ask_once(
        &self,
        method: http::Method,
        path_and_query: &str,
        headers: http::HeaderMap,
        body: bytes::Bytes,
    ) -> Result<http::Response<bytes::Bytes>, AskError> {
        use http_body_util::BodyExt;
        let uri = self
            .upstream
            .uri_for(path_and_query)
            .map_err(|e| AskError::Request(e.to_string()))?;
        let mut request = http::Request::new(StreamingBody::new(
            Body::from(body),
            self.timeouts.body_idle,
            Direction::Request,
        ));
        *request.method_mut() = method;
        *request.uri_mut() = uri;
        *request.headers_mut() = headers;
        let upstream = || self.upstream.url();
        let exchange = async {
            let response = self.pool().send(request).await.map_err(|e| {
                let reason = root_cause(&e).to_string();
                // A pooled connection MLflow was closing as the request went out.
                if matches!(&e, SendError::Exchange(e) if e.is_incomplete_message()) {
                    AskError::Closed {
                        upstream: upstream(),
                        reason,
                    }
                } else {
                    AskError::Exchange {
                        upstream: upstream(),
                        reason,
                    }
                }
            })?;
            let (parts, body) = response.into_parts();
            let body = http_body_util::Limited::new(body, 16 << 20)
                .collect()
                .await
                .map_err(|e| AskError::Exchange {
                    upstream: upstream(),
                    reason: e.to_string(),
                })?
                .to_bytes();
            Ok::<_, AskError>(http::Response::from_parts(parts, body))
        };
        match tokio::time::timeout(self.timeouts.response_headers, exchange).await {
            Ok(result) => result,
            Err(_) => Err(AskError::Timeout {
                upstream: upstream(),
                after: self.timeouts.response_headers,
            }),
        }
    }

    /// The headers a client request would reach the upstream with (hop-by-hop headers removed,
    /// the `Host` policy and `X-Forwarded-*` applied).
    pub fn upstream_headers(
        &self,
        client: &http::HeaderMap,
        peer: SocketAddr,
        authority: Option<&http::uri::Authority>,
        request_id: &HeaderValue,
    ) -> http::HeaderMap {
        let mut headers = client.clone();
        headers::to_upstream(
            &mut headers,
            peer,
            authority,
            self.host_header,
            &self.upstream_host,
            request_id,
        );
        headers
    }

    /// A bodiless GET to the upstream, for readiness checks.
    pub async fn probe(&self, path: &str) -> Result<http::StatusCode, String> {
        let uri = self.upstream.uri_for(path).map_err(|e| e.to_string())?;
        let body = StreamingBody::new(Body::empty(), self.timeouts.body_idle, Direction::Request);
        let request = http::Request::get(uri)
            .body(body)
            .map_err(|e| e.to_string())?;
        match self.pool().send(request).await {
            Ok(response) => Ok(response.status()),
            Err(e) => Err(root_cause(&e).to_string()),
        }
    }

    fn classify(&self, error: &SendError) -> ProxyError {
        let upstream = self.upstream.url();
        let hyper_error = match error {
            SendError::ConnectTimeout(_) => {
                return ProxyError::UpstreamConnectTimeout {
                    upstream,
                    after: self.timeouts.connect,
                }
            }
            SendError::Connect(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                return ProxyError::UpstreamConnectTimeout {
                    upstream,
                    after: self.timeouts.connect,
                }
            }
            SendError::Connect(e) => {
                return ProxyError::UpstreamConnect {
                    upstream,
                    reason: e.to_string(),
                }
            }
            SendError::Exchange(e) => e,
        };
        if let Some(idle) = find_idle_timeout(hyper_error) {
            return ProxyError::ClientBodyIdle { after: idle.after };
        }
        let root = root_cause(hyper_error);
        // A request body that failed on the client's side (disconnect, bad chunking) surfaces
        // here as a hyper "user body" error.
        if hyper_error.is_user() {
            return ProxyError::ClientBody {
                reason: root.to_string(),
            };
        }
        ProxyError::UpstreamReset {
            upstream,
            reason: root.to_string(),
        }
    }
}

fn root_cause<'a>(error: &'a (dyn StdError + 'static)) -> &'a (dyn StdError + 'static) {
    let mut current = error;
    while let Some(source) = current.source() {
        current = source;
    }
    current
}

/// The fallback of the route table: every request no capability intercepts goes to MLflow as it
/// came.
pub async fn forward(
    State(forwarder): State<Forwarder>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    request: Request,
) -> Response {
    forwarder.forward(request, peer).await
}

/// What [`Forwarder::read_small`] made of a request.
pub(crate) enum Small {
    /// The body, whole, with the request's head: the handler's to answer.
    Read(http::request::Parts, bytes::Bytes),
    /// The body was longer than the handler reads: the request went on to MLflow as it came,
    /// and this is MLflow's answer (or the forwarder's, when MLflow could not be reached), the
    /// client's answer.
    Forwarded(Response),
}

impl Forwarder {
    /// The body of a request a handler reads only when it is small: at most `limit` bytes, with
    /// the request's head. A longer body (declared, or found while reading) is not the handler's:
    /// the request goes on to MLflow as it comes, and [`Small::Forwarded`] holds MLflow's answer.
    /// `Err` when the body cannot be read: the client's 400.
    pub(crate) async fn read_small(
        &self,
        request: Request,
        limit: usize,
        peer: SocketAddr,
    ) -> Result<Small, crate::plumbing::error::Error> {
        let (parts, body) = request.into_parts();
        let declared = parts
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|len| len > limit as u64) {
            let answer = self.forward(Request::from_parts(parts, body), peer).await;
            return Ok(Small::Forwarded(answer));
        }
        match read_up_to(body, limit).await {
            Ok(Ok(body)) => Ok(Small::Read(parts, body)),
            // Longer than it said, or of no declared length: streamed on as it comes.
            Ok(Err(unread)) => {
                let answer = self.forward(Request::from_parts(parts, unread), peer).await;
                Ok(Small::Forwarded(answer))
            }
            Err(error) => Err(crate::plumbing::error::Error::BadRequest(format!(
                "the request body could not be read: {error}"
            ))),
        }
    }

    /// Forwards one request and answers with MLflow's response, or with the proxy's own error
    /// when MLflow could not be reached. Interceptors call this after their own phase.
    pub async fn forward(&self, request: Request, peer: SocketAddr) -> Response {
        let id = request_id(request.headers());
        match self.send(request, peer, &id).await {
            Ok(response) => response,
            Err(error) => self.answer_error(error),
        }
    }

    /// The response for a failed exchange, counted and logged.
    pub fn answer_error(&self, error: ProxyError) -> Response {
        if let Some(kind) = error.kind() {
            self.metrics
                .upstream_errors
                .get_or_create(&ErrorLabels { kind })
                .inc();
        }
        tracing::warn!(status = error.status().as_u16(), error = %error, "request failed");
        error.into_response()
    }
}
