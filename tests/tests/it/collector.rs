//! mlscope-collector end to end: the real binary posting through the proxy into the real MLflow.
//! Two collectors that claim one node leave one node series; a proxy that is down for a minute
//! costs no sample; wrapper mode's tags land on the run.

use std::path::Path;
use std::process::{Command, ExitStatus};
use std::time::Duration;

use mlscope_tests::{
    collector_binary, consistently, eventually, eventually_blocking, free_port, spawn_proxy,
    spawn_proxy_on, Process, ProxyProcess, TestStack,
};
use serde_json::Value;

use crate::mlflow::{create_run, get_run, history, http, metric_keys, run_tags, NODE_WIDE_NAMES};

/// The steps of a series, in timestamp order.
async fn steps(mlflow: &str, run_id: &str, key: &str) -> Vec<i64> {
    history(mlflow, run_id, key)
        .await
        .into_iter()
        .map(|(step, _)| step)
        .collect()
}

/// Polls `steps` of `key` until it has at least `count` points.
async fn wait_for_points(mlflow: &str, run_id: &str, key: &str, count: usize, timeout: Duration) {
    eventually(
        timeout,
        format_args!("{count} points of {key}"),
        async || match steps(mlflow, run_id, key).await.len() {
            have if have >= count => Ok(()),
            have => Err(format!("{have} points")),
        },
    )
    .await;
}

// === the collector ===

/// `mlscope-collector` as a pod would run it: MLflow's variables, the node from `NODE_NAME`, the
/// pod from `POD_NAME` (`pod-<node>-<rank>`), the rank from `RANK`; one sample a second,
/// retries at most 2 s apart.
pub(crate) fn start_collector(
    dir: &Path,
    proxy_url: &str,
    run_id: &str,
    node: &str,
    rank: u32,
    wrapped: &[&str],
) -> Process {
    start_collector_with(dir, proxy_url, run_id, node, rank, &[], wrapped)
}

/// As [`start_collector`], with more collector flags (e.g. `--cgroup-path`).
pub(crate) fn start_collector_with(
    dir: &Path,
    proxy_url: &str,
    run_id: &str,
    node: &str,
    rank: u32,
    flags: &[&str],
    wrapped: &[&str],
) -> Process {
    let mut command = Command::new(collector_binary());
    command
        .env("MLFLOW_TRACKING_URI", proxy_url)
        .env("MLFLOW_RUN_ID", run_id)
        .env("NODE_NAME", node)
        .env("RANK", rank.to_string())
        .env("POD_NAME", format!("pod-{node}-{rank}"))
        .env("MLSCOPE_LOG_FORMAT", "json")
        .args(["--interval", "1", "--max-backoff", "2s"])
        .args(flags);
    if !wrapped.is_empty() {
        command.arg("--").args(wrapped);
    }
    let log = dir.join(format!(
        "collector-{node}-{rank}-{}.log",
        uuid::Uuid::new_v4().simple()
    ));
    Process::spawn("mlscope-collector", &command, &log).unwrap()
}

/// Waits (up to a minute, off the async runtime) for a wrapper to exit; its exit code.
pub(crate) async fn wait_exit(mut collector: Process) -> Option<i32> {
    tokio::task::spawn_blocking(move || {
        eventually_blocking(
            Duration::from_secs(60),
            "the wrapper's exit",
            || match collector.try_status() {
                Some(status) => Ok(status.code()),
                None => Err("still running".to_owned()),
            },
        )
    })
    .await
    .unwrap()
}

/// SIGTERM, then the collector's exit status and its last log line (the sender's summary).
fn stop_collector(mut collector: Process) -> (ExitStatus, Value) {
    let status = collector.terminate();
    let log = std::fs::read_to_string(collector.log_path()).unwrap();
    let last = log
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or(Value::Null);
    (status, last)
}

const RANK_NAMES: [&str; 5] = [
    "network_receive_megabytes",
    "network_transmit_megabytes",
    "container_memory_working_set_megabytes",
    "container_memory_peak_megabytes",
    "container_cpu_utilization_percentage",
];

fn dedup_proxy(dir: &Path, upstream: &str) -> ProxyProcess {
    // A long failover timeout: the first reporter keeps its seat for the whole test.
    spawn_proxy(
        upstream,
        &[
            "--dedup-update-interval",
            "300ms",
            "--dedup-failover-timeout",
            "60s",
        ],
        dir,
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn two_collectors_claiming_one_node_store_the_contracts_keys_and_one_node_series() {
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let proxy = dedup_proxy(dir.path(), mlflow);
    let run_id = create_run(mlflow, "collector").await;

    let collectors = [
        start_collector(dir.path(), &proxy.url, &run_id, "node-c", 0, &[]),
        start_collector(dir.path(), &proxy.url, &run_id, "node-c", 1, &[]),
    ];
    for rank in [0, 1] {
        wait_for_points(
            mlflow,
            &run_id,
            &format!("system/rank-{rank}/network_receive_megabytes"),
            5,
            Duration::from_secs(90),
        )
        .await;
    }
    let stopped: Vec<(ExitStatus, Value)> =
        tokio::task::spawn_blocking(move || collectors.into_iter().map(stop_collector).collect())
            .await
            .unwrap();
    for (status, summary) in &stopped {
        assert!(
            status.success(),
            "the collector exits 0 on SIGTERM: {status} {summary}"
        );
        assert_eq!(
            summary["message"], "stopped; everything buffered was sent",
            "{summary}"
        );
    }

    let keys = metric_keys(mlflow, &run_id).await;
    for name in NODE_WIDE_NAMES {
        assert!(
            keys.contains(&format!("system/node-c/{name}")),
            "missing node-c/{name} in {keys:?}"
        );
    }
    for rank in [0, 1] {
        for name in RANK_NAMES {
            assert!(
                keys.contains(&format!("system/rank-{rank}/{name}")),
                "missing rank-{rank}/{name} in {keys:?}"
            );
        }
    }
    for key in &keys {
        let name = key.rsplit('/').next().unwrap();
        let rule = mlscope_scopes::rule_for(name)
            .unwrap_or_else(|| panic!("{key} is not in the scope table"));
        let owner = key.trim_start_matches("system/").split('/').next().unwrap();
        if rule.scope.is_node_wide() {
            assert_eq!(owner, "node-c", "{key}");
        } else {
            assert!(owner == "rank-0" || owner == "rank-1", "{key}");
        }
    }

    // One node series: exactly the elected reporter's samples, each step once and rising.
    let view: Value = http()
        .get(format!("{}/runs/{run_id}/scopes", proxy.admin_url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let reporter = view["reporters"][0]["rank"]
        .as_i64()
        .expect("a reporter for node-c");
    assert_eq!(view["reporters"].as_array().unwrap().len(), 1, "{view}");
    let reporter_samples = steps(
        mlflow,
        &run_id,
        &format!("system/rank-{reporter}/network_receive_megabytes"),
    )
    .await;
    for name in NODE_WIDE_NAMES {
        let node_steps = steps(mlflow, &run_id, &format!("system/node-c/{name}")).await;
        assert_eq!(
            node_steps, reporter_samples,
            "{name}: one point per reporter sample, not one per collector"
        );
    }
    let standby = view["identities"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["rank"].as_i64() == Some(1 - reporter))
        .expect("the standby rank");
    assert!(
        standby["node_samples_dropped"].as_u64().unwrap() >= 5 * NODE_WIDE_NAMES.len() as u64,
        "{view}"
    );

    let run = get_run(mlflow, &run_id).await;
    let latest = |key: &str| {
        run["run"]["data"]["metrics"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["key"] == key)
            .unwrap()["value"]
            .as_f64()
            .unwrap()
    };
    assert!(latest("system/rank-0/container_memory_working_set_megabytes") > 0.0);
    assert!((0.0..=100.0).contains(&latest("system/node-c/node_memory_usage_percentage")));
}

#[tokio::test(flavor = "multi_thread")]
async fn with_the_proxy_down_for_a_minute_no_sample_is_lost() {
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let (port, admin_port) = (free_port(), free_port());
    let mut proxy = spawn_proxy_on(mlflow, &[], dir.path(), port, admin_port).unwrap();
    let run_id = create_run(mlflow, "collector").await;
    let collector = start_collector(dir.path(), &proxy.url, &run_id, "node-d", 0, &[]);
    let rank_key = "system/rank-0/network_receive_megabytes";
    wait_for_points(mlflow, &run_id, rank_key, 3, Duration::from_secs(60)).await;

    let proxy = tokio::task::spawn_blocking(move || {
        assert!(proxy.process.terminate().success());
        proxy
    })
    .await
    .unwrap();
    let down_at = steps(mlflow, &run_id, rank_key).await.len();
    // The outage: a minute of samples go nowhere but the collector's buffer.
    consistently(
        Duration::from_secs(60),
        "nothing reaches MLflow while the proxy is down",
        async || match steps(mlflow, &run_id, rank_key).await.len() {
            have if have == down_at => Ok(()),
            have => Err(format!("{have} points of {rank_key}, {down_at} before")),
        },
    )
    .await;
    drop(proxy);
    let _proxy = spawn_proxy_on(mlflow, &[], dir.path(), port, admin_port).unwrap();
    // The backlog (60 samples) arrives, then a few more live ones.
    wait_for_points(
        mlflow,
        &run_id,
        rank_key,
        down_at + 63,
        Duration::from_secs(90),
    )
    .await;
    let (status, summary) = tokio::task::spawn_blocking(move || stop_collector(collector))
        .await
        .unwrap();
    assert!(status.success(), "{status} {summary}");
    assert_eq!(
        summary["message"], "stopped; everything buffered was sent",
        "{summary}"
    );

    // Every sample the collector took is stored exactly once, in order: steps 0, 1, 2, ...
    // (`sent` counts requests: the samples, the placement tags sent with the first one, and the
    // pre-flight's tags sent at the start).
    let sent = summary["sent"].as_u64().unwrap() as i64 - 2;
    assert!(sent >= 66, "{summary}");
    for key in [
        rank_key.to_owned(),
        "system/rank-0/container_memory_working_set_megabytes".into(),
        "system/node-d/node_cpu_utilization_percentage".into(),
    ] {
        assert_eq!(
            steps(mlflow, &run_id, &key).await,
            (0..sent).collect::<Vec<_>>(),
            "{key}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn wrapper_mode_records_how_the_rank_ended_on_the_run() {
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let run_id = create_run(mlflow, "collector").await;
    let collector = start_collector(
        dir.path(),
        stack.proxy_url(),
        &run_id,
        "node-w",
        4,
        &["sh", "-c", "sleep 1; exit 3"],
    );
    let code = wait_exit(collector).await;
    assert_eq!(code, Some(3));
    let tags = run_tags(mlflow, &run_id).await;
    for (key, value) in [
        ("mlscope/rank-4/outcome", "exited"),
        ("mlscope/rank-4/exit_code", "3"),
        ("mlscope/rank-4/node", "node-w"),
    ] {
        assert!(
            tags.get(key).map(String::as_str) == Some(value),
            "{key}={value} not in {tags:?}"
        );
    }
    assert!(metric_keys(mlflow, &run_id)
        .await
        .contains("system/rank-4/container_memory_working_set_megabytes"));
}
