//! The production gateway, `deploy/nginx/mlscope-gateway.conf`, run by the real nginx in front of
//! two mlscope-proxy replicas serving artifacts from SeaweedFS: a 2 MiB and a 1 GiB artifact go
//! up and come back byte for byte through nginx → proxy → store, and nginx writes no body to its
//! temporary paths on the way.

use std::path::Path;

use futures_util::StreamExt;
use mlscope_tests::{spawn_proxy, Nginx, S3Store, StackOptions, TestStack};
use sha2::{Digest, Sha256};

use crate::mlflow::{create_experiment_and_run, http};
use crate::objects::{pattern, sha256, store_objects};

/// Bytes under `dir` in regular files (nginx's temporary directories).
fn bytes_under(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(Result::ok)
        .map(|e| {
            let path = e.path();
            if path.is_dir() {
                bytes_under(&path)
            } else {
                e.metadata().map_or(0, |m| m.len())
            }
        })
        .sum()
}

fn artifact_url(base: &str, path: &str) -> String {
    format!("{base}/api/2.0/mlflow-artifacts/artifacts/{path}")
}

/// Uploads `size` bytes of a repeated 1 MiB pattern as a stream (never whole in memory) and
/// returns their SHA-256.
async fn upload_stream(base: &str, path: &str, size: u64) -> String {
    let chunk = bytes::Bytes::from(pattern(1 << 20, size));
    let mut hash = Sha256::new();
    let chunks = size / (1 << 20);
    for _ in 0..chunks {
        hash.update(&chunk);
    }
    let stream = futures_util::stream::iter(
        (0..chunks).map(move |_| Ok::<_, std::io::Error>(chunk.clone())),
    );
    let response = http()
        .put(artifact_url(base, path))
        .header(reqwest::header::CONTENT_LENGTH, size)
        .body(reqwest::Body::wrap_stream(stream))
        .timeout(std::time::Duration::from_secs(900))
        .send()
        .await
        .unwrap();
    let status = response.status();
    assert_eq!(status, 200, "{path}: {}", response.text().await.unwrap());
    format!("{:x}", hash.finalize())
}

/// Downloads as a stream; returns (length, SHA-256).
async fn download_stream(base: &str, path: &str) -> (u64, String) {
    let response = http()
        .get(artifact_url(base, path))
        .timeout(std::time::Duration::from_secs(900))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200, "{path}");
    let mut hash = Sha256::new();
    let mut length = 0u64;
    let mut body = response.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.unwrap();
        length += chunk.len() as u64;
        hash.update(&chunk);
    }
    (length, format!("{:x}", hash.finalize()))
}

#[tokio::test(flavor = "multi_thread")]
async fn two_mib_and_one_gib_artifacts_round_trip_through_the_shipped_gateway_config_without_temp_files(
) {
    let stack = TestStack::start(StackOptions {
        proxy: false,
        ..Default::default()
    })
    .unwrap();
    let args = stack.s3.gateway_args(&stack.s3.url);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let replicas = [
        spawn_proxy(&stack.mlflow.url, &args, stack.dir.path()).unwrap(),
        spawn_proxy(&stack.mlflow.url, &args, stack.dir.path()).unwrap(),
    ];
    let urls: Vec<&str> = replicas.iter().map(|r| r.url.as_str()).collect();
    let gateway = Nginx::start_gateway(&urls, stack.dir.path()).unwrap();
    let (experiment, run_id) = create_experiment_and_run(&stack.mlflow.url, "gateway").await;
    let root = format!("{experiment}/{run_id}/artifacts");

    // 2 MiB: nginx's default 1 MiB body limit once rejected this with 413.
    let small = pattern(2 << 20, 7);
    let path = format!("{root}/model/weights.bin");
    let response = http()
        .put(artifact_url(&gateway.url, &path))
        .body(small.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let (length, hash) = download_stream(&gateway.url, &path).await;
    assert_eq!((length, hash), (small.len() as u64, sha256(&small)));

    // 1 GiB, streamed both ways.
    let size = 1u64 << 30;
    let path = format!("{root}/checkpoints/step-1000.pt");
    let sent = upload_stream(&gateway.url, &path, size).await;
    let (length, received) = download_stream(&gateway.url, &path).await;
    assert_eq!((length, received), (size, sent));
    // One object in the store, where MLflow keeps the run's artifacts, of the whole size.
    let stored = store_objects(&stack.s3, &format!("{}/{path}", S3Store::PREFIX)).await;
    assert_eq!(stored.len(), 1, "{stored:?}");
    assert_eq!(stored[0].1, size);

    // Streamed, not spooled: nothing in nginx's temporary paths, no "buffered to a temporary
    // file" in its log.
    for temp in ["client_body_temp", "proxy_temp"] {
        assert_eq!(
            bytes_under(&gateway.prefix.join(temp)),
            0,
            "nginx wrote bodies to {temp}"
        );
    }
    let log = std::fs::read_to_string(gateway.prefix.join("error.log")).unwrap_or_default();
    assert!(!log.contains("temporary file"), "{log}");
    // Both requests carried the gateway's request id header to the replicas' logs.
    let access = std::fs::read_to_string(gateway.prefix.join("access.log")).unwrap();
    assert!(
        access.lines().filter(|l| l.contains("rid=")).count() >= 4,
        "{access}"
    );
}
