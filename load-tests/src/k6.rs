//! `k6-log-batch`: MLflow's own log-batch benchmark workload (k6, every virtual user writing into
//! one run, `load-tests/k6/log-batch.js`), straight to MLflow and through mlscope-proxy, the
//! targets taking turns round by round; every acknowledged sample counted back from MLflow.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context as _};
use serde_json::Value;

use crate::cli::K6LogBatchArgs;
use crate::markdown::{command_block, Align, Table};
use crate::mlflow::{create_experiment, create_run, get_json, version};
use crate::stack::{BenchStack, Target, TargetKind};
use crate::{http, progress, Report};

/// One k6 run's outcome for one target.
#[derive(Debug, Clone, Default)]
struct Outcome {
    requests: u64,
    rate: f64,
    p95_ms: f64,
    failed: u64,
    acknowledged: u64,
    stored: u64,
}

/// Per (shape, target): every round's outcome.
struct Row {
    shape: (u32, u32, u32),
    kind: TargetKind,
    rounds: Vec<Outcome>,
}

fn k6_binary(args: &K6LogBatchArgs) -> PathBuf {
    args.k6
        .clone()
        .unwrap_or_else(|| mlscope_tests::venv().join("bin/k6"))
}

fn script() -> PathBuf {
    mlscope_tests::repo_root().join("load-tests/k6/log-batch.js")
}

pub(crate) async fn run(
    args: &K6LogBatchArgs,
    stack: &BenchStack,
    command_line: &str,
) -> anyhow::Result<Report> {
    let k6 = k6_binary(args);
    if !k6.exists() {
        bail!(
            "{} not found: run scripts/setup first (it installs k6)",
            k6.display()
        );
    }
    let direct = stack
        .target(TargetKind::Direct)
        .context("no direct target")?;
    let targets: Vec<Target> = [TargetKind::Direct, TargetKind::Proxy]
        .into_iter()
        .filter_map(|k| stack.target(k))
        .collect();
    let experiment =
        create_experiment(&direct, &format!("k6-log-batch-{}", std::process::id())).await?;
    let client = http::client(4)?;
    let mut rows: Vec<Row> = Vec::new();
    let total = args.shapes.len() * args.rounds as usize * targets.len();
    let bar = progress::count_bar(total as u64);
    for &shape in &args.shapes {
        for round in 0..args.rounds {
            // Alternate which target goes first, so drift (the database growing) hits both alike.
            let mut order = targets.clone();
            if round % 2 == 1 {
                order.reverse();
            }
            for target in order {
                bar.set_message(format!(
                    "{}/{}/{} round {} {}",
                    shape.0,
                    shape.1,
                    shape.2,
                    round + 1,
                    target.kind
                ));
                let run_name = format!(
                    "k6-{}-{}-{}-{}-r{round}",
                    shape.0,
                    shape.1,
                    shape.2,
                    target.kind.slug()
                );
                let run_id = create_run(&client, &target, &experiment, &run_name).await?;
                let mut outcome = run_k6(&k6, args, &target, &run_id, shape).await?;
                outcome.stored = count_back(&client, &direct, &run_id, shape.2).await?;
                match rows
                    .iter_mut()
                    .find(|r| r.shape == shape && r.kind == target.kind)
                {
                    Some(row) => row.rounds.push(outcome),
                    None => rows.push(Row {
                        shape,
                        kind: target.kind,
                        rounds: vec![outcome],
                    }),
                }
                bar.inc(1);
            }
        }
    }
    bar.finish_and_clear();
    Ok(report(args, &rows, version(&direct).await, command_line))
}

async fn run_k6(
    k6: &PathBuf,
    args: &K6LogBatchArgs,
    target: &Target,
    run_id: &str,
    (tags, params, metrics): (u32, u32, u32),
) -> anyhow::Result<Outcome> {
    let dir = tempfile::tempdir().context("a directory for k6's summary")?;
    let summary = dir.path().join("summary.json");
    let output = tokio::process::Command::new(k6)
        .arg("run")
        .arg("--quiet")
        .arg("--no-usage-report")
        .args(["--vus", &args.vus.to_string()])
        .args(["--duration", &format!("{}s", args.duration.as_secs())])
        .args(["--summary-trend-stats", "avg,med,p(95),p(99),max"])
        .arg("--summary-export")
        .arg(&summary)
        .env("BASE_URL", &target.base_url)
        .env("RUN_ID", run_id)
        .env("TAGS", tags.to_string())
        .env("PARAMS", params.to_string())
        .env("METRICS", metrics.to_string())
        .env("K6_NO_USAGE_REPORT", "true")
        .arg(script())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(args.duration + Duration::from_secs(180), output)
        .await
        .context("k6 did not finish")?
        .context("starting k6")?;
    if !output.status.success() {
        bail!(
            "k6 against {} exited with {}: {}",
            target.kind,
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let text = std::fs::read_to_string(&summary).context("reading k6's summary")?;
    let summary: Value = serde_json::from_str(&text).context("k6's summary is not JSON")?;
    let metric = |name: &str, field: &str| summary["metrics"][name][field].as_f64().unwrap_or(0.0);
    Ok(Outcome {
        requests: metric("http_reqs", "count") as u64,
        rate: metric("http_reqs", "rate"),
        p95_ms: metric("http_req_duration", "p(95)"),
        failed: metric("requests_failed", "count") as u64,
        acknowledged: metric("samples_acknowledged", "count") as u64,
        stored: 0,
    })
}

/// Samples MLflow holds in `run_id` under `metric_0..metric_<n>`, read page by page.
async fn count_back(
    client: &reqwest::Client,
    direct: &Target,
    run_id: &str,
    metrics: u32,
) -> anyhow::Result<u64> {
    let url = format!("{}/api/2.0/mlflow/metrics/get-history", direct.base_url);
    let mut stored = 0u64;
    for i in 0..metrics {
        let key = format!("metric_{i}");
        let mut token = String::new();
        loop {
            let mut query = vec![
                ("run_id", run_id),
                ("metric_key", key.as_str()),
                ("max_results", "25000"),
            ];
            if !token.is_empty() {
                query.push(("page_token", token.as_str()));
            }
            let page = get_json(client, &url, &query).await?;
            stored += page["metrics"].as_array().map_or(0, |m| m.len() as u64);
            match page["next_page_token"].as_str() {
                Some(next) if !next.is_empty() => token = next.to_owned(),
                _ => break,
            }
        }
    }
    Ok(stored)
}

fn report(
    args: &K6LogBatchArgs,
    rows: &[Row],
    mlflow_version: Option<String>,
    command_line: &str,
) -> Report {
    let mut md = String::new();
    md.push_str(&format!(
        "MLflow {} · {} virtual users · {} s per run · best of {} rounds, targets alternating\n\n",
        mlflow_version.as_deref().unwrap_or("(version unknown)"),
        args.vus,
        args.duration.as_secs(),
        args.rounds
    ));
    let mut table = Table::new(&[
        ("tags/params/metrics", Align::Left),
        ("target", Align::Left),
        ("log-batch/s (best)", Align::Right),
        ("each round", Align::Right),
        ("p95 ms", Align::Right),
        ("failed", Align::Right),
        ("samples acknowledged", Align::Right),
        ("missing", Align::Right),
        ("extra", Align::Right),
        ("vs direct", Align::Right),
    ]);
    let mut problems = Vec::new();
    for row in rows {
        let best = row
            .rounds
            .iter()
            .max_by(|a, b| a.rate.total_cmp(&b.rate))
            .cloned()
            .unwrap_or_default();
        let direct = rows
            .iter()
            .find(|r| r.shape == row.shape && r.kind == TargetKind::Direct)
            .and_then(|r| r.rounds.iter().map(|o| o.rate).max_by(f64::total_cmp));
        let failed: u64 = row.rounds.iter().map(|o| o.failed).sum();
        let acknowledged: u64 = row.rounds.iter().map(|o| o.acknowledged).sum();
        let stored: u64 = row.rounds.iter().map(|o| o.stored).sum();
        let missing = acknowledged.saturating_sub(stored);
        let extra = stored.saturating_sub(acknowledged);
        let shape = format!("{}/{}/{}", row.shape.0, row.shape.1, row.shape.2);
        if failed > 0 {
            problems.push(format!("{shape} {}: {failed} failed requests", row.kind));
        }
        if missing + extra > 0 {
            problems.push(format!(
                "{shape} {}: {missing} acknowledged samples missing, {extra} stored beyond those acknowledged",
                row.kind
            ));
        }
        let rounds: Vec<String> = row
            .rounds
            .iter()
            .map(|o| format!("{:.1}", o.rate))
            .collect();
        table.row(vec![
            shape,
            row.kind.label().to_owned(),
            format!("{:.1}", best.rate),
            rounds.join(", "),
            format!("{:.0}", best.p95_ms),
            failed.to_string(),
            acknowledged.to_string(),
            missing.to_string(),
            extra.to_string(),
            direct
                .filter(|d| *d > 0.0)
                .map_or("–".into(), |d| format!("{:.2}×", best.rate / d)),
        ]);
    }
    md.push_str(&table.render());
    md.push_str(&format!(
        "\nRequests per run: {}.\n\n",
        rows.iter()
            .map(|r| format!(
                "{} {}/{}/{}: {}",
                r.kind.slug(),
                r.shape.0,
                r.shape.1,
                r.shape.2,
                r.rounds
                    .iter()
                    .map(|o| o.requests.to_string())
                    .collect::<Vec<_>>()
                    .join("+")
            ))
            .collect::<Vec<_>>()
            .join("; ")
    ));
    md.push_str(&command_block(command_line));
    Report {
        markdown: md,
        problems,
    }
}
