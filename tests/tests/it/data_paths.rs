//! Data paths end to end: the collector's `--data` through the proxy into the real MLflow. The
//! fingerprint is the run's dataset input (MLflow's own Datasets panel) and moves only when the
//! files do; `--preflight enforce` with a missing path leaves the run `FAILED` with the reason
//! and the run checks on its page.

use std::path::Path;
use std::time::{Duration, Instant};

use mlscope_tests::TestStack;
use serde_json::{json, Value};

use crate::collector::{start_collector_with, wait_exit};
use crate::mlflow::{create_run, get_run, now_ms, post, run_tags};

/// `(name, digest, source_type, source)` of every dataset input of the run.
async fn dataset_inputs(mlflow: &str, run_id: &str) -> Vec<(String, String, String, String)> {
    let run = get_run(mlflow, run_id).await;
    run["run"]["inputs"]["dataset_inputs"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|input| {
            let d = &input["dataset"];
            let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
            (
                text(&d["name"]),
                text(&d["digest"]),
                text(&d["source_type"]),
                text(&d["source"]),
            )
        })
        .collect()
}

async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut ready: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !ready().await {
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn waiting_command(marker: &Path) -> String {
    format!(
        "while [ ! -e '{}' ]; do sleep 0.1; done; exit 0",
        marker.display()
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_data_path_is_the_runs_dataset_input_whose_digest_moves_with_its_files_only() {
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let val = dir.path().join("val");
    std::fs::create_dir_all(val.join("shards")).unwrap();
    for (file, text) in [
        ("shards/a.tar", "aaaa"),
        ("shards/b.tar", "bb"),
        ("index.json", "{}"),
    ] {
        std::fs::write(val.join(file), text).unwrap();
    }
    let marker = dir.path().join("end");
    let run_id = create_run(mlflow, "data-paths").await;
    let data = format!("val={}", val.display());
    let script = waiting_command(&marker);
    let collector = start_collector_with(
        dir.path(),
        stack.proxy_url(),
        &run_id,
        "node-data",
        0,
        &["--data", &data, "--data-interval", "1s"],
        &["sh", "-c", &script],
    );
    wait_until(
        "the first dataset input",
        Duration::from_secs(60),
        || async { !dataset_inputs(mlflow, &run_id).await.is_empty() },
    )
    .await;
    let first = dataset_inputs(mlflow, &run_id).await;
    let (name, digest, source_type, source) = first[0].clone();
    assert_eq!((name.as_str(), source_type.as_str()), ("val", "local"));
    assert_eq!(
        serde_json::from_str::<Value>(&source).unwrap(),
        json!({"uri": val.to_str().unwrap()})
    );
    let tags = run_tags(mlflow, &run_id).await;
    assert_eq!(tags["mlscope/data/val/fingerprint"], digest);
    assert_eq!(tags["mlscope/data/val/files"], "3");
    assert_eq!(tags["mlscope/data/val/bytes"], "8");
    assert_eq!(tags["mlscope/data/val/path"], val.to_str().unwrap());
    assert_eq!(tags["mlscope/rank-0/preflight_run"], "RUNNING");
    assert_eq!(
        tags["mlscope/rank-0/artifact_root"],
        "through the proxy (mlflow-artifacts:)"
    );
    assert!(
        tags["mlscope/rank-0/data_val_mount"].contains(" at /"),
        "{tags:?}"
    );

    // Three rounds over unchanged files: no second input, no change.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(dataset_inputs(mlflow, &run_id).await.len(), 1);
    assert!(!run_tags(mlflow, &run_id)
        .await
        .contains_key("mlscope/data/val/changed"));

    std::fs::write(val.join("shards/b.tar"), "rewritten").unwrap();
    wait_until(
        "a second dataset input",
        Duration::from_secs(30),
        || async { dataset_inputs(mlflow, &run_id).await.len() >= 2 },
    )
    .await;
    let digests: Vec<String> = dataset_inputs(mlflow, &run_id)
        .await
        .into_iter()
        .map(|(_, d, _, _)| d)
        .collect();
    assert_eq!(digests.len(), 2);
    assert!(
        digests.contains(&digest) && digests[0] != digests[1],
        "{digests:?}"
    );
    let tags = run_tags(mlflow, &run_id).await;
    assert!(
        tags["mlscope/data/val/changed"]
            .ends_with("rank 0: 0 vanished, 0 appeared, 1 changed: shards/b.tar"),
        "{tags:?}"
    );
    assert_ne!(tags["mlscope/data/val/fingerprint"], digest);

    std::fs::write(&marker, "").unwrap();
    assert_eq!(wait_exit(collector).await, Some(0));
    let tags = run_tags(mlflow, &run_id).await;
    assert_eq!(tags["mlscope/rank-0/outcome"], "exited");
    assert!(!tags.contains_key("mlscope/rank-0/data_changed_before_exit"));
}

#[tokio::test(flavor = "multi_thread")]
async fn preflight_enforce_with_a_missing_path_leaves_the_run_failed_with_its_reason() {
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    // Artifacts straight to a bucket, not through the tracking server: the run check says so.
    let experiment = post(
        mlflow,
        "experiments/create",
        json!({
            "name": format!("data-preflight-{}", uuid::Uuid::new_v4().simple()),
            "artifact_location": "s3://elsewhere/direct",
        }),
    )
    .await;
    let run = post(
        mlflow,
        "runs/create",
        json!({"experiment_id": experiment["experiment_id"], "start_time": now_ms()}),
    )
    .await;
    let run_id = run["run"]["info"]["run_id"].as_str().unwrap().to_owned();
    let missing = dir.path().join("val");
    let ran = dir.path().join("ran");
    let data = format!("val={}", missing.display());
    let collector = start_collector_with(
        dir.path(),
        stack.proxy_url(),
        &run_id,
        "node-data",
        3,
        &["--data", &data, "--preflight", "enforce"],
        &["touch", ran.to_str().unwrap()],
    );
    assert_eq!(wait_exit(collector).await, Some(78));
    assert!(!ran.exists(), "the command must not start");
    let run = get_run(mlflow, &run_id).await;
    assert_eq!(run["run"]["info"]["status"], "FAILED", "{run}");
    let tags = run_tags(mlflow, &run_id).await;
    for (key, value) in [
        ("mlscope/rank-3/outcome", "preflight_failed".to_owned()),
        ("mlscope/rank-3/exit_code", "78".to_owned()),
        (
            "mlscope/rank-3/data_val_preflight",
            format!("missing: {} does not exist", missing.display()),
        ),
        ("mlscope/rank-3/preflight_run", "RUNNING".to_owned()),
        (
            "mlscope/rank-3/artifact_root",
            format!("direct: s3://elsewhere/direct/{run_id}/artifacts"),
        ),
    ] {
        assert_eq!(tags.get(key), Some(&value), "{key} in {tags:?}");
    }
}
