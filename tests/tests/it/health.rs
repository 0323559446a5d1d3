//! Run health end to end: real collectors (wrapper mode) posting through mlscope-proxy into the
//! real MLflow, real signals and a real memory cgroup. A run whose rank was killed ends FAILED
//! with outcome `killed` as soon as its other rank is done; an OOM kill gives `oom_killed`; a pod
//! that vanished leaves its run `lost` after the stale timeout, while a live run and a run its
//! client finished are left alone, by two replicas sharing PostgreSQL that judge each run once.

use std::path::Path;
use std::time::{Duration, Instant};

use mlscope_tests::{
    consistently, eventually, spawn_proxy, MemoryCgroup, PostgresDatabase, ProxyProcess, TestStack,
};
use serde_json::{json, Value};

use crate::collector::{start_collector, start_collector_with, wait_exit};
use crate::mlflow::{create_run, get_run, http, now_ms, post, run_tags, scrape};

/// A proxy judging quickly: heartbeats flushed every 200 ms, a sweep every 300 ms.
pub(crate) fn health_proxy(
    dir: &Path,
    mlflow: &str,
    stale_after: &str,
    extra: &[&str],
) -> ProxyProcess {
    let mut args = vec![
        "--run-stale-after",
        stale_after,
        "--health-sweep-interval",
        "300ms",
        "--health-flush-interval",
        "200ms",
    ];
    args.extend_from_slice(extra);
    spawn_proxy(mlflow, &args, dir).unwrap()
}

fn status(run: &Value) -> String {
    run["run"]["info"]["status"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// Polls the run until its status is `wanted`; panics with the run after `timeout`.
pub(crate) async fn wait_for_status(
    mlflow: &str,
    run_id: &str,
    wanted: &str,
    timeout: Duration,
) -> Value {
    eventually(timeout, format_args!("run {run_id} {wanted}"), async || {
        let run = get_run(mlflow, run_id).await;
        if status(&run) == wanted {
            Ok(run)
        } else {
            Err(run.to_string())
        }
    })
    .await
}

pub(crate) async fn health_view(proxy: &ProxyProcess, run_id: &str) -> (u16, Value) {
    let response = http()
        .get(format!("{}/runs/{run_id}/health", proxy.admin_url))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// The sum of a counter's samples over the proxies' `/metrics`.
pub(crate) async fn counter(proxies: &[&ProxyProcess], series: &str) -> f64 {
    let mut total = 0.0;
    for proxy in proxies {
        total += scrape(&proxy.admin_url)
            .await
            .lines()
            .filter(|l| l.starts_with(series))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum::<f64>();
    }
    total
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_rank_fails_the_run_once_its_other_rank_exited_without_waiting_for_the_timeout() {
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    // A stale timeout far beyond the test: only the wrapper's report can end the run in time.
    let proxy = health_proxy(dir.path(), mlflow, "10m", &[]);
    let run_id = create_run(mlflow, "health-killed").await;
    let pid_file = dir.path().join("rank-1.pid");
    let normal = start_collector(
        dir.path(),
        &proxy.url,
        &run_id,
        "node-h",
        0,
        &["sh", "-c", "sleep 4"],
    );
    let script = format!("echo $$ > '{}'; exec sleep 300", pid_file.display());
    let victim = start_collector(
        dir.path(),
        &proxy.url,
        &run_id,
        "node-h",
        1,
        &["sh", "-c", &script],
    );

    // Samples of both ranks arrive (with rank 1's limits); the run is alive.
    let (code, view) = eventually(
        Duration::from_secs(30),
        "samples of both ranks in the health view and rank 1's limits on the run",
        async || {
            let (code, view) = health_view(&proxy, &run_id).await;
            let tags = run_tags(mlflow, &run_id).await;
            let arrived = view["ranks"].as_array().is_some_and(|r| r.len() == 2)
                && tags.contains_key("mlscope/rank-1/memory_limit_megabytes")
                && tags.contains_key("mlscope/rank-1/cpu_limit_cores")
                && std::fs::read_to_string(&pid_file).is_ok_and(|pid| pid.ends_with('\n'));
            if arrived {
                Ok((code, view))
            } else {
                Err(format!("{code} {view}; tags {tags:?}"))
            }
        },
    )
    .await;
    assert_eq!(status(&get_run(mlflow, &run_id).await), "RUNNING");
    assert_eq!(
        (code, view["state"].as_str()),
        (200, Some("live")),
        "{view}"
    );
    assert_eq!(view["ranks"].as_array().unwrap().len(), 2, "{view}");
    // Placement, on the run page from the first sample on.
    let tags = run_tags(mlflow, &run_id).await;
    for (key, value) in [
        ("mlscope/rank-0/node", "node-h"),
        ("mlscope/rank-0/pod", "pod-node-h-0"),
        ("mlscope/rank-1/pod", "pod-node-h-1"),
    ] {
        assert_eq!(
            tags.get(key).map(String::as_str),
            Some(value),
            "{key}: {tags:?}"
        );
    }
    assert!(
        tags.contains_key("mlscope/rank-1/memory_limit_megabytes"),
        "{tags:?}"
    );
    assert!(
        tags.contains_key("mlscope/rank-1/cpu_limit_cores"),
        "{tags:?}"
    );

    // Rank 1's training process is SIGKILLed; rank 0 exits normally.
    let pid = std::fs::read_to_string(&pid_file).unwrap();
    let killed = std::process::Command::new("kill")
        .args(["-KILL", pid.trim()])
        .status()
        .unwrap();
    assert!(killed.success());
    assert_eq!(wait_exit(victim).await, Some(137));
    assert_eq!(wait_exit(normal).await, Some(0));

    let run = wait_for_status(mlflow, &run_id, "FAILED", Duration::from_secs(30)).await;
    let tags = run_tags(mlflow, &run_id).await;
    assert_eq!(
        tags.get("mlscope.outcome").map(String::as_str),
        Some("killed"),
        "{tags:?}"
    );
    assert!(
        tags["mlscope.outcome_detail"]
            .starts_with("rank 1 on node-h was killed by a signal (exit 137)"),
        "{tags:?}"
    );
    assert!(
        tags["mlflow.note.content"].contains("mlscope: outcome killed."),
        "{tags:?}"
    );
    assert!(
        tags["mlscope.last_heard"].contains("rank 1 on node-h"),
        "{tags:?}"
    );
    let end_time = run["run"]["info"]["end_time"].as_i64().unwrap();
    assert!(
        end_time <= now_ms() && end_time > now_ms() - 60_000,
        "{run}"
    );

    let (code, view) = health_view(&proxy, &run_id).await;
    assert_eq!(code, 200);
    assert_eq!(view["state"], "judged", "{view}");
    assert_eq!(view["outcome"], "killed", "{view}");
    assert_eq!(view["action"], "end", "{view}");
    let outcomes: Vec<(i64, String, String)> = view["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["rank"].as_i64().unwrap(),
                r["outcome"].as_str().unwrap_or("-").to_owned(),
                r["pod"].as_str().unwrap_or("-").to_owned(),
            )
        })
        .collect();
    assert_eq!(
        outcomes,
        [
            (0, "exited".into(), "pod-node-h-0".into()),
            (1, "killed".into(), "pod-node-h-1".into())
        ]
    );
    assert_eq!(
        counter(
            &[&proxy],
            r#"mlscope_runs_judged_total{outcome="killed",action="end"}"#
        )
        .await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rank_oom_killed_in_a_real_memory_cgroup_fails_the_run_as_oom_killed() {
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let proxy = health_proxy(dir.path(), mlflow, "10m", &[]);
    let run_id = create_run(mlflow, "health-oom").await;
    let cgroup = MemoryCgroup::create("mlscope-health-oom", 64 << 20)
        .expect("needs root and a cgroup v1 memory controller (this project's machines have both)");
    let python = mlscope_tests::venv().join("bin/python");
    let command = cgroup.run_inside(&[
        python.to_str().unwrap(),
        "-c",
        "import time; time.sleep(2); b = b'x' * (256 << 20)",
    ]);
    let cgroup_dir = cgroup.dir.to_str().unwrap().to_owned();
    let wrapped: Vec<&str> = command.iter().map(String::as_str).collect();
    let collector = start_collector_with(
        dir.path(),
        &proxy.url,
        &run_id,
        "node-o",
        0,
        &["--cgroup-path", &cgroup_dir],
        &wrapped,
    );
    assert_eq!(wait_exit(collector).await, Some(137));

    wait_for_status(mlflow, &run_id, "FAILED", Duration::from_secs(30)).await;
    let tags = run_tags(mlflow, &run_id).await;
    assert_eq!(
        tags.get("mlscope.outcome").map(String::as_str),
        Some("oom_killed"),
        "{tags:?}"
    );
    assert!(
        tags["mlscope.outcome_detail"].contains("was OOM-killed"),
        "{tags:?}"
    );
    // The limit of the cgroup the rank ran in, on the run page.
    assert_eq!(
        tags.get("mlscope/rank-0/memory_limit_megabytes")
            .map(String::as_str),
        Some(format!("{}", (64u64 << 20) as f64 / 1e6).as_str()),
        "{tags:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_vanished_pod_is_lost_after_the_timeout_and_two_replicas_judge_it_once_leaving_live_and_finished_runs_alone(
) {
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let admin = std::env::var("MLSCOPE_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let database = PostgresDatabase::create(&admin, "mlscope_it").unwrap();
    let shared = ["--database-url", database.url.as_str()];
    let replicas = [
        health_proxy(dir.path(), mlflow, "4s", &shared),
        health_proxy(dir.path(), mlflow, "4s", &shared),
    ];
    let lost = create_run(mlflow, "health-lost").await;
    let live = create_run(mlflow, "health-live").await;
    let finished = create_run(mlflow, "health-finished").await;
    let mut vanishing = start_collector(
        dir.path(),
        &replicas[0].url,
        &lost,
        "node-l",
        0,
        &["sleep", "300"],
    );
    let alive = start_collector(
        dir.path(),
        &replicas[1].url,
        &live,
        "node-a",
        0,
        &["sleep", "300"],
    );
    let mut done = start_collector(
        dir.path(),
        &replicas[0].url,
        &finished,
        "node-f",
        0,
        &["sleep", "300"],
    );
    // Each run has its rank's heartbeat in the shared store.
    for (replica, run) in [(0, &lost), (1, &live), (0, &finished)] {
        eventually(
            Duration::from_secs(30),
            format_args!("a heartbeat of run {run} in replica {replica}'s health view"),
            async || match health_view(&replicas[replica], run).await {
                (200, view) if view["ranks"].as_array().is_some_and(|r| r.len() == 1) => Ok(()),
                (code, view) => Err(format!("{code} {view}")),
            },
        )
        .await;
    }
    // The pod vanishes: collector and training process killed at once, no word from either.
    let killed_at = now_ms();
    vanishing.kill();
    // The client of the third run finishes it, then its pod goes the same way.
    post(
        mlflow,
        "runs/update",
        json!({"run_id": finished, "status": "FINISHED", "end_time": now_ms()}),
    )
    .await;
    done.kill();

    let run = wait_for_status(mlflow, &lost, "FAILED", Duration::from_secs(40)).await;
    let tags = run_tags(mlflow, &lost).await;
    assert_eq!(
        tags.get("mlscope.outcome").map(String::as_str),
        Some("lost"),
        "{tags:?}"
    );
    assert_eq!(
        tags.get("mlscope.silent_nodes").map(String::as_str),
        Some("node-l")
    );
    assert!(
        tags["mlscope.last_heard"].starts_with("rank 0 on node-l: "),
        "{tags:?}"
    );
    assert!(tags.contains_key("mlscope/rank-0/last_heard"), "{tags:?}");
    // Ended at its last heartbeat: before the kill, within a sampling interval or two of it.
    let end_time = run["run"]["info"]["end_time"].as_i64().unwrap();
    assert!(
        end_time <= killed_at && end_time >= killed_at - 3_000,
        "end_time {end_time}, killed at {killed_at}"
    );

    // For several sweeps, beyond the stale timeout: the live run and the finished run stay as
    // their clients left them.
    consistently(
        Duration::from_secs(6),
        "the live run RUNNING and the finished run FINISHED, neither with an outcome",
        async || {
            let live_run = get_run(mlflow, &live).await;
            let live_tags = run_tags(mlflow, &live).await;
            let finished_run = get_run(mlflow, &finished).await;
            let finished_tags = run_tags(mlflow, &finished).await;
            if status(&live_run) == "RUNNING"
                && !live_tags.contains_key("mlscope.outcome")
                && status(&finished_run) == "FINISHED"
                && !finished_tags.contains_key("mlscope.outcome")
            {
                Ok(())
            } else {
                Err(format!(
                    "live: {live_run}, tags {live_tags:?}; finished: {finished_run}, tags {finished_tags:?}"
                ))
            }
        },
    )
    .await;
    let (_, view) = health_view(&replicas[1], &finished).await;
    assert_eq!(
        (
            view["state"].as_str(),
            view["outcome"].as_str(),
            view["action"].as_str()
        ),
        (Some("judged"), Some("ended_by_client"), Some("none")),
        "{view}"
    );

    // Each dead run was judged by one replica, once.
    let both = [&replicas[0], &replicas[1]];
    assert_eq!(
        counter(
            &both,
            r#"mlscope_runs_judged_total{outcome="lost",action="end"}"#
        )
        .await,
        1.0
    );
    assert_eq!(
        counter(
            &both,
            r#"mlscope_runs_judged_total{outcome="ended_by_client",action="none"}"#
        )
        .await,
        1.0
    );
    let (_, view) = health_view(&replicas[0], &live).await;
    assert_eq!(view["state"], "live", "{view}");
    drop(alive);
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_gpus_of_a_live_run_are_gauged_per_run_and_shown_in_its_health() {
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let proxy = health_proxy(dir.path(), mlflow, "10m", &["--gpu-idle-after", "30m"]);
    let run_id = create_run(mlflow, "health-gpus").await;
    // What the collector of a rank with two GPUs sends: GPU 0 busy, GPU 1 idle for an hour.
    let body = json!({
        "run_id": run_id,
        "metrics": [
            {"key": "system/rank-0/gpu_0_utilization_percentage", "value": 97, "timestamp": now_ms(), "step": 0},
            {"key": "system/rank-0/gpu_0_idle_seconds", "value": 0, "timestamp": now_ms(), "step": 0},
            {"key": "system/rank-0/gpu_1_utilization_percentage", "value": 0, "timestamp": now_ms(), "step": 0},
            {"key": "system/rank-0/gpu_1_idle_seconds", "value": 3600, "timestamp": now_ms(), "step": 0},
        ],
    });
    let response = http()
        .post(format!("{}/api/2.0/mlflow/runs/log-batch", proxy.url))
        .header("X-Mlscope-Node", "node-g")
        .header("X-Mlscope-Rank", "0")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);

    let (allocated, idle) = (
        format!(r#"mlscope_run_gpus_allocated{{run_id="{run_id}"}} 2"#),
        format!(r#"mlscope_run_gpus_idle{{run_id="{run_id}"}} 1"#),
    );
    eventually(
        Duration::from_secs(20),
        format_args!("GPU gauges for {run_id}"),
        async || {
            let metrics = scrape(&proxy.admin_url).await;
            if metrics.contains(&allocated) && metrics.contains(&idle) {
                Ok(())
            } else {
                Err(metrics)
            }
        },
    )
    .await;
    let (code, view) = health_view(&proxy, &run_id).await;
    assert_eq!(code, 200);
    assert_eq!(
        (view["gpus_allocated"].as_i64(), view["gpus_idle"].as_i64()),
        (Some(2), Some(1))
    );
    let gpus = &view["ranks"][0]["gpus"];
    assert_eq!(gpus[0]["idle"], false, "{view}");
    assert_eq!(gpus[1]["idle"], true, "{view}");
    assert!(
        gpus[1]["idle_seconds"].as_f64().unwrap() >= 3600.0,
        "{view}"
    );

    // A run nobody sent anything for: a clear MLflow-style 404.
    let (code, view) = health_view(&proxy, "0123456789abcdef").await;
    assert_eq!(code, 404);
    assert_eq!(view["error_code"], "RESOURCE_DOES_NOT_EXIST");
}

/// Under MLflow's basic-auth app: the sweep ends a dead run with its service credential; without
/// one, MLflow's refusal is counted and the run left alone; and heartbeats MLflow refused (an
/// anonymous client) never make a run judgeable.
#[tokio::test(flavor = "multi_thread")]
async fn with_mlflow_authentication_the_sweep_acts_only_with_its_service_credential() {
    use mlscope_tests::{MlflowServer, S3Store, MLFLOW_ADMIN_PASSWORD};
    let dir = tempfile::tempdir().unwrap();
    let s3 = S3Store::start(dir.path()).unwrap();
    let mlflow = MlflowServer::start_with_basic_auth(dir.path(), &s3).unwrap();
    let with_credential = health_proxy(
        dir.path(),
        &mlflow.url,
        "3s",
        &[
            "--mlflow-service-username",
            "admin",
            "--mlflow-service-password",
            MLFLOW_ADMIN_PASSWORD,
        ],
    );
    let without = health_proxy(dir.path(), &mlflow.url, "3s", &[]);
    let admin = |method: reqwest::Method, path: &str, body: Option<Value>| {
        let mut request = http()
            .request(method, format!("{}/api/2.0/mlflow/{path}", mlflow.url))
            .basic_auth("admin", Some(MLFLOW_ADMIN_PASSWORD));
        if let Some(body) = body {
            request = request.json(&body);
        }
        async move { request.send().await.unwrap().json::<Value>().await.unwrap() }
    };
    let create = |name: &'static str| async move {
        let name = format!("{name}-{}", uuid::Uuid::new_v4().simple());
        let experiment = admin(
            reqwest::Method::POST,
            "experiments/create",
            Some(json!({"name": name})),
        )
        .await;
        let body = json!({"experiment_id": experiment["experiment_id"], "start_time": now_ms()});
        let run = admin(reqwest::Method::POST, "runs/create", Some(body)).await;
        run["run"]["info"]["run_id"].as_str().unwrap().to_owned()
    };
    let status_of = |run_id: String| async move {
        admin(
            reqwest::Method::GET,
            &format!("runs/get?run_id={run_id}"),
            None,
        )
        .await
    };
    // One pod-scope sample of rank 0 on node-s, with the admin's credential or none; the status.
    let heartbeat = |proxy: &ProxyProcess, run_id: &str, authenticated: bool| {
        let mut request = http()
            .post(format!("{}/api/2.0/mlflow/runs/log-batch", proxy.url))
            .header("X-Mlscope-Node", "node-s")
            .header("X-Mlscope-Rank", "0")
            .json(&json!({"run_id": run_id, "metrics": [
                {"key": "system/rank-0/network_receive_megabytes", "value": 1.0, "timestamp": now_ms(), "step": 0}]}));
        if authenticated {
            request = request.basic_auth("admin", Some(MLFLOW_ADMIN_PASSWORD));
        }
        async move { request.send().await.unwrap().status().as_u16() }
    };
    let ended = create("health-auth-ended").await;
    let refused = create("health-auth-refused").await;
    let intruded = create("health-auth-intruded").await;
    assert_eq!(heartbeat(&with_credential, &ended, true).await, 200);
    assert_eq!(heartbeat(&without, &refused, true).await, 200);
    // MLflow refuses the anonymous client: 401, and nothing is recorded for the run.
    assert_eq!(heartbeat(&with_credential, &intruded, false).await, 401);
    // Nor may it end another user's run to have it billed (and left alone by the sweep): MLflow
    // refuses the update, so `ended` is still judged lost below.
    let forged_end = http()
        .post(format!(
            "{}/api/2.0/mlflow/runs/update",
            with_credential.url
        ))
        .json(&json!({"run_id": ended, "status": "FINISHED", "end_time": now_ms()}))
        .send()
        .await
        .unwrap();
    assert_eq!(forged_end.status(), 401);

    let run = eventually(
        Duration::from_secs(30),
        "the run ended with the service credential",
        async || {
            let run = status_of(ended.clone()).await;
            if status(&run) == "FAILED" {
                Ok(run)
            } else {
                Err(run.to_string())
            }
        },
    )
    .await;
    let tags = run["run"]["data"]["tags"].to_string();
    assert!(
        tags.contains("mlscope.outcome") && tags.contains("lost"),
        "{run}"
    );
    // Several sweeps later: the proxy without a credential was refused and changed nothing.
    eventually(
        Duration::from_secs(30),
        "a refusal counted by the proxy without a credential",
        async || {
            let refused = counter(
                &[&without],
                r#"mlscope_health_sweep_errors_total{reason="refused"}"#,
            )
            .await;
            if refused >= 1.0 {
                Ok(())
            } else {
                Err(format!("{refused} refusals"))
            }
        },
    )
    .await;
    let run = status_of(refused.clone()).await;
    assert_eq!(status(&run), "RUNNING", "{run}");
    assert!(!run.to_string().contains("mlscope.outcome"), "{run}");
    let run = status_of(intruded.clone()).await;
    assert_eq!(status(&run), "RUNNING", "{run}");
    let (code, _) = health_view(&with_credential, &intruded).await;
    assert_eq!(code, 404, "a refused heartbeat was recorded");
}

/// Posts a log-batch to the proxy, with the collector's identity headers when `rank` is given
/// (`(node, rank)`); returns the status.
async fn log_batch(proxy: &ProxyProcess, rank: Option<(&str, u32)>, body: Value) -> u16 {
    let mut request = http()
        .post(format!("{}/api/2.0/mlflow/runs/log-batch", proxy.url))
        .json(&body);
    if let Some((node, rank)) = rank {
        request = request
            .header("x-mlscope-node", node)
            .header("x-mlscope-rank", rank.to_string());
    }
    request.send().await.unwrap().status().as_u16()
}

fn sample(run: &str, key: &str, step: i64) -> Value {
    json!({"run_id": run, "metrics": [{"key": key, "value": 1.0, "timestamp": now_ms(), "step": step}]})
}

fn outcome_tag(run: &str, rank: u32) -> Value {
    json!({"run_id": run, "tags": [{"key": format!("mlscope/rank-{rank}/outcome"), "value": "killed"}]})
}

/// Liveness cannot be forged or missed: tags `mlscope/rank-<r>/outcome=killed` sent by anyone
/// but rank r itself do not end a live two-rank run (before: FAILED within one sweep); an end
/// that rank r's identity reported is cleared by its own samples that keep coming; and a run that
/// got one system sample and then only its loss, every 500 ms, stays RUNNING past
/// `--run-stale-after` (before: judged lost while still writing), and is judged lost once the
/// writes stop; so does a run that writes only params and tags (`log-parameter`, `set-tag`).
#[tokio::test(flavor = "multi_thread")]
async fn forged_ends_do_not_end_a_live_run_and_plain_writes_are_signs_of_life() {
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let proxy = health_proxy(dir.path(), mlflow, "3s", &[]);
    let ranked = create_run(mlflow, "health-forged").await;
    let writing = create_run(mlflow, "health-writing").await;
    let tagging = create_run(mlflow, "health-tagging").await;
    // One sample of MLflow's own monitor (no identity): the runs now have a rank row.
    for run in [&writing, &tagging] {
        assert_eq!(
            log_batch(
                &proxy,
                None,
                sample(run, "system/cpu_utilization_percentage", 0)
            )
            .await,
            200
        );
    }
    let write_pair = |operation: &'static str, body: Value| {
        let url = format!("{}/api/2.0/mlflow/runs/{operation}", proxy.url);
        async move {
            http()
                .post(url)
                .json(&body)
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };

    let mut step = 0;
    let mut forged_by_rank_0 = None;
    // Samples go on until rank 0's own samples have come for longer than the supersede window
    // (10 s) after its forged end.
    while forged_by_rank_0.is_none_or(|at: Instant| at.elapsed() < Duration::from_secs(12)) {
        step += 1;
        for rank in [0, 1] {
            let key = format!("system/node-f/rank-{rank}/cpu_utilization_percentage");
            assert_eq!(
                log_batch(&proxy, Some(("node-f", rank)), sample(&ranked, &key, step)).await,
                200
            );
        }
        assert_eq!(
            log_batch(&proxy, None, sample(&writing, "loss", step)).await,
            200
        );
        let (operation, key) = if step % 2 == 0 {
            ("log-parameter", format!("p{step}"))
        } else {
            ("set-tag", format!("t{step}"))
        };
        assert_eq!(
            write_pair(
                operation,
                json!({"run_id": tagging, "key": key, "value": "v"})
            )
            .await,
            200
        );
        if step == 2 {
            // Without identity headers, and from another rank's identity: not taken.
            for rank in [0, 1] {
                assert_eq!(
                    log_batch(&proxy, None, outcome_tag(&ranked, rank)).await,
                    200
                );
                assert_eq!(
                    log_batch(
                        &proxy,
                        Some(("node-f", 1 - rank)),
                        outcome_tag(&ranked, rank)
                    )
                    .await,
                    200
                );
            }
        }
        if step == 4 {
            // With rank 0's own identity (all it takes without MLflow authentication): taken,
            // until rank 0's later samples supersede it.
            assert_eq!(
                log_batch(&proxy, Some(("node-f", 0)), outcome_tag(&ranked, 0)).await,
                200
            );
            forged_by_rank_0 = Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for run in [&ranked, &writing, &tagging] {
        assert_eq!(status(&get_run(mlflow, run).await), "RUNNING", "{run}");
    }
    let (code, view) = health_view(&proxy, &ranked).await;
    assert_eq!(code, 200, "{view}");
    let ranks = view["ranks"].as_array().unwrap_or_else(|| panic!("{view}"));
    assert_eq!(ranks.len(), 2, "{view}");
    assert!(
        ranks.iter().all(|r| r["outcome"].is_null()),
        "rank 0's end is superseded by its own later samples: {view}"
    );

    // The writes stop: now the runs that only logged their loss, or params and tags, are lost
    // after --run-stale-after.
    for run in [&writing, &tagging] {
        wait_for_status(mlflow, run, "FAILED", Duration::from_secs(20)).await;
        let tags = run_tags(mlflow, run).await;
        assert_eq!(
            tags.get("mlscope.outcome").map(String::as_str),
            Some("lost"),
            "{tags:?}"
        );
    }
}

/// What a run stood on, as its collectors report it in tags through the proxy: a declared data
/// path that changed and what rank 0's command left running reach MLflow as sent, show in
/// `/runs/{id}/health` (data changes for the run, leftovers on the rank that reported them),
/// and count once in `/metrics` though the collector sent its batch twice (a retry). Another
/// rank's identity cannot put leftovers on rank 0, and a rank that left nothing shows none.
#[tokio::test(flavor = "multi_thread")]
async fn data_changes_and_leftovers_show_in_the_runs_health_and_count_once() {
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let proxy = health_proxy(dir.path(), mlflow, "10m", &[]);
    let run_id = create_run(mlflow, "health-findings").await;
    for rank in [0, 1] {
        let key = format!("system/node-f/rank-{rank}/cpu_utilization_percentage");
        assert_eq!(
            log_batch(&proxy, Some(("node-f", rank)), sample(&run_id, &key, 0)).await,
            200
        );
    }
    let changed = "2026-12-02T14:03:11Z, step 41200, rank 0: 2 vanished, 0 appeared, 0 changed: val/a.tar, val/b.tar";
    let left = "1: 4121 python w.py (812 MB, /dev/nvidia0 /dev/nvidiactl)";
    let reports = json!({"run_id": run_id, "tags": [
        {"key": "mlscope/data/val/changed", "value": changed},
        {"key": "mlscope/rank-0/leftover_processes", "value": left},
        {"key": "mlscope/rank-0/leftover_processes_ended", "value": "1 by SIGTERM"},
        {"key": "mlscope/rank-0/gpu_0_memory_left_megabytes", "value": "812"},
    ]});
    for _ in 0..2 {
        assert_eq!(
            log_batch(&proxy, Some(("node-f", 0)), reports.clone()).await,
            200
        );
    }
    // Rank 1 cannot report rank 0's leftovers; its own "nothing left" shows as such.
    let forged = json!({"run_id": run_id, "tags": [
        {"key": "mlscope/rank-0/leftover_processes", "value": "9: forged"},
        {"key": "mlscope/rank-1/leftover_processes", "value": "0"},
    ]});
    assert_eq!(log_batch(&proxy, Some(("node-f", 1)), forged).await, 200);
    // A data change alone in its batch (no other tag of the rank, no sample) counts too.
    let train = "2026-12-02T14:05:00Z, step 41300, rank 1: path gone";
    let alone =
        json!({"run_id": run_id, "tags": [{"key": "mlscope/data/train/changed", "value": train}]});
    assert_eq!(log_batch(&proxy, Some(("node-f", 1)), alone).await, 200);

    let view = eventually(
        Duration::from_secs(30),
        "the reports in the health view and /metrics",
        async || {
            let (code, view) = health_view(&proxy, &run_id).await;
            let counted = counter(&[&proxy], "mlscope_run_findings_total").await;
            // Findings are stored after MLflow took their batch, each on its own: wait for all.
            let changes = view["data_changes"].as_array().map_or(0, Vec::len);
            if code == 200
                && view["ranks"][1]["leftovers"].is_object()
                && changes == 2
                && counted >= 4.0
            {
                Ok(view)
            } else {
                Err(format!("{code} {view}; {counted} findings counted"))
            }
        },
    )
    .await;
    let mut changes: Vec<(Value, Value, Value)> = view["data_changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["name"].clone(), c["rank"].clone(), c["what"].clone()))
        .collect();
    changes.sort_by_key(|c| c.0.to_string());
    assert_eq!(
        changes,
        [
            (json!("train"), json!(1), json!(train)),
            (json!("val"), json!(0), json!(changed))
        ],
        "{view}"
    );
    assert_eq!(
        view["ranks"][0]["leftovers"],
        json!({"processes": left, "ended": "1 by SIGTERM",
               "gpu_memory_left": [{"index": 0, "megabytes": 812.0}]}),
        "{view}"
    );
    assert_eq!(
        view["ranks"][1]["leftovers"],
        json!({"processes": "0", "ended": null, "gpu_memory_left": []})
    );
    let tags = run_tags(mlflow, &run_id).await;
    assert_eq!(
        tags.get("mlscope/data/val/changed").map(String::as_str),
        Some(changed)
    );
    assert_eq!(
        tags.get("mlscope/rank-1/leftover_processes")
            .map(String::as_str),
        Some("0")
    );
    for (kind, count) in [
        ("data_changed", 2.0),
        ("leftover_processes", 1.0),
        ("gpu_memory_left", 1.0),
    ] {
        let series = format!("mlscope_run_findings_total{{kind=\"{kind}\"}}");
        assert_eq!(counter(&[&proxy], &series).await, count, "{series}");
    }
}
