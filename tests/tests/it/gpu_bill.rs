//! The GPU bill end to end, against the real MLflow: the collector's GPU payload
//! (`system/rank-<r>/gpu_<i>_utilization_percentage`, `gpu_<i>_idle_seconds`, its identity headers
//! and placement tags) sent with controlled timestamps, so that the run's length and each GPU's
//! idle time are known. A run its client ends through the proxy, a rank that went silent, a run
//! the sweep judged lost and a run two replicas on one PostgreSQL share are each billed once, as
//! docs/run-health.md defines; a live run's idle GPUs are named in a tag that goes once they work.

use std::collections::BTreeMap;
use std::time::Duration;

use mlscope_tests::{consistently, eventually, PostgresDatabase, ProxyProcess, TestStack};
use serde_json::{json, Value};

use crate::health::{counter, health_proxy, health_view, wait_for_status};
use crate::mlflow::{get_run, http, now_ms, post, run_tags};

pub(crate) const MIN: i64 = 60_000;

/// A run created directly in MLflow with `start_time` = `start_ms`.
pub(crate) async fn run_started_at(mlflow: &str, prefix: &str, start_ms: i64) -> String {
    let name = format!("{prefix}-{}", uuid::Uuid::new_v4().simple());
    let experiment = post(mlflow, "experiments/create", json!({ "name": name })).await;
    let run = post(
        mlflow,
        "runs/create",
        json!({"experiment_id": experiment["experiment_id"], "start_time": start_ms}),
    )
    .await;
    run["run"]["info"]["run_id"].as_str().unwrap().to_owned()
}

/// One publish of a rank's collector: every GPU's utilization and idle clock, all stamped `at`,
/// with the placement tags on the first publish (`step` 0), as the collector sends them.
pub(crate) fn publish(
    run_id: &str,
    rank: u32,
    node: &str,
    step: i64,
    at: i64,
    gpus: &[f64],
) -> Value {
    let mut metrics = Vec::new();
    for (index, &idle) in gpus.iter().enumerate() {
        let utilization = if idle > 0.0 { 0.0 } else { 97.0 };
        let owner = format!("system/rank-{rank}/gpu_{index}");
        metrics.push(json!({"key": format!("{owner}_utilization_percentage"), "value": utilization, "timestamp": at, "step": step}));
        metrics.push(json!({"key": format!("{owner}_idle_seconds"), "value": idle, "timestamp": at, "step": step}));
    }
    let mut tags = Vec::new();
    if step == 0 {
        for (fact, value) in [
            ("node", node.to_owned()),
            ("pod", format!("pod-{node}-{rank}")),
            ("gpu_count", gpus.len().to_string()),
            ("gpu_model", "NVIDIA H200".to_owned()),
        ] {
            tags.push(json!({"key": format!("mlscope/rank-{rank}/{fact}"), "value": value}));
        }
    }
    json!({"run_id": run_id, "metrics": metrics, "tags": tags})
}

pub(crate) async fn send(proxy: &ProxyProcess, rank: u32, node: &str, body: &Value) {
    let response = http()
        .post(format!("{}/api/2.0/mlflow/runs/log-batch", proxy.url))
        .header("X-Mlscope-Node", node)
        .header("X-Mlscope-Rank", rank.to_string())
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
}

/// A rank's publishes every 10 minutes from `start` for `minutes`: GPU `i` idle throughout
/// when `idle[i]` (its clock rising from 0 at the start), busy otherwise.
pub(crate) fn publishes(start: i64, minutes: i64, idle: &[bool]) -> Vec<(i64, i64, Vec<f64>)> {
    (0..=minutes / 10)
        .map(|k| {
            let at = start + k * 10 * MIN;
            let clocks = idle
                .iter()
                .map(|&i| if i { (k * 600) as f64 } else { 0.0 })
                .collect();
            (k, at, clocks)
        })
        .collect()
}

pub(crate) async fn send_rank(
    proxy: &ProxyProcess,
    run_id: &str,
    rank: u32,
    node: &str,
    publishes: &[(i64, i64, Vec<f64>)],
) {
    for (step, at, clocks) in publishes {
        send(
            proxy,
            rank,
            node,
            &publish(run_id, rank, node, *step, *at, clocks),
        )
        .await;
    }
}

/// Ends the run through `proxy` as MLflow's client does (`run_id` and `run_uuid`).
pub(crate) async fn end_run(proxy: &ProxyProcess, run_id: &str, end_ms: i64) {
    post(
        &proxy.url,
        "runs/update",
        json!({"run_id": run_id, "run_uuid": run_id, "status": "FINISHED", "end_time": end_ms}),
    )
    .await;
}

/// Polls the run's tags until `mlscope.gpu_hours` is there.
pub(crate) async fn billed_tags(mlflow: &str, run_id: &str) -> BTreeMap<String, String> {
    eventually(
        Duration::from_secs(40),
        format_args!("run {run_id} billed"),
        async || {
            let tags = run_tags(mlflow, run_id).await;
            if tags.contains_key("mlscope.gpu_hours") {
                Ok(tags)
            } else {
                Err(format!("{tags:?}"))
            }
        },
    )
    .await
}

pub(crate) fn number(tags: &BTreeMap<String, String>, key: &str) -> f64 {
    tags.get(key)
        .unwrap_or_else(|| panic!("no {key}: {tags:?}"))
        .parse()
        .unwrap_or_else(|_| panic!("{key} is not a number: {tags:?}"))
}

pub(crate) fn within_2_percent(tags: &BTreeMap<String, String>, key: &str, truth: f64) {
    let value = number(tags, key);
    assert!(
        (value - truth).abs() <= 0.02 * truth,
        "{key} = {value}, truth {truth}: {tags:?}"
    );
}

/// (a) two ranks with two GPUs each for two hours, GPU 1 of rank 0 idle throughout, ended by
/// its client: 8 GPU hours, 2 of them idle. (b) the same, but rank 1 goes silent after one hour
/// and the run is ended at two: rank 1 is billed to its last heartbeat (6 GPU hours).
#[tokio::test(flavor = "multi_thread")]
async fn a_run_ended_by_its_client_is_billed_its_gpu_hours_and_a_silent_rank_to_its_last_heartbeat()
{
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let proxy = health_proxy(dir.path(), mlflow, "10m", &[]);
    let start = now_ms() - 3 * 60 * MIN;
    let whole = run_started_at(mlflow, "bill-whole", start).await;
    let silent = run_started_at(mlflow, "bill-silent", start).await;
    send_rank(
        &proxy,
        &whole,
        0,
        "node-a",
        &publishes(start, 120, &[false, true]),
    )
    .await;
    send_rank(
        &proxy,
        &whole,
        1,
        "node-b",
        &publishes(start, 120, &[false, false]),
    )
    .await;
    send_rank(
        &proxy,
        &silent,
        0,
        "node-a",
        &publishes(start, 120, &[false, true]),
    )
    .await;
    send_rank(
        &proxy,
        &silent,
        1,
        "node-b",
        &publishes(start, 60, &[false, false]),
    )
    .await;

    // Live: the bill so far is in the run's health (once every sample is flushed), and the idle
    // GPU is named.
    let view = eventually(
        Duration::from_secs(20),
        "a bill so far of 8 GPU hours",
        async || {
            let (code, view) = health_view(&proxy, &whole).await;
            assert_eq!(
                (code, view["bill"].as_str()),
                (200, Some("running")),
                "{view}"
            );
            if (view["gpu_hours"].as_f64().unwrap_or_default() - 8.0).abs() < 0.16 {
                Ok(view)
            } else {
                Err(view.to_string())
            }
        },
    )
    .await;
    assert!(
        (view["gpu_idle_hours"].as_f64().unwrap() - 2.0).abs() < 0.04,
        "{view}"
    );
    assert_eq!(view["gpus_idle_tag"], "rank-0:gpu1", "{view}");

    end_run(&proxy, &whole, start + 120 * MIN).await;
    end_run(&proxy, &silent, start + 120 * MIN).await;

    let tags = billed_tags(mlflow, &whole).await;
    // Collectors without GPM judge idleness by utilisation, and the run says so.
    assert_eq!(tags["mlscope.gpu_idle_basis"], "utilization", "{tags:?}");
    within_2_percent(&tags, "mlscope.gpu_hours", 8.0);
    within_2_percent(&tags, "mlscope.gpu_idle_hours", 2.0);
    within_2_percent(&tags, "mlscope.gpu_idle_fraction", 0.25);
    within_2_percent(&tags, "mlscope/rank-0/gpu_hours", 4.0);
    within_2_percent(&tags, "mlscope/rank-0/gpu_idle_hours", 2.0);
    within_2_percent(&tags, "mlscope/rank-1/gpu_hours", 4.0);
    assert_eq!(number(&tags, "mlscope/rank-1/gpu_idle_hours"), 0.0);

    let tags = billed_tags(mlflow, &silent).await;
    within_2_percent(&tags, "mlscope.gpu_hours", 6.0);
    within_2_percent(&tags, "mlscope.gpu_idle_hours", 2.0);
    within_2_percent(&tags, "mlscope/rank-1/gpu_hours", 2.0);

    // The health view shows what the tags say; the fleet counters have both runs.
    let (_, view) = health_view(&proxy, &whole).await;
    assert_eq!(
        (view["state"].as_str(), view["bill"].as_str()),
        (Some("ended"), Some("billed")),
        "{view}"
    );
    assert!(
        (view["gpu_hours"].as_f64().unwrap() - 8.0).abs() < 0.16,
        "{view}"
    );
    let busy = counter(
        &[&proxy],
        r#"mlscope_gpu_seconds_total{model="NVIDIA H200",state="busy"}"#,
    )
    .await;
    let idle = counter(
        &[&proxy],
        r#"mlscope_gpu_seconds_total{model="NVIDIA H200",state="idle"}"#,
    )
    .await;
    assert!(
        ((busy + idle) / 3600.0 - 14.0).abs() < 0.28 && (idle / 3600.0 - 4.0).abs() < 0.08,
        "busy {busy} s, idle {idle} s"
    );
    assert_eq!(counter(&[&proxy], "mlscope_runs_billed_total").await, 2.0);
    // The idle tag written while the run was live went with its end; no write failed.
    assert!(!run_tags(mlflow, &whole)
        .await
        .contains_key("mlscope.gpus_idle"));
    assert_eq!(
        counter(&[&proxy], "mlscope_health_sweep_errors_total").await,
        0.0
    );
}

/// (c) a run whose only rank vanished is judged lost by the sweep, ended at its last heartbeat,
/// and billed over its samples: one hour of two GPUs, GPU 1 idle for the last half hour.
#[tokio::test(flavor = "multi_thread")]
async fn a_run_the_sweep_judges_lost_is_billed_to_its_last_heartbeat() {
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let proxy = health_proxy(dir.path(), mlflow, "3s", &[]);
    let start = now_ms() - 90 * MIN;
    let run_id = run_started_at(mlflow, "bill-lost", start).await;
    for k in 0..=6 {
        // GPU 1 works until minute 30, then idles: its clock reads 0, 0, 0, 0, 600, 1200, 1800.
        let clock = ((k - 3).max(0) * 600) as f64;
        let body = publish(&run_id, 0, "node-l", k, start + k * 10 * MIN, &[0.0, clock]);
        send(&proxy, 0, "node-l", &body).await;
    }
    wait_for_status(mlflow, &run_id, "FAILED", Duration::from_secs(40)).await;
    let tags = billed_tags(mlflow, &run_id).await;
    assert_eq!(
        tags.get("mlscope.outcome").map(String::as_str),
        Some("lost")
    );
    within_2_percent(&tags, "mlscope.gpu_hours", 2.0);
    within_2_percent(&tags, "mlscope.gpu_idle_hours", 0.5);
    within_2_percent(&tags, "mlscope.gpu_idle_fraction", 0.25);
}

/// (d) two replicas on one PostgreSQL, each hearing one rank (in parts, one part late and out of
/// order), the run ended through one of them: billed once, by one replica, with the true figures.
#[tokio::test(flavor = "multi_thread")]
async fn two_replicas_sharing_postgresql_bill_a_run_once() {
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let admin = std::env::var("MLSCOPE_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let database = PostgresDatabase::create(&admin, "mlscope_bill").unwrap();
    let shared = ["--database-url", database.url.as_str()];
    let replicas = [
        health_proxy(dir.path(), mlflow, "10m", &shared),
        health_proxy(dir.path(), mlflow, "10m", &shared),
    ];
    let start = now_ms() - 3 * 60 * MIN;
    let run_id = run_started_at(mlflow, "bill-replicas", start).await;
    let rank0 = publishes(start, 120, &[false, true]);
    let rank1 = publishes(start, 120, &[false, false]);
    // Each replica's flushes reach the store apart (the pause outlasts the flush interval): the
    // last hour first, then the first (merged before it), then the middle (between the two).
    for (part, pause) in [(9..13, true), (0..5, true), (5..9, false)] {
        send_rank(&replicas[0], &run_id, 0, "node-a", &rank0[part.clone()]).await;
        send_rank(&replicas[1], &run_id, 1, "node-b", &rank1[part]).await;
        if pause {
            tokio::time::sleep(Duration::from_millis(800)).await;
        }
    }
    end_run(&replicas[1], &run_id, start + 120 * MIN).await;

    let tags = billed_tags(mlflow, &run_id).await;
    within_2_percent(&tags, "mlscope.gpu_hours", 8.0);
    within_2_percent(&tags, "mlscope.gpu_idle_hours", 2.0);
    // Through several sweeps of both replicas: billed by one of them, once.
    let both = [&replicas[0], &replicas[1]];
    let billed = async || match counter(&both, "mlscope_runs_billed_total").await {
        1.0 => Ok(()),
        n => Err(format!("billed {n} times")),
    };
    eventually(Duration::from_secs(10), "the run counted billed", billed).await;
    consistently(Duration::from_secs(3), "the run billed once", billed).await;
    let seconds = counter(&both, "mlscope_gpu_seconds_total").await;
    assert!(
        (seconds / 3600.0 - 8.0).abs() < 0.16,
        "{seconds} GPU seconds"
    );
    for replica in &both {
        let (_, view) = health_view(replica, &run_id).await;
        assert_eq!(view["bill"], "billed", "{view}");
    }
}

/// (e) a live run whose GPU has been idle past `--gpu-idle-after` carries `mlscope.gpus_idle`
/// naming it; once it works again the tag is deleted.
#[tokio::test(flavor = "multi_thread")]
async fn idle_gpus_of_a_live_run_are_named_in_a_tag_that_goes_when_they_work_again() {
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let proxy = health_proxy(dir.path(), mlflow, "10m", &["--gpu-idle-after", "30m"]);
    let run_id = run_started_at(mlflow, "bill-idle-tag", now_ms()).await;
    // Rank 1's GPU 0 has been idle an hour, rank 0's GPUs work, rank 1's GPU 1 idles 10 min.
    send(
        &proxy,
        0,
        "node-a",
        &publish(&run_id, 0, "node-a", 0, now_ms(), &[0.0, 0.0]),
    )
    .await;
    send(
        &proxy,
        1,
        "node-b",
        &publish(&run_id, 1, "node-b", 0, now_ms(), &[3600.0, 600.0]),
    )
    .await;
    let tag = |wanted: Option<&'static str>| {
        let run_id = run_id.clone();
        async move {
            eventually(
                Duration::from_secs(30),
                format_args!("mlscope.gpus_idle {wanted:?}"),
                async || {
                    let tags = run_tags(mlflow, &run_id).await;
                    if tags.get("mlscope.gpus_idle").map(String::as_str) == wanted {
                        Ok(())
                    } else {
                        Err(format!("{tags:?}"))
                    }
                },
            )
            .await;
        }
    };
    tag(Some("rank-1:gpu0")).await;
    // It works again: the next sweeps delete the tag.
    send(
        &proxy,
        1,
        "node-b",
        &publish(&run_id, 1, "node-b", 1, now_ms(), &[0.0, 660.0]),
    )
    .await;
    tag(None).await;
    let (_, view) = health_view(&proxy, &run_id).await;
    assert!(view["gpus_idle_tag"].is_null(), "{view}");
    assert_eq!(view["bill"], "running", "{view}");
    assert_eq!(
        counter(&[&proxy], "mlscope_health_sweep_errors_total").await,
        0.0
    );
}

/// POSTs a `runs/update` body to `base` (the proxy or MLflow) and returns MLflow's status and
/// JSON answer, whatever they are.
async fn update_answer(base: &str, body: &Value) -> (u16, Value) {
    let response = http()
        .post(format!("{base}/api/2.0/mlflow/runs/update"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// (f) a client ends its runs with a wild `end_time`, one at the lowest 64-bit value and one at
/// the highest: each gets MLflow's own answer, and each is billed no more than its GPUs were
/// held (one hour of two GPUs, the second idle), in the tags and in the fleet counter.
#[tokio::test(flavor = "multi_thread")]
async fn a_wild_end_time_from_the_client_is_mlflows_to_answer_and_never_inflates_the_bill() {
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let proxy = health_proxy(dir.path(), mlflow, "10m", &[]);
    let start = now_ms() - 90 * MIN;
    for end_time in [i64::MIN, i64::MAX] {
        let run_id = run_started_at(mlflow, "bill-wild-end", start).await;
        send_rank(
            &proxy,
            &run_id,
            0,
            "node-w",
            &publishes(start, 60, &[false, true]),
        )
        .await;
        let body = json!({"run_id": run_id, "run_uuid": run_id, "status": "FINISHED", "end_time": end_time});
        let (status, answer) = update_answer(&proxy.url, &body).await;
        // What MLflow says of the run now is what it answered the update with.
        let info = crate::mlflow::get_run(mlflow, &run_id).await["run"]["info"].clone();
        assert_eq!(
            (status, &answer["run_info"]),
            (200, &info),
            "end_time {end_time}: {answer}"
        );
        let tags = billed_tags(mlflow, &run_id).await;
        within_2_percent(&tags, "mlscope.gpu_hours", 2.0);
        within_2_percent(&tags, "mlscope.gpu_idle_hours", 1.0);
    }
    let seconds = counter(&[&proxy], "mlscope_gpu_seconds_total").await;
    assert!(
        (seconds / 3600.0 - 4.0).abs() < 0.08,
        "{seconds} GPU seconds for two runs of 2 GPU hours"
    );
    assert_eq!(counter(&[&proxy], "mlscope_runs_billed_total").await, 2.0);
}

/// (g) `runs/update` requests MLflow refuses get MLflow's own answer through the proxy: the
/// same status and JSON body as straight from MLflow, for a run that does not exist, a status
/// that is no status, and a body over the proxy's read limit (sent with and without a
/// length, the latter streamed on as it came): none of them is billed.
#[tokio::test(flavor = "multi_thread")]
async fn refused_run_updates_pass_through_with_mlflows_own_answer() {
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let proxy = health_proxy(dir.path(), mlflow, "10m", &[]);
    let run_id = run_started_at(mlflow, "bill-refused-update", now_ms()).await;
    send(
        &proxy,
        0,
        "node-r",
        &publish(&run_id, 0, "node-r", 0, now_ms(), &[0.0]),
    )
    .await;
    let padding = "x".repeat(1_100_000);
    let bodies = [
        json!({"run_id": "0123456789abcdef0123456789abcdef", "status": "FINISHED", "end_time": now_ms()}),
        json!({"run_id": run_id, "status": ["FINISHED"], "end_time": now_ms()}),
        json!({"run_id": "0123456789abcdef0123456789abcdef", "status": "FINISHED", "padding": padding}),
    ];
    let answer = |base: String, body: Vec<u8>, chunked: bool| async move {
        let request = http()
            .post(format!("{base}/api/2.0/mlflow/runs/update"))
            .header("Content-Type", "application/json");
        let request = if chunked {
            let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
                body.chunks(64 * 1024).map(|c| Ok(c.to_vec())).collect();
            request.body(reqwest::Body::wrap_stream(futures_util::stream::iter(
                chunks,
            )))
        } else {
            request.body(body)
        };
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        (
            status,
            response.json::<Value>().await.unwrap_or(Value::Null),
        )
    };
    // Chunked only where the proxy streams the body on unread: a body it reads goes to MLflow
    // with its length (MLflow's server reads no chunked body of its own).
    for (i, body) in bodies.iter().enumerate() {
        for chunked in [false, i == 2] {
            let bytes = serde_json::to_vec(body).unwrap();
            let direct = answer(mlflow.to_owned(), bytes.clone(), chunked).await;
            let through = answer(proxy.url.clone(), bytes, chunked).await;
            assert!(direct.0 >= 400, "case {i}: MLflow took it: {direct:?}");
            assert_eq!(through, direct, "case {i}, chunked {chunked}");
        }
    }
    // The run MLflow kept running is not billed: its health shows the bill so far.
    let view = eventually(
        Duration::from_secs(20),
        "the run's health view",
        async || match health_view(&proxy, &run_id).await {
            (200, view) => Ok(view),
            (code, view) => Err(format!("{code} {view}")),
        },
    )
    .await;
    assert_eq!(view["bill"], "running", "{view}");
    assert_eq!(
        counter(&[&proxy], "mlscope_health_sweep_errors_total").await,
        0.0
    );
}

/// (h) a run whose only rank reported a clean exit (exit status 0) and that its client ended
/// straight at MLflow, not through the proxy: the sweep sees MLflow's end and bills it.
#[tokio::test(flavor = "multi_thread")]
async fn a_run_ended_straight_at_mlflow_after_its_ranks_exited_cleanly_is_billed() {
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let proxy = health_proxy(dir.path(), mlflow, "10m", &[]);
    let start = now_ms() - 90 * MIN;
    let run_id = run_started_at(mlflow, "bill-clean-exit", start).await;
    send_rank(
        &proxy,
        &run_id,
        0,
        "node-c",
        &publishes(start, 60, &[false, true]),
    )
    .await;
    let exited = json!({"run_id": run_id, "tags": [
        {"key": "mlscope/rank-0/outcome", "value": "exited"},
        {"key": "mlscope/rank-0/exit_code", "value": "0"},
    ]});
    send(&proxy, 0, "node-c", &exited).await;
    end_run_at(mlflow, &run_id, start + 60 * MIN).await;
    let tags = billed_tags(mlflow, &run_id).await;
    within_2_percent(&tags, "mlscope.gpu_hours", 2.0);
    within_2_percent(&tags, "mlscope.gpu_idle_hours", 1.0);
}

/// Ends the run straight at MLflow.
async fn end_run_at(mlflow: &str, run_id: &str, end_ms: i64) {
    post(
        mlflow,
        "runs/update",
        json!({"run_id": run_id, "status": "FINISHED", "end_time": end_ms}),
    )
    .await;
}

/// (g) a `runs/update` that spells its run two ways naming two runs (`runId`, which MLflow reads
/// as `run_id` and acts on, and `run_uuid`): the run MLflow ended is billed and the other keeps
/// running, in MLflow and in its health view. (e93dbfe billed the `run_uuid` run: its bill froze
/// and its view said `ended` while it ran.)
#[tokio::test(flavor = "multi_thread")]
async fn a_run_update_spelling_its_run_two_ways_bills_the_run_mlflow_ended_and_no_other() {
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let proxy = health_proxy(dir.path(), mlflow, "10m", &[]);
    let start = now_ms() - 2 * 60 * MIN;
    let ended = run_started_at(mlflow, "bill-ended", start).await;
    let victim = run_started_at(mlflow, "bill-victim", start).await;
    for run in [&ended, &victim] {
        send_rank(&proxy, run, 0, "node-a", &publishes(start, 60, &[false])).await;
    }
    let (status, answer) = update_answer(
        &proxy.url,
        &json!({"runId": ended, "run_uuid": victim, "status": "FINISHED", "end_time": start + 60 * MIN}),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        answer["run_info"]["run_id"],
        ended.as_str(),
        "MLflow ended the runId run"
    );

    let tags = billed_tags(mlflow, &ended).await;
    within_2_percent(&tags, "mlscope.gpu_hours", 1.0);
    // The other run: still running in MLflow, live and unbilled in its view.
    let run = get_run(mlflow, &victim).await;
    assert_eq!(run["run"]["info"]["status"], "RUNNING", "{run}");
    let (code, view) = health_view(&proxy, &victim).await;
    assert_eq!(
        (code, view["state"].as_str(), view["bill"].as_str()),
        (200, Some("live"), Some("running")),
        "{view}"
    );
    assert!(!run_tags(mlflow, &victim)
        .await
        .contains_key("mlscope.gpu_hours"));
}

/// (h) a forged run: `start_time` 1 ms after the epoch, a sample there and one now, 64 GPUs.
/// The bill stays within what the proxy saw of the rank (at most six hours of backfill before it
/// first heard it), in the tags and in the fleet counter, which cannot be undone (e93dbfe billed
/// 31.9 M GPU hours).
#[tokio::test(flavor = "multi_thread")]
async fn a_forged_start_and_sample_time_bills_no_more_than_the_proxy_saw() {
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let proxy = health_proxy(dir.path(), mlflow, "10m", &[]);
    let run = run_started_at(mlflow, "bill-forged", 1).await;
    let gpus = vec![0.0; 64];
    let now = now_ms();
    send(
        &proxy,
        0,
        "node-a",
        &publish(&run, 0, "node-a", 0, 1, &gpus),
    )
    .await;
    send(
        &proxy,
        0,
        "node-a",
        &publish(&run, 0, "node-a", 1, now, &gpus),
    )
    .await;
    end_run(&proxy, &run, now).await;
    let tags = billed_tags(mlflow, &run).await;
    let hours = number(&tags, "mlscope.gpu_hours");
    assert!(hours <= 64.0 * 6.1, "{hours} GPU hours billed: {tags:?}");
    let total = counter(
        &[&proxy],
        r#"mlscope_gpu_seconds_total{model="NVIDIA H200",state="busy"}"#,
    )
    .await;
    assert!(total <= 64.0 * 6.1 * 3600.0, "fleet counter {total} s");
}
