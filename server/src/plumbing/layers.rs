//! Cross-cutting concerns of the MLflow-facing router, as steps every request goes through (so no
//! route can escape a limit): ambiguous requests refused, the request id, one span and one log
//! line per request, request metrics, the concurrency limit, and the browser-protection headers
//! MLflow sets.
//!
//! Each step is a function of the request and what comes after it (`next`), not a layer of its
//! own: the route table composes them, with the capabilities' steps, into one layer
//! (`shell::app`). An axum middleware layer clones everything beneath it for every request, so a
//! stack of them costs in proportion to the square of its depth; one layer costs one clone.

use std::future::Future;
use std::time::Instant;

use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use http::{header, HeaderValue, Method};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tracing::Instrument;

use crate::plumbing::after;
use crate::plumbing::error::{Error, ProxyError};
use crate::plumbing::proxy::{request_id, AnsweredBy, Guarded, UpstreamTime, X_REQUEST_ID};
use crate::plumbing::route::RouteClass;
use crate::plumbing::telemetry::{Metrics, RequestLabels, RouteLabels};

/// Request id (the client's own when sane, else a new one, sent upstream and back), a span
/// carrying it with the route class, method and path, one log line per request and the request
/// metrics.
pub(crate) async fn observe<F, R>(metrics: &Metrics, mut request: Request, next: F) -> Response
where
    F: FnOnce(Request) -> R,
    R: Future<Output = Response>,
{
    let started = Instant::now();
    let route = RouteClass::of(request.uri().path());
    let method = request.method().clone();
    let id = request_id(request.headers());
    request
        .headers_mut()
        .insert(X_REQUEST_ID.clone(), id.clone());
    // The path is the client's: bounded in the log (the request head is bounded too).
    let path = request.uri().path();
    let path = path
        .char_indices()
        .nth(512)
        .map_or(path, |(end, _)| &path[..end]);
    let span = tracing::info_span!(
        "request",
        request_id = id.to_str().unwrap_or_default(),
        route = route.as_str(),
        method = method.as_str(),
        path
    );
    let line_span = span.clone();
    async move {
        let mut response = next(request).await;
        response.headers_mut().insert(X_REQUEST_ID.clone(), id);
        let status = response.status().as_u16();
        let elapsed = started.elapsed();
        // Unmarked responses are the proxy's own (see `AnsweredBy`).
        let answered_by = response
            .extensions()
            .get::<AnsweredBy>()
            .map_or(AnsweredBy::PROXY.0, |a| a.0);
        // MLflow's share of it, where MLflow answered (the rest is the proxy's own).
        let upstream_ms = response
            .extensions()
            .get::<UpstreamTime>()
            .map(|t| t.0.as_secs_f64() * 1e3);
        // What the steps left for after the answer, the request metrics and the log line run
        // once the answer has gone (see `after`): a task spawned here runs after the
        // connection's task has written the response, so none of it is on the request's path
        // (nor the log's occasional stall behind the disk).
        let after = after::take(&mut response);
        let metrics = metrics.clone();
        let latency_ms = elapsed.as_secs_f64() * 1e3;
        tokio::spawn(
            async move {
                drop(after);
                metrics
                    .latency
                    .get_or_create(&RouteLabels { route })
                    .observe(elapsed.as_secs_f64());
                metrics
                    .requests
                    .get_or_create(&RequestLabels {
                        route,
                        method: method_label(&method),
                        status,
                    })
                    .inc();
                tracing::info!(status, latency_ms, upstream_ms, answered_by, "answered");
            }
            .instrument(line_span),
        );
        response
    }
    .instrument(span)
    .await
}

/// The one concurrency limit of everything the proxy does: forwarded requests, inspected metric
/// bodies and every gateway operation. A request over the limit is not forwarded: it is answered
/// 429 `REQUEST_LIMIT_EXCEEDED` with `Retry-After` once its body (up to a bound) has been read, so
/// the client retries it (also a write MLflow's client does not retry after a 503) on a connection
/// that stays usable; a request counts until its response
/// body has been sent. Writes may hold three quarters of it: the last quarter is kept for reads,
/// so the UI answers while writers take everything else.
#[derive(Clone)]
pub(crate) struct ConcurrencyLimit {
    permits: std::sync::Arc<Semaphore>,
    write_permits: std::sync::Arc<Semaphore>,
    limit: usize,
    metrics: Metrics,
}

impl ConcurrencyLimit {
    pub(crate) fn new(limit: usize, metrics: Metrics) -> Self {
        Self {
            permits: std::sync::Arc::new(Semaphore::new(limit)),
            write_permits: std::sync::Arc::new(Semaphore::new((limit * 3 / 4).max(1))),
            limit,
            metrics,
        }
    }
}

pub(crate) async fn limit_concurrency<F, R>(
    limit: &ConcurrencyLimit,
    request: Request,
    next: F,
) -> Response
where
    F: FnOnce(Request) -> R,
    R: Future<Output = Response>,
{
    let write_permit = if crate::plumbing::route::is_write(request.method(), request.uri().path()) {
        match limit.write_permits.clone().try_acquire_owned() {
            Ok(permit) => Some(permit),
            Err(_) => return limit.refuse(request).await,
        }
    } else {
        None
    };
    let Ok(permit) = limit.permits.clone().try_acquire_owned() else {
        return limit.refuse(request).await;
    };
    let guard = InFlight::new(&limit.metrics, permit, write_permit);
    let response = next(request).await;
    let (parts, body) = response.into_parts();
    Response::from_parts(parts, Body::new(Guarded::new(body, Box::new(guard))))
}

impl ConcurrencyLimit {
    async fn refuse(&self, request: Request) -> Response {
        tracing::warn!(
            limit = self.limit,
            "concurrency limit reached; answered 429, not forwarded"
        );
        self.metrics.overload_refusals.inc();
        let refusal = ProxyError::Overloaded { limit: self.limit }.into_response();
        crate::plumbing::error::refuse_unread(request.into_body(), refusal).await
    }
}

/// Counts a request as in flight from the moment it gets a permit until its response body is
/// finished or dropped.
struct InFlight {
    metrics: Metrics,
    _permit: OwnedSemaphorePermit,
    _write_permit: Option<OwnedSemaphorePermit>,
}

impl InFlight {
    fn new(
        metrics: &Metrics,
        permit: OwnedSemaphorePermit,
        write_permit: Option<OwnedSemaphorePermit>,
    ) -> Self {
        metrics.in_flight.inc();
        Self {
            metrics: metrics.clone(),
            _permit: permit,
            _write_permit: write_permit,
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
pub(crate) async fn refuse_ambiguous<F, R>(request: Request, next: F) -> Response
where
    F: FnOnce(Request) -> R,
    R: Future<Output = Response>,
{
    if request.headers().get_all(header::HOST).iter().count() > 1 {
        tracing::info!("request with two Host headers refused");
        return Error::BadRequest(
            "the request carries more than one Host header; send exactly one".into(),
        )
        .into_response();
    }
    let unsupported = request
        .headers()
        .get_all(header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|v| v.to_str().unwrap_or("?").split(','))
        .map(str::trim)
        .any(|coding| !coding.eq_ignore_ascii_case("chunked") && !coding.is_empty());
    if unsupported {
        tracing::info!("request with an unsupported transfer coding refused");
        return Error::Unsupported(
            "only the chunked transfer coding is supported; send the body uncompressed (Content-Encoding is not applied either)".into(),
        )
        .into_response();
    }
    next(request).await
}

/// The request with the path MLflow's server routes on: uvicorn and werkzeug percent-decode the
/// path once before routing, so `runs/log%2Dbatch` is MLflow's `runs/log-batch` and
/// `mlflow%2Dartifacts` its artifact API. The proxy routes on the same path, written back with
/// only what a path must keep encoded (`%`, controls, spaces, non-ASCII bytes, `?`, `#`), so
/// that one decode of it is the path MLflow sees and no spelling takes a request past the route
/// that handles it. Runs before routing, around the whole router.
pub(crate) fn route_as_mlflow(mut request: Request) -> Request {
    if let Some(uri) = as_mlflow_routes(request.uri()) {
        *request.uri_mut() = uri;
    }
    request
}

/// `uri` with its path decoded as MLflow's server decodes it; `None` when that is the path.
pub(crate) fn as_mlflow_routes(uri: &http::Uri) -> Option<http::Uri> {
    let path = uri.path();
    if !path.contains('%') {
        return None;
    }
    let decoded: Vec<u8> = percent_encoding::percent_decode_str(path).collect();
    let mut canonical = String::with_capacity(decoded.len());
    for byte in decoded {
        if byte.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@/".contains(&byte) {
            canonical.push(char::from(byte));
        } else {
            canonical.push_str(&format!("%{byte:02X}"));
        }
    }
    if canonical == path {
        return None;
    }
    let path_and_query = match uri.query() {
        Some(query) => format!("{canonical}?{query}"),
        None => canonical,
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(path_and_query.parse().ok()?);
    http::Uri::from_parts(parts).ok()
}

/// The headers MLflow's server (3.5+) puts on every answer, added to those the proxy writes
/// itself (errors, the gateway's answers) so that mlscope in front weakens no browser
/// protection. Answers forwarded from MLflow already carry them and are left as they are.
pub(crate) async fn security_headers<F, R>(request: Request, next: F) -> Response
where
    F: FnOnce(Request) -> R,
    R: Future<Output = Response>,
{
    let mut response = next(request).await;
    let headers = response.headers_mut();
    if !headers.contains_key(header::X_CONTENT_TYPE_OPTIONS) {
        headers.insert(
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        );
    }
    if !headers.contains_key(header::X_FRAME_OPTIONS) {
        headers.insert(
            header::X_FRAME_OPTIONS,
            HeaderValue::from_static("SAMEORIGIN"),
        );
    }
    if !headers.get_all(header::VARY).iter().any(|v| {
        v.as_bytes()
            .windows(b"origin".len())
            .any(|w| w.eq_ignore_ascii_case(b"origin"))
    }) {
        headers.append(header::VARY, HeaderValue::from_static("Origin"));
    }
    response
}

/// A method as a metric label: the standard ones by name, anything a client makes up as
/// `OTHER`, so that clients cannot grow the label set.
fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::HEAD => "HEAD",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::OPTIONS => "OPTIONS",
        Method::CONNECT => "CONNECT",
        Method::TRACE => "TRACE",
        _ => "OTHER",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// MLflow's browser-protection headers are added where the answer lacks them, and `Vary`
    /// names `Origin` once, whatever its case or place in the list.
    #[tokio::test]
    async fn browser_protection_headers_are_added_once() {
        let answer = |headers: &'static [(&'static str, &'static str)]| {
            move |_: Request| async move {
                let mut response = Response::new(Body::empty());
                for (name, value) in headers {
                    response
                        .headers_mut()
                        .append(*name, HeaderValue::from_static(value));
                }
                response
            }
        };
        let vary = |response: &Response| -> Vec<String> {
            response
                .headers()
                .get_all(header::VARY)
                .iter()
                .map(|v| v.to_str().unwrap().to_owned())
                .collect()
        };
        let request = || Request::new(Body::empty());

        let plain = security_headers(request(), answer(&[])).await;
        assert_eq!(plain.headers()[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
        assert_eq!(plain.headers()[header::X_FRAME_OPTIONS], "SAMEORIGIN");
        assert_eq!(vary(&plain), ["Origin"]);

        let own = security_headers(
            request(),
            answer(&[
                ("x-frame-options", "DENY"),
                ("vary", "Accept-Encoding, ORIGIN"),
            ]),
        )
        .await;
        assert_eq!(own.headers()[header::X_FRAME_OPTIONS], "DENY");
        assert_eq!(vary(&own), ["Accept-Encoding, ORIGIN"]);

        let other = security_headers(request(), answer(&[("vary", "Accept-Encoding")])).await;
        assert_eq!(vary(&other), ["Accept-Encoding", "Origin"]);
    }

    /// The request log lines written while `f` runs, as JSON.
    async fn logged<F: std::future::Future>(f: F) -> Vec<serde_json::Value> {
        let capture = crate::plumbing::json_lines::tests::Capture::default();
        let subscriber = tracing_subscriber::fmt()
            .fmt_fields(crate::plumbing::json_lines::SpanFields)
            .event_format(crate::plumbing::json_lines::JsonLines::new())
            .with_writer(capture.clone())
            .finish();
        let _default = tracing::subscriber::set_default(subscriber);
        f.await;
        // The request log line is written by a task of its own once the answer has gone.
        for _ in 0..8 {
            tokio::task::yield_now().await;
        }
        let text = capture.text();
        text.lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect()
    }

    /// Answers one request through `observe` and a forwarder to `upstream`; returns the status
    /// and the log line's `answered_by`.
    async fn answer_through(upstream: std::net::SocketAddr) -> (u16, String) {
        use tower::ServiceExt;
        let config = crate::plumbing::proxy::ForwarderConfig {
            upstream: crate::plumbing::proxy::Upstream::parse(&format!("http://{upstream}"))
                .unwrap(),
            ..Default::default()
        };
        let metrics = Metrics::new();
        let forwarder = crate::plumbing::proxy::Forwarder::new(&config, metrics.clone());
        let peer = std::net::SocketAddr::from(([127, 0, 0, 1], 1));
        let router = axum::Router::new()
            .fallback(move |request: Request| async move { forwarder.forward(request, peer).await })
            .layer(axum::middleware::from_fn(
                move |request: Request, next: axum::middleware::Next| {
                    let metrics = metrics.clone();
                    async move { observe(&metrics, request, |request| next.run(request)).await }
                },
            ));
        let mut status = 0;
        let lines = logged(async {
            let request = http::Request::get("/api/2.0/mlflow/experiments/get?experiment_id=0")
                .body(Body::empty())
                .unwrap();
            status = router.oneshot(request).await.unwrap().status().as_u16();
        })
        .await;
        let line = lines
            .iter()
            .find(|l| l["message"] == "answered")
            .unwrap_or_else(|| panic!("no request log line in {lines:?}"));
        assert_eq!(line["status"], status);
        (status, line["answered_by"].as_str().unwrap().to_owned())
    }

    #[tokio::test]
    async fn a_502_the_proxy_made_because_mlflow_is_unreachable_is_logged_as_the_proxys() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        assert_eq!(answer_through(closed).await, (502, "proxy".to_owned()));
    }

    #[tokio::test]
    async fn an_error_mlflow_sent_is_logged_as_the_upstreams() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = listener.local_addr().unwrap();
        let mlflow = axum::Router::new().fallback(|| async { http::StatusCode::NOT_FOUND });
        let server = tokio::spawn(async move { axum::serve(listener, mlflow).await });
        assert_eq!(answer_through(upstream).await, (404, "upstream".to_owned()));
        server.abort();
    }

    #[test]
    fn a_path_is_routed_as_mlflow_decodes_it() {
        let routed = |uri: &str| as_mlflow_routes(&uri.parse().unwrap()).map(|u| u.to_string());
        assert_eq!(routed("/api/2.0/mlflow/runs/log-batch"), None);
        assert_eq!(
            routed("/api/2.0/mlflow/runs/log%2Dbatch").as_deref(),
            Some("/api/2.0/mlflow/runs/log-batch")
        );
        assert_eq!(
            routed("/api/2.0/mlflow/%72uns/log-metric?x=%2D").as_deref(),
            Some("/api/2.0/mlflow/runs/log-metric?x=%2D")
        );
        assert_eq!(
            routed("/api/2.0/mlflow%2Dartifacts/artifacts/1").as_deref(),
            Some("/api/2.0/mlflow-artifacts/artifacts/1")
        );
        // What one decode makes of the path is kept: a `%` stays a `%`, a space a space.
        assert_eq!(routed("/api/2.0/mlflow-artifacts/artifacts/a%20b"), None);
        assert_eq!(routed("/api/2.0/mlflow-artifacts/artifacts/a%252Fb"), None);
        assert_eq!(
            routed("/api/2.0/mlflow-artifacts/artifacts/a%2Fb%2e%2E").as_deref(),
            Some("/api/2.0/mlflow-artifacts/artifacts/a/b..")
        );
        assert_eq!(routed("/x/%zz%e4").as_deref(), Some("/x/%25zz%E4"));
    }

    #[test]
    fn made_up_methods_share_one_label() {
        assert_eq!(method_label(&Method::GET), "GET");
        assert_eq!(method_label(&Method::from_bytes(b"FOO").unwrap()), "OTHER");
        assert_eq!(method_label(&Method::from_bytes(b"BAR").unwrap()), "OTHER");
    }
}
