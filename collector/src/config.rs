//! Configuration: the environment a training pod already has (MLflow's variables, the
//! launcher's rank, the downward API's node name), plus flags or `MLSCOPE_*` variables for what
//! only the collector needs. Flags win over the environment. Nothing else reads `std::env`.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::BoolishValueParser;
use clap::{ArgAction, Parser, ValueEnum};
use ureq::tls::Certificate;

use crate::data::{parse_data_path, DataConfig, DataPath, PreflightMode, ScanBudget};
use crate::leftovers::LeftoverConfig;
use crate::outbox::HttpConfig;

const ENVIRONMENT_HELP: &str = "\
MLflow's own variables (as the MLflow client reads them):
  MLFLOW_TRACKING_URI               where to post (http:// or https://), usually the mlscope proxy
  MLFLOW_RUN_ID                     the run the samples belong to
  MLFLOW_TRACKING_USERNAME/_PASSWORD  HTTP basic authentication (wins over the token, as in MLflow)
  MLFLOW_TRACKING_TOKEN             bearer token
  MLFLOW_WORKSPACE                  the MLflow workspace of the run (sent as X-MLFLOW-WORKSPACE)
  MLFLOW_TRACKING_INSECURE_TLS      `true`: do not verify the server's certificate
  MLFLOW_TRACKING_SERVER_CERT_PATH  PEM file with the CA certificates to trust

Rank: --rank / MLSCOPE_RANK, else the first of RANK, OMPI_COMM_WORLD_RANK, PMI_RANK, PMIX_RANK,
SLURM_PROCID, MV2_COMM_WORLD_RANK, JOB_COMPLETION_INDEX that holds a number, else 0.
Node: --node / NODE_NAME (set it from the downward API: fieldRef spec.nodeName), else the host
name, which in a pod is the pod's name: co-located ranks are then not deduplicated.

Wrapper mode: `mlscope-collector [OPTIONS] -- COMMAND [ARGS...]` runs COMMAND as a child,
forwards SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 to it, sets
MLFLOW_SYSTEM_METRICS_NODE_ID=<node>/rank-<rank> for it unless already set, tags the run with how
it ended and exits with its exit status (128 + signal when it was killed). Without
MLFLOW_TRACKING_URI or MLFLOW_RUN_ID the command still runs, unmeasured. The collector is the
child subreaper: processes the command leaves running are re-parented to it; when the command
ends they are listed (with memory and the /dev/nvidia* files they hold open) in the tag
mlscope/rank-<r>/leftover_processes, then ended: SIGTERM, --leftover-grace, SIGKILL
(mlscope/rank-<r>/leftover_processes_ended), unless --leave-leftovers. GPU memory still
allocated afterwards is tagged mlscope/rank-<r>/gpu_<i>_memory_left_megabytes.

Data paths (--data NAME=PATH, MLSCOPE_DATA): before the command starts, each is checked (exists,
readable, not empty; mounted read-only unless marked :rw, per mount, per superblock and by
statvfs, mounts below it included) and so is the run (exists, RUNNING, artifacts through the
proxy); each answer is a tag, mlscope/rank-<r>/data_<name>_preflight and others. Nothing is
written into a data path. Then every --data-interval the tree is scanned: a fingerprint over each
file's path, size and mtime (tag mlscope/data/<name>/fingerprint and the run's dataset input),
and what vanished, appeared or changed since the last scan (tag mlscope/data/<name>/changed);
series data_<name>_files. --preflight enforce: a failed check keeps the command from starting,
ends the run FAILED (outcome preflight_failed) and exits 78.";

#[derive(Debug, Parser)]
#[command(
    name = "mlscope-collector",
    version,
    about = "Measures what a training container really uses (cgroup, node, root filesystem, volumes, pod network, GPUs) and posts it to MLflow under the mlscope scope contract's names",
    after_help = ENVIRONMENT_HELP
)]
struct Args {
    /// MLflow (or mlscope proxy) URL.
    #[arg(long, env = "MLFLOW_TRACKING_URI")]
    tracking_uri: Option<String>,
    /// The MLflow run to log into.
    #[arg(long, env = "MLFLOW_RUN_ID")]
    run_id: Option<String>,
    /// Kubernetes node name [default: the host name].
    #[arg(long, env = "NODE_NAME")]
    node: Option<String>,
    /// Global rank [default: the launcher's variables (see below), else 0].
    #[arg(long, env = "MLSCOPE_RANK")]
    rank: Option<u32>,
    /// Sampling interval: whole seconds (`10`) or a duration (`500ms`, `1m`).
    #[arg(long, env = "MLSCOPE_INTERVAL", default_value = "10", value_parser = parse_interval)]
    interval: Duration,
    /// A volume to report as `volume_<name>_*`, as NAME=PATH; repeat the flag, or separate with
    /// commas in the variable.
    #[arg(long = "volume", env = "MLSCOPE_VOLUMES", value_name = "NAME=PATH", value_delimiter = ',', value_parser = parse_volume)]
    volumes: Vec<(String, PathBuf)>,
    /// A data path to check before the command starts and watch while it runs, as NAME=PATH
    /// (expected read-only) or NAME=PATH:rw (meant to be writable); repeat the flag, or
    /// separate with commas in the variable.
    #[arg(long = "data", env = "MLSCOPE_DATA", value_name = "NAME=PATH[:rw]", value_delimiter = ',', value_parser = parse_data_path)]
    data: Vec<DataPath>,
    /// How often the data paths are scanned again: whole seconds or a duration (`5m`).
    #[arg(long, env = "MLSCOPE_DATA_INTERVAL", default_value = "5m", value_parser = parse_duration_or_seconds)]
    data_interval: Duration,
    /// A scan stops after this many files (in name order); the fingerprint then covers those.
    #[arg(long, env = "MLSCOPE_DATA_MAX_FILES", default_value = "1000000")]
    data_max_files: u64,
    /// A scan stops after this long; the fingerprint then covers the files scanned.
    #[arg(long, env = "MLSCOPE_DATA_MAX_SCAN_TIME", default_value = "60s", value_parser = humantime::parse_duration)]
    data_max_scan_time: Duration,
    /// What a failed pre-flight check does: `warn` tags and logs it; `enforce` (wrapper mode)
    /// also keeps the command from starting, ends the run FAILED and exits 78.
    #[arg(long, env = "MLSCOPE_PREFLIGHT", value_enum, default_value_t = Preflight::Warn)]
    preflight: Preflight,
    /// The cgroup to measure instead of the collector's own: a directory under a cgroup mount
    /// (`/sys/fs/cgroup/...`) or a path as `/proc/<pid>/cgroup` shows it.
    #[arg(long, env = "MLSCOPE_CGROUP_PATH")]
    cgroup_path: Option<PathBuf>,
    /// How much sampling time to keep in memory while MLflow is unreachable; the oldest samples
    /// go first.
    #[arg(long, env = "MLSCOPE_BUFFER", default_value = "1h", value_parser = humantime::parse_duration)]
    buffer: Duration,
    /// After SIGTERM (or the wrapped command's exit): how long to try to send what is buffered.
    #[arg(long, env = "MLSCOPE_FLUSH_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    flush_timeout: Duration,
    /// Longest wait between retries while MLflow is unreachable.
    #[arg(long, env = "MLSCOPE_MAX_BACKOFF", default_value = "30s", value_parser = humantime::parse_duration)]
    max_backoff: Duration,
    /// Limit for one request to MLflow.
    #[arg(long, env = "MLSCOPE_REQUEST_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    request_timeout: Duration,
    /// Log format.
    #[arg(long, env = "MLSCOPE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Pretty)]
    log_format: LogFormat,
    /// `tracing` filter, e.g. `mlscope_collector=debug`.
    #[arg(long = "log-level", env = "MLSCOPE_LOG", default_value = "info")]
    log_level: String,
    /// Wrapper mode: after the command ends, how long the processes it left running get between
    /// SIGTERM and SIGKILL (`0s`: SIGKILL at once; at most 10m).
    #[arg(long, env = "MLSCOPE_LEFTOVER_GRACE", default_value = "10s", value_parser = humantime::parse_duration)]
    leftover_grace: Duration,
    /// Wrapper mode: list and tag the processes the command left running, but do not end them.
    #[arg(long, env = "MLSCOPE_LEAVE_LEFTOVERS", action = ArgAction::SetTrue, value_parser = BoolishValueParser::new())]
    leave_leftovers: bool,
    /// Where GPM measures SM activity (Hopper and newer): a GPU whose SMs are busy less than this
    /// share of the interval, in percent, counts as idle, whatever its utilisation says (a
    /// one-thread kernel shows 100 % utilisation at under 1 % SM activity). 5 % is about 7 of
    /// an H100's 132 SMs: waiting, polling and stray kernels stay under it, training (even
    /// data-starved) above. Without GPM, idle is utilisation and memory activity at or under 5 %.
    #[arg(long, env = "MLSCOPE_GPU_IDLE_BELOW", value_name = "PERCENT", default_value_t = crate::sources::gpu::DEFAULT_SM_IDLE_BELOW)]
    gpu_idle_below: f64,
    /// Open files whose path starts with this count as GPU device files (tests point it at a
    /// file of their own).
    #[arg(
        long,
        env = "MLSCOPE_GPU_DEVICE_PREFIX",
        default_value = "/dev/nvidia",
        hide = true
    )]
    gpu_device_prefix: PathBuf,
    /// Check the configuration (flags and environment) and exit: 0 when it is accepted, 64 with
    /// the reason when not. Nothing is measured, sent or run.
    #[arg(long)]
    check_config: bool,
    /// Copy this binary into DIR (as DIR/mlscope-collector) and exit: how an init container hands
    /// the collector to a training container that runs under it (the proxy's injection webhook
    /// does this).
    #[arg(long, value_name = "DIR", conflicts_with_all = ["check_config", "command"])]
    install_to: Option<PathBuf>,
    /// Wrapper mode: the training command and its arguments, after `--`.
    #[arg(last = true, value_name = "COMMAND")]
    command: Vec<OsString>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Preflight {
    Warn,
    Enforce,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Pretty,
    Json,
}

pub use crate::outbox::Auth;

/// The validated configuration.
#[derive(Debug)]
pub struct Config {
    /// Where to send; `None` only in wrapper mode when MLflow's variables are missing.
    pub http: Option<HttpConfig>,
    /// Wrapper mode without MLflow's variables: which are missing, e.g. "MLFLOW_RUN_ID (or
    /// --run-id) is not set", for the warning that the command runs unmeasured.
    pub unmeasured_because: Option<String>,
    pub node: String,
    pub rank: u32,
    /// The pod (`POD_NAME` from the downward API, else the host name, which Kubernetes sets to
    /// the pod name), for the run's placement tags.
    pub pod: String,
    /// Where the node name and rank came from, for the start-up log line.
    pub node_source: String,
    pub rank_source: String,
    pub interval: Duration,
    pub volumes: Vec<(String, PathBuf)>,
    /// Data paths: the pre-flight and the watch.
    pub data: DataConfig,
    pub cgroup_path: Option<PathBuf>,
    /// Samples kept while MLflow is unreachable.
    pub buffer_samples: usize,
    pub flush_timeout: Duration,
    pub max_backoff: Duration,
    pub log_format: LogFormat,
    pub log_level: String,
    /// Wrapper mode when not empty.
    pub command: Vec<OsString>,
    /// Wrapper mode: what to do about processes the command leaves running.
    pub leftovers: LeftoverConfig,
    /// GPM's SM activity under this (percent) counts as idle.
    pub gpu_idle_below: f64,
    /// `--check-config`: report the configuration and exit.
    pub check_only: bool,
    /// `--install-to`: copy the binary there and exit.
    pub install_to: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Cli(#[from] clap::Error),
    #[error("{0}")]
    Invalid(String),
}

/// The launcher variables that carry the global rank, in the order they are tried.
pub use mlscope_scopes::RANK_VARIABLES;

impl Config {
    /// Flags from the command line, everything else from the process environment.
    pub fn from_env_and_args() -> Result<Config, ConfigError> {
        let env: HashMap<String, String> = std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .collect();
        let args = Args::try_parse()?;
        Self::resolve(args, &env, || {
            nix::unistd::gethostname()
                .ok()
                .and_then(|h| h.into_string().ok())
        })
    }

    /// As [`Config::from_env_and_args`], from given arguments (the first is the program name)
    /// and environment; flags that clap reads from the environment still come from the process.
    pub fn from_parts<I, T>(
        args: I,
        env: &HashMap<String, String>,
        hostname: impl FnOnce() -> Option<String>,
    ) -> Result<Config, ConfigError>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        Self::resolve(Args::try_parse_from(args)?, env, hostname)
    }

    fn resolve(
        args: Args,
        env: &HashMap<String, String>,
        hostname: impl FnOnce() -> Option<String>,
    ) -> Result<Config, ConfigError> {
        let (rank, rank_source) = match args.rank {
            Some(rank) => (rank, "--rank / MLSCOPE_RANK".to_owned()),
            None => rank_from_launcher(env),
        };
        let host = hostname().unwrap_or_default();
        let (node, node_source) = match args.node.as_deref().filter(|n| !n.trim().is_empty()) {
            Some(node) => (sanitize_node(node), "--node / NODE_NAME".to_owned()),
            None => (
                sanitize_node(&host),
                "the host name (NODE_NAME is not set)".to_owned(),
            ),
        };
        let pod: String = env
            .get("POD_NAME")
            .map(|p| p.trim())
            .filter(|p| !p.is_empty())
            .unwrap_or(host.trim())
            .chars()
            .take(253)
            .collect();
        let wrapper = !args.command.is_empty();
        let (tracking_uri, run_id) = (
            args.tracking_uri.filter(|u| !u.is_empty()),
            args.run_id.filter(|r| !r.is_empty()),
        );
        let unmeasured_because = match (&tracking_uri, &run_id) {
            (Some(_), Some(_)) => None,
            (None, Some(_)) => Some("MLFLOW_TRACKING_URI (or --tracking-uri) is not set"),
            (Some(_), None) => Some("MLFLOW_RUN_ID (or --run-id) is not set"),
            (None, None) => {
                Some("MLFLOW_TRACKING_URI and MLFLOW_RUN_ID (or --tracking-uri and --run-id) are not set")
            }
        };
        let http = match (tracking_uri, run_id) {
            (Some(uri), Some(run_id)) => Some(http_settings(
                uri,
                run_id,
                &node,
                rank,
                args.request_timeout,
                env,
            )?),
            _ if wrapper || args.install_to.is_some() => None,
            _ => {
                return Err(invalid(format!(
                    "{}; without a command to wrap (sidecar mode) the collector needs both",
                    unmeasured_because.unwrap_or_default()
                )))
            }
        };
        let unmeasured_because = unmeasured_because.filter(|_| wrapper).map(str::to_owned);
        let mut names = std::collections::HashSet::new();
        for (name, _) in &args.volumes {
            if !names.insert(name) {
                return Err(invalid(format!("volume {name:?} is given twice")));
            }
        }
        for (what, value) in [
            ("--flush-timeout", args.flush_timeout),
            ("--max-backoff", args.max_backoff),
            ("--request-timeout", args.request_timeout),
            ("--buffer", args.buffer),
        ] {
            if value.is_zero() {
                return Err(invalid(format!("{what} must be more than 0")));
            }
        }
        if !(args.gpu_idle_below > 0.0 && args.gpu_idle_below <= 100.0) {
            return Err(invalid(format!(
                "--gpu-idle-below must be a percentage above 0 and at most 100, not {}",
                args.gpu_idle_below
            )));
        }
        let leftovers = LeftoverConfig {
            grace: args.leftover_grace,
            leave: args.leave_leftovers,
            device_prefix: args.gpu_device_prefix,
        };
        leftovers.validate().map_err(invalid)?;
        let data = DataConfig {
            paths: args.data,
            interval: args.data_interval,
            budget: ScanBudget {
                max_files: args.data_max_files,
                max_time: args.data_max_scan_time,
            },
            preflight: match args.preflight {
                Preflight::Warn => PreflightMode::Warn,
                Preflight::Enforce => PreflightMode::Enforce,
            },
        };
        data.validate().map_err(invalid)?;
        let buffer_samples =
            usize::try_from(args.buffer.as_nanos().div_ceil(args.interval.as_nanos()))
                .unwrap_or(usize::MAX)
                .max(2);
        Ok(Config {
            http,
            unmeasured_because,
            node,
            rank,
            pod,
            node_source,
            rank_source,
            interval: args.interval,
            volumes: args.volumes,
            data,
            cgroup_path: args.cgroup_path,
            buffer_samples,
            flush_timeout: args.flush_timeout,
            max_backoff: args.max_backoff,
            log_format: args.log_format,
            log_level: args.log_level,
            command: args.command,
            leftovers,
            gpu_idle_below: args.gpu_idle_below,
            check_only: args.check_config,
            install_to: args.install_to,
        })
    }
}

fn invalid(message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid(message.into())
}

fn http_settings(
    uri: String,
    run_id: String,
    node: &str,
    rank: u32,
    request_timeout: Duration,
    env: &HashMap<String, String>,
) -> Result<HttpConfig, ConfigError> {
    if !(uri.starts_with("http://") || uri.starts_with("https://")) {
        return Err(invalid(format!(
            "MLFLOW_TRACKING_URI must be an http:// or https:// URL, not {uri:?}"
        )));
    }
    let var = |name: &str| env.get(name).filter(|v| !v.is_empty()).cloned();
    let auth = match (
        var("MLFLOW_TRACKING_USERNAME"),
        var("MLFLOW_TRACKING_PASSWORD"),
        var("MLFLOW_TRACKING_TOKEN"),
    ) {
        (Some(username), Some(password), _) => Auth::Basic { username, password },
        (_, _, Some(token)) => Auth::Bearer(token),
        _ => Auth::None,
    };
    let insecure_tls = var("MLFLOW_TRACKING_INSECURE_TLS")
        .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
    let ca_certificates = match var("MLFLOW_TRACKING_SERVER_CERT_PATH") {
        None => None,
        Some(_) if insecure_tls => return Err(invalid(
            "MLFLOW_TRACKING_INSECURE_TLS and MLFLOW_TRACKING_SERVER_CERT_PATH cannot both be set",
        )),
        Some(path) => {
            let pem = std::fs::read(&path)
                .map_err(|e| invalid(format!("MLFLOW_TRACKING_SERVER_CERT_PATH {path}: {e}")))?;
            let certs: Vec<Certificate<'static>> = ureq::tls::parse_pem(&pem)
                .filter_map(|item| match item {
                    Ok(ureq::tls::PemItem::Certificate(cert)) => Some(cert),
                    _ => None,
                })
                .collect();
            if certs.is_empty() {
                return Err(invalid(format!(
                    "MLFLOW_TRACKING_SERVER_CERT_PATH {path} holds no PEM certificate"
                )));
            }
            Some(certs)
        }
    };
    Ok(HttpConfig {
        tracking_uri: uri.trim_end_matches('/').to_owned(),
        run_id,
        node: node.to_owned(),
        rank,
        auth,
        workspace: var("MLFLOW_WORKSPACE").map(|w| w.trim().to_owned()),
        request_timeout,
        insecure_tls,
        ca_certificates,
    })
}

/// The first launcher variable that holds a rank; 0 when none does.
pub fn rank_from_launcher(env: &HashMap<String, String>) -> (u32, String) {
    for name in RANK_VARIABLES {
        if let Some(value) = env.get(name) {
            match value.trim().parse() {
                Ok(rank) => return (rank, name.to_owned()),
                Err(_) => continue,
            }
        }
    }
    (
        0,
        "the default (no launcher rank variable is set)".to_owned(),
    )
}

/// A node name as the contract writes it: `[a-z0-9.-]+`, starting with a letter or digit.
pub fn sanitize_node(raw: &str) -> String {
    mlscope_scopes::normalize_node(raw)
}

/// `10` (seconds) or a duration such as `500ms`; between 100 ms and one hour.
pub fn parse_interval(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let interval = match text.parse::<u64>() {
        Ok(seconds) => Duration::from_secs(seconds),
        Err(_) => humantime::parse_duration(text).map_err(|e| {
            format!("{text:?} is neither whole seconds nor a duration like 500ms: {e}")
        })?,
    };
    if interval < Duration::from_millis(100) || interval > Duration::from_secs(3600) {
        return Err(format!("{text:?} is outside 100ms..1h"));
    }
    Ok(interval)
}

/// Whole seconds (`300`) or a duration (`5m`); the range is the setting's own to check.
pub fn parse_duration_or_seconds(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    match text.parse::<u64>() {
        Ok(seconds) => Ok(Duration::from_secs(seconds)),
        Err(_) => humantime::parse_duration(text)
            .map_err(|e| format!("{text:?} is neither whole seconds nor a duration like 5m: {e}")),
    }
}

/// `NAME=PATH`, with a name the scope table accepts in `volume_<name>_*`.
pub fn parse_volume(text: &str) -> Result<(String, PathBuf), String> {
    let (name, path) = crate::flags::named(text, "volume", |name| {
        mlscope_scopes::volume_metric_name(name, "usage_megabytes").is_some()
    })?;
    let path = crate::flags::absolute("volume", path)?;
    Ok((name.to_owned(), path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn config(args: &[&str], pairs: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let mut argv = vec![
            "mlscope-collector",
            "--tracking-uri",
            "http://127.0.0.1:5001",
            "--run-id",
            "r1",
            "--node",
            "n1",
        ];
        argv.extend_from_slice(args);
        Config::from_parts(argv, &env(pairs), || Some("pod-7".into()))
    }

    #[test]
    fn intervals_are_whole_seconds_or_durations() {
        assert_eq!(parse_interval("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_interval("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_interval("1m"), Ok(Duration::from_secs(60)));
        assert!(parse_interval("0").is_err());
        assert!(parse_interval("10 apples").is_err());
        assert!(parse_interval("2h").is_err());
    }

    #[test]
    fn volumes_are_name_path_pairs_with_names_the_table_accepts() {
        assert_eq!(
            parse_volume("data=/mnt/data"),
            Ok(("data".into(), PathBuf::from("/mnt/data")))
        );
        assert!(parse_volume("data").is_err());
        assert!(parse_volume("da/ta=/x").is_err());
        assert!(parse_volume("data=relative").is_err());
        let two = config(&["--volume", "data=/data", "--volume", "ckpt=/ckpt"], &[]).unwrap();
        assert_eq!(two.volumes.len(), 2);
        assert!(matches!(
            config(&["--volume", "a=/x", "--volume", "a=/y"], &[]),
            Err(ConfigError::Invalid(_))
        ));
    }

    #[test]
    fn data_paths_default_to_a_five_minute_watch_that_only_warns() {
        let defaults = config(&[], &[]).unwrap().data;
        assert_eq!(defaults, DataConfig::default());
        assert_eq!(defaults.interval, Duration::from_secs(300));
        let set = config(
            &[
                "--data",
                "val=/data/val",
                "--data",
                "cache=/cache:rw",
                "--data-interval",
                "2",
                "--data-max-files",
                "10",
                "--data-max-scan-time",
                "1s",
                "--preflight",
                "enforce",
            ],
            &[],
        )
        .unwrap()
        .data;
        assert_eq!(set.paths.len(), 2);
        assert!(set.paths[1].writable);
        assert_eq!(set.interval, Duration::from_secs(2));
        assert_eq!(set.budget.max_files, 10);
        assert_eq!(set.preflight, PreflightMode::Enforce);
        for refused in [
            &["--data", "a=/x", "--data", "a=/y"][..],
            &["--data-interval", "0"][..],
            &["--data-max-files", "0"][..],
            &["--preflight", "strict"][..],
        ] {
            assert!(config(refused, &[]).is_err(), "{refused:?}");
        }
    }

    #[test]
    fn the_rank_comes_from_the_first_launcher_variable_that_holds_one() {
        assert_eq!(
            rank_from_launcher(&env(&[
                ("OMPI_COMM_WORLD_RANK", "5"),
                ("SLURM_PROCID", "9")
            ]))
            .0,
            5
        );
        assert_eq!(
            rank_from_launcher(&env(&[("RANK", "x"), ("PMI_RANK", "2")])).0,
            2
        );
        assert_eq!(rank_from_launcher(&env(&[])).0, 0);
        assert_eq!(config(&["--rank", "4"], &[("RANK", "1")]).unwrap().rank, 4);
    }

    #[test]
    fn node_names_are_made_valid_and_fall_back_to_the_host_name() {
        assert_eq!(sanitize_node("GPU_Node.1"), "gpu-node.1");
        assert_eq!(sanitize_node("--"), "unknown-node");
        let argv = [
            "mlscope-collector",
            "--tracking-uri",
            "http://x",
            "--run-id",
            "r",
            "--node",
            "",
        ];
        let config = Config::from_parts(argv, &env(&[]), || Some("Pod-7".into())).unwrap();
        assert_eq!(config.node, "pod-7");
    }

    #[test]
    fn basic_auth_wins_over_the_token_and_is_never_printed() {
        let both = [
            ("MLFLOW_TRACKING_USERNAME", "u"),
            ("MLFLOW_TRACKING_PASSWORD", "p"),
            ("MLFLOW_TRACKING_TOKEN", "t"),
        ];
        let http = config(&[], &both).unwrap().http.unwrap();
        assert_eq!(http.auth.header_value().as_deref(), Some("Basic dTpw"));
        assert!(!format!("{http:?}").contains("dTpw") && !format!("{:?}", http.auth).contains('p'));
        let token = config(&[], &[("MLFLOW_TRACKING_TOKEN", "secret-token")])
            .unwrap()
            .http
            .unwrap();
        assert_eq!(
            token.auth.header_value().as_deref(),
            Some("Bearer secret-token")
        );
        assert!(!format!("{token:?}").contains("secret-token"));
    }

    #[test]
    fn leftovers_are_ended_after_ten_seconds_unless_told_otherwise() {
        let defaults = config(&[], &[]).unwrap().leftovers;
        assert_eq!(defaults, LeftoverConfig::default());
        assert_eq!(defaults.grace, Duration::from_secs(10));
        let set = config(
            &[
                "--leftover-grace",
                "1s",
                "--leave-leftovers",
                "--gpu-device-prefix",
                "/tmp/fake/nvidia",
            ],
            &[],
        )
        .unwrap()
        .leftovers;
        assert_eq!(
            (set.grace, set.leave, set.device_prefix),
            (
                Duration::from_secs(1),
                true,
                PathBuf::from("/tmp/fake/nvidia")
            )
        );
        for refused in [
            &["--leftover-grace", "1h"][..],
            &["--gpu-device-prefix", "nvidia"][..],
        ] {
            assert!(
                matches!(config(refused, &[]), Err(ConfigError::Invalid(_))),
                "{refused:?}"
            );
        }
    }

    #[test]
    fn gpus_are_idle_under_five_percent_sm_activity_unless_told_otherwise() {
        assert_eq!(config(&[], &[]).unwrap().gpu_idle_below, 5.0);
        assert_eq!(
            config(&["--gpu-idle-below", "12.5"], &[])
                .unwrap()
                .gpu_idle_below,
            12.5
        );
        for refused in ["0", "-1", "101", "NaN", "five"] {
            assert!(
                config(&["--gpu-idle-below", refused], &[]).is_err(),
                "{refused}"
            );
        }
    }

    #[test]
    fn the_buffer_holds_an_hour_of_samples_by_default() {
        assert_eq!(config(&[], &[]).unwrap().buffer_samples, 360);
        assert_eq!(
            config(&["--interval", "1"], &[]).unwrap().buffer_samples,
            3600
        );
        assert_eq!(
            config(&["--interval", "7", "--buffer", "1m"], &[])
                .unwrap()
                .buffer_samples,
            9
        );
    }

    #[test]
    fn without_mlflow_settings_only_wrapper_mode_starts() {
        let bare = |args: &[&str]| {
            Config::from_parts(
                std::iter::once("mlscope-collector").chain(args.iter().copied()),
                &env(&[]),
                || None,
            )
        };
        // Only meaningful when the test process itself has no MLflow variables.
        if std::env::var_os("MLFLOW_TRACKING_URI").is_none()
            && std::env::var_os("MLFLOW_RUN_ID").is_none()
        {
            assert!(matches!(bare(&[]), Err(ConfigError::Invalid(_))));
            let wrapped = bare(&["--", "true"]).unwrap();
            assert!(wrapped.http.is_none());
            assert_eq!(
                wrapped.unmeasured_because.as_deref(),
                Some("MLFLOW_TRACKING_URI and MLFLOW_RUN_ID (or --tracking-uri and --run-id) are not set")
            );
            let half = bare(&["--run-id", "abc", "--", "true"]).unwrap();
            assert_eq!(
                half.unmeasured_because.as_deref(),
                Some("MLFLOW_TRACKING_URI (or --tracking-uri) is not set")
            );
            assert_eq!(wrapped.command, [OsString::from("true")]);
        }
        assert!(matches!(
            config(
                &[],
                &[
                    ("MLFLOW_TRACKING_INSECURE_TLS", "true"),
                    ("MLFLOW_TRACKING_SERVER_CERT_PATH", "/x")
                ]
            ),
            Err(ConfigError::Invalid(_))
        ));
        let ftp = Config::from_parts(
            [
                "mlscope-collector",
                "--tracking-uri",
                "file:///tmp",
                "--run-id",
                "r",
            ],
            &env(&[]),
            || None,
        );
        assert!(matches!(ftp, Err(ConfigError::Invalid(_))));
    }
}
