//! `mlscope-bench dedup-rows`: how many rows MLflow stores for the system metrics of a multi-rank
//! job, with mlscope-proxy's node-series deduplication and without it.
//!
//! Every rank of a distributed job runs MLflow's system-metrics monitor, and every rank on a node
//! reads the same `/proc/stat`, `/proc/meminfo` and root partition: without deduplication a node
//! with 8 ranks stores each node-wide value 8 times. The benchmark simulates those monitors,
//! sends the same publishes through mlscope-proxy (dedup on), through a second mlscope-proxy with
//! `--dedup false` and straight to MLflow, each into a run of its own, and then counts the rows
//! MLflow holds for each run.

mod report;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use serde_json::{json, Value};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::cli::DedupRowsArgs;
use crate::mlflow::{self, unix_millis};
use crate::monitor::{MonitoredRank, SeriesKind, SAMPLING_INTERVAL_MILLIS};
use crate::progress;
use crate::stack::{BenchStack, Target, TargetKind};
use crate::{http, prometheus, Report};

/// Requests outstanding per target at most: the ranks of a publish are sent at once, up to this.
/// MLflow's SQLAlchemy pool holds 15 connections (5 + 10 overflow); 16 concurrent log-batch
/// requests into one run, writing the same keys, exhaust it, and MLflow answers 400 ("QueuePool
/// limit ... reached") 30 s later. Staying well below keeps MLflow's limit out of the count.
pub(crate) const MAX_IN_FLIGHT: usize = 8;
/// GPUs per simulated rank: none, so every key is a CPU-monitor key the brief counts.
const GPUS: u32 = 0;
/// Most pages of one `metrics/get-history` read, to keep the count bounded.
const MAX_HISTORY_PAGES: usize = 1_000;

/// What one target's run ended up with.
#[derive(Debug, Clone, Default)]
pub(crate) struct Stored {
    pub(crate) requests: u64,
    pub(crate) failed: u64,
    /// Rows and distinct keys per kind of series.
    pub(crate) rows: BTreeMap<SeriesKind, u64>,
    pub(crate) series: BTreeMap<SeriesKind, u64>,
}

/// A proxy's own count of node-wide samples, from its `/metrics`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ProxyCounters {
    pub(crate) kept: u64,
    pub(crate) dropped: u64,
    pub(crate) elections: u64,
}

pub(crate) async fn run(
    args: &DedupRowsArgs,
    stack: &BenchStack,
    command_line: &str,
) -> anyhow::Result<Report> {
    let targets = stack.targets();
    let direct = stack
        .target(TargetKind::Direct)
        .context("the stack has no direct target")?;
    let experiment_id = mlflow::create_experiment(
        &direct,
        &format!("mlscope-bench-dedup-{}", uuid::Uuid::new_v4()),
    )
    .await?;
    let ranks: Vec<MonitoredRank> = args
        .ranks()
        .into_iter()
        .map(|(node, rank)| MonitoredRank::new(node, rank))
        .collect();

    let mut runs = Vec::with_capacity(targets.len());
    for target in &targets {
        let client = http::client(MAX_IN_FLIGHT)?;
        let run_id = mlflow::create_run(
            &client,
            target,
            &experiment_id,
            &format!("dedup-{}", target.kind.slug()),
        )
        .await?;
        runs.push((target.clone(), client, run_id, Stored::default()));
    }

    // The simulated history ends now: publish p of every rank is stamped 10 s after publish p-1.
    let first_timestamp = unix_millis().saturating_sub(args.publishes * SAMPLING_INTERVAL_MILLIS);
    let total = args.publishes * ranks.len() as u64 * targets.len() as u64;
    let bar = progress::count_bar(total);
    let mut failures = Vec::new();
    for publish in 0..args.publishes {
        // Targets take turns publish by publish, so every run sees the same pace.
        for (target, client, run_id, stored) in &mut runs {
            bar.set_message(format!(
                "publish {}/{} via {}",
                publish + 1,
                args.publishes,
                target.kind
            ));
            let failed = send_publish(
                client,
                target,
                run_id,
                &ranks,
                publish,
                first_timestamp,
                args.request_timeout,
            )
            .await;
            stored.requests += ranks.len() as u64;
            stored.failed += failed.len() as u64;
            failures.extend(
                failed
                    .into_iter()
                    .map(|why| format!("publish {publish} via {}: {why}", target.kind)),
            );
            bar.inc(ranks.len() as u64);
        }
    }
    bar.finish_and_clear();

    let counting = progress::spinner("counting the rows MLflow stored");
    let reader = http::client(1)?;
    for (target, _, run_id, stored) in &mut runs {
        count_rows(&reader, &direct, run_id, stored)
            .await
            .with_context(|| format!("counting the rows of the run logged via {}", target.kind))?;
    }
    counting.finish_and_clear();

    let mut counters = BTreeMap::new();
    for target in &targets {
        if let Some(admin) = stack.admin_url(target.kind) {
            if let Some(found) = proxy_counters(&reader, &admin).await {
                counters.insert(target.kind, found);
            }
        }
    }

    let results: Vec<(TargetKind, Stored)> = runs
        .into_iter()
        .map(|(target, _, _, stored)| (target.kind, stored))
        .collect();
    let facts = report::RunFacts {
        command_line: command_line.to_string(),
        mlflow_version: mlflow::version(&direct).await,
        ranks_per_node: args.ranks_per_node,
        nodes: args.nodes,
        publishes: args.publishes,
        keys_per_publish: ranks.first().map_or(0, |rank| rank.publish(0, GPUS).len()),
    };
    let mut problems = report::unexpected(&facts, &results);
    let shown = failures.len().min(10);
    problems.extend(failures.drain(..shown));
    if !failures.is_empty() {
        problems.push(format!("… and {} more failed requests", failures.len()));
    }
    Ok(Report {
        markdown: report::render(&facts, &results, &counters),
        problems,
    })
}

/// Sends publish `publish` of every rank to `target` at once (at most [`MAX_IN_FLIGHT`] in
/// flight) and returns why the failed ones failed.
async fn send_publish(
    client: &reqwest::Client,
    target: &Target,
    run_id: &str,
    ranks: &[MonitoredRank],
    publish: u64,
    first_timestamp: u64,
    timeout: Duration,
) -> Vec<String> {
    let url = format!("{}/api/2.0/mlflow/runs/log-batch", target.base_url);
    let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let mut sending = JoinSet::new();
    for rank in ranks {
        let body = publish_body(run_id, rank, publish, first_timestamp);
        let request = client.post(&url).json(&body).timeout(timeout);
        let slots = slots.clone();
        sending.spawn(async move {
            let _slot = slots.acquire_owned().await;
            let response = request.send().await.map_err(describe)?;
            let status = response.status();
            let text = response.text().await.map_err(describe)?;
            if status.is_success() {
                Ok(())
            } else {
                Err(format!("HTTP {status}: {text}"))
            }
        });
    }
    let mut failed = Vec::new();
    while let Some(done) = sending.join_next().await {
        match done {
            Ok(Ok(())) => {}
            Ok(Err(why)) => failed.push(why),
            Err(panicked) => failed.push(format!("sending task failed: {panicked}")),
        }
    }
    failed
}

/// A transport error with its causes ("error sending request" alone says nothing).
fn describe(error: reqwest::Error) -> String {
    format!("{:#}", anyhow::Error::from(error))
}

/// One monitor publish as a log-batch: the rank's own step counter (`publish`), one timestamp.
/// The timestamp is offset by the rank in milliseconds: monitors of different ranks do not
/// sample at the same instant.
fn publish_body(run_id: &str, rank: &MonitoredRank, publish: u64, first_timestamp: u64) -> Value {
    let timestamp =
        first_timestamp + publish * SAMPLING_INTERVAL_MILLIS + u64::from(rank.rank) % 1_000;
    let metrics: Vec<Value> = rank
        .publish(publish, GPUS)
        .into_iter()
        .map(|(key, value)| json!({ "key": key, "value": value, "timestamp": timestamp, "step": publish }))
        .collect();
    json!({ "run_id": run_id, "metrics": metrics })
}

/// Adds up what MLflow stored for `run_id`: every key `runs/get` lists, and the length of its
/// `metrics/get-history`. Read straight from MLflow, not through a proxy.
async fn count_rows(
    client: &reqwest::Client,
    direct: &Target,
    run_id: &str,
    into: &mut Stored,
) -> anyhow::Result<()> {
    let run = mlflow::get_json(
        client,
        &format!("{}/api/2.0/mlflow/runs/get", direct.base_url),
        &[("run_id", run_id)],
    )
    .await?;
    let keys: Vec<String> = run
        .pointer("/run/data/metrics")
        .and_then(Value::as_array)
        .map(|metrics| {
            metrics
                .iter()
                .filter_map(|m| m.get("key").and_then(Value::as_str).map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let url = format!("{}/api/2.0/mlflow/metrics/get-history", direct.base_url);
    for key in keys {
        let kind = SeriesKind::of_key(&key);
        let mut rows = 0u64;
        let mut page_token: Option<String> = None;
        for _ in 0..MAX_HISTORY_PAGES {
            let mut query = vec![("run_id", run_id), ("metric_key", key.as_str())];
            if let Some(token) = &page_token {
                query.push(("page_token", token.as_str()));
            }
            let page = mlflow::get_json(client, &url, &query).await?;
            rows += page
                .get("metrics")
                .and_then(Value::as_array)
                .map_or(0, |m| m.len() as u64);
            page_token = page
                .get("next_page_token")
                .and_then(Value::as_str)
                .filter(|t| !t.is_empty())
                .map(str::to_string);
            if page_token.is_none() {
                break;
            }
        }
        *into.rows.entry(kind).or_default() += rows;
        *into.series.entry(kind).or_default() += 1;
    }
    Ok(())
}

/// mlscope-proxy's node-sample and election counters from its admin `/metrics`; `None` when the
/// page cannot be read.
async fn proxy_counters(client: &reqwest::Client, admin_url: &str) -> Option<ProxyCounters> {
    Some(parse_counters(
        &prometheus::scrape(client, admin_url).await?,
    ))
}

fn parse_counters(exposition: &str) -> ProxyCounters {
    let value = |series: &str| prometheus::sum(exposition, series) as u64;
    ProxyCounters {
        kept: value(r#"mlscope_node_samples_total{reason="kept"}"#),
        dropped: value(r#"mlscope_node_samples_total{reason="dropped"}"#),
        elections: value("mlscope_dedup_elections_total{"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_publish_is_one_batch_with_the_ranks_step_and_one_timestamp() {
        let body = publish_body("r", &MonitoredRank::new("node-1", 9), 4, 1_000_000);
        let metrics = body["metrics"].as_array().expect("metrics");
        assert_eq!(metrics.len(), 8);
        assert!(metrics
            .iter()
            .all(|m| m["step"] == 4 && m["timestamp"] == 1_040_009u64));
        assert_eq!(
            metrics[0]["key"],
            "system/node-1/rank-9/cpu_utilization_percentage"
        );
    }

    #[test]
    fn counters_are_read_from_the_prometheus_exposition() {
        let text = "# HELP mlscope_node_samples Node-wide samples\n\
                    # TYPE mlscope_node_samples counter\n\
                    mlscope_node_samples_total{reason=\"kept\"} 120\n\
                    mlscope_node_samples_total{reason=\"dropped\"} 840\n\
                    mlscope_dedup_elections_total{reason=\"elected\"} 2\n";
        assert_eq!(
            parse_counters(text),
            ProxyCounters {
                kept: 120,
                dropped: 840,
                elections: 2
            }
        );
    }
}
