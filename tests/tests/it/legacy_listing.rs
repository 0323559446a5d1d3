//! MLflow 3.15.2 — the last release before the fix — lists zero-byte `key/` directory markers as
//! files. Against a real 3.15.2 server the markers show up; through the proxy (plain forwarding,
//! no artifact gateway) they are gone from both listing endpoints and from what the Python client
//! sees, while real files and directories stay as MLflow lists them.

use std::process::Stdio;
use std::time::Duration;

use mlscope_tests::{legacy_venv, S3Store, StackOptions, TestStack};
use serde_json::{json, Value};
use tokio::process::Command;

use crate::mlflow::{create_run, get_run, http};

/// Prints what the MLflow client lists under `dir` of a run, as `[[path, is_dir, file_size]]`.
const LIST_DIR: &str = r#"
import json, sys
from mlflow.tracking import MlflowClient
files = MlflowClient(tracking_uri=sys.argv[1]).list_artifacts(sys.argv[2], "dir")
print(json.dumps([[f.path, f.is_dir, f.file_size] for f in files]))
"#;

#[tokio::test]
async fn directory_markers_that_mlflow_3_15_lists_as_files_are_hidden_by_the_proxy() {
    let stack = TestStack::start_with_mlflow_from(StackOptions::default(), &legacy_venv())
        .expect("starting a stack with MLflow 3.15.2");
    let mlflow = stack.mlflow.url.as_str();
    let proxy = stack.proxy_url();
    let version = http()
        .get(format!("{mlflow}/version"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        version, "3.15.2",
        "the upstream must be a release that lists directory markers"
    );

    let run_id = create_run(mlflow, "legacy-listing").await;
    let run = get_run(mlflow, &run_id).await;
    let experiment_id = run["run"]["info"]["experiment_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let root_uri = run["run"]["info"]["artifact_uri"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        root_uri,
        format!("mlflow-artifacts:/{experiment_id}/{run_id}/artifacts")
    );
    let root = format!("{experiment_id}/{run_id}/artifacts");

    let upload = http()
        .put(format!(
            "{mlflow}/api/2.0/mlflow-artifacts/artifacts/{root}/dir/a.txt"
        ))
        .body("hello\n")
        .send()
        .await
        .unwrap();
    assert!(
        upload.status().is_success(),
        "uploading dir/a.txt through MLflow: {}",
        upload.status()
    );
    for marker in [format!("{root}/"), format!("{root}/dir/")] {
        let url = format!(
            "{}/{}/{}/{marker}",
            stack.s3.url,
            stack.s3.bucket,
            S3Store::PREFIX
        );
        let put = http()
            .put(&url)
            .header("content-length", "0")
            .send()
            .await
            .unwrap();
        assert!(
            put.status().is_success(),
            "creating the marker {url}: {}",
            put.status()
        );
    }

    // The artifact API's listing (basenames).
    let list_root = format!("/api/2.0/mlflow-artifacts/artifacts?path={root}");
    let list_dir = format!("/api/2.0/mlflow-artifacts/artifacts?path={root}/dir");
    let direct = get(mlflow, &list_root).await;
    assert_eq!(
        direct["files"],
        json!([{"path": "artifacts", "is_dir": false}, {"path": "dir", "is_dir": true}]),
        "MLflow 3.15.2 lists the run root's own marker"
    );
    let filtered = get(proxy, &list_root).await;
    assert_eq!(
        filtered,
        json!({"files": [{"path": "dir", "is_dir": true}]})
    );

    let direct = get(mlflow, &list_dir).await;
    assert_eq!(
        direct["files"],
        json!([{"path": "dir", "is_dir": false}, {"path": "a.txt", "is_dir": false, "file_size": 6}]),
        "MLflow 3.15.2 lists dir/'s own marker (sorted by its key, before dir/a.txt)"
    );
    let filtered = get_text(proxy, &list_dir).await;
    assert_eq!(filtered, "{\n  \"files\": [\n    {\n      \"path\": \"a.txt\",\n      \"is_dir\": false,\n      \"file_size\": 6\n    }\n  ]\n}", "written as MLflow writes it");
    for prefix in ["/ajax-api", "/api"] {
        let path = format!("{prefix}/2.0/mlflow-artifacts/artifacts?path={root}/dir");
        assert_eq!(
            get(proxy, &path).await,
            json!({"files": [{"path": "a.txt", "is_dir": false, "file_size": 6}]}),
            "{path}"
        );
    }

    // The tracking API's run listing (run-relative paths, `root_uri` first), as the UI calls it.
    for prefix in ["/api", "/ajax-api"] {
        let list_root = format!("{prefix}/2.0/mlflow/artifacts/list?run_id={run_id}");
        let direct = get(mlflow, &list_root).await;
        assert_eq!(
            direct["files"],
            json!([{"path": "artifacts", "is_dir": false}, {"path": "dir", "is_dir": true}]),
            "{list_root}"
        );
        let filtered = get_text(proxy, &list_root).await;
        assert_eq!(filtered, format!("{{\n  \"root_uri\": \"{root_uri}\",\n  \"files\": [\n    {{\n      \"path\": \"dir\",\n      \"is_dir\": true\n    }}\n  ]\n}}"));

        let list_dir = format!("{prefix}/2.0/mlflow/artifacts/list?run_id={run_id}&path=dir");
        let direct = get(mlflow, &list_dir).await;
        assert_eq!(
            direct["files"],
            json!([{"path": "dir/dir", "is_dir": false}, {"path": "dir/a.txt", "is_dir": false, "file_size": 6}]),
            "{list_dir}"
        );
        let filtered = get(proxy, &list_dir).await;
        assert_eq!(
            filtered,
            json!({"root_uri": root_uri, "files": [{"path": "dir/a.txt", "is_dir": false, "file_size": 6}]}),
            "{list_dir}"
        );
    }

    // The MLflow 3.15.2 client itself: a bogus `dir/dir` file directly, only `dir/a.txt` through
    // the proxy.
    let direct = list_with_client(mlflow, &run_id).await;
    assert_eq!(
        direct,
        json!([["dir/a.txt", false, 6], ["dir/dir", false, null]])
    );
    let filtered = list_with_client(proxy, &run_id).await;
    assert_eq!(filtered, json!([["dir/a.txt", false, 6]]));
}

/// GETs `base` + `path`, asserts 200 and a Content-Length that matches the body, and returns it.
async fn get_text(base: &str, path: &str) -> String {
    let response = http().get(format!("{base}{path}")).send().await.unwrap();
    let status = response.status();
    let length = response.content_length();
    let body = response.text().await.unwrap();
    println!("GET {base}{path} -> {status}\n{body}");
    assert_eq!(status, 200, "GET {base}{path}: {body}");
    assert_eq!(
        length,
        Some(body.len() as u64),
        "Content-Length of GET {base}{path}"
    );
    body
}

async fn get(base: &str, path: &str) -> Value {
    serde_json::from_str(&get_text(base, path).await).unwrap()
}

/// Runs [`LIST_DIR`] with the Python of the MLflow 3.15.2 environment against `tracking_uri`.
async fn list_with_client(tracking_uri: &str, run_id: &str) -> Value {
    let mut command = Command::new(legacy_venv().join("bin/python"));
    command
        .args(["-c", LIST_DIR, tracking_uri, run_id])
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env_remove("HTTP_PROXY")
        .env_remove("http_proxy")
        .env_remove("MLFLOW_TRACKING_URI")
        // Not the repository, where a local directory could shadow a Python package.
        .current_dir(std::env::temp_dir())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(180), command.output())
        .await
        .expect("the MLflow client finished within 180 s")
        .expect("starting python");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "python failed\n--- stdout\n{stdout}\n--- stderr\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    println!(
        "MlflowClient({tracking_uri}).list_artifacts(run, \"dir\") -> {}",
        stdout.trim()
    );
    serde_json::from_str(stdout.trim().lines().last().unwrap_or_default())
        .expect("a JSON line from the client")
}
