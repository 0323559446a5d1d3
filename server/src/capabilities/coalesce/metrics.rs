//! The coalescer's metrics: what was merged, how much, after how long, and what was turned away.
//! Registered into the proxy's registry when the coalescer is built.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};

use crate::plumbing::telemetry::{Metrics, ReasonLabels};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

/// The coalescer's handles on its families; cheap to clone.
#[derive(Clone)]
pub(crate) struct CoalesceMetrics {
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

impl CoalesceMetrics {
    /// The coalescer's families, registered into `registry`.
    pub(crate) fn new(registry: &Metrics) -> Self {
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
        coalesce
    }

    /// A batch sent: `merged`, `single`, or `split`.
    pub(crate) fn outcome(&self, outcome: &'static str) {
        self.batches.get_or_create(&OutcomeLabels { outcome }).inc();
    }

    pub(crate) fn batch(&self, requests: usize, samples: usize) {
        self.requests_per_batch.observe(requests as f64);
        self.samples_per_batch.observe(samples as f64);
    }

    pub(crate) fn waited(&self, waited: Duration) {
        self.wait.observe(waited.as_secs_f64());
    }

    pub(crate) fn skipped(&self, reason: &'static str) {
        self.skipped.get_or_create(&ReasonLabels { reason }).inc();
    }

    pub(crate) fn in_flight_limit(&self, limit: i64) {
        self.in_flight_limit.set(limit);
    }

    /// Requests entered (`delta` > 0) or left (`delta` < 0) the coalescer's queues.
    pub(crate) fn queued(&self, delta: i64) {
        self.queued.inc_by(delta);
    }

    /// A run's queue was created (`delta` 1) or removed (`delta` -1).
    pub(crate) fn runs(&self, delta: i64) {
        self.runs.inc_by(delta);
    }

    pub(crate) fn rejected(&self, reason: &'static str) {
        self.rejected.get_or_create(&ReasonLabels { reason }).inc();
    }
}
