//! Faults with real processes: MLflow, SeaweedFS and a private PostgreSQL (the proxy's shared
//! state) are killed mid-traffic and restarted. While each is gone the proxy answers MLflow's
//! error JSON with a retryable 5xx; it recovers without a restart; and the MLflow Python client,
//! with MLflow's own retry settings, loses nothing: every metric step and every object is counted.

use std::time::Duration;

use mlscope_tests::{
    eventually, free_port, repo_root, spawn_proxy, MlflowServer, PrivatePostgres, ProxyProcess,
    S3Store,
};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::ChildStdout;

use crate::mlflow::{create_run, history, http, now_ms, scrape};
use crate::python_client::python;

const STEPS: i64 = 60;
const ARTIFACT_EVERY: i64 = 5;

/// Reads the client's output until it reports `step` (or `done`); returns the lines read.
async fn until_step(lines: &mut Lines<BufReader<ChildStdout>>, step: i64) -> Vec<String> {
    let mut seen = Vec::new();
    let wait = async {
        while let Some(line) = lines.next_line().await.unwrap() {
            let reached = line == "done"
                || line
                    .strip_prefix("step ")
                    .and_then(|n| n.parse::<i64>().ok())
                    .is_some_and(|n| n >= step);
            seen.push(line);
            if reached {
                return;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(300), wait)
        .await
        .unwrap_or_else(|_| panic!("the client did not reach step {step}: {seen:?}"));
    seen
}

/// The proxy's answer while a dependency is gone: a retryable 5xx with MLflow's error JSON.
async fn assert_retryable_json_error(response: reqwest::Response, what: &str) {
    let status = response.status();
    let body: Value = response.json().await.unwrap_or(Value::Null);
    assert!(
        matches!(status.as_u16(), 502..=504),
        "{what}: {status} {body}"
    );
    assert_eq!(
        body["error_code"], "TEMPORARILY_UNAVAILABLE",
        "{what}: {body}"
    );
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{what}: {body}"
    );
}

/// How many `method` requests of `route` the proxy answered with a 5xx, from its `/metrics`.
async fn server_errors(proxy: &ProxyProcess, route: &str, method: &str) -> f64 {
    let series =
        format!(r#"mlscope_http_requests_total{{route="{route}",method="{method}",status="5"#);
    scrape(&proxy.admin_url)
        .await
        .lines()
        .filter(|l| l.starts_with(&series))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// Waits until the proxy has answered more than `before` of the client's `method` requests of
/// `route` with a 5xx: the client met the outage (and retries), which can end now.
async fn until_the_client_met_the_outage(
    proxy: &ProxyProcess,
    outage: &str,
    route: &str,
    method: &str,
    before: f64,
) {
    eventually(
        Duration::from_secs(60),
        format_args!(
            "a {method} {route} request of the client answered 5xx while {outage} is down"
        ),
        async || {
            let now = server_errors(proxy, route, method).await;
            if now > before {
                Ok(())
            } else {
                Err(format!("{now} answered 5xx, {before} before the outage"))
            }
        },
    )
    .await;
}

#[tokio::test]
async fn mlflow_seaweedfs_and_postgres_killed_mid_traffic_lose_no_metric_and_no_object() {
    let dir = tempfile::Builder::new()
        .prefix("mlscope-faults-")
        .tempdir()
        .unwrap();
    let mut postgres = PrivatePostgres::start().expect("starting a private PostgreSQL");
    let s3_port = free_port();
    let mut s3 = S3Store::start_on(dir.path(), s3_port).expect("starting SeaweedFS");
    let mlflow_port = free_port();
    let mut mlflow =
        MlflowServer::start_on(dir.path(), &s3, None, mlflow_port).expect("starting MLflow");
    let backend = mlflow.backend_store_uri.clone();
    let mut args = s3.gateway_args(&s3.url);
    args.extend(["--database-url".into(), postgres.url.clone()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let proxy = spawn_proxy(&mlflow.url, &args, dir.path()).expect("starting the proxy");

    let mut client = python(
        &proxy.url,
        &[
            ("FAULT_STEPS", &STEPS.to_string()),
            ("FAULT_ARTIFACT_EVERY", &ARTIFACT_EVERY.to_string()),
            ("FAULT_SCRATCH", dir.path().to_str().unwrap()),
        ],
    )
    .arg(repo_root().join("tests/python/fault_client.py"))
    .spawn()
    .expect("starting the client");
    let mut lines = BufReader::new(client.stdout.take().unwrap()).lines();
    let first = lines
        .next_line()
        .await
        .unwrap()
        .expect("the client prints its run");
    let run: Value = serde_json::from_str(&first).unwrap();
    let run_id = run["run_id"].as_str().unwrap().to_owned();
    until_step(&mut lines, 5).await;

    // MLflow, killed: the proxy answers 502 while it is gone, to the client too.
    let mut outages = Vec::new();
    let before = server_errors(&proxy, "log_batch", "POST").await;
    let down = std::time::Instant::now();
    mlflow.process.kill();
    let search = format!(
        "{}/api/2.0/mlflow/experiments/search?max_results=1",
        proxy.url
    );
    assert_retryable_json_error(http().get(&search).send().await.unwrap(), "MLflow down").await;
    until_the_client_met_the_outage(&proxy, "MLflow", "log_batch", "POST", before).await;
    mlflow = MlflowServer::start_on(dir.path(), &s3, Some(&backend), mlflow_port)
        .expect("restarting MLflow");
    outages.push(("MLflow", down.elapsed()));
    let resumed = until_step(&mut lines, 20).await;
    if resumed.is_empty() {
        let output = client.wait_with_output().await.unwrap();
        panic!(
            "the client stopped in the MLflow outage ({}):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    assert!(
        http()
            .get(&search)
            .send()
            .await
            .unwrap()
            .status()
            .is_success(),
        "recovered without a proxy restart"
    );

    // SeaweedFS, killed: the gateway answers 503, to the client's next checkpoint too.
    let before = server_errors(&proxy, "artifacts", "PUT").await;
    let down = std::time::Instant::now();
    s3.process.kill();
    let listing = format!(
        "{}/api/2.0/mlflow-artifacts/artifacts?path={}/{run_id}/artifacts",
        proxy.url,
        run["experiment_id"].as_str().unwrap()
    );
    assert_retryable_json_error(http().get(&listing).send().await.unwrap(), "SeaweedFS down").await;
    until_the_client_met_the_outage(&proxy, "SeaweedFS", "artifacts", "PUT", before).await;
    let _s3_again = S3Store::start_on(dir.path(), s3_port).expect("restarting SeaweedFS");
    outages.push(("SeaweedFS", down.elapsed()));
    until_step(&mut lines, 35).await;
    assert!(
        http()
            .get(&listing)
            .send()
            .await
            .unwrap()
            .status()
            .is_success(),
        "the gateway recovered"
    );

    // PostgreSQL (the proxy's shared state), killed: node-wide samples get 503, the client's too.
    let before = server_errors(&proxy, "log_batch", "POST").await;
    let down = std::time::Instant::now();
    postgres.kill();
    let probe_run = create_run(&mlflow.url, "faults-probe").await;
    let body = json!({ "run_id": probe_run, "metrics": [{ "key": "system/node-p/rank-0/cpu_utilization_percentage", "value": 1.0, "timestamp": now_ms(), "step": 0 }] });
    let batch = format!("{}/api/2.0/mlflow/runs/log-batch", proxy.url);
    assert_retryable_json_error(
        http().post(&batch).json(&body).send().await.unwrap(),
        "PostgreSQL down",
    )
    .await;
    // The test's own sample above is one of them.
    until_the_client_met_the_outage(&proxy, "PostgreSQL", "log_batch", "POST", before + 1.0).await;
    postgres.restart().expect("restarting PostgreSQL");
    outages.push(("PostgreSQL", down.elapsed()));
    until_step(&mut lines, STEPS).await;
    assert!(
        http()
            .post(&batch)
            .json(&body)
            .send()
            .await
            .unwrap()
            .status()
            .is_success(),
        "dedup recovered"
    );

    let output = tokio::time::timeout(Duration::from_secs(120), client.wait_with_output())
        .await
        .expect("the client finishes")
        .unwrap();
    assert!(
        output.status.success(),
        "the client failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );

    // Every step of every series exactly once, and every checkpoint with its size.
    let expected: Vec<i64> = (0..STEPS).collect();
    let mut stored_samples = 0;
    for key in ["loss", "system/node-f/node_cpu_utilization_percentage"] {
        let steps: Vec<i64> = history(&mlflow.url, &run_id, key)
            .await
            .into_iter()
            .map(|(step, _)| step)
            .collect();
        assert_eq!(steps, expected, "{key}");
        stored_samples += steps.len();
    }
    let listed: Value = http()
        .get(format!(
            "{}/api/2.0/mlflow/artifacts/list?run_id={run_id}&path=checkpoints",
            mlflow.url
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut files: Vec<(String, i64)> = listed["files"]
        .as_array()
        .expect("checkpoints listed")
        .iter()
        .map(|f| {
            (
                f["path"].as_str().unwrap().to_owned(),
                f["file_size"].as_i64().unwrap_or(0),
            )
        })
        .collect();
    files.sort();
    let mut wanted: Vec<(String, i64)> = (0..STEPS)
        .step_by(ARTIFACT_EVERY as usize)
        .map(|s| (format!("checkpoints/ckpt-{s}.bin"), 1024 * (s + 1)))
        .collect();
    wanted.sort();
    assert_eq!(files, wanted);
    eprintln!(
        "faults: outages {}; stored {} of {} metric samples (each step once) and {} of {} checkpoints",
        outages.iter().map(|(what, d)| format!("{what} {:.1} s", d.as_secs_f64())).collect::<Vec<_>>().join(", "),
        stored_samples,
        2 * STEPS,
        files.len(),
        wanted.len()
    );
}
