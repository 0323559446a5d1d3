//! Logging setup and the Prometheus registry.
//!
//! Logs never carry request headers, so `Authorization` and cookies cannot leak into them.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicI64, AtomicU64};
use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tracing_subscriber::EnvFilter;

pub use crate::error::UpstreamErrorKind;
use crate::route::RouteClass;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Pretty,
    Json,
}

/// How the proxy logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogConfig {
    pub format: LogFormat,
    /// `tracing` filter directive, e.g. `info` or `mlscope_proxy=debug,info`.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: LogFormat::Pretty,
            level: "info".to_owned(),
        }
    }
}

impl LogConfig {
    pub fn validate(&self) -> Result<(), String> {
        EnvFilter::try_new(&self.level)
            .map(drop)
            .map_err(|e| format!("log-level {:?}: {e}", self.level))
    }
}

/// Logging's settings as given (see [`crate::settings`]); `None`: not given here.
#[derive(Debug, Clone, Default, clap::Args, serde::Deserialize)]
pub struct LogOptions {
    /// Log format [default: pretty].
    #[arg(long, env = "MLSCOPE_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    /// Log filter, e.g. `info` or `mlscope_proxy=debug` [default: info].
    #[arg(long, env = "MLSCOPE_LOG", value_name = "FILTER")]
    pub log_level: Option<String>,
}

impl LogOptions {
    /// The given values over the defaults.
    pub fn resolve(self) -> LogConfig {
        let d = LogConfig::default();
        LogConfig {
            format: self.log_format.unwrap_or(d.format),
            level: self.log_level.unwrap_or(d.level),
        }
    }
}

/// Installs the global `tracing` subscriber. Called once by `main`; tests leave it alone.
pub fn init_logging(format: LogFormat, filter: &str) {
    let filter = EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // Where colour may be used, tracing-subscriber's default applies: colour unless NO_COLOR
    // (https://no-color.org) is set to a non-empty value.
    let builder = if may_colour(format, std::io::stderr().is_terminal()) {
        builder
    } else {
        builder.with_ansi(false)
    };
    match format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .init(),
        LogFormat::Pretty => builder.compact().init(),
    }
}

/// Colour is for a person reading a terminal: logs redirected to a file or collected from a
/// container's stderr would keep the escape codes, and JSON lines are read by programs.
fn may_colour(format: LogFormat, stderr_is_terminal: bool) -> bool {
    format == LogFormat::Pretty && stderr_is_terminal
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub route: RouteClass,
    pub method: String,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub route: RouteClass,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub kind: UpstreamErrorKind,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KeyLabels {
    pub family: &'static str,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ArtifactLabels {
    pub op: &'static str,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

/// The proxy's own metrics, one registry per running instance (tests run several per process).
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    pub requests: Family<RequestLabels, Counter>,
    pub latency: Family<RouteLabels, Histogram, fn() -> Histogram>,
    pub upstream_errors: Family<ErrorLabels, Counter>,
    /// Requests refused with 429 because `--max-in-flight` requests were in flight already.
    pub overload_refusals: Counter,
    pub in_flight: Gauge<i64, AtomicI64>,
    pub open_connections: Gauge<i64, AtomicI64>,
    pub artifact_requests: Family<ArtifactLabels, Counter>,
    pub artifact_bytes_uploaded: Counter,
    pub artifact_policy_violations: Counter,
    pub artifact_authz_denials: Counter,
    metric_keys: Family<KeyLabels, Counter>,
    node_samples: Family<ReasonLabels, Counter>,
    elections: Family<ReasonLabels, Counter>,
    bodies_passed_through: Family<ReasonLabels, Counter>,
    bodies_rejected: Family<ReasonLabels, Counter>,
    fair_share: FairShareMetrics,
    coalesce: CoalesceMetrics,
    health: HealthMetrics,
    store_up: Gauge,
}

/// Run health: live runs, their GPUs, and what the stale-run sweep did.
#[derive(Clone)]
struct HealthMetrics {
    gpus_allocated: Family<RunLabels, Gauge>,
    gpus_idle: Family<RunLabels, Gauge>,
    live_runs: Gauge,
    judged: Family<JudgedLabels, Counter>,
    heartbeats_dropped: Counter,
    sweep_errors: Family<ReasonLabels, Counter>,
    gpu_seconds: Family<GpuLabels, Counter<f64, AtomicU64>>,
    runs_billed: Counter,
    findings: Family<KindLabels, Counter>,
    /// GPU models that have a label; beyond [`MAX_GPU_MODELS`] they count as `other`.
    gpu_models: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
}

/// Distinct `model` labels of `mlscope_gpu_seconds_total` (the model comes from the collector's
/// tag, so a client could invent any number of them).
const MAX_GPU_MODELS: usize = 32;

/// GPU seconds billed, by model and by whether the GPUs worked.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GpuLabels {
    pub model: String,
    pub state: &'static str,
}

/// One live run. Only runs heard from within `--run-stale-after`, at most
/// run health's `MAX_GAUGE_RUNS`, carry this label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RunLabels {
    pub run_id: String,
}

/// What a collector reported about what its run stood on (`health::findings`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct JudgedLabels {
    pub outcome: &'static str,
    pub action: &'static str,
}

/// Each client's share of MLflow's writes: what was admitted and refused (and why), per team
/// named in the configuration, and the learned limit on writes at MLflow at once.
#[derive(Clone)]
struct FairShareMetrics {
    writes: Family<ShareLabels, Counter>,
    team_writes: Family<TeamLabels, Counter>,
    write_limit: Gauge,
    writes_at_mlflow: Gauge,
}

/// `reason` is `none` for admitted writes, else one of the fair share's fixed set of reasons.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ShareLabels {
    pub outcome: &'static str,
    pub reason: &'static str,
}

/// `team` is a name from the configuration file: the label set is bounded by it.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TeamLabels {
    pub team: String,
    pub outcome: &'static str,
}

/// Write coalescing: what was merged, how much, after how long, and what was turned away.
#[derive(Clone)]
struct CoalesceMetrics {
    batches: Family<OutcomeLabels, Counter>,
    requests_per_batch: Histogram,
    samples_per_batch: Histogram,
    wait: Histogram,
    skipped: Family<ReasonLabels, Counter>,
    rejected: Family<ReasonLabels, Counter>,
    queued: Gauge,
    runs: Gauge,
    in_flight_limit: Gauge,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: &'static str,
}

fn latency_histogram() -> Histogram {
    // 100 µs .. ~105 s
    Histogram::new(exponential_buckets(0.0001, 2.0, 21))
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("mlscope");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "http_requests",
            "Requests answered, by route class, method and status",
            requests.clone(),
        );
        let latency = Family::<RouteLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        registry.register(
            "http_request_duration_seconds",
            "Time from receiving a request to sending its response headers",
            latency.clone(),
        );
        let upstream_errors = Family::<ErrorLabels, Counter>::default();
        registry.register(
            "upstream_errors",
            "Requests the upstream did not answer, by cause",
            upstream_errors.clone(),
        );
        let overload_refusals = Counter::default();
        registry.register(
            "overload_refusals",
            "Requests refused with 429 because --max-in-flight requests were in flight already (MLflow was not asked)",
            overload_refusals.clone(),
        );
        let in_flight = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "http_requests_in_flight",
            "Requests whose response has not finished streaming",
            in_flight.clone(),
        );
        let open_connections = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "client_connections",
            "Client connections open on the MLflow-facing listener",
            open_connections.clone(),
        );
        let artifact_requests = Family::<ArtifactLabels, Counter>::default();
        registry.register(
            "artifact_requests",
            "Artifact API requests the gateway answered from the store, by operation and status",
            artifact_requests.clone(),
        );
        let artifact_bytes_uploaded = Counter::default();
        registry.register(
            "artifact_uploaded_bytes",
            "Bytes the gateway stored",
            artifact_bytes_uploaded.clone(),
        );
        let artifact_policy_violations = Counter::default();
        registry.register(
            "artifact_policy_violations",
            "Artifact writes outside the artifact root of an existing run, model or trace (refused under enforce, logged under warn)",
            artifact_policy_violations.clone(),
        );
        let artifact_authz_denials = Counter::default();
        registry.register(
            "artifact_authz_denials",
            "Artifact requests MLflow's authentication refused for the client (401/403 relayed by the gateway)",
            artifact_authz_denials.clone(),
        );
        let metric_keys = Family::<KeyLabels, Counter>::default();
        registry.register(
            "system_metric_keys",
            "system/ metric samples by contract family and outcome (rewritten, unchanged, invalid: kept as sent)",
            metric_keys.clone(),
        );
        let node_samples = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "node_samples",
            "Node-wide samples kept from the reporter, dropped from other ranks, or left undeduplicated because MLflow refuses the client (refused_by_mlflow)",
            node_samples.clone(),
        );
        let elections = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "dedup_elections",
            "Reporter elections (first reporter) and failovers",
            elections.clone(),
        );
        let bodies_passed_through = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "metric_bodies_passed_through",
            "Metrics requests forwarded without inspection, by reason",
            bodies_passed_through.clone(),
        );
        let bodies_rejected = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "metric_bodies_rejected",
            "Metrics requests the proxy refused, by reason",
            bodies_rejected.clone(),
        );
        let fair_share = FairShareMetrics {
            writes: Family::default(),
            team_writes: Family::default(),
            write_limit: Gauge::default(),
            writes_at_mlflow: Gauge::default(),
        };
        registry.register(
            "fair_share_writes",
            "Writes to MLflow admitted or refused (429) by the per-client share, by outcome and reason (client_rate, client_samples, team_rate, team_samples, saturation)",
            fair_share.writes.clone(),
        );
        registry.register(
            "fair_share_team_writes",
            "Writes of the members of each team of the configuration, admitted or refused",
            fair_share.team_writes.clone(),
        );
        registry.register(
            "fair_share_write_limit",
            "Writes allowed at MLflow at once before the heaviest client is refused, learned from MLflow's latency",
            fair_share.write_limit.clone(),
        );
        registry.register(
            "fair_share_writes_at_mlflow",
            "Writes admitted by the share and not yet answered",
            fair_share.writes_at_mlflow.clone(),
        );
        let coalesce = CoalesceMetrics {
            batches: Family::default(),
            requests_per_batch: Histogram::new(exponential_buckets(1.0, 2.0, 12)),
            samples_per_batch: Histogram::new(exponential_buckets(1.0, 2.0, 11)),
            wait: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            skipped: Family::default(),
            rejected: Family::default(),
            queued: Gauge::default(),
            runs: Gauge::default(),
            in_flight_limit: Gauge::default(),
        };
        registry.register(
            "coalesce_in_flight_per_run",
            "Batches of metrics alone of one run at MLflow at once (1 once MLflow is known to deadlock on overlapping writes)",
            coalesce.in_flight_limit.clone(),
        );
        registry.register(
            "coalesce_queued_requests",
            "Write requests waiting in the coalescer for their batch",
            coalesce.queued.clone(),
        );
        registry.register(
            "coalesce_runs",
            "Runs the coalescer holds a queue for (writes waiting or a batch at MLflow)",
            coalesce.runs.clone(),
        );
        registry.register(
            "coalesce_batches",
            "Metric batches sent to MLflow by the coalescer: merged (several requests, stored), single (one request, sent as it came), split (merged batch refused or failed, its requests sent one by one)",
            coalesce.batches.clone(),
        );
        registry.register(
            "coalesce_requests_per_batch",
            "Client requests per batch sent",
            coalesce.requests_per_batch.clone(),
        );
        registry.register(
            "coalesce_samples_per_batch",
            "Metric samples per batch sent",
            coalesce.samples_per_batch.clone(),
        );
        registry.register(
            "coalesce_wait_seconds",
            "Time a request waited in the coalescer before its batch left",
            coalesce.wait.clone(),
        );
        registry.register(
            "coalesce_skipped",
            "Write requests sent to MLflow alone, as they came, by reason: shape (not a write shape the coalescer knows), element (an element MLflow would not parse as written), limits (over a log-batch limit), repeated_param (one param key twice)",
            coalesce.skipped.clone(),
        );
        registry.register(
            "coalesce_rejected",
            "Metric requests answered 429 because the coalescer's queue was full, by limit",
            coalesce.rejected.clone(),
        );
        let health = HealthMetrics {
            gpus_allocated: Family::default(),
            gpus_idle: Family::default(),
            live_runs: Gauge::default(),
            judged: Family::default(),
            heartbeats_dropped: Counter::default(),
            sweep_errors: Family::default(),
            gpu_seconds: Family::default(),
            runs_billed: Counter::default(),
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
        let store_up = Gauge::default();
        registry.register(
            "state_store_up",
            "1 while the state store took this replica's last write (every 15 s and at each /readyz), 0 when it failed",
            store_up.clone(),
        );
        Self {
            registry: Arc::new(registry),
            coalesce,
            health,
            store_up,
            requests,
            latency,
            artifact_requests,
            artifact_bytes_uploaded,
            artifact_policy_violations,
            artifact_authz_denials,
            upstream_errors,
            overload_refusals,
            in_flight,
            open_connections,
            metric_keys,
            node_samples,
            elections,
            bodies_passed_through,
            bodies_rejected,
            fair_share,
        }
    }

    pub fn keys(&self, family: &'static str, outcome: &'static str, samples: u64) {
        self.metric_keys
            .get_or_create(&KeyLabels { family, outcome })
            .inc_by(samples);
    }

    pub fn node_samples(&self, reason: &'static str, samples: u64) {
        self.node_samples
            .get_or_create(&ReasonLabels { reason })
            .inc_by(samples);
    }

    pub fn election(&self, reason: &'static str) {
        self.elections.get_or_create(&ReasonLabels { reason }).inc();
    }

    pub fn passed_through(&self, reason: &'static str) {
        self.bodies_passed_through
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// A write admitted (`reason` `none`) or refused by the share; `team` when its client is a
    /// member of one.
    pub fn fair_share(&self, outcome: &'static str, reason: &'static str, team: Option<&str>) {
        self.fair_share
            .writes
            .get_or_create(&ShareLabels { outcome, reason })
            .inc();
        if let Some(team) = team {
            self.fair_share
                .team_writes
                .get_or_create(&TeamLabels {
                    team: team.to_owned(),
                    outcome,
                })
                .inc();
        }
    }

    /// The learned write limit and the writes at MLflow now.
    pub fn fair_share_load(&self, limit: usize, at_mlflow: usize) {
        self.fair_share.write_limit.set(limit as i64);
        self.fair_share.writes_at_mlflow.set(at_mlflow as i64);
    }

    pub fn rejected(&self, reason: &'static str) {
        self.bodies_rejected
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    pub fn coalesce_outcome(&self, outcome: &'static str) {
        self.coalesce
            .batches
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    pub fn coalesce_batch(&self, requests: usize, samples: usize) {
        self.coalesce.requests_per_batch.observe(requests as f64);
        self.coalesce.samples_per_batch.observe(samples as f64);
    }

    pub fn coalesce_waited(&self, waited: std::time::Duration) {
        self.coalesce.wait.observe(waited.as_secs_f64());
    }

    pub fn coalesce_skipped(&self, reason: &'static str) {
        self.coalesce
            .skipped
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    pub fn coalesce_in_flight_limit(&self, limit: i64) {
        self.coalesce.in_flight_limit.set(limit);
    }

    /// Requests entered (`delta` > 0) or left (`delta` < 0) the coalescer's queues.
    pub fn coalesce_queued(&self, delta: i64) {
        self.coalesce.queued.inc_by(delta);
    }

    /// A run's queue was created (`delta` 1) or removed (`delta` -1).
    pub fn coalesce_runs(&self, delta: i64) {
        self.coalesce.runs.inc_by(delta);
    }

    pub fn coalesce_rejected(&self, reason: &'static str) {
        self.coalesce
            .rejected
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// Replaces the per-run GPU gauges and the live-run count with `runs`: (run id, GPUs
    /// allocated, GPUs idle).
    pub fn set_live_runs(&self, runs: &[(String, i64, i64)]) {
        self.health.gpus_allocated.clear();
        self.health.gpus_idle.clear();
        for (run_id, allocated, idle) in runs {
            let labels = RunLabels {
                run_id: run_id.clone(),
            };
            self.health
                .gpus_allocated
                .get_or_create(&labels)
                .set(*allocated);
            self.health.gpus_idle.get_or_create(&labels).set(*idle);
        }
        self.health.live_runs.set(runs.len() as i64);
    }

    pub fn run_judged(&self, outcome: &'static str, action: &'static str) {
        self.health
            .judged
            .get_or_create(&JudgedLabels { outcome, action })
            .inc();
    }

    /// Adds one billed run's busy and idle GPU seconds of one GPU model.
    pub fn gpu_seconds(&self, model: &str, busy: f64, idle: f64) {
        let model: String = model.chars().take(64).collect();
        let model = {
            let mut models = self.health.gpu_models.lock().expect("gpu models");
            if models.contains(&model) || models.len() < MAX_GPU_MODELS {
                models.insert(model.clone());
                model
            } else {
                "other".to_owned()
            }
        };
        for (state, seconds) in [("busy", busy), ("idle", idle)] {
            if seconds.is_finite() && seconds > 0.0 {
                self.health
                    .gpu_seconds
                    .get_or_create(&GpuLabels {
                        model: model.clone(),
                        state,
                    })
                    .inc_by(seconds);
            }
        }
    }

    pub fn run_billed(&self) {
        self.health.runs_billed.inc();
    }

    pub fn store_reachable(&self, up: bool) {
        self.store_up.set(i64::from(up));
    }

    pub fn heartbeat_dropped(&self) {
        self.health.heartbeats_dropped.inc();
    }

    /// A report of `kind` heard for the first time (see `health::findings`).
    pub fn finding(&self, kind: &'static str) {
        self.health
            .findings
            .get_or_create(&KindLabels { kind })
            .inc();
    }

    pub fn health_error(&self, reason: &'static str) {
        self.health
            .sweep_errors
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// The Prometheus text exposition of every family.
    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logs_are_coloured_only_when_pretty_and_on_a_terminal() {
        assert!(may_colour(LogFormat::Pretty, true));
        assert!(!may_colour(LogFormat::Pretty, false));
        assert!(!may_colour(LogFormat::Json, true));
        assert!(!may_colour(LogFormat::Json, false));
    }
}
