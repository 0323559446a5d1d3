//! The coalescer's settings: declared once, as options, resolved and checked here.

use std::time::Duration;

use crate::plumbing::writes::MAX_BATCH_METRICS;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoalesceConfig {
    /// How long a request for a run that already has a batch at MLflow waits for others; zero
    /// turns coalescing off.
    pub window: Duration,
    /// The most batches of one run at MLflow at once; how many help is learned from MLflow's
    /// answers (see [`super::concurrency`]), and batches that write the same params or tags never
    /// overlap (see [`super::claims`]).
    pub in_flight_per_run: usize,
    /// Items (metrics, params, tags) queued per run before requests get 429.
    pub max_pending_per_run: usize,
    /// Bytes of request bodies queued over all runs before requests get 429.
    pub max_pending_bytes: usize,
}

impl Default for CoalesceConfig {
    fn default() -> Self {
        Self {
            window: Duration::from_millis(5),
            in_flight_per_run: 8,
            max_pending_per_run: 50_000,
            max_pending_bytes: 64 << 20,
        }
    }
}

impl CoalesceConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.window > Duration::from_secs(1) {
            return Err(format!(
                "coalesce-window must be at most 1s (every merged request waits up to it), not {:?}",
                self.window
            ));
        }
        if self.in_flight_per_run == 0 {
            return Err("coalesce-in-flight-per-run must be at least 1".into());
        }
        if self.max_pending_per_run < MAX_BATCH_METRICS {
            return Err(format!(
                "coalesce-max-pending-per-run must be at least {MAX_BATCH_METRICS} (one full batch)"
            ));
        }
        if self.max_pending_bytes < 1 << 20 {
            return Err("coalesce-max-pending must be at least 1MiB (one full batch)".into());
        }
        Ok(())
    }
}

/// The coalescer's settings as given (see [`crate::plumbing::settings`]); `None`: not given here.
#[derive(Debug, Clone, Default, clap::Args, serde::Deserialize)]
pub struct CoalesceOptions {
    /// How long a metric-only log-batch or log-metric waits for others to the same run (same
    /// credential) while that run has a batch at MLflow, to go on as one batch (a run with none
    /// sends at once); 0s turns coalescing off [default: 5ms].
    #[arg(long, env = "MLSCOPE_COALESCE_WINDOW", value_parser = crate::plumbing::settings::parse_duration, value_name = "DURATION")]
    #[serde(default, with = "humantime_serde")]
    pub coalesce_window: Option<Duration>,
    /// The most batches of one run at MLflow at once; requests gather while they are. The proxy
    /// learns how many help from MLflow's answers, up to this; batches writing the same params
    /// or tags never overlap, and against MLflow before 3.16, which deadlocks on PostgreSQL when
    /// writes to one run overlap, it sends one at a time [default: 8].
    #[arg(long, env = "MLSCOPE_COALESCE_IN_FLIGHT_PER_RUN", value_name = "N")]
    pub coalesce_in_flight_per_run: Option<usize>,
    /// Items (metrics, params, tags) queued per run before new requests for it get 429 [default: 50000].
    #[arg(long, env = "MLSCOPE_COALESCE_MAX_PENDING_PER_RUN", value_name = "N")]
    pub coalesce_max_pending_per_run: Option<usize>,
    /// Bytes of metric bodies queued over all runs before new requests get 429 [default: 64MiB].
    #[arg(long, env = "MLSCOPE_COALESCE_MAX_PENDING", value_parser = crate::plumbing::settings::parse_size, value_name = "SIZE")]
    #[serde(default, deserialize_with = "crate::plumbing::settings::size")]
    pub coalesce_max_pending: Option<usize>,
}

impl CoalesceOptions {
    /// The given values over the defaults.
    pub fn resolve(self) -> CoalesceConfig {
        let d = CoalesceConfig::default();
        CoalesceConfig {
            window: self.coalesce_window.unwrap_or(d.window),
            in_flight_per_run: self
                .coalesce_in_flight_per_run
                .unwrap_or(d.in_flight_per_run),
            max_pending_per_run: self
                .coalesce_max_pending_per_run
                .unwrap_or(d.max_pending_per_run),
            max_pending_bytes: self.coalesce_max_pending.unwrap_or(d.max_pending_bytes),
        }
    }
}
