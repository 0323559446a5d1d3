//! The figures of a run's report, from what the store keeps (ranks, their series and histograms,
//! the bill, the verdict), and the advice they support. Pure: no I/O.
//!
//! Advice thresholds (docs/run-report.md lists them):
//! - memory: a limit is **oversized** when the peak working set plus `MEMORY_HEADROOM` fits in a
//!   size at most `OVERSIZED` of it; a peak of `NEAR_LIMIT` of the limit or more is **close**;
//! - CPU: a mean below `CPU_UNDERUSED` of a limit of two cores or more is **underused**; a mean
//!   throttled share of `THROTTLED` or more says the limit holds the job back;
//! - GPUs: idle `GPU_IDLE_SHARE` of the GPU time or more is said, with the longest stretch in which
//!   the rank's mean activity stayed below `GPU_IDLE_BELOW`; a rank whose mean activity is below
//!   `STRAGGLER` of the ranks' median (of at least `STRAGGLER_MEDIAN_FLOOR`) is the odd one out.

use std::collections::BTreeMap;

use serde::Serialize;

use super::super::bill::RunBill;
use super::super::findings::{DataChange, Leftovers};
use super::super::judge::timestamp;
use super::super::store::RankRow;
use super::super::usage::{Bucket, RunSeries, Series};

pub const MEMORY_HEADROOM: f64 = 0.4;
pub const OVERSIZED: f64 = 0.75;
pub const NEAR_LIMIT: f64 = 0.9;
pub const CPU_UNDERUSED: f64 = 0.25;
pub const THROTTLED: f64 = 10.0;
pub const GPU_IDLE_SHARE: f64 = 0.1;
pub const GPU_IDLE_BELOW: f64 = 5.0;
pub const STRAGGLER: f64 = 0.7;
pub const STRAGGLER_MEDIAN_FLOOR: f64 = 20.0;
/// Idle buckets this close (or three buckets) are one idle stretch: a few sampling intervals.
const IDLE_GAP_MS: i64 = 30_000;

/// Bytes in the collector's megabyte (MLflow's unit: 10^6).
const MB: f64 = 1e6;
const GIB: f64 = (1u64 << 30) as f64;

/// The report of one run.
#[derive(Debug, Serialize)]
pub struct RunReport {
    pub run_id: String,
    pub run_name: Option<String>,
    /// MLflow's status of the run.
    pub status: Option<String>,
    /// How it ended, as run health judged it (`oom_killed`, `lost`...), and why.
    pub outcome: Option<String>,
    pub outcome_detail: Option<String>,
    pub live: bool,
    pub start: Option<String>,
    pub end: Option<String>,
    pub wall_seconds: Option<f64>,
    pub generated: String,
    /// The summary line (`mlscope.summary`).
    pub summary: String,
    pub advice: Vec<String>,
    pub ranks: Vec<RankReport>,
    /// Senders of system metrics that named no rank (MLflow's own monitor, for one): not ranks,
    /// not in the figures.
    pub unidentified_writers: usize,
    pub gpu: Option<GpuTotals>,
    pub data_changes: Vec<DataChange>,
    /// The run's start (unix ms) that the charts count time from.
    pub chart_origin_ms: i64,
}

#[derive(Debug, Serialize)]
pub struct RankReport {
    pub node: String,
    pub rank: i64,
    pub pod: Option<String>,
    /// Other ranks of the run on the same node.
    pub co_located: Vec<i64>,
    pub first_sample: Option<String>,
    pub last_sample: Option<String>,
    pub wall_seconds: Option<f64>,
    pub outcome: Option<String>,
    pub exit_code: Option<i64>,
    pub memory: Option<MemoryFigures>,
    pub cpu: Option<CpuFigures>,
    pub gpu: Option<GpuFigures>,
    /// The kernel's OOM kills in the container (`container_oom_kill_count`), and when the first
    /// one was seen.
    pub oom_kills: Option<f64>,
    pub oom_at_ms: Option<i64>,
    pub leftovers: Option<Leftovers>,
    /// Series for the charts: memory working set (MB), GPU activity (%), CPU (% of the limit).
    pub charts: RankCharts,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct RankCharts {
    pub memory: Vec<Point>,
    pub gpu: Vec<Point>,
    pub cpu: Vec<Point>,
}

/// One bucket of a chart: its start, mean and peak.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Point {
    pub t_ms: i64,
    pub mean: f64,
    pub peak: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct MemoryFigures {
    pub limit_mb: Option<f64>,
    pub peak_mb: f64,
    pub peak_at: String,
    pub peak_ms: i64,
    /// The run's step when the peak came (the highest step it had logged by then).
    pub peak_step: Option<i64>,
    pub p95_mb: Option<f64>,
    pub mean_mb: f64,
    /// Peak over limit.
    pub peak_fraction: Option<f64>,
    pub samples: i64,
}

#[derive(Debug, Clone, Serialize)]
pub struct CpuFigures {
    pub limit_cores: Option<f64>,
    /// Mean and peak (of the chart's buckets' means) of the used share of the limit, in %.
    pub mean_percent: f64,
    pub peak_percent: f64,
    pub throttled_percent: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct GpuFigures {
    pub gpus: i64,
    pub model: Option<String>,
    /// `sm_active` (GPM's SM activity) or `utilization` (a kernel ran).
    pub measure: &'static str,
    pub activity_mean_percent: Option<f64>,
    pub gpu_hours: f64,
    pub idle_hours: f64,
    /// The longest stretch with activity below `GPU_IDLE_BELOW`: (from, to), unix ms.
    pub idle_stretch_ms: Option<(i64, i64)>,
}

#[derive(Debug, Clone, Serialize)]
pub struct GpuTotals {
    pub gpu_hours: f64,
    pub idle_hours: f64,
    pub idle_fraction: f64,
    pub busy_percent: Option<f64>,
}

/// What the report is built from.
pub struct Inputs<'a> {
    pub run_id: &'a str,
    pub run_name: Option<String>,
    pub status: Option<String>,
    pub start_ms: Option<i64>,
    pub end_ms: Option<i64>,
    pub live: bool,
    pub now_ms: i64,
    pub outcome: Option<String>,
    pub outcome_detail: Option<String>,
    pub ranks: &'a [RankRow],
    /// By (node, rank, series): merged buckets.
    pub series: &'a RunSeries,
    /// Memory histograms by (node, rank).
    pub histograms: &'a BTreeMap<(String, i64), Vec<(i32, i64)>>,
    pub bill: &'a RunBill,
    pub data_changes: Vec<DataChange>,
    pub leftovers: &'a dyn Fn(&str, i64) -> Option<Leftovers>,
}

pub fn build(inputs: Inputs<'_>) -> RunReport {
    let ranks: Vec<&RankRow> = inputs.ranks.iter().filter(|r| r.rank >= 0).collect();
    let unidentified_writers = inputs.ranks.len() - ranks.len();
    let steps = inputs.series.get(&(String::new(), -1, Series::Step));
    let get = |r: &RankRow, s: Series| inputs.series.get(&(r.node.clone(), r.rank, s));
    let mut reports = Vec::new();
    for r in &ranks {
        let bill = inputs
            .bill
            .ranks
            .iter()
            .find(|b| b.node == r.node && b.rank == r.rank);
        let memory = get(r, Series::Memory).and_then(|(_, buckets)| {
            let (peak, samples, total) = totals(buckets)?;
            let histogram = inputs.histograms.get(&(r.node.clone(), r.rank));
            let limit = r.memory_limit_mb;
            Some(MemoryFigures {
                limit_mb: limit,
                peak_mb: peak.peak,
                peak_at: timestamp(peak.peak_ms),
                peak_ms: peak.peak_ms,
                peak_step: steps.and_then(|(_, s)| step_at(s, peak.peak_ms)),
                p95_mb: histogram.and_then(|h| super::super::usage::quantile(h, 0.95)),
                mean_mb: total / samples as f64,
                peak_fraction: limit.filter(|l| *l > 0.0).map(|l| peak.peak / l),
                samples,
            })
        });
        let cpu = get(r, Series::Cpu).and_then(|(_, buckets)| {
            let (_, samples, total) = totals(buckets)?;
            Some(CpuFigures {
                limit_cores: r.cpu_limit_cores,
                mean_percent: total / samples as f64,
                peak_percent: buckets.values().map(Bucket::mean).fold(0.0, f64::max),
                throttled_percent: get(r, Series::Throttled)
                    .and_then(|(_, b)| totals(b))
                    .map(|(_, n, t)| t / n as f64),
            })
        });
        let activity = get(r, Series::GpuSm)
            .map(|s| ("sm_active", s))
            .or_else(|| get(r, Series::GpuUtil).map(|s| ("utilization", s)));
        let gpus = r.gpus.max(bill.map_or(0, |b| b.gpus));
        let gpu = (gpus > 0 || activity.is_some()).then(|| GpuFigures {
            gpus,
            model: r.gpu_model.clone(),
            measure: activity.map_or("utilization", |(m, _)| m),
            activity_mean_percent: activity
                .and_then(|(_, (_, b))| totals(b))
                .map(|(_, n, t)| t / n as f64),
            gpu_hours: unsigned(bill.map_or(0.0, |b| b.gpu_seconds / 3600.0)),
            idle_hours: unsigned(bill.map_or(0.0, |b| b.idle_seconds / 3600.0)),
            idle_stretch_ms: activity.and_then(|(_, (width, b))| idle_stretch(b, *width)),
        });
        let oom = get(r, Series::OomKills);
        let oom_kills = oom.and_then(|(_, b)| totals(b)).map(|(p, _, _)| p.peak);
        let oom_at_ms = oom_moment(r, oom.map(|(_, b)| b));
        let chart = |s: Option<&(i64, BTreeMap<i64, Bucket>)>| -> Vec<Point> {
            s.map(|(_, b)| {
                b.iter()
                    .map(|(&t_ms, b)| Point {
                        t_ms,
                        mean: b.mean(),
                        peak: b.peak,
                    })
                    .collect()
            })
            .unwrap_or_default()
        };
        reports.push(RankReport {
            node: r.node.clone(),
            rank: r.rank,
            pod: r.pod.clone(),
            co_located: ranks
                .iter()
                .filter(|o| !r.node.is_empty() && o.node == r.node && o.rank != r.rank)
                .map(|o| o.rank)
                .collect(),
            first_sample: r.bill_first_ms.map(timestamp),
            last_sample: r.bill_last_ms.map(timestamp),
            wall_seconds: match (r.bill_first_ms, r.bill_last_ms) {
                (Some(a), Some(b)) if b >= a => Some((b - a) as f64 / 1e3),
                _ => None,
            },
            outcome: r.outcome.clone(),
            exit_code: r.exit_code,
            memory,
            cpu,
            gpu,
            oom_kills,
            oom_at_ms,
            leftovers: (inputs.leftovers)(&r.node, r.rank),
            charts: RankCharts {
                memory: chart(get(r, Series::Memory)),
                gpu: chart(activity.map(|(_, s)| s)),
                cpu: chart(get(r, Series::Cpu)),
            },
        });
    }
    let gpu = (inputs.bill.gpu_seconds > 0.0).then(|| {
        let means: Vec<f64> = reports
            .iter()
            .filter_map(|r| r.gpu.as_ref()?.activity_mean_percent)
            .collect();
        GpuTotals {
            gpu_hours: unsigned(inputs.bill.gpu_hours()),
            idle_hours: unsigned(inputs.bill.idle_hours()),
            idle_fraction: unsigned(inputs.bill.idle_fraction()),
            busy_percent: (!means.is_empty())
                .then(|| means.iter().sum::<f64>() / means.len() as f64),
        }
    });
    let end_ms = inputs.end_ms.or(inputs.live.then_some(inputs.now_ms));
    let chart_origin_ms = inputs
        .start_ms
        .or_else(|| ranks.iter().filter_map(|r| r.bill_first_ms).min())
        .unwrap_or(inputs.now_ms);
    let mut report = RunReport {
        run_id: inputs.run_id.to_owned(),
        run_name: inputs.run_name,
        status: inputs.status,
        outcome: inputs.outcome,
        outcome_detail: inputs.outcome_detail,
        live: inputs.live,
        start: inputs.start_ms.map(timestamp),
        end: inputs.end_ms.map(timestamp),
        wall_seconds: match (inputs.start_ms, end_ms) {
            (Some(a), Some(b)) if b >= a => Some((b - a) as f64 / 1e3),
            _ => None,
        },
        generated: timestamp(inputs.now_ms),
        summary: String::new(),
        advice: Vec::new(),
        ranks: reports,
        unidentified_writers,
        gpu,
        data_changes: inputs.data_changes,
        chart_origin_ms,
    };
    report.advice = advice(&report);
    report.summary = summary(&report);
    report
}

/// The peak bucket, the sample count and the sum of a series; `None` without samples.
fn totals(buckets: &BTreeMap<i64, Bucket>) -> Option<(Bucket, i64, f64)> {
    let mut all: Option<Bucket> = None;
    for b in buckets.values() {
        match &mut all {
            Some(a) => a.merge(b),
            None => all = Some(*b),
        }
    }
    all.filter(|a| a.n > 0).map(|a| (a, a.n, a.total))
}

/// The highest step the run had logged by `at_ms`, as far as its buckets tell: a bucket whose
/// highest step came after `at_ms` says nothing of when its lower steps came, so it is left out
/// (never a step the run had not reached; at most one bucket's steps short).
fn step_at(steps: &BTreeMap<i64, Bucket>, at_ms: i64) -> Option<i64> {
    steps
        .values()
        .filter(|b| b.peak_ms <= at_ms)
        .map(|b| b.peak)
        .fold(None, |max: Option<f64>, s| {
            Some(max.map_or(s, |m| m.max(s)))
        })
        .map(|s| s as i64)
}

/// When the rank was OOM-killed: its reported end, when its outcome says so; else the first
/// bucket in which the kernel's OOM-kill count rose.
fn oom_moment(rank: &RankRow, kills: Option<&BTreeMap<i64, Bucket>>) -> Option<i64> {
    if rank.outcome.as_deref() == Some("oom_killed") {
        if let Some(ended) = rank.ended_ms.or(rank.bill_last_ms) {
            return Some(ended);
        }
    }
    let kills = kills?;
    let first = kills.values().next()?.low;
    kills.values().find(|b| b.peak > first).map(|b| b.peak_ms)
}

/// The longest run of buckets whose mean activity is below `GPU_IDLE_BELOW`.
fn idle_stretch(buckets: &BTreeMap<i64, Bucket>, width: i64) -> Option<(i64, i64)> {
    let mut best: Option<(i64, i64)> = None;
    let mut current: Option<(i64, i64)> = None;
    // Samples come every few seconds: buckets apart by less than a few sampling intervals are
    // one stretch.
    let gap = (3 * width).max(IDLE_GAP_MS);
    for (&start, b) in buckets {
        if b.mean() < GPU_IDLE_BELOW {
            current = Some(match current {
                Some((from, to)) if start - to <= gap => (from, start + width),
                _ => (start, start + width),
            });
            let c = current.unwrap_or_default();
            if best.is_none_or(|(f, t)| c.1 - c.0 > t - f) {
                best = Some(c);
            }
        } else {
            current = None;
        }
    }
    best
}

/// `x` without a sign on zero (`-0.0` prints as such).
pub fn unsigned(x: f64) -> f64 {
    if x == 0.0 {
        0.0
    } else {
        x
    }
}

/// Megabytes (10^6 bytes) in GiB or MiB, one decimal.
pub fn size(mb: f64) -> String {
    let bytes = mb * MB;
    if bytes >= GIB {
        format!("{:.1} GiB", bytes / GIB)
    } else {
        format!("{:.0} MiB", bytes / (1u64 << 20) as f64)
    }
}

/// The smallest size a person would ask for that holds `mb` megabytes: a whole number of GiB from
/// the usual steps (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64...), or a multiple of 256 MiB below
/// 1 GiB. Written as Kubernetes writes it.
pub fn request_for(mb: f64) -> (f64, String) {
    let gib = mb * MB / GIB;
    if gib <= 1.0 {
        let mib = ((gib * 4.0).ceil().max(1.0)) * 256.0;
        if mib < 1024.0 {
            return (mib * (1u64 << 20) as f64 / MB, format!("{mib:.0}Mi"));
        }
    }
    let mut step = 1.0f64;
    loop {
        for m in [1.0, 1.5] {
            let candidate = step * m;
            if candidate >= gib {
                return (candidate * GIB / MB, format!("{candidate:.0}Gi"));
            }
        }
        step *= 2.0;
        if step > 1e9 {
            return (mb, format!("{gib:.0}Gi"));
        }
    }
}

/// GPU-hours with the precision a person reads: two decimals below 10.
pub fn gpu_hours(h: f64) -> String {
    if h < 10.0 {
        format!("{h:.2}")
    } else {
        format!("{h:.1}")
    }
}

fn percent(x: f64) -> String {
    format!("{:.0} %", x * 100.0)
}

/// Seconds as `1 h 02 min`, `12 min 5 s` or `40 s`.
pub fn duration(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as i64;
    if s >= 3600 {
        format!("{} h {:02} min", s / 3600, (s % 3600) / 60)
    } else if s >= 60 {
        format!("{} min {} s", s / 60, s % 60)
    } else {
        format!("{s} s")
    }
}

/// A moment as the time since the run's start (`+12 min 5 s`).
pub fn since(report: &RunReport, at_ms: i64) -> String {
    format!(
        "+{}",
        duration((at_ms - report.chart_origin_ms) as f64 / 1e3)
    )
}

fn grouped(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

/// Advice with its basis beside it.
fn advice(report: &RunReport) -> Vec<String> {
    let mut out = Vec::new();
    for r in &report.ranks {
        let Some(m) = &r.memory else { continue };
        let Some(limit) = m.limit_mb.filter(|l| *l > 0.0) else {
            continue;
        };
        let fraction = m.peak_mb / limit;
        let step = m
            .peak_step
            .map(|s| format!(", step {}", grouped(s)))
            .unwrap_or_default();
        if let (Some(oom), "oom_killed") = (r.oom_at_ms, r.outcome.as_deref().unwrap_or_default()) {
            out.push(format!(
                "rank {} peaked at {} of its {} memory limit ({}) at {}{step}, {} before it was OOM-killed at {}: give it more than {} or make it use less",
                r.rank,
                percent(fraction),
                size(limit),
                size(m.peak_mb),
                since(report, m.peak_ms),
                match oom - m.peak_ms {
                    ms if ms < 1_000 => "under a second".to_owned(),
                    ms => duration(ms as f64 / 1e3),
                },
                since(report, oom),
                size(limit)
            ));
        } else if fraction >= NEAR_LIMIT {
            out.push(format!(
                "rank {} peaked at {} of its {} memory limit ({}) at {}{step}: close to an OOM kill; raise the limit to at least {}",
                r.rank,
                percent(fraction),
                size(limit),
                size(m.peak_mb),
                since(report, m.peak_ms),
                request_for(m.peak_mb * (1.0 + MEMORY_HEADROOM)).1
            ));
        } else {
            let (request_mb, request) = request_for(m.peak_mb * (1.0 + MEMORY_HEADROOM));
            if request_mb <= limit * OVERSIZED {
                out.push(format!(
                    "rank {}: peak working set {} of a {} limit (p95 {}): {} would have held the peak with {} headroom",
                    r.rank,
                    size(m.peak_mb),
                    size(limit),
                    m.p95_mb.map_or("unknown".into(), size),
                    request,
                    percent(MEMORY_HEADROOM)
                ));
            }
        }
    }
    for r in &report.ranks {
        let Some(c) = &r.cpu else { continue };
        if let Some(throttled) = c.throttled_percent.filter(|t| *t >= THROTTLED) {
            out.push(format!(
                "rank {} was CPU-throttled in {throttled:.0} % of its scheduling periods (limit {} cores): raise the CPU limit or run fewer threads",
                r.rank,
                c.limit_cores.map_or("unknown".into(), |l| format!("{l}"))
            ));
        } else if let Some(limit) = c.limit_cores.filter(|l| *l >= 2.0) {
            if c.mean_percent / 100.0 < CPU_UNDERUSED {
                let need = (limit * c.peak_percent / 100.0 * 1.25).ceil().max(1.0);
                if need < limit {
                    out.push(format!(
                        "rank {} used on average {:.1} of its {limit} CPU cores ({:.0} %, busiest stretch {:.0} %): {need} cores would do",
                        r.rank,
                        limit * c.mean_percent / 100.0,
                        c.mean_percent,
                        c.peak_percent
                    ));
                }
            }
        }
    }
    if let Some(g) = &report.gpu {
        if g.idle_fraction >= GPU_IDLE_SHARE {
            let stretch = report
                .ranks
                .iter()
                .filter_map(|r| r.gpu.as_ref()?.idle_stretch_ms)
                .max_by_key(|(a, b)| b - a)
                .map(|(a, b)| {
                    format!(
                        "; the longest idle stretch ran from {} to {} (activity below {GPU_IDLE_BELOW} %)",
                        since(report, a),
                        since(report, b)
                    )
                })
                .unwrap_or_default();
            out.push(format!(
                "GPUs idle {} of the run ({} of {} GPU-hours){stretch}",
                percent(g.idle_fraction),
                gpu_hours(g.idle_hours),
                gpu_hours(g.gpu_hours)
            ));
        }
        let mut means: Vec<(i64, f64)> = report
            .ranks
            .iter()
            .filter_map(|r| Some((r.rank, r.gpu.as_ref()?.activity_mean_percent?)))
            .collect();
        if means.len() >= 2 {
            let mut sorted: Vec<f64> = means.iter().map(|(_, m)| *m).collect();
            sorted.sort_by(f64::total_cmp);
            let median = sorted[sorted.len() / 2];
            means.sort_by_key(|(rank, _)| *rank);
            for (rank, mean) in means {
                if median >= STRAGGLER_MEDIAN_FLOOR && mean < STRAGGLER * median {
                    out.push(format!(
                        "rank {rank}'s GPUs were busy {mean:.0} % against the ranks' median of {median:.0} %: a straggler, or a data loader that starves it"
                    ));
                }
            }
        }
    }
    out
}

/// The one line of `mlscope.summary`.
fn summary(report: &RunReport) -> String {
    let mut parts = Vec::new();
    let n = report.ranks.len();
    parts.push(format!("{n} rank{}", if n == 1 { "" } else { "s" }));
    let top = report
        .ranks
        .iter()
        .filter_map(|r| Some((r, r.memory.as_ref()?)))
        .max_by(|(_, a), (_, b)| {
            let key = |m: &MemoryFigures| m.peak_fraction.unwrap_or(0.0);
            key(a)
                .total_cmp(&key(b))
                .then(a.peak_mb.total_cmp(&b.peak_mb))
        });
    if let Some((r, m)) = top {
        let of = m
            .limit_mb
            .map(|l| format!(" of {}", size(l)))
            .unwrap_or_default();
        let step = m
            .peak_step
            .map(|s| format!(", at step {}", grouped(s)))
            .unwrap_or_default();
        parts.push(format!(
            "peak memory {}{of} (rank {}{step})",
            size(m.peak_mb),
            r.rank
        ));
    }
    if let Some(g) = &report.gpu {
        let busy = g
            .busy_percent
            .map(|b| format!("GPUs {b:.0} % busy, "))
            .unwrap_or_else(|| "GPUs: ".into());
        parts.push(format!(
            "{busy}{} of {} GPU-hours idle",
            gpu_hours(g.idle_hours),
            gpu_hours(g.gpu_hours)
        ));
    }
    if report.live {
        parts.push("running".into());
    } else {
        let mut ended = format!(
            "ended {}",
            report.status.as_deref().unwrap_or("(status unknown)")
        );
        if let Some(outcome) = &report.outcome {
            ended.push(' ');
            ended.push_str(outcome);
            let which: Vec<String> = report
                .ranks
                .iter()
                .filter(|r| r.outcome.as_deref() == Some(outcome.as_str()))
                .map(|r| r.rank.to_string())
                .collect();
            if !which.is_empty() && which.len() < n {
                ended.push_str(&format!(
                    " (rank{} {})",
                    if which.len() == 1 { "" } else { "s" },
                    which.join(", ")
                ));
            }
        }
        parts.push(ended);
    }
    parts.join(" · ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_the_sizes_people_ask_for() {
        let gib = GIB / MB;
        assert_eq!(request_for(11.2 * gib * 1.4).1, "16Gi");
        assert_eq!(request_for(4.0 * gib).1, "4Gi");
        assert_eq!(request_for(4.1 * gib).1, "6Gi");
        assert_eq!(request_for(100.0).1, "256Mi");
        assert_eq!(request_for(600.0).1, "768Mi");
        assert_eq!(size(64.0 * gib), "64.0 GiB");
        assert_eq!(size(100.0), "95 MiB");
        assert_eq!(grouped(41_200), "41,200");
        assert_eq!(duration(3725.0), "1 h 02 min");
        assert_eq!(unsigned(-0.0).to_string(), "0");
    }

    /// Two ranks on one node, 64 GiB limits: rank 0 peaks at 11.2 GiB, rank 1 at 98 % of its limit
    /// 40 s before it is OOM-killed; the run logged step 41,200 by rank 1's peak.
    #[test]
    fn a_report_says_what_peaked_when_and_what_to_ask_for() {
        let gib = GIB / MB;
        let limit = 64.0 * gib;
        let t0 = 1_700_000_000_000i64;
        let rank = |r: i64, outcome: Option<&str>, ended: Option<i64>| RankRow {
            run_id: "run".into(),
            node: "node-a".into(),
            rank: r,
            memory_limit_mb: Some(limit),
            outcome: outcome.map(str::to_owned),
            ended_ms: ended,
            bill_first_ms: Some(t0),
            bill_last_ms: Some(t0 + 600_000),
            ..RankRow::default()
        };
        let oom_at = t0 + 540_000;
        let ranks = [
            rank(0, Some("exited"), Some(t0 + 600_000)),
            rank(1, Some("oom_killed"), Some(oom_at)),
            RankRow {
                run_id: "run".into(),
                rank: -1,
                ..RankRow::default()
            },
        ];
        let memory = |peak: f64, at: i64| {
            let mut b: BTreeMap<i64, Bucket> = BTreeMap::new();
            b.insert(t0, Bucket::of(0.5 * peak, t0));
            b.insert(at, Bucket::of(peak, at));
            (1_000, b)
        };
        let mut series = RunSeries::new();
        series.insert(
            ("node-a".into(), 0, Series::Memory),
            memory(11.2 * gib, t0 + 100_000),
        );
        series.insert(
            ("node-a".into(), 1, Series::Memory),
            memory(0.98 * limit, oom_at - 40_000),
        );
        let mut steps = BTreeMap::new();
        steps.insert(t0 + 400_000, Bucket::of(41_200.0, oom_at - 50_000));
        steps.insert(t0 + 520_000, Bucket::of(45_000.0, oom_at - 10_000));
        series.insert((String::new(), -1, Series::Step), (1_000, steps));
        let histograms = BTreeMap::new();
        let bill = RunBill::default();
        let report = build(Inputs {
            run_id: "run",
            run_name: Some("train".into()),
            status: Some("FAILED".into()),
            start_ms: Some(t0),
            end_ms: Some(t0 + 600_000),
            live: false,
            now_ms: t0 + 700_000,
            outcome: Some("oom_killed".into()),
            outcome_detail: None,
            ranks: &ranks,
            series: &series,
            histograms: &histograms,
            bill: &bill,
            data_changes: Vec::new(),
            leftovers: &|_, _| None,
        });
        assert_eq!(
            report.summary,
            "2 ranks · peak memory 62.7 GiB of 64.0 GiB (rank 1, at step 41,200) · ended FAILED oom_killed (rank 1)"
        );
        assert_eq!(report.unidentified_writers, 1);
        assert_eq!(report.ranks[0].co_located, [1]);
        assert_eq!(report.ranks[1].oom_at_ms, Some(oom_at));
        assert_eq!(
            report.advice,
            [
                "rank 0: peak working set 11.2 GiB of a 64.0 GiB limit (p95 unknown): 16Gi would have held the peak with 40 % headroom",
                "rank 1 peaked at 98 % of its 64.0 GiB memory limit (62.7 GiB) at +8 min 20 s, step 41,200, 40 s before it was OOM-killed at +9 min 0 s: give it more than 64.0 GiB or make it use less",
            ]
        );
        let page = super::super::render::html(&report);
        assert!(
            page.contains("<svg") && page.contains("rank 1 OOM-killed"),
            "{page}"
        );
        assert!(!page.contains("<script"), "{page}");
    }

    #[test]
    fn the_idle_stretch_is_the_longest_run_of_idle_buckets() {
        let b = |mean: f64| Bucket::of(mean, 0);
        let buckets: BTreeMap<i64, Bucket> = [
            (0, b(0.0)),
            (10, b(1.0)),
            (20, b(90.0)),
            (30, b(0.0)),
            (40, b(0.0)),
            (50, b(2.0)),
            (70, b(0.0)),
        ]
        .into_iter()
        .collect();
        // With samples seconds apart, idle buckets a few intervals apart are one stretch.
        assert_eq!(idle_stretch(&buckets, 10), Some((30, 80)));
        let apart: BTreeMap<i64, Bucket> = [
            (0, b(0.0)),
            (10_000, b(1.0)),
            (20_000, b(90.0)),
            (100_000, b(0.0)),
            (120_000, b(0.0)),
            (140_000, b(2.0)),
            (200_000, b(0.0)),
        ]
        .into_iter()
        .collect();
        assert_eq!(idle_stretch(&apart, 1_000), Some((100_000, 141_000)));
    }
}
