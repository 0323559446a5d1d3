//! The real MLflow Python client against the proxy: a full run round trip, and the client's own
//! retries carrying it over an upstream that comes up late.

use std::process::Stdio;
use std::time::Duration;

use mlscope_tests::{eventually, free_port, repo_root, spawn_proxy, venv, TestStack};
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};
use tokio::time::timeout;

use crate::mlflow::scrape;

/// Asks for experiments once the client is imported, and prints how long the call took.
const SEARCH_WITH_RETRIES: &str = r#"
import time
from mlflow.tracking import MlflowClient
client = MlflowClient()
print("requesting", flush=True)
started = time.monotonic()
client.search_experiments(max_results=1)
print(f"succeeded after {time.monotonic() - started:.1f} s", flush=True)
"#;

#[tokio::test]
async fn the_mlflow_python_client_round_trips_a_run_through_the_proxy() {
    let stack = TestStack::shared();
    let script = repo_root().join("tests/python/client_e2e.py");
    let child = python(stack.proxy_url(), &[])
        .arg(&script)
        .spawn()
        .expect("starting python");
    let (status, stdout, stderr) = finish(child, Duration::from_secs(600)).await;
    assert!(
        status,
        "{} failed\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        script.display()
    );
}

#[tokio::test]
async fn a_proxy_whose_upstream_is_down_answers_502_temporarily_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let silent = format!("http://127.0.0.1:{}", free_port());
    let proxy = spawn_proxy(&silent, &[], dir.path()).expect("starting the proxy");

    let response = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .get(format!(
            "{}/api/2.0/mlflow/experiments/search?max_results=1",
            proxy.url
        ))
        .send()
        .await
        .expect("the proxy answers although its upstream does not");

    assert_eq!(response.status().as_u16(), 502);
    let body: Value = response.json().await.expect("a JSON error body");
    assert_eq!(
        body["error_code"], "TEMPORARILY_UNAVAILABLE",
        "body: {body}"
    );
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|message| !message.is_empty()),
        "the MLflow client shows `message` to the user; body: {body}"
    );
}

#[tokio::test]
async fn the_python_client_retries_through_the_proxy_until_a_late_upstream_answers() {
    let stack = TestStack::shared();
    let dir = tempfile::tempdir().unwrap();
    let late_port = free_port();
    let proxy = spawn_proxy(&format!("http://127.0.0.1:{late_port}"), &[], dir.path())
        .expect("starting the proxy");

    // urllib3 waits 0, 2, 4, 8, 16 s (+ up to 1 s jitter) between attempts: about 30 s in all.
    let retries = [
        ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "5"),
        ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1"),
    ];
    let mut child = python(&proxy.url, &retries)
        .args(["-c", SEARCH_WITH_RETRIES])
        .spawn()
        .expect("starting python");
    let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
    let started = timeout(Duration::from_secs(60), stdout.next_line()).await;
    assert!(
        matches!(started, Ok(Ok(Some(ref line))) if line == "requesting"),
        "the snippet did not get to its request: {started:?}"
    );

    // The upstream comes up once the client was refused twice: urllib3 retries the first refusal
    // at once, so the attempt that gets through is a retry that waited (2 s or more).
    eventually(
        Duration::from_secs(60),
        "two of the client's attempts answered 5xx by the proxy",
        async || {
            let metrics = scrape(&proxy.admin_url).await;
            let refused: f64 = metrics
                .lines()
                .filter(|l| {
                    l.starts_with("mlscope_http_requests_total{") && l.contains(r#"status="5"#)
                })
                .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
                .sum();
            if refused >= 2.0 {
                Ok(())
            } else {
                Err(format!("{refused} answered 5xx:\n{metrics}"))
            }
        },
    )
    .await;
    let relay = tokio::spawn(relay(late_port, stack.mlflow.url.clone()));

    let outcome = timeout(Duration::from_secs(90), stdout.next_line()).await;
    let (status, _, stderr) = finish(child, Duration::from_secs(10)).await;
    relay.abort();
    assert!(
        status,
        "the client gave up: {outcome:?}\n--- stderr\n{stderr}"
    );
    let line = outcome
        .ok()
        .and_then(Result::ok)
        .flatten()
        .unwrap_or_default();
    let seconds: f64 = line
        .strip_prefix("succeeded after ")
        .and_then(|rest| rest.strip_suffix(" s"))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("unexpected output {line:?}"));
    assert!(
        seconds >= 2.0,
        "the call succeeded after {seconds} s, so it never needed a retry"
    );
}

/// The venv's Python with `MLFLOW_TRACKING_URI` set and piped output, never through an HTTP
/// proxy from the environment.
pub(crate) fn python(tracking_uri: &str, envs: &[(&str, &str)]) -> Command {
    let mut command = Command::new(venv().join("bin/python"));
    command
        .env("MLFLOW_TRACKING_URI", tracking_uri)
        .env("NO_PROXY", "127.0.0.1,localhost")
        .envs(envs.iter().copied())
        .env_remove("HTTP_PROXY")
        .env_remove("http_proxy")
        .env_remove("HTTPS_PROXY")
        .env_remove("https_proxy")
        // Not the repository, where a local directory could shadow a Python package.
        .current_dir(std::env::temp_dir())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    command
}

/// Waits for `child`, killing it after `limit`, and returns success, stdout and stderr.
pub(crate) async fn finish(child: Child, limit: Duration) -> (bool, String, String) {
    match timeout(limit, child.wait_with_output()).await {
        Ok(Ok(output)) => (
            output.status.success(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        ),
        Ok(Err(error)) => (false, String::new(), format!("waiting for python: {error}")),
        Err(_) => (false, String::new(), format!("killed after {limit:?}")),
    }
}

/// Relays every connection on `port` to `upstream`, standing in for an MLflow that starts late.
async fn relay(port: u16, upstream: String) {
    let listener = TcpListener::bind(("127.0.0.1", port))
        .await
        .expect("binding the late upstream's port");
    let target = upstream.trim_start_matches("http://").to_owned();
    loop {
        let Ok((mut inbound, _)) = listener.accept().await else {
            continue;
        };
        let target = target.clone();
        tokio::spawn(async move {
            if let Ok(mut outbound) = TcpStream::connect(&target).await {
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            }
        });
    }
}

/// Runs the Python `script` against MLflow straight and through the shared stack's proxy (with
/// `SUFFIX`, its own `TMPDIR` and `env`), and returns what each printed last as JSON, after
/// checking that both printed the same.
async fn straight_and_through(script: &str, env: &[(&str, &str)], limit: Duration) -> Vec<Value> {
    let stack = TestStack::shared();
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let mut results = Vec::new();
    for (target, url) in [
        ("direct", stack.mlflow.url.clone()),
        ("through", stack.proxy_url().to_owned()),
    ] {
        let scratch = tempfile::tempdir().unwrap();
        let suffix = format!("{target}-{suffix}");
        let mut vars = vec![
            ("SUFFIX", suffix.as_str()),
            ("TMPDIR", scratch.path().to_str().unwrap()),
        ];
        vars.extend_from_slice(env);
        let child = python(&url, &vars)
            .arg(repo_root().join(script))
            .spawn()
            .unwrap();
        let (ok, stdout, stderr) = finish(child, limit).await;
        assert!(ok, "{target}\n--- stdout\n{stdout}\n--- stderr\n{stderr}");
        let stored: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default())
            .unwrap_or_else(|e| panic!("{target}: {e}: {stdout}"));
        results.push(stored);
    }
    assert_eq!(
        results[1], results[0],
        "through the proxy (left) and straight to MLflow (right)"
    );
    results
}

/// MLflow 3's client surface: metrics with `model_id` and a dataset, asynchronous logging, logged
/// models and traces store the same through the proxy as straight to MLflow (each run read back
/// from MLflow itself).
#[tokio::test]
async fn mlflow3_client_surface_stores_the_same_through_the_proxy_as_directly() {
    let results = straight_and_through(
        "tests/python/mlflow3_surface.py",
        &[("MLFLOW_ENABLE_ASYNC_LOGGING", "true")],
        Duration::from_secs(300),
    )
    .await;
    let direct = &results[0];
    assert_eq!(direct["train_loss_count"], 200, "{direct}");
    assert!(
        direct["logged_model_metrics"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m[0] == "eval_loss" && m[3] == "train-set" && m[4] == true),
        "metrics logged with model_id and a dataset reach the logged model: {direct}"
    );
    assert_eq!(
        direct["traces"].as_array().map(Vec::len),
        Some(3),
        "{direct}"
    );
}

/// OpenTelemetry's OTLP export to MLflow (`POST /v1/traces`): protobuf gzip-compressed and JSON
/// are stored through the proxy exactly as straight to MLflow (spans, attributes, events, read
/// back with the MLflow client), and MLflow's own answers to malformed exports (not gzip, no
/// spans) reach the client unchanged.
#[tokio::test]
async fn otlp_trace_exports_store_the_same_through_the_proxy_as_directly() {
    let results =
        straight_and_through("tests/python/otlp_traces.py", &[], Duration::from_secs(120)).await;
    let direct = &results[0];
    for (export, status) in [
        ("protobuf, gzip", 200),
        ("json", 200),
        ("not gzip", 400),
        ("no spans", 400),
    ] {
        assert_eq!(
            direct["answers"][export]["status"], status,
            "{export}: {direct}"
        );
    }
    let spans: Vec<usize> = direct["traces"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["spans"].as_array().unwrap().len())
        .collect();
    assert_eq!(spans, [1, 3], "{direct}");
}
