//! Logging setup, the Prometheus registry and the request metrics (each component registers the
//! families of its own).
//!
//! Logs never carry request headers, so `Authorization` and cookies cannot leak into them.

use std::io::IsTerminal;
use std::sync::atomic::AtomicI64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Metric, Registry};
use tracing_subscriber::EnvFilter;

use crate::plumbing::error::UpstreamErrorKind;
pub use crate::plumbing::log_writer::LogFlush;
use crate::plumbing::log_writer::LogWriter;
use crate::plumbing::route::RouteClass;

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
    /// How long `INFO` and lower lines may wait to be written together (zero: each at once); see
    /// [`crate::plumbing::log_writer`].
    pub flush_interval: Duration,
}

/// The longest flush interval accepted: beyond it a line would come too late to watch a proxy by.
const MAX_FLUSH_INTERVAL: Duration = Duration::from_secs(10);

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: LogFormat::Pretty,
            level: "info".to_owned(),
            flush_interval: Duration::from_millis(100),
        }
    }
}

impl LogConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.flush_interval > MAX_FLUSH_INTERVAL {
            return Err(format!(
                "log-flush-interval {:?} is longer than {MAX_FLUSH_INTERVAL:?}: lines would come too late to watch the proxy by; use 0s to write each line at once",
                self.flush_interval
            ));
        }
        EnvFilter::try_new(&self.level)
            .map(drop)
            .map_err(|e| format!("log-level {:?}: {e}", self.level))
    }
}

/// Logging's settings as given (see [`crate::plumbing::settings`]); `None`: not given here.
#[derive(Debug, Clone, Default, clap::Args, serde::Deserialize)]
pub struct LogOptions {
    /// Log format [default: pretty].
    #[arg(long, env = "MLSCOPE_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    /// Log filter, e.g. `info` or `mlscope_proxy=debug` [default: info].
    #[arg(long, env = "MLSCOPE_LOG", value_name = "FILTER")]
    pub log_level: Option<String>,
    /// How long INFO and lower lines may wait to be written together; WARN and ERROR lines go
    /// at once, after them; 0s writes every line at once [default: 100ms].
    #[arg(long, env = "MLSCOPE_LOG_FLUSH_INTERVAL", value_parser = crate::plumbing::settings::parse_duration, value_name = "DURATION")]
    #[serde(default, with = "humantime_serde")]
    pub log_flush_interval: Option<Duration>,
}

impl LogOptions {
    /// The given values over the defaults.
    pub fn resolve(self) -> LogConfig {
        let d = LogConfig::default();
        LogConfig {
            format: self.log_format.unwrap_or(d.format),
            level: self.log_level.unwrap_or(d.level),
            flush_interval: self.log_flush_interval.unwrap_or(d.flush_interval),
        }
    }
}

/// Installs the global `tracing` subscriber, writing to standard error with lines batched for
/// `flush_interval` (see [`crate::plumbing::log_writer`]). Called once by `main`, which keeps the
/// returned guard until it returns; tests leave it alone.
pub fn init_logging(format: LogFormat, filter: &str, flush_interval: Duration) -> LogFlush {
    let filter = EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new("info"));
    let writer = LogWriter::stderr(flush_interval);
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer.clone());
    // Where colour may be used, tracing-subscriber's default applies: colour unless NO_COLOR
    // (https://no-color.org) is set to a non-empty value.
    let builder = if may_colour(format, std::io::stderr().is_terminal()) {
        builder
    } else {
        builder.with_ansi(false)
    };
    match format {
        LogFormat::Json => builder
            .fmt_fields(crate::plumbing::json_lines::SpanFields)
            .event_format(crate::plumbing::json_lines::JsonLines::new())
            .init(),
        LogFormat::Pretty => builder.compact().init(),
    }
    LogFlush::install(writer)
}

/// Colour is for a person reading a terminal: logs redirected to a file or collected from a
/// container's stderr would keep the escape codes, and JSON lines are read by programs.
fn may_colour(format: LogFormat, stderr_is_terminal: bool) -> bool {
    format == LogFormat::Pretty && stderr_is_terminal
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub route: RouteClass,
    pub method: &'static str,
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
pub struct ReasonLabels {
    pub reason: &'static str,
}

/// The proxy's own metrics, one registry per running instance (tests run several per process):
/// the request metrics here, and every family a component registers into it when it is built
/// ([`Metrics::register`]: the coalescer's, the fair share's, the gateway's, run health's), each
/// component holding the handles of its own.
///
/// One allocation shared by every clone: a clone is taken for every request (the layers' state),
/// and copying each family's handle cost a dozen atomic increments and decrements per request.
#[derive(Clone)]
pub struct Metrics(Arc<MetricFamilies>);

/// The families behind [`Metrics`].
pub struct MetricFamilies {
    registry: Mutex<Registry>,
    pub requests: Family<RequestLabels, Counter>,
    pub latency: Family<RouteLabels, Histogram, fn() -> Histogram>,
    pub upstream_errors: Family<ErrorLabels, Counter>,
    /// Requests refused with 429 because `--max-in-flight` requests were in flight already.
    pub overload_refusals: Counter,
    pub in_flight: Gauge<i64, AtomicI64>,
    pub open_connections: Gauge<i64, AtomicI64>,
    metric_keys: Family<KeyLabels, Counter>,
    node_samples: Family<ReasonLabels, Counter>,
    elections: Family<ReasonLabels, Counter>,
    bodies_passed_through: Family<ReasonLabels, Counter>,
    bodies_rejected: Family<ReasonLabels, Counter>,
    store_up: Gauge,
}

impl std::ops::Deref for Metrics {
    type Target = MetricFamilies;

    fn deref(&self) -> &MetricFamilies {
        &self.0
    }
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
        let store_up = Gauge::default();
        registry.register(
            "state_store_up",
            "1 while the state store took this replica's last write (every 15 s and at each /readyz), 0 when it failed",
            store_up.clone(),
        );
        Self(Arc::new(MetricFamilies {
            registry: Mutex::new(registry),
            store_up,
            requests,
            latency,
            upstream_errors,
            overload_refusals,
            in_flight,
            open_connections,
            metric_keys,
            node_samples,
            elections,
            bodies_passed_through,
            bodies_rejected,
        }))
    }

    /// Registers a family a component keeps the handle of (its name under the `mlscope_`
    /// prefix, as every family here). Each component registers its own once, when it is built.
    pub fn register(&self, name: &str, help: &str, metric: impl Metric) {
        self.registry
            .lock()
            .expect("metrics registry")
            .register(name, help, metric);
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

    pub fn rejected(&self, reason: &'static str) {
        self.bodies_rejected
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    pub fn store_reachable(&self, up: bool) {
        self.store_up.set(i64::from(up));
    }

    /// The Prometheus text exposition of every family.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let registry = self.registry.lock().expect("metrics registry");
        prometheus_client::encoding::text::encode(&mut out, &registry)
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
