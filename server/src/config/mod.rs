//! Configuration: defaults, then an optional TOML file, then environment, then flags.
//!
//! Nothing else in the crate reads `std::env`; tests build a [`Config`] directly.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use clap::{ArgAction, Parser};
use mlscope_scopes::OwnerPattern;
use serde::Deserialize;

use crate::artifacts::{ArtifactsConfig, Destination, Quirks, WritePolicy};
use crate::coalesce::CoalesceConfig;
use crate::fairshare::{FairShareConfig, Team};
use crate::health::{HealthConfig, ServiceCredential, StaleAction};
use crate::listen::ListenAddr;
use crate::rewrite::ScopeConfig;

mod relocate;

pub use relocate::{RelocateArgs, Secret};

/// Why a configuration was refused. `main` prints it on one line and exits with 64 (EX_USAGE).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    ReadFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    ParseFile { path: PathBuf, message: String },
    #[error("{0}")]
    Invalid(String),
    /// `--help` / `--version` or a flag clap could not parse; carries clap's own rendering.
    #[error("{0}")]
    Cli(#[from] clap::Error),
}

pub use crate::proxy::{ForwarderSettings, HostHeader, Timeouts, Upstream};
pub use crate::telemetry::LogFormat;

/// What one client connection may hold. None of it limits a transfer that keeps moving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InboundLimits {
    /// Client connections open at once; further ones wait in the listen backlog.
    pub max_connections: usize,
    /// Time a client has to send a request's headers, counted from when the connection starts
    /// waiting for them (also between keep-alive requests: the idle timeout).
    pub header_read_timeout: Duration,
    /// Largest request head (request line and headers) in bytes.
    pub max_header_bytes: usize,
}

impl Default for InboundLimits {
    fn default() -> Self {
        Self {
            max_connections: 4096,
            header_read_timeout: Duration::from_secs(15),
            max_header_bytes: 64 << 10,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Config {
    /// Where the MLflow-facing listener binds; a host name is resolved when serving starts.
    pub listen: ListenAddr,
    /// Where the admin listener (`/healthz`, `/readyz`, `/metrics`) binds.
    pub admin_listen: ListenAddr,
    pub upstream: Upstream,
    pub database_url: String,
    pub host_header: HostHeader,
    /// Gateways whose `X-Forwarded-For` names the client, for the limits one client may hold.
    pub trusted_proxies: crate::client::TrustedProxies,
    /// Each client's share of MLflow's writes.
    pub fair_share: FairShareConfig,
    pub timeouts: Timeouts,
    /// Requests handled at once; one more is answered 503 at once instead of queueing.
    pub max_in_flight: usize,
    /// Idle keep-alive connections kept to the upstream.
    pub upstream_max_idle: usize,
    /// Limits on inbound connections, against slow or hostile clients.
    pub inbound: InboundLimits,
    /// Rows of the state store untouched this long (leases, upload-failure counts, replicas) are
    /// deleted by the retention sweep.
    pub state_retention: Duration,
    /// How long in-flight requests may run on after SIGTERM/SIGINT.
    pub shutdown_grace: Duration,
    pub log_format: LogFormat,
    /// `tracing` filter directive, e.g. `info` or `mlscope_proxy=debug,info`.
    pub log_level: String,
    /// System-metric scoping and node deduplication.
    pub scopes: ScopeConfig,
    /// The artifact gateway: MLflow's artifact API served from an S3-compatible store.
    pub artifacts: ArtifactsConfig,
    /// Write coalescing of metric requests per run.
    pub coalesce: CoalesceConfig,
    /// Heartbeats, the stale-run sweep and GPU idleness.
    pub health: HealthConfig,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 5001)).into(),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 9464)).into(),
            upstream: Upstream::parse("http://127.0.0.1:5000").expect("default upstream parses"),
            database_url: "sqlite://mlscope.db".to_owned(),
            host_header: HostHeader::Preserve,
            trusted_proxies: crate::client::TrustedProxies::default(),
            fair_share: FairShareConfig::default(),
            timeouts: Timeouts {
                connect: Duration::from_secs(5),
                response_headers: Duration::from_secs(120),
                body_idle: Duration::from_secs(120),
            },
            max_in_flight: 1024,
            upstream_max_idle: 64,
            inbound: InboundLimits::default(),
            state_retention: Duration::from_secs(14 * 86_400),
            shutdown_grace: Duration::from_secs(30),
            log_format: LogFormat::Pretty,
            log_level: "info".to_owned(),
            scopes: ScopeConfig::default(),
            artifacts: ArtifactsConfig::default(),
            coalesce: CoalesceConfig::default(),
            health: HealthConfig::default(),
        }
    }
}

/// Command line and environment. Every field is optional so that a value given nowhere falls
/// back to the file, then to the default.
#[derive(Debug, Parser)]
#[command(
    name = "mlscope-proxy",
    version,
    about = "MLflow-compatible reverse proxy in front of an MLflow tracking server."
)]
struct Cli {
    /// TOML file with any of the settings below (keys as the long flags, with `_` for `-`).
    #[arg(long, env = "MLSCOPE_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// Address the MLflow-facing listener binds: an IP address or a host name with a port, e.g.
    /// 0.0.0.0:5001, [::1]:5001 or localhost:5001. A name is resolved at startup and only the
    /// first of its addresses that this host has is bound (::1 is skipped where IPv6 is off);
    /// give [::]:5001 to take IPv4 and IPv6 clients alike [default: 127.0.0.1:5001].
    #[arg(long, env = "MLSCOPE_LISTEN", value_name = "HOST:PORT")]
    listen: Option<ListenAddr>,
    /// Address of the admin listener serving /healthz, /readyz and /metrics, written and
    /// resolved as --listen [default: 127.0.0.1:9464].
    #[arg(long, env = "MLSCOPE_ADMIN_LISTEN", value_name = "HOST:PORT")]
    admin_listen: Option<ListenAddr>,
    /// URL of the MLflow tracking server [default: http://127.0.0.1:5000].
    #[arg(long, global = true, env = "MLSCOPE_UPSTREAM", value_name = "URL")]
    upstream: Option<String>,
    /// State store: `sqlite://<path>` (created on first start) or `postgres://...` when several
    /// replicas share state [default: sqlite://mlscope.db].
    #[arg(long, env = "MLSCOPE_DATABASE_URL", value_name = "URL")]
    database_url: Option<String>,
    /// `preserve` forwards the client's Host header; `upstream` sends the upstream's [default: preserve].
    #[arg(long, env = "MLSCOPE_HOST_HEADER", value_enum)]
    host_header: Option<HostHeader>,
    /// Addresses or networks of gateways in front of the proxy (e.g. 10.0.0.0/8,fd00::/8): a
    /// request from one is counted against the client its X-Forwarded-For names, for the share
    /// of inspected bodies and upload slots one client may hold [default: none; every client is
    /// its source address].
    #[arg(long, env = "MLSCOPE_TRUSTED_PROXIES", value_name = "NETWORKS")]
    trusted_proxies: Option<String>,
    /// Writes to MLflow's tracking API per second one client (its credential once MLflow
    /// accepted it, else its address) may send, with bursts of two seconds' worth; beyond, 429
    /// with Retry-After, which MLflow's client retries; 0 turns the limit off [default: 1000].
    #[arg(long, env = "MLSCOPE_CLIENT_WRITE_RATE", value_name = "PER_SECOND")]
    client_write_rate: Option<f64>,
    /// Metrics, params and tags per second one client may write, with bursts of two seconds'
    /// worth; a batch is charged once answered, so its client's next write waits until the bucket
    /// has paid for it; 0 turns the limit off [default: 20000].
    #[arg(long, env = "MLSCOPE_CLIENT_SAMPLE_RATE", value_name = "PER_SECOND")]
    client_sample_rate: Option<f64>,
    /// Ceiling of the number of writes at MLflow at once, a limit learned from MLflow's latency:
    /// once it is reached, the client with the most writes waiting is refused (429) while others
    /// are active; 0 turns saturation control off [default: 64].
    #[arg(long, env = "MLSCOPE_MAX_WRITES_AT_MLFLOW", value_name = "N")]
    max_writes_at_mlflow: Option<usize>,
    /// Upstream TCP connect timeout [default: 5s].
    #[arg(long, env = "MLSCOPE_CONNECT_TIMEOUT", value_parser = parse_duration, value_name = "DURATION")]
    connect_timeout: Option<Duration>,
    /// Time the upstream may take to send response headers [default: 120s].
    #[arg(long, env = "MLSCOPE_RESPONSE_TIMEOUT", value_parser = parse_duration, value_name = "DURATION")]
    response_timeout: Option<Duration>,
    /// Longest pause inside a request or response body before it is aborted [default: 120s].
    #[arg(long, env = "MLSCOPE_BODY_IDLE_TIMEOUT", value_parser = parse_duration, value_name = "DURATION")]
    body_idle_timeout: Option<Duration>,
    /// Concurrent requests before new ones get 503 [default: 1024].
    #[arg(long, env = "MLSCOPE_MAX_IN_FLIGHT", value_name = "N")]
    max_in_flight: Option<usize>,
    /// State-store rows untouched this long (node leases, upload-failure counts, replica rows)
    /// are deleted; keep it above the longest pause of a run that may resume [default: 14d].
    #[arg(long, env = "MLSCOPE_STATE_RETENTION", value_parser = parse_duration, value_name = "DURATION")]
    state_retention: Option<Duration>,
    /// Client connections open at once; more wait in the listen backlog [default: 4096].
    #[arg(long, env = "MLSCOPE_MAX_CONNECTIONS", value_name = "N")]
    max_connections: Option<usize>,
    /// Time a client has to send a request's headers; also how long an idle keep-alive
    /// connection stays open [default: 15s].
    #[arg(long, env = "MLSCOPE_HEADER_READ_TIMEOUT", value_parser = parse_duration, value_name = "DURATION")]
    header_read_timeout: Option<Duration>,
    /// Largest request head (request line and headers), e.g. 64KiB [default: 64KiB].
    #[arg(long, env = "MLSCOPE_MAX_HEADER_BYTES", value_parser = parse_size, value_name = "SIZE")]
    max_header_bytes: Option<usize>,
    /// Idle keep-alive connections kept to the upstream [default: 64].
    #[arg(long, env = "MLSCOPE_UPSTREAM_MAX_IDLE", value_name = "N")]
    upstream_max_idle: Option<usize>,
    /// Deadline for in-flight requests after SIGTERM/SIGINT [default: 30s].
    #[arg(long, env = "MLSCOPE_SHUTDOWN_GRACE", value_parser = parse_duration, value_name = "DURATION")]
    shutdown_grace: Option<Duration>,
    /// Log format [default: pretty].
    #[arg(long, env = "MLSCOPE_LOG_FORMAT", value_enum)]
    log_format: Option<LogFormat>,
    /// Log filter, e.g. `info` or `mlscope_proxy=debug` [default: info].
    #[arg(long, env = "MLSCOPE_LOG", value_name = "FILTER")]
    log_level: Option<String>,
    /// Rename ambiguous `system/` metric keys to scoped names [default: true].
    #[arg(long, env = "MLSCOPE_REWRITE_SYSTEM_METRICS", value_name = "BOOL", action = ArgAction::Set)]
    rewrite_system_metrics: Option<bool>,
    /// Regular expression for the owner segment(s) of `system/<owner>/<name>` keys, with named
    /// groups `node` and/or `rank` [default: rank-<r>, rank_<r>, rank<r>, <node>/rank-<r>].
    #[arg(long, env = "MLSCOPE_OWNER_PATTERN", value_name = "REGEX")]
    owner_pattern: Option<String>,
    /// Migration period: until this time (RFC 3339, e.g. 2027-03-01T00:00:00Z) each renamed
    /// sample is also written under its original key so existing dashboards keep working.
    #[arg(long, env = "MLSCOPE_KEEP_ORIGINAL_KEYS_UNTIL", value_name = "TIME", value_parser = parse_time)]
    keep_original_keys_until: Option<SystemTime>,
    /// Keep node-wide samples (node_*, rootfs_*) from one rank per (run, node) [default: true].
    #[arg(long, env = "MLSCOPE_DEDUP", value_name = "BOOL", action = ArgAction::Set)]
    dedup: Option<bool>,
    /// How often a reporter's lease is renewed in the store (a higher last step is written at once, whatever the interval) [default: 5s].
    #[arg(long, env = "MLSCOPE_DEDUP_UPDATE_INTERVAL", value_parser = parse_duration, value_name = "DURATION")]
    dedup_update_interval: Option<Duration>,
    /// Silence after which another rank takes over a node's series [default: 30s].
    #[arg(long, env = "MLSCOPE_DEDUP_FAILOVER_TIMEOUT", value_parser = parse_duration, value_name = "DURATION")]
    dedup_failover_timeout: Option<Duration>,
    /// Largest metrics body inspected; larger ones get 413 (e.g. 16MiB, 512KiB) [default: 16MiB].
    #[arg(long, env = "MLSCOPE_MAX_INSPECT_BODY", value_parser = parse_size, value_name = "SIZE")]
    max_inspect_body: Option<usize>,
    /// Memory all metrics bodies under inspection may hold together; beyond it requests get 503
    /// and are retried (e.g. 256MiB) [default: 256MiB].
    #[arg(long, env = "MLSCOPE_MAX_INSPECT_TOTAL", value_parser = parse_size, value_name = "SIZE")]
    max_inspect_total: Option<usize>,
    /// How long a metrics body may take to arrive whole; a slower one gets 408 and frees what it
    /// held of --max-inspect-total (which bodies are charged as bytes arrive; its last quarter is
    /// kept for clients holding less than a quarter) [default: 60s].
    #[arg(long, env = "MLSCOPE_INSPECT_BODY_DEADLINE", value_parser = parse_duration, value_name = "DURATION")]
    inspect_body_deadline: Option<Duration>,
    /// How long a metric-only log-batch or log-metric waits for others to the same run (same
    /// credential) while that run has a batch at MLflow, to go on as one batch (a run with none
    /// sends at once); 0s turns coalescing off [default: 5ms].
    #[arg(long, env = "MLSCOPE_COALESCE_WINDOW", value_parser = parse_duration, value_name = "DURATION")]
    coalesce_window: Option<Duration>,
    /// Batches of metrics alone of one run at MLflow at once (batches with params or tags always
    /// go one at a time); requests gather while they are. Against MLflow before 3.16, which
    /// deadlocks on PostgreSQL when they overlap, the proxy uses 1 [default: 2].
    #[arg(long, env = "MLSCOPE_COALESCE_IN_FLIGHT_PER_RUN", value_name = "N")]
    coalesce_in_flight_per_run: Option<usize>,
    /// Items (metrics, params, tags) queued per run before new requests for it get 503 [default: 50000].
    #[arg(long, env = "MLSCOPE_COALESCE_MAX_PENDING_PER_RUN", value_name = "N")]
    coalesce_max_pending_per_run: Option<usize>,
    /// Bytes of metric bodies queued over all runs before new requests get 503 [default: 64MiB].
    #[arg(long, env = "MLSCOPE_COALESCE_MAX_PENDING", value_parser = parse_size, value_name = "SIZE")]
    coalesce_max_pending: Option<usize>,
    /// Serve MLflow's artifact API from this S3 location, laid out as MLflow's own
    /// `--artifacts-destination` (e.g. s3://mlflow/artifacts). Unset: artifact requests are forwarded.
    #[arg(
        long,
        global = true,
        env = "MLSCOPE_ARTIFACTS_DESTINATION",
        value_name = "URI"
    )]
    artifacts_destination: Option<String>,
    /// S3 endpoint of an S3-compatible store (e.g. http://seaweedfs:8333); unset for AWS S3.
    #[arg(
        long,
        global = true,
        env = "MLSCOPE_S3_ENDPOINT_URL",
        value_name = "URL"
    )]
    s3_endpoint_url: Option<String>,
    /// Region to sign requests for [default: the quirks profile's, us-east-1 for most].
    #[arg(long, global = true, env = "MLSCOPE_S3_REGION", value_name = "REGION")]
    s3_region: Option<String>,
    /// Path-style addressing (endpoint/bucket/key) [default: the quirks profile's].
    #[arg(long, global = true, env = "MLSCOPE_S3_PATH_STYLE", value_name = "BOOL", action = ArgAction::Set)]
    s3_path_style: Option<bool>,
    /// Store quirks profile: generic, aws, seaweedfs, minio, ceph, r2 [default: generic].
    #[arg(long, global = true, env = "MLSCOPE_S3_QUIRKS", value_name = "PROFILE")]
    s3_quirks: Option<String>,
    /// Endpoint written into presigned multipart URLs when clients reach the store under
    /// another address than the proxy [default: --s3-endpoint-url].
    #[arg(
        long,
        global = true,
        env = "MLSCOPE_S3_PRESIGN_ENDPOINT_URL",
        value_name = "URL"
    )]
    s3_presign_endpoint_url: Option<String>,
    /// Part size of multipart uploads; memory per upload is bounded by part size x
    /// (concurrency + 1) [default: 8MiB, at least 5MiB].
    #[arg(long, env = "MLSCOPE_ARTIFACT_PART_SIZE", value_parser = parse_size, value_name = "SIZE")]
    artifact_part_size: Option<usize>,
    /// Parts of one upload sent to the store at once [default: 4].
    #[arg(long, env = "MLSCOPE_ARTIFACT_UPLOAD_CONCURRENCY", value_name = "N")]
    artifact_upload_concurrency: Option<usize>,
    /// Uploads up to this size go to the store as one PUT; larger or unknown-length ones as
    /// multipart uploads [default: 8MiB].
    #[arg(long, env = "MLSCOPE_ARTIFACT_MULTIPART_THRESHOLD", value_parser = parse_size, value_name = "SIZE")]
    artifact_multipart_threshold: Option<usize>,
    /// Artifact uploads handled at once; more get 503 and are retried by the client [default: 32].
    #[arg(
        long,
        env = "MLSCOPE_ARTIFACT_MAX_CONCURRENT_UPLOADS",
        value_name = "N"
    )]
    artifact_max_concurrent_uploads: Option<usize>,
    /// Writes outside MLflow-owned roots (<exp>/<run>/artifacts, <exp>/models/<id>/artifacts,
    /// <exp>/traces/<id>/artifacts): enforce (403), warn (log and allow) or off [default: enforce].
    #[arg(long, env = "MLSCOPE_ARTIFACT_WRITE_POLICY", value_enum)]
    artifact_write_policy: Option<WritePolicy>,
    /// How long a run's, model's or trace's existence is cached for the write policy [default: 5m].
    #[arg(long, env = "MLSCOPE_ARTIFACT_OWNER_CACHE_TTL", value_parser = parse_duration, value_name = "DURATION")]
    artifact_owner_cache_ttl: Option<Duration>,
    /// When MLflow authenticates, how long its "allowed" for one client, operation and path is
    /// reused before MLflow is asked again; 0 asks on every request [default: 10s].
    #[arg(long, env = "MLSCOPE_ARTIFACT_AUTHZ_CACHE_TTL", value_parser = parse_duration, value_name = "DURATION")]
    artifact_authz_cache_ttl: Option<Duration>,
    /// Validity of presigned multipart part URLs [default: 1h].
    #[arg(long, env = "MLSCOPE_ARTIFACT_PRESIGN_EXPIRY", value_parser = parse_duration, value_name = "DURATION")]
    artifact_presign_expiry: Option<Duration>,
    /// Run health: record heartbeats of every rank, judge runs whose ranks all went silent or
    /// failed, and export live runs' idle GPUs [default: true].
    #[arg(long, env = "MLSCOPE_RUN_HEALTH", value_name = "BOOL", action = ArgAction::Set)]
    run_health: Option<bool>,
    /// Silence of every rank after which a run still RUNNING in MLflow is judged lost [default: 5m].
    #[arg(long, env = "MLSCOPE_RUN_STALE_AFTER", value_parser = parse_duration, value_name = "DURATION")]
    run_stale_after: Option<Duration>,
    /// What happens to a dead run: `end` tags it and ends it FAILED at its last heartbeat,
    /// `tag` only tags it [default: end].
    #[arg(long, env = "MLSCOPE_STALE_RUN_ACTION", value_enum)]
    stale_run_action: Option<StaleAction>,
    /// A GPU idle (utilisation and memory activity under the collector's threshold) this long
    /// counts as idle in /metrics, /runs/{id}/health and the run's mlscope.gpus_idle tag
    /// [default: 30m].
    #[arg(long, env = "MLSCOPE_GPU_IDLE_AFTER", value_parser = parse_duration, value_name = "DURATION")]
    gpu_idle_after: Option<Duration>,
    /// How often the stale-run sweep runs (on one replica at a time) and the run gauges are
    /// refreshed [default: 30s].
    #[arg(long, env = "MLSCOPE_HEALTH_SWEEP_INTERVAL", value_parser = parse_duration, value_name = "DURATION")]
    health_sweep_interval: Option<Duration>,
    /// How often heartbeats gathered in memory are written to the state store [default: 2s].
    #[arg(long, env = "MLSCOPE_HEALTH_FLUSH_INTERVAL", value_parser = parse_duration, value_name = "DURATION")]
    health_flush_interval: Option<Duration>,
    /// Bearer token the stale-run sweep uses with an MLflow that authenticates (needs EDIT on
    /// every run it may end).
    #[arg(
        long,
        env = "MLSCOPE_MLFLOW_SERVICE_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    mlflow_service_token: Option<Secret>,
    /// User name the stale-run sweep uses with MLflow's basic authentication.
    #[arg(long, env = "MLSCOPE_MLFLOW_SERVICE_USERNAME", value_name = "USER")]
    mlflow_service_username: Option<String>,
    /// Password for --mlflow-service-username.
    #[arg(
        long,
        env = "MLSCOPE_MLFLOW_SERVICE_PASSWORD",
        hide_env_values = true,
        value_name = "PASSWORD"
    )]
    mlflow_service_password: Option<Secret>,
    /// Check the configuration (file, environment, flags) and exit: 0 when it is accepted, 64
    /// with the reason when not. Nothing is started or connected to.
    #[arg(long)]
    check_config: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Copy stray objects (e.g. checkpoints written outside MLflow's layout) into a run's
    /// artifact path with server-side copies; originals are kept unless --delete-source.
    Relocate(RelocateArgs),
}

/// What the command line asks for.
#[derive(Debug)]
pub enum Invocation {
    /// Run the proxy (no subcommand).
    Serve(Config),
    /// `relocate`: repair history with server-side copies, using the S3 and upstream settings.
    Relocate(Config, RelocateArgs),
    /// `--check-config`: the configuration was accepted; nothing is started.
    Check(Config),
}

/// The TOML file: the same settings as the flags.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    // Read as text and checked with the key's name (`listen_setting`): a serde error would not
    // say which key it was about.
    listen: Option<String>,
    admin_listen: Option<String>,
    upstream: Option<String>,
    database_url: Option<String>,
    host_header: Option<HostHeader>,
    trusted_proxies: Option<String>,
    client_write_rate: Option<f64>,
    client_sample_rate: Option<f64>,
    max_writes_at_mlflow: Option<usize>,
    /// Per-team quotas (`[[teams]]` tables): only in the file.
    #[serde(default)]
    teams: Vec<Team>,
    #[serde(default, with = "humantime_serde")]
    connect_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    response_timeout: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    body_idle_timeout: Option<Duration>,
    max_in_flight: Option<usize>,
    max_connections: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    state_retention: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    header_read_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "size_from_toml")]
    max_header_bytes: Option<usize>,
    upstream_max_idle: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    shutdown_grace: Option<Duration>,
    log_format: Option<LogFormat>,
    log_level: Option<String>,
    rewrite_system_metrics: Option<bool>,
    owner_pattern: Option<String>,
    #[serde(default, with = "humantime_serde")]
    keep_original_keys_until: Option<SystemTime>,
    dedup: Option<bool>,
    #[serde(default, with = "humantime_serde")]
    dedup_update_interval: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    dedup_failover_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "size_from_toml")]
    max_inspect_body: Option<usize>,
    #[serde(default, deserialize_with = "size_from_toml")]
    max_inspect_total: Option<usize>,
    #[serde(default, with = "humantime_serde")]
    inspect_body_deadline: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    coalesce_window: Option<Duration>,
    coalesce_in_flight_per_run: Option<usize>,
    coalesce_max_pending_per_run: Option<usize>,
    #[serde(default, deserialize_with = "size_from_toml")]
    coalesce_max_pending: Option<usize>,
    artifacts_destination: Option<String>,
    s3_endpoint_url: Option<String>,
    s3_region: Option<String>,
    s3_path_style: Option<bool>,
    s3_quirks: Option<String>,
    s3_presign_endpoint_url: Option<String>,
    #[serde(default, deserialize_with = "size_from_toml")]
    artifact_part_size: Option<usize>,
    artifact_upload_concurrency: Option<usize>,
    #[serde(default, deserialize_with = "size_from_toml")]
    artifact_multipart_threshold: Option<usize>,
    artifact_max_concurrent_uploads: Option<usize>,
    artifact_write_policy: Option<WritePolicy>,
    #[serde(default, with = "humantime_serde")]
    artifact_owner_cache_ttl: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    artifact_authz_cache_ttl: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    artifact_presign_expiry: Option<Duration>,
    run_health: Option<bool>,
    #[serde(default, with = "humantime_serde")]
    run_stale_after: Option<Duration>,
    stale_run_action: Option<StaleAction>,
    #[serde(default, with = "humantime_serde")]
    gpu_idle_after: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    health_sweep_interval: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    health_flush_interval: Option<Duration>,
    // Credentials come from the environment or flags only, never from the file.
}

fn size_from_toml<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Bytes(usize),
        Text(String),
    }
    match Option::<Size>::deserialize(d)? {
        None => Ok(None),
        Some(Size::Bytes(n)) => Ok(Some(n)),
        Some(Size::Text(t)) => parse_size(&t).map(Some).map_err(serde::de::Error::custom),
    }
}

/// `16MiB`, `512KiB`, `1GiB`, `1000000` (bytes); `MB`/`KB`/`GB` are decimal.
pub(crate) fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let number: usize = number
        .parse()
        .map_err(|_| format!("{s:?} is not a size (write e.g. 16MiB)"))?;
    let factor = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => {
            return Err(format!(
                "unknown size unit {other:?} (use B, KiB, MiB, GiB)"
            ))
        }
    };
    number
        .checked_mul(factor)
        .ok_or_else(|| format!("{s:?} is too large"))
}

fn parse_time(s: &str) -> Result<SystemTime, String> {
    humantime::parse_rfc3339_weak(s).map_err(|e| format!("{e} (write e.g. 2027-03-01T00:00:00Z)"))
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (write e.g. 500ms, 30s, 2m)"))
}

impl Config {
    /// What the forwarder to MLflow is built from.
    pub fn forwarder(&self) -> ForwarderSettings {
        ForwarderSettings {
            upstream: self.upstream.clone(),
            host_header: self.host_header,
            timeouts: self.timeouts,
            max_idle: self.upstream_max_idle,
        }
    }

    /// Loads from the given arguments (environment still applies through clap's `env`) for
    /// serving; a subcommand is refused.
    pub fn from_args<I, T>(args: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        match Self::invocation(args)? {
            Invocation::Serve(config) => Ok(config),
            Invocation::Relocate(..) | Invocation::Check(_) => Err(ConfigError::Invalid(
                "a subcommand was given where serving was expected".into(),
            )),
        }
    }

    /// Parses the command line: serving, or a subcommand with the configuration it shares.
    pub fn invocation<I, T>(args: I) -> Result<Invocation, ConfigError>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let mut cli = Cli::try_parse_from(args)?;
        let command = cli.command.take();
        let file = match &cli.config {
            Some(path) => read_file(path)?,
            None => FileConfig::default(),
        };
        let mut config = Config::default();
        let upstream = cli.upstream.or(file.upstream);
        if let Some(url) = upstream {
            config.upstream = Upstream::parse(&url).map_err(ConfigError::Invalid)?;
        }
        macro_rules! layer {
            ($($field:ident => $target:expr),* $(,)?) => {
                $( if let Some(v) = cli.$field.or(file.$field) { $target = v; } )*
            };
        }
        let config_path = cli.config.as_deref();
        if let Some(listen) = listen_setting(cli.listen, file.listen, "listen", config_path)? {
            config.listen = listen;
        }
        if let Some(admin_listen) = listen_setting(
            cli.admin_listen,
            file.admin_listen,
            "admin_listen",
            config_path,
        )? {
            config.admin_listen = admin_listen;
        }
        if let Some(networks) = cli.trusted_proxies.or(file.trusted_proxies) {
            config.trusted_proxies = crate::client::TrustedProxies::parse(&networks)
                .map_err(|e| ConfigError::Invalid(format!("trusted-proxies: {e}")))?;
        }
        if let Some(pattern) = cli.owner_pattern.or(file.owner_pattern) {
            config.scopes.owner_pattern =
                OwnerPattern::new(&pattern).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        }
        if let Some(until) = cli
            .keep_original_keys_until
            .or(file.keep_original_keys_until)
        {
            config.scopes.keep_original_until = Some(until);
        }
        layer! {
            rewrite_system_metrics => config.scopes.rewrite,
            dedup => config.scopes.dedup,
            dedup_update_interval => config.scopes.dedup_config.update_interval,
            dedup_failover_timeout => config.scopes.dedup_config.failover_timeout,
            max_inspect_body => config.scopes.max_inspect_bytes,
            max_inspect_total => config.scopes.max_inspect_total,
            inspect_body_deadline => config.scopes.inspect_deadline,
            coalesce_window => config.coalesce.window,
            coalesce_in_flight_per_run => config.coalesce.in_flight_per_run,
            coalesce_max_pending_per_run => config.coalesce.max_pending_per_run,
            coalesce_max_pending => config.coalesce.max_pending_bytes,
            database_url => config.database_url,
            host_header => config.host_header,
            client_write_rate => config.fair_share.client_write_rate,
            client_sample_rate => config.fair_share.client_sample_rate,
            max_writes_at_mlflow => config.fair_share.max_writes_at_mlflow,
            connect_timeout => config.timeouts.connect,
            response_timeout => config.timeouts.response_headers,
            body_idle_timeout => config.timeouts.body_idle,
            max_in_flight => config.max_in_flight,
            max_connections => config.inbound.max_connections,
            state_retention => config.state_retention,
            header_read_timeout => config.inbound.header_read_timeout,
            max_header_bytes => config.inbound.max_header_bytes,
            upstream_max_idle => config.upstream_max_idle,
            shutdown_grace => config.shutdown_grace,
            log_format => config.log_format,
            log_level => config.log_level,
            artifact_part_size => config.artifacts.part_size,
            artifact_upload_concurrency => config.artifacts.upload_concurrency,
            artifact_multipart_threshold => config.artifacts.multipart_threshold,
            artifact_max_concurrent_uploads => config.artifacts.max_concurrent_uploads,
            artifact_write_policy => config.artifacts.write_policy,
            artifact_owner_cache_ttl => config.artifacts.owner_cache_ttl,
            artifact_authz_cache_ttl => config.artifacts.authz_cache_ttl,
            artifact_presign_expiry => config.artifacts.presign_expiry,
            run_health => config.health.enabled,
            run_stale_after => config.health.stale_after,
            stale_run_action => config.health.action,
            gpu_idle_after => config.health.gpu_idle_after,
            health_sweep_interval => config.health.sweep_interval,
            health_flush_interval => config.health.flush_interval,
        }
        config.fair_share.teams = file.teams;
        config.health.credential = match (
            cli.mlflow_service_token,
            cli.mlflow_service_username,
            cli.mlflow_service_password,
        ) {
            (Some(token), None, None) => ServiceCredential::Token(token),
            (None, Some(username), Some(password)) => ServiceCredential::Basic { username, password },
            (None, None, None) => ServiceCredential::None,
            _ => {
                return Err(ConfigError::Invalid(
                    "give the stale-run sweep either --mlflow-service-token, or both --mlflow-service-username and --mlflow-service-password".into(),
                ))
            }
        };
        if let Some(uri) = cli.artifacts_destination.or(file.artifacts_destination) {
            config.artifacts.destination =
                Some(Destination::parse(&uri).map_err(ConfigError::Invalid)?);
        }
        let s3 = &mut config.artifacts.s3;
        s3.endpoint_url = cli
            .s3_endpoint_url
            .or(file.s3_endpoint_url)
            .or(s3.endpoint_url.take());
        s3.region = cli.s3_region.or(file.s3_region).or(s3.region.take());
        s3.path_style = cli.s3_path_style.or(file.s3_path_style).or(s3.path_style);
        s3.presign_endpoint_url = cli
            .s3_presign_endpoint_url
            .or(file.s3_presign_endpoint_url)
            .or(s3.presign_endpoint_url.take());
        if let Some(name) = cli.s3_quirks.or(file.s3_quirks) {
            config.artifacts.s3.quirks = Quirks::named(&name).map_err(ConfigError::Invalid)?;
        }
        config.artifacts.s3.stall_grace = config.timeouts.body_idle;
        config.validate()?;
        Ok(match command {
            None if cli.check_config => Invocation::Check(config),
            None => Invocation::Serve(config),
            Some(Command::Relocate(args)) => Invocation::Relocate(config, args),
        })
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        if self.listen == self.admin_listen && self.listen.port() != 0 {
            return invalid(format!(
                "listen and admin-listen are both {}; give the admin listener its own port",
                self.listen
            ));
        }
        if self.max_in_flight == 0 {
            return invalid("max-in-flight must be at least 1".into());
        }
        if self.state_retention < Duration::from_secs(3600) {
            return invalid(
                "state-retention must be at least 1h (leases of live runs must never expire)"
                    .into(),
            );
        }
        if self.inbound.max_connections == 0 {
            return invalid("max-connections must be at least 1".into());
        }
        if self.inbound.header_read_timeout.is_zero() {
            return invalid("header-read-timeout must be longer than 0".into());
        }
        if !(8 << 10..=16 << 20).contains(&self.inbound.max_header_bytes) {
            return invalid(format!(
                "max-header-bytes must be between 8KiB and 16MiB, not {} bytes",
                self.inbound.max_header_bytes
            ));
        }
        for (name, d) in [
            ("connect-timeout", self.timeouts.connect),
            ("response-timeout", self.timeouts.response_headers),
            ("body-idle-timeout", self.timeouts.body_idle),
        ] {
            if d.is_zero() {
                return invalid(format!("{name} must be longer than 0"));
            }
        }
        let dedup = &self.scopes.dedup_config;
        if dedup.update_interval.is_zero() || dedup.update_interval >= dedup.failover_timeout {
            return invalid(format!(
                "dedup-update-interval ({:?}) must be above 0 and below dedup-failover-timeout ({:?})",
                dedup.update_interval, dedup.failover_timeout
            ));
        }
        if self.scopes.max_inspect_bytes < 1024 {
            return invalid("max-inspect-body must be at least 1KiB".into());
        }
        if self.scopes.max_inspect_total < self.scopes.max_inspect_bytes {
            return invalid(format!(
                "max-inspect-total ({} bytes) must be at least max-inspect-body ({} bytes)",
                self.scopes.max_inspect_total, self.scopes.max_inspect_bytes
            ));
        }
        self.fair_share.validate().map_err(ConfigError::Invalid)?;
        if self.scopes.inspect_deadline < Duration::from_secs(1) {
            return invalid(format!(
                "inspect-body-deadline must be at least 1s (a whole metrics body must arrive within it), not {:?}",
                self.scopes.inspect_deadline
            ));
        }
        let coalesce = &self.coalesce;
        if coalesce.window > Duration::from_secs(1) {
            return invalid(format!(
                "coalesce-window must be at most 1s (every merged request waits up to it), not {:?}",
                coalesce.window
            ));
        }
        if coalesce.in_flight_per_run == 0 {
            return invalid("coalesce-in-flight-per-run must be at least 1".into());
        }
        if coalesce.max_pending_per_run < crate::coalesce::MAX_BATCH_METRICS {
            return invalid(format!(
                "coalesce-max-pending-per-run must be at least {} (one full batch)",
                crate::coalesce::MAX_BATCH_METRICS
            ));
        }
        if coalesce.max_pending_bytes < 1 << 20 {
            return invalid("coalesce-max-pending must be at least 1MiB (one full batch)".into());
        }
        let health = &self.health;
        if health.stale_after < Duration::from_secs(1) {
            return invalid("run-stale-after must be at least 1s".into());
        }
        if health.sweep_interval < Duration::from_millis(100)
            || health.flush_interval < Duration::from_millis(100)
        {
            return invalid(
                "health-sweep-interval and health-flush-interval must be at least 100ms".into(),
            );
        }
        self.artifacts.validate().map_err(ConfigError::Invalid)?;
        crate::store::StoreUrl::parse(&self.database_url)
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        tracing_subscriber::EnvFilter::try_new(&self.log_level)
            .map_err(|e| ConfigError::Invalid(format!("log-level {:?}: {e}", self.log_level)))?;
        Ok(())
    }
}

/// A listen address from the flags (clap has checked it), else from the file.
fn listen_setting(
    flag: Option<ListenAddr>,
    file: Option<String>,
    key: &str,
    path: Option<&Path>,
) -> Result<Option<ListenAddr>, ConfigError> {
    match (flag, file) {
        (Some(address), _) => Ok(Some(address)),
        (None, Some(text)) => text
            .parse()
            .map(Some)
            .map_err(|why| ConfigError::ParseFile {
                path: path.unwrap_or(Path::new("")).to_owned(),
                message: format!("{key} = {text:?}: {why}"),
            }),
        (None, None) => Ok(None),
    }
}

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
        path: path.to_owned(),
        source,
    })?;
    toml::from_str(&text).map_err(|e| ConfigError::ParseFile {
        path: path.to_owned(),
        // toml's message spans several lines (with a source excerpt); keep the first.
        message: e
            .message()
            .lines()
            .next()
            .unwrap_or("invalid TOML")
            .to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn flags_override_the_file_which_overrides_defaults() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        writeln!(file, "upstream = \"http://mlflow:5000/prefix/\"\nlisten = \"0.0.0.0:8080\"\nbody_idle_timeout = \"5m\"").unwrap();
        let path = file.path().to_str().unwrap();
        let c = Config::from_args([
            "mlscope-proxy",
            "--config",
            path,
            "--listen",
            "127.0.0.1:7000",
        ])
        .unwrap();
        assert_eq!(c.listen, "127.0.0.1:7000".parse().unwrap());
        assert_eq!(c.upstream.authority.as_str(), "mlflow:5000");
        assert_eq!(c.upstream.base_path, "/prefix");
        assert_eq!(c.timeouts.body_idle, Duration::from_secs(300));
        assert_eq!(c.admin_listen, Config::default().admin_listen);
    }

    #[test]
    fn listen_addresses_may_name_a_host_and_must_have_a_port() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        writeln!(file, "admin_listen = \"localhost:9000\"").unwrap();
        let path = file.path().to_str().unwrap().to_owned();
        let c = Config::from_args(["p", "--config", &path, "--listen", "localhost:5001"]).unwrap();
        assert_eq!(c.listen.to_string(), "localhost:5001");
        assert_eq!(c.admin_listen.to_string(), "localhost:9000");
        let c = Config::from_args(["p", "--listen", "[::1]:5001"]).unwrap();
        assert_eq!(c.listen.to_string(), "[::1]:5001");

        let err = Config::from_args(["p", "--listen", "localhost"]).unwrap_err();
        let ConfigError::Cli(clap) = &err else {
            panic!("not refused by the flag's parser: {err}")
        };
        let first = clap.to_string().lines().next().unwrap().to_owned();
        assert!(first.contains("--listen"), "{first}");
        assert!(
            first.contains("expected HOST:PORT, e.g. 127.0.0.1:5001 or localhost:5001"),
            "{first}"
        );
        let err = Config::from_args(["p", "--admin-listen", "localhost:65536"]).unwrap_err();
        assert!(err.to_string().contains("--admin-listen"), "{err}");

        writeln!(file, "listen = \"0.0.0.0\"").unwrap();
        let err = Config::from_args(["p", "--config", &path]).unwrap_err();
        assert!(
            err.to_string()
                .contains("listen = \"0.0.0.0\": no port; expected HOST:PORT"),
            "{err}"
        );
    }

    #[test]
    fn unknown_file_keys_and_bad_values_are_refused_with_a_reason() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        writeln!(file, "upstreem = \"http://x\"").unwrap();
        let err = Config::from_args(["p", "--config", file.path().to_str().unwrap()]).unwrap_err();
        assert!(
            err.to_string().contains("unknown field `upstreem`"),
            "{err}"
        );

        let err = Config::from_args(["p", "--upstream", "https://mlflow"]).unwrap_err();
        assert!(err.to_string().contains("not supported"), "{err}");
        let err = Config::from_args(["p", "--database-url", "mysql://x"]).unwrap_err();
        assert!(err.to_string().contains("mysql"), "{err}");
        let err = Config::from_args(["p", "--connect-timeout", "soon"]).unwrap_err();
        assert!(matches!(err, ConfigError::Cli(_)));
    }

    #[test]
    fn scope_settings_come_from_flags_and_file() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        writeln!(file, "dedup_failover_timeout = \"45s\"\nmax_inspect_body = \"2MiB\"\nowner_pattern = \"^(?P<node>[a-z]+)/w(?P<rank>\\\\d+)$\"").unwrap();
        let c = Config::from_args([
            "p",
            "--config",
            file.path().to_str().unwrap(),
            "--dedup",
            "false",
            "--keep-original-keys-until",
            "2030-01-01T00:00:00Z",
        ])
        .unwrap();
        assert!(!c.scopes.dedup);
        assert_eq!(
            c.scopes.dedup_config.failover_timeout,
            Duration::from_secs(45)
        );
        assert_eq!(c.scopes.max_inspect_bytes, 2 << 20);
        assert!(c.scopes.keep_original_until.is_some());
        assert_eq!(c.scopes.owner_pattern.parse("abc/w3").rank, Some(3));
        let err = Config::from_args(["p", "--dedup-update-interval", "40s"]).unwrap_err();
        assert!(
            err.to_string().contains("below dedup-failover-timeout"),
            "{err}"
        );
        let err = Config::from_args(["p", "--owner-pattern", "("]).unwrap_err();
        assert!(
            err.to_string().contains("not a valid regular expression"),
            "{err}"
        );
        assert_eq!(parse_size("16MiB"), Ok(16 << 20));
        assert!(parse_size("12 parsecs").is_err());
    }

    #[test]
    fn artifact_gateway_settings_come_from_file_and_flags_and_bad_ones_are_refused() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        writeln!(
            file,
            "artifacts_destination = \"s3://mlflow/artifacts\"\ns3_endpoint_url = \"http://seaweedfs:8333\"\ns3_quirks = \"seaweedfs\"\nartifact_part_size = \"16MiB\"\nartifact_write_policy = \"warn\""
        )
        .unwrap();
        let path = file.path().to_str().unwrap();
        let c = Config::from_args(["p", "--config", path, "--artifact-upload-concurrency", "8"])
            .unwrap();
        let a = &c.artifacts;
        assert_eq!(
            a.destination.as_ref().unwrap().to_string(),
            "s3://mlflow/artifacts"
        );
        assert_eq!(a.s3.endpoint_url.as_deref(), Some("http://seaweedfs:8333"));
        assert_eq!(a.s3.quirks.name, "seaweedfs");
        assert_eq!((a.part_size, a.upload_concurrency), (16 << 20, 8));
        assert_eq!(a.write_policy, WritePolicy::Warn);
        assert_eq!(a.upload_memory_bound(), (8 << 20) + 1 + 8 * (16 << 20));
        assert!(
            Config::default().artifacts.destination.is_none(),
            "without a destination artifacts are forwarded"
        );

        for (args, expected) in [
            (vec!["--s3-quirks", "gcs"], "known profiles: generic, aws"),
            (
                vec!["--artifacts-destination", "gs://bucket/x"],
                "s3://<bucket>/<prefix>",
            ),
            (
                vec!["--s3-endpoint-url", "http://s3:8333"],
                "artifacts-destination is not",
            ),
            (
                vec![
                    "--artifacts-destination",
                    "s3://b/p",
                    "--artifact-part-size",
                    "1MiB",
                ],
                "between 5MiB and 5GiB",
            ),
            (
                vec![
                    "--artifacts-destination",
                    "s3://b/p",
                    "--s3-endpoint-url",
                    "s3.local:8333",
                ],
                "http:// or https://",
            ),
            (
                vec![
                    "--artifacts-destination",
                    "s3://b/p",
                    "--artifact-presign-expiry",
                    "30d",
                ],
                "at most",
            ),
        ] {
            let err =
                Config::from_args(std::iter::once("p").chain(args.iter().copied())).unwrap_err();
            assert!(err.to_string().contains(expected), "{args:?}: {err}");
        }
    }

    #[test]
    fn relocate_shares_the_store_and_upstream_settings_in_any_position() {
        let invocation = Config::invocation([
            "p",
            "--artifacts-destination",
            "s3://mlflow/artifacts",
            "relocate",
            "s3://mlflow/my-experiment",
            "--run-id",
            "abc",
            "--upstream",
            "http://mlflow:5000",
            "--s3-quirks",
            "minio",
        ])
        .unwrap();
        match invocation {
            Invocation::Relocate(config, args) => {
                assert_eq!(config.upstream.authority.as_str(), "mlflow:5000");
                assert_eq!(config.artifacts.s3.quirks.name, "minio");
                assert_eq!(args.run_id, "abc");
            }
            Invocation::Serve(_) | Invocation::Check(_) => panic!("relocate was not recognised"),
        }
    }

    #[test]
    fn check_config_parses_everything_and_starts_nothing() {
        let invocation = Config::invocation([
            "mlscope-proxy",
            "--check-config",
            "--upstream",
            "http://mlflow:5000",
            "--run-stale-after",
            "10m",
        ])
        .unwrap();
        match invocation {
            Invocation::Check(config) => {
                assert_eq!(config.health.stale_after, Duration::from_secs(600))
            }
            _ => panic!("--check-config was not recognised"),
        }
        // A refused setting is refused with --check-config as without it.
        assert!(
            Config::invocation(["mlscope-proxy", "--check-config", "--run-stale-after", "0s"])
                .is_err()
        );
        assert!(Config::invocation([
            "mlscope-proxy",
            "--check-config",
            "--mlflow-service-username",
            "svc"
        ])
        .is_err());
    }

    #[test]
    fn upstream_keeps_path_and_query_byte_exact() {
        let u = Upstream::parse("http://127.0.0.1:5000/").unwrap();
        let uri = u
            .uri_for("/api/2.0/mlflow/runs/get?run_id=a%2Fb&x=%20+y")
            .unwrap();
        assert_eq!(
            uri.to_string(),
            "http://127.0.0.1:5000/api/2.0/mlflow/runs/get?run_id=a%2Fb&x=%20+y"
        );
    }
}
