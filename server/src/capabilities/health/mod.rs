//! Run health: every system-metrics sample MLflow accepted is a heartbeat of its (run, node,
//! rank); the collector's wrapper reports how a rank ended; the collector reports placement and
//! GPU idleness. Heartbeats gather in memory and go to the store in batches; a sweep, one
//! replica at a time, finds runs still `RUNNING` in MLflow whose ranks all went silent or failed,
//! and tags (and by default ends) them. Every run that ends (its client's `runs/update` through
//! the proxy, or the sweep's verdict) is billed once: GPU hours held and idle ([`bill`]), as run
//! tags and fleet counters; a live run holding GPUs idle past `--gpu-idle-after` carries a tag
//! naming them, and both say what idleness was judged on ([`basis`]: SM activity or utilisation,
//! each rank's collector's word). `GET /runs/{run_id}/health` on the admin listener and
//! Prometheus gauges show live runs, their idle GPUs and their bill so far.
//!
//! The rooms: [`settings`]; [`beat`] (what a request says of its ranks) and [`buffer`] (kept in
//! memory, flushed to the store); [`sweep`], which judges ([`judge`](mod@judge), [`verdict`]), bills
//! ([`bill`]) and tags idle GPUs ([`idle`]); [`view`], the admin view; [`update`], the
//! `runs/update` route; [`calls`], what it asks of MLflow; [`store`], its rows and SQL;
//! [`metrics`], its families in `/metrics`.

pub mod basis;
pub mod bill;
pub mod findings;
pub mod judge;
pub mod report;
pub mod store;
pub mod usage;

mod beat;
mod buffer;
mod calls;
mod idle;
mod metrics;
mod settings;
mod sweep;
mod update;
mod verdict;
mod view;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use crate::capabilities::coalesce::Coalescer;
use crate::plumbing::mlflow::MlflowClient;
use crate::plumbing::proxy::Forwarder;
use crate::plumbing::store::{unix_millis, Store};
use crate::plumbing::telemetry::Metrics;
use bill::IdleWindow;
use metrics::HealthMetrics;
use store::{FindingRow, HealthStore, RankRow};

pub use beat::{Beat, RankBeat};
pub use idle::IDLE_TAG;
pub use report::{RunReport, REPORT_PATH};
pub use settings::{HealthConfig, HealthOptions, StaleAction};
pub use update::update_run;

/// A run's report as its HTML page.
pub fn report_page(report: &RunReport) -> String {
    report::render::html(report)
}
pub use view::{GpuHealth, RankHealth, RunHealth};

use idle::{gpu_idle_of, idle_gpus};

/// Live runs that get per-run gauges; beyond it only the count is exported.
pub const MAX_GAUGE_RUNS: usize = 1_000;
/// Ranks that get their own `mlscope/rank-<r>/...` tags when a run is judged or billed.
const MAX_RANK_TAGS: usize = 64;
/// MLflow's longest tag value is 8000 characters (5000 in older versions); stay under both.
const MAX_TAG_VALUE: usize = 5_000;

/// Run health, shared by the handlers (heartbeats), the admin view and the sweep.
#[derive(Clone)]
pub struct Health {
    inner: Arc<Inner>,
}

struct Inner {
    config: HealthConfig,
    /// Run health's rows (and, through it, the store's work lease for the sweep).
    store: HealthStore,
    mlflow: MlflowClient,
    /// The proxy's own tag writes join their run's write queue, so they keep their order with
    /// the client's writes and never overlap them at MLflow.
    coalescer: Coalescer,
    metrics: HealthMetrics,
    replica_id: String,
    pending: Mutex<HashMap<(String, String, i64), RankRow>>,
    /// Idle-clock windows per (run, node, rank, GPU) since the last flush.
    pending_idle: Mutex<HashMap<(String, String, i64, i64), IdleWindow>>,
    /// Reports of what runs stood on since the last flush, as heard.
    pending_findings: Mutex<Vec<FindingRow>>,
    /// What ranks used since the last flush, per (run, node, rank, series): the run's report.
    pending_usage: Mutex<HashMap<(String, String, i64, usage::Series), usage::Gathered>>,
    /// Runs written to (any accepted metric write) since the last flush, with the latest time.
    writes: Mutex<HashMap<String, i64>>,
    /// The artifact gateway's routes, when it is on: reports are written through them.
    artifact_router: std::sync::OnceLock<axum::Router>,
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
                store: HealthStore::new(store),
                mlflow: MlflowClient::new(forwarder),
                coalescer,
                metrics: HealthMetrics::new(&metrics),
                replica_id,
                pending: Mutex::new(HashMap::new()),
                pending_idle: Mutex::new(HashMap::new()),
                pending_findings: Mutex::new(Vec::new()),
                pending_usage: Mutex::new(HashMap::new()),
                writes: Mutex::new(HashMap::new()),
                artifact_router: std::sync::OnceLock::new(),
                queueing: Arc::new(tokio::sync::Semaphore::new(update::MAX_QUEUEING_BILLS)),
            }),
        }
    }

    pub fn config(&self) -> &HealthConfig {
        &self.inner.config
    }

    /// Deletes run health's rows untouched for `retention`, as the store's retention sweep does
    /// its own (whether or not run health is on: the rows outlive a restart without it).
    pub async fn sweep_expired(
        &self,
        retention: std::time::Duration,
        now: SystemTime,
    ) -> Result<store::HealthSwept, crate::plumbing::store::StoreError> {
        self.inner.store.sweep_expired(retention, now).await
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
}

fn truncate(text: &str) -> String {
    text.chars().take(MAX_TAG_VALUE).collect()
}
