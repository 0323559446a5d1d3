//! The fleet report: one row per target and fleet size, the largest fleet each target sustained,
//! and the same as JSON.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::{json, Value};

use super::{Op, Outcome};
use crate::cli::FleetArgs;
use crate::markdown::{command_block, Align, Table};
use crate::stack::TargetKind;
use crate::units::micros_as_millis;

pub(crate) fn render(
    args: &FleetArgs,
    command_line: &str,
    mlflow_version: Option<&str>,
    outcomes: &[Outcome],
) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "### Training fleet\n");
    out.push_str(&command_block(command_line));
    let _ = writeln!(
        out,
        "\n{nodes} nodes in {runs} run(s), one system-metrics publish of {source} ({per} metrics, {gpus} GPU(s)) per rank every {interval} \
         simulated, time compressed {scale}× (each rank stands for {scale}); {training}; 10 params and 2 tags per run at its start; {checkpoints}; {scenario} start; \
         {duration} of load per target and fleet size; open loop (latency from each request's scheduled instant to its final \
         answer, up to {retries} retries on 429/5xx/transport errors as the MLflow client does); sustained = no failed or \
         dropped request, no acknowledged sample missing or duplicated, p99 acknowledgement ≤ {bound}. Upstream: MLflow {version}, \
         backend store {backend}; {cpus} logical CPUs shared by the load generator, MLflow, nginx and mlscope-proxy.\n",
        nodes = args.nodes,
        runs = args.runs,
        source = match args.system_from {
            crate::cli::SystemFrom::Monitor => "MLflow's monitor",
            crate::cli::SystemFrom::Collector => "mlscope-collector",
        },
        per = match args.system_from {
            crate::cli::SystemFrom::Monitor => 8,
            crate::cli::SystemFrom::Collector => crate::monitor::COLLECTOR_NAMES.len() as u32,
        } + 5 * args.gpus,
        gpus = args.gpus,
        interval = humantime::format_duration(args.interval),
        scale = args.time_scale,
        training = if args.training_metrics == 0 {
            "no training metrics".to_owned()
        } else {
            format!(
                "{} training metrics per step every {} simulated from {}",
                args.training_metrics,
                humantime::format_duration(args.step_interval),
                match args.training_from {
                    crate::cli::TrainingFrom::All => "every rank",
                    crate::cli::TrainingFrom::Rank0 => "each run's rank 0",
                }
            )
        },
        checkpoints = if args.checkpoint_every.is_zero() {
            "no checkpoint uploads".to_owned()
        } else {
            format!(
                "a {}-byte checkpoint from each run's rank 0 every {} simulated",
                args.checkpoint_size.0,
                humantime::format_duration(args.checkpoint_every)
            )
        },
        scenario = match args.scenario {
            crate::cli::Scenario::Steady => "steady (ranks spread over one interval)",
            crate::cli::Scenario::Burst => "burst (every rank at the same instant)",
            crate::cli::Scenario::MlflowRestart => {
                "steady, with MLflow killed halfway through and started again (same port and backend) 2 s later,"
            }
            crate::cli::Scenario::ReplicaKill => {
                "steady, with replica 0 killed (SIGKILL) halfway through and started again (same ports and database) 2 s later,"
            }
        },
        duration = humantime::format_duration(args.duration),
        retries = args.retries,
        bound = humantime::format_duration(args.p99_bound),
        version = mlflow_version.unwrap_or("(version not reported)"),
        backend = args.stack.backend_label(),
        cpus = std::thread::available_parallelism().map_or(0, |n| n.get()),
    );

    let mut table = Table::new(&[
        ("target", Align::Left),
        ("ranks", Align::Right),
        ("simulated ranks", Align::Right),
        ("requests", Align::Right),
        ("acked", Align::Right),
        ("failed", Align::Right),
        ("retried", Align::Right),
        ("samples acked", Align::Right),
        ("stored", Align::Right),
        ("missing", Align::Right),
        ("duplicated", Align::Right),
        ("p50 ms", Align::Right),
        ("p99 ms", Align::Right),
        ("max ms", Align::Right),
        ("sustained", Align::Left),
    ]);
    for o in outcomes {
        let q = |quantile: f64| {
            if o.all_latency.is_empty() {
                "—".into()
            } else {
                micros_as_millis(o.all_latency.value_at_quantile(quantile))
            }
        };
        table.row(vec![
            o.target.label().to_owned(),
            (o.nodes * o.ranks_per_node).to_string(),
            format!("{}", o.simulated_ranks),
            o.requests.to_string(),
            o.acknowledged.to_string(),
            (o.failed + o.dropped).to_string(),
            o.retried.to_string(),
            o.counts.acknowledged.to_string(),
            o.counts.stored.to_string(),
            o.counts.missing.to_string(),
            o.counts.duplicated.to_string(),
            q(0.5),
            q(0.99),
            if o.all_latency.is_empty() {
                "—".into()
            } else {
                micros_as_millis(o.all_latency.max())
            },
            if o.sustained() { "yes" } else { "no" }.to_owned(),
        ]);
    }
    out.push_str(&table.render());

    // p99 per operation, for the rows that had more than one kind.
    let mut per_op = Table::new(&[
        ("target", Align::Left),
        ("ranks", Align::Right),
        ("operation", Align::Left),
        ("acked", Align::Right),
        ("p50 ms", Align::Right),
        ("p99 ms", Align::Right),
    ]);
    for o in outcomes {
        for (op, histogram) in &o.latency {
            per_op.row(vec![
                o.target.label().to_owned(),
                (o.nodes * o.ranks_per_node).to_string(),
                op.label().to_owned(),
                histogram.len().to_string(),
                micros_as_millis(histogram.value_at_quantile(0.5)),
                micros_as_millis(histogram.value_at_quantile(0.99)),
            ]);
        }
    }
    let _ = writeln!(out, "\nAcknowledgement latency per operation:\n");
    out.push_str(&per_op.render());

    let with_batches: Vec<&Outcome> = outcomes.iter().filter(|o| o.batches.is_some()).collect();
    if !with_batches.is_empty() {
        let mut batches = Table::new(&[
            ("target", Align::Left),
            ("ranks", Align::Right),
            ("batches to MLflow", Align::Right),
            ("merged", Align::Right),
            ("single", Align::Right),
            ("split", Align::Right),
            ("requests per batch", Align::Right),
            ("samples per batch", Align::Right),
        ]);
        for o in with_batches {
            let b = o.batches.clone().unwrap_or_default();
            let mean = |v: Option<f64>| v.map_or_else(|| "—".into(), |v| format!("{v:.1}"));
            batches.row(vec![
                o.target.label().to_owned(),
                (o.nodes * o.ranks_per_node).to_string(),
                b.sent().to_string(),
                b.merged.to_string(),
                b.single.to_string(),
                b.split.to_string(),
                mean(b.requests_per_batch()),
                mean(b.samples_per_batch()),
            ]);
        }
        let _ = writeln!(
            out,
            "\nMetric batches the proxies' coalescers sent MLflow (from their `/metrics`, \
             `mlscope_coalesce_*`; a replica killed in the phase counts only from its restart):\n"
        );
        out.push_str(&batches.render());
    }

    if !args.checkpoint_every.is_zero() {
        let _ = writeln!(
            out,
            "\nCheckpoint uploads acknowledged, and read back whole from MLflow afterwards:\n"
        );
        let mut objects = Table::new(&[
            ("target", Align::Left),
            ("ranks", Align::Right),
            ("uploads acked", Align::Right),
            ("read back whole", Align::Right),
            ("missing", Align::Right),
        ]);
        for o in outcomes {
            objects.row(vec![
                o.target.label().to_owned(),
                (o.nodes * o.ranks_per_node).to_string(),
                o.counts.objects_acknowledged.to_string(),
                o.counts.objects_stored.to_string(),
                (o.counts.objects_acknowledged
                    - o.counts.objects_stored.min(o.counts.objects_acknowledged))
                .to_string(),
            ]);
        }
        out.push_str(&objects.render());
    }

    let failures: Vec<String> = outcomes
        .iter()
        .flat_map(|o| {
            o.failures.iter().map(move |(answer, n)| {
                format!(
                    "- {} at {} ranks: {n} × {answer}",
                    o.target.label(),
                    o.nodes * o.ranks_per_node
                )
            })
        })
        .collect();
    if !failures.is_empty() {
        let _ = writeln!(out, "\nFailed requests, by final answer:\n");
        for line in failures.iter().take(40) {
            let _ = writeln!(out, "{line}");
        }
    }

    let after: Vec<String> = outcomes
        .iter()
        .filter(|o| o.count_error.is_some() || o.drained.as_secs() >= 5)
        .map(|o| {
            let mut line = format!(
                "- {} at {} ranks: MLflow answered promptly again {:.0} s after the load",
                o.target.label(),
                o.nodes * o.ranks_per_node,
                o.drained.as_secs_f64()
            );
            if let Some(error) = &o.count_error {
                let shown: String = error.chars().take(200).collect();
                let _ = write!(line, "; the samples could not be counted: {shown}");
            }
            line
        })
        .collect();
    if !after.is_empty() {
        let _ = writeln!(out, "\nAfter the load:\n");
        for line in &after {
            let _ = writeln!(out, "{line}");
        }
    }

    let restarts: Vec<String> = outcomes
        .iter()
        .filter_map(|o| {
            o.outage.as_ref().map(|outage| {
                format!(
                    "- {} at {} ranks: {} gone for {:.1} s (kill to ready again)",
                    o.target.label(),
                    o.nodes * o.ranks_per_node,
                    outage.what,
                    outage.gone.as_secs_f64()
                )
            })
        })
        .collect();
    if !restarts.is_empty() {
        let _ = writeln!(out, "\nKilled and started again:\n");
        for line in &restarts {
            let _ = writeln!(out, "{line}");
        }
    }

    for o in outcomes.iter().filter(|o| !o.resources.is_empty()) {
        let _ = writeln!(
            out,
            "\n{} at {} ranks. {}",
            o.target.label(),
            o.nodes * o.ranks_per_node,
            super::soak::table(&o.resources)
        );
    }

    let largest = largest_sustained(outcomes);
    let _ = writeln!(out, "\nLargest fleet sustained (simulated ranks):\n");
    let direct = largest.get(&TargetKind::Direct).copied().flatten();
    let mut summary = Table::new(&[
        ("target", Align::Left),
        ("largest sustained", Align::Right),
        ("÷ direct", Align::Right),
        ("note", Align::Left),
    ]);
    for (kind, best) in &largest {
        let stepped_out = outcomes
            .iter()
            .filter(|o| o.target == *kind)
            .all(|o| o.sustained());
        summary.row(vec![
            kind.label().to_owned(),
            best.map_or_else(|| "none".into(), |b| format!("{b}")),
            match (best, direct) {
                (Some(b), Some(d)) if d > 0.0 => format!("{:.2}×", b / d),
                _ => "—".into(),
            },
            if stepped_out {
                "every size tried was sustained: the limit is higher".into()
            } else {
                String::new()
            },
        ]);
    }
    out.push_str(&summary.render());
    out
}

/// Per target, the most simulated ranks of a sustained row (`None` when none was).
fn largest_sustained(outcomes: &[Outcome]) -> BTreeMap<TargetKind, Option<f64>> {
    let mut largest: BTreeMap<TargetKind, Option<f64>> = BTreeMap::new();
    for o in outcomes {
        let entry = largest.entry(o.target).or_insert(None);
        if o.sustained() {
            *entry = Some(entry.map_or(o.simulated_ranks, |b: f64| b.max(o.simulated_ranks)));
        }
    }
    largest
}

pub(crate) fn json(args: &FleetArgs, mlflow_version: Option<&str>, outcomes: &[Outcome]) -> Value {
    let rows: Vec<Value> = outcomes
        .iter()
        .map(|o| {
            let per_op: BTreeMap<&str, Value> = o
                .latency
                .iter()
                .map(|(op, h): (&Op, _)| {
                    (
                        op.label(),
                        json!({
                            "acknowledged": h.len(),
                            "p50_ms": h.value_at_quantile(0.5) as f64 / 1e3,
                            "p99_ms": h.value_at_quantile(0.99) as f64 / 1e3,
                            "max_ms": h.max() as f64 / 1e3,
                        }),
                    )
                })
                .collect();
            json!({
                "target": o.target.slug(),
                "ranks": o.nodes * o.ranks_per_node,
                "simulated_ranks": o.simulated_ranks,
                "requests": o.requests,
                "acknowledged": o.acknowledged,
                "failed": o.failed,
                "dropped": o.dropped,
                "retried": o.retried,
                "failures": o.failures,
                "samples": {
                    "sent": o.counts.sent,
                    "acknowledged": o.counts.acknowledged,
                    "stored": o.counts.stored,
                    "missing": o.counts.missing,
                    "duplicated": o.counts.duplicated,
                },
                "objects": {
                    "acknowledged": o.counts.objects_acknowledged,
                    "read_back": o.counts.objects_stored,
                },
                "p99_ms": o.p99_micros().map(|p| p as f64 / 1e3),
                "latency": per_op,
                "sustained": o.sustained(),
                "drained_s": o.drained.as_secs_f64(),
                "outage": o.outage.as_ref().map(|outage| json!({
                    "what": outage.what,
                    "gone_s": outage.gone.as_secs_f64(),
                })),
                "batches": o.batches.as_ref().map(|b| json!({
                    "sent": b.sent(),
                    "merged": b.merged,
                    "single": b.single,
                    "split": b.split,
                    "requests_per_batch": b.requests_per_batch(),
                    "samples_per_batch": b.samples_per_batch(),
                })),
                "count_error": o.count_error,
                "resources": o.resources.iter().map(|r| json!({
                    "at_s": r.at.as_secs_f64(),
                    "rss_bytes": r.rss_bytes,
                    "open_fds": r.open_fds,
                    "queued_requests": r.queued_requests,
                    "in_flight": r.in_flight,
                    "state_rows": r.state_rows,
                    "report_rows": r.report_rows,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    let largest: BTreeMap<&str, Option<f64>> = largest_sustained(outcomes)
        .into_iter()
        .map(|(k, v)| (k.slug(), v))
        .collect();
    json!({
        "mlflow_version": mlflow_version,
        "nodes": args.nodes,
        "runs": args.runs,
        "time_scale": args.time_scale,
        "interval_s": args.interval.as_secs_f64(),
        "duration_s": args.duration.as_secs_f64(),
        "p99_bound_ms": args.p99_bound.as_secs_f64() * 1e3,
        "rows": rows,
        "largest_sustained_simulated_ranks": largest,
    })
}
