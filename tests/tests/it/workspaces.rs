//! MLflow workspaces (`mlflow server --enable-workspaces`) through the proxy with the artifact
//! gateway on: every step of a training job in a non-default workspace works as it does straight
//! to MLflow, and its files land where MLflow places them (`workspaces/<name>/...`).

use std::sync::OnceLock;
use std::time::Duration;

use mlscope_tests::{
    eventually, repo_root, spawn_proxy, ProxyProcess, S3Store, StackOptions, TestStack,
};
use serde_json::{json, Value};

use crate::python_client::{finish, python};

struct Workspaces {
    stack: TestStack,
    proxy: ProxyProcess,
}

fn workspaces() -> &'static Workspaces {
    static STACK: OnceLock<Workspaces> = OnceLock::new();
    STACK.get_or_init(|| {
        let stack = TestStack::start(StackOptions {
            proxy: false,
            mlflow_args: vec!["--enable-workspaces".into()],
            ..StackOptions::default()
        })
        .expect("starting MLflow with --enable-workspaces");
        let args = stack.s3.gateway_args(&stack.s3.url);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let proxy =
            spawn_proxy(&stack.mlflow.url, &args, stack.dir.path()).expect("starting the proxy");
        let client = reqwest::blocking::Client::new();
        for name in ["team-a", "team-b"] {
            let created = client
                .post(format!("{}/api/3.0/mlflow/workspaces", stack.mlflow.url))
                .json(&json!({ "name": name }))
                .send()
                .unwrap();
            assert!(
                created.status().is_success(),
                "creating workspace {name}: {created:?}"
            );
        }
        Workspaces { stack, proxy }
    })
}

/// The client steps of `tests/python/workspace_client.py` in `workspace`, against `url`.
async fn job(url: &str, workspace: &str, suffix: &str) -> Value {
    let scratch = tempfile::tempdir().unwrap();
    let child = python(
        url,
        &[
            ("WORKSPACE", workspace),
            ("SUFFIX", suffix),
            // load_model keeps its download: in a directory the test removes.
            ("TMPDIR", scratch.path().to_str().unwrap()),
        ],
    )
    .arg(repo_root().join("tests/python/workspace_client.py"))
    .spawn()
    .unwrap();
    let (ok, stdout, stderr) = finish(child, Duration::from_secs(300)).await;
    assert!(ok, "--- stdout\n{stdout}\n--- stderr\n{stderr}");
    serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e}: {stdout}\n{stderr}"))
}

/// The steps' outcomes, without what differs between two runs (ids).
fn outcomes(results: &Value) -> Value {
    let mut outcomes = results.clone();
    let object = outcomes.as_object_mut().unwrap();
    object.remove("artifact_uri");
    object.remove("model_id");
    outcomes
}

#[tokio::test]
async fn a_training_job_in_a_workspace_works_through_the_gateway_as_straight_to_mlflow() {
    // Started on a blocking thread: the setup uses blocking HTTP.
    let w = tokio::task::spawn_blocking(workspaces).await.unwrap();
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    for workspace in ["team-a", "team-b", "default"] {
        let direct = job(&w.stack.mlflow.url, workspace, &format!("direct-{suffix}")).await;
        let through = job(&w.proxy.url, workspace, &format!("through-{suffix}")).await;
        let every_step_ok = |r: &Value| {
            outcomes(r)
                .as_object()
                .unwrap()
                .values()
                .all(|outcome| outcome[0] == "ok")
        };
        assert!(
            every_step_ok(&direct),
            "straight to MLflow in {workspace}: {direct}"
        );
        assert_eq!(outcomes(&through), outcomes(&direct), "in {workspace}");
        assert_eq!(through["listing"][1], json!(["checkpoints/ckpt.bin"]));
        // The model's metrics on a dataset kept every MLflow 3 field through the coalescer, and
        // the finalized model is found by search.
        assert_eq!(
            through["model_metrics"][1],
            json!([
                ["eval_loss", 0.5 / 3.0, 2, "eval-set", "d1g3st"],
                ["eval_loss", 0.25, 1, "eval-set", "d1g3st"],
                ["eval_loss", 0.5, 0, "eval-set", "d1g3st"]
            ]),
            "{through}"
        );
        assert_eq!(
            through["search_models"][1],
            json!([["echo", "READY"]]),
            "{through}"
        );

        // The gateway put the checkpoint where MLflow puts a workspace's files.
        let uri = through["artifact_uri"].as_str().unwrap();
        let root = uri.strip_prefix("mlflow-artifacts:/").unwrap();
        if workspace != "default" {
            assert!(
                root.starts_with(&format!("workspaces/{workspace}/")),
                "{uri}"
            );
        }
        let object = reqwest::get(format!(
            "{}/{}/{}/{root}/checkpoints/ckpt.bin",
            w.stack.s3.url,
            S3Store::BUCKET,
            S3Store::PREFIX
        ))
        .await
        .unwrap();
        assert_eq!(object.status().as_u16(), 200, "the object under {root}");
        assert_eq!(object.bytes().await.unwrap().len(), 256 * 64);
    }
}

#[tokio::test]
async fn a_path_of_another_workspace_is_refused_as_mlflow_refuses_it() {
    // Started on a blocking thread: the setup uses blocking HTTP.
    let w = tokio::task::spawn_blocking(workspaces).await.unwrap();
    let client = reqwest::Client::new();
    let path = "workspaces/team-a/1/0123456789abcdef/artifacts/checkpoints/ckpt.bin";
    let mut answers = Vec::new();
    for base in [&w.stack.mlflow.url, &w.proxy.url] {
        let mut answer = Vec::new();
        for (method, workspace) in [("GET", "team-b"), ("PUT", "team-b"), ("GET", "")] {
            let mut request = client.request(
                method.parse().unwrap(),
                format!("{base}/api/2.0/mlflow-artifacts/artifacts/{path}"),
            );
            if !workspace.is_empty() {
                request = request.header("X-MLFLOW-WORKSPACE", workspace);
            }
            if method == "PUT" {
                request = request.body("x");
            }
            let response = request.send().await.unwrap();
            let status = response.status().as_u16();
            let body: Value = response.json().await.unwrap_or(Value::Null);
            answer.push((
                method,
                workspace,
                status,
                body["error_code"].clone(),
                body["message"].clone(),
            ));
        }
        answers.push(answer);
    }
    assert_eq!(
        answers[1], answers[0],
        "through the gateway, as MLflow answers"
    );
    assert!(
        answers[0].iter().all(|(_, _, status, ..)| *status == 400),
        "{:?}",
        answers[0]
    );
}

/// Without authentication, a workspace header MLflow refuses (400) or a workspace it does not
/// have (404) gets MLflow's answer through the gateway for every artifact operation, never the
/// gateway's own 200 with an empty listing or a file of another workspace.
#[tokio::test]
async fn a_workspace_mlflow_refuses_or_does_not_have_gets_mlflow_s_answer_through_the_gateway() {
    let w = tokio::task::spawn_blocking(workspaces).await.unwrap();
    let client = reqwest::Client::new();
    let run_root = "1/0123456789abcdef0123456789abcdef/artifacts";
    // A file in team-a's run, straight into MLflow.
    let put = client
        .put(format!(
            "{}/api/2.0/mlflow-artifacts/artifacts/{run_root}/secret.txt",
            w.stack.mlflow.url
        ))
        .header("X-MLFLOW-WORKSPACE", "team-a")
        .body("secret")
        .send()
        .await
        .unwrap();
    assert!(put.status().is_success(), "{put:?}");
    let cases: [(&str, String); 5] = [
        (
            "team-a/1/0123456789abcdef0123456789abcdef/artifacts",
            String::new(),
        ),
        (
            "default/1",
            "0123456789abcdef0123456789abcdef/artifacts".to_owned(),
        ),
        ("Team-A", run_root.to_owned()),
        ("team-a/..", format!("team-a/{run_root}")),
        ("no-such-team", run_root.to_owned()),
    ];
    let mut answers = Vec::new();
    for base in [&w.stack.mlflow.url, &w.proxy.url] {
        let mut answer = Vec::new();
        for (workspace, below) in &cases {
            let file = if below.is_empty() {
                "secret.txt".to_owned()
            } else {
                format!("{below}/secret.txt")
            };
            let api = format!("{base}/api/2.0/mlflow-artifacts");
            for (op, request) in [
                ("get", client.get(format!("{api}/artifacts/{file}"))),
                ("head", client.head(format!("{api}/artifacts/{file}"))),
                (
                    "list",
                    client
                        .get(format!("{api}/artifacts"))
                        .query(&[("path", below)]),
                ),
                ("presigned", client.get(format!("{api}/presigned/{file}"))),
                ("delete", client.delete(format!("{api}/artifacts/{file}"))),
            ] {
                let response = request
                    .header("X-MLFLOW-WORKSPACE", *workspace)
                    .send()
                    .await
                    .unwrap();
                let status = response.status().as_u16();
                let body: Value = response.json().await.unwrap_or(Value::Null);
                answer.push((*workspace, op, status, body["error_code"].clone()));
            }
        }
        answers.push(answer);
    }
    assert_eq!(
        answers[1], answers[0],
        "through the gateway, as MLflow answers"
    );
    assert!(
        answers[0]
            .iter()
            .all(|(_, _, status, _)| (400..500).contains(status)),
        "{:?}",
        answers[0]
    );
    // The file is still there.
    let get = client
        .get(format!(
            "{}/api/2.0/mlflow-artifacts/artifacts/{run_root}/secret.txt",
            w.stack.mlflow.url
        ))
        .header("X-MLFLOW-WORKSPACE", "team-a")
        .send()
        .await
        .unwrap();
    assert_eq!(get.status(), 200);
}

/// MLflow's REST API in `workspace`: POST `path` with `body`, the answer's JSON.
async fn in_workspace(base: &str, workspace: &str, method: &str, path: &str, body: Value) -> Value {
    let client = reqwest::Client::new();
    let url = format!("{base}/api/2.0/mlflow/{path}");
    let request = match method {
        "GET" => client.get(url).query(
            &body
                .as_object()
                .unwrap()
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
                .collect::<Vec<_>>(),
        ),
        _ => client.post(url).json(&body),
    };
    let response = request
        .header("X-MLFLOW-WORKSPACE", workspace)
        .send()
        .await
        .unwrap();
    let status = response.status();
    let answer: Value = response.json().await.unwrap_or(Value::Null);
    assert!(
        status.is_success(),
        "{method} {path} in {workspace}: {status} {answer}"
    );
    answer
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_run_in_a_workspace_is_ended_failed_and_its_node_series_kept_once() {
    let w = tokio::task::spawn_blocking(workspaces).await.unwrap();
    let mlflow = w.stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let proxy = spawn_proxy(
        mlflow,
        &[
            "--run-stale-after",
            "3s",
            "--health-sweep-interval",
            "300ms",
            "--health-flush-interval",
            "200ms",
        ],
        dir.path(),
    )
    .unwrap();
    let workspace = "team-b";
    let name = format!("health-{}", uuid::Uuid::new_v4().simple());
    let experiment = in_workspace(
        mlflow,
        workspace,
        "POST",
        "experiments/create",
        json!({ "name": name }),
    )
    .await;
    let run = in_workspace(
        mlflow,
        workspace,
        "POST",
        "runs/create",
        json!({ "experiment_id": experiment["experiment_id"], "start_time": crate::mlflow::now_ms() }),
    )
    .await;
    let run_id = run["run"]["info"]["run_id"].as_str().unwrap().to_owned();

    // Two ranks of one node, as a pod in the workspace runs them (MLFLOW_WORKSPACE set).
    let ranks: Vec<mlscope_tests::Process> = (0..2)
        .map(|rank| {
            let mut command = std::process::Command::new(mlscope_tests::collector_binary());
            command
                .env("MLFLOW_TRACKING_URI", &proxy.url)
                .env("MLFLOW_RUN_ID", &run_id)
                .env("MLFLOW_WORKSPACE", workspace)
                .env("NODE_NAME", "node-w")
                .env("RANK", rank.to_string())
                .env("MLSCOPE_LOG_FORMAT", "json")
                .args(["--interval", "1", "--", "sleep", "300"]);
            let log = dir.path().join(format!("collector-{rank}.log"));
            mlscope_tests::Process::spawn("mlscope-collector", &command, &log).unwrap()
        })
        .collect();
    // Both ranks publish side by side for a few samples: the node series has three steps.
    eventually(
        Duration::from_secs(60),
        format_args!("samples of both ranks and three of the node series in {workspace}"),
        async || {
            let run = in_workspace(
                mlflow,
                workspace,
                "GET",
                "runs/get",
                json!({ "run_id": run_id }),
            )
            .await;
            let keys: Vec<&str> = run["run"]["data"]["metrics"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|m| m["key"].as_str())
                .collect();
            let node_key = keys.iter().find(|k| k.starts_with("system/node-w/node_"));
            let both = ["system/rank-0/", "system/rank-1/"]
                .iter()
                .all(|rank| keys.iter().any(|k| k.starts_with(rank)));
            let (Some(node_key), true) = (node_key, both) else {
                return Err(format!("keys {keys:?}"));
            };
            let history = in_workspace(
                mlflow,
                workspace,
                "GET",
                "metrics/get-history",
                json!({ "run_id": run_id, "metric_key": node_key }),
            )
            .await;
            match history["metrics"].as_array().map_or(0, Vec::len) {
                n if n >= 3 => Ok(()),
                n => Err(format!("{n} points of {node_key}")),
            }
        },
    )
    .await;
    // The pod vanishes: no word from either rank again.
    for mut rank in ranks {
        rank.kill();
    }

    let run = eventually(
        Duration::from_secs(60),
        format_args!("the dead run in {workspace} ended FAILED"),
        async || {
            let run = in_workspace(
                mlflow,
                workspace,
                "GET",
                "runs/get",
                json!({ "run_id": run_id }),
            )
            .await;
            if run["run"]["info"]["status"] == "FAILED" {
                Ok(run)
            } else {
                Err(format!("{run}\n{}", proxy.process.log_tail()))
            }
        },
    )
    .await;
    let keys: Vec<&str> = run["run"]["data"]["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["key"].as_str())
        .collect();
    assert!(
        keys.iter().any(|k| k.starts_with("system/node-w/node_")),
        "the node's series, scoped: {keys:?}"
    );
    // One copy of the node series for the two co-located ranks: the history holds one sample per
    // step, not two.
    let node_key = keys
        .iter()
        .find(|k| k.starts_with("system/node-w/node_"))
        .unwrap()
        .to_string();
    let history = in_workspace(
        mlflow,
        workspace,
        "GET",
        "metrics/get-history",
        json!({ "run_id": run_id, "metric_key": node_key }),
    )
    .await;
    let steps: Vec<i64> = history["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["step"].as_i64())
        .collect();
    let mut unique = steps.clone();
    unique.sort_unstable();
    unique.dedup();
    assert!(!steps.is_empty());
    assert_eq!(
        steps.len(),
        unique.len(),
        "{node_key}: one sample per step: {steps:?}"
    );
}
