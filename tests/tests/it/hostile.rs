//! Hostile and broken clients against a proxy with the artifact gateway, in front of real MLflow
//! and SeaweedFS: each input a probe found wrong gets a clear 4xx (never a panic, a closed
//! connection or a store error the client would retry forever), and slow clients cannot hold the
//! proxy.

use std::sync::OnceLock;
use std::time::Duration;

use mlscope_tests::{eventually, spawn_proxy, ProxyProcess, TestStack};
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::mlflow::{create_experiment_and_run, history, http, now_ms, scrape};

struct Hostile {
    stack: &'static TestStack,
    proxy: ProxyProcess,
}

fn hostile() -> &'static Hostile {
    static STACK: OnceLock<Result<TestStack, String>> = OnceLock::new();
    static PROXY: OnceLock<Hostile> = OnceLock::new();
    PROXY.get_or_init(|| {
        let stack = crate::module_stack(&STACK, "hostile-input stack");
        let mut args = stack.s3.gateway_args(&stack.s3.url);
        args.extend(["--header-read-timeout".into(), "2s".into()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let proxy =
            spawn_proxy(&stack.mlflow.url, &args, stack.dir.path()).expect("starting the proxy");
        Hostile { stack, proxy }
    })
}

/// Sends `head` (and `body`) as given over a fresh connection; returns the status (0 when the
/// connection closed without an answer) and the body's text.
async fn raw(base: &str, head: &str, body: &[u8]) -> (u16, String) {
    let address = base.trim_start_matches("http://");
    let mut socket = tokio::net::TcpStream::connect(address).await.unwrap();
    socket.write_all(head.as_bytes()).await.unwrap();
    socket.write_all(body).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), socket.read_to_end(&mut answer)).await;
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (
        status,
        text.split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default(),
    )
}

async fn error_code(response: reqwest::Response) -> (StatusCode, String) {
    let status = response.status();
    let body: Value = response.json().await.unwrap_or(Value::Null);
    (
        status,
        body["error_code"].as_str().unwrap_or_default().to_owned(),
    )
}

#[tokio::test]
async fn an_overlong_upload_id_is_a_400_not_a_closed_connection() {
    let h = hostile();
    let (experiment, run) = create_experiment_and_run(&h.stack.mlflow.url, "hostile").await;
    let url = |op: &str| {
        format!(
            "{}/api/2.0/mlflow-artifacts/mpu/{op}/{experiment}/{run}/artifacts",
            h.proxy.url
        )
    };
    // Overlong, and with path separators (before: 502, which the client retried for minutes).
    let long_id = "A".repeat(70_000);
    for made_up in [
        long_id.as_str(),
        "a/b",
        "../x",
        "a\\b",
        "bm90/LWFu\\LXVw",
        "..",
        ".",
    ] {
        for op in ["abort", "complete"] {
            let body = json!({ "path": "big.bin", "upload_id": made_up, "parts": [{ "part_number": 1, "etag": "x" }] });
            let (status, code) =
                error_code(http().post(url(op)).json(&body).send().await.unwrap()).await;
            assert_eq!(
                (status, code.as_str()),
                (StatusCode::BAD_REQUEST, "INVALID_PARAMETER_VALUE"),
                "mpu/{op} with upload id {:.40?}",
                made_up
            );
        }
    }
    // A made-up but well-formed id is the client's mistake too: 404, not a retryable 5xx.
    let body = json!({ "path": "big.bin", "upload_id": "bm90LWFuLXVwbG9hZA", "parts": [{ "part_number": 1, "etag": "x" }] });
    let (status, code) = error_code(
        http()
            .post(url("complete"))
            .json(&body)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert!(
        status.is_client_error(),
        "made-up upload id: {status} {code}"
    );
    let body = json!({ "path": "big.bin", "upload_id": "x", "parts": [{ "part_number": 4_294_967_297i64, "etag": "x" }] });
    let (status, _) = error_code(
        http()
            .post(url("complete"))
            .json(&body)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        status,
        StatusCode::BAD_REQUEST,
        "a part number beyond i32 is refused, not wrapped"
    );
}

#[tokio::test]
async fn control_characters_and_overlong_keys_never_reach_the_store() {
    let h = hostile();
    let (experiment, run) = create_experiment_and_run(&h.stack.mlflow.url, "hostile").await;
    let root = format!("{experiment}/{run}/artifacts");
    // Without `Origin` the gateway asks MLflow only until it has seen that MLflow does not
    // authenticate; a browser's request (MLflow allows localhost origins) is always asked. MLflow
    // refuses the question about the line break itself (404: its router takes no such path), and
    // the answer is the gateway's 400 all the same, never MLflow's handling of the request.
    for origin in [None, Some("http://localhost:3000")] {
        for path in [
            format!("{root}/a%0d%0aX-Injected:%20yes"),
            format!("{root}/tab%09name"),
            format!("{root}/{}", "k".repeat(1100)),
        ] {
            let mut request = http().put(format!(
                "{}/api/2.0/mlflow-artifacts/artifacts/{path}",
                h.proxy.url
            ));
            if let Some(origin) = origin {
                request = request.header("Origin", origin);
            }
            let (status, code) = error_code(request.body("x").send().await.unwrap()).await;
            assert_eq!(
                (status, code.as_str()),
                (StatusCode::BAD_REQUEST, "INVALID_PARAMETER_VALUE"),
                "origin {origin:?}: {}",
                &path[..path.len().min(120)]
            );
        }
    }
    let keys = crate::objects::store_keys(&h.stack.s3, &format!("artifacts/{root}")).await;
    assert!(keys.is_empty(), "nothing stored: {keys:?}");
}

#[tokio::test]
async fn ambiguous_requests_are_refused_before_anyone_reads_them() {
    let h = hostile();
    let (experiment, run) = create_experiment_and_run(&h.stack.mlflow.url, "hostile").await;
    let path = format!("/api/2.0/mlflow-artifacts/artifacts/{experiment}/{run}/artifacts/gz.txt");
    let address = h.proxy.url.trim_start_matches("http://");
    // gzip inside chunked: stored as is it would be corrupt.
    let head = format!("PUT {path} HTTP/1.1\r\nHost: {address}\r\nTransfer-Encoding: gzip, chunked\r\nConnection: close\r\n\r\n");
    let (status, body) = raw(&h.proxy.url, &head, b"5\r\nhello\r\n0\r\n\r\n").await;
    assert_eq!(status, 501, "{body}");
    assert!(body.contains("chunked"), "{body}");
    let stored = http()
        .get(format!("{}{path}", h.stack.mlflow.url))
        .send()
        .await
        .unwrap()
        .status();
    assert_ne!(stored, StatusCode::OK, "nothing was stored");
    // Two Host headers: MLflow answers 400; so does the proxy, without forwarding either.
    let head = format!("GET /api/2.0/mlflow/experiments/get?experiment_id={experiment} HTTP/1.1\r\nHost: {address}\r\nHost: evil.example\r\nConnection: close\r\n\r\n");
    let (status, _) = raw(&h.proxy.url, &head, b"").await;
    assert_eq!(status, 400);
}

#[tokio::test]
async fn a_repeated_path_parameter_lists_the_first_as_mlflow_does() {
    let h = hostile();
    let (experiment, run) = create_experiment_and_run(&h.stack.mlflow.url, "hostile").await;
    let root = format!("{experiment}/{run}/artifacts");
    for dir in ["first", "second"] {
        let url = format!(
            "{}/api/2.0/mlflow-artifacts/artifacts/{root}/{dir}/{dir}.txt",
            h.proxy.url
        );
        assert_eq!(
            http().put(url).body(dir).send().await.unwrap().status(),
            StatusCode::OK
        );
    }
    let list = |base: String| {
        let url = format!(
            "{base}/api/2.0/mlflow-artifacts/artifacts?path={root}/first&path={root}/second"
        );
        async move {
            http()
                .get(url)
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        }
    };
    let (ours, theirs) = (
        list(h.proxy.url.clone()).await,
        list(h.stack.mlflow.url.clone()).await,
    );
    assert_eq!(ours, theirs);
    assert_eq!(ours["files"][0]["path"], "first.txt", "{ours}");
}

#[tokio::test]
async fn deleting_an_experiment_or_a_bare_run_prefix_is_refused_and_removes_nothing() {
    let h = hostile();
    let (experiment, run) = create_experiment_and_run(&h.stack.mlflow.url, "hostile").await;
    let file = format!(
        "{}/api/2.0/mlflow-artifacts/artifacts/{experiment}/{run}/artifacts/keep.txt",
        h.proxy.url
    );
    assert_eq!(
        http()
            .put(&file)
            .body("keep")
            .send()
            .await
            .unwrap()
            .status(),
        StatusCode::OK
    );
    for target in [experiment.clone(), format!("{experiment}/{run}")] {
        let response = http()
            .delete(format!(
                "{}/api/2.0/mlflow-artifacts/artifacts/{target}",
                h.proxy.url
            ))
            .send()
            .await
            .unwrap();
        let (status, code) = error_code(response).await;
        assert_eq!(
            (status, code.as_str()),
            (StatusCode::FORBIDDEN, "PERMISSION_DENIED"),
            "DELETE {target}"
        );
    }
    assert_eq!(
        http().get(&file).send().await.unwrap().status(),
        StatusCode::OK,
        "the run's file is still there"
    );
    // The run's own artifact root may go, as one owner's artifacts.
    let whole_root = format!(
        "{}/api/2.0/mlflow-artifacts/artifacts/{experiment}/{run}/artifacts",
        h.proxy.url
    );
    assert_eq!(
        http().delete(whole_root).send().await.unwrap().status(),
        StatusCode::OK
    );
    assert_eq!(
        http().get(&file).send().await.unwrap().status(),
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn one_extreme_step_is_refused_and_the_node_keeps_reporting() {
    let h = hostile();
    let (_, run) = create_experiment_and_run(&h.stack.mlflow.url, "hostile").await;
    let key = |rank: u32| format!("system/node-x/rank-{rank}/cpu_utilization_percentage");
    let send = |rank: u32, step: i64| {
        let body = json!({ "run_id": run, "metrics": [{ "key": key(rank), "value": 1.0, "timestamp": now_ms(), "step": step }] });
        http()
            .post(format!("{}/api/2.0/mlflow/runs/log-batch", h.proxy.url))
            .json(&body)
            .send()
    };
    assert_eq!(send(0, 0).await.unwrap().status(), StatusCode::OK);
    for step in [i64::MIN, i64::MAX, 1 << 62] {
        let (status, code) = error_code(send(0, step).await.unwrap()).await;
        assert_eq!(
            (status, code.as_str()),
            (StatusCode::BAD_REQUEST, "INVALID_PARAMETER_VALUE"),
            "step {step}"
        );
    }
    assert_eq!(
        send(0, 1).await.unwrap().status(),
        StatusCode::OK,
        "the node still reports"
    );
    let steps: Vec<i64> = history(
        &h.stack.mlflow.url,
        &run,
        "system/node-x/node_cpu_utilization_percentage",
    )
    .await
    .into_iter()
    .map(|(s, _)| s)
    .collect();
    assert_eq!(steps, vec![0, 1]);
}

#[tokio::test]
async fn a_made_up_method_does_not_grow_the_metric_labels() {
    let h = hostile();
    let address = h.proxy.url.trim_start_matches("http://");
    for method in ["FOO", "BAR", "BAZ"] {
        raw(&h.proxy.url, &format!("{method} /api/2.0/mlflow/experiments/search HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"), b"").await;
    }
    let metrics = scrape(&h.proxy.admin_url).await;
    assert!(
        metrics.contains("method=\"OTHER\""),
        "made-up methods are counted as OTHER"
    );
    assert!(
        !metrics.contains("FOO") && !metrics.contains("BAZ"),
        "no label per made-up method"
    );
}

#[tokio::test]
async fn connections_that_never_finish_their_headers_are_closed_and_do_not_block_others() {
    use futures_util::FutureExt as _;
    let h = hostile();
    let address = h.proxy.url.trim_start_matches("http://").to_owned();
    let mut slow = Vec::new();
    for _ in 0..1000 {
        let mut socket = tokio::net::TcpStream::connect(&address).await.unwrap();
        socket
            .write_all(b"GET /health HTTP/1.1\r\nHo")
            .await
            .unwrap();
        slow.push(socket);
    }
    // A normal client is served while they hang.
    let response = http()
        .get(format!("{}/health", h.proxy.url))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    // Keep trickling a byte at a time: the header deadline (2 s here) closes them anyway.
    for socket in &mut slow {
        let _ = socket.write_all(b"s").await;
    }
    let trickled = std::time::Instant::now();
    // A connection is closed once a read returns: the end, an error or an answer.
    let mut closed = vec![false; slow.len()];
    eventually(
        Duration::from_secs(30),
        "every connection still sending its headers closed",
        async || {
            for (socket, closed) in slow.iter_mut().zip(&mut closed) {
                let mut buf = [0u8; 512];
                *closed = *closed || socket.read(&mut buf).now_or_never().is_some();
            }
            match closed.iter().filter(|c| !**c).count() {
                0 => Ok(()),
                open => Err(format!("{open} of {} still open", closed.len())),
            }
        },
    )
    .await;
    // By the 2 s deadline: the default (15 s) would take longer.
    assert!(
        trickled.elapsed() < Duration::from_secs(10),
        "the connections were closed only after {:?}",
        trickled.elapsed()
    );
    eventually(
        Duration::from_secs(10),
        "fewer than 10 client connections open at the proxy",
        async || {
            let metrics = scrape(&h.proxy.admin_url).await;
            let open: i64 = metrics
                .lines()
                .find_map(|l| l.strip_prefix("mlscope_client_connections "))
                .and_then(|v| v.trim().parse().ok())
                .expect("mlscope_client_connections is exported");
            if open < 10 {
                Ok(())
            } else {
                Err(format!("{open} client connections still open"))
            }
        },
    )
    .await;
}

#[tokio::test]
async fn browser_requests_get_mlflows_origin_checks_and_cors_answers_through_the_gateway() {
    let h = hostile();
    let (experiment, run) = create_experiment_and_run(&h.stack.mlflow.url, "hostile").await;
    let url = |base: &str, name: &str| {
        format!("{base}/api/2.0/mlflow-artifacts/artifacts/{experiment}/{run}/artifacts/{name}")
    };
    let shared = url(&h.proxy.url, "shared.txt");
    assert_eq!(
        http()
            .put(&shared)
            .body("shared")
            .send()
            .await
            .unwrap()
            .status(),
        StatusCode::OK
    );
    let mut answers = Vec::new();
    for base in [h.stack.mlflow.url.as_str(), h.proxy.url.as_str()] {
        // A state-changing request from a foreign page: MLflow's security middleware refuses it.
        let put = http()
            .put(url(base, "from-evil.txt"))
            .header("Origin", "http://evil.example")
            .body("x")
            .send()
            .await
            .unwrap();
        // A read from an allowed (local) page: MLflow answers CORS for it.
        let get = http()
            .get(url(base, "shared.txt"))
            .header("Origin", "http://localhost:3000")
            .send()
            .await
            .unwrap();
        let allow = get
            .headers()
            .get("access-control-allow-origin")
            .map(|v| v.to_str().unwrap().to_owned());
        answers.push((put.status(), get.status(), allow));
    }
    assert_eq!(
        answers[0], answers[1],
        "MLflow, then the gateway: (foreign PUT, local GET, Access-Control-Allow-Origin)"
    );
    assert_eq!(
        answers[0].0,
        StatusCode::FORBIDDEN,
        "MLflow refuses a foreign origin's upload"
    );
    let stored = http()
        .get(url(&h.stack.mlflow.url, "from-evil.txt"))
        .send()
        .await
        .unwrap()
        .status();
    assert_ne!(stored, StatusCode::OK, "nothing was stored");
}

/// Rows of the proxy's state store: `(node lease rows, rank rows)` whose run id is longer than
/// any MLflow run id, and `(node lease rows, rank rows)` of `run_id`. Read with Python's sqlite3
/// (the store is the proxy's SQLite file).
fn state_rows(database: &std::path::Path, run_id: &str) -> ((i64, i64), (i64, i64)) {
    let script = r#"
import json, sqlite3, sys
db = sqlite3.connect(sys.argv[1])
q = lambda sql, *a: db.execute(sql, a).fetchone()[0]
print(json.dumps([
    [q("select count(*) from node_leases where length(run_id) > 256"),
     q("select count(*) from run_ranks where length(run_id) > 256")],
    [q("select count(*) from node_leases where run_id = ?", sys.argv[2]),
     q("select count(*) from run_ranks where run_id = ?", sys.argv[2])],
]))
"#;
    let output = std::process::Command::new(mlscope_tests::venv().join("bin/python"))
        .args(["-c", script])
        .arg(database)
        .arg(run_id)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

/// One log-batch with a 100,000-character made-up run id and 1,000 node-wide keys, each naming
/// its own node: MLflow refuses it, and the proxy keeps nothing for it (before: 1,000 lease rows
/// and 1,000 cache entries, each with its own copy of the run id, about 200 MB per request).
/// A real run's node series in the same proxy is leased and recorded as always.
#[tokio::test]
async fn a_made_up_run_id_gets_mlflows_refusal_and_no_state_in_the_proxy() {
    let h = hostile();
    let made_up = "x".repeat(100_000);
    let metrics: Vec<Value> = (0..1000)
        .map(|j| json!({"key": format!("system/n{j}/rank-0/cpu_utilization_percentage"), "value": 1.0, "timestamp": now_ms(), "step": 0}))
        .collect();
    let mut refusals = Vec::new();
    for base in [&h.stack.mlflow.url, &h.proxy.url] {
        let response = http()
            .post(format!("{base}/api/2.0/mlflow/runs/log-batch"))
            .json(&json!({"run_id": made_up, "metrics": metrics}))
            .send()
            .await
            .unwrap();
        refusals.push(error_code(response).await);
    }
    assert_eq!(
        refusals[1], refusals[0],
        "through the proxy, straight to MLflow"
    );
    assert!(refusals[0].0.is_client_error(), "{refusals:?}");

    // A real run's node samples, after the made-up one: their lease and heartbeat are stored
    // (the heartbeats are flushed every 2 s), so the store has been written since.
    let (_, run) = create_experiment_and_run(&h.stack.mlflow.url, "made-up-run-id").await;
    let real = json!({"run_id": run, "metrics": [{"key": "system/node-a/rank-0/cpu_utilization_percentage", "value": 1.0, "timestamp": now_ms(), "step": 0}]});
    let response = http()
        .post(format!("{}/api/2.0/mlflow/runs/log-batch", h.proxy.url))
        .json(&real)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let port = h.proxy.url.rsplit(':').next().unwrap();
    let database = h.stack.dir.path().join(format!("mlscope-{port}.db"));
    let (made_up_rows, real_rows) = eventually(
        Duration::from_secs(30),
        "the real run's rank row in the proxy's store",
        async || match state_rows(&database, &run) {
            rows if rows.1 .1 > 0 => Ok(rows),
            rows => Err(format!("(made-up, real) (leases, rank rows): {rows:?}")),
        },
    )
    .await;
    assert_eq!(real_rows, (1, 1), "the real run's lease and rank row");
    assert_eq!(made_up_rows, (0, 0), "rows for the made-up run id");
}

/// Made-up run ids of valid form (256 characters, MLflow's longest; 32 hex digits like a real
/// one), each with 16 node identities, to an MLflow without authentication: MLflow answers 404,
/// and the proxy keeps no lease and no row for them (e93dbfe kept 16 lease rows per request for
/// `--state-retention`, 14 days). A real run's node series after them is leased as always.
#[tokio::test]
async fn made_up_run_ids_of_valid_form_get_mlflows_refusal_and_leave_no_lease() {
    let h = hostile();
    let made_up: Vec<String> = (0..20)
        .map(|i| {
            if i % 2 == 0 {
                format!("{i:0>4}{}", "f".repeat(252))
            } else {
                uuid::Uuid::new_v4().simple().to_string()
            }
        })
        .collect();
    for run_id in &made_up {
        let metrics: Vec<Value> = (0..16)
            .map(|j| json!({"key": format!("system/made-up-{j}/rank-0/cpu_utilization_percentage"), "value": 1.0, "timestamp": now_ms(), "step": 0}))
            .collect();
        let body = json!({"run_id": run_id, "metrics": metrics});
        let mut refusals = Vec::new();
        for base in [&h.stack.mlflow.url, &h.proxy.url] {
            let response = http()
                .post(format!("{base}/api/2.0/mlflow/runs/log-batch"))
                .json(&body)
                .send()
                .await
                .unwrap();
            refusals.push(error_code(response).await);
        }
        assert_eq!(
            refusals[1], refusals[0],
            "through the proxy, straight to MLflow"
        );
        assert!(refusals[0].0.is_client_error(), "{refusals:?}");
    }
    let (_, run) = create_experiment_and_run(&h.stack.mlflow.url, "made-up-valid-ids").await;
    let real = json!({"run_id": run, "metrics": [{"key": "system/node-a/rank-0/cpu_utilization_percentage", "value": 1.0, "timestamp": now_ms(), "step": 0}]});
    let response = http()
        .post(format!("{}/api/2.0/mlflow/runs/log-batch", h.proxy.url))
        .json(&real)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let port = h.proxy.url.rsplit(':').next().unwrap();
    let database = h.stack.dir.path().join(format!("mlscope-{port}.db"));
    eventually(
        Duration::from_secs(30),
        "the real run's lease in the proxy's store",
        async || match state_rows(&database, &run) {
            (_, real_rows) if real_rows.0 > 0 => Ok(()),
            rows => Err(format!("(made-up, real) (leases, rank rows): {rows:?}")),
        },
    )
    .await;
    for run_id in &made_up {
        let (_, rows) = state_rows(&database, run_id);
        assert_eq!(
            rows,
            (0, 0),
            "leases and rank rows for made-up run {run_id}"
        );
    }
}

/// One page of `/runs/{run}/health` (`query`: its paging), or null when it is not JSON.
async fn health_page(admin_url: &str, run: &str, query: &str) -> Value {
    let response = http()
        .get(format!("{admin_url}/runs/{run}/health?{query}"))
        .send()
        .await
        .unwrap();
    response.json().await.unwrap_or(Value::Null)
}

/// Rank identities per run are bounded (before: 200 requests of 1,000 keys
/// `system/fn<i>/rank-<r>/...` made 200,000 identities in one run, 164 MB resident, a 64 MB health
/// answer). One request may name at most 16 (node, rank) identities and a run at most 1,024
/// nodes; beyond, the request is refused with a message and nothing of it reaches MLflow. The
/// health view pages its ranks.
#[tokio::test]
async fn identities_per_request_and_nodes_per_run_are_capped_with_a_clear_refusal() {
    let h = hostile();
    let (_, run) = create_experiment_and_run(&h.stack.mlflow.url, "hostile-identities").await;
    let batch = |keys: Vec<String>| {
        let metrics: Vec<Value> = keys
            .into_iter()
            .map(|key| json!({"key": key, "value": 1.0, "timestamp": now_ms(), "step": 0}))
            .collect();
        json!({"run_id": run, "metrics": metrics})
    };
    let send = |body: Value| async move {
        error_code(
            http()
                .post(format!("{}/api/2.0/mlflow/runs/log-batch", h.proxy.url))
                .json(&body)
                .send()
                .await
                .unwrap(),
        )
        .await
    };
    let key = |node: String| format!("system/{node}/rank-0/gpu_0_utilization_percentage");
    let crowded = batch((0..1000).map(|i| key(format!("fn{i}"))).collect());
    assert_eq!(
        send(crowded).await,
        (
            StatusCode::BAD_REQUEST,
            "INVALID_PARAMETER_VALUE".to_owned()
        )
    );

    // 16 new nodes per request: 64 requests fill the run's 1,024 nodes, the 65th is refused.
    for request in 0..64 {
        let keys = (0..16).map(|j| key(format!("n{request}-{j}"))).collect();
        assert_eq!(
            send(batch(keys)).await.0,
            StatusCode::OK,
            "request {request}"
        );
    }
    let refused = batch((0..16).map(|j| key(format!("late-{j}"))).collect());
    let response = http()
        .post(format!("{}/api/2.0/mlflow/runs/log-batch", h.proxy.url))
        .json(&refused)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let message: Value = response.json().await.unwrap();
    assert!(
        message["message"]
            .as_str()
            .unwrap()
            .contains("at most 1024 per run"),
        "{message}"
    );
    // Known nodes still report; nothing of the refused request is in MLflow.
    assert_eq!(
        send(batch(vec![key("n0-0".into())])).await.0,
        StatusCode::OK
    );
    let late = history(
        &h.stack.mlflow.url,
        &run,
        "system/late-0/rank-0/gpu_0_utilization_percentage",
    )
    .await;
    assert!(late.is_empty(), "{late:?}");

    // The health view: 1,024 ranks, listed 100 at a time.
    let view = eventually(
        Duration::from_secs(30),
        "1024 ranks in the health view",
        async || {
            let view = health_page(&h.proxy.admin_url, &run, "max_results=100").await;
            if view["rank_count"] == 1024 {
                Ok(view)
            } else {
                Err(format!("{view:.300}"))
            }
        },
    )
    .await;
    assert_eq!(view["ranks"].as_array().map(Vec::len), Some(100));
    assert_eq!(view["next_page_token"], "100");
    let last = health_page(&h.proxy.admin_url, &run, "max_results=100&page_token=1000").await;
    assert_eq!(last["ranks"].as_array().map(Vec::len), Some(24));
    assert!(last.get("next_page_token").is_none(), "{last:.300}");
}

/// Slow bodies cannot switch metric logging off for everyone (before: 16 connections declaring
/// a 16 MiB log-batch and sending a byte every few seconds reserved all of --max-inspect-total,
/// and every client's log-batch got 503 while they went on). Bodies are charged by what
/// arrived, and one that does not arrive whole within --inspect-body-deadline gets 408.
#[tokio::test]
async fn trickling_bodies_do_not_starve_other_clients_and_time_out() {
    let h = hostile();
    let dir = tempfile::tempdir().unwrap();
    let proxy = spawn_proxy(
        &h.stack.mlflow.url,
        &["--inspect-body-deadline", "4s"],
        dir.path(),
    )
    .unwrap();
    let (_, run) = create_experiment_and_run(&h.stack.mlflow.url, "hostile-slow").await;
    let address = proxy.url.trim_start_matches("http://").to_owned();
    let head = format!(
        "POST /api/2.0/mlflow/runs/log-batch HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        16 << 20
    );
    let mut slow = Vec::new();
    for _ in 0..16 {
        let mut socket = tokio::net::TcpStream::connect(&address).await.unwrap();
        socket.write_all(head.as_bytes()).await.unwrap();
        socket.write_all(b"{").await.unwrap();
        slow.push(socket);
    }
    // Once the proxy reads every slow body.
    eventually(
        Duration::from_secs(30),
        "the 16 slow bodies in flight at the proxy",
        async || {
            let metrics = scrape(&proxy.admin_url).await;
            match metrics
                .lines()
                .find_map(|l| l.strip_prefix("mlscope_http_requests_in_flight "))
                .and_then(|v| v.trim().parse::<i64>().ok())
            {
                Some(n) if n >= 16 => Ok(()),
                n => Err(format!("mlscope_http_requests_in_flight {n:?}")),
            }
        },
    )
    .await;
    // A well-behaved client meanwhile: stored.
    let body = json!({"run_id": run, "metrics": [{"key": "loss", "value": 0.5, "timestamp": now_ms(), "step": 1}]});
    let response = http()
        .post(format!("{}/api/2.0/mlflow/runs/log-batch", proxy.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.status(),
        StatusCode::OK,
        "{:?}",
        response.text().await
    );
    assert_eq!(history(&h.stack.mlflow.url, &run, "loss").await.len(), 1);
    // The trickling bodies end with 408 once their deadline passes.
    for mut socket in slow {
        let _ = socket.write_all(b" ").await;
        let mut answer = Vec::new();
        let _ =
            tokio::time::timeout(Duration::from_secs(15), socket.read_to_end(&mut answer)).await;
        let text = String::from_utf8_lossy(&answer);
        assert!(text.starts_with("HTTP/1.1 408"), "{text}");
        assert!(text.contains("did not arrive whole within 4s"), "{text}");
    }
}

/// Slow artifact uploads cannot take every upload slot (before: as many slow PUTs as
/// --artifact-max-concurrent-uploads blocked every upload with 503). The last quarter of the
/// slots is kept for clients below their quarter: the slow client gets 429 for it, another
/// client still uploads. The
/// clients are told apart by the X-Forwarded-For of a trusted gateway (here, the test itself).
#[tokio::test]
async fn slow_uploads_of_one_client_leave_upload_slots_for_others() {
    let h = hostile();
    let dir = tempfile::tempdir().unwrap();
    let mut args = h.stack.s3.gateway_args(&h.stack.s3.url);
    args.extend(
        [
            "--artifact-max-concurrent-uploads",
            "8",
            "--trusted-proxies",
            "127.0.0.1",
        ]
        .map(String::from),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let proxy = spawn_proxy(&h.stack.mlflow.url, &args, dir.path()).unwrap();
    let (experiment, run) = create_experiment_and_run(&h.stack.mlflow.url, "hostile-uploads").await;
    let address = proxy.url.trim_start_matches("http://").to_owned();
    let mut slow = Vec::new();
    let mut refused = 0;
    for i in 0..8 {
        let head = format!(
            "PUT /api/2.0/mlflow-artifacts/artifacts/{experiment}/{run}/artifacts/slow-{i}.bin HTTP/1.1\r\nHost: {address}\r\nX-Forwarded-For: 203.0.113.7\r\nContent-Length: {}\r\n\r\n",
            1u64 << 30
        );
        let mut socket = tokio::net::TcpStream::connect(&address).await.unwrap();
        socket.write_all(head.as_bytes()).await.unwrap();
        socket.write_all(b"x").await.unwrap();
        // A refused one is answered at once; a held one waits for its body.
        let mut answer = [0u8; 12];
        match tokio::time::timeout(Duration::from_millis(700), socket.read(&mut answer)).await {
            Ok(Ok(n)) if n > 0 => {
                assert!(
                    answer.starts_with(b"HTTP/1.1 429"),
                    "{}",
                    String::from_utf8_lossy(&answer)
                );
                refused += 1;
            }
            _ => slow.push(socket),
        }
    }
    assert_eq!(
        (slow.len(), refused),
        (6, 2),
        "the last quarter of the slots is kept for other clients"
    );
    let response = http()
        .put(format!(
            "{}/api/2.0/mlflow-artifacts/artifacts/{experiment}/{run}/artifacts/checkpoint.bin",
            proxy.url
        ))
        .header("x-forwarded-for", "198.51.100.1")
        .body(vec![7u8; 1 << 20])
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.status(),
        StatusCode::OK,
        "{:?}",
        response.text().await
    );
    drop(slow);
}

/// Each client's share of the writes (`--client-write-rate`): a client flooding log-metric is
/// refused with 429, `Retry-After` and `REQUEST_LIMIT_EXCEEDED` beyond its share, while a calm
/// client's writes all succeed; every write answered 200 is in MLflow, once.
#[tokio::test]
async fn a_flooding_client_is_refused_its_excess_and_a_calm_one_is_not() {
    let h = hostile();
    let dir = tempfile::tempdir().unwrap();
    let proxy = spawn_proxy(
        &h.stack.mlflow.url,
        // The per-client rate alone: 200 writes at once saturate MLflow, and saturation control
        // would refuse the flood's excess too (reason "saturation").
        &[
            "--client-write-rate",
            "20",
            "--max-writes-at-mlflow",
            "0",
            "--trusted-proxies",
            "127.0.0.1",
        ],
        dir.path(),
    )
    .unwrap();
    let (_, flood_run) = create_experiment_and_run(&h.stack.mlflow.url, "fair-flood").await;
    let (_, calm_run) = create_experiment_and_run(&h.stack.mlflow.url, "fair-calm").await;
    let write = |run: String, client: &'static str, step: i64| {
        let url = format!("{}/api/2.0/mlflow/runs/log-metric", proxy.url);
        async move {
            let response = http()
                .post(url)
                .header("x-forwarded-for", client)
                .json(&json!({"run_id": run, "key": "loss", "value": 1.0, "timestamp": now_ms(), "step": step}))
                .send()
                .await
                .unwrap();
            let retry_after = response.headers().get("retry-after").is_some();
            let (status, code) = error_code(response).await;
            (status, code, retry_after)
        }
    };
    let flood = futures_util::future::join_all(
        (0..200).map(|step| write(flood_run.clone(), "203.0.113.9", step)),
    );
    let calm = async {
        let mut answers = Vec::new();
        for step in 0..6 {
            answers.push(write(calm_run.clone(), "198.51.100.4", step).await);
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        answers
    };
    let (flood, calm) = tokio::join!(flood, calm);
    assert!(
        calm.iter().all(|(status, _, _)| *status == StatusCode::OK),
        "{calm:?}"
    );
    let admitted = flood
        .iter()
        .filter(|(s, _, _)| *s == StatusCode::OK)
        .count();
    let refused: Vec<_> = flood
        .iter()
        .filter(|(s, _, _)| *s != StatusCode::OK)
        .collect();
    assert!(
        refused.iter().all(
            |(status, code, retry_after)| *status == StatusCode::TOO_MANY_REQUESTS
                && code == "REQUEST_LIMIT_EXCEEDED"
                && *retry_after
        ),
        "{refused:?}"
    );
    assert!((40..200).contains(&admitted), "admitted {admitted} of 200");
    // Acknowledged means stored: every 200 is one sample in MLflow.
    assert_eq!(
        history(&h.stack.mlflow.url, &flood_run, "loss").await.len(),
        admitted
    );
    assert_eq!(
        history(&h.stack.mlflow.url, &calm_run, "loss").await.len(),
        6
    );
}

/// Saturation control with the proxy's defaults: one client flooding heavy batches with 32
/// concurrent writers (each into its own run, a tag and 100 metrics per batch) fills the writes
/// MLflow takes at once, and gives way first (its writes wait for their turn, counted as
/// `outcome="waited"`; refused with 429, `Retry-After`, `REQUEST_LIMIT_EXCEEDED` after waiting too
/// long, counted as `reason="saturation"`), while a calm client that waits for each answer, and a UI
/// reader, get every request answered 200; every batch answered 200 is in MLflow, once.
#[tokio::test(flavor = "multi_thread")]
async fn under_a_flood_of_heavy_batches_the_heaviest_client_gives_way_and_nothing_acknowledged_is_lost(
) {
    const WRITERS: usize = 32;
    const METRICS: i64 = 100;
    let h = hostile();
    let dir = tempfile::tempdir().unwrap();
    let proxy = spawn_proxy(
        &h.stack.mlflow.url,
        &["--trusted-proxies", "127.0.0.1"],
        dir.path(),
    )
    .unwrap();
    let mlflow = h.stack.mlflow.url.as_str();
    let mut flood_runs = Vec::new();
    for _ in 0..WRITERS {
        flood_runs.push(
            create_experiment_and_run(mlflow, "saturation-flood")
                .await
                .1,
        );
    }
    let (experiment, calm_run) = create_experiment_and_run(mlflow, "saturation-calm").await;
    let url = format!("{}/api/2.0/mlflow/runs/log-batch", proxy.url);
    // The calm client and the reader are active first (a client alone is never refused: it
    // competes with nobody); the flood starts once they are, and goes on until the calm client
    // has written its 16 writes and the reader read as often, however slow MLflow is.
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    let (calm_started, calm_done) = (AtomicBool::new(false), AtomicBool::new(false));
    let flood = futures_util::future::join_all(flood_runs.iter().map(|run| {
        let (url, run) = (url.clone(), run.clone());
        let (calm_started, calm_done) = (&calm_started, &calm_done);
        async move {
            let client = http();
            let (mut ok, mut refused, mut other) = (0i64, Vec::new(), Vec::new());
            let mut unanswered = 0i64;
            eventually(
                Duration::from_secs(60),
                "the calm client and the reader active",
                async || {
                    calm_started
                        .load(Relaxed)
                        .then_some(())
                        .ok_or_else(|| "not yet".to_owned())
                },
            )
            .await;
            while !calm_done.load(Relaxed) {
                let metrics: Vec<Value> = (0..METRICS)
                    .map(|j| json!({"key": "flood", "value": j, "timestamp": now_ms(), "step": ok * METRICS + j}))
                    .collect();
                let sent = client
                    .post(&url)
                    .header("x-forwarded-for", "203.0.113.9")
                    .json(&json!({"run_id": run, "metrics": metrics, "tags": [{"key": "batch", "value": ok.to_string()}]}))
                    .send()
                    .await;
                // A heavy batch MLflow itself takes longer than the client's 60 s to answer
                // (seen once with the whole suite sharing MLflow's SQLite): unacknowledged, so
                // nothing the proxy promised; kept apart, and it may be stored or not.
                let response = match sent {
                    Ok(response) => response,
                    Err(error) if error.is_timeout() => {
                        unanswered += 1;
                        continue;
                    }
                    Err(error) => panic!("{error}"),
                };
                let retry_after = response.headers().get("retry-after").is_some();
                match error_code(response).await {
                    (StatusCode::OK, _) => ok += 1,
                    (StatusCode::TOO_MANY_REQUESTS, code) => {
                        refused.push((code, retry_after));
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    (status, code) => other.push((status, code)),
                }
            }
            (run, ok, refused, other, unanswered)
        }
    }));
    let calm = async {
        let client = http();
        let mut answers = Vec::new();
        for step in 0..16 {
            let response = client
                .post(&url)
                .header("x-forwarded-for", "198.51.100.7")
                .json(&json!({"run_id": calm_run, "metrics": [{"key": "calm", "value": 1, "timestamp": now_ms(), "step": step}]}))
                .send()
                .await
                .unwrap();
            answers.push((response.status(), response.text().await.unwrap_or_default()));
            let read = client
                .post(format!("{}/ajax-api/2.0/mlflow/runs/search", proxy.url))
                .header("x-forwarded-for", "198.51.100.8")
                .json(&json!({"experiment_ids": [experiment], "max_results": 10}))
                .send()
                .await
                .unwrap();
            answers.push((read.status(), read.text().await.unwrap_or_default()));
            if step == 1 {
                calm_started.store(true, Relaxed);
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        calm_done.store(true, Relaxed);
        answers
    };
    let (flood, calm) = tokio::join!(flood, calm);
    assert!(
        calm.iter().all(|(s, _)| *s == StatusCode::OK),
        "the calm client and the reader: {:?}",
        calm.iter()
            .filter(|(s, _)| *s != StatusCode::OK)
            .collect::<Vec<_>>()
    );
    let mut refusals = 0;
    for (run, ok, refused, other, unanswered) in &flood {
        assert!(
            other.is_empty(),
            "neither 5xx nor another refusal: {other:?}"
        );
        assert!(
            refused
                .iter()
                .all(|(code, retry_after)| code == "REQUEST_LIMIT_EXCEEDED" && *retry_after),
            "{refused:?}"
        );
        refusals += refused.len();
        // Acknowledged means stored: every batch answered 200 is in MLflow, once (a batch that
        // got no answer may be stored too, once).
        let stored = history(mlflow, run, "flood").await.len() as i64;
        assert!(
            stored >= ok * METRICS && stored <= (ok + unanswered) * METRICS,
            "run {run}: {stored} stored, {ok} batches acknowledged, {unanswered} unanswered"
        );
    }
    assert_eq!(
        history(mlflow, &calm_run, "calm").await.len(),
        calm.len() / 2
    );
    let metrics = scrape(&proxy.admin_url).await;
    let count = |outcome: &str| {
        metrics
            .lines()
            .find(|l| {
                l.starts_with("mlscope_fair_share_writes_total")
                    && l.contains(&format!("outcome=\"{outcome}\""))
                    && l.contains("reason=\"saturation\"")
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0) as usize
    };
    // The flood gave way: its writes waited for their turn, and those that waited too long were
    // refused; every refusal the flood saw is counted.
    assert!(count("waited") > 0, "the flood never waited: {metrics}");
    assert_eq!(count("refused"), refusals, "{metrics}");
    assert!(
        metrics.contains("mlscope_fair_share_write_limit "),
        "{metrics}"
    );
}

/// Spellings MLflow's server decodes before it routes or parses: a percent-encoded path
/// (`runs/log%2Dbatch`, `%72uns/...`), a body with a UTF-8 byte-order mark, in UTF-16, or
/// double-encoded as a JSON string. MLflow stores each; through the proxy each is scoped as the
/// plain request is (e93dbfe forwarded them untouched: no scoping, dedup, caps or heartbeats,
/// and charged one sample each).
#[tokio::test]
async fn encodings_mlflow_decodes_are_scoped_as_the_plain_request() {
    let h = hostile();
    let key = "system/gpu-node-1/rank-3/cpu_utilization_percentage";
    let scoped = "system/gpu-node-1/node_cpu_utilization_percentage";
    let batch = |run: &str| {
        json!({"run_id": run, "metrics": [{"key": key, "value": 5.0, "timestamp": now_ms(), "step": 0}]}).to_string()
    };
    let metric = |run: &str| {
        json!({"run_id": run, "run_uuid": run, "key": key, "value": 5.0, "timestamp": now_ms(), "step": 0}).to_string()
    };
    type Body = fn(String) -> Vec<u8>;
    let plain: Body = |json| json.into_bytes();
    let bom: Body = |json| [&b"\xef\xbb\xbf"[..], json.as_bytes()].concat();
    let utf16: Body = |json| json.encode_utf16().flat_map(u16::to_le_bytes).collect();
    let double: Body = |json| serde_json::to_string(&json).unwrap().into_bytes();
    let cases: [(&str, &str, Body, bool); 8] = [
        ("plain", "runs/log-batch", plain, true),
        ("encoded hyphen", "runs/log%2Dbatch", plain, true),
        ("encoded letter", "%72uns/log-batch", plain, true),
        ("encoded lowercase", "runs%2flog%2dbatch", plain, true),
        ("byte-order mark", "runs/log-batch", bom, true),
        ("UTF-16", "runs/log-batch", utf16, true),
        ("double-encoded", "runs/log-batch", double, true),
        ("log-metric encoded", "runs/log%2Dmetric", plain, false),
    ];
    let mut stored = Vec::new();
    for (name, path, body, is_batch) in cases {
        let (_, run) = create_experiment_and_run(&h.stack.mlflow.url, "encodings").await;
        let json = if is_batch { batch(&run) } else { metric(&run) };
        let response = http()
            .post(format!("{}/api/2.0/mlflow/{path}", h.proxy.url))
            .header("content-type", "application/json")
            .body(body(json))
            .send()
            .await
            .unwrap();
        let status = response.status();
        assert_eq!(
            status,
            StatusCode::OK,
            "{name}: {}",
            response.text().await.unwrap()
        );
        let keys = crate::mlflow::metric_keys(&h.stack.mlflow.url, &run).await;
        stored.push((name, keys.into_iter().collect::<Vec<_>>()));
    }
    for (name, keys) in &stored {
        assert_eq!(keys, &vec![scoped.to_owned()], "{name}: {stored:?}");
    }
}

/// The artifact API spelled with an encoded hyphen (`mlflow%2Dartifacts`) is the gateway's:
/// the delete of an experiment's root is refused (403) as for the plain path, and a PUT outside
/// any run's root is refused (e93dbfe forwarded both to MLflow, which deleted every run's
/// files of the experiment).
#[tokio::test]
async fn the_artifact_api_spelled_with_encodings_is_guarded_as_the_plain_one() {
    let h = hostile();
    let (experiment, run) =
        create_experiment_and_run(&h.stack.mlflow.url, "encoded-artifacts").await;
    let file = format!("{experiment}/{run}/artifacts/model.pkl");
    let put = http()
        .put(format!(
            "{}/api/2.0/mlflow-artifacts/artifacts/{file}",
            h.stack.mlflow.url
        ))
        .body("weights")
        .send()
        .await
        .unwrap();
    assert!(put.status().is_success(), "{put:?}");
    let mut answers = Vec::new();
    for api in [
        "mlflow-artifacts",
        "mlflow%2Dartifacts",
        "mlflow%2dartifacts",
    ] {
        let delete = http()
            .delete(format!(
                "{}/api/2.0/{api}/artifacts/{experiment}",
                h.proxy.url
            ))
            .send()
            .await
            .unwrap();
        let outside = http()
            .put(format!(
                "{}/api/2.0/{api}/artifacts/{experiment}/planted.txt",
                h.proxy.url
            ))
            .body("x")
            .send()
            .await
            .unwrap();
        answers.push((api, delete.status().as_u16(), outside.status().as_u16()));
    }
    assert!(
        answers
            .iter()
            .all(|(_, delete, outside)| *delete == 403 && *outside == 403),
        "{answers:?}"
    );
    let get = http()
        .get(format!(
            "{}/api/2.0/mlflow-artifacts/artifacts/{file}",
            h.stack.mlflow.url
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(
        get.status(),
        StatusCode::OK,
        "the run's file is still there"
    );
}

/// A `.` segment in an artifact path is the client's mistake: a 4xx it does not retry, for every
/// operation (e93dbfe: 502 from the store, which clients retried for minutes; MLflow 3.17 500).
#[tokio::test]
async fn a_dot_segment_in_an_artifact_path_is_a_client_error_not_a_retryable_5xx() {
    let h = hostile();
    let (experiment, run) = create_experiment_and_run(&h.stack.mlflow.url, "dot-segment").await;
    let root = format!("{experiment}/{run}/artifacts");
    let host = h.proxy.url.trim_start_matches("http://");
    let mut answers = Vec::new();
    // Sent as written (an HTTP client library would remove the segment first).
    for path in [
        format!("{root}/./model.pkl"),
        format!("{root}/%2E/model.pkl"),
    ] {
        for (op, method, body) in [
            ("get", "GET", ""),
            ("put", "PUT", "x"),
            ("delete", "DELETE", ""),
        ] {
            let head = format!(
                "{method} /api/2.0/mlflow-artifacts/artifacts/{path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let (status, _) = raw(&h.proxy.url, &head, body.as_bytes()).await;
            answers.push((path.clone(), op, status));
        }
        let status = http()
            .get(format!(
                "{}/api/2.0/mlflow-artifacts/artifacts",
                h.proxy.url
            ))
            .query(&[("path", path.as_str())])
            .send()
            .await
            .unwrap()
            .status();
        answers.push((path.clone(), "list", status.as_u16()));
    }
    assert!(
        answers
            .iter()
            .all(|(_, _, status)| (400..500).contains(status)),
        "{answers:?}"
    );
}

/// `set-tag` and `log-parameter` bodies longer than a batch (here padded with JSON whitespace to
/// 1.5 and 5 MB) get MLflow's own answer, as straight to MLflow, and are stored (e93dbfe: the
/// proxy's own 400 at 1 MB, a reset mid-upload at 5 MB).
#[tokio::test]
async fn params_and_tags_in_bodies_longer_than_a_batch_are_stored_as_mlflow_stores_them() {
    let h = hostile();
    for (size, endpoint, key) in [
        (1_500_000, "runs/set-tag", "padded-tag"),
        (5_000_000, "runs/set-tag", "padded-tag-5mb"),
        (1_500_000, "runs/log-parameter", "padded-param"),
    ] {
        let mut answers = Vec::new();
        for base in [&h.stack.mlflow.url, &h.proxy.url] {
            let (_, run) = create_experiment_and_run(&h.stack.mlflow.url, "long-pairs").await;
            let json = json!({"run_id": run, "key": key, "value": "v"}).to_string();
            let body = format!("{}{}}}", &json[..json.len() - 1], " ".repeat(size));
            let response = http()
                .post(format!("{base}/api/2.0/mlflow/{endpoint}"))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap();
            let status = response.status().as_u16();
            let run_json = crate::mlflow::get_run(&h.stack.mlflow.url, &run).await;
            let data = &run_json["run"]["data"];
            let stored = data["tags"]
                .as_array()
                .into_iter()
                .chain(data["params"].as_array())
                .flatten()
                .any(|pair| pair["key"] == key && pair["value"] == "v");
            answers.push((status, stored));
        }
        assert_eq!(
            answers[1], answers[0],
            "{endpoint} of {size} bytes: through the proxy, straight to MLflow"
        );
        assert_eq!(answers[0], (200, true), "{endpoint} of {size} bytes");
    }
}

/// The job of finding 2: eight ranks, each logging one metric every 100 ms with MLflow's own
/// client (`MlflowClient.log_metric`, retries and all), for `STEPS` steps; prints the run and every
/// exception a call raised.
const TRAINING_JOB: &str = r#"
import os, sys, threading, time, uuid
from mlflow.tracking import MlflowClient
client = MlflowClient()
experiment = client.create_experiment(f"fair-job-{uuid.uuid4().hex}")
run = client.create_run(experiment).info.run_id
steps = int(os.environ["STEPS"])
errors = []
def rank(r):
    for step in range(steps):
        try:
            client.log_metric(run, f"loss/{r}", step * 0.1, step=step)
        except Exception as e:
            errors.append(repr(e))
        time.sleep(0.1)
threads = [threading.Thread(target=rank, args=(r,)) for r in range(8)]
for t in threads: t.start()
for t in threads: t.join()
print(f"run {run}", flush=True)
print(f"errors {len(errors)}", flush=True)
for e in errors[:5]: print(e, flush=True)
"#;

/// The sum of `mlscope_fair_share_writes_total{outcome="refused"}` over every reason.
fn fair_share_refusals(metrics: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| {
            l.starts_with("mlscope_fair_share_writes_total") && l.contains("outcome=\"refused\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Finding 2: a training job of 8 ranks under one address, with MLflow's own client, beside 30
/// readers polling `/version`, 3 clients trickling `set-tag` bodies and 24 invented credentials
/// (each primed with `/health`, then writing what the proxy answers itself), through the proxy's
/// defaults: the governor halved its limit to 1 on ordinary concurrency, shared it among the
/// readers and refused the job (26 of 160 `log_metric` calls raised). Now no write is refused,
/// no call raises, and every sample is stored.
#[tokio::test(flavor = "multi_thread")]
async fn a_training_job_beside_readers_tricklers_and_invented_credentials_is_never_refused() {
    use base64::Engine as _;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
    const STEPS: usize = 30;
    // An MLflow of its own: the flood of the test above, run at the same time against a shared
    // MLflow, exhausts MLflow's own connection pool (its 400 "QueuePool limit"), which is not
    // what this test is about.
    static STACK: OnceLock<Result<TestStack, String>> = OnceLock::new();
    let stack = crate::module_stack(&STACK, "training-job stack");
    let dir = tempfile::tempdir().unwrap();
    let proxy = spawn_proxy(
        &stack.mlflow.url,
        &["--trusted-proxies", "127.0.0.1"],
        dir.path(),
    )
    .unwrap();
    let (_, other_run) = create_experiment_and_run(&stack.mlflow.url, "fair-job-other").await;
    let (done, reads) = (AtomicBool::new(false), AtomicUsize::new(0));
    let base = proxy.url.clone();
    let readers = futures_util::future::join_all((0..30).map(|i| {
        let (base, done, reads) = (&base, &done, &reads);
        async move {
            let client = http();
            while !done.load(Relaxed) {
                let answer = client
                    .get(format!("{base}/version"))
                    .header("x-forwarded-for", format!("198.51.100.{}", i + 1))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(answer.status(), StatusCode::OK);
                reads.fetch_add(1, Relaxed);
                tokio::time::sleep(Duration::from_millis(1500)).await;
            }
        }
    }));
    let invented = futures_util::future::join_all((0..24).map(|i| {
        let (base, done, other_run) = (&base, &done, &other_run);
        async move {
            let client = http();
            let credential = format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("invented-{i}:x"))
            );
            while !done.load(Relaxed) {
                let health = client
                    .get(format!("{base}/health"))
                    .header("authorization", &credential)
                    .header("x-forwarded-for", "192.0.2.200")
                    .send()
                    .await
                    .unwrap();
                assert_eq!(health.status(), StatusCode::OK);
                // run_id and run_uuid naming different runs: the proxy answers 400 itself.
                let write = client
                    .post(format!("{base}/api/2.0/mlflow/runs/log-batch"))
                    .header("authorization", &credential)
                    .header("x-forwarded-for", "192.0.2.200")
                    .json(&json!({"run_id": other_run, "run_uuid": "0123456789abcdef", "metrics": [{"key": "m", "value": 1, "timestamp": now_ms(), "step": 0}]}))
                    .send()
                    .await
                    .unwrap();
                assert!(write.status().is_client_error(), "{}", write.status());
                tokio::time::sleep(Duration::from_millis(1500)).await;
            }
        }
    }));
    let tricklers = futures_util::future::join_all((0..3).map(|i| {
        let (address, done, other_run) = (
            base.trim_start_matches("http://").to_owned(),
            &done,
            &other_run,
        );
        async move {
            while !done.load(Relaxed) {
                let body = json!({"run_id": other_run, "key": format!("trickle-{i}"), "value": "x".repeat(100)}).to_string();
                let head = format!(
                    "POST /api/2.0/mlflow/runs/set-tag HTTP/1.1\r\nHost: {address}\r\nX-Forwarded-For: 203.0.113.{}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                    i + 1,
                    body.len()
                );
                let mut socket = tokio::net::TcpStream::connect(&address).await.unwrap();
                socket.write_all(head.as_bytes()).await.unwrap();
                for byte in body.as_bytes() {
                    if done.load(Relaxed) || socket.write_all(&[*byte]).await.is_err() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_secs(3)).await;
                }
            }
        }
    }));
    let job = async {
        // Every reader has read before the job starts.
        eventually(
            Duration::from_secs(60),
            "every reader's first read",
            async || match reads.load(Relaxed) {
                n if n >= 30 => Ok(()),
                n => Err(format!("{n} reads")),
            },
        )
        .await;
        let child = crate::python_client::python(&proxy.url, &[("STEPS", &STEPS.to_string())])
            .args(["-c", TRAINING_JOB])
            .spawn()
            .expect("starting python");
        let finished = crate::python_client::finish(child, Duration::from_secs(600)).await;
        done.store(true, Relaxed);
        finished
    };
    let ((ok, stdout, stderr), ..) = tokio::join!(job, readers, invented, tricklers);
    assert!(
        ok,
        "the job failed\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    );
    assert!(
        stdout.contains("errors 0\n"),
        "log_metric raised\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    );
    let refused = fair_share_refusals(&scrape(&proxy.admin_url).await);
    assert_eq!(refused, 0.0, "writes refused by the fair share");
    let run = stdout
        .lines()
        .find_map(|l| l.strip_prefix("run "))
        .expect("the job's run");
    for rank in 0..8 {
        assert_eq!(
            history(&stack.mlflow.url, run, &format!("loss/{rank}"))
                .await
                .len(),
            STEPS,
            "rank {rank}"
        );
    }
}
