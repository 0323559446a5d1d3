//! The production shape under load with a replica killed, as `scripts/replicas` runs it, at test
//! size: `mlscope-bench fleet --scenario replica-kill` against nginx with the shipped gateway
//! config in front of three mlscope-proxy replicas sharing a PostgreSQL state database and
//! serving artifacts from SeaweedFS, MLflow on PostgreSQL. Replica 0 is SIGKILLed halfway and
//! started again; every acknowledged sample and checkpoint must be in MLflow exactly once.

use std::process::Command;

use mlscope_tests::{proxy_binary, PostgresDatabase};
use serde_json::Value;

#[test]
fn a_replica_killed_under_load_loses_no_sample_and_no_checkpoint_and_doubles_none() {
    let admin = std::env::var("MLSCOPE_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let mlflow_db = PostgresDatabase::create(&admin, "mlscope_it_mlflow").unwrap();
    let backend = mlflow_db
        .url
        .replacen("postgres://", "postgresql+psycopg://", 1);
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("fleet.json");
    let output = Command::new(proxy_binary().with_file_name("mlscope-bench"))
        .args([
            "fleet",
            "--mlflow-backend",
            &backend,
            "--replica-postgres",
            &admin,
        ])
        .args([
            "--targets",
            "mlscope-replicas",
            "--replicas",
            "3",
            "--scenario",
            "replica-kill",
        ])
        .args([
            "--nodes",
            "2",
            "--ranks-per-node",
            "4",
            "--time-scale",
            "10",
            "--duration",
            "24s",
        ])
        .args(["--checkpoint-every", "40s", "--checkpoint-size", "256KiB"])
        .args([
            "--retries",
            "7",
            "--request-timeout",
            "60s",
            "--p99-bound",
            "60s",
        ])
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{report}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let summary: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let row = &summary["rows"][0];
    assert_eq!(row["target"], "mlscope-proxy-replicas", "{report}");
    assert_eq!(row["outage"]["what"], "mlscope-proxy replica 0", "{report}");
    assert_eq!(
        (row["failed"].as_u64(), row["dropped"].as_u64()),
        (Some(0), Some(0)),
        "{report}"
    );
    let samples = &row["samples"];
    assert!(samples["acknowledged"].as_u64().unwrap() > 1000, "{report}");
    assert_eq!(
        (samples["missing"].as_u64(), samples["duplicated"].as_u64()),
        (Some(0), Some(0)),
        "{report}"
    );
    let objects = &row["objects"];
    assert!(objects["acknowledged"].as_u64().unwrap() >= 2, "{report}");
    assert_eq!(objects["read_back"], objects["acknowledged"], "{report}");
    assert_eq!(row["count_error"], Value::Null, "{report}");
}
