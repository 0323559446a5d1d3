//! System metrics through the proxy into real MLflow: the contract's keys, one node series per
//! (run, node), failover, replicas sharing PostgreSQL and restarts.
//!
//! Ranks are either MLflow's own system-metrics monitor (tests/python/rank_monitor.py) or, where
//! the test must control exactly which request goes to which replica, a Rust rank that sends
//! what that monitor sends: `system/<node>/rank-<r>/<name>` keys, one timestamp per publish and
//! a step counter that starts at its own value.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use mlscope_tests::{
    eventually, repo_root, spawn_proxy, venv, PostgresDatabase, ProxyProcess, TestStack,
};
use serde_json::{json, Value};

use crate::mlflow::{create_run, history, http, metric_keys, now_ms, NODE_WIDE_NAMES};

/// A node series must never reuse a step or go back in step: in timestamp order, steps rise.
fn assert_monotonic(key: &str, points: &[(i64, i64)]) {
    for pair in points.windows(2) {
        assert!(
            pair[1].0 > pair[0].0 && pair[1].1 >= pair[0].1,
            "{key}: step went back or repeated at {pair:?} in {points:?}"
        );
    }
}

async fn run_view(proxy: &ProxyProcess, run_id: &str) -> Value {
    http()
        .get(format!("{}/runs/{run_id}/scopes", proxy.admin_url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

async fn reporter_of(proxy: &ProxyProcess, run_id: &str, node: &str) -> Option<i64> {
    let view = run_view(proxy, run_id).await;
    view["reporters"]
        .as_array()?
        .iter()
        .find(|r| r["node"] == node)
        .and_then(|r| r["rank"].as_i64())
}

const MLFLOW_NAMES: [&str; 6] = [
    "cpu_utilization_percentage",
    "system_memory_usage_megabytes",
    "system_memory_usage_percentage",
    "disk_usage_megabytes",
    "disk_usage_percentage",
    "disk_available_megabytes",
];

// === ranks running MLflow's own monitor ===

fn spawn_monitor_rank(
    proxy: &ProxyProcess,
    run_id: &str,
    node: &str,
    rank: u32,
    seconds: u32,
) -> Child {
    Command::new(venv().join("bin/python"))
        .arg(repo_root().join("tests/python/rank_monitor.py"))
        .args([run_id, node, &rank.to_string(), &seconds.to_string()])
        .env("MLFLOW_TRACKING_URI", &proxy.url)
        .env("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
        .env("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python from the project venv")
}

/// Waits for a rank and returns how many training steps it logged.
fn finish_rank(child: Child) -> i64 {
    let output = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "rank failed: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let line: Value = serde_json::from_str(stdout.lines().last().unwrap_or("{}")).unwrap();
    line["train_steps"].as_i64().unwrap()
}

fn dedup_proxy(dir: &Path, upstream: &str, extra: &[&str]) -> ProxyProcess {
    let mut args = vec![
        "--dedup-update-interval",
        "300ms",
        "--dedup-failover-timeout",
        "4s",
    ];
    args.extend_from_slice(extra);
    spawn_proxy(upstream, &args, dir).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn eight_ranks_on_two_nodes_store_one_series_per_node_and_every_rank_series_complete() {
    let stack = TestStack::shared();
    let dir = tempfile::tempdir().unwrap();
    // One reporter per node for the whole run: a failover timeout far beyond any pause of the
    // ranks' monitors on a loaded machine (eight Python processes on two cores paused one for
    // more than 4 s, and its node rightly changed reporter). Handovers have tests of their own.
    let proxy = spawn_proxy(
        &stack.mlflow.url,
        &[
            "--dedup-update-interval",
            "300ms",
            "--dedup-failover-timeout",
            "60s",
        ],
        dir.path(),
    )
    .unwrap();
    let run_id = create_run(&stack.mlflow.url, "system-metrics").await;

    let ranks: Vec<(String, u32)> = (0..8)
        .map(|r| (if r < 4 { "node-a" } else { "node-b" }.to_owned(), r))
        .collect();
    let children: Vec<_> = ranks
        .iter()
        .map(|(node, rank)| spawn_monitor_rank(&proxy, &run_id, node, *rank, 10))
        .collect();
    let train_steps: Vec<i64> =
        tokio::task::spawn_blocking(move || children.into_iter().map(finish_rank).collect())
            .await
            .unwrap();

    let keys = metric_keys(&stack.mlflow.url, &run_id).await;
    for node in ["node-a", "node-b"] {
        for name in NODE_WIDE_NAMES {
            let key = format!("system/{node}/{name}");
            assert!(keys.contains(&key), "missing {key} in {keys:?}");
            let points = history(&stack.mlflow.url, &run_id, &key).await;
            assert!(points.len() >= 3, "{key}: {points:?}");
            assert_monotonic(&key, &points);
        }
    }
    for key in &keys {
        // No rank-owned copy of a node value survives, and no MLflow name of a node value.
        let name = key.rsplit('/').next().unwrap();
        assert!(!MLFLOW_NAMES.contains(&name), "unscoped key stored: {key}");
        assert!(
            !(key.contains("/rank-") && (name.starts_with("node_") || name.starts_with("rootfs_"))),
            "rank-owned node key: {key}"
        );
    }
    for ((_, rank), steps) in ranks.iter().zip(&train_steps) {
        for name in ["network_receive_megabytes", "network_transmit_megabytes"] {
            let key = format!("system/rank-{rank}/{name}");
            let points = history(&stack.mlflow.url, &run_id, &key).await;
            // MLflow's monitor counts its publishes 0, 1, 2...: every one of them arrived.
            let steps_seen: Vec<i64> = points.iter().map(|p| p.0).collect();
            assert_eq!(
                steps_seen,
                (0..points.len() as i64).collect::<Vec<_>>(),
                "{key}"
            );
            assert!(points.len() >= 3, "{key}: {points:?}");
        }
        let key = format!("train/loss_rank{rank}");
        assert_eq!(
            history(&stack.mlflow.url, &run_id, &key).await.len() as i64,
            *steps,
            "{key}"
        );
    }
    // The admin view explains it: one reporter per node, three standby ranks each.
    let view = run_view(&proxy, &run_id).await;
    assert_eq!(view["reporters"].as_array().unwrap().len(), 2, "{view}");
    let dropping = view["identities"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["node_samples_dropped"].as_u64().unwrap_or(0) > 0)
        .count();
    assert_eq!(dropping, 6, "{view}");
    let metrics = http()
        .get(format!("{}/metrics", proxy.admin_url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for expected in [
        r#"mlscope_dedup_elections_total{reason="elected"} 2"#,
        r#"mlscope_system_metric_keys_total{family="cpu",outcome="rewritten"}"#,
        r#"mlscope_node_samples_total{reason="dropped"}"#,
        r#"mlscope_node_samples_total{reason="kept"}"#,
    ] {
        assert!(
            metrics.contains(expected),
            "{expected} missing from /metrics:\n{metrics}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn when_the_reporter_stops_another_rank_takes_over_within_the_failover_timeout() {
    let stack = TestStack::shared();
    let dir = tempfile::tempdir().unwrap();
    let proxy = dedup_proxy(dir.path(), &stack.mlflow.url, &[]);
    let run_id = create_run(&stack.mlflow.url, "system-metrics").await;

    let mut first = spawn_monitor_rank(&proxy, &run_id, "node-f", 0, 60);
    eventually(
        Duration::from_secs(90),
        "rank 0 the reporter of node-f",
        async || match reporter_of(&proxy, &run_id, "node-f").await {
            Some(0) => Ok(()),
            other => Err(format!("reporter {other:?}")),
        },
    )
    .await;
    let second = spawn_monitor_rank(&proxy, &run_id, "node-f", 1, 25);
    // Let both ranks publish side by side for a while, then the reporter dies.
    eventually(
        Duration::from_secs(90),
        "rank 1 publishing as standby (12 node samples dropped)",
        async || {
            let view = run_view(&proxy, &run_id).await;
            let dropped =
                view["identities"].as_array().unwrap().iter().any(|i| {
                    i["rank"] == 1 && i["node_samples_dropped"].as_u64().unwrap_or(0) >= 12
                });
            if dropped {
                Ok(())
            } else {
                Err(view.to_string())
            }
        },
    )
    .await;
    first.kill().unwrap();
    first.wait().unwrap();
    tokio::task::spawn_blocking(move || finish_rank(second))
        .await
        .unwrap();

    assert_eq!(reporter_of(&proxy, &run_id, "node-f").await, Some(1));
    let view = run_view(&proxy, &run_id).await;
    assert_eq!(view["reporters"][0]["epoch"], 2, "{view}");
    let key = "system/node-f/node_cpu_utilization_percentage";
    let points = history(&stack.mlflow.url, &run_id, key).await;
    assert_monotonic(key, &points);
    // The series has no hole longer than the failover timeout (4 s) plus a sampling interval or
    // two on each side of the handover.
    let gap = points.windows(2).map(|w| w[1].1 - w[0].1).max().unwrap();
    assert!(gap <= 4_000 + 3_000, "gap of {gap} ms in {points:?}");
    assert!(points.len() >= 10, "{points:?}");
}

// === ranks simulated request by request ===

/// A rank that publishes what MLflow's monitor publishes, to a proxy the caller chooses.
struct SimRank {
    node: &'static str,
    rank: u32,
    step: i64,
    sent: i64,
}

impl SimRank {
    fn new(node: &'static str, rank: u32, first_step: i64) -> Self {
        Self {
            node,
            rank,
            step: first_step,
            sent: 0,
        }
    }

    async fn publish(&mut self, proxy: &str, run_id: &str) {
        let ts = now_ms();
        let metrics: Vec<Value> = ["cpu_utilization_percentage", "system_memory_usage_megabytes", "network_receive_megabytes"]
            .iter()
            .map(|name| json!({"key": format!("system/{}/rank-{}/{name}", self.node, self.rank), "value": 10.0 + f64::from(self.rank), "timestamp": ts, "step": self.step}))
            .collect();
        let body = json!({ "run_id": run_id, "metrics": metrics, "params": [], "tags": [] });
        let response = http()
            .post(format!("{proxy}/api/2.0/mlflow/runs/log-batch"))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = response.status();
        let text = response.text().await.unwrap();
        assert_eq!(
            (status.as_u16(), text.as_str()),
            (200, "{}"),
            "rank {} step {}",
            self.rank,
            self.step
        );
        self.step += 1;
        self.sent += 1;
    }
}

/// An empty PostgreSQL database for one test on the server at `MLSCOPE_TEST_POSTGRES_URL`
/// (default: the machine's, 127.0.0.1:5432), dropped with the guard.
fn postgres_database() -> PostgresDatabase {
    let admin = std::env::var("MLSCOPE_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    PostgresDatabase::create(&admin, "mlscope_it").expect("PostgreSQL must be running")
}

async fn node_series_and_rank_counts(
    mlflow: &str,
    run_id: &str,
    node: &str,
    ranks: &[SimRank],
) -> Vec<(i64, i64)> {
    let key = format!("system/{node}/node_cpu_utilization_percentage");
    let points = history(mlflow, run_id, &key).await;
    assert_monotonic(&key, &points);
    for rank in ranks {
        let key = format!("system/rank-{}/network_receive_megabytes", rank.rank);
        assert_eq!(
            history(mlflow, run_id, &key).await.len() as i64,
            rank.sent,
            "{key}: every pod sample is kept"
        );
    }
    points
}

#[tokio::test(flavor = "multi_thread")]
async fn two_replicas_sharing_postgres_keep_one_reporter_through_a_failover() {
    let stack = TestStack::shared();
    let dir = tempfile::tempdir().unwrap();
    let database = postgres_database();
    let args = [
        "--database-url",
        database.url.as_str(),
        "--dedup-update-interval",
        "100ms",
        "--dedup-failover-timeout",
        "1500ms",
    ];
    let replicas = [
        spawn_proxy(&stack.mlflow.url, &args, dir.path()).unwrap(),
        spawn_proxy(&stack.mlflow.url, &args, dir.path()).unwrap(),
    ];
    let run_id = create_run(&stack.mlflow.url, "system-metrics").await;
    // Rank counters differ on purpose, as real ranks' do.
    let mut ranks: Vec<SimRank> = (0..4)
        .map(|r| SimRank::new("node-r", r, i64::from(r) * 7))
        .collect();

    let mut request = 0usize;
    for _ in 0..8 {
        for rank in ranks.iter_mut() {
            rank.publish(&replicas[request % 2].url, &run_id).await;
            request += 1;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let reporter = reporter_of(&replicas[0], &run_id, "node-r")
        .await
        .expect("a reporter");
    let before = history(
        &stack.mlflow.url,
        &run_id,
        "system/node-r/node_cpu_utilization_percentage",
    )
    .await;
    assert_eq!(
        before.len(),
        8,
        "one series, one point per tick: {before:?}"
    );

    // The reporter goes silent; the others keep publishing through both replicas.
    for _ in 0..12 {
        for rank in ranks.iter_mut().filter(|r| i64::from(r.rank) != reporter) {
            rank.publish(&replicas[request % 2].url, &run_id).await;
            request += 1;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let after = reporter_of(&replicas[1], &run_id, "node-r")
        .await
        .expect("a reporter");
    assert_ne!(after, reporter);
    let points = node_series_and_rank_counts(&stack.mlflow.url, &run_id, "node-r", &ranks).await;
    // 8 ticks before, and the ticks after the takeover: at least 12 minus the failover window.
    assert!(
        points.len() >= 8 + 12 - 7 && points.len() <= 8 + 12,
        "{points:?}"
    );
}

async fn leases_survive_a_proxy_restart(postgres: Option<&PostgresDatabase>) {
    let stack = TestStack::shared();
    let dir = tempfile::tempdir().unwrap();
    let database = postgres.map_or_else(
        || format!("sqlite://{}/restart.db", dir.path().display()),
        |db| db.url.clone(),
    );
    let args = [
        "--database-url",
        database.as_str(),
        "--dedup-update-interval",
        "100ms",
        "--dedup-failover-timeout",
        "20s",
    ];
    let run_id = create_run(&stack.mlflow.url, "system-metrics").await;
    let mut ranks = [SimRank::new("node-s", 0, 0), SimRank::new("node-s", 1, 100)];

    let mut proxy = spawn_proxy(&stack.mlflow.url, &args, dir.path()).unwrap();
    for _ in 0..3 {
        for rank in ranks.iter_mut() {
            rank.publish(&proxy.url, &run_id).await;
        }
    }
    assert_eq!(reporter_of(&proxy, &run_id, "node-s").await, Some(0));
    assert!(
        proxy.process.terminate().success(),
        "the proxy exits 0 on SIGTERM"
    );

    proxy = spawn_proxy(&stack.mlflow.url, &args, dir.path()).unwrap();
    // Rank 1 first: a proxy that forgot the lease would make it the reporter.
    for _ in 0..3 {
        for rank in ranks.iter_mut().rev() {
            rank.publish(&proxy.url, &run_id).await;
        }
    }
    let view = run_view(&proxy, &run_id).await;
    assert_eq!(view["reporters"][0]["rank"], 0, "{view}");
    assert_eq!(view["reporters"][0]["epoch"], 1, "{view}");
    let points = node_series_and_rank_counts(&stack.mlflow.url, &run_id, "node-s", &ranks).await;
    assert_eq!(
        points.iter().map(|p| p.0).collect::<Vec<_>>(),
        (0..6).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn leases_survive_a_proxy_restart_on_sqlite() {
    leases_survive_a_proxy_restart(None).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn leases_survive_a_proxy_restart_on_postgres() {
    let database = postgres_database();
    leases_survive_a_proxy_restart(Some(&database)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_single_rank_run_gets_the_contracts_keys_and_untouched_training_metrics() {
    let stack = TestStack::shared();
    let run_id = create_run(&stack.mlflow.url, "system-metrics").await;
    let proxy = stack.proxy.as_ref().unwrap();
    let body = json!({"run_id": run_id, "metrics": [
        {"key": "system/gpu-node-1/rank-3/cpu_utilization_percentage", "value": 12.5, "timestamp": 1_700_000_000_000i64, "step": 0},
        {"key": "system/gpu-node-1/rank-3/gpu_0_utilization_percentage", "value": "NaN", "timestamp": 1_700_000_000_000i64, "step": 0},
        {"key": "system/gpu-node-1/rank-3/custom_thing", "value": 1, "timestamp": 1_700_000_000_000i64, "step": 0},
        {"key": "loss", "value": 0.25, "timestamp": 1_700_000_000_000i64, "step": 9_007_199_254_740_993i64},
    ]});
    let response = http()
        .post(format!("{}/api/2.0/mlflow/runs/log-batch", proxy.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let keys: BTreeMap<String, ()> = metric_keys(&stack.mlflow.url, &run_id)
        .await
        .into_iter()
        .map(|k| (k, ()))
        .collect();
    let keys: Vec<&str> = keys.keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "loss",
            "system/gpu-node-1/node_cpu_utilization_percentage",
            "system/gpu-node-1/rank-3/custom_thing",
            "system/rank-3/gpu_0_utilization_percentage"
        ]
    );
    let loss = history(&stack.mlflow.url, &run_id, "loss").await;
    assert_eq!(loss, [(9_007_199_254_740_993, 1_700_000_000_000)]);

    // One spelling for MLflow, another for the proxy: refused.
    let conflict = http()
        .post(format!("{}/api/2.0/mlflow/runs/log-metric", proxy.url))
        .json(&json!({"run_id": run_id, "run_uuid": "someone-elses-run", "key": "loss", "value": 1, "timestamp": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(conflict.status(), 400);
    let error: Value = conflict.json().await.unwrap();
    assert_eq!(error["error_code"], "INVALID_PARAMETER_VALUE");
}
