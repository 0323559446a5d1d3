//! Run health's settings: what the sweep does with a dead run, when a run is dead and a GPU idle,
//! how often the sweep runs and heartbeats are flushed, and the credential the sweep uses for
//! MLflow.

use std::time::Duration;

use crate::plumbing::credential::Secret;
use crate::plumbing::settings::parse_duration;

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
use crate::plumbing::credential::ServiceCredential;

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

/// Run health's settings as given (see [`crate::plumbing::settings`]); `None`: not given here.
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
