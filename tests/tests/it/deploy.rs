//! deploy/ checked offline: the Kubernetes manifests against the Kubernetes 1.33 JSON schemas
//! (strict), the kustomization against its directory, the ConfigMap's TOML and every container's
//! command line against the real binaries (`--check-config`), and every metric the alert rules and
//! the Grafana dashboard query against what a running mlscope-proxy exports. The checks live in
//! `tests/python/validate_deploy.py` (the schemas ship with the `kubernetes-validate` package).

use std::process::Command;

use mlscope_tests::{collector_binary, proxy_binary, repo_root, venv, TestStack};

use crate::mlflow::scrape;

#[tokio::test(flavor = "multi_thread")]
async fn deploy_manifests_dashboard_and_alerts_hold_against_kubernetes_and_the_binaries() {
    let stack = TestStack::shared();
    let admin = &stack
        .proxy
        .as_ref()
        .expect("the shared stack has a proxy")
        .admin_url;
    let dir = tempfile::tempdir().unwrap();
    let exposition = dir.path().join("metrics.txt");
    std::fs::write(&exposition, scrape(admin).await).unwrap();
    let root = repo_root();
    let output = Command::new(venv().join("bin/python"))
        .arg(root.join("tests/python/validate_deploy.py"))
        .arg(&root)
        .arg(proxy_binary())
        .arg(collector_binary())
        .arg(&exposition)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "deploy checks failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // Every manifest file was looked at, and the binaries ran for the proxy and both examples.
    for expected in [
        "proxy-deployment.yaml#0 Deployment/mlscope-proxy valid",
        "proxy-prometheusrule.yaml#0 PrometheusRule/mlscope-proxy valid (own schema)",
        "training-job-sidecar.yaml container mlscope-collector: mlscope-collector: configuration ok",
        "training-job-wrapper.yaml container train: mlscope-collector: configuration ok",
        "proxy-deployment.yaml container mlscope-proxy: mlscope-proxy: configuration ok",
        "inject-deployment.yaml container mlscope-inject: mlscope-proxy inject: configuration ok",
        "inject-webhook.yaml#0 MutatingWebhookConfiguration/mlscope-inject valid",
        "inject-certificate.yaml#1 Certificate/mlscope-inject valid (own schema)",
        "all deploy checks passed",
    ] {
        assert!(stdout.contains(expected), "{expected:?} not in:\n{stdout}");
    }
}
