//! The differential compatibility suite (`mlscope_tests::compat`, the code `mlscope-compat`
//! ships) against the stack the tests start: every operation answers the same directly and
//! through the proxy, and through plain nginx, which keeps the normalisation honest. The tool
//! itself: equal answers exit 0, a server that is not the same MLflow exits 1 with the
//! differences. With the artifact gateway on, against the oldest (2.22) and the newest (3.17)
//! MLflow of the support matrix; scripts/compat-matrix runs every version.

use std::process::Command;

use mlscope_tests::compat::{compare_deployments, Credentials};
use mlscope_tests::{matrix_venv, venv, Nginx, StackOptions, TestStack};

#[tokio::test]
async fn every_mlflow_operation_answers_the_same_through_the_proxy() {
    let stack = TestStack::shared();
    assert_same_answers(&stack.mlflow.url, stack.proxy_url(), "the proxy").await;
}

/// Keeps the suite honest: a plain reverse proxy must pass it, so a mismatch through mlscope is
/// mlscope's and not an artefact of the normalisation.
#[tokio::test]
async fn every_mlflow_operation_answers_the_same_through_plain_nginx() {
    let stack = TestStack::shared();
    let dir = tempfile::tempdir().unwrap();
    let nginx = Nginx::start(&stack.mlflow.url, dir.path()).expect("starting nginx");
    assert_same_answers(&stack.mlflow.url, &nginx.url, "nginx").await;
}

/// Runs every operation on MLflow at `direct` and at `through`, and fails with every difference.
async fn assert_same_answers(direct: &str, through: &str, what: &str) {
    let comparison = compare_deployments(direct, through, &Credentials::none(), |_| {}).await;
    let mismatches: Vec<String> = comparison
        .differences()
        .map(|r| format!("{}:\n{}", r.name, r.difference().unwrap_or_default()))
        .collect();
    assert!(
        mismatches.is_empty(),
        "{} of {} operations answered differently through {what}:\n\n{}",
        mismatches.len(),
        comparison.results.len(),
        mismatches.join("\n\n")
    );
    assert!(
        comparison.results.len() > 50,
        "{}",
        comparison.results.len()
    );
    assert!(
        comparison.cleanup_problems.is_empty(),
        "{:?}",
        comparison.cleanup_problems
    );
}

fn compat_binary() -> std::path::PathBuf {
    mlscope_tests::proxy_binary().with_file_name("mlscope-compat")
}

/// `mlscope-compat --quiet --direct <direct> --through <through>`: its stdout, after checking
/// that it exited with `expected` (stderr shown when it did not).
fn run_compat(direct: &str, through: &str, expected: i32) -> String {
    let output = Command::new(compat_binary())
        .args(["--quiet", "--direct", direct, "--through", through])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert_eq!(
        output.status.code(),
        Some(expected),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[tokio::test(flavor = "multi_thread")]
async fn mlscope_compat_exits_0_on_equal_answers_and_1_with_the_differences_and_cleans_up() {
    let stack = TestStack::shared();
    let stdout = run_compat(&stack.mlflow.url, stack.proxy_url(), 0);
    assert!(
        stdout.contains("operations answered the same directly and through"),
        "{stdout}"
    );
    assert!(!stdout.contains("DIFFERENT"), "{stdout}");
    // Nothing of the comparison is left active: the experiments of both its sides are deleted.
    let cleaned = stdout
        .lines()
        .find_map(|l| l.strip_prefix("cleaned up: experiments compat-*-"))
        .expect("the clean-up line");
    let direct_suffix = cleaned.split_whitespace().next().unwrap();
    let through_suffix = cleaned
        .split("compat-*-")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap();
    for suffix in [direct_suffix, through_suffix] {
        let filter = format!("name LIKE '%{suffix}'");
        let active = crate::mlflow::post(
            &stack.mlflow.url,
            "experiments/search",
            serde_json::json!({"filter": filter, "max_results": 100}),
        )
        .await;
        assert!(
            active["experiments"].as_array().is_none_or(Vec::is_empty),
            "left behind: {active}"
        );
        let deleted = crate::mlflow::post(
            &stack.mlflow.url,
            "experiments/search",
            serde_json::json!({"filter": filter, "max_results": 100, "view_type": "DELETED_ONLY"}),
        )
        .await;
        assert!(
            deleted["experiments"]
                .as_array()
                .is_some_and(|e| !e.is_empty()),
            "{suffix}: the comparison created no experiment? {deleted}"
        );
    }

    // The S3 store is not MLflow: every answer differs, and the tool says so.
    let stdout = run_compat(&stack.mlflow.url, &stack.s3.url, 1);
    assert!(stdout.contains("DIFFERENT"), "{stdout}");
    assert!(stdout.contains("differences:"), "{stdout}");

    // A user mistake is one line and exit 2.
    let unusable = Command::new(compat_binary())
        .args(["--direct", "mlflow:5000", "--through", "http://127.0.0.1:1"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&unusable.stderr);
    assert_eq!(unusable.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
}

/// The gateway in front of an MLflow of the matrix: `mlscope-compat` exits 0, naming what differs
/// on purpose and what this MLflow lacks. Returns the tool's output.
fn compat_with_the_gateway(mlflow_venv: std::path::PathBuf) -> String {
    let mut stack = TestStack::start(StackOptions {
        proxy: false,
        mlflow_venv: Some(mlflow_venv),
        ..StackOptions::default()
    })
    .expect("starting the stack");
    let dir = stack.dir.path().to_owned();
    let args = stack.s3.gateway_args(&stack.s3.url);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    stack.proxy =
        Some(mlscope_tests::spawn_proxy(&stack.mlflow.url, &args, &dir).expect("the proxy"));
    let stdout = run_compat(&stack.mlflow.url, stack.proxy_url(), 0);
    assert!(!stdout.contains("DIFFERENT"), "{stdout}");
    stdout
}

#[test]
fn mlscope_compat_exits_0_through_the_gateway_on_the_oldest_supported_mlflow() {
    let stdout = compat_with_the_gateway(matrix_venv("2.22"));
    assert!(stdout.contains("MLflow 2.22."), "{stdout}");
    // MLflow 2.22 lists the marker SeaweedFS leaves in an emptied directory as a file; the
    // gateway does not, and the tool says that this is intended.
    assert!(
        stdout.contains("intended  mlflow-artifacts delete and list: MLflow before 3.16 lists a zero-byte directory marker"),
        "{stdout}"
    );
    assert!(stdout.contains("1 differed as intended"), "{stdout}");
    // Logged models (3.0) and paged metric history (3.2) are not there to compare.
    for skipped in [
        "logged-models create",
        "logged-models search",
        "metrics/get-history two pages",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.contains(skipped))
            .unwrap_or_else(|| panic!("{skipped}: {stdout}"));
        assert!(
            line.contains("skipped   ") && line.contains(": not supported by this MLflow (2.22."),
            "{line}"
        );
    }
    assert!(
        stdout.contains("4 not supported by this MLflow, 0 different"),
        "{stdout}"
    );
}

#[test]
fn mlscope_compat_exits_0_through_the_gateway_on_the_newest_supported_mlflow() {
    let stdout = compat_with_the_gateway(venv());
    assert!(stdout.contains("MLflow 3.17."), "{stdout}");
    assert!(stdout.contains("0 differed as intended (docs/compatibility.md), 0 not supported by this MLflow, 0 different"), "{stdout}");
}
