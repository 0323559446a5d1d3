//! Forwarding: every request that no later layer intercepts goes to the MLflow server unchanged,
//! streamed in both directions over pooled keep-alive connections.

mod body;
mod headers;
mod route;

use std::error::Error as StdError;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::response::{IntoResponse, Response};
use http::HeaderValue;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::Instrument;

pub use body::{find_idle_timeout, Direction, IdleTimeoutError, StreamingBody};
pub use headers::{request_id, strip_hop_by_hop, X_REQUEST_ID};
pub use route::RouteClass;

use crate::app::AppState;
use crate::artifacts::legacy_listing as listing_filter;
use crate::artifacts::ArtifactOp;
use crate::config::{Config, HostHeader, Timeouts, Upstream};
use crate::error::ProxyError;
use crate::rewrite::body::Endpoint;
use crate::telemetry::{ErrorLabels, Metrics, RequestLabels, RouteLabels};

type UpstreamBody = StreamingBody<Body>;

/// The upstream MLflow server and the pooled client that reaches it.
#[derive(Clone)]
pub struct Forwarder {
    client: Client<HttpConnector, UpstreamBody>,
    upstream: Arc<Upstream>,
    host_header: HostHeader,
    timeouts: Timeouts,
    permits: Arc<Semaphore>,
    max_in_flight: usize,
    metrics: Metrics,
}

impl Forwarder {
    pub fn new(config: &Config, metrics: Metrics) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(config.timeouts.connect));
        connector.set_nodelay(true);
        connector.set_keepalive(Some(Duration::from_secs(60)));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(config.upstream_max_idle)
            .build(connector);
        Self {
            client,
            upstream: Arc::new(config.upstream.clone()),
            host_header: config.host_header,
            timeouts: config.timeouts,
            permits: Arc::new(Semaphore::new(config.max_in_flight)),
            max_in_flight: config.max_in_flight,
            metrics,
        }
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
        let permit =
            self.permits
                .clone()
                .try_acquire_owned()
                .map_err(|_| ProxyError::Overloaded {
                    limit: self.max_in_flight,
                })?;
        let guard = InFlight::new(&self.metrics, permit);
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
            &self.upstream.authority,
            request_id,
        );
        parts.uri = uri;
        parts.version = http::Version::HTTP_11;
        let upstream_request = http::Request::from_parts(
            parts,
            StreamingBody::new(body, self.timeouts.body_idle, Direction::Request),
        );

        let response = match tokio::time::timeout(
            self.timeouts.response_headers,
            self.client.request(upstream_request),
        )
        .await
        {
            Ok(Ok(response)) => response,
            Ok(Err(e)) => return Err(self.classify(&e)),
            Err(_) => {
                return Err(ProxyError::UpstreamResponseTimeout {
                    upstream: self.upstream.url(),
                    after: self.timeouts.response_headers,
                })
            }
        };
        let (mut parts, body) = response.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        let body = StreamingBody::new(body, self.timeouts.body_idle, Direction::Response)
            .with_guard(Box::new(guard));
        Ok(Response::from_parts(parts, Body::new(body)))
    }

    /// A request of the proxy's own to MLflow (write-policy lookups, failure tags), answered in
    /// full. The client's credentials (`Authorization`, `Cookie`) are passed on so MLflow's own
    /// authorization applies; `Host` is the upstream's.
    pub async fn call(
        &self,
        method: http::Method,
        path_and_query: &str,
        client_headers: &http::HeaderMap,
        json: Option<serde_json::Value>,
    ) -> Result<(http::StatusCode, bytes::Bytes), String> {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            http::header::HOST,
            HeaderValue::from_str(self.upstream.authority.as_str()).map_err(|e| e.to_string())?,
        );
        for name in [http::header::AUTHORIZATION, http::header::COOKIE] {
            if let Some(value) = client_headers.get(&name) {
                headers.insert(name, value.clone());
            }
        }
        let body = match json {
            Some(value) => {
                headers.insert(
                    http::header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                );
                bytes::Bytes::from(serde_json::to_vec(&value).map_err(|e| e.to_string())?)
            }
            None => bytes::Bytes::new(),
        };
        let response = self.ask(method, path_and_query, headers, body).await?;
        Ok((response.status(), response.into_body()))
    }

    /// Sends a request of the proxy's own with exactly `headers` and a small body, and reads the
    /// whole answer (at most 16 MiB) within the response timeout.
    pub async fn ask(
        &self,
        method: http::Method,
        path_and_query: &str,
        headers: http::HeaderMap,
        body: bytes::Bytes,
    ) -> Result<http::Response<bytes::Bytes>, String> {
        use http_body_util::BodyExt;
        let uri = self
            .upstream
            .uri_for(path_and_query)
            .map_err(|e| e.to_string())?;
        let mut request = http::Request::new(StreamingBody::new(
            Body::from(body),
            self.timeouts.body_idle,
            Direction::Request,
        ));
        *request.method_mut() = method;
        *request.uri_mut() = uri;
        *request.headers_mut() = headers;
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| root_cause(&e).to_string())?;
            let (parts, body) = response.into_parts();
            let body = http_body_util::Limited::new(body, 16 << 20)
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            Ok::<_, String>(http::Response::from_parts(parts, body))
        };
        match tokio::time::timeout(self.timeouts.response_headers, exchange).await {
            Ok(result) => {
                result.map_err(|e| format!("MLflow at {} did not answer: {e}", self.upstream.url()))
            }
            Err(_) => Err(format!(
                "MLflow at {} did not answer within {:?}",
                self.upstream.url(),
                self.timeouts.response_headers
            )),
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
            &self.upstream.authority,
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
        match self.client.request(request).await {
            Ok(response) => Ok(response.status()),
            Err(e) => Err(root_cause(&e).to_string()),
        }
    }

    fn classify(&self, error: &hyper_util::client::legacy::Error) -> ProxyError {
        let upstream = self.upstream.url();
        if let Some(idle) = find_idle_timeout(error) {
            return ProxyError::ClientBodyIdle { after: idle.after };
        }
        let root = root_cause(error);
        if error.is_connect() {
            if root
                .downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
                || root.to_string().contains("timed out")
            {
                return ProxyError::UpstreamConnectTimeout {
                    upstream,
                    after: self.timeouts.connect,
                };
            }
            return ProxyError::UpstreamConnect {
                upstream,
                reason: root.to_string(),
            };
        }
        // A request body that failed on the client's side (disconnect, bad chunking) surfaces
        // here as a hyper "user body" error.
        if let Some(hyper_error) = find_in_chain::<hyper::Error>(error) {
            if hyper_error.is_user() {
                return ProxyError::ClientBody {
                    reason: root.to_string(),
                };
            }
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

fn find_in_chain<'a, T: StdError + 'static>(error: &'a (dyn StdError + 'static)) -> Option<&'a T> {
    let mut current = Some(error);
    while let Some(e) = current {
        if let Some(found) = e.downcast_ref::<T>() {
            return Some(found);
        }
        current = e.source();
    }
    None
}

/// Counts a request as in flight from the moment it gets a permit until its response body is
/// finished or dropped.
struct InFlight {
    metrics: Metrics,
    _permit: OwnedSemaphorePermit,
}

impl InFlight {
    fn new(metrics: &Metrics, permit: OwnedSemaphorePermit) -> Self {
        metrics.in_flight.inc();
        Self {
            metrics: metrics.clone(),
            _permit: permit,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.metrics.in_flight.dec();
    }
}

/// Requests whose meaning depends on who reads them, refused before anyone does: two `Host`
/// headers (MLflow answers 400), and transfer codings other than `chunked` (a `gzip, chunked`
/// body would be stored or forwarded still compressed; MLflow's server refuses it).
fn refuse_ambiguous(request: &Request) -> Option<Response> {
    use crate::error::mlflow_error;
    if request.headers().get_all(http::header::HOST).iter().count() > 1 {
        return Some(mlflow_error(
            http::StatusCode::BAD_REQUEST,
            "BAD_REQUEST",
            "the request carries more than one Host header; send exactly one",
        ));
    }
    let codings = request.headers().get_all(http::header::TRANSFER_ENCODING);
    let unsupported = codings
        .iter()
        .flat_map(|v| v.to_str().unwrap_or("?").split(','))
        .map(str::trim)
        .any(|coding| !coding.eq_ignore_ascii_case("chunked") && !coding.is_empty());
    if unsupported {
        return Some(mlflow_error(
            http::StatusCode::NOT_IMPLEMENTED,
            "BAD_REQUEST",
            "only the chunked transfer coding is supported; send the body uncompressed (Content-Encoding is not applied either)",
        ));
    }
    None
}

/// A method as a metric label: the standard ones by name, anything a client makes up as
/// `OTHER`, so that clients cannot grow the label set.
fn method_label(method: &http::Method) -> String {
    const KNOWN: [http::Method; 9] = [
        http::Method::GET,
        http::Method::HEAD,
        http::Method::POST,
        http::Method::PUT,
        http::Method::DELETE,
        http::Method::PATCH,
        http::Method::OPTIONS,
        http::Method::CONNECT,
        http::Method::TRACE,
    ];
    if KNOWN.contains(method) {
        method.as_str()
    } else {
        "OTHER"
    }
    .to_owned()
}

/// The fallback handler: lets the metrics rewriter inspect metrics requests, forwards, records
/// metrics and logs one line per request.
pub async fn forward(
    State(state): State<AppState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    request: Request,
) -> Response {
    let forwarder = &state.forwarder;
    let started = Instant::now();
    let route = RouteClass::of(request.uri().path());
    let method = request.method().clone();
    let id = request_id(request.headers());
    let span = tracing::info_span!("request", request_id = id.to_str().unwrap_or_default(), route = route.as_str(), method = %method, path = request.uri().path());
    async move {
        if let Some(refusal) = refuse_ambiguous(&request) {
            tracing::info!(
                status = refusal.status().as_u16(),
                "ambiguous request refused"
            );
            return refusal;
        }
        let gateway_op = state
            .artifacts
            .as_ref()
            .and_then(|g| ArtifactOp::of(request.method(), request.uri().path()).map(|op| (g, op)));
        let legacy_listing = listing_filter::applies(route, request.method(), request.uri().path())
            .then(|| request.uri().clone());
        let answered_by = if gateway_op.is_some() {
            "artifact_store"
        } else {
            "upstream"
        };
        let result = if let Some((gateway, op)) = gateway_op {
            Ok(gateway.serve(op, request).await)
        } else {
            let prepared = match (route, request.method() == http::Method::POST) {
                (RouteClass::LogBatch, true) => {
                    state.rewriter.prepare(request, Endpoint::LogBatch).await
                }
                (RouteClass::LogMetric, true) => {
                    state.rewriter.prepare(request, Endpoint::LogMetric).await
                }
                _ => Ok(request),
            };
            match prepared {
                Ok(request) => match forwarder.send(request, peer, &id).await {
                    Ok(response) if response.status() == http::StatusCode::UNAUTHORIZED => {
                        // MLflow authenticates: the gateway must ask it from now on.
                        if let Some(gateway) = &state.artifacts {
                            gateway.authorizer().saw_unauthorized();
                        }
                        Ok(response)
                    }
                    Ok(response) => match &legacy_listing {
                        Some(uri) => {
                            listing_filter::filter(response, uri, forwarder.upstream()).await
                        }
                        None => Ok(response),
                    },
                    other => other,
                },
                Err(answer) => Ok(answer),
            }
        };
        let mut response = match result {
            Ok(response) => response,
            Err(error) => {
                if let Some(kind) = error.kind() {
                    forwarder
                        .metrics
                        .upstream_errors
                        .get_or_create(&ErrorLabels { kind })
                        .inc();
                }
                tracing::warn!(status = error.status().as_u16(), error = %error, "request failed");
                error.into_response()
            }
        };
        response
            .headers_mut()
            .insert(X_REQUEST_ID.clone(), id.clone());
        let status = response.status().as_u16();
        let elapsed = started.elapsed();
        forwarder
            .metrics
            .latency
            .get_or_create(&RouteLabels { route })
            .observe(elapsed.as_secs_f64());
        forwarder
            .metrics
            .requests
            .get_or_create(&RequestLabels {
                route,
                method: method_label(&method),
                status,
            })
            .inc();
        tracing::info!(
            status,
            latency_ms = elapsed.as_secs_f64() * 1e3,
            answered_by,
            "answered"
        );
        response
    }
    .instrument(span)
    .await
}
