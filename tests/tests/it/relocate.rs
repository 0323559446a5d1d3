//! `mlscope-proxy relocate` against real SeaweedFS and MLflow: checkpoints that an upload hook wrote
//! beside MLflow's layout are copied into a run, where MLflow itself lists and serves them.

use std::process::Output;
use std::sync::OnceLock;
use std::time::Duration;

use mlscope_tests::{proxy_binary, TestStack};

use crate::mlflow::{create_experiment_and_run, http, response_json};
use crate::objects::{pattern, sha256};

/// SeaweedFS and MLflow (no proxy: `relocate` talks to both directly), shared by this module.
fn stack() -> &'static TestStack {
    static STACK: OnceLock<Result<TestStack, String>> = OnceLock::new();
    crate::module_stack(&STACK, "relocate test stack")
}

/// Runs `mlscope-proxy --upstream <mlflow> relocate <args> <gateway flags>`.
async fn relocate(stack: &TestStack, args: &[&str]) -> Output {
    let mut command = tokio::process::Command::new(proxy_binary());
    command
        .args(["--upstream", &stack.mlflow.url, "relocate"])
        .args(args)
        .args(stack.s3.gateway_args(&stack.s3.url))
        .env("AWS_ACCESS_KEY_ID", "mlscope")
        .env("AWS_SECRET_ACCESS_KEY", "mlscope")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .kill_on_drop(true);
    tokio::time::timeout(Duration::from_secs(180), command.output())
        .await
        .expect("relocate finishes within 3 minutes")
        .expect("running mlscope-proxy relocate")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// The number at the start of the summary line `<name>: <n> ...`.
fn count(output: &Output, name: &str) -> u64 {
    let text = stdout(output);
    let line = text
        .lines()
        .find(|l| l.split_once(':').is_some_and(|(label, _)| label == name))
        .unwrap_or_else(|| panic!("no {name:?} line in the summary:\n{text}"));
    let value = line
        .split_once(':')
        .map(|(_, v)| v.trim())
        .unwrap_or_default();
    value
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{name:?} is not a number: {line}"))
}

fn object_url(stack: &TestStack, key: &str) -> String {
    format!("{}/{}/{}", stack.s3.url, stack.s3.bucket, encode(key))
}

/// Percent-encodes what the test keys hold besides unreserved characters and `/`.
fn encode(path: &str) -> String {
    path.replace('%', "%25")
        .replace(' ', "%20")
        .replace('+', "%2B")
}

/// Writes an object straight into SeaweedFS (it accepts unsigned requests), as the upload hook did.
async fn put_object(stack: &TestStack, key: &str, body: Vec<u8>) {
    let response = http()
        .put(object_url(stack, key))
        .body(body)
        .send()
        .await
        .unwrap();
    assert!(
        response.status().is_success(),
        "PUT {key}: {}",
        response.status()
    );
}

async fn exists(stack: &TestStack, key: &str) -> bool {
    let status = http()
        .head(object_url(stack, key))
        .send()
        .await
        .unwrap()
        .status();
    assert!(status == 200 || status == 404, "HEAD {key}: {status}");
    status == 200
}

#[tokio::test(flavor = "multi_thread")]
async fn stray_checkpoints_are_copied_into_the_run_where_mlflow_lists_and_serves_them() {
    let stack = stack();
    let mlflow = &stack.mlflow.url;
    let (experiment, run_id) = create_experiment_and_run(mlflow, "relocate").await;
    let stray = format!("my-experiment-{}", &run_id[..8]);
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("epoch_1.pt", pattern(1024, 1)),
        ("epoch_2.pt", pattern(300 << 10, 2)),
        ("sub/epoch_3.pt", pattern(10, 3)),
        ("epoch 4+.pt", pattern(2048, 4)),
        // Above --max-single-copy 8MiB: five UploadPartCopy parts of 5MiB, the last one short.
        ("big.pt", pattern((20 << 20) + 123, 5)),
    ];
    let total: u64 = files.iter().map(|(_, data)| data.len() as u64).sum();
    for (name, data) in &files {
        put_object(stack, &format!("{stray}/{name}"), data.clone()).await;
    }
    // A "folder" marker, and a sibling that merely shares the prefix.
    put_object(stack, &format!("{stray}/"), Vec::new()).await;
    put_object(stack, &format!("{stray}-other/not-mine.pt"), pattern(10, 6)).await;

    let source = format!("s3://{}/{stray}", stack.s3.bucket);
    let run_dir = format!("artifacts/{experiment}/{run_id}/artifacts/checkpoints");
    let common = [
        "--run-id",
        &run_id,
        "--part-size",
        "5MiB",
        "--max-single-copy",
        "8MiB",
    ];

    // Dry run: the plan, and nothing copied.
    let mut args = vec![source.as_str(), "--dry-run"];
    args.extend(common);
    let dry = relocate(stack, &args).await;
    assert!(
        dry.status.success(),
        "dry run: {}\n{}",
        stdout(&dry),
        stderr(&dry)
    );
    let plan = stdout(&dry);
    assert!(plan.contains("dry run: nothing was copied"), "{plan}");
    assert!(
        plan.contains(&format!("copy s3://mlflow/{stray}/epoch_1.pt -> s3://mlflow/{run_dir}/epoch_1.pt (1.00 KiB, 1024 bytes")),
        "{plan}"
    );
    assert!(
        plan.contains(&format!("s3://mlflow/{run_dir}/sub/epoch_3.pt")),
        "{plan}"
    );
    assert!(
        plan.contains("multipart copy, 5 parts of 5.00 MiB"),
        "{plan}"
    );
    assert!(
        !plan.contains("not-mine"),
        "a sibling prefix is not part of the source: {plan}"
    );
    assert_eq!(count(&dry, "objects found"), 5, "{plan}");
    assert_eq!(count(&dry, "would copy"), 5, "{plan}");
    for (name, _) in &files {
        assert!(
            !exists(stack, &format!("{run_dir}/{name}")).await,
            "the dry run copied {name}"
        );
    }

    // The copy.
    let mut args = vec![source.as_str()];
    args.extend(common);
    let first = relocate(stack, &args).await;
    assert!(
        first.status.success(),
        "relocate: {}\n{}",
        stdout(&first),
        stderr(&first)
    );
    let summary = stdout(&first);
    println!("{summary}");
    assert_eq!(count(&first, "objects found"), 5, "{summary}");
    assert_eq!(count(&first, "copied"), 5, "{summary}");
    assert!(summary.contains("(1 by multipart copy)"), "{summary}");
    assert_eq!(count(&first, "already there"), 0, "{summary}");
    assert_eq!(count(&first, "failed"), 0, "{summary}");
    assert_eq!(count(&first, "verified"), 5, "{summary}");
    assert_eq!(count(&first, "sources deleted"), 0, "{summary}");
    assert!(
        summary.contains(&format!("({total} bytes)")),
        "bytes copied: {summary}"
    );

    // MLflow serves every copy byte for byte, and lists them in the run.
    for (name, data) in &files {
        let url = format!("{mlflow}/api/2.0/mlflow-artifacts/artifacts/{experiment}/{run_id}/artifacts/checkpoints/{}", encode(name));
        let response = http().get(&url).send().await.unwrap();
        assert_eq!(response.status(), 200, "GET {url}");
        let body = response.bytes().await.unwrap();
        assert_eq!(
            sha256(&body),
            sha256(data),
            "{name} differs from its source"
        );
    }
    let checkpoints = format!("{experiment}/{run_id}/artifacts/checkpoints");
    let listing = response_json(
        http()
            .get(format!("{mlflow}/api/2.0/mlflow-artifacts/artifacts"))
            .query(&[("path", checkpoints)]),
    )
    .await;
    let mut names: Vec<&str> = listing["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    names.sort_unstable();
    assert_eq!(
        names,
        ["big.pt", "epoch 4+.pt", "epoch_1.pt", "epoch_2.pt", "sub"],
        "{listing}"
    );
    let run_listing = response_json(
        http()
            .get(format!("{mlflow}/api/2.0/mlflow/artifacts/list"))
            .query(&[("run_id", run_id.as_str()), ("path", "checkpoints")]),
    )
    .await;
    let big = run_listing["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["path"] == "checkpoints/big.pt");
    assert_eq!(
        big.map(|f| f["file_size"].as_u64()),
        Some(Some((20 << 20) + 123)),
        "{run_listing}"
    );
    for (name, _) in &files {
        assert!(
            exists(stack, &format!("{stray}/{name}")).await,
            "the source {name} is kept without --delete-source"
        );
    }

    // Resumable: an interrupted copy (a short target) is copied again, the rest is skipped.
    put_object(stack, &format!("{run_dir}/epoch_2.pt"), pattern(5, 7)).await;
    let second = relocate(stack, &args).await;
    assert!(
        second.status.success(),
        "rerun: {}\n{}",
        stdout(&second),
        stderr(&second)
    );
    assert_eq!(count(&second, "copied"), 1, "{}", stdout(&second));
    assert_eq!(count(&second, "already there"), 4, "{}", stdout(&second));
    let third = relocate(stack, &args).await;
    assert!(
        third.status.success(),
        "third run: {}\n{}",
        stdout(&third),
        stderr(&third)
    );
    assert_eq!(count(&third, "copied"), 0, "{}", stdout(&third));
    assert_eq!(count(&third, "already there"), 5, "{}", stdout(&third));
    assert!(stdout(&third).contains("(0 bytes)"), "{}", stdout(&third));

    // --delete-source removes the sources once their copies are in place, and nothing else.
    let mut args = vec![source.as_str(), "--delete-source"];
    args.extend(common);
    let cleanup = relocate(stack, &args).await;
    assert!(
        cleanup.status.success(),
        "--delete-source: {}\n{}",
        stdout(&cleanup),
        stderr(&cleanup)
    );
    assert_eq!(
        count(&cleanup, "sources deleted"),
        5,
        "{}",
        stdout(&cleanup)
    );
    for (name, _) in &files {
        assert!(
            !exists(stack, &format!("{stray}/{name}")).await,
            "the source {name} was not deleted"
        );
        assert!(
            exists(stack, &format!("{run_dir}/{name}")).await,
            "the copy of {name} is gone"
        );
    }
    assert!(
        exists(stack, &format!("{stray}-other/not-mine.pt")).await,
        "a sibling prefix was touched"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_mlflow_does_not_know_fails_with_exit_1_and_copies_nothing() {
    let stack = stack();
    let stray = format!("my-experiment-missing-{}", uuid::Uuid::new_v4().simple());
    put_object(stack, &format!("{stray}/epoch_1.pt"), pattern(100, 8)).await;
    let source = format!("s3://{}/{stray}", stack.s3.bucket);
    let output = relocate(
        stack,
        &[&source, "--run-id", "0123456789abcdef0123456789abcdef"],
    )
    .await;
    assert_eq!(
        output.status.code(),
        Some(1),
        "{}\n{}",
        stdout(&output),
        stderr(&output)
    );
    let message = stderr(&output);
    assert!(
        message.contains("has no run \"0123456789abcdef0123456789abcdef\""),
        "{message}"
    );
    assert!(
        message.contains("--run-id"),
        "the message says what to check: {message}"
    );
    assert!(exists(stack, &format!("{stray}/epoch_1.pt")).await);

    // --delete-source without verification is refused before anything happens.
    let output = relocate(
        stack,
        &[&source, "--run-id", "x", "--delete-source", "--no-verify"],
    )
    .await;
    assert_eq!(output.status.code(), Some(64), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("--no-verify"),
        "{}",
        stderr(&output)
    );
}
