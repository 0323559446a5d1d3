//! `mlscope-bench rewrite`: the proxy's system-metric rewrite engine alone, in process, on one
//! thread — no sockets, no MLflow — so its own cost per metric sample is visible.
//!
//! Next to it, on the same body and in the same run: a plain `serde_json::Value` parse and
//! serialize (what a naive proxy that edits JSON does before it even renames a key) and a byte copy
//! (the floor: what forwarding the body untouched costs). The paths take turns round by round, like
//! the targets of `passthrough`, so drift (CPU clock, the other processes on the machine) hits all
//! of them alike.

mod batch;
mod report;

use std::hint::black_box;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use axum::body::Body;
use axum::extract::Request;
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::BodyExt as _;
use mlscope_proxy::capabilities::health::Health;
use mlscope_proxy::capabilities::rewrite::body::Endpoint;
use mlscope_proxy::capabilities::rewrite::{MetricsRewriter, Outgoing, ScopeConfig};
use mlscope_proxy::plumbing::proxy::Forwarder;
use mlscope_proxy::plumbing::store::Store;
use mlscope_proxy::plumbing::telemetry::Metrics;
use serde_json::Value;
use tokio::time::Instant;

use crate::cli::RewriteArgs;
use crate::progress;
use crate::Report;
use batch::Batch;

/// Longest round: each path runs at most this long before the next one takes its turn.
const ROUND: Duration = Duration::from_secs(1);
/// The path the proxy sees log-batch requests on.
const LOG_BATCH_PATH: &str = "/api/2.0/mlflow/runs/log-batch";
/// Slowest single body the histograms hold, in nanoseconds.
const MAX_TRACKABLE_NANOS: u64 = 60_000_000_000;

/// What is done with each body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Path {
    /// `MetricsRewriter::prepare` (dedup off) and collecting the rewritten body.
    Rewrite,
    /// The same with run health on: the request's heartbeats read from the body and recorded
    /// (in memory, as the handler does after MLflow's answer).
    RewriteHeartbeats,
    /// `serde_json::from_slice::<Value>` and `serde_json::to_vec`.
    SerdeValue,
    /// Copying the bytes into a fresh buffer.
    Copy,
}

const PATHS: [Path; 4] = [
    Path::Rewrite,
    Path::RewriteHeartbeats,
    Path::SerdeValue,
    Path::Copy,
];

/// The rewriters the paths use: without and with heartbeats.
struct Engines {
    plain: MetricsRewriter,
    beating: MetricsRewriter,
    health: Health,
    /// Holds the health store's SQLite file.
    _dir: tempfile::TempDir,
}

/// Per-body times of one path, accumulated over rounds.
#[derive(Debug, Clone)]
pub(crate) struct Tally {
    pub(crate) nanos: Histogram<u64>,
    /// Sum of the per-body times.
    pub(crate) busy: Duration,
    pub(crate) bodies: u64,
}

/// What the check before the measurement found in the rewritten body.
#[derive(Debug, Clone)]
pub(crate) struct Verified {
    pub(crate) keys_rewritten: usize,
    pub(crate) problems: Vec<String>,
}

/// Runs the benchmark on a current-thread runtime: one thread, like one core of the proxy.
pub(crate) fn run(args: &RewriteArgs, command_line: &str) -> anyhow::Result<Report> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(measure(args, command_line))
}

async fn measure(args: &RewriteArgs, command_line: &str) -> anyhow::Result<Report> {
    let batch = batch::mlflow_log_batch(args.metrics);
    let engines = Engines::new().await?;
    let rewriter = &engines;
    let verified = verify(&engines.plain, &batch).await?;
    let beats = verify(&engines.beating, &batch).await?;
    let mut verified = verified;
    verified.problems.extend(beats.problems);

    let rounds = (args.duration.as_secs_f64() / ROUND.as_secs_f64())
        .ceil()
        .max(1.0) as u32;
    let slice = args.duration / rounds;
    let planned = (args.warmup + args.duration) * PATHS.len() as u32;
    let bar = progress::timed_bar(planned);
    // The bar moves between slices only: no ticker thread beside the measured one.
    bar.disable_steady_tick();

    let mut tallies: Vec<Tally> = PATHS.iter().map(|_| Tally::new()).collect();
    if !args.warmup.is_zero() {
        for path in PATHS {
            bar.set_message(format!("warm-up {}", path.label()));
            let mut discarded = Tally::new();
            run_slice(
                path,
                rewriter,
                &batch.body,
                args.warmup,
                u64::MAX,
                &mut discarded,
            )
            .await?;
            bar.inc(args.warmup.as_millis() as u64);
        }
    }
    for round in 0..rounds {
        for turn in 0..PATHS.len() {
            let index = (round as usize + turn) % PATHS.len();
            let path = PATHS[index];
            bar.set_message(format!("{} (round {}/{rounds})", path.label(), round + 1));
            let quota = match args.iterations {
                // What is left, spread evenly over the rounds still to come.
                Some(total) => {
                    let left = total.saturating_sub(tallies[index].bodies);
                    left.div_ceil(u64::from(rounds - round))
                }
                None => u64::MAX,
            };
            run_slice(
                path,
                rewriter,
                &batch.body,
                slice,
                quota,
                &mut tallies[index],
            )
            .await?;
            bar.inc(slice.as_millis() as u64);
        }
    }
    bar.finish_and_clear();

    let facts = report::RunFacts {
        command_line: command_line.to_string(),
        rounds,
        slice,
        warmup: args.warmup,
    };
    let results: Vec<(Path, Tally)> = PATHS.into_iter().zip(tallies).collect();
    Ok(Report {
        markdown: report::render(&facts, &batch, &verified, &results),
        problems: verified.problems,
    })
}

/// Sends `body` through `path` again and again until `slice` has passed or `quota` bodies are
/// done, adding each body's time to `into`.
async fn run_slice(
    path: Path,
    rewriter: &Engines,
    body: &Bytes,
    slice: Duration,
    quota: u64,
    into: &mut Tally,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + slice;
    let mut done = 0;
    while done < quota && Instant::now() < deadline {
        let elapsed = one_body(path, rewriter, body).await?;
        into.record(elapsed);
        done += 1;
    }
    Ok(())
}

/// Processes one body and returns the time it took, including freeing what the path allocated
/// (a proxy pays for that too).
async fn one_body(path: Path, engines: &Engines, body: &Bytes) -> anyhow::Result<Duration> {
    match path {
        Path::Rewrite | Path::RewriteHeartbeats => {
            let rewriter = if path == Path::Rewrite {
                &engines.plain
            } else {
                &engines.beating
            };
            // Building the request is the server's work, not the rewriter's: outside the clock.
            let request = json_request(body.clone());
            let start = Instant::now();
            let inspected = rewriter
                .inspect(request, Endpoint::LogBatch)
                .await
                .map_err(|answer| anyhow!("the rewriter answered {} itself", answer.status()))?;
            if let Some(beat) = inspected.beat {
                engines.health.record(beat, 1_800_000_000_000);
            } else if path == Path::RewriteHeartbeats {
                bail!("the rewriter with heartbeats handed on no heartbeat");
            }
            // What goes on to MLflow, as the coalescer takes it: the body read once.
            let bytes = match inspected.outgoing {
                Outgoing::Read { body, .. } => body,
                Outgoing::Unread(request) => request
                    .into_body()
                    .collect()
                    .await
                    .context("collecting the body")?
                    .to_bytes(),
            };
            drop(black_box(bytes));
            Ok(start.elapsed())
        }
        Path::SerdeValue => {
            let start = Instant::now();
            let value: Value =
                serde_json::from_slice(black_box(body)).context("parsing the body as JSON")?;
            let bytes = serde_json::to_vec(&value).context("serializing the body")?;
            drop(black_box(bytes));
            drop(value);
            Ok(start.elapsed())
        }
        Path::Copy => {
            let start = Instant::now();
            let bytes = black_box(body).to_vec();
            drop(black_box(bytes));
            Ok(start.elapsed())
        }
    }
}

/// A `POST runs/log-batch` request as the proxy's server hands it to the rewriter.
fn json_request(body: Bytes) -> Request {
    let length = body.len();
    Request::post(LOG_BATCH_PATH)
        .header(CONTENT_TYPE, "application/json")
        .header(CONTENT_LENGTH, length)
        .body(Body::from(body))
        .expect("a static request is valid")
}

/// Rewrites the body once and checks the result, so the benchmark cannot measure a path that
/// quietly passes the body through: every system key must have a new key, and nothing else in
/// the body may change.
async fn verify(rewriter: &MetricsRewriter, batch: &Batch) -> anyhow::Result<Verified> {
    let rewritten = rewriter
        .prepare(json_request(batch.body.clone()), Endpoint::LogBatch)
        .await
        .map_err(|answer| anyhow!("the rewriter answered {} itself", answer.status()))?;
    let out = rewritten
        .into_body()
        .collect()
        .await
        .context("collecting the rewritten body")?
        .to_bytes();
    let before: Value = serde_json::from_slice(&batch.body).context("the generated body")?;
    let after: Value = serde_json::from_slice(&out).context("the rewritten body is not JSON")?;
    let (Some(before_metrics), Some(after_metrics)) =
        (before["metrics"].as_array(), after["metrics"].as_array())
    else {
        bail!(
            "the rewritten body has no metrics array: {}",
            String::from_utf8_lossy(&out)
        );
    };
    let mut problems = Vec::new();
    if before_metrics.len() != after_metrics.len() {
        problems.push(format!(
            "rewrite: {} metrics went in, {} came out",
            before_metrics.len(),
            after_metrics.len()
        ));
    }
    let mut keys_rewritten = 0;
    for (old, new) in before_metrics.iter().zip(after_metrics) {
        let (mut old, mut new) = (old.clone(), new.clone());
        if old["key"] != new["key"] {
            keys_rewritten += 1;
        }
        old["key"] = Value::Null;
        new["key"] = Value::Null;
        if old != new {
            problems.push(format!(
                "rewrite changed more than a key: {old} became {new}"
            ));
            break;
        }
    }
    if keys_rewritten != batch.system_metrics {
        problems.push(format!(
            "rewrite: {keys_rewritten} keys changed, expected the {} system keys",
            batch.system_metrics
        ));
    }
    let step = ((1i64 << 53) + 1).to_string();
    if batch.metrics > 13 && !std::str::from_utf8(&out).is_ok_and(|text| text.contains(&step)) {
        problems.push(format!("rewrite: step {step} did not survive as written"));
    }
    Ok(Verified {
        keys_rewritten,
        problems,
    })
}

// === impl Engines ===

impl Engines {
    async fn new() -> anyhow::Result<Engines> {
        let scopes = ScopeConfig {
            dedup: false,
            ..Default::default()
        };
        let dir = tempfile::tempdir().context("creating a directory for the health store")?;
        let store = Store::open(&format!("sqlite://{}/health.db", dir.path().display()))
            .await
            .context("opening the health store")?;
        let config = mlscope_proxy::shell::config::Config::default();
        let metrics = Metrics::new();
        Ok(Engines {
            plain: MetricsRewriter::new(scopes.clone(), None, Metrics::new()),
            beating: MetricsRewriter::new(scopes, None, metrics.clone()).with_beats(),
            health: Health::new(
                config.health.clone(),
                store,
                Forwarder::new(&config.forwarder, metrics.clone()),
                mlscope_proxy::capabilities::coalesce::Coalescer::new(
                    config.coalesce,
                    Forwarder::new(&config.forwarder, metrics.clone()),
                    metrics.clone(),
                ),
                metrics,
                "bench".into(),
            ),
            _dir: dir,
        })
    }
}

// === impl Path ===

impl Path {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Path::Rewrite => "mlscope-proxy rewrite",
            Path::RewriteHeartbeats => "mlscope-proxy rewrite + heartbeats",
            Path::SerdeValue => "serde_json::Value round trip",
            Path::Copy => "pass-through (byte copy)",
        }
    }

    /// What the path does to each body, for the report.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Path::Rewrite => {
                "`MetricsRewriter::prepare` (scoping on, dedup off) on a `POST runs/log-batch` \
                 request, then collecting the rewritten body"
            }
            Path::RewriteHeartbeats => {
                "the same with run health on (`with_beats`): the body's ranks, GPUs and limits \
                 read into a heartbeat, which is then recorded in memory as the handler does \
                 after MLflow's answer"
            }
            Path::SerdeValue => "`serde_json::from_slice::<Value>` then `serde_json::to_vec`",
            Path::Copy => "`body.to_vec()`",
        }
    }
}

// === impl Tally ===

impl Tally {
    fn new() -> Tally {
        Tally {
            nanos: Histogram::new_with_bounds(1, MAX_TRACKABLE_NANOS, 3)
                .expect("valid histogram bounds"),
            busy: Duration::ZERO,
            bodies: 0,
        }
    }

    fn record(&mut self, elapsed: Duration) {
        let nanos = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX).max(1);
        self.nanos.saturating_record(nanos);
        self.busy += elapsed;
        self.bodies += 1;
    }

    /// Mean time per body; `None` before the first body.
    pub(crate) fn mean(&self) -> Option<Duration> {
        u32::try_from(self.bodies)
            .ok()
            .filter(|&n| n > 0)
            .map(|n| self.busy / n)
    }

    /// Metric samples per second of busy time, for bodies of `metrics` metrics.
    pub(crate) fn samples_per_second(&self, metrics: usize) -> Option<f64> {
        let seconds = self.busy.as_secs_f64();
        (self.bodies > 0 && seconds > 0.0).then(|| (self.bodies * metrics as u64) as f64 / seconds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rewriter() -> MetricsRewriter {
        MetricsRewriter::new(
            ScopeConfig {
                dedup: false,
                ..Default::default()
            },
            None,
            Metrics::new(),
        )
    }

    #[tokio::test]
    async fn the_check_finds_every_system_key_rewritten_and_nothing_else_changed() {
        let batch = batch::mlflow_log_batch(1000);
        let verified = verify(&rewriter(), &batch)
            .await
            .expect("verification runs");
        assert_eq!(verified.problems, Vec::<String>::new());
        assert_eq!(verified.keys_rewritten, batch.system_metrics);
    }

    #[tokio::test]
    async fn the_check_notices_a_rewriter_that_leaves_keys_alone() {
        let off = MetricsRewriter::new(
            ScopeConfig {
                rewrite: false,
                dedup: false,
                ..Default::default()
            },
            None,
            Metrics::new(),
        );
        let verified = verify(&off, &batch::mlflow_log_batch(100))
            .await
            .expect("verification runs");
        assert_eq!(verified.keys_rewritten, 0);
        assert_eq!(verified.problems.len(), 1, "{:?}", verified.problems);
    }

    #[tokio::test]
    async fn every_path_processes_a_body_and_the_quota_bounds_a_slice() {
        let batch = batch::mlflow_log_batch(50);
        let engines = Engines::new().await.unwrap();
        for path in PATHS {
            let mut tally = Tally::new();
            run_slice(
                path,
                &engines,
                &batch.body,
                Duration::from_secs(60),
                3,
                &mut tally,
            )
            .await
            .expect("the path runs");
            assert_eq!(tally.bodies, 3, "{path:?}");
            assert!(tally.mean().is_some());
            assert!(tally.samples_per_second(50).is_some_and(|s| s > 0.0));
        }
    }
}
