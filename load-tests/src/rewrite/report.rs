//! The rewrite report: one row per path, each compared with the rewrite engine, and the issue's
//! throughput target.

use std::fmt::Write as _;
use std::time::Duration;

use super::batch::Batch;
use super::{Path, Tally, Verified};
use crate::markdown::{command_block, Align, Table};
use crate::units::ByteSize;

/// The issue's target: metric samples per second on one core.
pub(crate) const TARGET_SAMPLES_PER_SECOND: f64 = 1_000_000.0;

pub(crate) struct RunFacts {
    pub(crate) command_line: String,
    pub(crate) rounds: u32,
    pub(crate) slice: Duration,
    pub(crate) warmup: Duration,
}

pub(crate) fn render(
    facts: &RunFacts,
    batch: &Batch,
    verified: &Verified,
    results: &[(Path, Tally)],
) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "### Rewrite engine on one core\n");
    out.push_str(&command_block(&facts.command_line));
    let _ = writeln!(
        out,
        "\nOne `runs/log-batch` body of {} metrics ({}, written the way MLflow's Python client \
         writes it): {} system keys of MLflow's monitor under `system/node-a/rank-3/` (CPU, \
         memory, disk, network, one GPU; a step and timestamp per publish) and {} training \
         metrics at steps beyond 2^53, {} of them `\"NaN\"` or `\"Infinity\"`. The rewrite changes \
         {} keys per body. One thread (current-thread tokio runtime); {} rounds of {} per path, \
         paths rotated each round; warm-up {} per path; {}; {} build.\n",
        batch.metrics,
        ByteSize(batch.body.len() as u64),
        batch.system_metrics,
        batch.metrics - batch.system_metrics,
        batch.non_finite_values,
        verified.keys_rewritten,
        facts.rounds,
        humantime::format_duration(facts.slice),
        humantime::format_duration(facts.warmup),
        cpu_model().unwrap_or_else(|| "CPU model unknown".into()),
        if cfg!(debug_assertions) {
            "**debug** (not representative: build with --release)"
        } else {
            "release"
        },
    );

    let rewrite = results
        .iter()
        .find(|(path, _)| *path == Path::Rewrite)
        .and_then(|(_, tally)| tally.mean());
    let mut table = Table::new(&[
        ("path", Align::Left),
        ("bodies", Align::Right),
        ("µs/body", Align::Right),
        ("p50 µs", Align::Right),
        ("p99 µs", Align::Right),
        ("samples/s", Align::Right),
        ("MB/s", Align::Right),
        ("time ÷ rewrite", Align::Right),
    ]);
    for (path, tally) in results {
        let mean = tally.mean();
        table.row(vec![
            path.label().to_string(),
            tally.bodies.to_string(),
            mean.map_or_else(|| "n/a".into(), |m| format!("{:.1}", micros(m))),
            quantile_micros(tally, 0.50),
            quantile_micros(tally, 0.99),
            tally
                .samples_per_second(batch.metrics)
                .map_or_else(|| "n/a".into(), |s| thousands(s.round() as u64)),
            mean.map_or_else(
                || "n/a".into(),
                |m| format!("{:.0}", batch.body.len() as f64 / 1e6 / m.as_secs_f64()),
            ),
            ratio(mean, rewrite),
        ]);
    }
    out.push_str(&table.render());

    let _ = writeln!(
        out,
        "\nPaths, each timed per body including freeing what it allocated:"
    );
    for (path, _) in results {
        let _ = writeln!(out, "- {}: {}", path.label(), path.describe());
    }
    let _ = writeln!(
        out,
        "\n`samples/s`: metric samples (metrics in the body × bodies) per second of the path's own \
         time. `time ÷ rewrite`: the path's mean time per body over the rewrite's."
    );
    let tally = |wanted: Path| {
        results
            .iter()
            .find(|(path, _)| *path == wanted)
            .map(|(_, tally)| tally)
    };
    if let (Some(rewrite), Some(value), Some(copy)) = (
        tally(Path::Rewrite).and_then(Tally::mean),
        tally(Path::SerdeValue).and_then(Tally::mean),
        tally(Path::Copy).and_then(Tally::mean),
    ) {
        let _ = writeln!(
            out,
            "\nPer body, the rewrite is {} a `serde_json::Value` round trip of the same body and \
             {} copying it.",
            compare(rewrite, value),
            compare(rewrite, copy),
        );
    }
    if let Some(rate) = tally(Path::Rewrite).and_then(|t| t.samples_per_second(batch.metrics)) {
        let verdict = if rate >= TARGET_SAMPLES_PER_SECOND {
            "met"
        } else {
            "**not met**"
        };
        let _ = writeln!(
            out,
            "\nTarget ≥ {} metric samples/s on one core: {verdict} ({} samples/s, {:.2}× the \
             target).",
            thousands(TARGET_SAMPLES_PER_SECOND as u64),
            thousands(rate.round() as u64),
            rate / TARGET_SAMPLES_PER_SECOND,
        );
    }
    if !verified.problems.is_empty() {
        let _ = writeln!(out, "\nProblems:");
        for problem in &verified.problems {
            let _ = writeln!(out, "- {problem}");
        }
    }
    out
}

/// `"2.00× faster than"` or `"3.10× slower than"`: `time` against `other`.
fn compare(time: Duration, other: Duration) -> String {
    let (time, other) = (time.as_secs_f64(), other.as_secs_f64());
    if time <= other {
        format!("{:.2}× faster than", other / time)
    } else {
        format!("{:.2}× slower than", time / other)
    }
}

fn micros(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e6
}

fn quantile_micros(tally: &Tally, quantile: f64) -> String {
    if tally.nanos.is_empty() {
        return "n/a".into();
    }
    format!(
        "{:.1}",
        tally.nanos.value_at_quantile(quantile) as f64 / 1_000.0
    )
}

/// `value ÷ base` as `1.00×`; "n/a" without either.
fn ratio(value: Option<Duration>, base: Option<Duration>) -> String {
    match (value, base) {
        (Some(value), Some(base)) if !base.is_zero() => {
            format!("{:.2}×", value.as_secs_f64() / base.as_secs_f64())
        }
        _ => "n/a".into(),
    }
}

/// `1234567` as `1,234,567`.
pub(crate) fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The first `model name` of `/proc/cpuinfo`.
fn cpu_model() -> Option<String> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    cpuinfo
        .lines()
        .find(|line| line.starts_with("model name"))
        .and_then(|line| line.split_once(':'))
        .map(|(_, model)| model.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tally(nanos_per_body: u64, bodies: u64) -> Tally {
        let mut tally = Tally::new();
        for _ in 0..bodies {
            tally.record(Duration::from_nanos(nanos_per_body));
        }
        tally
    }

    #[test]
    fn the_report_compares_every_path_with_the_rewrite_and_judges_the_target() {
        let batch = super::super::batch::mlflow_log_batch(1000);
        let verified = Verified {
            keys_rewritten: batch.system_metrics,
            problems: Vec::new(),
        };
        let facts = RunFacts {
            command_line: "mlscope-bench rewrite --duration 5s".into(),
            rounds: 5,
            slice: Duration::from_secs(1),
            warmup: Duration::from_secs(1),
        };
        let results = vec![
            (Path::Rewrite, tally(500_000, 10)),
            (Path::SerdeValue, tally(1_000_000, 10)),
            (Path::Copy, tally(10_000, 10)),
        ];
        let report = render(&facts, &batch, &verified, &results);
        assert!(
            report.contains("```sh\nmlscope-bench rewrite --duration 5s\n```"),
            "{report}"
        );
        assert!(
            report.contains("| mlscope-proxy rewrite | 10 | 500.0 | 500.2 | 500.2 | 2,000,000 |"),
            "{report}"
        );
        assert!(report.contains("| 2.00× |"), "{report}");
        assert!(report.contains("| 0.02× |"), "{report}");
        assert!(
            report.contains(
                "the rewrite is 2.00× faster than a `serde_json::Value` round trip of the same \
                 body and 50.00× slower than copying it"
            ),
            "{report}"
        );
        assert!(
            report.contains("on one core: met (2,000,000 samples/s, 2.00× the target)"),
            "{report}"
        );
    }

    #[test]
    fn large_numbers_get_thousands_separators() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(12_345_678), "12,345,678");
    }
}
