//! Retries store once: acknowledgements lost on purpose, and the MLflow client's own retry rules
//! (3.17's as installed, 3.18's as its source states them) deciding what is sent again.
//!
//! - A create whose answer MLflow never gave (its connection closed after the request reached
//!   it) is answered with a status neither client retries, so the run exists once.
//! - Batches merged by the coalescer, whose acknowledgements the client never got, are sent again
//!   by the client and stored once each.

use std::sync::OnceLock;

use mlscope_tests::{spawn_proxy, TestStack};
use serde_json::json;

use crate::coalesce::histories;
use crate::mlflow::{create_run, http, post, response_json};
use crate::python_client::python;
use crate::relay::{Relay, Rules};

fn stack() -> &'static TestStack {
    static STACK: OnceLock<Result<TestStack, String>> = OnceLock::new();
    crate::module_stack(&STACK, "retries' MLflow")
}

/// Runs `tests/python/retry_client.py` under `policy` with `envs`; its output lines.
async fn retry_client(tracking_uri: &str, policy: &str, envs: &[(&str, &str)]) -> Vec<String> {
    let script = mlscope_tests::repo_root().join("tests/python/retry_client.py");
    let mut all = vec![
        ("RETRY_POLICY", policy),
        // Quick retries: the test is about what is sent again, not when.
        ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0"),
        // Enough that no batch meets a lost answer on every attempt (a quarter of all answers are
        // lost, whichever client sent them).
        ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "10"),
    ];
    all.extend_from_slice(envs);
    let output = python(tracking_uri, &all)
        .arg(&script)
        .output()
        .await
        .expect("running the retry client");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "retry_client.py ({policy}) failed\n--- stdout\n{stdout}\n--- stderr\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout.lines().map(str::to_owned).collect()
}

/// The ids of the runs of an experiment, asked of MLflow directly.
async fn runs_of(mlflow: &str, experiment_id: &str) -> Vec<String> {
    let found = response_json(
        http()
            .post(format!("{mlflow}/api/2.0/mlflow/runs/search"))
            .json(&json!({"experiment_ids": [experiment_id], "max_results": 100})),
    )
    .await;
    found["runs"]
        .as_array()
        .map(|runs| {
            runs.iter()
                .map(|r| r["info"]["run_id"].as_str().unwrap().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn a_create_whose_answer_mlflow_never_gave_is_not_retried_by_either_client() {
    let stack = stack();
    for policy in ["3.17", "3.18"] {
        // Between the proxy and MLflow: the first runs/create reaches MLflow, which creates the
        // run, and its answer is lost.
        let relay = Relay::start(
            &stack.mlflow.url,
            Rules::losing(|method, path, before| {
                method == http::Method::POST && path.ends_with("/runs/create") && before == 0
            }),
        )
        .await;
        let dir = tempfile::tempdir().unwrap();
        let proxy = spawn_proxy(&relay.url, &[], dir.path()).expect("starting the proxy");
        let name = format!("retries-create-{policy}-{}", uuid::Uuid::new_v4().simple());
        let experiment = post(
            &stack.mlflow.url,
            "experiments/create",
            json!({"name": name}),
        )
        .await;
        let experiment_id = experiment["experiment_id"].as_str().unwrap();

        let lines = retry_client(
            &proxy.url,
            policy,
            &[
                ("RETRY_MODE", "create"),
                ("RETRY_EXPERIMENT_ID", experiment_id),
            ],
        )
        .await;

        assert_eq!(
            relay.lost(),
            1,
            "the relay lost the create's answer: {lines:?}"
        );
        let runs = runs_of(&stack.mlflow.url, experiment_id).await;
        assert_eq!(
            runs.len(),
            1,
            "{policy}: MLflow created the run once, the client did not send it again: {lines:?}"
        );
        let outcome = lines.last().cloned().unwrap_or_default();
        assert!(
            outcome.starts_with("refused 409 ") && outcome.contains("may have applied"),
            "{policy}: the client is told the create may have been applied: {outcome}"
        );
    }
}

#[tokio::test]
async fn merged_batches_sent_again_after_lost_acknowledgements_are_stored_once() {
    let stack = stack();
    for policy in ["3.17", "3.18"] {
        let dir = tempfile::tempdir().unwrap();
        // A coalescing proxy in front of MLflow, and the relay between the clients and it.
        let proxy = spawn_proxy(
            &stack.mlflow.url,
            &["--coalesce-window", "20ms"],
            dir.path(),
        )
        .expect("starting the proxy");
        let relay = Relay::start(
            &proxy.url,
            Rules::losing(|_, path, before| path.ends_with("/runs/log-batch") && before % 4 == 1),
        )
        .await;
        let run_id = create_run(&stack.mlflow.url, &format!("retries-batches-{policy}")).await;
        let (threads, batches, per_batch) = (6usize, 20usize, 5usize);
        let lines = retry_client(
            &relay.url,
            policy,
            &[
                ("RETRY_MODE", "batches"),
                ("RETRY_RUN_ID", &run_id),
                ("RETRY_THREADS", &threads.to_string()),
                ("RETRY_BATCHES", &batches.to_string()),
                ("RETRY_METRICS", &per_batch.to_string()),
            ],
        )
        .await;
        assert!(
            lines.contains(&format!("logged {}", threads * batches))
                && lines.contains(&"failed 0".to_owned()),
            "{policy}: every batch acknowledged in the end: {lines:?}"
        );
        let lost = relay.lost();
        assert!(
            lost >= threads * batches / 5,
            "{policy}: only {lost} acknowledgements lost: the retries were not exercised"
        );
        let stored = histories(&stack.mlflow.url, &run_id).await;
        for t in 0..threads {
            let points = &stored[&format!("m{t}")];
            let steps: Vec<i64> = points.iter().map(|p| p.0).collect();
            let expected: Vec<i64> = (0..(batches * per_batch) as i64).collect();
            assert_eq!(
                steps, expected,
                "{policy}: series m{t} holds each step once after {lost} lost acknowledgements"
            );
            for (step, _, value) in points {
                let sent = (t * 1_000_000) as f64 + *step as f64;
                assert_eq!(
                    value.parse::<f64>().unwrap(),
                    sent,
                    "{policy}: m{t} step {step}"
                );
            }
        }
    }
}
