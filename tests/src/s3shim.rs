//! A quirk-injecting S3 shim: an HTTP reverse proxy in front of the real SeaweedFS that makes it
//! answer like the S3-compatible stores of the field notes (§4, "S3-compatible stores are not S3").
//!
//! The project's rule is that a fake is allowed only where the real behaviour cannot be produced
//! here. SeaweedFS 4.x, the store of the test stack, decodes `aws-chunked` bodies with trailing
//! checksums, accepts `x-amz-checksum-*` headers and answers `GetObjectTagging` (all three shown
//! against it in `tests/tests/it/s3_quirks.rs`), so the failures below cannot be had from it; the
//! shim injects them. Everything else is SeaweedFS's own behaviour: each request is forwarded with its
//! method, path and query, headers (`Host` included) and streamed body, and the store's answer
//! comes back as it was sent. Only hop-by-hop framing (`Connection`, `Transfer-Encoding`,
//! `Expect`, ...) is redone by hyper on each side.
//!
//! What each quirk reproduces (each can be switched off in [`Quirks`]; all are on by default):
//!
//! - [`Quirks::missing_content_length`]: stores that do not understand `aws-chunked` uploads
//!   (bodies framed in chunks with a trailing `x-amz-checksum-*`, as boto3 ≥ 1.36 and
//!   aws-sdk-s3 ≥ 1.69 send them by default) and insist on an exact `Content-Length`. A PUT or
//!   POST whose body is `aws-chunked` (`Content-Encoding: aws-chunked`, an
//!   `x-amz-content-sha256: STREAMING-...` or an `x-amz-trailer` header) or whose body has no
//!   `Content-Length` (HTTP chunked transfer encoding) is answered `411 MissingContentLength`.
//! - [`Quirks::checksums_not_implemented`]: stores that do not implement S3's flexible
//!   checksums. A PUT with any `x-amz-checksum-*` or `x-amz-sdk-checksum-algorithm` header, or
//!   with such a query parameter (a presigned URL with a checksum baked in), is answered
//!   `501 NotImplemented`.
//! - [`Quirks::tagging_malformed_xml`]: stores whose object tagging API is missing or broken, which
//!   fails copies that read the source's tags. `GET` and `PUT ?tagging` (GetObjectTagging,
//!   PutObjectTagging) are answered `400 MalformedXML`.
//! - [`Quirks::directory_markers`]: "folder" uploads by consoles and sync tools, which leave a
//!   zero-byte object for each directory. After every successful PutObject (a PUT of an object
//!   that is neither a part nor a copy) and CompleteMultipartUpload of `a/b/c`, the shim PUTs
//!   zero-byte `a/` and `a/b/` into the same bucket itself. Here only the writes are made up:
//!   SeaweedFS stores a zero-byte key ending in `/` as an object and lists it among `Contents`
//!   like S3 does (in a listing without delimiter, and as the first entry of the directory's own
//!   delimited listing), so what a lister sees afterwards is the store's real behaviour and the
//!   shim does not rewrite listings.
//!
//! The shim assumes path-style requests (`/<bucket>/<key>`), as every client in these tests sends
//! them. It counts what it forwarded and what it injected ([`S3Shim::counts`]) so that a test can
//! show a quirk really fired, and keeps a log of the requests it saw ([`S3Shim::exchanges`]).
//! It runs on a Tokio runtime of its own, so it serves requests whatever the caller's thread
//! does (a blocking test, another runtime), and stops when dropped.

use std::convert::Infallible;
use std::net::TcpListener as StdTcpListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, Context, Result};
use bytes::Bytes;
use http::uri::{Authority, PathAndQuery};
use http::{
    header, HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri,
};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::{Body, Incoming};
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};

type ShimBody = BoxBody<Bytes, hyper::Error>;

/// Which store behaviours the shim injects. [`Quirks::default`] turns all of them on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quirks {
    /// `aws-chunked` bodies and bodies without `Content-Length` are refused with
    /// `411 MissingContentLength`.
    pub missing_content_length: bool,
    /// PUTs with flexible-checksum headers or query parameters are refused with
    /// `501 NotImplemented`.
    pub checksums_not_implemented: bool,
    /// GetObjectTagging and PutObjectTagging are refused with `400 MalformedXML`.
    pub tagging_malformed_xml: bool,
    /// Zero-byte `dir/` objects are created for the directories of every object written.
    pub directory_markers: bool,
}

impl Default for Quirks {
    fn default() -> Self {
        Quirks {
            missing_content_length: true,
            checksums_not_implemented: true,
            tagging_malformed_xml: true,
            directory_markers: true,
        }
    }
}

impl Quirks {
    /// No quirk: a plain pass-through proxy.
    pub fn none() -> Self {
        Quirks {
            missing_content_length: false,
            checksums_not_implemented: false,
            tagging_malformed_xml: false,
            directory_markers: false,
        }
    }
}

/// A failure the shim answers in the store's place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Injection {
    /// `411 MissingContentLength`.
    MissingContentLength,
    /// `501 NotImplemented`.
    ChecksumNotImplemented,
    /// `400 MalformedXML`.
    TaggingMalformedXml,
}

impl Injection {
    pub fn status(self) -> StatusCode {
        match self {
            Injection::MissingContentLength => StatusCode::LENGTH_REQUIRED,
            Injection::ChecksumNotImplemented => StatusCode::NOT_IMPLEMENTED,
            Injection::TaggingMalformedXml => StatusCode::BAD_REQUEST,
        }
    }

    /// The S3 error code in the response body.
    pub fn code(self) -> &'static str {
        match self {
            Injection::MissingContentLength => "MissingContentLength",
            Injection::ChecksumNotImplemented => "NotImplemented",
            Injection::TaggingMalformedXml => "MalformedXML",
        }
    }

    fn message(self) -> &'static str {
        match self {
            Injection::MissingContentLength => "You must provide the Content-Length HTTP header.",
            Injection::ChecksumNotImplemented => {
                "A header you provided implies functionality that is not implemented."
            }
            Injection::TaggingMalformedXml => {
                "The XML you provided was not well-formed or did not validate against our published schema."
            }
        }
    }
}

/// What the shim has done so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InjectionCounts {
    /// Requests passed on to the store (the shim's own marker PUTs not included).
    pub forwarded: u64,
    pub missing_content_length: u64,
    pub checksum_not_implemented: u64,
    pub tagging_malformed_xml: u64,
    /// Directory markers the shim wrote into the store.
    pub markers_created: u64,
}

impl InjectionCounts {
    /// Requests answered with an injected failure.
    pub fn failures(&self) -> u64 {
        self.missing_content_length + self.checksum_not_implemented + self.tagging_malformed_xml
    }
}

/// One request the shim saw, for assertions and for failure messages.
#[derive(Debug, Clone)]
pub struct Exchange {
    pub method: Method,
    /// Path and query as received.
    pub target: String,
    /// The request headers, `Authorization` left out.
    pub headers: Vec<(String, String)>,
    /// The failure the shim answered with, if it did not forward the request.
    pub injected: Option<Injection>,
    /// The status the client got (502 when the store could not be reached).
    pub status: u16,
}

#[derive(Debug, Default)]
struct Counters {
    forwarded: AtomicU64,
    missing_content_length: AtomicU64,
    checksum_not_implemented: AtomicU64,
    tagging_malformed_xml: AtomicU64,
    markers_created: AtomicU64,
}

impl Counters {
    fn injected(&self, injection: Injection) {
        let counter = match injection {
            Injection::MissingContentLength => &self.missing_content_length,
            Injection::ChecksumNotImplemented => &self.checksum_not_implemented,
            Injection::TaggingMalformedXml => &self.tagging_malformed_xml,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> InjectionCounts {
        InjectionCounts {
            forwarded: self.forwarded.load(Ordering::Relaxed),
            missing_content_length: self.missing_content_length.load(Ordering::Relaxed),
            checksum_not_implemented: self.checksum_not_implemented.load(Ordering::Relaxed),
            tagging_malformed_xml: self.tagging_malformed_xml.load(Ordering::Relaxed),
            markers_created: self.markers_created.load(Ordering::Relaxed),
        }
    }
}

// === impl S3Shim ===

/// A running shim; dropping it stops it.
#[derive(Debug)]
pub struct S3Shim {
    /// `http://127.0.0.1:<port>`: use it as the S3 endpoint.
    pub url: String,
    state: Arc<State>,
    runtime: Option<tokio::runtime::Runtime>,
}

#[derive(Debug)]
struct State {
    upstream: Authority,
    quirks: Quirks,
    client: Client<HttpConnector, ShimBody>,
    counters: Counters,
    exchanges: Mutex<Vec<Exchange>>,
}

impl S3Shim {
    /// Starts a shim on a free loopback port in front of the S3 endpoint `upstream`
    /// (`http://host:port`).
    pub fn start(upstream: &str, quirks: Quirks) -> Result<S3Shim> {
        let authority = upstream
            .strip_prefix("http://")
            .map(|rest| rest.trim_end_matches('/'))
            .ok_or_else(|| anyhow!("the shim's upstream {upstream:?} must be an http:// URL"))?;
        let upstream: Authority = authority
            .parse()
            .with_context(|| format!("parsing {upstream:?}"))?;
        let listener = StdTcpListener::bind("127.0.0.1:0").context("binding the S3 shim")?;
        listener.set_nonblocking(true)?;
        let url = format!("http://{}", listener.local_addr()?);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("s3-shim")
            .enable_all()
            .build()
            .context("starting the S3 shim's runtime")?;
        let state = Arc::new(State {
            upstream,
            quirks,
            client: Client::builder(TokioExecutor::new()).build_http(),
            counters: Counters::default(),
            exchanges: Mutex::new(Vec::new()),
        });
        let serving = state.clone();
        runtime.spawn(async move {
            let listener = match tokio::net::TcpListener::from_std(listener) {
                Ok(listener) => listener,
                Err(e) => {
                    eprintln!("s3 shim: cannot listen: {e}");
                    return;
                }
            };
            while let Ok((stream, _)) = listener.accept().await {
                let state = serving.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |request| {
                        let state = state.clone();
                        async move { Ok::<_, Infallible>(state.handle(request).await) }
                    });
                    // A client that goes away mid-request is no concern of the shim's.
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Ok(S3Shim {
            url,
            state,
            runtime: Some(runtime),
        })
    }

    /// What the shim has forwarded and injected so far.
    pub fn counts(&self) -> InjectionCounts {
        self.state.counters.snapshot()
    }

    /// Every request the shim has answered, in the order it answered them.
    pub fn exchanges(&self) -> Vec<Exchange> {
        self.state
            .exchanges
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Drop for S3Shim {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            // Never blocks, so the shim may be dropped inside another runtime.
            runtime.shutdown_background();
        }
    }
}

// === impl State ===

impl State {
    async fn handle(&self, request: Request<Incoming>) -> Response<ShimBody> {
        let method = request.method().clone();
        let target = request
            .uri()
            .path_and_query()
            .map(PathAndQuery::to_string)
            .unwrap_or_else(|| "/".into());
        let headers: Vec<(String, String)> = request
            .headers()
            .iter()
            .filter(|(name, _)| *name != header::AUTHORIZATION)
            .map(|(name, value)| {
                (
                    name.to_string(),
                    String::from_utf8_lossy(value.as_bytes()).into_owned(),
                )
            })
            .collect();
        let has_body = !request.body().is_end_stream();
        let injected = injection_for(
            &self.quirks,
            &method,
            request.uri(),
            request.headers(),
            has_body,
        );
        let response = match injected {
            Some(injection) => {
                self.counters.injected(injection);
                // Read the body before answering, as a store does, so that the client sees the
                // error instead of a connection closed under its upload.
                let mut body = request.into_body();
                while let Some(Ok(_)) = body.frame().await {}
                s3_error(
                    injection.status(),
                    injection.code(),
                    injection.message(),
                    request_path(&target),
                )
            }
            None => self.forward(request).await,
        };
        let exchange = Exchange {
            method,
            target,
            headers,
            injected,
            status: response.status().as_u16(),
        };
        self.exchanges
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(exchange);
        response
    }

    async fn forward(&self, request: Request<Incoming>) -> Response<ShimBody> {
        let (mut parts, body) = request.into_parts();
        let target = parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        let writes_object = self.quirks.directory_markers
            && writes_object(&parts.method, &parts.uri, &parts.headers);
        parts.uri = match Uri::builder()
            .scheme("http")
            .authority(self.upstream.clone())
            .path_and_query(target.clone())
            .build()
        {
            Ok(uri) => uri,
            Err(e) => {
                return s3_error(
                    StatusCode::BAD_REQUEST,
                    "InvalidURI",
                    &e.to_string(),
                    target.path(),
                )
            }
        };
        strip_hop_by_hop(&mut parts.headers);
        self.counters.forwarded.fetch_add(1, Ordering::Relaxed);
        let response = match self
            .client
            .request(Request::from_parts(parts, body.boxed()))
            .await
        {
            Ok(response) => response,
            Err(e) => {
                return s3_error(
                    StatusCode::BAD_GATEWAY,
                    "ShimUpstreamError",
                    &format!("the store could not be reached: {e}"),
                    target.path(),
                )
            }
        };
        if writes_object && response.status().is_success() {
            for marker in marker_paths(target.path()) {
                self.create_marker(&marker).await;
            }
        }
        let (mut parts, body) = response.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        Response::from_parts(parts, body.boxed())
    }

    /// PUTs a zero-byte object at `path` (`/<bucket>/<dir>/`), as a folder-creating tool does.
    async fn create_marker(&self, path: &str) {
        let Ok(uri) = Uri::builder()
            .scheme("http")
            .authority(self.upstream.clone())
            .path_and_query(path)
            .build()
        else {
            return;
        };
        let request = Request::put(uri).header(header::CONTENT_LENGTH, "0").body(
            Empty::<Bytes>::new()
                .map_err(|never| match never {})
                .boxed(),
        );
        let Ok(request) = request else { return };
        match self.client.request(request).await {
            Ok(response) if response.status().is_success() => {
                self.counters
                    .markers_created
                    .fetch_add(1, Ordering::Relaxed);
            }
            Ok(response) => eprintln!(
                "s3 shim: creating the marker {path} failed with {}",
                response.status()
            ),
            Err(e) => eprintln!("s3 shim: creating the marker {path} failed: {e}"),
        }
    }
}

// === request classification ===

/// The failure to inject for a request, if any; the checks run in the order a store that lacks
/// these features would fail them: the body's framing first, then its headers, then the API.
pub fn injection_for(
    quirks: &Quirks,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    has_body: bool,
) -> Option<Injection> {
    let writes = *method == Method::PUT || *method == Method::POST;
    if quirks.missing_content_length && writes {
        let text = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
        };
        let aws_chunked = text("content-encoding")
            .to_ascii_lowercase()
            .contains("aws-chunked")
            || text("x-amz-content-sha256").starts_with("STREAMING-")
            || headers.contains_key("x-amz-trailer");
        let unknown_length = !headers.contains_key(header::CONTENT_LENGTH)
            && (has_body || headers.contains_key(header::TRANSFER_ENCODING));
        if aws_chunked || unknown_length {
            return Some(Injection::MissingContentLength);
        }
    }
    if quirks.checksums_not_implemented && *method == Method::PUT {
        let checksum_name = |name: &str| {
            let name = name.to_ascii_lowercase();
            name.starts_with("x-amz-checksum-") || name == "x-amz-sdk-checksum-algorithm"
        };
        if headers.keys().any(|name| checksum_name(name.as_str()))
            || query_names(uri).any(checksum_name)
        {
            return Some(Injection::ChecksumNotImplemented);
        }
    }
    if quirks.tagging_malformed_xml
        && (*method == Method::GET || *method == Method::PUT)
        && query_names(uri).any(|name| name == "tagging")
    {
        return Some(Injection::TaggingMalformedXml);
    }
    None
}

/// PutObject (a PUT of a key with no sub-resource, not a copy) or CompleteMultipartUpload
/// (a POST with `uploadId`).
fn writes_object(method: &Method, uri: &Uri, headers: &HeaderMap) -> bool {
    let has_key = uri
        .path()
        .trim_start_matches('/')
        .split_once('/')
        .is_some_and(|(_, key)| !key.is_empty());
    if !has_key {
        return false;
    }
    match *method {
        // Only signature and SDK bookkeeping parameters: `?x-id=PutObject`, presigned `X-Amz-*`.
        Method::PUT => {
            !headers.contains_key("x-amz-copy-source")
                && query_names(uri)
                    .all(|name| name == "x-id" || name.to_ascii_lowercase().starts_with("x-amz-"))
        }
        Method::POST => query_names(uri).any(|name| name == "uploadId"),
        _ => false,
    }
}

/// The markers a folder-creating tool leaves for `/<bucket>/a/b/c`: `/<bucket>/a/` and
/// `/<bucket>/a/b/` (not the object itself, even when its key ends in `/`).
pub fn marker_paths(path: &str) -> Vec<String> {
    let Some((bucket, key)) = path.trim_start_matches('/').split_once('/') else {
        return Vec::new();
    };
    let segments: Vec<&str> = key.trim_end_matches('/').split('/').collect();
    let mut markers = Vec::new();
    let mut dir = String::new();
    for segment in &segments[..segments.len().saturating_sub(1)] {
        if segment.is_empty() {
            break;
        }
        dir.push_str(segment);
        dir.push('/');
        markers.push(format!("/{bucket}/{dir}"));
    }
    markers
}

fn query_names(uri: &Uri) -> impl Iterator<Item = &str> {
    uri.query()
        .unwrap_or("")
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| pair.split_once('=').map_or(pair, |(name, _)| name))
}

fn request_path(target: &str) -> &str {
    target.split('?').next().unwrap_or(target)
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) and `Expect`, which hyper answers itself; hyper frames
/// each side's body anew.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| name.trim().parse().ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in [
        header::CONNECTION,
        header::TRANSFER_ENCODING,
        header::TE,
        header::TRAILER,
        header::UPGRADE,
        header::EXPECT,
        HeaderName::from_static("keep-alive"),
        HeaderName::from_static("proxy-connection"),
    ] {
        headers.remove(name);
    }
}

/// An S3 error document, as stores send it.
fn s3_error(status: StatusCode, code: &str, message: &str, resource: &str) -> Response<ShimBody> {
    let body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>{}</Message><Resource>{}</Resource><RequestId>s3-shim</RequestId></Error>",
        xml_escape(message),
        xml_escape(resource)
    );
    let mut response = Response::new(
        Full::new(Bytes::from(body))
            .map_err(|never| match never {})
            .boxed(),
    );
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/xml"),
    );
    response
}

fn xml_escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| (HeaderName::from_static(k), HeaderValue::from_static(v)))
            .collect()
    }

    fn classify(
        method: Method,
        uri: &str,
        pairs: &[(&'static str, &'static str)],
        has_body: bool,
    ) -> Option<Injection> {
        injection_for(
            &Quirks::default(),
            &method,
            &uri.parse().unwrap(),
            &headers(pairs),
            has_body,
        )
    }

    #[test]
    fn aws_chunked_bodies_and_bodies_of_unknown_length_miss_their_content_length() {
        let trailer = [
            ("content-encoding", "aws-chunked"),
            ("x-amz-content-sha256", "STREAMING-UNSIGNED-PAYLOAD-TRAILER"),
            ("x-amz-trailer", "x-amz-checksum-crc32"),
            ("x-amz-sdk-checksum-algorithm", "CRC32"),
        ];
        assert_eq!(
            classify(Method::PUT, "/b/k", &trailer, true),
            Some(Injection::MissingContentLength)
        );
        assert_eq!(
            classify(
                Method::PUT,
                "/b/k",
                &[
                    ("content-length", "9"),
                    ("x-amz-trailer", "x-amz-checksum-crc32")
                ],
                true
            ),
            Some(Injection::MissingContentLength)
        );
        assert_eq!(
            classify(
                Method::PUT,
                "/b/k",
                &[("transfer-encoding", "chunked")],
                true
            ),
            Some(Injection::MissingContentLength)
        );
        // An empty POST without Content-Length (CreateMultipartUpload) has no body to frame.
        assert_eq!(classify(Method::POST, "/b/k?uploads", &[], false), None);
        assert_eq!(
            classify(Method::PUT, "/b/k", &[("content-length", "5")], true),
            None
        );
    }

    #[test]
    fn flexible_checksums_on_puts_are_not_implemented() {
        let header = [
            ("content-length", "5"),
            ("x-amz-checksum-crc32", "NhCmhg=="),
            ("x-amz-sdk-checksum-algorithm", "CRC32"),
        ];
        assert_eq!(
            classify(Method::PUT, "/b/k?x-id=PutObject", &header, true),
            Some(Injection::ChecksumNotImplemented)
        );
        assert_eq!(
            classify(
                Method::PUT,
                "/b/k?partNumber=1&uploadId=u&x-amz-checksum-crc32=AAAAAA%3D%3D",
                &[("content-length", "5")],
                true
            ),
            Some(Injection::ChecksumNotImplemented)
        );
        // Response checksum validation on reads is not a flexible-checksum upload.
        assert_eq!(
            classify(
                Method::GET,
                "/b/k",
                &[("x-amz-checksum-mode", "ENABLED")],
                false
            ),
            None
        );
    }

    #[test]
    fn object_tagging_is_malformed_xml_and_quirks_switch_off_one_by_one() {
        assert_eq!(
            classify(Method::GET, "/b/k?tagging", &[], false),
            Some(Injection::TaggingMalformedXml)
        );
        assert_eq!(
            classify(
                Method::PUT,
                "/b/k?tagging",
                &[("content-length", "40")],
                true
            ),
            Some(Injection::TaggingMalformedXml)
        );
        assert_eq!(classify(Method::GET, "/b/k?taggingx=1", &[], false), None);
        let quirks = Quirks {
            tagging_malformed_xml: false,
            ..Quirks::default()
        };
        assert_eq!(
            injection_for(
                &quirks,
                &Method::GET,
                &"/b/k?tagging".parse().unwrap(),
                &HeaderMap::new(),
                false
            ),
            None
        );
        let none = Quirks::none();
        let chunked = headers(&[
            ("transfer-encoding", "chunked"),
            ("x-amz-checksum-crc32", "x"),
        ]);
        assert_eq!(
            injection_for(
                &none,
                &Method::PUT,
                &"/b/k".parse().unwrap(),
                &chunked,
                true
            ),
            None
        );
    }

    #[test]
    fn markers_are_made_for_every_directory_of_a_written_object() {
        assert_eq!(
            marker_paths("/mlflow/a/b/c"),
            vec!["/mlflow/a/", "/mlflow/a/b/"]
        );
        assert_eq!(marker_paths("/mlflow/a/b/"), vec!["/mlflow/a/"]);
        assert_eq!(marker_paths("/mlflow/c"), Vec::<String>::new());
        assert_eq!(marker_paths("/mlflow"), Vec::<String>::new());
        let put = |uri: &str, pairs: &[(&'static str, &'static str)]| {
            writes_object(&Method::PUT, &uri.parse().unwrap(), &headers(pairs))
        };
        assert!(put("/mlflow/a/b?x-id=PutObject", &[]));
        assert!(put(
            "/mlflow/a/b?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature=s",
            &[]
        ));
        assert!(!put(
            "/mlflow/a/b?partNumber=1&uploadId=u&x-id=UploadPart",
            &[]
        ));
        assert!(!put("/mlflow/a/b", &[("x-amz-copy-source", "/mlflow/x")]));
        assert!(!put("/mlflow", &[]));
        assert!(writes_object(
            &Method::POST,
            &"/mlflow/a/b?uploadId=u".parse().unwrap(),
            &HeaderMap::new()
        ));
        assert!(!writes_object(
            &Method::POST,
            &"/mlflow/a/b?uploads".parse().unwrap(),
            &HeaderMap::new()
        ));
    }
}
