//! The artifact gateway against the real thing: MLflow 3.17.2 serving the same SeaweedFS bucket
//! under the same `--artifacts-destination`, so every answer of the gateway can be compared with
//! MLflow's own, and every object either side writes can be read back through the other.

use std::sync::OnceLock;
use std::time::Duration;

use futures_util::StreamExt;
use mlscope_tests::{eventually, repo_root, spawn_proxy, ProxyProcess, StackOptions, TestStack};
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

use crate::mlflow::{create_experiment_and_run, http, response_json, run_tags};
use crate::objects::{pattern, pending_uploads, sha256, store_keys};
use crate::python_client::{finish, python};

/// One stack for this module: SeaweedFS, MLflow (serving artifacts from the bucket itself) and
/// a proxy whose gateway serves the artifact API from the same bucket.
struct Gateway {
    stack: TestStack,
    proxy: ProxyProcess,
}

fn gateway() -> &'static Gateway {
    static GATEWAY: OnceLock<Gateway> = OnceLock::new();
    GATEWAY.get_or_init(|| {
        let stack = TestStack::start(StackOptions {
            proxy: false,
            ..Default::default()
        })
        .expect("starting the stack");
        let args = stack.s3.gateway_args(&stack.s3.url);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let proxy =
            spawn_proxy(&stack.mlflow.url, &args, stack.dir.path()).expect("starting the gateway");
        Gateway { stack, proxy }
    })
}

impl Gateway {
    fn mlflow(&self) -> &str {
        &self.stack.mlflow.url
    }
    fn proxy(&self) -> &str {
        &self.proxy.url
    }
}

/// A new run; returns `(experiment_id, run_id, run artifact root)`.
async fn new_run(mlflow: &str) -> (String, String, String) {
    let (experiment, run_id) = create_experiment_and_run(mlflow, "artifacts").await;
    let root = format!("{experiment}/{run_id}/artifacts");
    (experiment, run_id, root)
}

fn artifact_url(base: &str, path: &str) -> String {
    format!("{base}/api/2.0/mlflow-artifacts/artifacts/{path}")
}

async fn put(base: &str, path: &str, body: impl Into<reqwest::Body>) -> (StatusCode, String) {
    let response = http()
        .put(artifact_url(base, path))
        .body(body)
        .send()
        .await
        .unwrap();
    (response.status(), response.text().await.unwrap())
}

async fn get_bytes(base: &str, path: &str) -> (StatusCode, Vec<u8>) {
    let response = http().get(artifact_url(base, path)).send().await.unwrap();
    (response.status(), response.bytes().await.unwrap().to_vec())
}

/// The listing's raw bytes and status.
async fn list_raw(base: &str, path: &str) -> (StatusCode, String) {
    let response = http()
        .get(format!("{base}/api/2.0/mlflow-artifacts/artifacts"))
        .query(&[("path", path)])
        .send()
        .await
        .unwrap();
    (response.status(), response.text().await.unwrap())
}

#[tokio::test]
async fn objects_written_by_either_side_read_back_identically_through_the_other() {
    let g = gateway();
    let (_, _, root) = new_run(g.mlflow()).await;
    let through_gateway = pattern(20 << 20, 1); // multipart: above the 8 MiB threshold
    let through_mlflow = pattern(3 << 20, 2);
    let (status, body) = put(
        g.proxy(),
        &format!("{root}/model/weights.bin"),
        through_gateway.clone(),
    )
    .await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, ""),
        "an upload is answered as MLflow answers it: 200, empty"
    );
    let (status, _) = put(
        g.mlflow(),
        &format!("{root}/data/sample.bin"),
        through_mlflow.clone(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = put(g.proxy(), &format!("{root}/empty.txt"), Vec::new()).await;
    assert_eq!(status, StatusCode::OK);

    let (status, back) = get_bytes(g.mlflow(), &format!("{root}/model/weights.bin")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        sha256(&back),
        sha256(&through_gateway),
        "MLflow reads what the gateway wrote"
    );
    let (status, back) = get_bytes(g.proxy(), &format!("{root}/data/sample.bin")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        sha256(&back),
        sha256(&through_mlflow),
        "the gateway reads what MLflow wrote"
    );
    let (status, back) = get_bytes(g.proxy(), &format!("{root}/empty.txt")).await;
    assert_eq!((status, back.len()), (StatusCode::OK, 0));

    // A body of unknown length (chunked) goes multipart too.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = pattern(12 << 20, 3)
        .chunks(1 << 20)
        .map(|c| Ok(c.to_vec()))
        .collect();
    let (status, _) = put(
        g.proxy(),
        &format!("{root}/chunked.bin"),
        reqwest::Body::wrap_stream(futures_util::stream::iter(chunks)),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (_, back) = get_bytes(g.mlflow(), &format!("{root}/chunked.bin")).await;
    assert_eq!(sha256(&back), sha256(&pattern(12 << 20, 3)));

    let response = http()
        .get(artifact_url(
            g.proxy(),
            &format!("{root}/model/weights.bin"),
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.headers()["content-length"],
        (20u64 << 20).to_string().as_str()
    );
    assert_eq!(
        response.headers()["content-type"],
        "application/octet-stream"
    );
    assert_eq!(
        response.headers()["content-disposition"],
        "attachment; filename=weights.bin"
    );
}

#[tokio::test]
async fn listings_match_mlflow_byte_for_byte_and_page_through_thousands_of_objects() {
    let g = gateway();
    let (_, _, root) = new_run(g.mlflow()).await;
    let files = [
        ("a.txt", b"alpha\n".to_vec()),
        ("empty.txt", Vec::new()),
        ("dir/b.json", b"{}".to_vec()),
        ("dir/sub/c.bin", vec![7; 1000]),
        ("spaced name/\u{fc}nicode \u{e9}.txt", b"u".to_vec()),
        ("z/deep/deeper/file", b"z".to_vec()),
    ];
    for (name, body) in &files {
        let (status, _) = put(
            g.proxy(),
            &format!("{root}/{}", urlencode_path(name)),
            body.clone(),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{name}");
    }
    // More than one page of ListObjectsV2 (1000 keys).
    let many = 1100;
    let uploads = futures_util::stream::iter(0..many)
        .map(|i| {
            let url = format!("{root}/many/f{i:05}.txt");
            async move { put(g.proxy(), &url, format!("{i}")).await.0 }
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;
    assert!(uploads.iter().all(|s| *s == StatusCode::OK));

    for path in [
        root.clone(),
        format!("{root}/dir"),
        format!("{root}/dir/sub"),
        format!("{root}/spaced name"),
        format!("{root}/many"),
        format!("{root}/does-not-exist"),
        format!("{root}/a.txt"),
    ] {
        let theirs = list_raw(g.mlflow(), &path).await;
        let ours = list_raw(g.proxy(), &path).await;
        assert_eq!(ours, theirs, "listing of {path}: gateway vs MLflow");
    }
    let (_, many_listing) = list_raw(g.proxy(), &format!("{root}/many")).await;
    let parsed: Value = serde_json::from_str(&many_listing).unwrap();
    assert_eq!(
        parsed["files"].as_array().unwrap().len(),
        many,
        "every object of a 2-page directory is listed"
    );
    let (_, root_listing) = list_raw(g.proxy(), &root).await;
    let parsed: Value = serde_json::from_str(&root_listing).unwrap();
    let empty = parsed["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["path"] == "empty.txt")
        .unwrap();
    assert!(
        empty.get("file_size").is_none(),
        "MLflow leaves file_size out for empty files: {empty}"
    );
}

/// One HTTP/1.1 request with the path exactly as given; returns the status and the body.
async fn raw_request(base: &str, method: &str, path: &str) -> (u16, String) {
    use tokio::io::AsyncReadExt;
    let address = base.trim_start_matches("http://");
    let mut socket = tokio::net::TcpStream::connect(address).await.unwrap();
    let request = format!("{method} {path} HTTP/1.1\r\nHost: {address}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    socket.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    socket.read_to_end(&mut answer).await.unwrap();
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    // A chunked body (MLflow's ASGI server) is reduced to its JSON by taking the braces' span.
    let body = match (body.find('{'), body.rfind('}')) {
        (Some(start), Some(end)) if start <= end => body[start..=end].to_owned(),
        _ => body,
    };
    (status, body)
}

fn urlencode_path(path: &str) -> String {
    path.split('/')
        .map(|s| {
            reqwest::Url::parse(&format!("http://x/{s}"))
                .unwrap()
                .path()[1..]
                .to_owned()
        })
        .collect::<Vec<_>>()
        .join("/")
}

#[tokio::test]
async fn errors_match_mlflow_where_mlflow_answers_sensibly() {
    let g = gateway();
    let (_, _, root) = new_run(g.mlflow()).await;
    let (status, _) = put(g.proxy(), &format!("{root}/dir/file.txt"), "x").await;
    assert_eq!(status, StatusCode::OK);

    // Traversal in any encoding: 400 INVALID_PARAMETER_VALUE "Invalid path", as MLflow. Sent
    // raw: an HTTP client library would normalise `%2e%2e` away before sending.
    for bad in [
        "%2e%2e/%2e%2e/etc/passwd",
        "%252e%252e/secret",
        "a/..%2f..%2fb",
        "C:/windows/x",
        "a/%2E%2E/%2E%2E/%2E%2E/x",
    ] {
        for base in [g.mlflow(), g.proxy()] {
            let (status, body) = raw_request(
                base,
                "GET",
                &format!("/api/2.0/mlflow-artifacts/artifacts/{bad}"),
            )
            .await;
            let body: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
            assert_eq!(status, 400, "{base} GET {bad}: {body}");
            assert_eq!(
                body["error_code"], "INVALID_PARAMETER_VALUE",
                "{base} GET {bad}"
            );
            assert_eq!(body["message"], "Invalid path", "{base} GET {bad}");
        }
        let (status, _) = raw_request(
            g.proxy(),
            "PUT",
            &format!("/api/2.0/mlflow-artifacts/artifacts/{bad}"),
        )
        .await;
        assert_eq!(status, 400, "PUT {bad}");
    }
    for base in [g.mlflow(), g.proxy()] {
        let (status, body) = list_raw(base, "../x").await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{base} list ../x");
        assert_eq!(
            serde_json::from_str::<Value>(&body).unwrap()["message"],
            "Invalid path"
        );
    }

    // A missing file: MLflow 3.17.2 answers 500 INTERNAL_ERROR wrapping the store's 404; the
    // gateway answers what happened, 404 RESOURCE_DOES_NOT_EXIST (the client raises either way).
    let (status, body) = get_bytes(g.mlflow(), &format!("{root}/missing.txt")).await;
    assert_eq!(
        status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "MLflow's answer changed: {}",
        String::from_utf8_lossy(&body)
    );
    let (status, body) = get_bytes(g.proxy(), &format!("{root}/missing.txt")).await;
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        (status, body["error_code"].as_str()),
        (StatusCode::NOT_FOUND, Some("RESOURCE_DOES_NOT_EXIST")),
        "{body}"
    );

    // A directory: MLflow's Flask handler answers 400 (its ASGI route on S3 sends 200 and then
    // breaks off the body); the gateway answers the 400.
    let (status, body) = get_bytes(g.proxy(), &format!("{root}/dir")).await;
    let body: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(
        body["message"],
        format!("Artifact path refers to a directory, not a file: '{root}/dir'")
    );
}

#[tokio::test]
async fn ranged_and_head_downloads_are_served_from_the_store() {
    let g = gateway();
    let (_, _, root) = new_run(g.mlflow()).await;
    let data = pattern(10 << 20, 9);
    put(g.proxy(), &format!("{root}/blob.bin"), data.clone()).await;
    let url = artifact_url(g.proxy(), &format!("{root}/blob.bin"));

    let response = http()
        .get(&url)
        .header("Range", "bytes=5-9")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::PARTIAL_CONTENT);
    assert_eq!(
        response.headers()["content-range"],
        format!("bytes 5-9/{}", 10 << 20).as_str()
    );
    assert_eq!(response.headers()["content-length"], "5");
    assert_eq!(response.bytes().await.unwrap().as_ref(), &data[5..10]);

    let response = http()
        .get(&url)
        .header("Range", "bytes=-4")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::PARTIAL_CONTENT);
    assert_eq!(
        response.bytes().await.unwrap().as_ref(),
        &data[data.len() - 4..]
    );

    let response = http()
        .get(&url)
        .header("Range", format!("bytes={}-", 20 << 20))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::RANGE_NOT_SATISFIABLE);

    let response = http().head(&url).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.headers()["content-length"],
        (10u64 << 20).to_string().as_str()
    );
    assert_eq!(response.headers()["accept-ranges"], "bytes");
}

#[tokio::test]
async fn delete_removes_a_tree_but_not_siblings_that_share_its_prefix() {
    let g = gateway();
    let (_, _, root) = new_run(g.mlflow()).await;
    for name in ["ckpt/a.pt", "ckpt/sub/b.pt", "ckpt-best/c.pt", "ckptx.pt"] {
        put(g.proxy(), &format!("{root}/{name}"), "x").await;
    }
    let response = http()
        .delete(artifact_url(g.proxy(), &format!("{root}/ckpt")))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.text().await.unwrap(), "{}");
    let (_, listing) = list_raw(g.mlflow(), &root).await;
    let names: Vec<String> = serde_json::from_str::<Value>(&listing).unwrap()["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        names,
        ["ckpt-best", "ckptx.pt"],
        "MLflow lists what is left"
    );
}

#[tokio::test]
async fn writes_outside_mlflow_roots_are_refused_with_where_the_file_must_go() {
    let g = gateway();
    let (experiment, run_id, root) = new_run(g.mlflow()).await;
    let (other_experiment, _, _) = new_run(g.mlflow()).await;
    let cases = [
        (
            "checkpoints/my-experiment/epoch_3.pt".to_owned(),
            "outside them".to_owned(),
        ),
        (
            format!("{experiment}/0123456789abcdef0123456789abcdef/artifacts/x.pt"),
            "MLflow has no such run".to_owned(),
        ),
        (
            format!("{other_experiment}/{run_id}/artifacts/x.pt"),
            format!("belongs to experiment {experiment}"),
        ),
        (
            format!("{experiment}/models/m-doesnotexist/artifacts/MLmodel"),
            "MLflow has no such logged model".to_owned(),
        ),
        (
            format!("{experiment}/{run_id}/artifacts"),
            "outside them".to_owned(),
        ),
    ];
    for (path, why) in &cases {
        let (status, body) = put(g.proxy(), path, "weights").await;
        let body: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
        assert_eq!(status, StatusCode::FORBIDDEN, "PUT {path}: {body}");
        assert_eq!(body["error_code"], "PERMISSION_DENIED");
        let message = body["message"].as_str().unwrap();
        assert!(message.contains(why.as_str()), "PUT {path}: {message}");
        assert!(
            message.contains("<experiment_id>/<run_id>/artifacts"),
            "the message says where files go: {message}"
        );
        assert!(
            store_keys(&g.stack.s3, &format!("artifacts/{path}"))
                .await
                .is_empty(),
            "nothing stored for {path}"
        );
    }
    let create = http()
        .post(format!(
            "{}/api/2.0/mlflow-artifacts/mpu/create/checkpoints/my-experiment",
            g.proxy()
        ))
        .json(&json!({"path": "/tmp/epoch_3.pt", "num_parts": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        create.status(),
        StatusCode::FORBIDDEN,
        "multipart uploads follow the same policy"
    );
    let (status, _) = put(
        g.proxy(),
        &format!("{root}/checkpoints/epoch_3.pt"),
        "weights",
    )
    .await;
    assert_eq!(status, StatusCode::OK, "inside the run it is accepted");

    // warn: accepted and counted; off: accepted.
    let metrics_before = policy_violations(&g.proxy).await;
    assert!(
        metrics_before > cases.len() as u64,
        "violations are counted: {metrics_before}"
    );
    for policy in ["warn", "off"] {
        let args: Vec<String> = g
            .stack
            .s3
            .gateway_args(&g.stack.s3.url)
            .into_iter()
            .chain(["--artifact-write-policy".into(), policy.into()])
            .collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let lenient = spawn_proxy(g.mlflow(), &args, g.stack.dir.path()).unwrap();
        let path = format!("checkpoints/{policy}/epoch_3.pt");
        let (status, _) = put(&lenient.url, &path, "weights").await;
        assert_eq!(status, StatusCode::OK, "policy {policy}");
        assert_eq!(
            store_keys(&g.stack.s3, &format!("artifacts/{path}"))
                .await
                .len(),
            1
        );
    }
}

async fn policy_violations(proxy: &ProxyProcess) -> u64 {
    let text = http()
        .get(format!("{}/metrics", proxy.admin_url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find(|l| l.starts_with("mlscope_artifact_policy_violations_total "))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn a_client_that_disconnects_mid_upload_leaves_no_object_and_no_multipart_upload() {
    let g = gateway();
    let (_, _, root) = new_run(g.mlflow()).await;
    let path = format!("{root}/interrupted.bin");
    let address = g.proxy().trim_start_matches("http://").to_owned();
    let mut socket = tokio::net::TcpStream::connect(&address).await.unwrap();
    let head = format!(
        "PUT /api/2.0/mlflow-artifacts/artifacts/{path} HTTP/1.1\r\nHost: {address}\r\nContent-Length: {}\r\n\r\n",
        200u64 << 20
    );
    socket.write_all(head.as_bytes()).await.unwrap();
    let chunk = pattern(1 << 20, 4);
    for _ in 0..30 {
        socket.write_all(&chunk).await.unwrap();
    }
    // 30 MiB in: parts go to the store. Then the client goes away.
    eventually(
        Duration::from_secs(30),
        "the upload under way as a multipart upload",
        async || {
            let pending = pending_uploads(&g.stack.s3, &format!("artifacts/{path}")).await;
            if pending.is_empty() {
                Err("no multipart upload".to_owned())
            } else {
                Ok(())
            }
        },
    )
    .await;
    drop(socket);

    eventually(
        Duration::from_secs(30),
        "no multipart upload left behind",
        async || match pending_uploads(&g.stack.s3, &format!("artifacts/{path}")).await {
            left if left.is_empty() => Ok(()),
            left => Err(format!("{left:?}")),
        },
    )
    .await;
    assert!(
        store_keys(&g.stack.s3, &format!("artifacts/{path}"))
            .await
            .is_empty(),
        "no partial object"
    );
}

#[tokio::test]
async fn an_upload_the_store_refuses_is_answered_503_and_recorded_on_the_run() {
    let g = gateway();
    let (_, run_id, root) = new_run(g.mlflow()).await;
    // A store that cannot be reached: the endpoint's port has no listener.
    let dead = format!("http://127.0.0.1:{}", mlscope_tests::free_port());
    let args = g.stack.s3.gateway_args(&dead);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let proxy = spawn_proxy(g.mlflow(), &args, g.stack.dir.path()).unwrap();
    let ready = http()
        .get(format!("{}/readyz", proxy.admin_url))
        .send()
        .await
        .unwrap();
    assert_eq!(
        ready.status(),
        StatusCode::SERVICE_UNAVAILABLE,
        "not ready without its artifact store"
    );
    let ready: Value = ready.json().await.unwrap();
    assert_eq!(ready["artifact_store"]["ok"], false, "{ready}");
    let ready: Value = http()
        .get(format!("{}/readyz", g.proxy.admin_url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ready["artifact_store"]["ok"], true, "{ready}");
    for attempt in 1..=2 {
        let (status, body) = put(
            &proxy.url,
            &format!("{root}/plots/loss_{attempt}.png"),
            "png",
        )
        .await;
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        assert_eq!(body["error_code"], "TEMPORARILY_UNAVAILABLE");
        assert!(
            body["message"]
                .as_str()
                .unwrap()
                .contains(&format!("{root}/plots/loss_{attempt}.png")),
            "{body}"
        );
    }
    let tags = run_tags(g.mlflow(), &run_id).await;
    assert_eq!(
        tags.get("mlscope.artifacts.upload_failures")
            .map(String::as_str),
        Some("2"),
        "{tags:?}"
    );
    assert_eq!(
        tags.get("mlscope.artifacts.last_failed_path"),
        Some(&format!("{root}/plots/loss_2.png"))
    );
    assert!(tags
        .get("mlscope.artifacts.last_upload_error")
        .is_some_and(|e| !e.is_empty()));
}

#[tokio::test]
async fn the_python_client_logs_lists_downloads_and_uploads_600_mib_in_parts_through_the_gateway() {
    let g = gateway();
    let script = repo_root().join("tests/python/artifacts_e2e.py");
    let child = python(g.proxy(), &[])
        .arg(&script)
        .spawn()
        .expect("starting python");
    let (ok, stdout, stderr) = finish(child, Duration::from_secs(900)).await;
    assert!(
        ok,
        "{} failed\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        script.display()
    );
    let metrics = http()
        .get(format!("{}/metrics", g.proxy.admin_url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for op in ["mpu_create", "mpu_complete", "upload", "list"] {
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with("mlscope_artifact_requests_total{")
                    && l.contains(&format!("op=\"{op}\""))
                    && l.contains("status=\"200\"")),
            "the gateway served {op}:\n{metrics}"
        );
    }
}

/// MLflow's multipart protocol, run the same way against MLflow and against the gateway: the
/// answers have the same shape, the presigned part URLs carry no checksum parameters, and the
/// object assembled from the parts is the file.
#[tokio::test]
async fn multipart_uploads_and_presigned_downloads_answer_like_mlflow() {
    let g = gateway();
    let (_, _, root) = new_run(g.mlflow()).await;
    let parts = [pattern(5 << 20, 11), pattern(1 << 20, 12)];
    let whole: Vec<u8> = parts.concat();
    for (side, base) in [("mlflow", g.mlflow()), ("gateway", g.proxy())] {
        let dir = format!("{root}/{side}");
        let mpu = |action: &str| format!("{base}/api/2.0/mlflow-artifacts/mpu/{action}/{dir}");
        let create = response_json(
            http()
                .post(mpu("create"))
                .json(&json!({"path": "/home/user/ckpt/epoch_3.pt", "num_parts": 2})),
        )
        .await;
        let keys: Vec<&String> = create.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["credentials", "upload_id"], "{side}: {create}");
        let credentials = create["credentials"].as_array().unwrap();
        assert_eq!(credentials.len(), 2, "{side}");
        let mut etags = Vec::new();
        for (credential, data) in credentials.iter().zip(&parts) {
            let url = credential["url"].as_str().unwrap();
            assert!(
                !url.to_ascii_lowercase().contains("checksum"),
                "{side}: presigned URL with a checksum parameter: {url}"
            );
            let response = reqwest::Client::new()
                .put(url)
                .body(data.clone())
                .send()
                .await
                .unwrap();
            assert!(
                response.status().is_success(),
                "{side}: part PUT {}",
                response.status()
            );
            etags.push(json!({"part_number": credential["part_number"], "etag": response.headers()["etag"].to_str().unwrap()}));
        }
        let done = json!({"path": "/home/user/ckpt/epoch_3.pt", "upload_id": create["upload_id"], "parts": etags});
        let complete = http()
            .post(mpu("complete"))
            .json(&done)
            .send()
            .await
            .unwrap();
        assert_eq!(complete.status(), StatusCode::OK, "{side}");
        assert_eq!(complete.json::<Value>().await.unwrap(), json!({}), "{side}");

        let (_, back) = get_bytes(g.mlflow(), &format!("{dir}/epoch_3.pt")).await;
        assert_eq!(
            sha256(&back),
            sha256(&whole),
            "{side}: the parts make the file"
        );

        let presigned = response_json(http().get(format!(
            "{base}/api/2.0/mlflow-artifacts/presigned/{dir}/epoch_3.pt"
        )))
        .await;
        assert_eq!(presigned["file_size"], whole.len(), "{side}: {presigned}");
        assert_eq!(presigned["headers"], json!({}), "{side}");
        let direct = reqwest::Client::new()
            .get(presigned["url"].as_str().unwrap())
            .send()
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        assert_eq!(
            sha256(&direct),
            sha256(&whole),
            "{side}: the presigned URL downloads the file"
        );

        let create = response_json(
            http()
                .post(mpu("create"))
                .json(&json!({"path": "abandoned.bin", "num_parts": 1})),
        )
        .await;
        let abort = http()
            .post(mpu("abort"))
            .json(&json!({"path": "abandoned.bin", "upload_id": create["upload_id"]}))
            .send()
            .await
            .unwrap();
        assert_eq!(abort.status(), StatusCode::OK, "{side}");
        assert!(
            pending_uploads(&g.stack.s3, &format!("artifacts/{dir}/abandoned.bin"))
                .await
                .is_empty(),
            "{side}: aborted"
        );
    }
}

/// `--body-idle-timeout` bounds pauses, not durations: an upload that trickles in for several
/// times the timeout is stored; one that stops is answered 408 and leaves nothing behind.
#[tokio::test]
async fn slow_uploads_that_keep_moving_are_stored_and_stalled_ones_are_cut() {
    use tokio::io::AsyncReadExt;
    let g = gateway();
    let (_, _, root) = new_run(g.mlflow()).await;
    let args: Vec<String> = g
        .stack
        .s3
        .gateway_args(&g.stack.s3.url)
        .into_iter()
        .chain(["--body-idle-timeout".into(), "2s".into()])
        .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let proxy = spawn_proxy(g.mlflow(), &args, g.stack.dir.path()).unwrap();

    let data = pattern(10 << 20, 21);
    let chunks: Vec<Vec<u8>> = data.chunks(1 << 20).map(<[u8]>::to_vec).collect();
    let slow = futures_util::stream::iter(chunks).then(|chunk| async move {
        tokio::time::sleep(Duration::from_millis(700)).await;
        Ok::<_, std::io::Error>(chunk)
    });
    // Ten chunks, each after 0.7 s: the body takes at least 7 s, three and a half idle timeouts.
    let (status, _) = put(
        &proxy.url,
        &format!("{root}/slow.bin"),
        reqwest::Body::wrap_stream(slow),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let (_, back) = get_bytes(g.mlflow(), &format!("{root}/slow.bin")).await;
    assert_eq!(sha256(&back), sha256(&data));

    let path = format!("{root}/stalled.bin");
    let address = proxy.url.trim_start_matches("http://").to_owned();
    let mut socket = tokio::net::TcpStream::connect(&address).await.unwrap();
    let head = format!("PUT /api/2.0/mlflow-artifacts/artifacts/{path} HTTP/1.1\r\nHost: {address}\r\nContent-Length: {}\r\n\r\n", 20u64 << 20);
    socket.write_all(head.as_bytes()).await.unwrap();
    for _ in 0..10 {
        socket.write_all(&pattern(1 << 20, 22)).await.unwrap();
    }
    let mut answer = vec![0u8; 4096];
    let read = tokio::time::timeout(Duration::from_secs(30), socket.read(&mut answer))
        .await
        .expect("an answer after the stall")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..read]).into_owned();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("stalled for more than 2s"), "{answer}");
    drop(socket);
    eventually(
        Duration::from_secs(30),
        "no multipart upload left behind",
        async || match pending_uploads(&g.stack.s3, &format!("artifacts/{path}")).await {
            left if left.is_empty() => Ok(()),
            left => Err(format!("{left:?}")),
        },
    )
    .await;
    assert!(store_keys(&g.stack.s3, &format!("artifacts/{path}"))
        .await
        .is_empty());
}

/// What `mlflow.log_image(..., synchronous=False)` does when the store fails: the client queues
/// the upload and never reports the error to the training code. The failure still shows on the
/// run, because the gateway tags it.
#[tokio::test]
async fn an_asynchronous_image_upload_that_fails_still_leaves_its_trace_on_the_run() {
    let g = gateway();
    let dead = format!("http://127.0.0.1:{}", mlscope_tests::free_port());
    let args = g.stack.s3.gateway_args(&dead);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let proxy = spawn_proxy(g.mlflow(), &args, g.stack.dir.path()).unwrap();
    let script = r#"
import mlflow, numpy
with mlflow.start_run() as run:
    print("run", run.info.run_id, flush=True)
    mlflow.log_image(numpy.zeros((8, 8, 3), dtype=numpy.uint8), key="sample", step=0, synchronous=False)
print("the training code saw no error", flush=True)
"#;
    let child = python(&proxy.url, &[("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")])
        .args(["-c", script])
        .spawn()
        .unwrap();
    let (ok, stdout, stderr) = finish(child, Duration::from_secs(300)).await;
    assert!(
        ok && stdout.contains("the training code saw no error"),
        "--- stdout\n{stdout}\n--- stderr\n{stderr}"
    );
    let run_id = stdout
        .lines()
        .find_map(|l| l.strip_prefix("run "))
        .expect("the script printed its run id")
        .trim()
        .to_owned();
    let tags = run_tags(g.mlflow(), &run_id).await;
    let failures: u32 = tags
        .get("mlscope.artifacts.upload_failures")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(
        failures >= 1,
        "the failed image upload is counted on the run: {tags:?}\n--- stderr\n{stderr}"
    );
    assert!(
        tags.get("mlscope.artifacts.last_failed_path")
            .is_some_and(|p| p.contains("/artifacts/images/")),
        "{tags:?}"
    );
}

/// Logged models and traces write under their own roots (`<exp>/models/<id>/artifacts`,
/// `<exp>/traces/<id>/artifacts`): the write policy finds them in MLflow and lets them through.
///
/// The traced function returns an attachment, which the client always uploads to the trace's
/// artifact root. The trace's spans may not be: MLflow 3.17's client sends them to the tracking
/// store and the trace's record on two tasks of its own, and uploads them as a file only when the
/// record gets there first.
#[tokio::test]
async fn logged_models_and_traces_write_through_the_enforcing_gateway() {
    let g = gateway();
    let script = r#"
import mlflow
from mlflow.pyfunc import PythonModel
from mlflow.tracing.attachments import Attachment

class Echo(PythonModel):
    def predict(self, context, model_input):
        return model_input

@mlflow.trace
def add(a, b):
    return Attachment(content_type="text/plain", content_bytes=str(a + b).encode())

mlflow.set_experiment("models-and-traces")
with mlflow.start_run():
    info = mlflow.pyfunc.log_model(name="echo", python_model=Echo(), pip_requirements=[])
    add(1, 2)
print("model", info.model_id, info.artifact_path, flush=True)
client = mlflow.MlflowClient()
files = [f.path for f in client.list_logged_model_artifacts(info.model_id)]
print("files", sorted(files), flush=True)
assert "MLmodel" in files, files
loaded = mlflow.pyfunc.load_model(info.model_uri)
assert list(loaded.predict([1, 2])) == [1, 2]
mlflow.flush_trace_async_logging()
trace = mlflow.get_trace(mlflow.get_last_active_trace_id())
assert trace.data.spans[0].name == "add", trace
print("ok", flush=True)
"#;
    // `load_model` downloads the model into a directory of its own that MLflow keeps for the
    // loaded model's lifetime and never removes: it goes into one the test removes.
    let scratch = tempfile::tempdir().unwrap();
    // The gateway is shared with the other artifact tests, from the same address: while the
    // 600 MiB upload holds most of its upload slots, a file of this client's may be answered
    // 429 "retry with backoff", and the client retries as MLflow's client does by default.
    let child = python(
        g.proxy(),
        &[
            ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "5"),
            ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1"),
            ("TMPDIR", scratch.path().to_str().unwrap()),
        ],
    )
    .args(["-c", script])
    .spawn()
    .unwrap();
    let (ok, stdout, stderr) = finish(child, Duration::from_secs(300)).await;
    assert!(
        ok && stdout.contains("ok"),
        "--- stdout\n{stdout}\n--- stderr\n{stderr}"
    );
    // The proxy's JSON request log: both kinds of write were answered 200 from the store. The
    // trace's attachment is uploaded as the client exits, and its line may be written just
    // after: the log is read again until both lines are there.
    let stored = |log: &str, root: &str| {
        log.lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .any(|line| {
                line["answered_by"] == "artifact_store"
                    && line["status"] == 200
                    && line["span"]["method"] == "PUT"
                    && line["span"]["path"]
                        .as_str()
                        .is_some_and(|p| p.contains(root))
            })
    };
    eventually(
        Duration::from_secs(30),
        "a logged-model file and a trace file stored through the gateway",
        async || {
            let log = std::fs::read_to_string(&g.proxy.log_path).unwrap();
            match (stored(&log, "/models/m-"), stored(&log, "/traces/tr-")) {
                (true, true) => Ok(()),
                (model, trace) => Err(format!(
                    "logged-model file stored: {model}, trace file stored: {trace}\n{stderr}"
                )),
            }
        },
    )
    .await;
}
