//! Configuration: every component's settings, gathered from defaults, then an optional TOML file,
//! then the environment, then flags.
//!
//! A component declares its settings once, in its own module, as options (see
//! [`crate::plumbing::settings`]): a flag with its environment variable and help, which is also a key of the
//! file. It turns them into its settings with its own defaults and checks them with its own
//! rules. This module only puts the options side by side (`Settings`), layers them, and hands
//! each component its own. Nothing else in the crate reads `std::env`; tests build a [`Config`]
//! directly.

use std::path::PathBuf;

use clap::{CommandFactory, FromArgMatches, Parser};
use serde::Deserialize;

use crate::capabilities::artifacts::{ArtifactsConfig, ArtifactsOptions};
use crate::capabilities::coalesce::{CoalesceConfig, CoalesceOptions};
use crate::capabilities::dedup::DedupOptions;
use crate::capabilities::fairshare::{FairShareConfig, FairShareOptions};
use crate::capabilities::health::{HealthConfig, HealthOptions};
use crate::capabilities::rewrite::{ScopeConfig, ScopeOptions};
use crate::plumbing::client::{ClientOptions, TrustedProxies};
use crate::plumbing::proxy::{ForwarderConfig, ForwarderOptions};
use crate::plumbing::store::{StoreConfig, StoreOptions};
use crate::plumbing::telemetry::{LogConfig, LogOptions};
use crate::shell::serve::{ServeConfig, ServeOptions};

mod file;
mod inject;
mod relocate;

pub use inject::InjectArgs;
pub use relocate::RelocateArgs;

#[cfg(test)]
use crate::capabilities::artifacts::WritePolicy;
#[cfg(test)]
use crate::plumbing::settings::parse_size;

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

/// Every component's settings, resolved: each component's own, as it declares them.
#[derive(Debug, Clone)]
pub struct Config {
    /// The listeners: where they bind and what they admit.
    pub serve: ServeConfig,
    /// The forwarder to MLflow: where it is, its `Host`, its timeouts and idle connections.
    pub forwarder: ForwarderConfig,
    /// Gateways whose `X-Forwarded-For` names the client, for the limits one client may hold.
    pub trusted_proxies: TrustedProxies,
    /// Each client's share of MLflow's writes.
    pub fair_share: FairShareConfig,
    /// Which state store to open and how long its rows are kept.
    pub store: StoreConfig,
    /// How the proxy logs.
    pub log: LogConfig,
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
    /// Every component's defaults: what the settings resolve to when none is given.
    fn default() -> Self {
        Settings::default()
            .resolve()
            .expect("every component's defaults resolve")
    }
}

/// Every component's options side by side: flattened into the command line (each a flag with
/// its environment variable) and into the file (each a top-level key, `[[teams]]` a table array).
/// The headings group `--help` by component.
#[derive(Debug, Default, clap::Args, Deserialize)]
#[serde(deny_unknown_fields)]
struct Settings {
    #[command(flatten, next_help_heading = "Listeners")]
    #[serde(flatten)]
    serve: ServeOptions,
    #[command(flatten, next_help_heading = "Forwarding to MLflow")]
    #[serde(flatten)]
    forwarder: ForwarderOptions,
    #[command(flatten, next_help_heading = "Clients")]
    #[serde(flatten)]
    clients: ClientOptions,
    #[command(flatten, next_help_heading = "Fair share of MLflow's writes")]
    #[serde(flatten)]
    fair_share: FairShareOptions,
    #[command(flatten, next_help_heading = "State store")]
    #[serde(flatten)]
    store: StoreOptions,
    #[command(flatten, next_help_heading = "Logging")]
    #[serde(flatten)]
    log: LogOptions,
    #[command(flatten, next_help_heading = "System metrics")]
    #[serde(flatten)]
    scopes: ScopeOptions,
    #[command(flatten, next_help_heading = "Node deduplication")]
    #[serde(flatten)]
    dedup: DedupOptions,
    #[command(flatten, next_help_heading = "Write coalescing")]
    #[serde(flatten)]
    coalesce: CoalesceOptions,
    #[command(flatten, next_help_heading = "Artifact gateway")]
    #[serde(flatten)]
    artifacts: ArtifactsOptions,
    #[command(flatten, next_help_heading = "Run health")]
    #[serde(flatten)]
    health: HealthOptions,
}

impl Settings {
    /// Hands each component its options, puts together what they resolve to and checks it.
    fn resolve(self) -> Result<Config, ConfigError> {
        let invalid = ConfigError::Invalid;
        let serve = self.serve.resolve();
        let forwarder = self.forwarder.resolve().map_err(invalid)?;
        let trusted_proxies = self.clients.resolve().map_err(invalid)?;
        let store = self.store.resolve();
        let log = self.log.resolve();
        let scopes = self.scopes.resolve(self.dedup).map_err(invalid)?;
        let mut artifacts = self.artifacts.resolve().map_err(invalid)?;
        let health = self.health.resolve().map_err(invalid)?;
        // The gateway's transfers to and from the store stall no longer than the forwarder's.
        artifacts.s3.stall_grace = forwarder.timeouts.body_idle;
        let config = Config {
            serve,
            forwarder,
            trusted_proxies,
            fair_share: self.fair_share.resolve(),
            store,
            log,
            scopes,
            artifacts,
            coalesce: self.coalesce.resolve(),
            health,
        };
        config.validate()?;
        Ok(config)
    }
}

/// Command line and environment: the file to read, every component's options, and what to do.
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
    /// Check the configuration (file, environment, flags) and exit: 0 when it is accepted, 64
    /// with the reason when not. Nothing is started or connected to.
    #[arg(long)]
    check_config: bool,
    #[command(flatten)]
    settings: Settings,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Copy stray objects (e.g. checkpoints written outside MLflow's layout) into a run's
    /// artifact path with server-side copies; originals are kept unless --delete-source.
    Relocate(RelocateArgs),
    /// Serve the Kubernetes admission webhook that injects mlscope-collector into the pods
    /// annotated `mlscope.io/inject` (none of the proxy's settings apply).
    Inject(InjectArgs),
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
    /// `inject`: the collector's injection webhook.
    Inject(InjectArgs),
}

impl Config {
    /// Loads from the given arguments (environment still applies through clap's `env`) for
    /// serving; a subcommand is refused.
    pub fn from_args<I, T>(args: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        match Self::invocation(args)? {
            Invocation::Serve(config) => Ok(config),
            Invocation::Relocate(..) | Invocation::Check(_) | Invocation::Inject(_) => Err(
                ConfigError::Invalid("a subcommand was given where serving was expected".into()),
            ),
        }
    }

    /// Parses the command line: serving, or a subcommand with the configuration it shares.
    pub fn invocation<I, T>(args: I) -> Result<Invocation, ConfigError>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let matches = Cli::command().try_get_matches_from(args)?;
        let Cli {
            config: path,
            check_config,
            // What the command line alone gave; the file goes under it below.
            settings: _,
            command,
        } = Cli::from_arg_matches(&matches)?;
        if let Some(Command::Inject(args)) = command {
            return Ok(Invocation::Inject(args));
        }
        let mut settings = match &path {
            Some(path) => file::read(path)?,
            None => Settings::default(),
        };
        // The one merge, the same for every setting of every component: what the command line
        // gives (clap reads a flag, else its environment variable) replaces the file's value;
        // what it does not give keeps the file's. A setting given nowhere stays `None` and its
        // component's default applies.
        settings.update_from_arg_matches(&matches)?;
        let config = settings.resolve()?;
        Ok(match command {
            None if check_config => Invocation::Check(config),
            None => Invocation::Serve(config),
            Some(Command::Relocate(args)) => Invocation::Relocate(config, args),
            // Answered above, before the settings are read.
            Some(Command::Inject(args)) => Invocation::Inject(args),
        })
    }

    /// Checks every component's settings by its own rules.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.serve
            .validate()
            .and_then(|()| self.store.validate())
            .and_then(|()| self.forwarder.validate())
            .and_then(|()| self.scopes.validate())
            .and_then(|()| self.fair_share.validate())
            .and_then(|()| self.coalesce.validate())
            .and_then(|()| self.health.validate())
            .and_then(|()| self.artifacts.validate())
            .and_then(|()| self.log.validate())
            .map_err(ConfigError::Invalid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plumbing::proxy::Upstream;
    use std::io::Write;
    use std::time::Duration;

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
        assert_eq!(c.serve.listen, "127.0.0.1:7000".parse().unwrap());
        assert_eq!(c.forwarder.upstream.authority.as_str(), "mlflow:5000");
        assert_eq!(c.forwarder.upstream.base_path, "/prefix");
        assert_eq!(c.forwarder.timeouts.body_idle, Duration::from_secs(300));
        assert_eq!(c.serve.admin_listen, Config::default().serve.admin_listen);
    }

    #[test]
    fn listen_addresses_may_name_a_host_and_must_have_a_port() {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        writeln!(file, "admin_listen = \"localhost:9000\"").unwrap();
        let path = file.path().to_str().unwrap().to_owned();
        let c = Config::from_args(["p", "--config", &path, "--listen", "localhost:5001"]).unwrap();
        assert_eq!(c.serve.listen.to_string(), "localhost:5001");
        assert_eq!(c.serve.admin_listen.to_string(), "localhost:9000");
        let c = Config::from_args(["p", "--listen", "[::1]:5001"]).unwrap();
        assert_eq!(c.serve.listen.to_string(), "[::1]:5001");

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
        let err = Config::from_args(["p", "--log-flush-interval", "1m"]).unwrap_err();
        assert!(
            err.to_string()
                .contains("log-flush-interval 60s is longer than 10s"),
            "{err}"
        );
    }

    #[test]
    fn serving_threads_default_to_the_cores_and_none_is_refused() {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        assert_eq!(Config::from_args(["p"]).unwrap().serve.threads, cores);
        let c = Config::from_args(["p", "--serve-threads", "3"]).unwrap();
        assert_eq!(c.serve.threads, 3);
        let err = Config::from_args(["p", "--serve-threads", "0"]).unwrap_err();
        assert!(
            err.to_string()
                .contains("serve-threads must be between 1 and 1024, not 0"),
            "{err}"
        );
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
                assert_eq!(config.forwarder.upstream.authority.as_str(), "mlflow:5000");
                assert_eq!(config.artifacts.s3.quirks.name, "minio");
                assert_eq!(args.run_id, "abc");
            }
            Invocation::Serve(_) | Invocation::Check(_) | Invocation::Inject(_) => {
                panic!("relocate was not recognised")
            }
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

    /// One setting of each component: its flag and environment variable, the value the file,
    /// the environment and the flag give it, and how the resolved value reads (`Debug`) given
    /// nowhere, by the file alone, by the environment over the file, and by the flag over both.
    struct Layered {
        flag: &'static str,
        env: &'static str,
        /// `key = value` in the file.
        file: &'static str,
        env_value: &'static str,
        flag_value: &'static str,
        read: fn(&Config) -> String,
        /// Default, file, environment, flag.
        expected: [&'static str; 4],
    }

    const ONE_OF_EACH_COMPONENT: &[Layered] = &[
        Layered {
            flag: "--shutdown-grace",
            env: "MLSCOPE_SHUTDOWN_GRACE",
            file: "shutdown_grace = \"11s\"",
            env_value: "12s",
            flag_value: "13s",
            read: |c| format!("{:?}", c.serve.shutdown_grace),
            expected: ["30s", "11s", "12s", "13s"],
        },
        Layered {
            flag: "--connect-timeout",
            env: "MLSCOPE_CONNECT_TIMEOUT",
            file: "connect_timeout = \"21s\"",
            env_value: "22s",
            flag_value: "23s",
            read: |c| format!("{:?}", c.forwarder.timeouts.connect),
            expected: ["5s", "21s", "22s", "23s"],
        },
        Layered {
            flag: "--trusted-proxies",
            env: "MLSCOPE_TRUSTED_PROXIES",
            file: "trusted_proxies = \"10.0.0.1\"",
            env_value: "10.0.0.2",
            flag_value: "10.0.0.3",
            read: |c| format!("{:?}", c.trusted_proxies),
            expected: [
                "TrustedProxies([])",
                "TrustedProxies([(10.0.0.1, 32)])",
                "TrustedProxies([(10.0.0.2, 32)])",
                "TrustedProxies([(10.0.0.3, 32)])",
            ],
        },
        Layered {
            flag: "--max-writes-at-mlflow",
            env: "MLSCOPE_MAX_WRITES_AT_MLFLOW",
            file: "max_writes_at_mlflow = 31",
            env_value: "32",
            flag_value: "33",
            read: |c| format!("{:?}", c.fair_share.max_writes_at_mlflow),
            expected: ["64", "31", "32", "33"],
        },
        Layered {
            flag: "--state-retention",
            env: "MLSCOPE_STATE_RETENTION",
            file: "state_retention = \"41h\"",
            env_value: "42h",
            flag_value: "43h",
            read: |c| format!("{:?}", c.store.state_retention),
            expected: ["1209600s", "147600s", "151200s", "154800s"],
        },
        Layered {
            flag: "--log-level",
            env: "MLSCOPE_LOG",
            file: "log_level = \"debug\"",
            env_value: "warn",
            flag_value: "error",
            read: |c| c.log.level.clone(),
            expected: ["info", "debug", "warn", "error"],
        },
        Layered {
            flag: "--log-flush-interval",
            env: "MLSCOPE_LOG_FLUSH_INTERVAL",
            file: "log_flush_interval = \"1s\"",
            env_value: "2s",
            flag_value: "0s",
            read: |c| format!("{:?}", c.log.flush_interval),
            expected: ["100ms", "1s", "2s", "0ns"],
        },
        Layered {
            flag: "--inspect-body-deadline",
            env: "MLSCOPE_INSPECT_BODY_DEADLINE",
            file: "inspect_body_deadline = \"51s\"",
            env_value: "52s",
            flag_value: "53s",
            read: |c| format!("{:?}", c.scopes.inspect_deadline),
            expected: ["60s", "51s", "52s", "53s"],
        },
        Layered {
            flag: "--dedup-failover-timeout",
            env: "MLSCOPE_DEDUP_FAILOVER_TIMEOUT",
            file: "dedup_failover_timeout = \"61s\"",
            env_value: "62s",
            flag_value: "63s",
            read: |c| format!("{:?}", c.scopes.dedup_config.failover_timeout),
            expected: ["30s", "61s", "62s", "63s"],
        },
        Layered {
            flag: "--coalesce-in-flight-per-run",
            env: "MLSCOPE_COALESCE_IN_FLIGHT_PER_RUN",
            file: "coalesce_in_flight_per_run = 71",
            env_value: "72",
            flag_value: "73",
            read: |c| format!("{:?}", c.coalesce.in_flight_per_run),
            expected: ["8", "71", "72", "73"],
        },
        Layered {
            flag: "--artifact-upload-concurrency",
            env: "MLSCOPE_ARTIFACT_UPLOAD_CONCURRENCY",
            file: "artifact_upload_concurrency = 8",
            env_value: "9",
            flag_value: "10",
            read: |c| format!("{:?}", c.artifacts.upload_concurrency),
            expected: ["4", "8", "9", "10"],
        },
        Layered {
            flag: "--run-stale-after",
            env: "MLSCOPE_RUN_STALE_AFTER",
            file: "run_stale_after = \"81m\"",
            env_value: "82m",
            flag_value: "83m",
            read: |c| format!("{:?}", c.health.stale_after),
            expected: ["300s", "4860s", "4920s", "4980s"],
        },
    ];

    /// Set in the child process that holds the environment layer: the file to read.
    const CHILD_WITH_ENVIRONMENT: &str = "MLSCOPE_TEST_LAYERS_FILE";

    fn check_layer(config: &Config, layer: usize, name: &str) {
        for setting in ONE_OF_EACH_COMPONENT {
            assert_eq!(
                (setting.read)(config),
                setting.expected[layer],
                "{} given by {name}",
                setting.flag
            );
        }
    }

    /// Flag over environment over file over default, for one setting of each component. The
    /// environment is the process's own, so that layer is checked in a child process (this test
    /// run again) that has it: setting it here would reach every other test running meanwhile.
    #[test]
    fn a_flag_beats_the_environment_which_beats_the_file_which_beats_the_default() {
        if let Some(path) = std::env::var_os(CHILD_WITH_ENVIRONMENT) {
            let path = path.to_str().unwrap().to_owned();
            let config = Config::from_args(["p", "--config", &path]).unwrap();
            check_layer(&config, 2, "the environment and the file");
            let mut args = vec!["p".to_owned(), "--config".to_owned(), path];
            for setting in ONE_OF_EACH_COMPONENT {
                args.extend([setting.flag.to_owned(), setting.flag_value.to_owned()]);
            }
            let config = Config::from_args(args).unwrap();
            check_layer(&config, 3, "a flag, the environment and the file");
            return;
        }
        check_layer(&Config::from_args(["p"]).unwrap(), 0, "nothing");
        let mut file = tempfile::NamedTempFile::new().unwrap();
        for setting in ONE_OF_EACH_COMPONENT {
            writeln!(file, "{}", setting.file).unwrap();
        }
        let path = file.path().to_str().unwrap();
        check_layer(
            &Config::from_args(["p", "--config", path]).unwrap(),
            1,
            "the file",
        );

        let test = format!(
            "{}::a_flag_beats_the_environment_which_beats_the_file_which_beats_the_default",
            module_path!().split_once("::").unwrap().1
        );
        let mut child = std::process::Command::new(std::env::current_exe().unwrap());
        child
            .args([test.as_str(), "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_WITH_ENVIRONMENT, path);
        for setting in ONE_OF_EACH_COMPONENT {
            child.env(setting.env, setting.env_value);
        }
        let output = child.output().unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success() && stdout.contains("1 passed"),
            "the environment layer (child process): {stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    #[test]
    fn upstream_keeps_path_and_query_byte_exact() {
        let u = Upstream::parse("http://127.0.0.1:5000/").unwrap();
        let uri = u
            .uri_for("/api/2.0/mlflow/runs/get?run_id=a%2Fb&x=%20+y")
            .unwrap();
        assert_eq!(
            uri.to_string(),
            "/api/2.0/mlflow/runs/get?run_id=a%2Fb&x=%20+y"
        );
        let u = Upstream::parse("http://mlflow:5000/under/").unwrap();
        assert_eq!(
            u.uri_for("/api/2.0/mlflow/runs/get?x=%2F")
                .unwrap()
                .to_string(),
            "/under/api/2.0/mlflow/runs/get?x=%2F"
        );
    }
}
