//! Forwarded listings from MLflow servers older than 3.16 list zero-byte `key/` directory markers
//! as files; the UI's image grid then shows "No results". The proxy drops those entries from the
//! JSON of `artifacts/list` and the `mlflow-artifacts` listing on their way back.
//!
//! MLflow ≤ 3.15 lists every object under the listed prefix, so of all markers only the one equal
//! to the listed directory itself shows up (markers of subdirectories fold into common prefixes):
//!
//! - `GET mlflow-artifacts/artifacts?path=<dir>` answers basenames and adds
//!   `{"path": "<basename of dir>", "is_dir": false}` (no `file_size`: MLflow leaves it out for
//!   zero bytes); with no `path`, the repository root's marker appears as `"."`.
//! - `GET mlflow/artifacts/list?run_id=..&path=<dir>` answers run-relative paths and adds
//!   `"<dir>/<basename of dir>"`, or at the run root the basename of `root_uri` (`"artifacts"`).
//!   For runs whose artifact root MLflow does not proxy (`s3://...` directly) it lists through the
//!   artifact repository, which yields `"<dir>"` itself, or `"."` at the root.
//!
//! An entry is dropped only if it is one of those names, not a directory, and has no or a zero
//! `file_size`. Tradeoff: a genuine empty file named like its directory (`dir/dir` of zero bytes,
//! or an empty `artifacts` file at the run root) looks exactly the same in the JSON and is hidden
//! too. MLflow 3.16 and later skip markers themselves and never send such entries, so there the
//! filter finds nothing and the original bytes pass unchanged. Listings served by the artifact
//! gateway never come here: they are built from the store without markers ([`super::listing`]).
//!
//! Anything that is not a successful, uncompressed JSON listing of a known shape, or that is
//! larger than [`MAX_LISTING_BYTES`], passes through untouched and streaming.

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Query, Request, State};
use axum::response::Response;
use futures_util::StreamExt;
use http::{header, HeaderValue, Method, StatusCode, Uri};
use http_body_util::BodyExt;
use serde::{Deserialize, Serialize};

use super::{listing, path};
use crate::plumbing::error::ProxyError;
use crate::plumbing::proxy::Forwarder;
use crate::plumbing::proxy::Upstream;
use crate::plumbing::route::RouteClass;

/// Listings larger than this pass through unfiltered, so the proxy never holds more per request.
/// MLflow answers a listing of 100,000 files with about 10 MiB.
pub const MAX_LISTING_BYTES: usize = 64 << 20;

/// Whether a forwarded request is a listing whose answer must be filtered: `GET` of
/// `/{api,ajax-api}/2.0/mlflow/artifacts/list` or `/{api,ajax-api}/2.0/mlflow-artifacts/artifacts`.
fn applies(route: RouteClass, method: &Method, path: &str) -> bool {
    method == Method::GET && endpoint(route, path).is_some()
}

/// The listing routes of MLflow servers before 3.16 (`GET artifacts/list`, `GET
/// mlflow-artifacts/artifacts`), forwarded, with directory markers removed from the answer.
pub async fn forward_filtered(
    State(forwarder): State<Forwarder>,
    ConnectInfo(peer): ConnectInfo<std::net::SocketAddr>,
    request: Request,
) -> Response {
    if !applies(
        RouteClass::of(request.uri().path()),
        request.method(),
        request.uri().path(),
    ) {
        return forwarder.forward(request, peer).await;
    }
    let uri = request.uri().clone();
    let response = forwarder.forward(request, peer).await;
    match filter(response, &uri, forwarder.upstream()).await {
        Ok(response) => response,
        Err(error) => forwarder.answer_error(error),
    }
}

/// The paths [`forward_filtered`] serves.
pub const PATHS: [&str; 4] = [
    "/api/2.0/mlflow/artifacts/list",
    "/ajax-api/2.0/mlflow/artifacts/list",
    "/api/2.0/mlflow-artifacts/artifacts",
    "/ajax-api/2.0/mlflow-artifacts/artifacts",
];

/// Drops directory-marker entries from a listing response; anything else passes unchanged. `uri`
/// is the request's, whose `path` parameter names the listed directory. Fails only when the
/// upstream's body breaks off while it is being read.
pub async fn filter(
    response: Response,
    uri: &Uri,
    upstream: &Upstream,
) -> Result<Response, ProxyError> {
    let Some(endpoint) = endpoint(RouteClass::of(uri.path()), uri.path()) else {
        return Ok(response);
    };
    if !is_plain_json_ok(&response) {
        return Ok(response);
    }
    let (mut parts, body) = response.into_parts();
    let bytes = match collect_capped(body, MAX_LISTING_BYTES).await {
        Collected::Complete(bytes) => bytes,
        Collected::TooLarge(body) => return Ok(Response::from_parts(parts, body)),
        Collected::Failed(error) => {
            return Err(ProxyError::UpstreamReset {
                upstream: upstream.url(),
                reason: format!("listing body broke off: {error}"),
            })
        }
    };
    let bytes = drop_markers(endpoint, listed_path(uri).as_deref(), &bytes)
        .map(Bytes::from)
        .unwrap_or(bytes);
    parts
        .headers
        .insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
    Ok(Response::from_parts(parts, Body::from(bytes)))
}

// === endpoints ===

/// The two listing endpoints, which name their entries differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    /// `mlflow-artifacts/artifacts?path=`: basenames, relative to the listed directory.
    ArtifactsApi,
    /// `mlflow/artifacts/list?run_id=&path=`: paths relative to the run's artifact root.
    RunArtifacts,
}

/// Exact paths only: with a trailing slash, `.../mlflow-artifacts/artifacts/` is MLflow's download
/// route (3.15.2 answers an empty `application/octet-stream`), and so is any longer path.
fn endpoint(route: RouteClass, path: &str) -> Option<Endpoint> {
    match route {
        RouteClass::Tracking => [
            "/api/2.0/mlflow/artifacts/list",
            "/ajax-api/2.0/mlflow/artifacts/list",
        ]
        .contains(&path)
        .then_some(Endpoint::RunArtifacts),
        RouteClass::Artifacts => [
            "/api/2.0/mlflow-artifacts/artifacts",
            "/ajax-api/2.0/mlflow-artifacts/artifacts",
        ]
        .contains(&path)
        .then_some(Endpoint::ArtifactsApi),
        _ => None,
    }
}

/// The listed directory as MLflow reads it: the first `path` parameter, URL-decoded repeatedly.
/// `None` when absent; also when MLflow would refuse it, since MLflow then answers no listing.
fn listed_path(uri: &Uri) -> Option<String> {
    let Query(params) = Query::<Vec<(String, String)>>::try_from_uri(uri).ok()?;
    let (_, raw) = params.into_iter().find(|(name, _)| name == "path")?;
    // `validate` decodes once more than the query parser already did; re-encode to match.
    path::validate(&crate::plumbing::mlflow::percent_encode(&raw)).ok()
}

// === the body ===

fn is_plain_json_ok(response: &Response) -> bool {
    let headers = response.headers();
    let is_json = crate::plumbing::proxy::is_json(headers);
    let encoded = headers
        .get(header::CONTENT_ENCODING)
        .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
    let declared_too_large = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|len| len > MAX_LISTING_BYTES as u64);
    response.status() == StatusCode::OK && is_json && !encoded && !declared_too_large
}

enum Collected {
    Complete(Bytes),
    /// Over the cap: what was read so far followed by the rest, still streaming.
    TooLarge(Body),
    Failed(axum::Error),
}

/// Reads `body` up to `cap` bytes. Trailers are dropped (MLflow sends none).
async fn collect_capped(mut body: Body, cap: usize) -> Collected {
    let mut buffer = Vec::new();
    while let Some(frame) = body.frame().await {
        let data = match frame {
            Ok(frame) => match frame.into_data() {
                Ok(data) => data,
                Err(_trailers) => continue,
            },
            Err(error) => return Collected::Failed(error),
        };
        buffer.extend_from_slice(&data);
        if buffer.len() > cap {
            let head = futures_util::stream::once(std::future::ready(Ok::<_, axum::Error>(
                Bytes::from(buffer),
            )));
            return Collected::TooLarge(Body::from_stream(head.chain(body.into_data_stream())));
        }
    }
    Collected::Complete(Bytes::from(buffer))
}

/// MLflow's `ListArtifacts.Response`, in its field order. Unknown fields make the parse fail, and
/// then the body passes unchanged rather than losing them.
#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct Listing {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    root_uri: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    files: Vec<FileInfo>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    next_page_token: Option<String>,
}

#[derive(Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct FileInfo {
    path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    is_dir: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    file_size: Option<i64>,
}

impl FileInfo {
    fn may_be_marker(&self) -> bool {
        self.is_dir != Some(true) && self.file_size.unwrap_or(0) == 0
    }
}

/// The listing without marker entries, written as MLflow writes it; `None` if nothing was
/// dropped or the body is not a listing, so that the original bytes pass unchanged.
fn drop_markers(endpoint: Endpoint, listed: Option<&str>, body: &[u8]) -> Option<String> {
    let mut parsed: Listing = serde_json::from_slice(body).ok()?;
    let names = marker_names(endpoint, listed, parsed.root_uri.as_deref());
    let before = parsed.files.len();
    parsed
        .files
        .retain(|file| !(file.may_be_marker() && names.contains(&file.path)));
    if parsed.files.len() == before {
        return None;
    }
    Some(listing::pretty_string(&parsed))
}

/// The entry names under which the marker of the listed directory appears (see the module doc).
fn marker_names(endpoint: Endpoint, listed: Option<&str>, root_uri: Option<&str>) -> Vec<String> {
    let listed = listed.unwrap_or_default();
    let dir = listed.trim_end_matches('/');
    match (endpoint, dir.is_empty()) {
        (Endpoint::ArtifactsApi, true) => vec![".".to_owned()],
        (Endpoint::ArtifactsApi, false) => vec![basename(dir).to_owned()],
        (Endpoint::RunArtifacts, true) => {
            let root = root_uri
                .map(|uri| basename(uri.trim_end_matches('/')))
                .filter(|name| !name.is_empty());
            vec![root.unwrap_or("artifacts").to_owned(), ".".to_owned()]
        }
        (Endpoint::RunArtifacts, false) => {
            // Python's `posixpath.join(listed, basename)`, as MLflow builds run-relative paths.
            let separator = if listed.ends_with('/') { "" } else { "/" };
            vec![
                format!("{listed}{separator}{}", basename(dir)),
                dir.to_owned(),
            ]
        }
    }
}

fn basename(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body as MLflow 3.15.2 writes it (`json.dumps(indent=2)`).
    fn mlflow_json(value: serde_json::Value) -> String {
        let parsed: Listing = serde_json::from_value(value).unwrap();
        listing::pretty_string(&parsed)
    }

    #[test]
    fn only_the_four_listing_endpoints_apply() {
        for path in [
            "/api/2.0/mlflow/artifacts/list",
            "/ajax-api/2.0/mlflow/artifacts/list",
            "/api/2.0/mlflow-artifacts/artifacts",
            "/ajax-api/2.0/mlflow-artifacts/artifacts",
        ] {
            assert!(applies(RouteClass::of(path), &Method::GET, path), "{path}");
            assert!(
                !applies(RouteClass::of(path), &Method::POST, path),
                "{path}"
            );
        }
        for path in [
            "/api/2.0/mlflow-artifacts/artifacts/1/run/artifacts/x.json",
            "/api/2.0/mlflow-artifacts/artifacts/x/mlflow-artifacts/artifacts",
            "/api/2.0/mlflow/runs/get",
            "/get-artifact",
            "/static-files/mlflow/artifacts/list",
        ] {
            assert!(!applies(RouteClass::of(path), &Method::GET, path), "{path}");
        }
    }

    #[test]
    fn the_artifacts_api_listing_of_a_run_root_loses_its_own_marker() {
        let body = mlflow_json(serde_json::json!({"files": [
            {"path": "artifacts", "is_dir": false},
            {"path": "dir", "is_dir": true},
            {"path": "empty.txt", "is_dir": false},
        ]}));
        let filtered = drop_markers(
            Endpoint::ArtifactsApi,
            Some("1/abc/artifacts"),
            body.as_bytes(),
        )
        .unwrap();
        assert_eq!(
            filtered,
            "{\n  \"files\": [\n    {\n      \"path\": \"dir\",\n      \"is_dir\": true\n    },\n    {\n      \"path\": \"empty.txt\",\n      \"is_dir\": false\n    }\n  ]\n}"
        );
    }

    #[test]
    fn the_artifacts_api_listing_of_a_subdirectory_keeps_files_and_sizes() {
        let body = mlflow_json(serde_json::json!({"files": [
            {"path": "a.txt", "is_dir": false, "file_size": 6},
            {"path": "dir", "is_dir": false},
            {"path": "other", "is_dir": false},
        ]}));
        let filtered = drop_markers(
            Endpoint::ArtifactsApi,
            Some("1/abc/artifacts/dir/"),
            body.as_bytes(),
        )
        .unwrap();
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&filtered).unwrap(),
            serde_json::json!({"files": [{"path": "a.txt", "is_dir": false, "file_size": 6}, {"path": "other", "is_dir": false}]})
        );
        assert!(
            filtered
                .contains("\"path\": \"a.txt\",\n      \"is_dir\": false,\n      \"file_size\": 6"),
            "{filtered}"
        );
    }

    #[test]
    fn a_listing_that_only_held_the_marker_becomes_empty_as_mlflow_writes_it() {
        let body = mlflow_json(serde_json::json!({"files": [{"path": "dir", "is_dir": false}]}));
        assert_eq!(
            drop_markers(
                Endpoint::ArtifactsApi,
                Some("1/abc/artifacts/dir"),
                body.as_bytes()
            )
            .unwrap(),
            "{}"
        );
        let body = mlflow_json(serde_json::json!({"files": [{"path": ".", "is_dir": false}]}));
        assert_eq!(
            drop_markers(Endpoint::ArtifactsApi, None, body.as_bytes()).unwrap(),
            "{}"
        );
    }

    #[test]
    fn the_run_listing_of_the_root_loses_the_marker_and_keeps_root_uri_first() {
        let body = mlflow_json(serde_json::json!({
            "root_uri": "mlflow-artifacts:/1/abc/artifacts",
            "files": [{"path": "artifacts", "is_dir": false}, {"path": "dir", "is_dir": true}],
        }));
        let filtered = drop_markers(Endpoint::RunArtifacts, None, body.as_bytes()).unwrap();
        assert_eq!(
            filtered,
            "{\n  \"root_uri\": \"mlflow-artifacts:/1/abc/artifacts\",\n  \"files\": [\n    {\n      \"path\": \"dir\",\n      \"is_dir\": true\n    }\n  ]\n}"
        );
        let only_marker = mlflow_json(serde_json::json!({
            "root_uri": "mlflow-artifacts:/1/abc/artifacts",
            "files": [{"path": "artifacts", "is_dir": false}],
        }));
        assert_eq!(
            drop_markers(Endpoint::RunArtifacts, Some(""), only_marker.as_bytes()).unwrap(),
            "{\n  \"root_uri\": \"mlflow-artifacts:/1/abc/artifacts\"\n}"
        );
    }

    #[test]
    fn the_run_listing_of_a_subdirectory_loses_dir_slash_dir_only() {
        let body = mlflow_json(serde_json::json!({
            "root_uri": "mlflow-artifacts:/1/abc/artifacts",
            "files": [
                {"path": "dir/a.txt", "is_dir": false, "file_size": 6},
                {"path": "dir/dir", "is_dir": false},
                {"path": "dir/empty", "is_dir": false},
                {"path": "dir/sub", "is_dir": true},
            ],
        }));
        for listed in ["dir", "dir/"] {
            let filtered =
                drop_markers(Endpoint::RunArtifacts, Some(listed), body.as_bytes()).unwrap();
            let paths: Vec<String> = serde_json::from_str::<Listing>(&filtered)
                .unwrap()
                .files
                .into_iter()
                .map(|f| f.path)
                .collect();
            assert_eq!(paths, ["dir/a.txt", "dir/empty", "dir/sub"], "{listed}");
        }
    }

    #[test]
    fn run_listings_through_the_artifact_repository_lose_their_marker_too() {
        let root = mlflow_json(serde_json::json!({
            "root_uri": "s3://bucket/1/abc/artifacts",
            "files": [{"path": ".", "is_dir": false}, {"path": "dir", "is_dir": true}],
        }));
        let filtered = drop_markers(Endpoint::RunArtifacts, None, root.as_bytes()).unwrap();
        assert!(!filtered.contains("\".\""), "{filtered}");
        let sub = mlflow_json(serde_json::json!({
            "root_uri": "s3://bucket/1/abc/artifacts",
            "files": [{"path": "dir", "is_dir": false}, {"path": "dir/a.txt", "is_dir": false, "file_size": 6}],
        }));
        let filtered = drop_markers(Endpoint::RunArtifacts, Some("dir"), sub.as_bytes()).unwrap();
        assert_eq!(
            serde_json::from_str::<Listing>(&filtered)
                .unwrap()
                .files
                .len(),
            1
        );
    }

    #[test]
    fn directories_non_empty_files_and_listings_without_markers_pass_unchanged() {
        let body = mlflow_json(serde_json::json!({"files": [
            {"path": "dir", "is_dir": true},
            {"path": "a.txt", "is_dir": false, "file_size": 6},
        ]}));
        assert_eq!(
            drop_markers(
                Endpoint::ArtifactsApi,
                Some("1/abc/artifacts/dir"),
                body.as_bytes()
            ),
            None
        );
        let sized = mlflow_json(
            serde_json::json!({"files": [{"path": "dir", "is_dir": false, "file_size": 1}]}),
        );
        assert_eq!(
            drop_markers(
                Endpoint::ArtifactsApi,
                Some("1/abc/artifacts/dir"),
                sized.as_bytes()
            ),
            None
        );
        let run = mlflow_json(
            serde_json::json!({"root_uri": "mlflow-artifacts:/1/abc/artifacts", "files": [{"path": "dir", "is_dir": false}]}),
        );
        assert_eq!(
            drop_markers(Endpoint::RunArtifacts, Some("other"), run.as_bytes()),
            None
        );
        assert_eq!(drop_markers(Endpoint::ArtifactsApi, Some("x"), b"{}"), None);
        assert_eq!(
            drop_markers(Endpoint::ArtifactsApi, Some("x"), b"not json"),
            None
        );
        let unknown = br#"{"files": [{"path": "x", "is_dir": false}], "extra": 1}"#;
        assert_eq!(
            drop_markers(Endpoint::ArtifactsApi, Some("x"), unknown),
            None
        );
    }

    #[test]
    fn non_ascii_names_are_escaped_as_python_escapes_them() {
        let body = r#"{"files": [{"path": "dir", "is_dir": false}, {"path": "bild-ü.png", "is_dir": false, "file_size": 3}]}"#;
        let filtered = drop_markers(Endpoint::ArtifactsApi, Some("dir"), body.as_bytes()).unwrap();
        assert!(
            filtered.contains(r#""path": "bild-\u00fc.png""#),
            "{filtered}"
        );
    }

    #[test]
    fn the_listed_path_is_decoded_as_mlflow_decodes_it() {
        let uri: Uri = "/api/2.0/mlflow-artifacts/artifacts?path=1%2Fabc%2Fartifacts%2Fmy%2520dir&path=ignored".parse().unwrap();
        assert_eq!(listed_path(&uri).as_deref(), Some("1/abc/artifacts/my dir"));
        let no_path: Uri = "/api/2.0/mlflow/artifacts/list?run_id=abc".parse().unwrap();
        assert_eq!(listed_path(&no_path), None);
    }

    fn response(content_type: &str, status: StatusCode, body: &'static str) -> Response {
        Response::builder()
            .status(status)
            .header(header::CONTENT_TYPE, content_type)
            .body(Body::from(body))
            .unwrap()
    }

    async fn body_of(response: Response) -> String {
        String::from_utf8(
            response
                .into_body()
                .collect()
                .await
                .unwrap()
                .to_bytes()
                .to_vec(),
        )
        .unwrap()
    }

    fn upstream() -> Upstream {
        Upstream {
            authority: "127.0.0.1:5000".parse().unwrap(),
            base_path: String::new(),
        }
    }

    const MARKER_LISTING: &str = "{\n  \"files\": [\n    {\n      \"path\": \"dir\",\n      \"is_dir\": false\n    }\n  ]\n}";

    #[tokio::test]
    async fn filtering_a_response_fixes_its_content_length() {
        let uri: Uri = "/ajax-api/2.0/mlflow-artifacts/artifacts?path=1/abc/artifacts/dir"
            .parse()
            .unwrap();
        let mut original = response("application/json", StatusCode::OK, MARKER_LISTING);
        original.headers_mut().insert(
            header::CONTENT_LENGTH,
            HeaderValue::from(MARKER_LISTING.len()),
        );
        let filtered = filter(original, &uri, &upstream()).await.unwrap();
        assert_eq!(filtered.headers()[header::CONTENT_LENGTH], "2");
        assert_eq!(body_of(filtered).await, "{}");
    }

    #[tokio::test]
    async fn non_json_error_and_compressed_responses_pass_through_unchanged() {
        let uri: Uri = "/api/2.0/mlflow-artifacts/artifacts?path=1/abc/artifacts/dir"
            .parse()
            .unwrap();
        for original in [
            response("text/plain", StatusCode::OK, MARKER_LISTING),
            response(
                "application/json",
                StatusCode::INTERNAL_SERVER_ERROR,
                MARKER_LISTING,
            ),
            {
                let mut gzip = response("application/json", StatusCode::OK, MARKER_LISTING);
                gzip.headers_mut()
                    .insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
                gzip
            },
        ] {
            let filtered = filter(original, &uri, &upstream()).await.unwrap();
            assert_eq!(body_of(filtered).await, MARKER_LISTING);
        }
    }

    #[tokio::test]
    async fn a_body_over_the_cap_streams_through_whole() {
        let chunks = (0..3).map(|_| Ok::<_, std::io::Error>(Bytes::from_static(b"0123456789")));
        let body = Body::from_stream(futures_util::stream::iter(chunks));
        match collect_capped(body, 15).await {
            Collected::TooLarge(body) => {
                assert_eq!(body.collect().await.unwrap().to_bytes().len(), 30)
            }
            _ => panic!("expected the body to be over the cap"),
        }
    }
}
