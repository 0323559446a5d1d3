//! The run report end to end, against the real stack: two proxy replicas sharing PostgreSQL, a
//! two-rank run whose ranks are real collectors in wrapper mode, each measuring the real cgroups
//! its command runs in (a memory limit and a CFS quota), with a known memory and CPU load, GPU
//! payloads as a collector with a GPU sends them, and the run's own loss logged at rising steps.
//! Rank 1 is OOM-killed; the sweep fails the run; one replica writes one report: the artifact
//! `mlscope/report.html`, the summary and advice tags, and the figures of `/runs/{id}/report`
//! match the samples MLflow stored.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mlscope_tests::{
    consistently, eventually, MemoryCgroup, PostgresDatabase, ProxyProcess, TestStack,
};
use serde_json::{json, Value};

use crate::collector::{start_collector_with, wait_exit};
use crate::health::{counter, health_proxy, health_view, wait_for_status};
use crate::mlflow::{create_run, get_run, http, now_ms, points, post, response_json, run_tags};

const MIB: u64 = 1 << 20;
const GIB_MB: f64 = (1u64 << 30) as f64 / 1e6;
const NODE: &str = "node-rp";
const GPU_MODEL: &str = "NVIDIA H200";

/// What the report's advice is judged by (server/src/capabilities/health/report/model.rs),
/// written out here.
const MEMORY_HEADROOM: f64 = 0.4;
const OVERSIZED: f64 = 0.75;
const THROTTLED: f64 = 10.0;
const STRAGGLER: f64 = 0.7;
const STRAGGLER_MEDIAN_FLOOR: f64 = 20.0;

/// Rank 0: takes 200 MB in four steps a second apart, then spins a CPU for 10 s (under a quota
/// of half a core: throttled in most periods), says it is done (the file named by its argument),
/// and exits 0.
const RANK_0: &str = "
import sys, time
held = []
for _ in range(4):
    held.append(b'x' * 50_000_000)
    time.sleep(1)
end = time.monotonic() + 10
while time.monotonic() < end:
    pass
open(sys.argv[1], 'w').close()
";
/// Rank 1: holds 40 MB until rank 0 is done (the file named by its argument; two minutes at
/// most) and a second more, then asks for 256 MiB more, far beyond its 96 MiB limit. So the run
/// fails after rank 0 sent its last samples: both replicas have flushed all of them before the
/// run is billed, and the report written then is the one either replica serves afterwards.
const RANK_1: &str = "
import os, sys, time
held = b'x' * 40_000_000
deadline = time.monotonic() + 120
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.1)
time.sleep(1)
more = b'y' * (256 << 20)
";

/// The GPU activity each rank's collector reports, alternating: rank 0 busy, rank 1 lagging.
const GPU_ACTIVITY: [[f64; 2]; 2] = [[75.0, 85.0], [8.0, 12.0]];

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

/// The nearest-rank quantile `q` of `values`.
fn nearest_rank(values: &[f64], q: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((q * sorted.len() as f64).ceil() as usize).max(1);
    sorted[rank - 1]
}

/// Within 2 % of `truth` (of 1 where `truth` is below 1: a percentage near 0).
#[track_caller]
fn within_2_percent(what: &str, got: &Value, truth: f64, report: &Value) {
    let got = got
        .as_f64()
        .unwrap_or_else(|| panic!("{what}: no figure in {report}"));
    assert!(
        (got - truth).abs() <= 0.02 * truth.abs().max(1.0),
        "{what}: the report says {got}, the samples {truth}: {report}"
    );
}

/// The smallest size a person would ask for that holds `mb` (MB), in MB: a multiple of 256 MiB
/// up to 1 GiB, then 1, 1.5, 2, 3, 4, 6... GiB.
fn request_for(mb: f64) -> f64 {
    let gib = mb / GIB_MB;
    if gib <= 1.0 {
        let mib = (gib * 4.0).ceil().max(1.0) * 256.0;
        if mib < 1024.0 {
            return mib * MIB as f64 / 1e6;
        }
    }
    let mut step = 1.0f64;
    loop {
        for m in [1.0, 1.5] {
            if step * m >= gib {
                return step * m * GIB_MB;
            }
        }
        step *= 2.0;
    }
}

async fn report_json(proxy: &ProxyProcess, run_id: &str) -> (u16, Value) {
    let response = http()
        .get(format!("{}/runs/{run_id}/report", proxy.admin_url))
        .header("accept", "application/json")
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// The report's page as the admin listener serves it: (status, content type, body).
async fn report_page(proxy: &ProxyProcess, run_id: &str) -> (u16, String, String) {
    let response = http()
        .get(format!("{}/runs/{run_id}/report", proxy.admin_url))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    (status, content_type, response.text().await.unwrap())
}

fn escaped(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&#39;")
}

/// One publish of a rank's GPU, with its identity headers, as its collector sends it (the
/// placement tags with the first).
async fn send_gpu(proxy_url: &str, run_id: &str, rank: u32, value: f64, first: bool) {
    let owner = format!("system/rank-{rank}");
    let mut body = json!({"run_id": run_id, "metrics": [
        {"key": format!("{owner}/gpu_0_utilization_percentage"), "value": value, "timestamp": now_ms(), "step": 0},
    ]});
    if first {
        body["tags"] = json!([
            {"key": format!("mlscope/rank-{rank}/gpu_count"), "value": "1"},
            {"key": format!("mlscope/rank-{rank}/gpu_model"), "value": GPU_MODEL},
        ]);
    }
    let response = http()
        .post(format!("{proxy_url}/api/2.0/mlflow/runs/log-batch"))
        .header("X-Mlscope-Node", NODE)
        .header("X-Mlscope-Rank", rank.to_string())
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
}

/// Two ranks, each a collector wrapping Python in its own memory and CPU cgroups, each talking
/// to its own replica; rank 1 is OOM-killed. The run ends FAILED/oom_killed, and one report is
/// written: one `mlscope/report.html` in the run, its summary and advice in tags, counted once
/// over both replicas; its figures (peak, mean and p95 memory, CPU, GPU activity) match the
/// samples MLflow stored within 2 %, and it has the OOM moment and the advice it supports.
#[tokio::test(flavor = "multi_thread")]
async fn a_two_rank_run_with_an_oom_killed_rank_gets_one_report_whose_figures_match_its_samples() {
    let began = Instant::now();
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    eprintln!("the stack is up after {:?}", began.elapsed());
    let dir = tempfile::tempdir().unwrap();
    let admin = std::env::var("MLSCOPE_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let database = PostgresDatabase::create(&admin, "mlscope_it").unwrap();
    let shared = ["--database-url", database.url.as_str()];
    let replicas = [
        health_proxy(dir.path(), mlflow, "8s", &shared),
        health_proxy(dir.path(), mlflow, "8s", &shared),
    ];
    let run_id = create_run(mlflow, "report").await;

    // Each rank in a memory cgroup with a CPU quota of its own. (Declared in this order, rank 1's
    // goes first: rank 0's created the parents both share in the CPU hierarchies.)
    let limits = [768 * MIB, 96 * MIB];
    let quotas = [0.5, 1.0];
    let cgroup_0 = MemoryCgroup::create("mlscope-report-0", limits[0])
        .and_then(|c| c.limit_cpu(Some(quotas[0])))
        .expect("needs root and cgroup v1 memory, cpu and cpuacct controllers (this project's machines have them)");
    let cgroup_1 = MemoryCgroup::create("mlscope-report-1", limits[1])
        .and_then(|c| c.limit_cpu(Some(quotas[1])))
        .expect("needs root and cgroup v1 memory, cpu and cpuacct controllers");

    // The training client and the GPUs: the run's loss at rising steps, in batches of its own as
    // a training loop logs it, and each rank's GPU activity until its collector reported how
    // its command ended (as a collector's sampling stops then), every half second.
    let done = [
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    ];
    let writer = {
        let urls = [replicas[0].url.clone(), replicas[1].url.clone()];
        let mlflow = mlflow.to_owned();
        let done = done.clone();
        let run_id = run_id.clone();
        tokio::spawn(async move {
            let mut pace = tokio::time::interval(Duration::from_millis(500));
            let mut tick = 0usize;
            loop {
                pace.tick().await;
                let tags = run_tags(&mlflow, &run_id).await;
                // A collector that exited without reporting its end stops its GPU too.
                let ended: Vec<bool> = (0..2)
                    .map(|rank| {
                        tags.contains_key(&format!("mlscope/rank-{rank}/outcome"))
                            || done[rank].load(Ordering::SeqCst)
                    })
                    .collect();
                if ended.iter().all(|&e| e) {
                    break tick;
                }
                let step = 100 * tick as i64;
                let loss = json!({"run_id": run_id, "metrics": [
                    {"key": "loss", "value": 1.0 / (tick as f64 + 1.0), "timestamp": now_ms(), "step": step}]});
                post(&urls[0], "runs/log-batch", loss).await;
                for rank in 0..2 {
                    if !ended[rank] {
                        let value = GPU_ACTIVITY[rank][tick % 2];
                        send_gpu(&urls[rank], &run_id, rank as u32, value, tick == 0).await;
                    }
                }
                tick += 1;
            }
        })
    };

    // The run has a step before either rank samples anything, so that each memory peak comes
    // after one however slowly the loss writer gets through on a busy machine.
    eventually(
        Duration::from_secs(60),
        "the run's first loss stored",
        async || match points(mlflow, &run_id, "loss").await.len() {
            0 => Err("no loss yet".to_owned()),
            _ => Ok(()),
        },
    )
    .await;

    let python = mlscope_tests::venv().join("bin/python");
    let python = python.to_str().unwrap();
    let rank_0_done = dir.path().join("rank-0-done");
    let rank_0_done = rank_0_done.to_str().unwrap();
    let mut exits = Vec::new();
    for (rank, (cgroup, program)) in [(&cgroup_0, RANK_0), (&cgroup_1, RANK_1)]
        .into_iter()
        .enumerate()
    {
        let command = cgroup.run_inside(&[python, "-c", program, rank_0_done]);
        let wrapped: Vec<&str> = command.iter().map(String::as_str).collect();
        let cgroup_dir = cgroup.dir.to_str().unwrap().to_owned();
        let collector = start_collector_with(
            dir.path(),
            &replicas[rank].url,
            &run_id,
            NODE,
            rank as u32,
            // The harness's watchdog (see `Process::spawn`) is a child of the collector's process,
            // so a leftover of every wrapped command here; it ignores SIGTERM: a short grace.
            &["--cgroup-path", &cgroup_dir, "--leftover-grace", "1s"],
            &wrapped,
        );
        let done = done[rank].clone();
        exits.push(tokio::spawn(async move {
            let code = wait_exit(collector).await;
            done.store(true, Ordering::SeqCst);
            eprintln!(
                "rank {rank}'s collector exited {code:?} after {:?}",
                began.elapsed()
            );
            code
        }));
    }

    // Live: either replica serves the report so far, both ranks in it, the run running.
    let live = eventually(
        Duration::from_secs(60),
        "a live report with both ranks' memory on replica 1",
        async || {
            let (code, report) = report_json(&replicas[1], &run_id).await;
            let ranks = report["ranks"].as_array().map_or(0, Vec::len);
            let measured = report["ranks"]
                .as_array()
                .is_some_and(|r| r.iter().all(|r| r["memory"].is_object()));
            if code == 200 && ranks == 2 && measured {
                Ok(report)
            } else {
                Err(format!("{code} {report}"))
            }
        },
    )
    .await;
    assert_eq!(live["live"], true, "{live}");
    assert_eq!(live["status"], "RUNNING", "{live}");
    assert!(
        live["summary"].as_str().unwrap().ends_with("running"),
        "{live}"
    );

    let codes = [
        exits.remove(0).await.unwrap(),
        exits.remove(0).await.unwrap(),
    ];
    assert_eq!(
        codes,
        [Some(0), Some(137)],
        "rank 0 exits 0, rank 1 is OOM-killed"
    );
    let ticks = writer.await.unwrap();
    eprintln!(
        "ranks done after {:?} ({ticks} loss/GPU publishes)",
        began.elapsed()
    );

    // The sweep fails the run; its billing replica writes the report.
    let run = wait_for_status(mlflow, &run_id, "FAILED", Duration::from_secs(90)).await;
    let tags = eventually(
        Duration::from_secs(90),
        "the report's tags on the run",
        async || {
            let tags = run_tags(mlflow, &run_id).await;
            if tags.contains_key("mlscope.report") || tags.contains_key("mlscope.report_error") {
                Ok(tags)
            } else {
                Err(format!("{tags:?}"))
            }
        },
    )
    .await;
    eprintln!("report written after {:?}", began.elapsed());
    assert!(!tags.contains_key("mlscope.report_error"), "{tags:?}");
    assert_eq!(
        tags.get("mlscope.outcome").map(String::as_str),
        Some("oom_killed"),
        "{tags:?}"
    );
    assert_eq!(tags["mlscope.report"], "mlscope/report.html", "{tags:?}");
    let summary = tags
        .get("mlscope.summary")
        .unwrap_or_else(|| panic!("no mlscope.summary: {tags:?}"));
    let advice_tag = tags
        .get("mlscope.advice")
        .unwrap_or_else(|| panic!("no mlscope.advice: {tags:?}"));

    // One file in the run's mlscope/ directory: the page, with its charts and summary.
    let listing = response_json(http().get(format!(
        "{mlflow}/api/2.0/mlflow/artifacts/list?run_id={run_id}&path=mlscope"
    )))
    .await;
    let files = listing["files"]
        .as_array()
        .unwrap_or_else(|| panic!("no files under mlscope/: {listing}"));
    assert_eq!(files.len(), 1, "{listing}");
    assert_eq!(files[0]["path"], "mlscope/report.html", "{listing}");
    assert_eq!(files[0]["is_dir"], false, "{listing}");
    let root = run["run"]["info"]["artifact_uri"]
        .as_str()
        .and_then(|uri| uri.strip_prefix("mlflow-artifacts:/"))
        .unwrap_or_else(|| panic!("an artifact root MLflow serves: {run}"))
        .trim_matches('/')
        .to_owned();
    let download = http()
        .get(format!(
            "{mlflow}/api/2.0/mlflow-artifacts/artifacts/{root}/mlscope/report.html"
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(download.status(), 200);
    let page = download.text().await.unwrap();
    assert_eq!(
        files[0]["file_size"].as_u64(),
        Some(page.len() as u64),
        "{listing}"
    );
    assert!(page.starts_with("<!DOCTYPE html>"), "{page}");
    assert!(page.contains("<svg"), "no chart in the page: {page}");
    assert!(
        page.contains(&escaped(summary)),
        "the summary {summary:?} is not in the page: {page}"
    );
    for line in advice_tag.lines() {
        assert!(page.contains(&escaped(line)), "{line:?} is not in the page");
    }

    // The report as JSON, the same from either replica, saying what the tags say. (What a replica
    // heard last reaches the shared store with its next flush: the two agree within an interval.)
    let report = eventually(
        Duration::from_secs(30),
        "the same report from either replica",
        async || {
            let (code, report) = report_json(&replicas[0], &run_id).await;
            let (other_code, other) = report_json(&replicas[1], &run_id).await;
            if (code, other_code) != (200, 200) {
                return Err(format!("{code} {report} / {other_code} {other}"));
            }
            let differ: Vec<&str> = [
                "summary", "advice", "ranks", "gpu", "outcome", "status", "live",
            ]
            .into_iter()
            .filter(|field| report[field] != other[field])
            .collect();
            if differ.is_empty() {
                Ok(report)
            } else {
                Err(format!("{differ:?} differ: {report} vs {other}"))
            }
        },
    )
    .await;
    assert_eq!(
        report["summary"].as_str(),
        Some(summary.as_str()),
        "{report}"
    );
    let advice: Vec<String> = report["advice"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(&advice.join("\n"), advice_tag, "{report}");
    assert_eq!(report["live"], false, "{report}");
    assert_eq!(report["status"], "FAILED", "{report}");
    assert_eq!(report["outcome"], "oom_killed", "{report}");
    assert_eq!(report["unidentified_writers"], 0, "{report}");
    assert!(summary.starts_with("2 ranks · peak memory "), "{summary}");
    assert!(
        summary.ends_with("ended FAILED oom_killed (rank 1)"),
        "{summary}"
    );
    // The live page too.
    let (code, content_type, live_page) = report_page(&replicas[1], &run_id).await;
    assert_eq!(code, 200);
    assert!(content_type.starts_with("text/html"), "{content_type}");
    assert!(live_page.contains("<svg") && live_page.contains(&escaped(summary)));

    // Each rank's figures against the samples MLflow stored.
    let ranks = report["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2, "{report}");
    let loss = points(mlflow, &run_id, "loss").await;
    let mut gpu_means = BTreeMap::new();
    let mut steps_found = 0;
    for (rank, figures) in ranks.iter().enumerate() {
        let r = rank as i64;
        assert_eq!(figures["rank"], r, "{report}");
        assert_eq!(figures["node"], NODE, "{report}");
        assert_eq!(figures["pod"], format!("pod-{NODE}-{rank}"), "{report}");
        assert_eq!(figures["co_located"], json!([1 - r]), "{report}");
        let key = |name: &str| format!("system/rank-{rank}/{name}");

        let memory = &figures["memory"];
        let samples = points(
            mlflow,
            &run_id,
            &key("container_memory_working_set_megabytes"),
        )
        .await;
        let values: Vec<f64> = samples.iter().map(|p| p.1).collect();
        assert!(values.len() >= 3, "rank {rank}: {samples:?}");
        let peak = values.iter().copied().fold(f64::MIN, f64::max);
        let peak_ms = samples.iter().find(|p| p.1 == peak).unwrap().0;
        assert_eq!(memory["samples"], values.len(), "rank {rank}: {report}");
        within_2_percent(
            &format!("rank {rank} peak"),
            &memory["peak_mb"],
            peak,
            &report,
        );
        within_2_percent(
            &format!("rank {rank} mean"),
            &memory["mean_mb"],
            mean(&values),
            &report,
        );
        within_2_percent(
            &format!("rank {rank} p95"),
            &memory["p95_mb"],
            nearest_rank(&values, 0.95),
            &report,
        );
        assert_eq!(
            memory["peak_ms"], peak_ms,
            "rank {rank}: {samples:?} {report}"
        );
        let limit = limits[rank] as f64 / 1e6;
        assert_eq!(memory["limit_mb"].as_f64(), Some(limit), "{report}");
        within_2_percent(
            &format!("rank {rank} peak fraction"),
            &memory["peak_fraction"],
            peak / limit,
            &report,
        );
        // The known load: what each command holds.
        let held = [200.0, 40.0][rank];
        assert!(
            peak >= held && peak < limit,
            "rank {rank} holds {held} MB: peak {peak} of {limit}"
        );
        // The run's step at the peak: the highest step of its loss logged by then (as the
        // report keeps steps in buckets a second wide: at least the one logged a second before).
        let truth = loss.iter().filter(|p| p.0 <= peak_ms).map(|p| p.2).max();
        let floor = loss
            .iter()
            .filter(|p| p.0 < peak_ms.div_euclid(1000) * 1000)
            .map(|p| p.2)
            .max();
        if let Some(step) = memory["peak_step"].as_i64() {
            steps_found += 1;
            assert!(
                Some(step) <= truth && Some(step) >= floor,
                "rank {rank}: peak step {step}, the loss's step at {peak_ms} {truth:?} (at least {floor:?}): {loss:?}"
            );
            eprintln!("rank {rank}: peak step {step}, exactly {truth:?}");
        }

        let cpu = &figures["cpu"];
        assert_eq!(cpu["limit_cores"].as_f64(), Some(quotas[rank]), "{report}");
        let used: Vec<f64> = points(
            mlflow,
            &run_id,
            &key("container_cpu_utilization_percentage"),
        )
        .await
        .iter()
        .map(|p| p.1)
        .collect();
        assert!(!used.is_empty(), "rank {rank}: no CPU samples");
        within_2_percent(
            &format!("rank {rank} CPU mean"),
            &cpu["mean_percent"],
            mean(&used),
            &report,
        );
        let busiest = used.iter().copied().fold(f64::MIN, f64::max);
        let peak_percent = cpu["peak_percent"].as_f64().unwrap();
        assert!(
            peak_percent <= busiest * 1.02 + 1e-9 && peak_percent >= mean(&used) - 1e-9,
            "rank {rank}: CPU peak {peak_percent}, samples {used:?}"
        );
        let throttled: Vec<f64> =
            points(mlflow, &run_id, &key("container_cpu_throttled_percentage"))
                .await
                .iter()
                .map(|p| p.1)
                .collect();
        within_2_percent(
            &format!("rank {rank} throttled"),
            &cpu["throttled_percent"],
            mean(&throttled),
            &report,
        );
        if rank == 0 {
            // A spinning thread under half a core's quota uses (most of) that half core.
            assert!(busiest >= 25.0, "rank 0 spun: {used:?}");
        }

        let gpu = &figures["gpu"];
        let activity: Vec<f64> = points(mlflow, &run_id, &key("gpu_0_utilization_percentage"))
            .await
            .iter()
            .map(|p| p.1)
            .collect();
        assert!(!activity.is_empty(), "rank {rank}: no GPU samples");
        assert!(
            activity.iter().all(|a| GPU_ACTIVITY[rank].contains(a)),
            "{activity:?}"
        );
        within_2_percent(
            &format!("rank {rank} GPU activity"),
            &gpu["activity_mean_percent"],
            mean(&activity),
            &report,
        );
        assert_eq!(gpu["measure"], "utilization", "{report}");
        assert_eq!(gpu["gpus"], 1, "{report}");
        assert_eq!(gpu["model"], GPU_MODEL, "{report}");
        assert!(gpu["gpu_hours"].as_f64().unwrap() > 0.0, "{report}");
        gpu_means.insert(rank, mean(&activity));

        assert!(
            !figures["charts"]["memory"].as_array().unwrap().is_empty()
                && !figures["charts"]["cpu"].as_array().unwrap().is_empty()
                && !figures["charts"]["gpu"].as_array().unwrap().is_empty(),
            "rank {rank}: charts {report}"
        );
    }
    within_2_percent(
        "GPUs busy",
        &report["gpu"]["busy_percent"],
        gpu_means.values().sum::<f64>() / 2.0,
        &report,
    );

    // How each rank ended, and the OOM moment: after rank 1's last sample, before now.
    let (rank_0, rank_1) = (&ranks[0], &ranks[1]);
    assert_eq!(
        (rank_0["outcome"].as_str(), rank_0["exit_code"].as_i64()),
        (Some("exited"), Some(0)),
        "{report}"
    );
    assert!(rank_0["oom_at_ms"].is_null(), "{report}");
    assert_eq!(rank_1["outcome"], "oom_killed", "{report}");
    let oom_at = rank_1["oom_at_ms"]
        .as_i64()
        .unwrap_or_else(|| panic!("no OOM moment for rank 1: {report}"));
    let last_sample = points(
        mlflow,
        &run_id,
        "system/rank-1/container_memory_working_set_megabytes",
    )
    .await
    .last()
    .unwrap()
    .0;
    assert!(
        oom_at >= last_sample - 1_000 && oom_at <= now_ms(),
        "OOM at {oom_at}, rank 1's last sample at {last_sample}"
    );

    // The advice the figures support, each with its basis.
    let has = |prefix: &str, words: &[&str]| {
        advice
            .iter()
            .any(|a| a.starts_with(prefix) && words.iter().all(|w| a.contains(w)))
    };
    assert!(
        has("rank 1 peaked at ", &["OOM-killed at +", "memory limit"]),
        "no OOM advice for rank 1: {advice:#?}"
    );
    let memory_0 = &rank_0["memory"];
    let (peak_0, limit_0) = (
        memory_0["peak_mb"].as_f64().unwrap(),
        memory_0["limit_mb"].as_f64().unwrap(),
    );
    let oversized = request_for(peak_0 * (1.0 + MEMORY_HEADROOM)) <= limit_0 * OVERSIZED;
    assert!(
        oversized,
        "the test's design: rank 0's peak {peak_0} MB is far below its limit {limit_0} MB"
    );
    assert_eq!(
        has("rank 0: peak working set ", &["would have held the peak"]),
        oversized,
        "rank 0 peaked at {peak_0} MB of {limit_0} MB: {advice:#?}"
    );
    let throttled_0 = rank_0["cpu"]["throttled_percent"].as_f64().unwrap();
    assert_eq!(
        has("rank 0 was CPU-throttled in ", &["limit 0.5 cores"]),
        throttled_0 >= THROTTLED,
        "rank 0 was throttled in {throttled_0} % of its periods: {advice:#?}"
    );
    let mut sorted: Vec<f64> = gpu_means.values().copied().collect();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    let straggler = median >= STRAGGLER_MEDIAN_FLOOR && gpu_means[&1] < STRAGGLER * median;
    assert!(
        straggler,
        "the test's design: rank 1's GPU lags ({gpu_means:?})"
    );
    assert_eq!(
        has("rank 1's GPUs were busy ", &["straggler"]),
        straggler,
        "{advice:#?}"
    );

    // The health view lists the two ranks and no writer without a rank.
    let (code, view) = health_view(&replicas[0], &run_id).await;
    assert_eq!(code, 200, "{view}");
    assert_eq!(view["rank_count"], 2, "{view}");
    assert!(view.get("writers_without_rank").is_none(), "{view}");

    // One report over both replicas, and it stays one for several sweeps.
    let both = [&replicas[0], &replicas[1]];
    let written = r#"mlscope_run_reports_total{reason="written"}"#;
    let failed = r#"mlscope_run_reports_total{reason="failed"}"#;
    consistently(
        Duration::from_secs(3),
        "one report written over both replicas, none failed",
        async || {
            let (w, f) = (counter(&both, written).await, counter(&both, failed).await);
            if (w, f) == (1.0, 0.0) {
                Ok(())
            } else {
                Err(format!("{w} written, {f} failed"))
            }
        },
    )
    .await;
    let listing = response_json(http().get(format!(
        "{mlflow}/api/2.0/mlflow/artifacts/list?run_id={run_id}&path=mlscope"
    )))
    .await;
    assert_eq!(
        listing["files"].as_array().map(Vec::len),
        Some(1),
        "{listing}"
    );
    assert_eq!(
        get_run(mlflow, &run_id).await["run"]["info"]["status"],
        "FAILED"
    );
    // Last, what the report says beside its figures, every shortfall at once: the run's step at
    // a peak (its loss was logged throughout, from before either peak), and no figure printed
    // as -0.0, in the report or the health view.
    let mut shortfalls = Vec::new();
    if steps_found == 0 {
        shortfalls.push(format!(
            "no rank has the run's step at its memory peak (peak_step), though the run logged its loss at steps {:?}..={:?} throughout",
            loss.first().map(|p| p.2),
            loss.last().map(|p| p.2)
        ));
    }
    for (what, text) in [
        ("the JSON report", report.to_string()),
        ("the health view", view.to_string()),
    ] {
        // A zero printed with a sign: `-0`, `-0.0`, `-0.00`... as a number (not in a name like
        // `pod-0`), not followed by another digit (`-0.05` is a number, not a zero).
        let signed_zero = text.match_indices("-0").map(|(at, _)| at).find(|&at| {
            let in_a_name = text[..at]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | '/'));
            let rest = text[at + 2..].trim_start_matches('.');
            let rest = rest.trim_start_matches('0');
            !in_a_name
                && !rest.starts_with(|c: char| c.is_ascii_digit())
                && text[at + 2..].starts_with(['.', '"', ',', '}', ']', ' ', '<', '%'])
        });
        if let Some(at) = signed_zero {
            let from = (at.saturating_sub(80)..=at)
                .find(|&i| text.is_char_boundary(i))
                .unwrap_or(at);
            let to = ((at + 5).min(text.len())..=text.len())
                .find(|&i| text.is_char_boundary(i))
                .unwrap_or(text.len());
            let context = &text[from..to];
            shortfalls.push(format!("{what} prints a signed zero: ...{context}..."));
        }
    }
    assert!(shortfalls.is_empty(), "{shortfalls:#?}");
    eprintln!("done after {:?}", began.elapsed());
    drop(cgroup_1);
    drop(cgroup_0);
}

/// A run whose artifact root MLflow does not serve (an experiment created with its own
/// `s3://` location) cannot take the page: its end goes through as MLflow answers it, and the
/// run says why it has no report, where the live one is, and counts it as failed, once.
#[tokio::test(flavor = "multi_thread")]
async fn a_run_whose_artifacts_mlflow_does_not_serve_ends_normally_and_says_why_it_has_no_report() {
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let proxy = health_proxy(dir.path(), mlflow, "10m", &[]);
    let name = format!("report-elsewhere-{}", uuid::Uuid::new_v4().simple());
    let experiment = post(
        mlflow,
        "experiments/create",
        json!({"name": name, "artifact_location": "s3://elsewhere/artifacts"}),
    )
    .await;
    let run = post(
        mlflow,
        "runs/create",
        json!({"experiment_id": experiment["experiment_id"], "start_time": now_ms()}),
    )
    .await;
    let run_id = run["run"]["info"]["run_id"].as_str().unwrap().to_owned();
    // One rank's samples, as its collector sends them.
    for value in [10.0, 20.0] {
        send_gpu(&proxy.url, &run_id, 0, value, value == 10.0).await;
    }
    eventually(
        Duration::from_secs(30),
        "the rank in the run's live report",
        async || match report_json(&proxy, &run_id).await {
            (200, report) if report["ranks"].as_array().is_some_and(|r| r.len() == 1) => Ok(()),
            (code, report) => Err(format!("{code} {report}")),
        },
    )
    .await;
    let ended = post(
        &proxy.url,
        "runs/update",
        json!({"run_id": run_id, "status": "FINISHED", "end_time": now_ms()}),
    )
    .await;
    assert_eq!(ended["run_info"]["status"], "FINISHED", "{ended}");
    let tags = eventually(
        Duration::from_secs(60),
        "mlscope.report_error on the run",
        async || {
            let tags = run_tags(mlflow, &run_id).await;
            match tags.get("mlscope.report_error") {
                Some(_) => Ok(tags),
                None => Err(format!("{tags:?}")),
            }
        },
    )
    .await;
    let error = &tags["mlscope.report_error"];
    assert!(
        error.contains("s3://elsewhere/artifacts")
            && error.contains(&format!("/runs/{run_id}/report")),
        "{error}"
    );
    assert!(!tags.contains_key("mlscope.summary"), "{tags:?}");
    assert_eq!(
        get_run(mlflow, &run_id).await["run"]["info"]["status"],
        "FINISHED"
    );
    let failed = r#"mlscope_run_reports_total{reason="failed"}"#;
    let written = r#"mlscope_run_reports_total{reason="written"}"#;
    assert_eq!(counter(&[&proxy], failed).await, 1.0);
    assert_eq!(counter(&[&proxy], written).await, 0.0);
    // The live report still answers.
    let (code, report) = report_json(&proxy, &run_id).await;
    assert_eq!(code, 200, "{report}");
    assert!(
        report["summary"]
            .as_str()
            .unwrap()
            .ends_with("ended FINISHED"),
        "{report}"
    );
}
