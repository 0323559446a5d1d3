//! Run health: every system-metrics sample MLflow accepted is a heartbeat of its (run, node,
//! rank); the collector's wrapper reports how a rank ended; the collector reports placement and
//! GPU idleness. Heartbeats gather in memory and go to the store in batches; a sweep, one
//! replica at a time, finds runs still `RUNNING` in MLflow whose ranks all went silent or failed,
//! and tags (and by default ends) them. Every run that ends (its client's `runs/update` through
//! the proxy, or the sweep's verdict) is billed once: GPU hours held and idle ([`bill`]), as run
//! tags and fleet counters; a live run holding GPUs idle past `--gpu-idle-after` carries a tag
//! naming them, and both say what idleness was judged on ([`basis`]: SM activity or utilisation,
//! each rank's collector's word). `GET /runs/{run_id}/health` on the admin listener and Prometheus gauges show live
//! runs, their idle GPUs and their bill so far.

pub mod basis;
pub mod bill;
pub mod findings;
pub mod judge;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use serde::Serialize;
use serde_json::{json, Value};

use std::net::SocketAddr;

use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::response::{IntoResponse, Response};
use tracing::Instrument as _;

use crate::coalesce::Coalescer;
use crate::credential::Secret;
use crate::mlflow::{Caller, MlflowClient, MlflowError, Run, RunTag, UpdateRun};
use crate::proxy::Forwarder;
use crate::settings::parse_duration;
use crate::store::{
    unix_millis, BillRow, FindingRow, GpuIdleRow, RankRow, Store, VerdictRow, SUPERSEDE_AFTER_MS,
};
use crate::telemetry::Metrics;
use bill::{Clip, IdleWindow, RunBill};

pub use judge::{judge, Judgement, Outcome};

/// Ranks with unflushed heartbeats a replica holds before new ones are dropped (and counted).
const MAX_PENDING_RANKS: usize = 100_000;
/// Runs examined per sweep.
const MAX_SWEPT_RUNS: i64 = 5_000;
/// Live runs that get per-run gauges; beyond it only the count is exported.
pub const MAX_GAUGE_RUNS: usize = 1_000;
/// Ranks that get their own `mlscope/rank-<r>/last_heard` tag when a run is judged.
const MAX_RANK_TAGS: usize = 64;
/// MLflow's longest tag value is 8000 characters (5000 in older versions); stay under both.
const MAX_TAG_VALUE: usize = 5_000;
/// The lease name of the stale-run sweep.
const SWEEP_LEASE: &str = "stale-run-sweep";
/// GPU indexes read from keys (`gpu_<i>_...`): beyond this an index is not a real device.
const MAX_GPUS_PER_RANK: i64 = 64;
/// Runs whose ranks all exited 0 asked about at MLflow per sweep (ended there, not through the
/// proxy, they are billed).
const MAX_CLEAN_ENDS_PER_SWEEP: usize = 50;
/// Bills carried out per sweep.
const MAX_BILLS_PER_SWEEP: i64 = 200;
/// The tag naming a live run's GPUs idle past `--gpu-idle-after`.
pub const IDLE_TAG: &str = "mlscope.gpus_idle";

/// What the sweep does with a dead run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StaleAction {
    /// Only tags: `mlscope.outcome` and the rest; the run stays `RUNNING`.
    Tag,
    /// Tags, then the run ends `FAILED` with `end_time` = its last heartbeat.
    End,
}

impl StaleAction {
    pub fn as_str(self) -> &'static str {
        match self {
            StaleAction::Tag => "tag",
            StaleAction::End => "end",
        }
    }
}

/// The credential the sweep uses for MLflow when MLflow requires one.
pub use crate::credential::ServiceCredential;

#[derive(Debug, Clone)]
pub struct HealthConfig {
    pub enabled: bool,
    pub stale_after: Duration,
    pub action: StaleAction,
    pub gpu_idle_after: Duration,
    pub sweep_interval: Duration,
    pub flush_interval: Duration,
    pub credential: ServiceCredential,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            enabled: true,
            stale_after: Duration::from_secs(300),
            action: StaleAction::End,
            gpu_idle_after: Duration::from_secs(1800),
            sweep_interval: Duration::from_secs(30),
            flush_interval: Duration::from_secs(2),
            credential: ServiceCredential::None,
        }
    }
}

impl HealthConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.stale_after < Duration::from_secs(1) {
            return Err("run-stale-after must be at least 1s".into());
        }
        if self.sweep_interval < Duration::from_millis(100)
            || self.flush_interval < Duration::from_millis(100)
        {
            return Err(
                "health-sweep-interval and health-flush-interval must be at least 100ms".into(),
            );
        }
        Ok(())
    }
}

/// Run health's settings as given (see [`crate::settings`]); `None`: not given here.
#[derive(Debug, Clone, Default, clap::Args, serde::Deserialize)]
pub struct HealthOptions {
    /// Run health: record heartbeats of every rank, judge runs whose ranks all went silent or
    /// failed, and export live runs' idle GPUs [default: true].
    #[arg(long, env = "MLSCOPE_RUN_HEALTH", value_name = "BOOL", action = clap::ArgAction::Set)]
    pub run_health: Option<bool>,
    /// Silence of every rank after which a run still RUNNING in MLflow is judged lost [default: 5m].
    #[arg(long, env = "MLSCOPE_RUN_STALE_AFTER", value_parser = parse_duration, value_name = "DURATION")]
    #[serde(default, with = "humantime_serde")]
    pub run_stale_after: Option<Duration>,
    /// What happens to a dead run: `end` tags it and ends it FAILED at its last heartbeat,
    /// `tag` only tags it [default: end].
    #[arg(long, env = "MLSCOPE_STALE_RUN_ACTION", value_enum)]
    pub stale_run_action: Option<StaleAction>,
    /// A GPU idle (utilisation and memory activity under the collector's threshold) this long
    /// counts as idle in /metrics, /runs/{id}/health and the run's mlscope.gpus_idle tag
    /// [default: 30m].
    #[arg(long, env = "MLSCOPE_GPU_IDLE_AFTER", value_parser = parse_duration, value_name = "DURATION")]
    #[serde(default, with = "humantime_serde")]
    pub gpu_idle_after: Option<Duration>,
    /// How often the stale-run sweep runs (on one replica at a time) and the run gauges are
    /// refreshed [default: 30s].
    #[arg(long, env = "MLSCOPE_HEALTH_SWEEP_INTERVAL", value_parser = parse_duration, value_name = "DURATION")]
    #[serde(default, with = "humantime_serde")]
    pub health_sweep_interval: Option<Duration>,
    /// How often heartbeats gathered in memory are written to the state store [default: 2s].
    #[arg(long, env = "MLSCOPE_HEALTH_FLUSH_INTERVAL", value_parser = parse_duration, value_name = "DURATION")]
    #[serde(default, with = "humantime_serde")]
    pub health_flush_interval: Option<Duration>,
    // Credentials come from the environment or flags only, never from the file.
    /// Bearer token the stale-run sweep uses with an MLflow that authenticates (needs EDIT on
    /// every run it may end).
    #[arg(
        long,
        env = "MLSCOPE_MLFLOW_SERVICE_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    #[serde(skip)]
    pub mlflow_service_token: Option<Secret>,
    /// User name the stale-run sweep uses with MLflow's basic authentication.
    #[arg(long, env = "MLSCOPE_MLFLOW_SERVICE_USERNAME", value_name = "USER")]
    #[serde(skip)]
    pub mlflow_service_username: Option<String>,
    /// Password for --mlflow-service-username.
    #[arg(
        long,
        env = "MLSCOPE_MLFLOW_SERVICE_PASSWORD",
        hide_env_values = true,
        value_name = "PASSWORD"
    )]
    #[serde(skip)]
    pub mlflow_service_password: Option<Secret>,
}

impl HealthOptions {
    /// The given values over the defaults; a credential is a token, or a user name with its
    /// password, or none.
    pub fn resolve(self) -> Result<HealthConfig, String> {
        let d = HealthConfig::default();
        let credential = match (
            self.mlflow_service_token,
            self.mlflow_service_username,
            self.mlflow_service_password,
        ) {
            (Some(token), None, None) => ServiceCredential::Token(token),
            (None, Some(username), Some(password)) => ServiceCredential::Basic { username, password },
            (None, None, None) => d.credential,
            _ => return Err(
                "give the stale-run sweep either --mlflow-service-token, or both --mlflow-service-username and --mlflow-service-password".into(),
            ),
        };
        Ok(HealthConfig {
            enabled: self.run_health.unwrap_or(d.enabled),
            stale_after: self.run_stale_after.unwrap_or(d.stale_after),
            action: self.stale_run_action.unwrap_or(d.action),
            gpu_idle_after: self.gpu_idle_after.unwrap_or(d.gpu_idle_after),
            sweep_interval: self.health_sweep_interval.unwrap_or(d.sweep_interval),
            flush_interval: self.health_flush_interval.unwrap_or(d.flush_interval),
            credential,
        })
    }
}

/// What one accepted metrics request said about the ranks of its run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Beat {
    pub run_id: String,
    pub ranks: Vec<RankBeat>,
    /// The MLflow workspace the request named (`X-MLFLOW-WORKSPACE`).
    pub workspace: Option<String>,
    /// What its collectors' tags reported the run stood on (data changes, leftovers).
    pub findings: Vec<findings::Finding>,
}

/// One (node, rank) of a [`Beat`]: `node` is `""` and `rank` `-1` where the sender named none.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RankBeat {
    pub node: String,
    pub rank: i64,
    /// GPUs its samples name (highest `gpu_<i>_` index + 1).
    pub gpus: i64,
    /// Seconds each GPU has been idle, by index, when the collector reports it.
    pub gpu_idle: Vec<Option<f64>>,
    pub memory_limit_mb: Option<f64>,
    pub cpu_limit_cores: Option<f64>,
    /// From the collector's tags `mlscope/rank-<r>/<fact>`.
    pub outcome: Option<String>,
    pub exit_code: Option<i64>,
    pub pod: Option<String>,
    pub gpu_model: Option<String>,
    /// What its collector judged GPU idleness on (`health::basis`).
    pub gpu_idle_basis: Option<&'static str>,
    /// Whether the request carried system samples of this rank (not only its tags).
    pub sampled: bool,
    /// Timestamps (the sender's, unix ms) of the rank's system samples: earliest and latest.
    pub sampled_between: Option<(i64, i64)>,
    /// Each idle-clock reading: (GPU index, timestamp, idle seconds).
    pub idle_readings: Vec<(i64, i64, f64)>,
}

impl Beat {
    /// The entry for `(node, rank)`, added when new.
    pub fn rank_mut(&mut self, node: &str, rank: i64) -> &mut RankBeat {
        let index = match self
            .ranks
            .iter()
            .position(|r| r.node == node && r.rank == rank)
        {
            Some(i) => i,
            None => {
                self.ranks.push(RankBeat {
                    node: node.to_owned(),
                    rank,
                    ..RankBeat::default()
                });
                self.ranks.len() - 1
            }
        };
        &mut self.ranks[index]
    }

    /// Whether [`Beat::observe_metric`] uses the value of metric `name` (otherwise any sample
    /// of it says the same).
    pub fn needs_value(name: &str) -> bool {
        matches!(
            name,
            "container_memory_limit_megabytes" | "container_cpu_limit_cores"
        ) || gpu_name(name).is_some_and(|(_, suffix)| suffix == "idle_seconds")
    }

    /// Reads one system metric of a rank: GPU count and idleness, container limits.
    /// `at_ms` is the sample's timestamp, when its value is read (idle clocks are billed by it).
    pub fn observe_metric(
        &mut self,
        node: &str,
        rank: i64,
        name: &str,
        value: f64,
        at_ms: Option<i64>,
    ) {
        let entry = self.rank_mut(node, rank);
        entry.sampled = true;
        if let Some((index, suffix)) = gpu_name(name) {
            entry.gpus = entry.gpus.max(index + 1);
            if suffix == "idle_seconds" && value.is_finite() && value >= 0.0 {
                if let Some(at) = at_ms {
                    entry.idle_readings.push((index, at, value));
                }
                let index = index as usize;
                if entry.gpu_idle.len() <= index {
                    entry.gpu_idle.resize(index + 1, None);
                }
                entry.gpu_idle[index] = Some(value);
            }
        } else if value.is_finite() && value > 0.0 {
            match name {
                "container_memory_limit_megabytes" => entry.memory_limit_mb = Some(value),
                "container_cpu_limit_cores" => entry.cpu_limit_cores = Some(value),
                _ => {}
            }
        }
    }

    /// Notes the timestamp of one system sample of a rank (its billed span).
    pub fn observe_time(&mut self, node: &str, rank: i64, at_ms: i64) {
        let entry = self.rank_mut(node, rank);
        entry.sampled_between = Some(match entry.sampled_between {
            Some((first, last)) => (first.min(at_ms), last.max(at_ms)),
            None => (at_ms, at_ms),
        });
    }

    /// Reads one run tag: the collector's `mlscope/rank-<r>/<fact>`, taken only from rank `r`
    /// itself (the request's `X-Mlscope-Rank` header, `header_rank`): another sender cannot end
    /// a rank it is not. Other tags are ignored.
    pub fn observe_tag(
        &mut self,
        header_node: Option<&str>,
        header_rank: Option<u32>,
        key: &str,
        value: &str,
    ) {
        if let Some(finding) = findings::of_tag(header_node, header_rank, key, value) {
            self.findings.push(finding);
        }
        let Some(rest) = key.strip_prefix("mlscope/rank-") else {
            return;
        };
        let Some((rank, fact)) = rest.split_once('/') else {
            return;
        };
        let Ok(rank) = rank.parse::<u32>() else {
            return;
        };
        if header_rank != Some(rank) {
            return;
        }
        let value: String = value.chars().take(256).collect();
        // The node a rank reports itself on; the request's header otherwise.
        let node = header_node.unwrap_or_default().to_owned();
        let entry = self.rank_mut(&node, i64::from(rank));
        match fact {
            "outcome" => entry.outcome = Some(value),
            "exit_code" => entry.exit_code = value.parse().ok(),
            "pod" => entry.pod = Some(value),
            "gpu_model" => entry.gpu_model = Some(value),
            "gpu_idle_basis" => entry.gpu_idle_basis = basis::parse(&value),
            "gpu_count" => {
                if let Ok(count) = value.parse::<i64>() {
                    entry.gpus = entry.gpus.max(count.clamp(0, MAX_GPUS_PER_RANK));
                }
            }
            _ => {}
        }
    }
}

/// `gpu_<i>_<suffix>` → `(i, suffix)`.
fn gpu_name(name: &str) -> Option<(i64, &str)> {
    let rest = name.strip_prefix("gpu_")?;
    let (index, suffix) = rest.split_once('_')?;
    let index: i64 = index.parse().ok()?;
    (index < MAX_GPUS_PER_RANK).then_some((index, suffix))
}

/// Run health, shared by the handlers (heartbeats), the admin view and the sweep.
#[derive(Clone)]
pub struct Health {
    inner: Arc<Inner>,
}

struct Inner {
    config: HealthConfig,
    store: Store,
    mlflow: MlflowClient,
    /// The proxy's own tag writes join their run's write queue, so they keep their order with
    /// the client's writes and never overlap them at MLflow.
    coalescer: Coalescer,
    metrics: Metrics,
    replica_id: String,
    pending: Mutex<HashMap<(String, String, i64), RankRow>>,
    /// Idle-clock windows per (run, node, rank, GPU) since the last flush.
    pending_idle: Mutex<HashMap<(String, String, i64, i64), IdleWindow>>,
    /// Reports of what runs stood on since the last flush, as heard.
    pending_findings: Mutex<Vec<FindingRow>>,
    /// Runs written to (any accepted metric write) since the last flush, with the latest time.
    writes: Mutex<HashMap<String, i64>>,
    /// Bills of runs ended by their clients being written to the store in the background.
    queueing: Arc<tokio::sync::Semaphore>,
}

impl Health {
    pub fn new(
        config: HealthConfig,
        store: Store,
        forwarder: Forwarder,
        coalescer: Coalescer,
        metrics: Metrics,
        replica_id: String,
    ) -> Self {
        Health {
            inner: Arc::new(Inner {
                config,
                store,
                mlflow: MlflowClient::new(forwarder),
                coalescer,
                metrics,
                replica_id,
                pending: Mutex::new(HashMap::new()),
                pending_idle: Mutex::new(HashMap::new()),
                pending_findings: Mutex::new(Vec::new()),
                writes: Mutex::new(HashMap::new()),
                queueing: Arc::new(tokio::sync::Semaphore::new(MAX_QUEUEING_BILLS)),
            }),
        }
    }

    pub fn config(&self) -> &HealthConfig {
        &self.inner.config
    }

    /// Records what an accepted request said, as heard at `now_ms`. Cheap: memory only.
    pub fn record(&self, beat: Beat, now_ms: i64) {
        // A sample stamped in the future (a wrong clock, or a forged one) counts as heard now.
        let at = |ms: i64| if ms > 0 { ms.min(now_ms) } else { now_ms };
        if !beat.findings.is_empty() {
            let mut pending = self.inner.pending_findings.lock().expect("health lock");
            for finding in &beat.findings {
                if pending.len() < MAX_PENDING_RANKS {
                    pending.push(finding.clone().row(&beat.run_id, now_ms));
                } else {
                    self.inner.metrics.heartbeat_dropped();
                }
            }
        }
        {
            let mut pending_idle = self.inner.pending_idle.lock().expect("health lock");
            for rank in &beat.ranks {
                let mut readings = rank.idle_readings.clone();
                readings.sort_by_key(|&(gpu, ms, _)| (gpu, ms));
                for (gpu, ms, idle) in readings {
                    let key = (beat.run_id.clone(), rank.node.clone(), rank.rank, gpu);
                    if let Some(window) = pending_idle.get_mut(&key) {
                        window.push(at(ms), idle);
                    } else if pending_idle.len() < MAX_PENDING_RANKS {
                        pending_idle.insert(key, IdleWindow::new(at(ms), idle));
                    } else {
                        self.inner.metrics.heartbeat_dropped();
                    }
                }
            }
        }
        let mut pending = self.inner.pending.lock().expect("health lock");
        for rank in beat.ranks {
            let key = (beat.run_id.clone(), rank.node.clone(), rank.rank);
            if !pending.contains_key(&key) && pending.len() >= MAX_PENDING_RANKS {
                self.inner.metrics.heartbeat_dropped();
                continue;
            }
            let entry = pending.entry(key).or_insert_with(|| RankRow {
                run_id: beat.run_id.clone(),
                node: rank.node.clone(),
                rank: rank.rank,
                first_heard_ms: now_ms,
                last_heard_ms: now_ms,
                ..RankRow::default()
            });
            if beat.workspace.is_some() {
                entry.workspace = beat.workspace.clone();
            }
            if now_ms > entry.last_heard_ms {
                entry.interval_ms = Some(now_ms - entry.last_heard_ms);
                entry.last_heard_ms = now_ms;
            }
            if let Some((first, last)) = rank.sampled_between {
                let (first, last) = (at(first), at(last));
                entry.bill_first_ms = Some(entry.bill_first_ms.map_or(first, |f| f.min(first)));
                entry.bill_last_ms = Some(entry.bill_last_ms.map_or(last, |l| l.max(last)));
            }
            if rank.sampled {
                entry.last_sample_ms = Some(now_ms);
                // The rank samples again well after its reported end: the end no longer holds
                // (the store applies the same rule to an end it already has).
                if entry
                    .ended_ms
                    .is_some_and(|ended| now_ms > ended + SUPERSEDE_AFTER_MS)
                {
                    entry.outcome = None;
                    entry.exit_code = None;
                    entry.ended_ms = None;
                }
            }
            if rank.outcome.is_some() {
                entry.outcome = rank.outcome;
                entry.ended_ms = Some(now_ms);
            }
            entry.exit_code = rank.exit_code.or(entry.exit_code);
            entry.pod = rank.pod.or(entry.pod.take());
            entry.gpu_model = rank.gpu_model.or(entry.gpu_model.take());
            if let Some(basis) = rank.gpu_idle_basis {
                entry.gpu_idle_basis = Some(basis.to_owned());
            }
            entry.memory_limit_mb = rank.memory_limit_mb.or(entry.memory_limit_mb);
            entry.cpu_limit_cores = rank.cpu_limit_cores.or(entry.cpu_limit_cores);
            entry.gpus = entry.gpus.max(rank.gpus);
            if rank.gpu_idle.iter().any(Option::is_some) {
                let idle: Vec<Value> = rank
                    .gpu_idle
                    .iter()
                    .map(|v| v.map_or(Value::Null, |s| json!(s)))
                    .collect();
                entry.gpu_idle = Some(Value::Array(idle).to_string());
                entry.gpu_idle_ms = Some(now_ms);
            }
        }
    }

    /// Records that MLflow accepted a write to `run_id` at `now_ms`: a sign of life for the run
    /// even when it carried no system samples (a training loop logging its loss). Memory only;
    /// a run the store has no ranks of is not added by it.
    pub fn touch(&self, run_id: &str, now_ms: i64) {
        let mut writes = self.inner.writes.lock().expect("health lock");
        if let Some(latest) = writes.get_mut(run_id) {
            *latest = (*latest).max(now_ms);
        } else if writes.len() < MAX_PENDING_RANKS {
            writes.insert(run_id.to_owned(), now_ms);
        } else {
            self.inner.metrics.heartbeat_dropped();
        }
    }

    /// Writes the buffered heartbeats to the store; on failure they stay buffered.
    pub async fn flush(&self) {
        self.flush_writes().await;
        self.flush_ranks().await;
        self.flush_idle().await;
        self.flush_findings().await;
    }

    async fn flush_findings(&self) {
        let rows: Vec<FindingRow> =
            std::mem::take(&mut *self.inner.pending_findings.lock().expect("health lock"));
        if rows.is_empty() {
            return;
        }
        match self.inner.store.record_findings(&rows).await {
            Ok(inserted) => {
                for (row, new) in rows.iter().zip(inserted) {
                    if let Some(kind) = findings::counted_kind(row).filter(|_| new) {
                        self.inner.metrics.finding(kind);
                    }
                }
            }
            Err(error) => {
                tracing::warn!(%error, reports = rows.len(), "recording data changes and leftovers failed; kept for the next flush");
                self.inner.metrics.health_error("store");
                let mut pending = self.inner.pending_findings.lock().expect("health lock");
                let room = MAX_PENDING_RANKS.saturating_sub(pending.len());
                pending.extend(rows.into_iter().take(room));
            }
        }
    }

    async fn flush_idle(&self) {
        let windows: Vec<GpuIdleRow> = {
            let mut pending = self.inner.pending_idle.lock().expect("health lock");
            if pending.is_empty() {
                return;
            }
            pending
                .drain()
                .map(|((run_id, node, rank, gpu), w)| GpuIdleRow {
                    run_id,
                    node,
                    rank,
                    gpu,
                    first_ms: w.first_ms,
                    first_idle: w.first_idle,
                    last_ms: w.last_ms,
                    last_idle: w.last_idle,
                    idle_s: w.idle_s,
                })
                .collect()
        };
        if let Err(error) = self.inner.store.record_gpu_idle(&windows).await {
            tracing::warn!(%error, gpus = windows.len(), "recording GPU idle clocks failed; kept for the next flush");
            self.inner.metrics.health_error("store");
            let mut pending = self.inner.pending_idle.lock().expect("health lock");
            for row in windows {
                let window = row.window();
                let key = (row.run_id, row.node, row.rank, row.gpu);
                let room = pending.len() < MAX_PENDING_RANKS;
                match pending.get_mut(&key) {
                    Some(newer) => {
                        let mut merged = window;
                        merged.merge(newer);
                        *newer = merged;
                    }
                    None if room => {
                        pending.insert(key, window);
                    }
                    None => {}
                }
            }
        }
    }

    async fn flush_writes(&self) {
        let writes: Vec<(String, i64)> = {
            let mut writes = self.inner.writes.lock().expect("health lock");
            writes.drain().collect()
        };
        if writes.is_empty() {
            return;
        }
        if let Err(error) = self.inner.store.record_writes(&writes).await {
            tracing::warn!(%error, runs = writes.len(), "recording writes failed; kept for the next flush");
            self.inner.metrics.health_error("store");
            let mut pending = self.inner.writes.lock().expect("health lock");
            for (run_id, ms) in writes {
                if pending.len() < MAX_PENDING_RANKS || pending.contains_key(&run_id) {
                    let latest = pending.entry(run_id).or_insert(ms);
                    *latest = (*latest).max(ms);
                }
            }
        }
    }

    async fn flush_ranks(&self) {
        let batch: Vec<RankRow> = {
            let mut pending = self.inner.pending.lock().expect("health lock");
            if pending.is_empty() {
                return;
            }
            pending.drain().map(|(_, update)| update).collect()
        };
        if let Err(error) = self.inner.store.record_ranks(&batch).await {
            tracing::warn!(%error, ranks = batch.len(), "recording heartbeats failed; kept for the next flush");
            self.inner.metrics.health_error("store");
            let mut pending = self.inner.pending.lock().expect("health lock");
            for update in batch {
                let key = (update.run_id.clone(), update.node.clone(), update.rank);
                // Newer heartbeats gathered meanwhile win; the failed batch fills the rest and
                // keeps the earliest first heartbeat and sample (the start of the bill).
                let room = pending.len() < MAX_PENDING_RANKS;
                match pending.get_mut(&key) {
                    Some(newer) => merge_older(newer, update),
                    None if room => {
                        pending.insert(key, update);
                    }
                    None => self.inner.metrics.heartbeat_dropped(),
                }
            }
        }
    }

    /// Flushes every `flush_interval` and sweeps every `sweep_interval`, until aborted.
    pub fn spawn(&self) -> tokio::task::JoinHandle<()> {
        let health = self.clone();
        tokio::spawn(async move {
            let mut flush = tokio::time::interval(health.inner.config.flush_interval);
            let mut sweep = tokio::time::interval(health.inner.config.sweep_interval);
            flush.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = flush.tick() => health.flush().await,
                    _ = sweep.tick() => {
                        health.flush().await;
                        health.sweep(unix_millis(SystemTime::now())).await;
                    }
                }
            }
        })
    }

    /// Refreshes the gauges and, on the replica holding the sweep lease, judges open runs.
    pub async fn sweep(&self, now_ms: i64) {
        let config = &self.inner.config;
        let stale_ms = config.stale_after.as_millis() as i64;
        // Every open run the store still keeps (retention drops older rows), read once: the
        // live ones are gauged, and the replica holding the sweep lease judges them all.
        let rows = match self.inner.store.ranks_of_open_runs(0, MAX_SWEPT_RUNS).await {
            Ok(rows) => rows,
            Err(error) => {
                tracing::warn!(%error, "reading open runs failed");
                self.inner.metrics.health_error("store");
                return;
            }
        };
        let live = by_run(&rows)
            .filter(|ranks| ranks.iter().any(|r| r.last_heard_ms >= now_ms - stale_ms))
            .take(MAX_GAUGE_RUNS);
        self.inner.metrics.set_live_runs(&self.gauges(live, now_ms));
        let lease_until = now_ms + 3 * config.sweep_interval.as_millis() as i64;
        match self
            .inner
            .store
            .hold_lease(SWEEP_LEASE, &self.inner.replica_id, now_ms, lease_until)
            .await
        {
            Ok(true) => {}
            Ok(false) => return,
            Err(error) => {
                tracing::warn!(%error, "taking the stale-run sweep lease failed");
                self.inner.metrics.health_error("store");
                return;
            }
        }
        let mut clean_ends_asked = 0;
        for ranks in by_run(&rows) {
            match judge(ranks, now_ms, config.stale_after) {
                Some(judgement) => {
                    self.carry_out(&ranks[0].run_id, ranks, &judgement, now_ms)
                        .await
                }
                None if ended_cleanly(ranks) && clean_ends_asked < MAX_CLEAN_ENDS_PER_SWEEP => {
                    clean_ends_asked += 1;
                    self.bill_clean_end(&ranks[0].run_id, ranks, now_ms).await;
                }
                None => {}
            }
        }
        let billed = self.bill_due(now_ms).await;
        let live = by_run(&rows)
            .filter(|ranks| ranks.iter().any(|r| r.last_heard_ms >= now_ms - stale_ms))
            .filter(|ranks| !billed.contains(&ranks[0].run_id))
            .take(MAX_GAUGE_RUNS);
        self.mark_idle_gpus(live, now_ms).await;
    }

    /// A run whose ranks all exited 0 is its client's to end, and the sweep leaves it alone;
    /// once MLflow has it ended (straight, not through the proxy) its bill is queued here.
    async fn bill_clean_end(&self, run_id: &str, ranks: &[RankRow], now_ms: i64) {
        let status = match self.get_run(&self.run_caller(ranks), run_id).await {
            Ok(run) => run.info.status.unwrap_or_default(),
            Err((reason, error)) => {
                tracing::warn!(run_id, error, "asking MLflow whether a run ended failed");
                self.inner.metrics.health_error(reason);
                return;
            }
        };
        if !matches!(status.as_str(), "FINISHED" | "FAILED" | "KILLED") {
            return;
        }
        // MLflow's end time clips the bill (read again when it is billed).
        let settle = 2 * self.inner.config.flush_interval.as_millis() as i64 + 1_000;
        if let Err(error) = self
            .inner
            .store
            .queue_bill(run_id, &status, None, now_ms + settle)
            .await
        {
            tracing::warn!(%error, run_id, "queueing the bill of a run ended at MLflow failed");
            self.inner.metrics.health_error("store");
        }
    }

    /// Bills every run whose bill is due, each claimed first so that one replica bills it;
    /// returns the runs due (ended: no idle-GPU tag for them any more).
    async fn bill_due(&self, now_ms: i64) -> std::collections::HashSet<String> {
        // A claim older than a few sweeps was abandoned (its replica died) or failed: due again.
        let abandoned_before = now_ms - 4 * self.inner.config.sweep_interval.as_millis() as i64;
        let due = match self
            .inner
            .store
            .due_bills(now_ms, abandoned_before, MAX_BILLS_PER_SWEEP)
            .await
        {
            Ok(due) => due,
            Err(error) => {
                tracing::warn!(%error, "reading due bills failed");
                self.inner.metrics.health_error("store");
                return Default::default();
            }
        };
        let ended = due.iter().map(|b| b.run_id.clone()).collect();
        for bill in due {
            match self
                .inner
                .store
                .claim_bill(
                    &bill.run_id,
                    &self.inner.replica_id,
                    now_ms,
                    abandoned_before,
                )
                .await
            {
                Ok(true) => self.bill_run(&bill, now_ms).await,
                Ok(false) => {}
                Err(error) => {
                    tracing::warn!(%error, run_id = bill.run_id, "claiming a bill failed");
                    self.inner.metrics.health_error("store");
                }
            }
        }
        ended
    }

    /// Bills one claimed run: its figures as run tags, the fleet counters, the bill row done.
    /// A failure leaves the claim to be taken over in a later sweep.
    async fn bill_run(&self, claimed: &BillRow, now_ms: i64) {
        let run_id = claimed.run_id.as_str();
        let (ranks, idle) = match (
            self.inner.store.ranks_of_run(run_id).await,
            self.inner.store.gpu_idle_of_run(run_id).await,
        ) {
            (Ok(ranks), Ok(idle)) => (ranks, idle),
            (Err(error), _) | (_, Err(error)) => {
                tracing::warn!(%error, run_id, "reading a run to bill failed");
                self.inner.metrics.health_error("store");
                return;
            }
        };
        let caller = self.run_caller(&ranks);
        let run = match self.get_run(&caller, run_id).await {
            Ok(run) => run,
            Err((REJECTED, error)) => return self.give_up_bill(run_id, &error).await,
            Err((reason, error)) => {
                tracing::warn!(run_id, error, "reading a run to bill failed; retried later");
                self.inner.metrics.health_error(reason);
                return;
            }
        };
        let clip = clip_of(&run, claimed.end_ms, now_ms);
        let bill = bill::bill(&ranks, &idle, clip);
        let holds_gpus = bill.ranks.iter().any(|r| r.gpus > 0);
        if holds_gpus {
            let tags = bill_tags(&bill, basis::of_run(&ranks));
            if let Err((reason, error)) = self.write_tags(run_id, &caller, &tags).await {
                if reason == REJECTED {
                    return self.give_up_bill(run_id, &error).await;
                }
                tracing::warn!(
                    run_id,
                    error,
                    "writing a run's GPU bill failed; retried later"
                );
                self.inner.metrics.health_error(reason);
                return;
            }
        }
        // The run ended: its idle-GPU tag goes with it.
        if let Err((reason, error)) = self.clear_idle_tag(run_id, &caller).await {
            tracing::warn!(
                run_id,
                error,
                "removing the idle-GPU tag of an ended run failed"
            );
            self.inner.metrics.health_error(reason);
        }
        match self
            .inner
            .store
            .finish_bill(
                run_id,
                &self.inner.replica_id,
                bill.gpu_seconds,
                bill.idle_seconds,
            )
            .await
        {
            Ok(true) => {
                for (model, busy, idle) in bill.by_model() {
                    self.inner.metrics.gpu_seconds(&model, busy, idle);
                }
                if holds_gpus {
                    self.inner.metrics.run_billed();
                }
                tracing::info!(
                    run_id,
                    ended_by = claimed.ended_by,
                    gpu_hours = bill.gpu_hours(),
                    gpu_idle_hours = bill.idle_hours(),
                    "run billed"
                );
            }
            // Another replica took the claim over meanwhile: it counts the run.
            Ok(false) => {}
            Err(error) => {
                tracing::warn!(%error, run_id, "recording a bill failed");
                self.inner.metrics.health_error("store");
            }
        }
    }

    /// Marks a claimed bill done unbilled: MLflow refused the run for good (deleted, or
    /// garbage-collected), so retrying would only hold the queue.
    async fn give_up_bill(&self, run_id: &str, error: &str) {
        tracing::warn!(
            run_id,
            error,
            "MLflow refused a run's GPU bill for good; not billed"
        );
        self.inner.metrics.health_error(REJECTED);
        if let Err(error) = self
            .inner
            .store
            .give_up_bill(run_id, &self.inner.replica_id, error)
            .await
        {
            tracing::warn!(%error, run_id, "recording an unbillable run failed");
            self.inner.metrics.health_error("store");
        }
    }

    /// Names the GPUs of each live run idle past `--gpu-idle-after` in its [`IDLE_TAG`], written
    /// when the set changes (the store remembers what was written, whichever replica sweeps) and
    /// deleted when they all work again or the run is no longer live.
    async fn mark_idle_gpus<'a>(&self, live: impl Iterator<Item = &'a [RankRow]>, now_ms: i64) {
        let written = match self.inner.store.idle_tags(2 * MAX_GAUGE_RUNS as i64).await {
            Ok(rows) => rows,
            Err(error) => {
                tracing::warn!(%error, "reading idle-GPU tags failed");
                self.inner.metrics.health_error("store");
                return;
            }
        };
        let mut written: HashMap<String, String> = written.into_iter().collect();
        let idle_after = self.inner.config.gpu_idle_after.as_secs_f64();
        for ranks in live {
            let run_id = ranks[0].run_id.as_str();
            let value = idle_gpus(ranks, now_ms, idle_after);
            let before = written.remove(run_id);
            if before.as_deref() == value.as_deref() {
                continue;
            }
            let caller = self.run_caller(ranks);
            let done = match &value {
                Some(value) => {
                    let mut tags = vec![(IDLE_TAG.to_owned(), value.clone())];
                    tags.extend(
                        basis::of_run(ranks).map(|b| (basis::BASIS_TAG.to_owned(), truncate(&b))),
                    );
                    match self.write_tags(run_id, &caller, &tags).await {
                        Ok(()) => self
                            .inner
                            .store
                            .set_idle_tag(run_id, Some(value), now_ms)
                            .await
                            .map(|_| ())
                            .map_err(|e| ("store", e.to_string())),
                        Err(e) => Err(e),
                    }
                }
                None => self.clear_idle_tag(run_id, &caller).await,
            };
            if let Err((reason, error)) = done {
                tracing::warn!(
                    run_id,
                    error,
                    "updating the idle-GPU tag failed; retried next sweep"
                );
                self.inner.metrics.health_error(reason);
            }
        }
        // Tags of runs no longer live (silent, or ended without a bill yet).
        for run_id in written.into_keys() {
            let ranks = self
                .inner
                .store
                .ranks_of_run(&run_id)
                .await
                .unwrap_or_default();
            if let Err((reason, error)) =
                self.clear_idle_tag(&run_id, &self.run_caller(&ranks)).await
            {
                tracing::warn!(run_id, error, "removing an idle-GPU tag failed");
                self.inner.metrics.health_error(reason);
            }
        }
    }

    /// Deletes the run's [`IDLE_TAG`] in MLflow when the store says it was written.
    async fn clear_idle_tag(
        &self,
        run_id: &str,
        caller: &Caller,
    ) -> Result<(), (&'static str, String)> {
        let written = self
            .inner
            .store
            .idle_tags_of(run_id)
            .await
            .map_err(|e| ("store", e.to_string()))?;
        if !written {
            return Ok(());
        }
        match self.inner.mlflow.delete_tag(caller, run_id, IDLE_TAG).await {
            Ok(()) => {}
            // Already gone (deleted by someone, or never stored): nothing left to remove.
            Err(e)
                if !e.refused_credential() && e.error_code() == Some("RESOURCE_DOES_NOT_EXIST") => {
            }
            Err(e) => return Err(failure(e)),
        }
        self.inner
            .store
            .set_idle_tag(run_id, None, 0)
            .await
            .map_err(|e| ("store", e.to_string()))
    }

    /// Writes run tags through the run's write queue.
    async fn write_tags(
        &self,
        run_id: &str,
        caller: &Caller,
        tags: &[(String, String)],
    ) -> Result<(), (&'static str, String)> {
        let tags: Vec<RunTag> = tags.iter().cloned().map(RunTag::from).collect();
        self.inner
            .coalescer
            .set_tags(caller, run_id, &tags)
            .await
            .map_err(failure)
    }

    /// The service credential, and the workspace the run's ranks wrote in (MLflow finds the run
    /// only there).
    fn run_caller(&self, ranks: &[RankRow]) -> Caller {
        Caller::service(&self.inner.config.credential)
            .in_workspace(ranks.iter().find_map(|r| r.workspace.as_deref()))
    }

    async fn get_run(&self, caller: &Caller, run_id: &str) -> Result<Run, (&'static str, String)> {
        self.inner
            .mlflow
            .get_run(caller, run_id)
            .await
            .map_err(failure)
    }

    /// After MLflow accepted a `runs/update` that ends or resumes a run: the store hears of it in
    /// the background, so the client's answer does not wait on the store; with
    /// [`MAX_QUEUEING_BILLS`] already under way, in line.
    async fn after_update(&self, run_id: String, status: String, end_ms: Option<i64>, now_ms: i64) {
        match self.inner.queueing.clone().try_acquire_owned() {
            Ok(permit) => {
                let health = self.clone();
                tokio::spawn(
                    async move {
                        health
                            .updated_by_client(&run_id, &status, end_ms, now_ms)
                            .await;
                        drop(permit);
                    }
                    .in_current_span(),
                );
            }
            Err(_) => {
                self.updated_by_client(&run_id, &status, end_ms, now_ms)
                    .await
            }
        }
    }

    /// A run its client ended is queued for its bill; one it resumed (`RUNNING`) is open again.
    async fn updated_by_client(
        &self,
        run_id: &str,
        status: &str,
        end_ms: Option<i64>,
        now_ms: i64,
    ) {
        if status != "RUNNING" {
            return self.ended_by_client(run_id, status, end_ms, now_ms).await;
        }
        if let Err(error) = self.inner.store.reopen_run(run_id, now_ms).await {
            tracing::warn!(%error, run_id, "reopening a run its client resumed failed");
            self.inner.metrics.health_error("store");
        }
    }

    /// A terminal status queues the run's bill, due once every replica has flushed what it
    /// heard until now.
    async fn ended_by_client(&self, run_id: &str, status: &str, end_ms: Option<i64>, now_ms: i64) {
        let settle = 2 * self.inner.config.flush_interval.as_millis() as i64 + 1_000;
        // The client's end as far as it can be true now (one at or before the epoch, or none:
        // now; one in the future: now); one before the run's start is dropped at billing.
        let end_ms = Clip::new(None, end_ms, now_ms).end_ms.unwrap_or(now_ms);
        if let Err(error) = self
            .inner
            .store
            .queue_bill(run_id, status, Some(end_ms), now_ms + settle)
            .await
        {
            tracing::warn!(%error, run_id, "queueing the bill of a run its client ended failed");
            self.inner.metrics.health_error("store");
        }
    }

    /// Per live run: GPUs allocated and GPUs idle past `--gpu-idle-after`.
    fn gauges<'a>(
        &self,
        runs: impl Iterator<Item = &'a [RankRow]>,
        now_ms: i64,
    ) -> Vec<(String, i64, i64)> {
        let idle_after = self.inner.config.gpu_idle_after.as_secs_f64();
        runs.map(|ranks| {
            let live = ranks.iter().filter(|r| r.outcome.is_none());
            let (mut allocated, mut idle) = (0, 0);
            for rank in live {
                let gpus = gpu_idle_of(rank, now_ms);
                allocated += rank.gpus.max(gpus.len() as i64);
                idle += gpus
                    .iter()
                    .filter(|s| s.is_some_and(|s| s >= idle_after))
                    .count() as i64;
            }
            (ranks[0].run_id.clone(), allocated, idle)
        })
        .collect()
    }

    /// Claims the run, asks MLflow whether it still runs, and tags and ends it.
    async fn carry_out(&self, run_id: &str, ranks: &[RankRow], judgement: &Judgement, now_ms: i64) {
        let config = &self.inner.config;
        let claim = VerdictRow {
            run_id: run_id.to_owned(),
            outcome: judgement.outcome.as_str().to_owned(),
            action: config.action.as_str().to_owned(),
            detail: judgement.detail.clone(),
            replica: self.inner.replica_id.clone(),
            claimed_ms: now_ms,
            done: 0,
        };
        // A claim older than a few sweeps was abandoned by a replica that died mid-way.
        let abandoned_before = now_ms - 4 * config.sweep_interval.as_millis() as i64;
        match self
            .inner
            .store
            .claim_verdict(&claim, abandoned_before)
            .await
        {
            Ok(true) => {}
            Ok(false) => return,
            Err(error) => {
                tracing::warn!(%error, run_id, "claiming a stale run failed");
                self.inner.metrics.health_error("store");
                return;
            }
        }
        let finished = match self.act(run_id, ranks, judgement).await {
            Ok(Acted::Done) => (judgement.outcome.as_str(), config.action.as_str()),
            Ok(Acted::EndedByClient(status)) => {
                tracing::info!(
                    run_id,
                    status,
                    "run judged dead was ended by its client meanwhile; left as it is"
                );
                ("ended_by_client", "none")
            }
            Err((reason, error)) => {
                tracing::warn!(
                    run_id,
                    error,
                    "acting on a dead run failed; retried in a later sweep"
                );
                self.inner.metrics.health_error(reason);
                return;
            }
        };
        self.inner.metrics.run_judged(finished.0, finished.1);
        tracing::info!(
            run_id,
            outcome = finished.0,
            action = finished.1,
            detail = judgement.detail,
            "stale run judged"
        );
        if let Err(error) = self
            .inner
            .store
            .finish_verdict(
                run_id,
                &self.inner.replica_id,
                finished.0,
                finished.1,
                &judgement.detail,
            )
            .await
        {
            tracing::warn!(%error, run_id, "recording a verdict failed");
            self.inner.metrics.health_error("store");
        }
        // Billed at its last sign of life; a run its client had ended, at MLflow's end time.
        let end_ms = (finished.1 != "none").then_some(judgement.end_time_ms);
        if let Err(error) = self
            .inner
            .store
            .queue_bill(run_id, finished.0, end_ms, now_ms)
            .await
        {
            tracing::warn!(%error, run_id, "queueing the bill of a judged run failed");
            self.inner.metrics.health_error("store");
        }
    }

    async fn act(
        &self,
        run_id: &str,
        ranks: &[RankRow],
        judgement: &Judgement,
    ) -> Result<Acted, (&'static str, String)> {
        let caller = self.run_caller(ranks);
        let run = self.get_run(&caller, run_id).await?;
        let status = run.info.status.as_deref().unwrap_or_default();
        if status != "RUNNING" {
            return Ok(Acted::EndedByClient(status.to_owned()));
        }
        let note = run.tag("mlflow.note.content").unwrap_or_default();
        let tags = self.tags(ranks, judgement, note);
        // The verdict's tags join the run's write queue, as every tag the proxy writes: a rank
        // that comes back to life meanwhile has its writes stored in order with them.
        self.write_tags(run_id, &caller, &tags).await?;
        if self.inner.config.action == StaleAction::End {
            let update = UpdateRun {
                run_id,
                run_uuid: run_id,
                status: "FAILED",
                end_time: Some(judgement.end_time_ms),
            };
            self.inner
                .mlflow
                .update_run(&caller, &update)
                .await
                .map_err(failure)?;
        }
        Ok(Acted::Done)
    }

    /// The tags a judged run gets: the outcome where the UI shows it (the description), and the
    /// facts behind it.
    fn tags(&self, ranks: &[RankRow], judgement: &Judgement, note: &str) -> Vec<(String, String)> {
        let outcome = judgement.outcome.as_str();
        let action = match self.inner.config.action {
            StaleAction::End => format!(
                "ended the run as FAILED at its last sign of life, {}",
                judge::timestamp(judgement.end_time_ms)
            ),
            StaleAction::Tag => {
                "tagged the run and left it RUNNING (--stale-run-action tag)".to_owned()
            }
        };
        let mut last_heard: Vec<String> = ranks
            .iter()
            .map(|r| {
                let mut text = format!(
                    "{}: {}",
                    judge::rank_label(&r.node, r.rank),
                    judge::timestamp(r.last_heard_ms)
                );
                if let Some(outcome) = &r.outcome {
                    text.push_str(&format!(" ({outcome})"));
                }
                text
            })
            .collect();
        last_heard.sort();
        let summary = format!(
            "**mlscope: outcome {outcome}.** {}. mlscope-proxy {action}.",
            judgement.detail
        );
        let description = if note.is_empty() {
            summary.clone()
        } else {
            format!("{note}\n\n{summary}")
        };
        let mut tags = vec![
            ("mlscope.outcome".to_owned(), outcome.to_owned()),
            (
                "mlscope.outcome_detail".to_owned(),
                truncate(&judgement.detail),
            ),
            (
                "mlscope.last_heard".to_owned(),
                truncate(&last_heard.join("; ")),
            ),
            (
                "mlscope.silent_nodes".to_owned(),
                truncate(&judgement.silent_nodes.join(",")),
            ),
            (
                "mlscope.judged_by".to_owned(),
                format!("mlscope-proxy {}", self.inner.replica_id),
            ),
            ("mlflow.note.content".to_owned(), truncate(&description)),
        ];
        // One tag per rank, for the first ranks only: a run's tags stay bounded however many
        // ranks it had (the health view lists them all).
        for r in ranks.iter().filter(|r| r.rank >= 0).take(MAX_RANK_TAGS) {
            tags.push((
                format!("mlscope/rank-{}/last_heard", r.rank),
                judge::timestamp(r.last_heard_ms),
            ));
        }
        tags
    }

    /// The admin view of one run; `None` when no heartbeat of it is known.
    /// The run's health with the ranks of one page: `ranks[offset..offset + limit]` (the totals
    /// count every rank).
    pub async fn view(
        &self,
        run_id: &str,
        now_ms: i64,
        offset: usize,
        limit: usize,
    ) -> Result<Option<RunHealth>, String> {
        let ranks = self
            .inner
            .store
            .ranks_of_run(run_id)
            .await
            .map_err(|e| e.to_string())?;
        if ranks.is_empty() {
            return Ok(None);
        }
        let verdict = self
            .inner
            .store
            .verdict(run_id)
            .await
            .map_err(|e| e.to_string())?;
        let config = &self.inner.config;
        let idle_after = config.gpu_idle_after.as_secs_f64();
        let judgement = judge(&ranks, now_ms, config.stale_after);
        // The bill so far (a live run), or as billed (an ended one: the figures of its tags).
        let billed = self
            .inner
            .store
            .bill_of(run_id)
            .await
            .map_err(|e| e.to_string())?;
        let state = match (&verdict, &judgement) {
            (Some(v), _) if v.done == 1 => "judged",
            (Some(_), _) => "being_judged",
            // Its client ended it through the proxy: the sweep leaves it alone.
            (None, _) if billed.as_ref().is_some_and(|b| b.reopened_ms.is_none()) => "ended",
            (None, Some(_)) => "dead",
            (None, None) if ranks.iter().all(|r| r.outcome.is_some()) => "ended",
            (None, None) => "live",
        };
        let (mut gpus_allocated, mut gpus_idle) = (0, 0);
        for r in ranks.iter().filter(|r| r.outcome.is_none()) {
            let idle = gpu_idle_of(r, now_ms);
            gpus_allocated += r.gpus.max(idle.len() as i64) as usize;
            gpus_idle += idle
                .iter()
                .filter(|s| s.is_some_and(|s| s >= idle_after))
                .count();
        }
        let idle_rows = self
            .inner
            .store
            .gpu_idle_of_run(run_id)
            .await
            .map_err(|e| e.to_string())?;
        let finding_rows = self
            .inner
            .store
            .findings_of_run(run_id)
            .await
            .map_err(|e| e.to_string())?;
        // Clipped as the bill is (MLflow's start and end of the run), so a rank's figures here
        // are those of its tags; without MLflow's answer, to the queued end only.
        let queued_end = billed.as_ref().and_then(|b| b.end_ms);
        let clip = match self.get_run(&self.run_caller(&ranks), run_id).await {
            Ok(run) => clip_of(&run, queued_end, now_ms),
            Err((_, error)) => {
                tracing::debug!(run_id, error, "run health view without MLflow's start time");
                Clip::new(None, queued_end, now_ms)
            }
        };
        let run_bill = bill::bill(&ranks, &idle_rows, clip);
        let (gpu_seconds, idle_seconds) = match &billed {
            Some(BillRow {
                done: 1,
                gpu_seconds: Some(gpu),
                idle_seconds: Some(idle),
                ..
            }) => (*gpu, *idle),
            _ => (run_bill.gpu_seconds, run_bill.idle_seconds),
        };
        let totals = RunBill {
            gpu_seconds,
            idle_seconds,
            ranks: Vec::new(),
        };
        let end = offset.saturating_add(limit).min(ranks.len());
        let rank_views: Vec<RankHealth> = ranks
            .get(offset.min(end)..end)
            .unwrap_or_default()
            .iter()
            .map(|r| {
                let idle = gpu_idle_of(r, now_ms);
                let gpus: Vec<GpuHealth> = (0..r.gpus.max(idle.len() as i64))
                    .map(|index| {
                        let idle_seconds = idle.get(index as usize).copied().flatten();
                        GpuHealth {
                            index,
                            idle_seconds,
                            idle: idle_seconds.is_some_and(|s| s >= idle_after),
                        }
                    })
                    .collect();
                let rank_bill = run_bill
                    .ranks
                    .iter()
                    .find(|b| b.node == r.node && b.rank == r.rank);
                RankHealth {
                    gpu_hours: rank_bill.map_or(0.0, |b| b.gpu_seconds / 3600.0),
                    gpu_idle_hours: rank_bill.map_or(0.0, |b| b.idle_seconds / 3600.0),
                    node: r.node.clone(),
                    rank: r.rank,
                    pod: r.pod.clone(),
                    first_heard: judge::timestamp(r.first_heard_ms),
                    last_heard: judge::timestamp(r.last_heard_ms),
                    silent_for_seconds: ((now_ms - r.last_heard_ms).max(0) as f64) / 1e3,
                    interval_seconds: r.interval_ms.map(|ms| ms as f64 / 1e3),
                    outcome: r.outcome.clone(),
                    exit_code: r.exit_code,
                    memory_limit_megabytes: r.memory_limit_mb,
                    cpu_limit_cores: r.cpu_limit_cores,
                    gpu_model: r.gpu_model.clone(),
                    gpu_idle_basis: basis::of_rank(r).map(str::to_owned),
                    gpus,
                    leftovers: findings::leftovers_of(&finding_rows, &r.node, r.rank),
                }
            })
            .collect();
        Ok(Some(RunHealth {
            run_id: run_id.to_owned(),
            state,
            outcome: verdict
                .as_ref()
                .map(|v| v.outcome.clone())
                .or_else(|| judgement.as_ref().map(|j| j.outcome.as_str().to_owned())),
            detail: verdict
                .as_ref()
                .map(|v| v.detail.clone())
                .or_else(|| judgement.as_ref().map(|j| j.detail.clone())),
            action: verdict.as_ref().map(|v| v.action.clone()),
            stale_after_seconds: config.stale_after.as_secs_f64(),
            gpu_idle_after_seconds: idle_after,
            gpus_allocated,
            gpus_idle,
            gpus_idle_tag: idle_gpus(&ranks, now_ms, idle_after),
            gpu_idle_basis: basis::of_run(&ranks).map(|b| truncate(&b)),
            bill: match &billed {
                Some(b) if b.done == 1 && b.failure.is_some() => "not_billed",
                Some(b) if b.done == 1 => "billed",
                Some(_) => "ended",
                None => "running",
            },
            gpu_hours: totals.gpu_hours(),
            gpu_idle_hours: totals.idle_hours(),
            gpu_idle_fraction: totals.idle_fraction(),
            data_changes: findings::data_changes(&finding_rows),
            rank_count: ranks.len(),
            ranks: rank_views,
            next_page_token: (end < ranks.len()).then(|| end.to_string()),
        }))
    }
}

/// A failed call to MLflow as the sweep counts it (`refused`: the service credential;
/// [`REJECTED`]: for good; `mlflow`: anything else) and logs it.
fn failure(error: MlflowError) -> (&'static str, String) {
    if error.refused_credential() {
        if let MlflowError::Refused { path, status, .. } = &error {
            return (
                "refused",
                format!(
                    "MLflow answered {status} to {path}: give the proxy a service credential that may edit runs (--mlflow-service-token, or --mlflow-service-username and --mlflow-service-password)"
                ),
            );
        }
    }
    let reason = if error.refused_for_good() {
        REJECTED
    } else {
        "mlflow"
    };
    (reason, error.to_string())
}

/// The reason of an answer that asking again will not change (see
/// [`MlflowError::refused_for_good`]).
const REJECTED: &str = "rejected";

/// The tags of a billed run: totals under `mlscope.` with what idleness was judged on
/// (`basis`, [`basis::BASIS_TAG`]), and per rank (the first [`MAX_RANK_TAGS`]) under
/// `mlscope/rank-<r>/`, as the sweep's other tags.
fn bill_tags(bill: &RunBill, basis: Option<String>) -> Vec<(String, String)> {
    let mut tags = vec![
        (
            "mlscope.gpu_hours".to_owned(),
            bill::hours(bill.gpu_hours()),
        ),
        (
            "mlscope.gpu_idle_hours".to_owned(),
            bill::hours(bill.idle_hours()),
        ),
        (
            "mlscope.gpu_idle_fraction".to_owned(),
            format!("{:.4}", bill.idle_fraction()),
        ),
    ];
    if let Some(basis) = basis {
        tags.push((basis::BASIS_TAG.to_owned(), truncate(&basis)));
    }
    for (rank, gpu_seconds, idle_seconds) in bill.per_rank().into_iter().take(MAX_RANK_TAGS) {
        tags.push((
            format!("mlscope/rank-{rank}/gpu_hours"),
            bill::hours(gpu_seconds / 3600.0),
        ));
        tags.push((
            format!("mlscope/rank-{rank}/gpu_idle_hours"),
            bill::hours(idle_seconds / 3600.0),
        ));
    }
    tags
}

/// The value of a live run's [`IDLE_TAG`]: its GPUs idle for at least `idle_after` seconds, as
/// `rank-0:gpu1, rank-1:gpu0`; `None` when none is.
fn idle_gpus(ranks: &[RankRow], now_ms: i64, idle_after: f64) -> Option<String> {
    let mut idle: Vec<(i64, String, i64)> = Vec::new();
    for r in ranks.iter().filter(|r| r.outcome.is_none()) {
        for (gpu, seconds) in gpu_idle_of(r, now_ms).into_iter().enumerate() {
            if seconds.is_some_and(|s| s >= idle_after) {
                idle.push((r.rank, r.node.clone(), gpu as i64));
            }
        }
    }
    if idle.is_empty() {
        return None;
    }
    idle.sort();
    let names: Vec<String> = idle
        .into_iter()
        .map(|(rank, node, gpu)| match (rank >= 0, node.is_empty()) {
            (true, _) => format!("rank-{rank}:gpu{gpu}"),
            (false, false) => format!("{node}:gpu{gpu}"),
            (false, true) => format!("monitor:gpu{gpu}"),
        })
        .collect();
    Some(truncate(&names.join(", ")))
}

/// `POST runs/update`: forwarded; once MLflow accepted a terminal status (`FINISHED`,
/// `FAILED`, `KILLED`) the run's GPU bill is queued. The run is the one MLflow acts on
/// (`run_id`, else `run_uuid`, read as MLflow reads them), so a client bills only a run MLflow
/// let it end. A body the handler does not read (over [`MAX_UPDATE_BYTES`]) goes on to MLflow
/// unchanged and unbilled; MLflow's answer is the client's in every case, and never waits on
/// the store.
pub async fn update_run(
    State(health): State<Health>,
    State(forwarder): State<Forwarder>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    request: Request,
) -> Response {
    if !health.inner.config.enabled {
        return forwarder.forward(request, peer).await;
    }
    let (parts, body) = match forwarder.read_small(request, MAX_UPDATE_BYTES, peer).await {
        Ok(read) => read,
        Err(answered) => return answered,
    };
    let ended = ended_by(&body);
    let response = forwarder
        .forward(Request::from_parts(parts, Body::from(body)), peer)
        .await;
    let Some((asked_run, status, end_ms)) = ended.filter(|_| response.status().is_success()) else {
        return response;
    };
    // The run MLflow updated is the one its answer describes: however the body spelled its run,
    // only that run is billed.
    let (response, updated) = updated_run(response).await;
    let run_id = match updated {
        Some(run_id) => run_id,
        // An answer without `run_info` (none of the versions in the field sends one): the body,
        // read as MLflow reads it.
        None => asked_run,
    };
    let now = unix_millis(SystemTime::now());
    health.after_update(run_id, status, end_ms, now).await;
    response
}

/// The run MLflow's answer to `runs/update` describes (`run_info.run_id`), and the answer,
/// whole again, for the client. An answer longer than [`MAX_UPDATE_BYTES`] is passed on as it
/// came, describing nothing.
async fn updated_run(response: Response) -> (Response, Option<String>) {
    let (parts, body) = response.into_parts();
    match crate::proxy::read_up_to(body, MAX_UPDATE_BYTES).await {
        Ok(Ok(bytes)) => {
            let run = serde_json::from_slice::<Value>(&bytes)
                .ok()
                .and_then(|answer| answer["run_info"]["run_id"].as_str().map(str::to_owned))
                .filter(|id| crate::writes::is_valid_run_id(id));
            (Response::from_parts(parts, Body::from(bytes)), run)
        }
        Ok(Err(unread)) => (Response::from_parts(parts, unread), None),
        Err(error) => {
            tracing::warn!(%error, "MLflow's answer to runs/update could not be read");
            (
                crate::error::Error::StoreFailed(
                    "mlscope-proxy lost MLflow's answer to runs/update while reading it; the update may have been applied, read the run before retrying".into(),
                )
                .into_response(),
                None,
            )
        }
    }
}

/// The longest `runs/update` body read for billing; a longer one is forwarded unread.
const MAX_UPDATE_BYTES: usize = crate::coalesce::MAX_BATCH_BYTES;
/// Bills being queued in the background at once; beyond it the next waits for the store.
const MAX_QUEUEING_BILLS: usize = 64;

/// The run a `runs/update` body ends (or resumes: `RUNNING`), with its status and the end it
/// names.
fn ended_by(body: &[u8]) -> Option<(String, String, Option<i64>)> {
    let run_id = crate::writes::run_of(body)?;
    let update: Value = serde_json::from_slice(body).ok()?;
    let status = match &update["status"] {
        Value::String(s) => s.clone(),
        Value::Number(n) => match n.as_i64() {
            Some(1) => "RUNNING".to_owned(),
            Some(3) => "FINISHED".to_owned(),
            Some(4) => "FAILED".to_owned(),
            Some(5) => "KILLED".to_owned(),
            _ => return None,
        },
        _ => return None,
    };
    let end_ms = match &update["end_time"] {
        Value::Number(n) => n.as_i64(),
        Value::String(s) => s.parse().ok(),
        _ => None,
    };
    matches!(
        status.as_str(),
        "FINISHED" | "FAILED" | "KILLED" | "RUNNING"
    )
    .then_some((run_id, status, end_ms))
}

enum Acted {
    Done,
    EndedByClient(String),
}

/// `GET /runs/{run_id}/health`.
#[derive(Debug, Serialize)]
pub struct RunHealth {
    pub run_id: String,
    /// `live`, `ended` (every rank reported its end, or the client ended the run through the
    /// proxy), `dead` (judged by the next sweep),
    /// `being_judged`, `judged`.
    pub state: &'static str,
    pub outcome: Option<String>,
    pub detail: Option<String>,
    /// What the sweep did: `end`, `tag`, or `none` (the client had ended the run).
    pub action: Option<String>,
    pub stale_after_seconds: f64,
    pub gpu_idle_after_seconds: f64,
    /// GPUs of ranks that have not ended, and how many of those are idle.
    pub gpus_allocated: usize,
    pub gpus_idle: usize,
    /// What the run's `mlscope.gpus_idle` tag names (or would, once the sweep writes it).
    pub gpus_idle_tag: Option<String>,
    /// What idleness is judged on: the run's `mlscope.gpu_idle_basis` tag; absent without GPUs.
    pub gpu_idle_basis: Option<String>,
    /// The GPU bill: `running` (so far), `ended` (queued, not written yet), `billed` (the
    /// figures of the run's tags), `not_billed` (MLflow refused the run for good: deleted).
    pub bill: &'static str,
    pub gpu_hours: f64,
    pub gpu_idle_hours: f64,
    pub gpu_idle_fraction: f64,
    /// Declared data that changed under the run, as its collectors reported it (the newest
    /// reports, with the ranks' leftovers at most `findings::MAX_FINDINGS_PER_RUN`), oldest first.
    pub data_changes: Vec<findings::DataChange>,
    /// Every rank of the run; `ranks` holds one page of them.
    pub rank_count: usize,
    pub ranks: Vec<RankHealth>,
    /// Where the next page starts (`?page_token=`); absent on the last page.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_page_token: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct RankHealth {
    pub node: String,
    pub rank: i64,
    pub pod: Option<String>,
    pub first_heard: String,
    pub last_heard: String,
    pub silent_for_seconds: f64,
    pub interval_seconds: Option<f64>,
    pub outcome: Option<String>,
    pub exit_code: Option<i64>,
    pub memory_limit_megabytes: Option<f64>,
    pub cpu_limit_cores: Option<f64>,
    pub gpu_model: Option<String>,
    /// `sm_active`, `utilization` or `mixed` (the collector's `gpu_idle_basis` tag;
    /// `utilization` when it sent none); absent without GPUs.
    pub gpu_idle_basis: Option<String>,
    pub gpus: Vec<GpuHealth>,
    /// This rank's share of the bill.
    pub gpu_hours: f64,
    pub gpu_idle_hours: f64,
    /// What its command left running when it exited, how that was ended, and GPU memory still
    /// held after (wrapper mode); absent when the rank reported none of it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leftovers: Option<findings::Leftovers>,
}

#[derive(Debug, Serialize)]
pub struct GpuHealth {
    pub index: i64,
    /// Seconds idle as of now (the collector's last report plus the time since).
    pub idle_seconds: Option<f64>,
    pub idle: bool,
}

/// The rank's GPU idle seconds as of `now_ms`: a GPU idle at the last report has stayed idle
/// since, as far as anyone knows.
fn gpu_idle_of(rank: &RankRow, now_ms: i64) -> Vec<Option<f64>> {
    let Some(text) = &rank.gpu_idle else {
        return Vec::new();
    };
    let since = ((now_ms - rank.gpu_idle_ms.unwrap_or(now_ms)).max(0) as f64) / 1e3;
    serde_json::from_str::<Vec<Option<f64>>>(text)
        .unwrap_or_default()
        .into_iter()
        .map(|idle| idle.map(|s| if s > 0.0 { s + since } else { s }))
        .collect()
}

/// The clip of a run's bill: MLflow's start and end of it (`runs/get`'s answer) and the end its
/// bill was queued with, the earlier end winning. Each end is checked on its own: a wild one
/// (the client's, stored by MLflow as sent) is ignored rather than winning the minimum.
fn clip_of(run: &Run, queued_end: Option<i64>, now_ms: i64) -> Clip {
    let start_ms = run.info.start_time;
    let queued = Clip::new(start_ms, queued_end, now_ms).end_ms;
    let mlflow_end = Clip::new(start_ms, run.info.end_time, now_ms).end_ms;
    Clip {
        start_ms: Clip::new(start_ms, None, now_ms).start_ms,
        end_ms: match (queued, mlflow_end) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        },
    }
}

/// Folds what a failed flush held of a rank (`older`) into what was gathered since (`newer`):
/// the newer facts win, the older fill the gaps, and the spans take both ends (the earliest
/// first heartbeat and sample, the latest last ones), as the store's merge does.
fn merge_older(newer: &mut RankRow, older: RankRow) {
    let min = |a: Option<i64>, b: Option<i64>| a.into_iter().chain(b).min();
    let max = |a: Option<i64>, b: Option<i64>| a.into_iter().chain(b).max();
    newer.first_heard_ms = newer.first_heard_ms.min(older.first_heard_ms);
    newer.last_heard_ms = newer.last_heard_ms.max(older.last_heard_ms);
    newer.bill_first_ms = min(newer.bill_first_ms, older.bill_first_ms);
    newer.bill_last_ms = max(newer.bill_last_ms, older.bill_last_ms);
    newer.last_sample_ms = max(newer.last_sample_ms, older.last_sample_ms);
    newer.last_write_ms = max(newer.last_write_ms, older.last_write_ms);
    newer.interval_ms = newer.interval_ms.or(older.interval_ms);
    newer.gpus = newer.gpus.max(older.gpus);
    newer.workspace = newer.workspace.take().or(older.workspace);
    newer.pod = newer.pod.take().or(older.pod);
    newer.gpu_model = newer.gpu_model.take().or(older.gpu_model);
    newer.gpu_idle_basis = newer.gpu_idle_basis.take().or(older.gpu_idle_basis);
    newer.memory_limit_mb = newer.memory_limit_mb.or(older.memory_limit_mb);
    newer.cpu_limit_cores = newer.cpu_limit_cores.or(older.cpu_limit_cores);
    if newer.gpu_idle_ms.is_none() {
        newer.gpu_idle = older.gpu_idle;
        newer.gpu_idle_ms = older.gpu_idle_ms;
    }
    // An end reported before the newer samples: the newer entry already dropped it when the
    // samples superseded it; otherwise it still holds.
    if newer.outcome.is_none()
        && newer.last_sample_ms <= older.ended_ms.map(|e| e + SUPERSEDE_AFTER_MS)
    {
        newer.outcome = older.outcome;
        newer.exit_code = newer.exit_code.or(older.exit_code);
        newer.ended_ms = older.ended_ms;
    }
}

/// Whether every rank of the run reported its end with exit status 0 (the wrapper's word).
fn ended_cleanly(ranks: &[RankRow]) -> bool {
    !ranks.is_empty()
        && ranks
            .iter()
            .all(|r| r.outcome.as_deref() == Some("exited") && r.exit_code.unwrap_or(0) == 0)
}

/// Consecutive rows of one run (rows come ordered by run).
fn by_run(rows: &[RankRow]) -> impl Iterator<Item = &[RankRow]> {
    rows.chunk_by(|a, b| a.run_id == b.run_id)
}

fn truncate(text: &str) -> String {
    text.chars().take(MAX_TAG_VALUE).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_beat_reads_gpus_limits_and_the_wrappers_tags() {
        let mut beat = Beat {
            run_id: "r".into(),
            ..Beat::default()
        };
        beat.observe_metric("n", 3, "gpu_1_utilization_percentage", 0.0, Some(1));
        beat.observe_metric("n", 3, "gpu_1_idle_seconds", 120.0, Some(1));
        beat.observe_metric("n", 3, "container_memory_limit_megabytes", 65536.0, Some(1));
        beat.observe_metric("n", 3, "container_cpu_limit_cores", 8.0, Some(1));
        beat.observe_metric("n", 3, "gpu_99_idle_seconds", 1.0, Some(1));
        beat.observe_tag(Some("n"), Some(3), "mlscope/rank-3/outcome", "oom_killed");
        beat.observe_tag(Some("n"), Some(3), "mlscope/rank-3/exit_code", "137");
        beat.observe_tag(Some("n"), Some(3), "mlscope/rank-3/pod", "train-3");
        beat.observe_tag(
            Some("n"),
            Some(3),
            "mlscope/rank-3/gpu_idle_basis",
            "sm_active",
        );
        beat.observe_tag(Some("n"), Some(3), "mlflow.user", "x");
        beat.observe_tag(Some("n"), Some(3), "mlscope/rank-x/outcome", "killed");
        // Another rank's sender, or one that names no rank, cannot end rank 3 (nor add a rank).
        beat.observe_tag(Some("n"), Some(0), "mlscope/rank-3/outcome", "killed");
        beat.observe_tag(None, None, "mlscope/rank-4/outcome", "killed");
        assert_eq!(beat.ranks.len(), 1);
        let rank = &beat.ranks[0];
        assert_eq!(rank.gpus, 2);
        // The idle clock with its sample's time, for the bill (GPU 99 is no device).
        assert_eq!(rank.idle_readings, [(1, 1, 120.0)]);
        assert_eq!(rank.gpu_idle, [None, Some(120.0)]);
        assert_eq!(
            (rank.memory_limit_mb, rank.cpu_limit_cores),
            (Some(65536.0), Some(8.0))
        );
        assert_eq!(rank.outcome.as_deref(), Some("oom_killed"));
        assert_eq!(
            (rank.exit_code, rank.pod.as_deref()),
            (Some(137), Some("train-3"))
        );
        assert_eq!(rank.gpu_idle_basis, Some("sm_active"));
        // Only the words the contract knows.
        beat.observe_tag(
            Some("n"),
            Some(3),
            "mlscope/rank-3/gpu_idle_basis",
            "<b>idle</b>",
        );
        assert_eq!(beat.ranks[0].gpu_idle_basis, None);
    }

    #[test]
    fn the_gpu_count_tag_and_sample_times_make_a_ranks_allocation_and_span() {
        let mut beat = Beat::default();
        beat.observe_time("n", 0, 5_000);
        beat.observe_time("n", 0, 1_000);
        beat.observe_tag(Some("n"), Some(0), "mlscope/rank-0/gpu_count", "8");
        // Beyond any real device: capped.
        beat.observe_tag(Some("n"), Some(1), "mlscope/rank-1/gpu_count", "100000");
        assert_eq!(beat.ranks[0].sampled_between, Some((1_000, 5_000)));
        assert_eq!(beat.ranks[0].gpus, 8);
        assert_eq!(beat.ranks[1].gpus, MAX_GPUS_PER_RANK);
    }

    #[test]
    fn the_idle_tag_names_ranks_and_gpus_idle_past_the_threshold() {
        let row = |rank: i64, idle: &str| RankRow {
            run_id: "r".into(),
            node: "n".into(),
            rank,
            gpus: 2,
            gpu_idle: Some(idle.into()),
            gpu_idle_ms: Some(10_000),
            ..RankRow::default()
        };
        let ranks = [row(0, "[0,1800]"), row(1, "[1800,10]")];
        assert_eq!(
            idle_gpus(&ranks, 10_000, 1800.0).as_deref(),
            Some("rank-0:gpu1, rank-1:gpu0")
        );
        assert_eq!(idle_gpus(&ranks, 10_000, 3600.0), None);
        let bill = RunBill {
            gpu_seconds: 7200.0,
            idle_seconds: 1800.0,
            ranks: Vec::new(),
        };
        let totals = [
            ("mlscope.gpu_hours".to_owned(), "2.0000".to_owned()),
            ("mlscope.gpu_idle_hours".to_owned(), "0.5000".to_owned()),
            ("mlscope.gpu_idle_fraction".to_owned(), "0.2500".to_owned()),
        ];
        assert_eq!(bill_tags(&bill, None), totals);
        assert_eq!(
            bill_tags(&bill, basis::of_run(&ranks)),
            [
                totals.to_vec(),
                vec![(
                    "mlscope.gpu_idle_basis".to_owned(),
                    "utilization".to_owned()
                )]
            ]
            .concat()
        );
    }

    #[test]
    fn idle_seconds_grow_with_the_time_since_the_report() {
        let row = RankRow {
            run_id: "r".into(),
            node: "n".into(),
            rank: 0,
            first_heard_ms: 0,
            last_heard_ms: 0,
            interval_ms: None,
            outcome: None,
            exit_code: None,
            ended_ms: None,
            pod: None,
            memory_limit_mb: None,
            cpu_limit_cores: None,
            gpu_model: None,
            gpus: 2,
            gpu_idle: Some("[0,100.5]".into()),
            gpu_idle_ms: Some(10_000),
            ..RankRow::default()
        };
        assert_eq!(gpu_idle_of(&row, 12_000), [Some(0.0), Some(102.5)]);
    }

    #[test]
    fn only_answers_that_asking_again_cannot_change_are_refusals_for_good() {
        let reason = |status, body: &[u8]| {
            failure(crate::mlflow::answer::<Value>(status, "/runs/get", body).unwrap_err()).0
        };
        let gone = br#"{"error_code":"RESOURCE_DOES_NOT_EXIST","message":"Run 'x' not found"}"#;
        assert_eq!(reason(http::StatusCode::NOT_FOUND, gone), REJECTED);
        let deleted = br#"{"error_code":"INVALID_PARAMETER_VALUE","message":"must be active"}"#;
        assert_eq!(reason(http::StatusCode::BAD_REQUEST, deleted), REJECTED);
        assert_eq!(reason(http::StatusCode::NOT_FOUND, b"not json"), REJECTED);
        for (status, body) in [
            (http::StatusCode::UNAUTHORIZED, &b""[..]),
            (http::StatusCode::FORBIDDEN, gone),
            (http::StatusCode::TOO_MANY_REQUESTS, b""),
            (http::StatusCode::CONFLICT, b""),
            (http::StatusCode::SERVICE_UNAVAILABLE, gone),
            (http::StatusCode::INTERNAL_SERVER_ERROR, deleted),
        ] {
            assert_ne!(reason(status, body), REJECTED);
        }
        assert_eq!(reason(http::StatusCode::FORBIDDEN, gone), "refused");
    }

    #[test]
    fn a_failed_flush_merged_back_keeps_the_ranks_first_sample_and_facts() {
        let older = RankRow {
            run_id: "r".into(),
            first_heard_ms: 1_000,
            last_heard_ms: 5_000,
            bill_first_ms: Some(900),
            bill_last_ms: Some(4_900),
            last_sample_ms: Some(5_000),
            pod: Some("train-0".into()),
            gpus: 8,
            gpu_idle_basis: Some("sm_active".into()),
            ..RankRow::default()
        };
        let mut newer = RankRow {
            run_id: "r".into(),
            first_heard_ms: 6_000,
            last_heard_ms: 7_000,
            bill_first_ms: Some(5_900),
            bill_last_ms: Some(6_900),
            last_sample_ms: Some(7_000),
            ..RankRow::default()
        };
        merge_older(&mut newer, older);
        assert_eq!((newer.first_heard_ms, newer.last_heard_ms), (1_000, 7_000));
        assert_eq!(
            (newer.bill_first_ms, newer.bill_last_ms),
            (Some(900), Some(6_900))
        );
        assert_eq!((newer.pod.as_deref(), newer.gpus), (Some("train-0"), 8));
        assert_eq!(newer.gpu_idle_basis.as_deref(), Some("sm_active"));
        assert_eq!(newer.outcome, None);
    }
}
