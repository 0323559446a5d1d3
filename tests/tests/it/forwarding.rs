//! Forwarding semantics over real sockets, against a scripted upstream.
//!
//! The upstream here is a small axum server, not MLflow: MLflow cannot echo the headers it
//! received, hold a response on command, stall a body or reset a connection, and those are the
//! behaviours these tests pin down (RFC 9110 hop-by-hop rules, streaming, timeouts, failures).
//! Everything MLflow-specific is covered against the real server in `compat` and `python_client`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use axum::Router;
use futures_util::StreamExt;
use mlscope_proxy::shell::config::Config;
use mlscope_tests::eventually;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, Notify};

use crate::mlflow::scrape;

// === scripted upstream ===

#[derive(Clone, Default)]
struct Script {
    /// Released by the test to let `/hold` answer.
    release: Arc<Notify>,
    /// Told when `/hold` has been entered.
    entered: Arc<Notify>,
    /// Chunks of `/upload-progress` bodies as the upstream receives them.
    received: Option<mpsc::UnboundedSender<usize>>,
    /// Lets `/sse` send its next event.
    next_event: Arc<Notify>,
}

async fn echo(request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    let headers: serde_json::Map<String, Value> = parts
        .headers
        .iter()
        .map(|(k, v)| {
            (
                k.to_string(),
                Value::String(v.to_str().unwrap_or("<binary>").to_owned()),
            )
        })
        .collect();
    axum::Json(json!({
        "method": parts.method.as_str(),
        "uri": parts.uri.to_string(),
        "headers": headers,
        "body_len": body.len(),
    }))
    .into_response()
}

fn upstream_app(script: Script) -> Router {
    let hold = script.clone();
    let progress = script.clone();
    let sse = script.clone();
    Router::new()
        .route("/echo", any(echo))
        .route(
            "/hold",
            get(move || async move {
                hold.entered.notify_one();
                hold.release.notified().await;
                "released"
            }),
        )
        .route(
            "/upload-progress",
            any(move |request: Request| async move {
                let mut stream = request.into_body().into_data_stream();
                let mut total = 0;
                while let Some(chunk) = stream.next().await {
                    let chunk = chunk.unwrap();
                    total += chunk.len();
                    let _ = progress.received.as_ref().unwrap().send(chunk.len());
                }
                total.to_string()
            }),
        )
        .route(
            "/sse",
            get(move || async move {
                let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(1);
                tokio::spawn(async move {
                    for i in 0..3 {
                        tx.send(Ok(Bytes::from(format!("data: event {i}\n\n"))))
                            .await
                            .unwrap();
                        sse.next_event.notified().await;
                    }
                });
                let body = Body::from_stream(tokio_stream_from(rx));
                (
                    [
                        ("content-type", "text/event-stream"),
                        ("cache-control", "no-cache"),
                    ],
                    body,
                )
            }),
        )
        .route(
            "/stall",
            get(|| async {
                let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(1);
                tokio::spawn(async move {
                    tx.send(Ok(Bytes::from_static(b"partial"))).await.unwrap();
                    // Never send more, never finish.
                    std::future::pending::<()>().await;
                    drop(tx);
                });
                Body::from_stream(tokio_stream_from(rx))
            }),
        )
        .route(
            "/slow-headers",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(30)).await;
                "too late"
            }),
        )
}

fn tokio_stream_from<T: Send + 'static>(
    mut rx: mpsc::Receiver<T>,
) -> impl futures_util::Stream<Item = T> {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

async fn start_upstream(script: Script) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, upstream_app(script)).await.unwrap() });
    addr
}

// === proxy under test, in process ===

struct Proxy {
    url: String,
    admin_url: String,
    addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    done: tokio::task::JoinHandle<anyhow::Result<()>>,
}

async fn start_proxy(upstream: &str, tweak: impl FnOnce(&mut Config)) -> Proxy {
    // The proxy runs until the test's runtime ends, after the test's locals are dropped.
    let dir = mlscope_tests::dir_removed_at_exit().unwrap();
    let mut config = Config::default();
    config.forwarder.upstream = mlscope_proxy::plumbing::proxy::Upstream::parse(upstream).unwrap();
    config.store.database_url = format!("sqlite://{}/state.db", dir.display());
    tweak(&mut config);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let admin_url = format!("http://{}", admin.local_addr().unwrap());
    let (tx, rx) = oneshot::channel::<()>();
    let done = tokio::spawn(mlscope_proxy::shell::app::run(
        config,
        listener,
        admin,
        async move {
            let _ = rx.await;
        },
    ));
    // `run` opens the store before serving; wait for the admin port to answer.
    let client = reqwest::Client::new();
    eventually(
        Duration::from_secs(30),
        "the in-process proxy's admin /healthz answers",
        async || {
            assert!(!done.is_finished(), "the in-process proxy stopped");
            match client.get(format!("{admin_url}/healthz")).send().await {
                Ok(_) => Ok(()),
                Err(e) => Err(e.to_string()),
            }
        },
    )
    .await;
    Proxy {
        url: format!("http://{addr}"),
        admin_url,
        addr,
        shutdown: Some(tx),
        done,
    }
}

/// Sends raw bytes and reads until the peer closes or `until` appears.
async fn raw_exchange(addr: SocketAddr, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut out = Vec::new();
    stream.read_to_end(&mut out).await.unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

fn body_of(response: &str) -> Value {
    let body = response.split("\r\n\r\n").nth(1).unwrap();
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {response}"))
}

// === tests ===

#[tokio::test]
async fn requests_reach_the_upstream_with_hop_by_hop_headers_removed_and_host_and_query_kept() {
    let upstream = start_upstream(Script::default()).await;
    let proxy = start_proxy(&format!("http://{upstream}"), |_| {}).await;
    let request = "GET /echo?x=a%2Fb&y=%20+&z=caf%C3%A9&&w HTTP/1.1\r\n\
                   Host: mlflow.example.com:8443\r\n\
                   Connection: close, X-Drop-Me\r\n\
                   X-Drop-Me: secret\r\n\
                   Keep-Alive: timeout=5\r\n\
                   Proxy-Connection: keep-alive\r\n\
                   TE: trailers\r\n\
                   X-Forwarded-For: 203.0.113.9\r\n\
                   Authorization: Bearer token\r\n\
                   X-Request-Id: client-chosen-id\r\n\r\n";
    let response = raw_exchange(proxy.addr, request.as_bytes()).await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(
        response
            .to_ascii_lowercase()
            .contains("x-request-id: client-chosen-id"),
        "{response}"
    );
    let seen = body_of(&response);
    assert_eq!(seen["uri"], "/echo?x=a%2Fb&y=%20+&z=caf%C3%A9&&w");
    let headers = &seen["headers"];
    assert_eq!(headers["host"], "mlflow.example.com:8443");
    assert_eq!(headers["x-forwarded-for"], "203.0.113.9, 127.0.0.1");
    assert_eq!(headers["x-forwarded-proto"], "http");
    assert_eq!(headers["authorization"], "Bearer token");
    assert_eq!(headers["x-request-id"], "client-chosen-id");
    for hop in ["x-drop-me", "keep-alive", "proxy-connection", "te"] {
        assert!(headers.get(hop).is_none(), "{hop} was forwarded: {headers}");
    }
}

#[tokio::test]
async fn head_requests_and_chunked_uploads_are_forwarded() {
    let upstream = start_upstream(Script::default()).await;
    let proxy = start_proxy(&format!("http://{upstream}"), |_| {}).await;
    let client = reqwest::Client::new();

    let head = client
        .head(format!("{}/echo", proxy.url))
        .send()
        .await
        .unwrap();
    assert_eq!(head.status(), 200);
    assert!(head.bytes().await.unwrap().is_empty());

    // A body of unknown length goes out chunked and arrives whole.
    let chunks = futures_util::stream::iter(
        (0..64).map(|_| Ok::<_, std::io::Error>(Bytes::from(vec![7u8; 16 * 1024]))),
    );
    let response = client
        .put(format!("{}/echo", proxy.url))
        .body(reqwest::Body::wrap_stream(chunks))
        .send()
        .await
        .unwrap();
    let seen: Value = response.json().await.unwrap();
    assert_eq!(seen["method"], "PUT");
    assert_eq!(seen["body_len"], 64 * 16 * 1024);
    assert_eq!(seen["headers"]["transfer-encoding"], "chunked");
}

#[tokio::test]
async fn expect_100_continue_gets_a_continue_before_the_body_is_sent() {
    let upstream = start_upstream(Script::default()).await;
    let proxy = start_proxy(&format!("http://{upstream}"), |_| {}).await;
    let mut stream = TcpStream::connect(proxy.addr).await.unwrap();
    stream
        .write_all(b"PUT /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut interim = [0u8; 25];
    stream.read_exact(&mut interim).await.unwrap();
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
    stream.write_all(b"hello").await.unwrap();
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).await.unwrap();
    let rest = String::from_utf8(rest).unwrap();
    assert!(rest.starts_with("HTTP/1.1 200"), "{rest}");
    assert_eq!(body_of(&rest)["body_len"], 5);
}

#[tokio::test]
async fn request_bodies_stream_to_the_upstream_before_the_client_finishes() {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let upstream = start_upstream(Script {
        received: Some(tx),
        ..Default::default()
    })
    .await;
    let proxy = start_proxy(&format!("http://{upstream}"), |_| {}).await;

    // The client sends its second chunk only after the upstream has seen the first: a proxy that
    // buffered the whole body would deadlock here.
    let (body_tx, body_rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(1);
    let url = format!("{}/upload-progress", proxy.url);
    let upload = tokio::spawn(async move {
        reqwest::Client::new()
            .put(url)
            .body(reqwest::Body::wrap_stream(tokio_stream_from(body_rx)))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    });
    body_tx
        .send(Ok(Bytes::from(vec![1u8; 1000])))
        .await
        .unwrap();
    let mut seen = 0;
    while seen < 1000 {
        seen += tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("first chunk reached the upstream")
            .unwrap();
    }
    body_tx.send(Ok(Bytes::from(vec![2u8; 500]))).await.unwrap();
    drop(body_tx);
    assert_eq!(upload.await.unwrap(), "1500");
}

#[tokio::test]
async fn server_sent_events_reach_the_client_one_by_one() {
    let script = Script::default();
    let upstream = start_upstream(script.clone()).await;
    let proxy = start_proxy(&format!("http://{upstream}"), |_| {}).await;
    let response = reqwest::get(format!("{}/sse", proxy.url)).await.unwrap();
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut stream = response.bytes_stream();
    for i in 0..3 {
        // The upstream sends event i+1 only once we have received event i.
        let chunk = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .expect("event arrives unbuffered")
            .unwrap()
            .unwrap();
        assert_eq!(chunk, Bytes::from(format!("data: event {i}\n\n")));
        script.next_event.notify_one();
    }
}

#[tokio::test]
async fn an_unreachable_upstream_is_a_502_in_mlflow_error_json() {
    let closed = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let proxy = start_proxy(&format!("http://{closed}"), |_| {}).await;
    let response = reqwest::get(format!("{}/api/2.0/mlflow/experiments/search", proxy.url))
        .await
        .unwrap();
    assert_eq!(response.status(), 502);
    let json: Value = response.json().await.unwrap();
    assert_eq!(json["error_code"], "TEMPORARILY_UNAVAILABLE");
    assert!(
        json["message"]
            .as_str()
            .unwrap()
            .contains("could not connect"),
        "{json}"
    );

    let ready = reqwest::get(format!("{}/readyz", proxy.admin_url))
        .await
        .unwrap();
    assert_eq!(ready.status(), 503);
    let ready: Value = ready.json().await.unwrap();
    assert_eq!(ready["upstream"]["ok"], false);
    assert_eq!(ready["store"]["ok"], true);
}

/// A proxy started with `--upstream` pointing at nothing says so in its log at once (before, it
/// started silently and users saw only their client's "too many 502 error responses"); its admin
/// port's `/` lists what it serves.
#[tokio::test]
async fn a_proxy_whose_upstream_does_not_answer_says_so_at_start() {
    let closed = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let proxy = mlscope_tests::spawn_proxy(&format!("http://{closed}"), &[], dir.path()).unwrap();
    let log = || std::fs::read_to_string(&proxy.log_path).unwrap_or_default();
    eventually(
        Duration::from_secs(60),
        "the proxy's warning that MLflow does not answer",
        async || {
            let log = log();
            let warning = log
                .lines()
                .find(|l| l.contains("MLflow does not answer at the upstream URL"));
            match warning {
                Some(line) => {
                    let line: Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
                    assert_eq!(line["level"], "WARN", "{line}");
                    assert!(
                        line.to_string().contains(&closed.to_string()),
                        "the warning names the URL: {line}"
                    );
                    Ok(())
                }
                None => Err(log.lines().take(5).collect::<Vec<_>>().join("\n")),
            }
        },
    )
    .await;
    let index = reqwest::get(format!("{}/", proxy.admin_url)).await.unwrap();
    assert_eq!(index.status(), 200);
    assert!(index.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    let page = index.text().await.unwrap();
    for path in ["/healthz", "/readyz", "/metrics", "/runs/"] {
        assert!(page.contains(path), "{path}: {page}");
    }
}

#[tokio::test]
async fn an_upstream_that_resets_the_connection_is_a_502() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = socket.read(&mut buf).await;
            drop(socket); // closes without answering
        }
    });
    let proxy = start_proxy(&format!("http://{addr}"), |_| {}).await;
    let response = reqwest::get(format!("{}/health", proxy.url)).await.unwrap();
    assert_eq!(response.status(), 502);
    let json: Value = response.json().await.unwrap();
    assert!(
        json["message"]
            .as_str()
            .unwrap()
            .contains("closed the connection"),
        "{json}"
    );
}

#[tokio::test]
async fn an_upstream_that_sends_no_headers_in_time_is_a_504() {
    let upstream = start_upstream(Script::default()).await;
    let proxy = start_proxy(&format!("http://{upstream}"), |c| {
        c.forwarder.timeouts.response_headers = Duration::from_millis(300)
    })
    .await;
    let response = reqwest::get(format!("{}/slow-headers", proxy.url))
        .await
        .unwrap();
    assert_eq!(response.status(), 504);
    let json: Value = response.json().await.unwrap();
    assert_eq!(json["error_code"], "TEMPORARILY_UNAVAILABLE");
    let metrics = scrape(&proxy.admin_url).await;
    assert!(
        metrics.contains("mlscope_upstream_errors_total{kind=\"response_timeout\"} 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_response_body_that_stalls_is_aborted_after_the_idle_timeout() {
    let upstream = start_upstream(Script::default()).await;
    let proxy = start_proxy(&format!("http://{upstream}"), |c| {
        c.forwarder.timeouts.body_idle = Duration::from_millis(300)
    })
    .await;
    let response = reqwest::get(format!("{}/stall", proxy.url)).await.unwrap();
    assert_eq!(response.status(), 200);
    let result = tokio::time::timeout(Duration::from_secs(10), response.bytes())
        .await
        .expect("the proxy ends the stalled body");
    assert!(
        result.is_err(),
        "a stalled body must not look complete: {result:?}"
    );
}

/// Reads one HTTP/1.1 response (headers and a `Content-Length` body) from `socket`: its status
/// line and headers, lower-cased.
async fn read_response(socket: &mut TcpStream) -> String {
    let mut seen = Vec::new();
    let mut byte = [0u8; 1];
    while !seen.ends_with(b"\r\n\r\n") {
        assert_eq!(socket.read(&mut byte).await.unwrap(), 1, "closed: {seen:?}");
        seen.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&seen).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map_or(0, |v| v.trim().parse().unwrap());
    let mut body = vec![0u8; length];
    socket.read_exact(&mut body).await.unwrap();
    head
}

/// Finding 5: the proxy's own refusal was 503, which MLflow 3.18's client does not retry for a
/// write such as `runs/create`, and the connection was closed under the client's next request.
/// A request the proxy did not forward is answered 429 `REQUEST_LIMIT_EXCEEDED` with
/// `Retry-After`, after its body was read, so the keep-alive connection serves the next request.
#[tokio::test]
async fn requests_over_the_concurrency_limit_get_429_with_retry_after_on_a_connection_that_stays_usable(
) {
    let script = Script::default();
    let upstream = start_upstream(script.clone()).await;
    let proxy = start_proxy(&format!("http://{upstream}"), |c| c.serve.max_in_flight = 1).await;
    let url = format!("{}/hold", proxy.url);
    let held = tokio::spawn(async move { reqwest::get(url).await.unwrap().text().await.unwrap() });
    script.entered.notified().await;

    let rejected = reqwest::get(format!("{}/echo", proxy.url)).await.unwrap();
    assert_eq!(rejected.status(), 429);
    assert_eq!(rejected.headers()["retry-after"], "1");
    let json: Value = rejected.json().await.unwrap();
    assert_eq!(json["error_code"], "REQUEST_LIMIT_EXCEEDED", "{json}");
    assert!(
        json["message"]
            .as_str()
            .unwrap()
            .contains("limit of 1 concurrent"),
        "{json}"
    );
    // A write refused on a keep-alive connection, its body unread by anyone: the client's next
    // request on the same connection is answered.
    let address = proxy.url.trim_start_matches("http://");
    let mut socket = TcpStream::connect(address).await.unwrap();
    let body = "x".repeat(64 * 1024);
    let post = format!(
        "POST /api/2.0/mlflow/runs/create HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(post.as_bytes()).await.unwrap();
    let refused = read_response(&mut socket).await;
    assert!(refused.starts_with("http/1.1 429"), "{refused}");
    assert!(refused.contains("retry-after: 1"), "{refused}");
    assert!(!refused.contains("connection: close"), "{refused}");
    // The proxy's own refusal is counted as such, never as MLflow failing to answer.
    let metrics = crate::mlflow::scrape(&proxy.admin_url).await;
    assert!(
        metrics.contains("mlscope_overload_refusals_total 2"),
        "{metrics}"
    );
    assert!(
        !metrics.contains("mlscope_upstream_errors_total{"),
        "{metrics}"
    );

    script.release.notify_one();
    assert_eq!(held.await.unwrap(), "released");
    // The permit is back once the held response has finished; the refused connection carries
    // the next request.
    socket
        .write_all(format!("GET /echo HTTP/1.1\r\nHost: {address}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let next = read_response(&mut socket).await;
    assert!(next.starts_with("http/1.1 200"), "{next}");
}

#[tokio::test]
async fn shutdown_lets_in_flight_requests_finish_and_stops_accepting() {
    let script = Script::default();
    let upstream = start_upstream(script.clone()).await;
    let mut proxy = start_proxy(&format!("http://{upstream}"), |_| {}).await;
    let url = format!("{}/hold", proxy.url);
    let held = tokio::spawn(async move { reqwest::get(url).await.map(|r| r.status()) });
    script.entered.notified().await;

    proxy.shutdown.take().unwrap().send(()).unwrap();
    // New connections are refused once the listener is closed.
    eventually(
        Duration::from_secs(10),
        "new connections refused after shutdown",
        async || match TcpStream::connect(proxy.addr).await {
            Ok(_) => Err("the listener still accepts".to_owned()),
            Err(_) => Ok(()),
        },
    )
    .await;

    script.release.notify_one();
    assert_eq!(held.await.unwrap().unwrap(), 200);
    proxy.done.await.unwrap().unwrap();
}

#[tokio::test]
async fn metrics_count_requests_by_route_class_and_status() {
    let upstream = start_upstream(Script::default()).await;
    let proxy = start_proxy(&format!("http://{upstream}"), |_| {}).await;
    for _ in 0..3 {
        reqwest::get(format!("{}/echo", proxy.url)).await.unwrap();
    }
    // A request is counted once its answer has gone: the third right after the client has it.
    let metrics = eventually(
        Duration::from_secs(10),
        "three requests counted",
        async || {
            let metrics = scrape(&proxy.admin_url).await;
            let counted =
                r#"mlscope_http_requests_total{route="other",method="GET",status="200"} 3"#;
            if metrics.contains(counted) {
                Ok(metrics)
            } else {
                Err(metrics)
            }
        },
    )
    .await;
    assert!(
        metrics.contains("mlscope_http_request_duration_seconds_bucket"),
        "{metrics}"
    );
    assert!(
        metrics.contains("mlscope_http_requests_in_flight 0"),
        "{metrics}"
    );
}
