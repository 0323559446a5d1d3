//! The `mlscope-proxy` binary as an operator meets it: `--help`, refused configuration, logs,
//! and SIGTERM.

use std::process::Command;

use mlscope_tests::{proxy_binary, spawn_proxy, TestStack};

#[test]
fn help_documents_every_setting_with_its_environment_variable() {
    let output = Command::new(proxy_binary()).arg("--help").output().unwrap();
    assert!(output.status.success());
    let help = String::from_utf8(output.stdout).unwrap();
    for (flag, env) in [
        ("--config", "MLSCOPE_CONFIG"),
        ("--listen", "MLSCOPE_LISTEN"),
        ("--upstream", "MLSCOPE_UPSTREAM"),
        ("--admin-listen", "MLSCOPE_ADMIN_LISTEN"),
        ("--database-url", "MLSCOPE_DATABASE_URL"),
        ("--connect-timeout", "MLSCOPE_CONNECT_TIMEOUT"),
        ("--response-timeout", "MLSCOPE_RESPONSE_TIMEOUT"),
        ("--body-idle-timeout", "MLSCOPE_BODY_IDLE_TIMEOUT"),
        ("--shutdown-grace", "MLSCOPE_SHUTDOWN_GRACE"),
        ("--log-format", "MLSCOPE_LOG_FORMAT"),
        ("--dedup-failover-timeout", "MLSCOPE_DEDUP_FAILOVER_TIMEOUT"),
        (
            "--keep-original-keys-until",
            "MLSCOPE_KEEP_ORIGINAL_KEYS_UNTIL",
        ),
    ] {
        assert!(
            help.contains(flag) && help.contains(env),
            "{flag} / {env} missing from --help"
        );
    }
}

#[test]
fn invalid_configuration_exits_64_with_a_one_line_reason() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(&file, "listen = \"not an address\"\n").unwrap();
    for args in [
        vec!["--upstream".to_owned(), "ftp://mlflow".to_owned()],
        vec!["--config".to_owned(), file.display().to_string()],
        vec!["--shutdown-grace".to_owned(), "forever".to_owned()],
    ] {
        let output = Command::new(proxy_binary())
            .args(&args)
            .env("MLSCOPE_DATABASE_URL", "sqlite::memory:")
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(64), "{args:?}");
        let stderr = String::from_utf8(output.stderr).unwrap();
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
        assert!(
            stderr.starts_with("mlscope-proxy: invalid configuration: "),
            "{stderr}"
        );
    }
    // The environment is read too.
    let output = Command::new(proxy_binary())
        .env("MLSCOPE_LISTEN", "nowhere")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(64));
    // A refusal says what to write instead: an enumerated flag's valid values, a URL given where
    // an address belongs.
    for (args, says) in [
        (["--log-format", "text"], "[possible values: pretty, json]"),
        (
            ["--listen", "http://127.0.0.1:5001"],
            "a listen address takes no scheme (http://): write \"127.0.0.1:5001\"",
        ),
    ] {
        let output = Command::new(proxy_binary()).args(args).output().unwrap();
        assert_eq!(output.status.code(), Some(64), "{args:?}");
        let stderr = String::from_utf8(output.stderr).unwrap();
        assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn credentials_never_reach_the_logs_and_sigterm_exits_0() {
    let stack = TestStack::shared();
    let dir = tempfile::tempdir().unwrap();
    let mut proxy = spawn_proxy(&stack.mlflow.url, &[], dir.path()).unwrap();
    let response = reqwest::Client::new()
        .get(format!(
            "{}/api/2.0/mlflow/experiments/search?max_results=1",
            proxy.url
        ))
        .header("Authorization", "Bearer s3cr3t-token")
        .header("Cookie", "session=c00kie-value")
        .header("X-Request-Id", "trace-me-123")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-request-id"], "trace-me-123");
    assert!(proxy.process.terminate().success(), "SIGTERM must exit 0");
    let log = std::fs::read_to_string(&proxy.log_path).unwrap();
    assert!(
        log.contains("trace-me-123"),
        "the request is logged with its id: {log}"
    );
    assert!(
        !log.contains("s3cr3t-token") && !log.contains("c00kie-value"),
        "credentials leaked: {log}"
    );
    // JSON logs: every line is an object.
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        serde_json::from_str::<serde_json::Value>(line).unwrap_or_else(|e| panic!("{e}: {line}"));
    }
}

/// The tools a newcomer runs first answer a missing environment with one line that says what to
/// run, not a panic.
#[test]
fn stack_and_bench_name_what_to_run_when_the_environment_is_missing() {
    let tools = proxy_binary();
    for (tool, args) in [
        ("mlscope-stack", vec!["--no-demo"]),
        ("mlscope-bench", vec!["passthrough", "--duration", "1s"]),
    ] {
        let output = Command::new(tools.with_file_name(tool))
            .args(&args)
            .env("MLSCOPE_VENV", "/nonexistent/mlscope-venv")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{tool}: {stderr}");
        assert!(!stderr.contains("panicked"), "{tool}: {stderr}");
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{tool}: {stderr}");
        assert!(
            lines[0].starts_with(&format!("{tool}: ")) && lines[0].contains("run scripts/setup"),
            "{tool}: {stderr}"
        );
    }
}
