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
    let (report, summary) = fleet(
        "mlscope_it_mlflow",
        &[
            "--replicas",
            "3",
            "--scenario",
            "replica-kill",
            "--ranks-per-node",
            "4",
            "--duration",
            "24s",
            "--checkpoint-every",
            "40s",
            "--checkpoint-size",
            "256KiB",
        ],
    );
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

/// The soak at test size (the hour is in BENCHMARKS.md): a steady fleet through nginx and two
/// replicas on PostgreSQL for a minute, the proxies' resources sampled every 3 s. Every sample is
/// stored once; once the load is answered the coalescers hold nothing and nothing is in flight;
/// the state database does not grow after every rank has been heard; memory and descriptors stay
/// within a bound of their mid-run values.
#[test]
fn a_steady_fleet_through_two_replicas_leaves_the_proxies_as_it_found_them() {
    let (report, summary) = fleet(
        "mlscope_it_soak",
        &[
            "--replicas",
            "2",
            "--ranks-per-node",
            "8",
            "--duration",
            "60s",
            "--sample-every",
            "3s",
        ],
    );
    let row = &summary["rows"][0];
    let samples = &row["samples"];
    assert_eq!(
        (
            row["failed"].as_u64(),
            samples["missing"].as_u64(),
            samples["duplicated"].as_u64()
        ),
        (Some(0), Some(0), Some(0)),
        "{report}"
    );
    let resources = row["resources"].as_array().expect("resource samples");
    assert!(resources.len() >= 10, "{report}");
    let (middle, last) = (
        &resources[resources.len() / 2],
        &resources[resources.len() - 1],
    );
    let value = |r: &Value, name: &str| r[name].as_f64().unwrap_or(f64::NAN);
    assert_eq!(value(last, "queued_requests"), 0.0, "{report}");
    assert_eq!(value(last, "in_flight"), 0.0, "{report}");
    assert_eq!(
        last["state_rows"], middle["state_rows"],
        "state rows grew after every rank was heard: {report}"
    );
    // The run report's rows grow with the run's first minutes, to a bound: 240 buckets for each
    // of a rank's seven series (and the run's step), a histogram row per 2 % of its working set.
    let bound = 16.0 * 8.0 * (240.0 + 60.0);
    assert!(
        value(last, "report_rows") <= bound,
        "run report rows beyond {bound}: {report}"
    );
    assert!(
        value(last, "rss_bytes") <= value(middle, "rss_bytes") + 64.0 * 1024.0 * 1024.0,
        "{report}"
    );
    assert!(
        value(last, "open_fds") <= value(middle, "open_fds") + 64.0,
        "{report}"
    );
}

/// Runs `mlscope-bench fleet` against mlscope-proxy replicas on two nodes at ten times real
/// speed, with MLflow on a PostgreSQL database of its own (named after `database`) and `args`;
/// returns the printed report and the JSON summary, failing with both when the bench fails.
fn fleet(database: &str, args: &[&str]) -> (String, Value) {
    let admin = std::env::var("MLSCOPE_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let mlflow_db = PostgresDatabase::create(&admin, database).unwrap();
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
            "--nodes",
            "2",
            "--time-scale",
            "10",
        ])
        .args(args)
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
    let report = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{report}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let summary = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    (report, summary)
}
