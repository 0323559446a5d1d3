//! Run health's metrics: live runs and their GPUs, what the sweep judged and billed, what runs
//! stood on, and what failed. Registered into the proxy's registry when run health is built.

use std::collections::HashSet;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use crate::plumbing::telemetry::{Metrics, ReasonLabels};

/// Distinct `model` labels of `mlscope_gpu_seconds_total` (the model comes from the collector's
/// tag, so a client could invent any number of them).
const MAX_GPU_MODELS: usize = 32;

/// GPU seconds billed, by model and by whether the GPUs worked.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabels {
    model: String,
    state: &'static str,
}

/// One live run. Only runs heard from within `--run-stale-after`, at most
/// [`super::MAX_GAUGE_RUNS`], carry this label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RunLabels {
    run_id: String,
}

/// What a collector reported about what its run stood on ([`super::findings`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct JudgedLabels {
    outcome: &'static str,
    action: &'static str,
}

/// Run health's handles on its families; cheap to clone.
#[derive(Clone)]
pub(crate) struct HealthMetrics {
    gpus_allocated: Family<RunLabels, Gauge>,
    gpus_idle: Family<RunLabels, Gauge>,
    live_runs: Gauge,
    judged: Family<JudgedLabels, Counter>,
    heartbeats_dropped: Counter,
    sweep_errors: Family<ReasonLabels, Counter>,
    gpu_seconds: Family<GpuLabels, Counter<f64, AtomicU64>>,
    runs_billed: Counter,
    reports: Family<ReasonLabels, Counter>,
    findings: Family<KindLabels, Counter>,
    /// GPU models that have a label; beyond [`MAX_GPU_MODELS`] they count as `other`.
    gpu_models: Arc<Mutex<HashSet<String>>>,
}

impl HealthMetrics {
    /// Run health's families, registered into `registry`.
    pub(crate) fn new(registry: &Metrics) -> Self {
        let health = HealthMetrics {
            gpus_allocated: Family::default(),
            gpus_idle: Family::default(),
            live_runs: Gauge::default(),
            judged: Family::default(),
            heartbeats_dropped: Counter::default(),
            sweep_errors: Family::default(),
            gpu_seconds: Family::default(),
            runs_billed: Counter::default(),
            reports: Family::default(),
            findings: Family::default(),
            gpu_models: Default::default(),
        };
        registry.register(
            "run_findings",
            "Reports of what runs stood on, by kind (data_changed: a declared data path changed under a run; leftover_processes: a rank left processes running; gpu_memory_left: GPU memory still held after them), counted once per report across retries",
            health.findings.clone(),
        );
        registry.register(
            "gpu_seconds",
            "GPU seconds of billed runs (counted when a run is billed, at its end), by GPU model and state (busy, idle: the collector's idle clock)",
            health.gpu_seconds.clone(),
        );
        registry.register(
            "runs_billed",
            "Runs with GPUs whose bill this replica wrote (each run is billed by one replica, once)",
            health.runs_billed.clone(),
        );
        registry.register(
            "run_reports",
            "Run reports this replica wrote into ended runs (reason=written), or could not (reason=failed: the run carries mlscope.report_error); each run's report is written by one replica, once",
            health.reports.clone(),
        );
        registry.register(
            "run_gpus_allocated",
            "GPUs the ranks of a live run report (runs heard from within --run-stale-after)",
            health.gpus_allocated.clone(),
        );
        registry.register(
            "run_gpus_idle",
            "GPUs of a live run idle for longer than --gpu-idle-after, as the collector measures them",
            health.gpus_idle.clone(),
        );
        registry.register(
            "runs_live",
            "Runs with a heartbeat within --run-stale-after and no verdict",
            health.live_runs.clone(),
        );
        registry.register(
            "runs_judged",
            "Runs the stale-run sweep judged, by outcome and by what it did (end, tag, none when the client had ended the run)",
            health.judged.clone(),
        );
        registry.register(
            "health_heartbeats_dropped",
            "Heartbeats not recorded because this replica's buffer of unflushed ranks was full",
            health.heartbeats_dropped.clone(),
        );
        registry.register(
            "health_sweep_errors",
            "Failures of the run-health work, by step (store, mlflow, refused; rejected: MLflow refused for good, e.g. a deleted run)",
            health.sweep_errors.clone(),
        );
        health
    }

    /// Replaces the per-run GPU gauges and the live-run count with `runs`: (run id, GPUs
    /// allocated, GPUs idle).
    pub(crate) fn set_live_runs(&self, runs: &[(String, i64, i64)]) {
        self.gpus_allocated.clear();
        self.gpus_idle.clear();
        for (run_id, allocated, idle) in runs {
            let labels = RunLabels {
                run_id: run_id.clone(),
            };
            self.gpus_allocated.get_or_create(&labels).set(*allocated);
            self.gpus_idle.get_or_create(&labels).set(*idle);
        }
        self.live_runs.set(runs.len() as i64);
    }

    pub(crate) fn run_judged(&self, outcome: &'static str, action: &'static str) {
        self.judged
            .get_or_create(&JudgedLabels { outcome, action })
            .inc();
    }

    /// Adds one billed run's busy and idle GPU seconds of one GPU model.
    pub(crate) fn gpu_seconds(&self, model: &str, busy: f64, idle: f64) {
        let model: String = model.chars().take(64).collect();
        let model = {
            let mut models = self.gpu_models.lock().expect("gpu models");
            if models.contains(&model) || models.len() < MAX_GPU_MODELS {
                models.insert(model.clone());
                model
            } else {
                "other".to_owned()
            }
        };
        for (state, seconds) in [("busy", busy), ("idle", idle)] {
            if seconds.is_finite() && seconds > 0.0 {
                self.gpu_seconds
                    .get_or_create(&GpuLabels {
                        model: model.clone(),
                        state,
                    })
                    .inc_by(seconds);
            }
        }
    }

    pub(crate) fn run_billed(&self) {
        self.runs_billed.inc();
    }

    /// A run's report written (`written`) or not (`failed`).
    pub(crate) fn report(&self, reason: &'static str) {
        self.reports.get_or_create(&ReasonLabels { reason }).inc();
    }

    pub(crate) fn heartbeat_dropped(&self) {
        self.heartbeats_dropped.inc();
    }

    /// A report of `kind` heard for the first time (see [`super::findings`]).
    pub(crate) fn finding(&self, kind: &'static str) {
        self.findings.get_or_create(&KindLabels { kind }).inc();
    }

    pub(crate) fn health_error(&self, reason: &'static str) {
        self.sweep_errors
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }
}
