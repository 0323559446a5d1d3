//! Workloads of MLflow's own clients into one run, straight to MLflow and through mlscope-proxy,
//! the targets taking turns round by round, every acknowledged sample counted back from MLflow:
//! `k6-log-batch` (MLflow's k6 log-batch benchmark) and `client-fleet` (the MLflow Python
//! client's `log_metric` from many rank threads).

pub(crate) mod client;
pub(crate) mod k6;

use std::future::Future;

use crate::markdown::{command_block, Align, Table};
use crate::mlflow::{create_experiment, create_run, get_json, version};
use crate::stack::{BenchStack, Target, TargetKind};
use crate::{http, progress, Report};

/// What one run of a workload against one target did.
#[derive(Debug, Clone, Default)]
pub(crate) struct Outcome {
    /// Requests (k6) or client calls (Python) made.
    pub(crate) requests: u64,
    /// `requests` per second of the run.
    pub(crate) rate: f64,
    pub(crate) p95_ms: Option<f64>,
    /// Requests answered anything but 200 (k6), or calls that raised after the client's retries.
    pub(crate) failed: u64,
    /// Samples in the requests answered 200.
    pub(crate) acknowledged: u64,
    /// Metric keys the run wrote, to count back.
    pub(crate) keys: Vec<String>,
    /// Samples MLflow holds under `keys` afterwards.
    pub(crate) stored: u64,
}

/// One size or shape of a workload.
pub(crate) trait Load {
    /// How the report names it (`5/3/10`, `32 ranks`).
    fn label(&self) -> String;
    fn run(&self, target: &Target, run_id: &str) -> impl Future<Output = anyhow::Result<Outcome>>;
}

/// Per (load, target): every round's outcome.
struct Row {
    load: String,
    kind: TargetKind,
    rounds: Vec<Outcome>,
}

/// Runs every load `rounds` times against direct MLflow and mlscope-proxy, alternating which goes
/// first, counts back, and reports.
pub(crate) async fn compare<L: Load>(
    stack: &BenchStack,
    loads: &[L],
    rounds: u32,
    title: &str,
    unit: &str,
    command_line: &str,
) -> anyhow::Result<Report> {
    let direct = stack
        .target(TargetKind::Direct)
        .ok_or_else(|| anyhow::anyhow!("no direct target"))?;
    let targets: Vec<Target> = [TargetKind::Direct, TargetKind::Proxy]
        .into_iter()
        .filter_map(|k| stack.target(k))
        .collect();
    let experiment = create_experiment(&direct, &format!("{title}-{}", std::process::id())).await?;
    let client = http::client(4)?;
    let mut rows: Vec<Row> = Vec::new();
    let bar = progress::count_bar((loads.len() * rounds as usize * targets.len()) as u64);
    for load in loads {
        for round in 0..rounds {
            // Alternate which target goes first, so drift (the database growing) hits both alike.
            let mut order = targets.clone();
            if round % 2 == 1 {
                order.reverse();
            }
            for target in order {
                bar.set_message(format!(
                    "{} round {} {}",
                    load.label(),
                    round + 1,
                    target.kind
                ));
                let name = format!("{title}-{}-{}-r{round}", load.label(), target.kind.slug());
                let run_id = create_run(&client, &target, &experiment, &name).await?;
                let mut outcome = load.run(&target, &run_id).await?;
                outcome.stored = count_back(&client, &direct, &run_id, &outcome.keys).await?;
                let label = load.label();
                match rows
                    .iter_mut()
                    .find(|r| r.load == label && r.kind == target.kind)
                {
                    Some(row) => row.rounds.push(outcome),
                    None => rows.push(Row {
                        load: label,
                        kind: target.kind,
                        rounds: vec![outcome],
                    }),
                }
                bar.inc(1);
            }
        }
    }
    bar.finish_and_clear();
    Ok(report(
        &rows,
        version(&direct).await,
        title,
        unit,
        command_line,
    ))
}

/// Samples MLflow holds in `run_id` under `keys`, read page by page.
async fn count_back(
    client: &reqwest::Client,
    direct: &Target,
    run_id: &str,
    keys: &[String],
) -> anyhow::Result<u64> {
    let url = format!("{}/api/2.0/mlflow/metrics/get-history", direct.base_url);
    let mut stored = 0u64;
    for key in keys {
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
    rows: &[Row],
    mlflow_version: Option<String>,
    title: &str,
    unit: &str,
    command_line: &str,
) -> Report {
    let mut md = format!(
        "{title} · MLflow {} · best of {} rounds, targets alternating\n\n",
        mlflow_version.as_deref().unwrap_or("(version unknown)"),
        rows.first().map_or(0, |r| r.rounds.len()),
    );
    let best_label = format!("{unit} (best)");
    let mut table = Table::new(&[
        ("load", Align::Left),
        ("target", Align::Left),
        (best_label.as_str(), Align::Right),
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
            .find(|r| r.load == row.load && r.kind == TargetKind::Direct)
            .and_then(|r| r.rounds.iter().map(|o| o.rate).max_by(f64::total_cmp));
        let failed: u64 = row.rounds.iter().map(|o| o.failed).sum();
        let acknowledged: u64 = row.rounds.iter().map(|o| o.acknowledged).sum();
        let stored: u64 = row.rounds.iter().map(|o| o.stored).sum();
        let missing = acknowledged.saturating_sub(stored);
        let extra = stored.saturating_sub(acknowledged);
        if failed > 0 {
            problems.push(format!(
                "{} {}: {failed} failed requests",
                row.load, row.kind
            ));
        }
        if missing + extra > 0 {
            problems.push(format!(
                "{} {}: {missing} acknowledged samples missing, {extra} stored beyond those acknowledged",
                row.load, row.kind
            ));
        }
        let rounds: Vec<String> = row
            .rounds
            .iter()
            .map(|o| format!("{:.1}", o.rate))
            .collect();
        table.row(vec![
            row.load.clone(),
            row.kind.label().to_owned(),
            format!("{:.1}", best.rate),
            rounds.join(", "),
            best.p95_ms.map_or("–".into(), |p| format!("{p:.0}")),
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
    let per_run: Vec<String> = rows
        .iter()
        .map(|r| {
            let counts: Vec<String> = r.rounds.iter().map(|o| o.requests.to_string()).collect();
            format!("{} {}: {}", r.kind.slug(), r.load, counts.join("+"))
        })
        .collect();
    md.push_str(&format!("\nRequests per run: {}.\n\n", per_run.join("; ")));
    md.push_str(&command_block(command_line));
    Report {
        markdown: md,
        problems,
    }
}
