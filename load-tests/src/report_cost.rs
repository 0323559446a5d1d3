//! `mlscope-bench report-cost`: what the run report's aggregates cost over a long run: state rows
//! per rank and the proxy's resident memory, at checkpoints through the run.
//!
//! A run of `--ranks` ranks is replayed through mlscope-proxy as its collectors would have sent it
//! over `--hours` (a sample every `--interval`, stamped in the past, so hours pass in minutes):
//! per rank the container's working set, CPU, throttling, SM activity, GPU utilization and OOM
//! kills, and the run's own `loss` with its step. The proxy keeps its state in a PostgreSQL
//! database of the bench's own, flushes every second and sweeps (merging series into wider
//! buckets) every second. At each checkpoint the bench waits for the sweep to have merged every
//! series, then counts the report's rows with psql and reads the proxy's RSS. At the end it asks
//! the admin port for the report and checks its peak against the one it sent.

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use serde_json::{json, Value};

use crate::cli::ReportCostArgs;
use crate::fleet::rss_bytes;
use crate::mlflow::{self, unix_millis};
use crate::stack::{BenchStack, TargetKind};
use crate::{http, progress, Report};

/// Samples of one rank per log-batch (six series each, plus the run's loss on rank 0): 700
/// metrics, under MLflow's 1,000 per request.
const PUBLISHES_PER_REQUEST: u64 = 100;
/// A series is merged when the sweep finds more buckets than this (`usage::POINTS`).
const POINTS: u64 = 240;
/// The sent peak of rank 0's working set (MB), at publish `PEAK_AT` of every checkpoint's range.
const PEAK_MB: f64 = 9_000.0;

/// One checkpoint's figures.
struct Checkpoint {
    hours: f64,
    samples_per_rank: u64,
    series_rows: u64,
    histogram_rows: u64,
    widest_series: u64,
    rss_bytes: u64,
}

pub(crate) async fn run(
    args: &ReportCostArgs,
    stack: &BenchStack,
    database_url: &str,
    command_line: &str,
) -> anyhow::Result<Report> {
    let proxy = stack
        .target(TargetKind::Proxy)
        .context("the stack has no proxy")?;
    let direct = stack
        .target(TargetKind::Direct)
        .context("the stack has no direct target")?;
    let client = http::client(4)?;
    let experiment = mlflow::create_experiment(
        &direct,
        &format!("mlscope-bench-report-cost-{}", uuid::Uuid::new_v4()),
    )
    .await?;
    let run_id = mlflow::create_run(&client, &proxy, &experiment, "report-cost").await?;
    let interval_ms = args.interval.as_millis() as u64;
    let publishes = args.hours * 3_600_000 / interval_ms;
    let start_ms = unix_millis() - publishes * interval_ms;
    let peak_at = publishes / 3;
    let bar = progress::count_bar(publishes * u64::from(args.ranks));
    let mut checkpoints = Vec::new();
    let mut sent = 0;
    let started = Instant::now();
    for k in 1..=u64::from(args.checkpoints) {
        let until = publishes * k / u64::from(args.checkpoints);
        while sent < until {
            let end = (sent + PUBLISHES_PER_REQUEST).min(until);
            for rank in 0..args.ranks {
                let body = batch(&run_id, rank, sent..end, start_ms, interval_ms, peak_at);
                let response = client
                    .post(format!("{}/api/2.0/mlflow/runs/log-batch", proxy.base_url))
                    .header("X-Mlscope-Node", format!("node-{}", rank / 8))
                    .header("X-Mlscope-Rank", rank.to_string())
                    .json(&body)
                    .send()
                    .await
                    .context("sending a batch through the proxy")?;
                if !response.status().is_success() {
                    bail!(
                        "the proxy answered {}: {}",
                        response.status(),
                        response.text().await.unwrap_or_default()
                    );
                }
                bar.inc(end - sent);
            }
            sent = end;
        }
        bar.set_message(format!("checkpoint {k}: waiting for the sweep to merge"));
        let (series_rows, histogram_rows, widest_series) = settled(database_url).await?;
        checkpoints.push(Checkpoint {
            hours: (sent * interval_ms) as f64 / 3.6e6,
            samples_per_rank: sent,
            series_rows,
            histogram_rows,
            widest_series,
            rss_bytes: rss_bytes(stack.proxy_pid()).unwrap_or(0),
        });
    }
    bar.finish_and_clear();
    let elapsed = started.elapsed();
    let (report, report_ms) = live_report(&stack.proxy().admin_url, &run_id).await?;
    let peak = report
        .pointer("/ranks/0/memory/peak_mb")
        .and_then(Value::as_f64)
        .unwrap_or(f64::NAN);
    let mut problems = Vec::new();
    if (peak - PEAK_MB).abs() > 1e-6 {
        problems.push(format!(
            "the report's peak of rank 0 is {peak} MB; the bench sent {PEAK_MB}"
        ));
    }
    let ranks = f64::from(args.ranks);
    let mut md = String::new();
    md.push_str("## The run report's cost over a long run\n\n");
    md.push_str(&format!(
        "`{command_line}`\n\n{} ranks, a sample every {} for {} h ({} samples per rank and series), replayed in {:.0} s through one mlscope-proxy (state in PostgreSQL, flush and sweep every second); MLflow {}.\n\n",
        args.ranks,
        humantime::format_duration(args.interval),
        args.hours,
        publishes,
        elapsed.as_secs_f64(),
        crate::stack::serving().unwrap_or("as the harness starts it"),
    ));
    md.push_str("| run time | samples per rank | series rows per rank | histogram rows per rank | buckets in the widest series | proxy RSS |\n|---:|---:|---:|---:|---:|---:|\n");
    for c in &checkpoints {
        md.push_str(&format!(
            "| {:.1} h | {} | {:.0} | {:.0} | {} | {:.1} MiB |\n",
            c.hours,
            c.samples_per_rank,
            c.series_rows as f64 / ranks,
            c.histogram_rows as f64 / ranks,
            c.widest_series,
            c.rss_bytes as f64 / (1u64 << 20) as f64
        ));
    }
    md.push_str(&format!(
        "\nThe live report (`/runs/{{id}}/report`, JSON) took {report_ms} ms at the end; rank 0's peak in it: {peak} MB (sent: {PEAK_MB} MB).\n"
    ));
    Ok(Report {
        markdown: md,
        problems,
    })
}

/// One rank's batch of publishes `range`: its six series and, on rank 0, the run's loss.
fn batch(
    run_id: &str,
    rank: u32,
    range: std::ops::Range<u64>,
    start_ms: u64,
    interval_ms: u64,
    peak_at: u64,
) -> Value {
    let mut metrics = Vec::new();
    for p in range {
        let at = start_ms + p * interval_ms;
        let wave = (p as f64 / 500.0).sin();
        let memory = if rank == 0 && p == peak_at {
            PEAK_MB
        } else {
            4_000.0 + 1_500.0 * wave + f64::from(rank) * 10.0
        };
        for (key, value) in [
            ("container_memory_working_set_megabytes", memory),
            ("container_cpu_utilization_percentage", 50.0 + 30.0 * wave),
            ("container_cpu_throttled_percentage", 2.0),
            ("gpu_0_sm_active_percentage", 70.0 + 20.0 * wave),
            ("gpu_0_utilization_percentage", 95.0),
            ("container_oom_kill_count", 0.0),
        ] {
            metrics.push(
                json!({"key": format!("system/{key}"), "value": value, "timestamp": at, "step": p}),
            );
        }
        if rank == 0 {
            metrics.push(
                json!({"key": "loss", "value": 1.0 / (p as f64 + 1.0), "timestamp": at, "step": p}),
            );
        }
    }
    json!({"run_id": run_id, "metrics": metrics})
}

/// Waits until the proxy has flushed and the sweep has merged every series to at most `POINTS`
/// buckets and the counts hold still; returns (series rows, histogram rows, buckets of the
/// widest series).
async fn settled(database_url: &str) -> anyhow::Result<(u64, u64, u64)> {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut last = None;
    loop {
        let now = counts(database_url).await?;
        if now.2 <= POINTS && last == Some(now) {
            return Ok(now);
        }
        if Instant::now() > deadline {
            bail!("the report's series were not merged within 120 s: {now:?} (series rows, histogram rows, widest series)");
        }
        last = Some(now);
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
}

async fn counts(database_url: &str) -> anyhow::Result<(u64, u64, u64)> {
    let query =
        "SELECT (SELECT count(*) FROM rank_series), (SELECT count(*) FROM rank_histogram), \
                 (SELECT coalesce(max(c), 0) FROM (SELECT count(*) AS c FROM rank_series \
                 GROUP BY run_id, node, rank, series) s)";
    let output = tokio::process::Command::new("psql")
        .args([database_url, "-At", "-F", " ", "-c", query])
        .output()
        .await
        .context("running psql")?;
    let text = String::from_utf8_lossy(&output.stdout);
    let numbers: Vec<u64> = text
        .split_whitespace()
        .filter_map(|n| n.parse().ok())
        .collect();
    match numbers[..] {
        [series, histogram, widest] => Ok((series, histogram, widest)),
        _ => bail!(
            "psql answered {text:?} ({})",
            String::from_utf8_lossy(&output.stderr).trim()
        ),
    }
}

/// The live report as JSON, and how long it took.
async fn live_report(admin_url: &str, run_id: &str) -> anyhow::Result<(Value, u128)> {
    let started = Instant::now();
    let response = http::client(1)?
        .get(format!("{admin_url}/runs/{run_id}/report"))
        .header("Accept", "application/json")
        .send()
        .await
        .context("asking the admin port for the report")?;
    let ms = started.elapsed().as_millis();
    let status = response.status();
    let body: Value = response.json().await.context("reading the report")?;
    if !status.is_success() {
        bail!("/runs/{run_id}/report answered {status}: {body}");
    }
    Ok((body, ms))
}
