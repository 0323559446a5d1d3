//! MLflow workspaces (`mlflow server --enable-workspaces`) through the proxy with the artifact
//! gateway on: every step of a training job in a non-default workspace works as it does straight
//! to MLflow, and its files land where MLflow places them (`workspaces/<name>/...`).

use std::sync::OnceLock;
use std::time::Duration;

use mlscope_tests::{repo_root, spawn_proxy, ProxyProcess, S3Store, StackOptions, TestStack};
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
