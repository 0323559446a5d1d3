//! `mlscope-bench fleet`: a training fleet against MLflow, nginx and mlscope-proxy, and the
//! largest fleet each one sustains.
//!
//! A fleet is N nodes × R ranks per node, spread over one or more runs (node `i` belongs to run
//! `i mod runs`, so every rank of a node writes into the same run, as in distributed training).
//! Every rank sends what MLflow's system-metrics monitor sends (its keys under
//! `system/<node>/rank-<r>/`, one `log-batch` per sampling interval), training metrics per step
//! (from every rank or from each run's rank 0), params and tags once at the start (rank 0), and
//! optionally checkpoint uploads of rank 0 through MLflow's artifact API.
//!
//! The load is open-loop: every request has a scheduled instant, computed from the start, and
//! its acknowledgement latency runs from that instant to MLflow's (or the proxy's) final answer,
//! retries included, so a slow target cannot slow the schedule down and hide its own stalls.
//! Time can be compressed: with `--time-scale 10` a 10 s interval passes in 1 s, so each rank
//! stands for ten.
//!
//! After each load phase the runs are read back from MLflow directly and every sample is
//! counted: sent, acknowledged, stored, missing (acknowledged but not stored), duplicated.
//! A fleet size is *sustained* when no request failed, nothing acknowledged is missing or
//! duplicated, and the p99 acknowledgement latency is within `--p99-bound`. With several
//! `--ranks-per-node` values the fleet steps up per target until a size is not sustained.
//!
//! - [`plan`]: the simulated ranks and the schedule of their requests;
//! - [`load`]: sending each scheduled request (with retries) and entering what was acknowledged;
//! - [`verify`]: the ledger, how a target stores each key, and the count back from MLflow;
//! - this file runs one fleet size per target and steps the sizes up; [`report`] and [`soak`]
//!   print what was measured.

mod load;
mod plan;
mod report;
mod soak;

pub(crate) use soak::rss_bytes;
mod verify;

use load::*;
use plan::*;
use verify::*;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;
use hdrhistogram::Histogram;
use mlscope_scopes::{scoped_key, Identity, KeyOutcome, OwnerPattern};
use serde_json::{json, Value};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::cli::{FleetArgs, Scenario, SystemFrom, TrainingFrom};
use crate::mlflow::{self, unix_millis};
use crate::monitor::{MonitoredRank, SeriesKind};
use crate::progress;
use crate::stack::{BenchStack, Target, TargetKind};
use crate::{http, Report};

/// Highest latency the histograms hold (an hour, in µs).
const MAX_TRACKABLE_MICROS: u64 = 3_600_000_000;
/// Reads of `metrics/get-history` at once when counting.
const VERIFY_CONCURRENCY: usize = 8;
/// Most pages of one history read.
const MAX_HISTORY_PAGES: usize = 1_000;
/// Lead time before the first scheduled request.
const START_LEAD: Duration = Duration::from_millis(200);

/// What one scheduled request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Op {
    /// Params and tags of a run, once, from its rank 0.
    Start,
    /// One publish of a rank's system-metrics monitor.
    System,
    /// One training step's metrics of a rank.
    Training,
    /// A checkpoint upload of a run's rank 0.
    Checkpoint,
}

impl Op {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Op::Start => "params+tags",
            Op::System => "system metrics",
            Op::Training => "training metrics",
            Op::Checkpoint => "checkpoint upload",
        }
    }
}

/// What one target did with one fleet size.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    pub(crate) target: TargetKind,
    pub(crate) nodes: u32,
    pub(crate) ranks_per_node: u32,
    pub(crate) simulated_ranks: f64,
    pub(crate) requests: u64,
    pub(crate) acknowledged: u64,
    pub(crate) failed: u64,
    /// Requests that needed at least one retry before their answer.
    pub(crate) retried: u64,
    /// Scheduled requests never sent: every in-flight slot stayed busy past the deadline.
    pub(crate) dropped: u64,
    /// First failures seen, by answer.
    pub(crate) failures: BTreeMap<String, u64>,
    pub(crate) latency: BTreeMap<Op, Histogram<u64>>,
    pub(crate) all_latency: Histogram<u64>,
    pub(crate) counts: Counts,
    pub(crate) p99_bound: Duration,
    /// What was killed in the middle (MLflow, a proxy replica) and how long it was gone.
    pub(crate) outage: Option<Outage>,
    /// How long MLflow took after the load to answer promptly again.
    pub(crate) drained: Duration,
    /// Why the samples could not be counted.
    pub(crate) count_error: Option<String>,
    /// What the proxies' coalescers sent MLflow during the phase; `None` for targets without a
    /// proxy.
    pub(crate) batches: Option<Batches>,
    /// The proxies' resources sampled during the load (`--sample-every`); empty when not asked.
    pub(crate) resources: Vec<soak::Sample>,
}

/// Batches the coalescer(s) of a target sent MLflow, from the proxies' `/metrics` before and
/// after a phase.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Batches {
    /// Batches of several requests, stored as one.
    pub(crate) merged: u64,
    /// Requests sent as they came (nothing to merge with).
    pub(crate) single: u64,
    /// Merged batches MLflow refused or that failed, sent again as their requests.
    pub(crate) split: u64,
    /// Client requests and metric samples over all batches sent.
    pub(crate) requests: u64,
    pub(crate) samples: u64,
}

impl Batches {
    fn read(exposition: &str) -> Batches {
        let value = |series: &str| crate::prometheus::sum(exposition, series) as u64;
        Batches {
            merged: value(r#"mlscope_coalesce_batches_total{outcome="merged"}"#),
            single: value(r#"mlscope_coalesce_batches_total{outcome="single"}"#),
            split: value(r#"mlscope_coalesce_batches_total{outcome="split"}"#),
            requests: value("mlscope_coalesce_requests_per_batch_sum"),
            samples: value("mlscope_coalesce_samples_per_batch_sum"),
        }
    }

    /// `after - before` field by field; a counter that went down belongs to a proxy that was
    /// started again, and counts from zero.
    fn since(after: &Batches, before: &Batches) -> Batches {
        let d = |a: u64, b: u64| if a >= b { a - b } else { a };
        Batches {
            merged: d(after.merged, before.merged),
            single: d(after.single, before.single),
            split: d(after.split, before.split),
            requests: d(after.requests, before.requests),
            samples: d(after.samples, before.samples),
        }
    }

    fn add(&mut self, other: &Batches) {
        self.merged += other.merged;
        self.single += other.single;
        self.split += other.split;
        self.requests += other.requests;
        self.samples += other.samples;
    }

    /// Batches sent to MLflow in all.
    pub(crate) fn sent(&self) -> u64 {
        self.merged + self.single
    }

    pub(crate) fn requests_per_batch(&self) -> Option<f64> {
        (self.sent() > 0).then(|| self.requests as f64 / self.sent() as f64)
    }

    pub(crate) fn samples_per_batch(&self) -> Option<f64> {
        (self.sent() > 0).then(|| self.samples as f64 / self.sent() as f64)
    }
}

/// Each proxy's coalescer counters behind `admin_urls`, in order (`None` where unreadable).
async fn scrape_batches(client: &reqwest::Client, admin_urls: &[String]) -> Vec<Option<Batches>> {
    let mut all = Vec::with_capacity(admin_urls.len());
    for url in admin_urls {
        all.push(
            crate::prometheus::scrape(client, url)
                .await
                .map(|text| Batches::read(&text)),
        );
    }
    all
}

/// A process killed in the middle of a load phase and started again.
#[derive(Debug, Clone)]
pub(crate) struct Outage {
    pub(crate) what: &'static str,
    /// From the kill until it answered again.
    pub(crate) gone: Duration,
}

/// Samples, counted after the load.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    pub(crate) sent: u64,
    pub(crate) acknowledged: u64,
    pub(crate) stored: u64,
    /// Acknowledged but not stored.
    pub(crate) missing: u64,
    /// Stored more than once.
    pub(crate) duplicated: u64,
    /// Checkpoint uploads acknowledged, and those read back whole from MLflow afterwards.
    pub(crate) objects_acknowledged: u64,
    pub(crate) objects_stored: u64,
}

impl Outcome {
    pub(crate) fn p99_micros(&self) -> Option<u64> {
        (!self.all_latency.is_empty()).then(|| self.all_latency.value_at_quantile(0.99))
    }

    /// No failure, nothing lost or doubled, p99 within the bound.
    pub(crate) fn sustained(&self) -> bool {
        self.failed == 0
            && self.dropped == 0
            && self.count_error.is_none()
            && self.counts.missing == 0
            && self.counts.duplicated == 0
            && self.counts.objects_stored == self.counts.objects_acknowledged
            && self
                .p99_micros()
                .is_some_and(|p99| p99 <= self.p99_bound.as_micros() as u64)
    }
}

pub(crate) async fn run(
    args: &FleetArgs,
    stack: Arc<BenchStack>,
    command_line: &str,
) -> anyhow::Result<Report> {
    let direct = stack
        .target(TargetKind::Direct)
        .context("the stack has no direct target")?;
    let experiment = mlflow::create_experiment(
        &direct,
        &format!("mlscope-bench-fleet-{}", uuid::Uuid::new_v4().simple()),
    )
    .await?;
    let mlflow_version = mlflow::version(&direct).await;
    let mut outcomes = Vec::new();
    for kind in crate::stack::fleet_target_kinds(args) {
        let target = stack
            .target(kind)
            .with_context(|| format!("{kind} was not started"))?;
        for &ranks_per_node in &args.ranks_per_node {
            let outcome =
                run_one(args, &stack, &target, &direct, &experiment, ranks_per_node).await?;
            let sustained = outcome.sustained();
            eprintln!(
                "{kind}: {} ranks ({} simulated): {}",
                args.nodes * ranks_per_node,
                outcome.simulated_ranks,
                if sustained {
                    "sustained"
                } else {
                    "not sustained"
                }
            );
            outcomes.push(outcome);
            if !sustained {
                break;
            }
        }
    }
    let markdown = report::render(args, command_line, mlflow_version.as_deref(), &outcomes);
    if let Some(path) = &args.json {
        let json = report::json(args, mlflow_version.as_deref(), &outcomes);
        std::fs::write(path, serde_json::to_vec_pretty(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(Report {
        markdown,
        problems: Vec::new(),
    })
}

/// One load phase of one fleet size against one target, then the count.
async fn run_one(
    args: &FleetArgs,
    stack: &Arc<BenchStack>,
    target: &Target,
    direct: &Target,
    experiment: &str,
    ranks_per_node: u32,
) -> anyhow::Result<Outcome> {
    let client = http::client(args.max_in_flight)?;
    let ranks = fleet(args, ranks_per_node);
    let mut run_ids = Vec::new();
    for run in 0..args.runs {
        let name = format!(
            "fleet-{}-{}x{}-job{run}",
            target.kind.slug(),
            args.nodes,
            ranks_per_node
        );
        run_ids.push(mlflow::create_run(&client, target, experiment, &name).await?);
    }
    let events = schedule(args, &ranks);
    let mapping = KeyMapping::of(target.kind);
    let ledger = Arc::new(Mutex::new(Ledger {
        runs: (0..run_ids.len()).map(|_| HashMap::new()).collect(),
        ..Ledger::default()
    }));
    let shared = Arc::new(Shared {
        client: client.clone(),
        base: target.base_url.clone(),
        experiment: experiment.to_owned(),
        run_ids: run_ids.clone(),
        ranks,
        args: RequestSettings {
            collector: args.system_from == SystemFrom::Collector,
            gpus: args.gpus,
            training_metrics: args.training_metrics,
            training_per_rank: args.training_from == TrainingFrom::All,
            checkpoint_bytes: args.checkpoint_size.0,
            retries: args.retries,
            request_timeout: args.request_timeout,
        },
        mapping,
        ledger: ledger.clone(),
        first_timestamp: unix_millis() as i64,
    });

    let bar = progress::count_bar(events.len() as u64);
    bar.set_message(format!(
        "{} · {} ranks",
        target.kind,
        args.nodes * ranks_per_node
    ));
    let slots = Arc::new(Semaphore::new(args.max_in_flight));
    let start = Instant::now() + START_LEAD;
    // The outage scenarios: MLflow or one proxy replica killed halfway through, back 2 s later
    // (plus its start-up).
    let victim = match args.scenario {
        Scenario::MlflowRestart => Some("MLflow"),
        Scenario::ReplicaKill => Some("mlscope-proxy replica 0"),
        Scenario::Steady | Scenario::Burst => None,
    };
    let outage = victim.map(|what| {
        let stack = stack.clone();
        let scenario = args.scenario;
        let at = start + args.duration / 2;
        let task = tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            tokio::task::spawn_blocking(move || {
                let down = Duration::from_secs(2);
                if scenario == Scenario::ReplicaKill {
                    stack.kill_replica(0, down)
                } else {
                    stack.restart_mlflow(down)
                }
            })
            .await
            .context("the outage task panicked")?
        });
        (what, task)
    });
    let deadline = start + args.duration + args.request_timeout;
    let mut tasks = JoinSet::new();
    let mut outcome = Outcome {
        target: target.kind,
        nodes: args.nodes,
        ranks_per_node,
        simulated_ranks: f64::from(args.nodes * ranks_per_node) * args.time_scale,
        requests: events.len() as u64,
        acknowledged: 0,
        failed: 0,
        retried: 0,
        dropped: 0,
        failures: BTreeMap::new(),
        latency: BTreeMap::new(),
        all_latency: histogram(),
        counts: Counts::default(),
        p99_bound: args.p99_bound,
        outage: None,
        drained: Duration::ZERO,
        count_error: None,
        batches: None,
        resources: Vec::new(),
    };
    let admin_urls = stack.admin_urls(target.kind);
    let batches_before = scrape_batches(&client, &admin_urls).await;
    let sampler = args.sample_every.map(|every| {
        soak::Sampler::start(
            every,
            client.clone(),
            stack.proxy_pids(target.kind),
            admin_urls.clone(),
            stack
                .state_database_url()
                .filter(|_| target.kind == TargetKind::ProxyReplicas),
        )
    });
    for (index, event) in events.iter().enumerate() {
        let scheduled = start + event.at;
        tokio::time::sleep_until(scheduled).await;
        let slot = match tokio::time::timeout_at(deadline, slots.clone().acquire_owned()).await {
            Ok(Ok(slot)) => slot,
            _ => {
                outcome.dropped += (events.len() - index) as u64;
                break;
            }
        };
        let shared = shared.clone();
        let event = event.clone();
        tasks.spawn(async move {
            let result = shared.send(&event).await;
            drop(slot);
            (event.op, scheduled, Instant::now(), result)
        });
        while let Some(done) = tasks.try_join_next() {
            record(&mut outcome, done);
            bar.inc(1);
        }
    }
    while let Some(done) = tasks.join_next().await {
        record(&mut outcome, done);
        bar.inc(1);
    }
    bar.finish_and_clear();
    if let Some(sampler) = sampler {
        outcome.resources = sampler.finish().await;
    }
    if let Some((what, task)) = outage {
        let gone = task.await.context("the outage task panicked")??;
        outcome.outage = Some(Outage { what, gone });
    }

    let counting = progress::spinner(format!("{}: counting what MLflow stored", target.kind));
    // An overloaded MLflow still works through requests whose clients gave up; the count waits
    // until it answers promptly again, so the next phase starts from an idle MLflow too.
    outcome.drained = wait_until_idle(&client, direct).await;
    if !admin_urls.is_empty() {
        let after = scrape_batches(&client, &admin_urls).await;
        let mut total = Batches::default();
        for (after, before) in after.iter().zip(&batches_before) {
            if let (Some(after), Some(before)) = (after, before) {
                total.add(&Batches::since(after, before));
            }
        }
        outcome.batches = Some(total);
    }
    let ledger = std::mem::take(&mut *ledger.lock().expect("ledger lock"));
    match count(&client, direct, &run_ids, ledger, args.checkpoint_size.0).await {
        Ok(counts) => outcome.counts = counts,
        Err(e) => outcome.count_error = Some(format!("{e:#}")),
    }
    counting.finish_and_clear();
    Ok(outcome)
}

/// Polls a cheap MLflow call until it answers within a second (at most 10 minutes); returns how
/// long that took.
async fn wait_until_idle(client: &reqwest::Client, direct: &Target) -> Duration {
    let started = Instant::now();
    let url = format!(
        "{}/api/2.0/mlflow/experiments/search?max_results=1",
        direct.base_url
    );
    while started.elapsed() < Duration::from_secs(600) {
        let asked = Instant::now();
        let answered = client
            .get(&url)
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if answered && asked.elapsed() < Duration::from_secs(1) {
            break;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    started.elapsed()
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_TRACKABLE_MICROS, 3).expect("valid histogram bounds")
}

type Done = Result<(Op, Instant, Instant, Sent), tokio::task::JoinError>;

fn record(outcome: &mut Outcome, done: Done) {
    let Ok((op, scheduled, finished, sent)) = done else {
        outcome.failed += 1;
        *outcome.failures.entry("task panicked".into()).or_default() += 1;
        return;
    };
    if sent.attempts > 1 {
        outcome.retried += 1;
    }
    match sent.result {
        Ok(()) => {
            outcome.acknowledged += 1;
            let micros = finished
                .saturating_duration_since(scheduled)
                .as_micros()
                .clamp(1, u128::from(MAX_TRACKABLE_MICROS)) as u64;
            outcome
                .latency
                .entry(op)
                .or_insert_with(histogram)
                .saturating_record(micros);
            outcome.all_latency.saturating_record(micros);
        }
        Err(failure) => {
            outcome.failed += 1;
            *outcome.failures.entry(failure).or_default() += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args(extra: &[&str]) -> FleetArgs {
        let mut argv = vec!["mlscope-bench", "fleet"];
        argv.extend_from_slice(extra);
        match crate::cli::Cli::parse_from(argv).command {
            crate::cli::Command::Fleet(args) => args,
            _ => panic!("not fleet"),
        }
    }

    #[test]
    fn every_rank_of_a_node_writes_into_its_nodes_run() {
        let args = args(&["--nodes", "4", "--ranks-per-node", "2", "--runs", "2"]);
        let ranks = fleet(&args, 2);
        assert_eq!(ranks.len(), 8);
        let runs: Vec<usize> = ranks.iter().map(|r| r.run).collect();
        assert_eq!(runs, [0, 0, 1, 1, 0, 0, 1, 1]);
        // Ranks within a run are 0..4, rank 0 once per run.
        let run0: Vec<u32> = ranks
            .iter()
            .filter(|r| r.run == 0)
            .map(|r| r.monitor.rank)
            .collect();
        assert_eq!(run0, [0, 1, 2, 3]);
        assert_eq!(ranks.iter().filter(|r| r.rank_zero).count(), 2);
        assert_eq!(ranks.iter().filter(|r| r.trains).count(), 2);
    }

    #[test]
    fn the_schedule_spreads_ranks_over_one_compressed_interval() {
        let args = args(&[
            "--nodes",
            "1",
            "--ranks-per-node",
            "4",
            "--interval",
            "10s",
            "--time-scale",
            "10",
            "--duration",
            "3s",
            "--training-metrics",
            "0",
        ]);
        let ranks = fleet(&args, 4);
        let events = schedule(&args, &ranks);
        let system: Vec<&Event> = events.iter().filter(|e| e.op == Op::System).collect();
        // 1 s real interval, 3 s: three publishes per rank, ranks 250 ms apart.
        assert_eq!(system.len(), 12);
        assert_eq!(system[1].at, Duration::from_millis(250));
        assert!(events.windows(2).all(|w| w[0].at <= w[1].at));
        assert_eq!(events.iter().filter(|e| e.op == Op::Start).count(), 1);
        let burst = self::args(&[
            "--nodes",
            "1",
            "--ranks-per-node",
            "4",
            "--scenario",
            "burst",
        ]);
        let at: BTreeSet<Duration> = schedule(&burst, &fleet(&burst, 4))
            .iter()
            .filter(|e| e.op == Op::System && e.seq == 0)
            .map(|e| e.at)
            .collect();
        assert_eq!(at.len(), 1, "a burst starts every rank at once");
    }

    #[test]
    fn batches_are_the_difference_of_two_scrapes_and_a_restarted_proxy_counts_from_zero() {
        let page = |merged: u64, single: u64, requests: u64, samples: u64| {
            format!(
                "mlscope_coalesce_batches_total{{outcome=\"merged\"}} {merged}\n\
                 mlscope_coalesce_batches_total{{outcome=\"single\"}} {single}\n\
                 mlscope_coalesce_requests_per_batch_sum {requests}\n\
                 mlscope_coalesce_requests_per_batch_count {}\n\
                 mlscope_coalesce_samples_per_batch_sum {samples}\n",
                merged + single
            )
        };
        let before = Batches::read(&page(2, 3, 13, 1000));
        let after = Batches::read(&page(12, 5, 65, 9000));
        let phase = Batches::since(&after, &before);
        assert_eq!(
            phase,
            Batches {
                merged: 10,
                single: 2,
                split: 0,
                requests: 52,
                samples: 8000,
            }
        );
        assert_eq!(phase.requests_per_batch(), Some(52.0 / 12.0));
        // Killed and started again: its counters restarted below the first scrape.
        let restarted = Batches::since(&Batches::read(&page(1, 1, 4, 30)), &before);
        assert_eq!((restarted.merged, restarted.samples), (1, 30));
        assert_eq!(Batches::default().samples_per_batch(), None);
    }

    #[test]
    fn the_replica_kill_scenario_runs_against_the_replicas_alone() {
        let only = args(&[
            "--scenario",
            "replica-kill",
            "--targets",
            "mlscope-replicas",
        ]);
        assert!(only.validate().is_ok());
        assert_eq!(
            crate::stack::fleet_target_kinds(&only),
            [TargetKind::ProxyReplicas]
        );
        let mixed = args(&[
            "--scenario",
            "replica-kill",
            "--targets",
            "direct,mlscope-replicas",
        ]);
        assert!(mixed
            .validate()
            .unwrap_err()
            .contains("mlscope-replicas alone"));
        let single = args(&[
            "--scenario",
            "replica-kill",
            "--targets",
            "mlscope-replicas",
            "--replicas",
            "1",
        ]);
        assert!(single.validate().is_err());
    }

    #[test]
    fn keys_are_counted_where_each_target_stores_them() {
        let plain = KeyMapping::of(TargetKind::Direct);
        let key = "system/node-1/rank-3/cpu_utilization_percentage";
        assert_eq!(plain.stored(key), (key.to_owned(), false));
        let scoped = KeyMapping::of(TargetKind::ProxyDedupOff);
        assert_eq!(
            scoped.stored(key),
            (
                "system/node-1/node_cpu_utilization_percentage".to_owned(),
                false
            )
        );
        let dedup = KeyMapping::of(TargetKind::Proxy);
        assert!(dedup.stored(key).1, "node-wide under dedup: by step");
        assert!(!dedup.stored("train/metric_0").1);
        assert!(KeyMapping::of(TargetKind::ProxyReplicas).stored(key).1);
    }

    #[test]
    fn the_collectors_keys_are_stored_as_sent_by_every_target() {
        let sample = MonitoredRank::new("node-1", 3).collector_publish(0, 1);
        for kind in [
            TargetKind::Direct,
            TargetKind::ProxyCoalesceOff,
            TargetKind::Proxy,
        ] {
            let mapping = KeyMapping::of(kind);
            for (key, _) in &sample {
                let (stored, by_step) = mapping.stored(key);
                assert_eq!(&stored, key, "{kind}");
                let node_wide = SeriesKind::of_key(key) == SeriesKind::NodeWide;
                assert_eq!(
                    by_step,
                    node_wide && kind == TargetKind::Proxy,
                    "{kind} {key}"
                );
            }
        }
    }
}
