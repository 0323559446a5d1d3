//! `mlscope-bench passthrough`: what a request pays for going through nginx or mlscope-proxy
//! instead of straight to MLflow, at request rates MLflow sustains. With `--system-metrics`, the
//! log-batch bodies carry one rank's system metrics, which mlscope-proxy rewrites and deduplicates,
//! and a second mlscope-proxy with scoping off shows what that work adds to plain forwarding.
//!
//! For each endpoint and rate the measured time is cut into short slices and the targets take
//! turns, slice by slice, with the order rotated every round. Everything that drifts during a run
//! (the SQLite file growing, page cache, other processes on a 2-core machine) then drifts for every
//! target alike, which a run of "all of direct, then all of nginx, then all of the proxy" cannot
//! promise.

mod breakdown;
mod open_loop;
mod report;
mod workload;

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;

use crate::cli::{Endpoint, PassthroughArgs};
use crate::mlflow;
use crate::progress;
use crate::stack::{BenchStack, TargetKind};
use crate::Report;
use open_loop::{Measurements, OpenLoop};
use workload::{BatchContent, Workload};

/// What the report needs to know about the setting besides the numbers.
pub(crate) struct RunFacts {
    pub(crate) command_line: String,
    pub(crate) mlflow_version: Option<String>,
    pub(crate) content: BatchContent,
    pub(crate) rounds: usize,
    pub(crate) slice: Duration,
}

/// Measurements per (endpoint, rate, target).
type Results = BTreeMap<(Endpoint, u32, TargetKind), Measurements>;

/// The proxy's own request log per (endpoint, rate): where its time went.
type Breakdowns = BTreeMap<(Endpoint, u32), breakdown::Breakdown>;

/// Longest wait for the proxy's request lines of a measured stretch to reach its log.
const LOG_WAIT: Duration = Duration::from_secs(5);

/// Runs the benchmark against `stack`. Failed requests make the run a failure: latency compared
/// across targets means little when one of them was answering errors.
pub(crate) async fn run(
    args: &PassthroughArgs,
    stack: &BenchStack,
    command_line: &str,
) -> anyhow::Result<Report> {
    let targets = stack.targets();
    let direct = targets
        .iter()
        .find(|t| t.kind == TargetKind::Direct)
        .context("no direct target")?;
    let experiment_name = format!("mlscope-bench-{}", uuid::Uuid::new_v4());
    let experiment_id = mlflow::create_experiment(direct, &experiment_name).await?;
    let content = BatchContent::new(args.system_metrics, args.metrics_per_request);
    let mut workloads = Vec::with_capacity(targets.len());
    for target in &targets {
        workloads
            .push(Workload::prepare(target, &experiment_id, &content, args.max_in_flight).await?);
    }

    let rates = args.sorted_rates();
    let endpoints = args.sorted_endpoints();
    let slices = split_into_slices(args.duration, args.slice);
    let planned = planned_load_time(args, targets.len());
    let bar = progress::timed_bar(planned);
    let mut results = Results::new();
    let mut breakdowns = Breakdowns::new();
    let proxy_log = stack.proxy_log_path().to_path_buf();

    for &endpoint in &endpoints {
        if !args.warmup.is_zero() {
            for (target, workload) in targets.iter().zip(&workloads) {
                bar.set_message(format!(
                    "warm-up {} via {}",
                    endpoint_name(endpoint),
                    target.kind
                ));
                let mut discarded = Measurements::new();
                fixed_rate(args, rates[0], args.warmup)
                    .run(|_| workload.request(endpoint), &mut discarded)
                    .await;
                bar.inc(millis(args.warmup));
            }
        }
        for &rate in &rates {
            let log_from = breakdown::log_size(&proxy_log);
            let since = std::time::SystemTime::now();
            for (round, &slice) in slices.iter().enumerate() {
                for turn in 0..targets.len() {
                    let index = target_of_turn(round, turn, targets.len());
                    let (target, workload) = (&targets[index], &workloads[index]);
                    bar.set_message(format!(
                        "{} {rate} req/s via {} (round {}/{})",
                        endpoint_name(endpoint),
                        target.kind,
                        round + 1,
                        slices.len()
                    ));
                    let measured =
                        results
                            .entry((endpoint, rate, target.kind))
                            .or_insert_with(|| match args.samples_out {
                                Some(_) => Measurements::keeping_samples(),
                                None => Measurements::new(),
                            });
                    fixed_rate(args, rate, slice)
                        .run(|_| workload.request(endpoint), measured)
                        .await;
                    bar.inc(millis(slice));
                }
            }
            // The proxy writes its request lines in batches, within its log flush interval
            // (100 ms unless configured): read until every request it answered is there, or
            // until LOG_WAIT has passed (the report then counts the lines it found).
            let answered = results
                .get(&(endpoint, rate, TargetKind::Proxy))
                .map_or(0, Measurements::successes);
            let waited = std::time::Instant::now();
            let found = loop {
                let mut found = breakdown::Breakdown::new();
                found
                    .read(&proxy_log, log_from, endpoint_path(endpoint), since)
                    .with_context(|| format!("reading the proxy's log {}", proxy_log.display()))?;
                if found.requests() >= answered || waited.elapsed() >= LOG_WAIT {
                    break found;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            breakdowns.insert((endpoint, rate), found);
        }
    }
    bar.finish_and_clear();

    if let Some(path) = &args.samples_out {
        write_samples(path, &results)
            .with_context(|| format!("writing the samples to {}", path.display()))?;
    }
    let facts = RunFacts {
        command_line: command_line.to_string(),
        mlflow_version: mlflow::version(direct).await,
        content,
        rounds: slices.len(),
        slice: slices.first().copied().unwrap_or(args.slice),
    };
    let problems = results
        .iter()
        .filter(|(_, measured)| measured.errors.total() > 0)
        .map(|((endpoint, rate, kind), measured)| {
            format!(
                "{} at {rate} req/s via {kind}: {}",
                endpoint_name(*endpoint),
                measured.errors.describe()
            )
        })
        .collect();
    Ok(Report {
        markdown: report::render(args, &facts, &results, &breakdowns),
        problems,
    })
}

/// Every successful request of the run as one CSV line:
/// `endpoint,rate,target,slice,order,sequence,micros,released_us`. `slice` is the target's own
/// slice (its round), `order` the slice's place in time among every target's slices of that
/// endpoint and rate (the targets take turns in the order [`run`] rotates them), `sequence` the
/// request's place in its slice's schedule, `released_us` when its latency started on the
/// system's monotonic clock.
fn write_samples(path: &std::path::Path, results: &Results) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(
        out,
        "endpoint,rate,target,slice,order,sequence,micros,released_us"
    )?;
    for ((endpoint, rate, kind), measured) in results {
        // The targets in the order `run` had them (by kind, as the results are).
        let kinds: Vec<TargetKind> = results
            .keys()
            .filter(|(e, r, _)| e == endpoint && r == rate)
            .map(|&(_, _, k)| k)
            .collect();
        let n = kinds.len();
        let index = kinds.iter().position(|k| k == kind).unwrap_or(0);
        for sample in measured.samples.iter().flatten() {
            let round = sample.slice as usize;
            let turn = (0..n)
                .find(|&turn| target_of_turn(round, turn, n) == index)
                .unwrap_or(0);
            writeln!(
                out,
                "{},{rate},{},{},{},{},{},{}",
                endpoint_name(*endpoint),
                kind.slug(),
                sample.slice,
                round * n + turn,
                sample.sequence,
                sample.micros,
                sample.released_us
            )?;
        }
    }
    out.flush()
}

/// Which of `n` targets (in kind order) has turn `turn` of round `round`: the order rotates by
/// one every round.
fn target_of_turn(round: usize, turn: usize, n: usize) -> usize {
    (round + turn) % n
}

fn fixed_rate(args: &PassthroughArgs, rate: u32, duration: Duration) -> OpenLoop {
    OpenLoop {
        rate,
        duration,
        max_in_flight: args.max_in_flight,
        request_timeout: args.request_timeout,
    }
}

/// Splits `total` into equal slices no longer than `slice`: 20 s by 5 s gives four of 5 s,
/// 6 s by 5 s two of 3 s (equal slices keep every round's weight the same).
fn split_into_slices(total: Duration, slice: Duration) -> Vec<Duration> {
    let rounds = (total.as_secs_f64() / slice.as_secs_f64()).ceil().max(1.0) as u32;
    vec![total / rounds; rounds as usize]
}

/// Load time the run will generate, for the progress bar (start-up and draining not included).
fn planned_load_time(args: &PassthroughArgs, targets: usize) -> Duration {
    let per_endpoint =
        args.warmup * targets as u32 + args.duration * (targets * args.sorted_rates().len()) as u32;
    per_endpoint * args.sorted_endpoints().len() as u32
}

pub(crate) fn endpoint_name(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::LogBatch => "log-batch",
        Endpoint::RunsGet => "runs/get",
    }
}

/// The path of an endpoint's requests (as the workload sends them and the proxy logs them).
pub(crate) fn endpoint_path(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::LogBatch => "/api/2.0/mlflow/runs/log-batch",
        Endpoint::RunsGet => "/api/2.0/mlflow/runs/get",
    }
}

fn millis(duration: Duration) -> u64 {
    duration.as_millis() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each sample's `order` is its slice's place in time: round by round, the targets in the
    /// rotated order the run gave them their turns.
    #[test]
    fn samples_are_written_with_their_slices_place_in_time() {
        let mut results = Results::new();
        let kinds = [TargetKind::Direct, TargetKind::Nginx, TargetKind::Proxy];
        for kind in kinds {
            let mut measured = Measurements::keeping_samples();
            for round in 0..3 {
                measured.samples.as_mut().unwrap().push(open_loop::Sample {
                    slice: round,
                    sequence: 0,
                    micros: 100,
                    released_us: 1_000 + u64::from(round),
                });
            }
            results.insert((Endpoint::RunsGet, 50, kind), measured);
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("samples.csv");
        write_samples(&path, &results).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(
            text.lines().next(),
            Some("endpoint,rate,target,slice,order,sequence,micros,released_us")
        );
        // Each line ends in its send time on the monotonic clock.
        let mut sent: Vec<&str> = text
            .lines()
            .skip(1)
            .filter_map(|l| l.rsplit(',').next())
            .collect();
        sent.sort_unstable();
        sent.dedup();
        assert_eq!(sent, ["1000", "1001", "1002"]);
        let mut order: Vec<(u64, String)> = text
            .lines()
            .skip(1)
            .map(|line| {
                let cells: Vec<&str> = line.split(',').collect();
                (cells[4].parse().unwrap(), cells[2].to_owned())
            })
            .collect();
        order.sort();
        let targets: Vec<&str> = order.iter().map(|(_, t)| t.as_str()).collect();
        // Round 0: 0 1 2; round 1: 1 2 0; round 2: 2 0 1 (`(round + turn) % 3`).
        assert_eq!(
            targets,
            [
                "direct",
                "nginx",
                "mlscope-proxy",
                "nginx",
                "mlscope-proxy",
                "direct",
                "mlscope-proxy",
                "direct",
                "nginx"
            ]
        );
        assert_eq!(
            order.iter().map(|(o, _)| *o).collect::<Vec<_>>(),
            (0..9).collect::<Vec<_>>()
        );
    }

    #[test]
    fn slices_divide_the_duration_evenly() {
        assert_eq!(
            split_into_slices(Duration::from_secs(20), Duration::from_secs(5)),
            vec![Duration::from_secs(5); 4]
        );
        assert_eq!(
            split_into_slices(Duration::from_secs(6), Duration::from_secs(5)),
            vec![Duration::from_secs(3); 2]
        );
        assert_eq!(
            split_into_slices(Duration::from_secs(2), Duration::from_secs(5)),
            vec![Duration::from_secs(2)]
        );
    }
}
