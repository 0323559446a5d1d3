//! The pass-through report: one row per (endpoint, rate, target), proxies compared with direct.

use std::fmt::Write as _;

use super::breakdown;
use super::open_loop::Measurements;
use super::workload::BatchContent;
use super::{endpoint_name, Breakdowns, Results, RunFacts};
use crate::cli::{Endpoint, PassthroughArgs};
use crate::markdown::{command_block, Align, Table};
use crate::stack::TargetKind;
use crate::units::{micros_as_millis, signed_micros_as_millis};

/// Percentiles reported, as (column name, quantile).
const PERCENTILES: [(&str, f64); 3] = [("p50", 0.50), ("p99", 0.99), ("p99.9", 0.999)];

/// Below this many samples p99.9 is simply the slowest request, which the report says.
const SAMPLES_FOR_P999: u64 = 1_000;

pub(crate) fn render(
    args: &PassthroughArgs,
    facts: &RunFacts,
    results: &Results,
    breakdowns: &Breakdowns,
) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "### Pass-through overhead\n");
    out.push_str(&command_block(&facts.command_line));
    // What `direct` is: the stub answers at once and is no MLflow of any version.
    let upstream = if args.stack.stub_upstream {
        "the load generator's stub server (no MLflow: it answers every call at once with fixed \
         MLflow-shaped JSON), so the differences are the proxies' own"
            .to_owned()
    } else {
        format!(
            "MLflow {}",
            facts
                .mlflow_version
                .as_deref()
                .unwrap_or("(version not reported)")
        )
    };
    let _ = writeln!(
        out,
        "\n{} rounds of {} per target, targets rotated each round; warm-up {} per target and endpoint; \
         at most {} requests in flight per target; log-batch carries {} with a unique step; \
         upstream: {}; {} logical CPUs shared by the load generator, {}, nginx and mlscope-proxy.\n",
        facts.rounds,
        humantime::format_duration(facts.slice),
        humantime::format_duration(args.warmup),
        args.max_in_flight,
        facts.content.describe(),
        upstream,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        if args.stack.stub_upstream { "the stub" } else { "MLflow" },
    );

    let mut columns = vec![
        ("endpoint", Align::Left),
        ("rate req/s", Align::Right),
        ("target", Align::Left),
        ("requests", Align::Right),
        ("errors", Align::Right),
    ];
    columns.extend([
        ("p50 ms", Align::Right),
        ("p99 ms", Align::Right),
        ("p99.9 ms", Align::Right),
    ]);
    columns.extend([
        ("+p50 ms", Align::Right),
        ("+p99 ms", Align::Right),
        ("+p99.9 ms", Align::Right),
    ]);
    let mut table = Table::new(&columns);
    let mut error_notes = Vec::new();
    let mut few_samples = false;

    // The map's key order (endpoint, rate, target) is the report's row order.
    for (&(endpoint, rate, kind), measured) in results {
        let direct = results.get(&(endpoint, rate, TargetKind::Direct));
        let mut cells = vec![
            endpoint_label(endpoint, &facts.content),
            rate.to_string(),
            kind.to_string(),
            measured.scheduled.to_string(),
            measured.errors.total().to_string(),
        ];
        for (_, quantile) in PERCENTILES {
            cells.push(
                measured
                    .quantile_micros(quantile)
                    .map_or_else(|| "n/a".into(), micros_as_millis),
            );
        }
        for (_, quantile) in PERCENTILES {
            cells.push(added_latency(kind, measured, direct, quantile));
        }
        table.row(cells);
        if measured.errors.total() > 0 {
            error_notes.push(format!(
                "{} at {rate} req/s via {kind}: {}",
                endpoint_name(endpoint),
                measured.errors.describe()
            ));
        }
        few_samples |= measured.successes() < SAMPLES_FOR_P999;
    }
    out.push_str(&table.render());

    let _ = writeln!(
        out,
        "\nLatency runs from each request's release by the generator's timer (on the millisecond \
         tick at or after its scheduled send) to the last byte of its response; time waiting for an \
         in-flight slot counts (open loop, so a stall delays the requests behind it and shows in \
         their latency). Successful requests only. `+` columns: target minus direct at the same endpoint and rate."
    );
    if few_samples {
        let _ = writeln!(
            out,
            "With fewer than {SAMPLES_FOR_P999} successful requests in a row, \
             p99.9 is that row's slowest request."
        );
    }
    if let Some(scoping) = scoping_cost(facts, results) {
        out.push_str(&scoping);
    }
    out.push_str(&inside_the_proxy(facts, results, breakdowns));
    if !error_notes.is_empty() {
        let _ = writeln!(out, "\nErrors:");
        for note in error_notes {
            let _ = writeln!(out, "- {note}");
        }
    }
    out
}

/// Where the proxy's time went, from its own request log: per endpoint and rate, the time
/// inside it (head to head), MLflow's part, and what is left (its own), beside what the client
/// saw it add.
fn inside_the_proxy(facts: &RunFacts, results: &Results, breakdowns: &Breakdowns) -> String {
    let mut table = Table::new(&[
        ("endpoint", Align::Left),
        ("rate req/s", Align::Right),
        ("requests logged", Align::Right),
        ("added, client's view p50 / p99 ms", Align::Right),
        ("inside the proxy p50 / p99 ms", Align::Right),
        ("upstream's part p50 / p99 ms", Align::Right),
        ("the proxy's own p50 / p99 ms", Align::Right),
    ]);
    let mut rows = 0;
    for (&(endpoint, rate), found) in breakdowns {
        if found.requests() == 0 {
            continue;
        }
        let added = |q| {
            let proxy = results.get(&(endpoint, rate, TargetKind::Proxy));
            let direct = results.get(&(endpoint, rate, TargetKind::Direct));
            match proxy {
                Some(proxy) => added_latency(TargetKind::Proxy, proxy, direct, q),
                None => "n/a".into(),
            }
        };
        let pair = |h: &hdrhistogram::Histogram<u64>| {
            format!(
                "{:.2} / {:.2}",
                breakdown::ms(h, 0.5),
                breakdown::ms(h, 0.99)
            )
        };
        table.row(vec![
            endpoint_label(endpoint, &facts.content),
            rate.to_string(),
            found.requests().to_string(),
            format!("{} / {}", added(0.5), added(0.99)),
            pair(&found.inside),
            pair(&found.upstream),
            pair(&found.own),
        ]);
        rows += 1;
    }
    if rows == 0 {
        return String::new();
    }
    format!(
        "\nInside mlscope-proxy, from its request log (`latency_ms`: the request's head reaching \
         its layers to the answer's head leaving them; `upstream_ms`: from handing the request to \
         the connection pool to the upstream's answer head, or for a merged batch its whole body). \
         \"Own\" is the difference: layers, bookkeeping, queues and task hand-overs. What the client \
         saw added beyond \"inside\" is the extra hop itself: the kernel and hyper reading and \
         writing on both sides.\n\n{}",
        table.render()
    )
}

fn endpoint_label(endpoint: Endpoint, content: &BatchContent) -> String {
    match endpoint {
        Endpoint::LogBatch => match content {
            BatchContent::Plain(n) => format!("POST runs/log-batch ({n} metrics)"),
            BatchContent::SystemMetrics(_) => {
                format!("POST runs/log-batch ({} system metrics)", content.metrics())
            }
        },
        Endpoint::RunsGet => "GET runs/get".to_string(),
    }
}

/// The cost of scoping itself: mlscope-proxy minus mlscope-proxy with scoping off, per endpoint and
/// rate. `None` when the run had no scoping-off proxy.
fn scoping_cost(facts: &RunFacts, results: &Results) -> Option<String> {
    let mut columns = vec![("endpoint", Align::Left), ("rate req/s", Align::Right)];
    columns.extend([
        ("+p50 ms", Align::Right),
        ("+p99 ms", Align::Right),
        ("+p99.9 ms", Align::Right),
    ]);
    let mut table = Table::new(&columns);
    let mut rows = 0;
    for (&(endpoint, rate, kind), measured) in results {
        if kind != TargetKind::Proxy {
            continue;
        }
        let Some(off) = results.get(&(endpoint, rate, TargetKind::ProxyScopingOff)) else {
            continue;
        };
        let mut cells = vec![endpoint_label(endpoint, &facts.content), rate.to_string()];
        for (_, quantile) in PERCENTILES {
            cells.push(added_latency(kind, measured, Some(off), quantile));
        }
        table.row(cells);
        rows += 1;
    }
    if rows == 0 {
        return None;
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\nWhat rewriting and deduplication add to forwarding alone \
         (`{}` minus `{}`; every sample comes from one rank, so that rank holds its node's \
         reporter seat and no sample is dropped):\n",
        TargetKind::Proxy,
        TargetKind::ProxyScopingOff
    );
    out.push_str(&table.render());
    Some(out)
}

/// `target − direct` at `quantile`, "—" for the direct row itself, "n/a" without data.
fn added_latency(
    kind: TargetKind,
    measured: &Measurements,
    direct: Option<&Measurements>,
    quantile: f64,
) -> String {
    if kind == TargetKind::Direct {
        return "—".into();
    }
    match (
        measured.quantile_micros(quantile),
        direct.and_then(|d| d.quantile_micros(quantile)),
    ) {
        (Some(target), Some(direct)) => signed_micros_as_millis(target as i64 - direct as i64),
        _ => "n/a".into(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use clap::Parser as _;

    use super::*;
    use crate::cli::{Cli, Command};

    fn measurements(latencies_micros: &[u64]) -> Measurements {
        let mut m = Measurements::new();
        for &l in latencies_micros {
            m.latency_micros.record(l).expect("in range");
        }
        m.scheduled = latencies_micros.len() as u64;
        m
    }

    #[test]
    fn proxies_are_reported_with_their_latency_added_over_direct() {
        let Command::Passthrough(args) =
            Cli::parse_from(["mlscope-bench", "passthrough", "--rates", "20"]).command
        else {
            panic!("wrong subcommand")
        };
        let mut results = Results::new();
        results.insert(
            (Endpoint::RunsGet, 20, TargetKind::Direct),
            measurements(&[1_000; 10]),
        );
        results.insert(
            (Endpoint::RunsGet, 20, TargetKind::Proxy),
            measurements(&[1_500; 10]),
        );
        let facts = RunFacts {
            command_line: "mlscope-bench passthrough --rates 20".into(),
            mlflow_version: Some("3.17.2".into()),
            content: BatchContent::Plain(10),
            rounds: 4,
            slice: Duration::from_secs(5),
        };
        let report = render(&args, &facts, &results, &Breakdowns::new());
        assert!(
            report.contains("```sh\nmlscope-bench passthrough --rates 20\n```"),
            "{report}"
        );
        assert!(
            report.contains(
                "| GET runs/get | 20 | direct | 10 | 0 | 1.00 | 1.00 | 1.00 | — | — | — |"
            ),
            "{report}"
        );
        assert!(report.contains("| GET runs/get | 20 | mlscope-proxy | 10 | 0 | 1.50 | 1.50 | 1.50 | +0.50 | +0.50 | +0.50 |"), "{report}");
        assert!(!report.contains("scoping off"), "{report}");
        assert!(report.contains("upstream: MLflow 3.17.2;"), "{report}");
    }

    #[test]
    fn with_a_scoping_off_proxy_the_cost_of_scoping_gets_its_own_table() {
        let Command::Passthrough(args) = Cli::parse_from([
            "mlscope-bench",
            "passthrough",
            "--system-metrics",
            "--rates",
            "20",
            "--endpoints",
            "log-batch",
            "--stub-upstream",
        ])
        .command
        else {
            panic!("wrong subcommand")
        };
        let mut results = Results::new();
        for (kind, micros) in [
            (TargetKind::Direct, 4_000),
            (TargetKind::ProxyScopingOff, 4_300),
            (TargetKind::Proxy, 4_500),
        ] {
            results.insert((Endpoint::LogBatch, 20, kind), measurements(&[micros; 10]));
        }
        let facts = RunFacts {
            command_line: "mlscope-bench passthrough --system-metrics".into(),
            mlflow_version: None,
            content: BatchContent::new(true, 10),
            rounds: 2,
            slice: Duration::from_secs(5),
        };
        let report = render(&args, &facts, &results, &Breakdowns::new());
        assert!(report.contains("| POST runs/log-batch (13 system metrics) | 20 | mlscope-proxy (scoping off) | 10 | 0 | 4.30 | 4.30 | 4.30 | +0.30 | +0.30 | +0.30 |"), "{report}");
        assert!(
            report.contains(
                "| POST runs/log-batch (13 system metrics) | 20 | +0.20 | +0.20 | +0.20 |"
            ),
            "{report}"
        );
        // Behind a stub, `direct` is no MLflow of any version.
        assert!(
            report.contains("upstream: the load generator's stub server (no MLflow"),
            "{report}"
        );
        assert!(!report.contains("MLflow (version"), "{report}");
    }
}
