//! Command-line interface: one subcommand per benchmark, and the limits that keep every run
//! bounded.

use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::units::{parse_byte_size, ByteSize};

/// Highest request rate accepted per target. MLflow with SQLite saturates at about 70 log-batch
/// requests/s on the 2-core benchmark machines; rates far above that measure MLflow's queue.
const MAX_RATE: u32 = 1_000;
/// Longest measured duration per (endpoint, rate, target), so a typo cannot run for a day.
const MAX_DURATION: Duration = Duration::from_secs(3_600);
/// Largest generated artifact.
const MAX_ARTIFACT_SIZE: u64 = 64 << 30;
/// Largest object of `gateway`: it is held in the bench's memory, copied to /dev/shm for boto3,
/// downloaded there by boto3 and into a buffer of the bench, so a run needs about four times this
/// much free memory.
const MAX_GATEWAY_SIZE: u64 = 2 << 30;
/// Most rounds of `gateway`.
const MAX_GATEWAY_ROUNDS: u32 = 20;
/// MLflow's limit on metrics per log-batch; mlscope-proxy forwards larger batches uninspected.
const MAX_METRICS_PER_BATCH: usize = 1000;
/// Most simulated ranks in `dedup-rows` (nodes × ranks per node).
const MAX_SIMULATED_RANKS: u32 = 1024;
/// Most publishes per rank in `dedup-rows`.
const MAX_PUBLISHES: u64 = 10_000;
/// Flags of the scoping comparison that `--proxy-arg` must not repeat (the proxy refuses a flag
/// given twice).
const SCOPING_FLAGS: [&str; 2] = ["--rewrite-system-metrics", "--dedup"];

#[derive(Debug, Parser)]
#[command(
    name = "mlscope-bench",
    version,
    about = "Benchmarks mlscope-proxy side by side with direct MLflow and nginx on loopback",
    long_about = "Starts a private stack (SeaweedFS, MLflow, mlscope-proxy, nginx) on free loopback \
                  ports, runs one benchmark and prints a markdown report on stdout. `rewrite` needs \
                  no stack: it runs the proxy's rewrite engine in process."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Added latency of nginx and mlscope-proxy over direct MLflow, at fixed request rates.
    Passthrough(PassthroughArgs),
    /// Streamed upload and download of a generated object through mlscope-proxy and direct.
    Artifact(ArtifactArgs),
    /// Upload and download of one large object through mlscope-proxy's artifact gateway, MLflow's
    /// own artifact proxy and boto3 straight to the S3 store, with time to first byte, the
    /// servers' peak memory and disk writes.
    Gateway(GatewayArgs),
    /// The system-metric rewrite engine alone, in process on one thread, next to a plain
    /// serde_json round trip and a byte copy.
    Rewrite(RewriteArgs),
    /// Rows MLflow stores for simulated system-metrics monitors of many ranks, with and without
    /// node-series deduplication.
    DedupRows(DedupRowsArgs),
    /// The run report's cost over a long run: state rows per rank and the proxy's memory at
    /// checkpoints, a run of many ranks replayed through mlscope-proxy in minutes.
    ReportCost(ReportCostArgs),
    /// Thousands of connections sending their headers a byte at a time, against MLflow, nginx
    /// and mlscope-proxy: how many each closes, whether a normal client is still served, memory.
    Slowloris(SlowlorisArgs),
    /// A simulated training fleet (N nodes × R ranks, system and training metrics, params and
    /// tags, checkpoints) against direct MLflow, nginx and mlscope-proxy with and without write
    /// coalescing; every sample counted back; the largest fleet each sustains.
    Fleet(FleetArgs),
    /// MLflow's own log-batch benchmark workload (k6, every virtual user writing into one run),
    /// straight to MLflow and through mlscope-proxy in alternating rounds; every acknowledged
    /// sample counted back.
    K6LogBatch(K6LogBatchArgs),
    /// The MLflow Python client's own `log_metric` from many rank threads into one run, straight
    /// to MLflow and through mlscope-proxy in alternating rounds; every acknowledged sample
    /// counted back.
    ClientFleet(ClientFleetArgs),
    /// One client flooding writes (many writers, no pause) beside calm clients, straight to
    /// MLflow and through mlscope-proxy with a per-client write share: the calm clients' success
    /// and p99 under the flood against alone; every acknowledged sample counted back.
    FairShare(FairShareArgs),
}

#[derive(Debug, Args)]
pub struct FairShareArgs {
    /// Concurrent writers of the flooding client, each into its own run.
    #[arg(long, default_value_t = 32)]
    pub flood_writers: usize,
    /// Well-behaved clients, each with its own address and run.
    #[arg(long, default_value_t = 10)]
    pub calm_clients: usize,
    /// Writes per second of each calm client.
    #[arg(long, default_value_t = 2)]
    pub calm_rate: u32,
    /// How long the flood runs.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// How long the calm clients run alone first (their unloaded p99).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub alone: Duration,
    /// How many times the calm clients' windows alone and under the flood alternate (N: each
    /// window 1/N of `--alone` or `--duration`), so that both p99s come from the same stretch of
    /// time and a busy machine's drift between the phases cancels out.
    #[arg(long, default_value_t = 1)]
    pub alternate: u32,
    /// mlscope-proxy's `--client-write-rate` for the run [default: the proxy's own].
    #[arg(long)]
    pub client_write_rate: Option<f64>,
    /// Run only the mlscope-proxy target (for tuning; a recorded figure needs both side by side).
    #[arg(long)]
    pub proxy_only: bool,
    #[command(flatten)]
    pub stack: StackArgs,
}

impl FairShareArgs {
    fn validate(&self) -> Result<(), String> {
        if !(1..=256).contains(&self.flood_writers) || !(1..=100).contains(&self.calm_clients) {
            return Err(
                "--flood-writers must be within 1..=256 and --calm-clients within 1..=100".into(),
            );
        }
        if !(1..=50).contains(&self.calm_rate) {
            return Err("--calm-rate must be within 1..=50".into());
        }
        if !(1..=20).contains(&self.alternate) {
            return Err("--alternate must be within 1..=20".into());
        }
        for (flag, d) in [("--duration", self.duration), ("--alone", self.alone)] {
            if d < Duration::from_secs(1) || d > Duration::from_secs(600) {
                return Err(format!("{flag} must be between 1s and 10m"));
            }
        }
        if self
            .client_write_rate
            .is_some_and(|r| !(r > 0.0 && r <= 10_000.0))
        {
            return Err("--client-write-rate must be above 0 and at most 10000".into());
        }
        Ok(())
    }
}

#[derive(Debug, Args)]
pub struct ClientFleetArgs {
    #[command(flatten)]
    pub stack: StackArgs,
    /// Rank threads calling `log_metric` back to back, one client process; several values
    /// (e.g. 8,32) run one after the other.
    #[arg(long, value_delimiter = ',', default_value = "32")]
    pub threads: Vec<u32>,
    /// Time per run.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Rounds per thread count; each round runs every target once, the order alternating.
    #[arg(long, default_value_t = 2)]
    pub rounds: u32,
}

impl ClientFleetArgs {
    fn validate(&self) -> Result<(), String> {
        if self.threads.iter().any(|t| !(1..=256).contains(t)) {
            return Err("--threads must be between 1 and 256".into());
        }
        if self.duration.is_zero() || self.duration > MAX_DURATION {
            return Err(format!(
                "--duration must be between 1s and {MAX_DURATION:?}"
            ));
        }
        if !(1..=10).contains(&self.rounds) {
            return Err("--rounds must be between 1 and 10".into());
        }
        Ok(())
    }
}

/// A batch shape, `tags/params/metrics`.
fn parse_shape(text: &str) -> Result<(u32, u32, u32), String> {
    let parts: Vec<u32> = text
        .split('/')
        .map(|p| p.trim().parse::<u32>())
        .collect::<Result<_, _>>()
        .map_err(|_| format!("{text:?} is not tags/params/metrics, e.g. 5/3/10"))?;
    match parts[..] {
        [tags, params, metrics] => Ok((tags, params, metrics)),
        _ => Err(format!("{text:?} is not tags/params/metrics, e.g. 5/3/10")),
    }
}

#[derive(Debug, Args)]
pub struct K6LogBatchArgs {
    #[command(flatten)]
    pub stack: StackArgs,
    /// Virtual users, each posting log-batch into the one run back to back (MLflow's script: 20).
    #[arg(long, default_value_t = 20)]
    pub vus: u32,
    /// Time per k6 run (MLflow's script: 30s).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Batch shapes as tags/params/metrics, comma-separated (MLflow's script: 5/3/10, with
    /// 50/50/300 and 100/100/800 commented in).
    #[arg(long, value_delimiter = ',', default_value = "5/3/10", value_parser = parse_shape)]
    pub shapes: Vec<(u32, u32, u32)>,
    /// Rounds per shape; each round runs every target once, the order alternating.
    #[arg(long, default_value_t = 2)]
    pub rounds: u32,
    /// The k6 binary (default: the one scripts/setup installs in the virtual environment).
    #[arg(long)]
    pub k6: Option<std::path::PathBuf>,
}

impl K6LogBatchArgs {
    fn validate(&self) -> Result<(), String> {
        if !(1..=200).contains(&self.vus) {
            return Err("--vus must be between 1 and 200".into());
        }
        if self.duration.is_zero() || self.duration > MAX_DURATION {
            return Err(format!(
                "--duration must be between 1s and {MAX_DURATION:?}"
            ));
        }
        if !(1..=10).contains(&self.rounds) {
            return Err("--rounds must be between 1 and 10".into());
        }
        for &(tags, params, metrics) in &self.shapes {
            if tags > 100 || params > 100 || metrics > 1000 || tags + params + metrics > 1000 {
                return Err(format!(
                    "shape {tags}/{params}/{metrics} is over MLflow's log-batch limits (100 tags, 100 params, 1000 metrics, 1000 in all)"
                ));
            }
        }
        Ok(())
    }
}

/// Where the fleet's ranks start within the sampling interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Scenario {
    /// Spread evenly over one interval, as ranks that started at different moments.
    Steady,
    /// All at the same instant, as every rank of a job starting together.
    Burst,
    /// Steady, with MLflow killed (SIGKILL) halfway through and started again 2 s later on the
    /// same port and backend store.
    MlflowRestart,
    /// Steady, against `mlscope-replicas` only: replica 0 killed (SIGKILL) halfway through and
    /// started again 2 s later on the same ports; nginx sends its share to the others meanwhile.
    ReplicaKill,
}

/// What sends each rank's system metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SystemFrom {
    /// MLflow's system-metrics monitor: its keys under `system/<node>/rank-<r>/`.
    Monitor,
    /// mlscope-collector beside each rank: the scope contract's keys, with the
    /// `X-Mlscope-Node`/`X-Mlscope-Rank` headers.
    Collector,
}

/// Which ranks log training metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TrainingFrom {
    /// Every rank, each under its own keys (`train/rank-<r>/...`).
    All,
    /// Rank 0 of each run (`train/...`), the usual DDP pattern.
    Rank0,
}

/// A target of the fleet benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FleetTarget {
    /// Straight to MLflow.
    Direct,
    /// nginx in front of MLflow.
    Nginx,
    /// mlscope-proxy without coalescing or deduplication (`--coalesce-window 0s --dedup false`).
    MlscopePlain,
    /// mlscope-proxy with write coalescing, deduplication off (`--dedup false`).
    MlscopeCoalesce,
    /// mlscope-proxy as configured by default: coalescing and deduplication.
    Mlscope,
    /// nginx in front of `--replicas` mlscope-proxy replicas (configured as `mlscope`) that
    /// share their state in a PostgreSQL database of their own on `--replica-postgres`.
    MlscopeReplicas,
}

#[derive(Debug, Args)]
pub struct FleetArgs {
    /// Simulated nodes (spread over the runs: node i writes into run i mod --runs).
    #[arg(long, default_value_t = 4)]
    pub nodes: u32,
    /// Ranks per node; several values (e.g. 4,8,16) step the fleet up per target until one size
    /// is not sustained.
    #[arg(long, value_delimiter = ',', default_value = "8")]
    pub ranks_per_node: Vec<u32>,
    /// Runs (jobs) the nodes are spread over.
    #[arg(long, default_value_t = 1)]
    pub runs: u32,
    /// Sampling interval of the simulated system-metrics monitors (MLflow's default: 10s).
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub interval: Duration,
    /// Simulated time per real second: 10 runs a 10s interval every second, so each rank stands
    /// for ten.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Load time per target and fleet size (real time).
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// What sends each rank's system metrics, one sample per interval.
    #[arg(long, value_enum, default_value = "monitor")]
    pub system_from: SystemFrom,
    /// GPUs in each rank's monitor publishes (each adds 5 metrics to the 8 of CPU, memory, disk
    /// and network).
    #[arg(long, default_value_t = 1)]
    pub gpus: u32,
    /// Training metrics per step (0: none).
    #[arg(long, default_value_t = 4)]
    pub training_metrics: u32,
    /// Which ranks log training metrics.
    #[arg(long, value_enum, default_value = "rank0")]
    pub training_from: TrainingFrom,
    /// Simulated time per training step.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub step_interval: Duration,
    /// Simulated time between checkpoint uploads of each run's rank 0 (0s: none).
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    pub checkpoint_every: Duration,
    /// Size of each checkpoint upload.
    #[arg(long, default_value = "1MiB", value_parser = parse_byte_size)]
    pub checkpoint_size: ByteSize,
    /// How the ranks start.
    #[arg(long, value_enum, default_value = "steady")]
    pub scenario: Scenario,
    /// Targets, measured one after the other in this order.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "direct,nginx,mlscope-plain,mlscope-coalesce,mlscope"
    )]
    pub targets: Vec<FleetTarget>,
    /// A fleet size is sustained only with a p99 acknowledgement latency up to this.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub p99_bound: Duration,
    /// Retries of a request answered 429/5xx or not at all (the MLflow client retries these, 7
    /// times by default).
    #[arg(long, default_value_t = 7)]
    pub retries: u32,
    /// Time after which one attempt counts as failed.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub request_timeout: Duration,
    /// Requests outstanding per target at most; later ones wait, and their wait counts. Keep it
    /// below MLflow's 15 database connections: with hundreds outstanding MLflow 3.17 stops
    /// answering for minutes (BENCHMARKS.md), and the run measures that instead of capacity.
    #[arg(long, default_value_t = 12)]
    pub max_in_flight: usize,
    /// Replicas behind nginx for the `mlscope-replicas` target.
    #[arg(long, default_value_t = 2)]
    pub replicas: usize,
    /// PostgreSQL server (a URL allowed to create databases) where the replicas get a state
    /// database of their own, dropped afterwards.
    #[arg(
        long,
        value_name = "URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub replica_postgres: String,
    /// Also write the summary as JSON to this file.
    #[arg(long, value_name = "PATH")]
    pub json: Option<std::path::PathBuf>,
    /// Sample the proxies' resident memory, open descriptors, queued and in-flight requests and
    /// (replicas) state rows this often during the load, and report start, peak and end: a soak.
    #[arg(long, value_parser = humantime::parse_duration, value_name = "DURATION")]
    pub sample_every: Option<Duration>,
    #[command(flatten)]
    pub stack: StackArgs,
}

impl FleetArgs {
    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.nodes == 0 || self.runs == 0 || self.runs > self.nodes {
            return Err(
                "--nodes and --runs must be at least 1, with no more runs than nodes".into(),
            );
        }
        if self.ranks_per_node.is_empty() || self.ranks_per_node.contains(&0) {
            return Err("--ranks-per-node takes sizes of at least 1".into());
        }
        if self.ranks_per_node.windows(2).any(|w| w[0] >= w[1]) {
            return Err("--ranks-per-node sizes must rise (the fleet steps up)".into());
        }
        if !(self.time_scale > 0.0 && self.time_scale <= 1000.0) {
            return Err("--time-scale must be above 0 and at most 1000".into());
        }
        if self.interval.is_zero() || self.step_interval.is_zero() {
            return Err("--interval and --step-interval must be longer than 0".into());
        }
        if self.duration.is_zero() || self.duration > Duration::from_secs(4 * 3600) {
            return Err("--duration must be between 1s and 4h".into());
        }
        if self.max_in_flight == 0 || self.max_in_flight > 16_000 {
            return Err("--max-in-flight must be within 1..=16000".into());
        }
        if self.checkpoint_size.0 > 1 << 30 {
            return Err("--checkpoint-size is at most 1GiB".into());
        }
        if self.targets.is_empty() {
            return Err("--targets needs at least one target".into());
        }
        if !(1..=16).contains(&self.replicas) {
            return Err("--replicas must be within 1..=16".into());
        }
        if self.scenario == Scenario::ReplicaKill && self.targets != [FleetTarget::MlscopeReplicas]
        {
            return Err(
                "--scenario replica-kill kills a replica of mlscope-replicas: use it with \
                 --targets mlscope-replicas alone"
                    .into(),
            );
        }
        if self.scenario == Scenario::ReplicaKill && self.replicas < 2 {
            return Err("--scenario replica-kill needs --replicas 2 or more".into());
        }
        if self.stack.stub_upstream {
            return Err(
                "fleet needs MLflow itself (it reads every sample back); drop --stub-upstream"
                    .into(),
            );
        }
        Ok(())
    }
}

/// Most slow connections of `slowloris` (each costs the bench and the server a descriptor).
const MAX_SLOW_CONNECTIONS: usize = 16_000;

#[derive(Debug, Args)]
pub struct SlowlorisArgs {
    /// Slow connections per target.
    #[arg(long, default_value_t = 3000)]
    pub connections: usize,
    /// How long they trickle before the bench counts which were closed.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub hold: Duration,
    #[command(flatten)]
    pub stack: StackArgs,
}

impl SlowlorisArgs {
    fn validate(&self) -> Result<(), String> {
        if !(1..=MAX_SLOW_CONNECTIONS).contains(&self.connections) {
            return Err(format!(
                "--connections must be within 1..={MAX_SLOW_CONNECTIONS}"
            ));
        }
        if self.hold < Duration::from_secs(1) || self.hold > Duration::from_secs(600) {
            return Err("--hold must be between 1s and 10m".into());
        }
        Ok(())
    }
}

#[derive(Debug, Args)]
pub struct PassthroughArgs {
    /// Request rates per target in requests/s, comma separated. Keep them below MLflow's
    /// saturation (about 70 log-batch requests/s with SQLite on 2 cores).
    #[arg(long, value_delimiter = ',', default_values_t = [20u32, 50])]
    pub rates: Vec<u32>,
    /// Measured time per (endpoint, rate, target), spread over interleaved slices.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Unmeasured load per (endpoint, target) before the first rate, at the lowest rate.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    pub warmup: Duration,
    /// Length of one slice; targets take turns slice by slice so drift (database growth, other
    /// processes on the machine) hits all of them alike.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub slice: Duration,
    /// Endpoints to measure, comma separated.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Endpoint::LogBatch, Endpoint::RunsGet])]
    pub endpoints: Vec<Endpoint>,
    /// Metrics per log-batch request (MLflow allows up to 1000).
    #[arg(long, default_value_t = 10)]
    pub metrics_per_request: usize,
    /// Make each log-batch one publish of MLflow's system-metrics monitor of one rank (13 keys
    /// under `system/node-a/rank-3/`), and add a second mlscope-proxy with scoping off
    /// (`--rewrite-system-metrics false --dedup false`) as a target.
    #[arg(long, conflicts_with = "metrics_per_request")]
    pub system_metrics: bool,
    /// Requests outstanding per target at most; when reached, later sends wait, and the wait
    /// counts in their latency.
    #[arg(long, default_value_t = 64)]
    pub max_in_flight: usize,
    /// Time after which a request counts as an error.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub request_timeout: Duration,
    /// Also write every successful request's latency to this CSV file (endpoint, rate, target,
    /// slice, its place in the slice, microseconds), for reading several runs together
    /// (`load-tests/perf/versus-nginx.py --samples`).
    #[arg(long, value_name = "FILE")]
    pub samples_out: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub stack: StackArgs,
}

#[derive(Debug, Args)]
pub struct ArtifactArgs {
    /// Size of the generated object, e.g. 64MiB, 1GiB, 500MB or a plain number of bytes.
    #[arg(long, default_value = "1GiB", value_parser = parse_byte_size)]
    pub size: ByteSize,
    /// Size of each generated chunk handed to the HTTP client.
    #[arg(long, default_value = "1MiB", value_parser = parse_byte_size)]
    pub chunk_size: ByteSize,
    /// Time limit for each single upload or download.
    #[arg(long, default_value = "20m", value_parser = humantime::parse_duration)]
    pub transfer_timeout: Duration,
    /// Skip the comparison transfer directly to MLflow.
    #[arg(long)]
    pub no_direct: bool,
    #[command(flatten)]
    pub stack: StackArgs,
}

#[derive(Debug, Args)]
pub struct GatewayArgs {
    /// Size of the large object, e.g. 1GiB, 256MiB or a plain number of bytes (at most 2GiB: the
    /// bench needs about four times as much memory, see README).
    #[arg(long, default_value = "1GiB", value_parser = parse_byte_size)]
    pub size: ByteSize,
    /// Size of the small object whose time to first byte is set beside the large one's.
    #[arg(long, default_value = "1MiB", value_parser = parse_byte_size)]
    pub small_size: ByteSize,
    /// Rounds; each moves the objects up and down through every target once, the targets' order
    /// rotated from round to round.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// Size of the slices of the in-memory object handed to the HTTP client.
    #[arg(long, default_value = "1MiB", value_parser = parse_byte_size)]
    pub chunk_size: ByteSize,
    /// Time limit for each single upload or download.
    #[arg(long, default_value = "20m", value_parser = humantime::parse_duration)]
    pub transfer_timeout: Duration,
    /// `--proxy-arg` goes to the gateway (after its `--artifacts-destination`, `--s3-endpoint-url`
    /// and `--s3-quirks seaweedfs`), e.g. `--proxy-arg=--artifact-upload-concurrency=8`.
    #[command(flatten)]
    pub stack: StackArgs,
}

#[derive(Debug, Args)]
pub struct RewriteArgs {
    /// Metrics per log-batch body (MLflow allows up to 1000).
    #[arg(long, default_value_t = 1000)]
    pub metrics: usize,
    /// Bodies per variant at most; the run ends at `--iterations` or `--duration`, whichever
    /// comes first.
    #[arg(long)]
    pub iterations: Option<u64>,
    /// Measured time per variant at most, spread over interleaved rounds.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Unmeasured work per variant before the measurement (caches, allocator, CPU clock).
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub warmup: Duration,
}

#[derive(Debug, Args)]
pub struct DedupRowsArgs {
    /// Simulated ranks (training processes, one system-metrics monitor each) per node.
    #[arg(long, default_value_t = 8)]
    pub ranks_per_node: u32,
    /// Simulated nodes.
    #[arg(long, default_value_t = 2)]
    pub nodes: u32,
    /// Publishes (log-batch requests) per rank and target.
    #[arg(long, default_value_t = 20)]
    pub publishes: u64,
    /// Time after which a request counts as failed.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub request_timeout: Duration,
    #[command(flatten)]
    pub stack: StackArgs,
}

#[derive(Debug, Args)]
pub struct ReportCostArgs {
    /// Ranks of the replayed run.
    #[arg(long, default_value_t = 8)]
    pub ranks: u32,
    /// How long the replayed run lasted, in hours.
    #[arg(long, default_value_t = 24)]
    pub hours: u64,
    /// The collector's sampling interval in the replayed run.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub interval: Duration,
    /// Checkpoints at which rows and memory are read.
    #[arg(long, default_value_t = 6)]
    pub checkpoints: u32,
    /// A PostgreSQL URL allowed to create databases: the proxy's state goes into one of the
    /// bench's own there, dropped afterwards.
    #[arg(
        long,
        env = "MLSCOPE_TEST_POSTGRES_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    pub postgres_admin_url: String,
    #[command(flatten)]
    pub stack: StackArgs,
}

impl ReportCostArgs {
    fn validate(&self) -> Result<(), String> {
        if !(1..=256).contains(&self.ranks) {
            return Err("--ranks must be within 1..=256".into());
        }
        if !(1..=24 * 30).contains(&self.hours) {
            return Err("--hours must be within 1..=720".into());
        }
        if self.interval < Duration::from_secs(1) || self.interval > Duration::from_secs(600) {
            return Err("--interval must be between 1s and 10m".into());
        }
        if !(1..=48).contains(&self.checkpoints) {
            return Err("--checkpoints must be within 1..=48".into());
        }
        if self.stack.stub_upstream {
            return Err("report-cost needs MLflow itself, not --stub-upstream".into());
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Args)]
pub struct StackArgs {
    /// MLflow `--backend-store-uri` (default: the harness's SQLite file).
    #[arg(long)]
    pub mlflow_backend: Option<String>,
    /// Extra argument for mlscope-proxy; repeat for several.
    #[arg(long = "proxy-arg", allow_hyphen_values = true)]
    pub proxy_args: Vec<String>,
    /// Put a constant-latency stub that answers like MLflow (passthrough's calls only) in place
    /// of MLflow as every target's upstream: measures what the proxies add without MLflow's
    /// jitter.
    #[arg(long)]
    pub stub_upstream: bool,
    /// MLflow's worker processes (`mlflow server --workers N`); default: MLflow's own (4), as a
    /// platform runs it.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub mlflow_workers: Option<u32>,
    /// Start MLflow without its job runner (`MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`); it is
    /// on by default, as MLflow defaults it.
    #[arg(long)]
    pub mlflow_no_jobs: bool,
}

impl StackArgs {
    /// How MLflow serves in this benchmark.
    /// MLflow's backend store for a report: "SQLite (…)" or "PostgreSQL (host/db)", without
    /// credentials.
    pub fn backend_label(&self) -> String {
        match self.mlflow_backend.as_deref() {
            None => "SQLite (a file in the stack's directory)".to_owned(),
            Some(uri) if uri.starts_with("postgresql") => {
                // The URI without credentials: scheme, host and database.
                let host = uri.rsplit('@').next().unwrap_or(uri);
                format!("PostgreSQL ({host})")
            }
            Some(uri) => uri.split(':').next().unwrap_or(uri).to_owned(),
        }
    }

    pub fn serving(&self) -> mlscope_tests::MlflowServing {
        mlscope_tests::MlflowServing {
            workers: self.mlflow_workers,
            job_execution: !self.mlflow_no_jobs,
        }
    }
}

/// The MLflow REST calls the pass-through benchmark sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub enum Endpoint {
    /// `POST /api/2.0/mlflow/runs/log-batch`, a unique step per request.
    LogBatch,
    /// `GET /api/2.0/mlflow/runs/get?run_id=...`.
    RunsGet,
}

// === impl Cli ===

impl Cli {
    /// Checks what clap cannot: ranges and relations between arguments.
    pub fn validate(&self) -> Result<(), String> {
        match &self.command {
            Command::Passthrough(args) => args.validate(),
            Command::Artifact(args) => args.validate(),
            Command::Gateway(args) => args.validate(),
            Command::Rewrite(args) => args.validate(),
            Command::DedupRows(args) => args.validate(),
            Command::ReportCost(args) => args.validate(),
            Command::Slowloris(args) => args.validate(),
            Command::Fleet(args) => args.validate(),
            Command::K6LogBatch(args) => args.validate(),
            Command::ClientFleet(args) => args.validate(),
            Command::FairShare(args) => args.validate(),
        }
    }
}

impl PassthroughArgs {
    fn validate(&self) -> Result<(), String> {
        if self.rates.is_empty() {
            return Err("--rates needs at least one rate".into());
        }
        if let Some(rate) = self.rates.iter().find(|&&r| r == 0 || r > MAX_RATE) {
            return Err(format!(
                "--rates: {rate} is outside 1..={MAX_RATE} requests/s"
            ));
        }
        if self.duration < Duration::from_secs(1) || self.duration > MAX_DURATION {
            return Err("--duration must be between 1s and 1h".into());
        }
        if self.warmup > MAX_DURATION {
            return Err("--warmup must be at most 1h".into());
        }
        if self.slice < Duration::from_millis(500) {
            return Err("--slice must be at least 500ms".into());
        }
        if self.endpoints.is_empty() {
            return Err("--endpoints needs at least one endpoint".into());
        }
        if !(1..=MAX_METRICS_PER_BATCH).contains(&self.metrics_per_request) {
            return Err("--metrics-per-request must be within 1..=1000 (MLflow's limit)".into());
        }
        if self.system_metrics {
            self.stack.refuse_scoping_flags("--system-metrics")?;
        }
        if !(1..=10_000).contains(&self.max_in_flight) {
            return Err("--max-in-flight must be within 1..=10000".into());
        }
        if self.request_timeout.is_zero() || self.request_timeout > Duration::from_secs(300) {
            return Err("--request-timeout must be between 1ms and 5m".into());
        }
        Ok(())
    }

    /// Rates in ascending order without repeats; the report reads best that way.
    pub(crate) fn sorted_rates(&self) -> Vec<u32> {
        let mut rates = self.rates.clone();
        rates.sort_unstable();
        rates.dedup();
        rates
    }

    /// Endpoints in a fixed order without repeats.
    pub(crate) fn sorted_endpoints(&self) -> Vec<Endpoint> {
        let mut endpoints = self.endpoints.clone();
        endpoints.sort_unstable();
        endpoints.dedup();
        endpoints
    }
}

impl RewriteArgs {
    fn validate(&self) -> Result<(), String> {
        if !(1..=MAX_METRICS_PER_BATCH).contains(&self.metrics) {
            return Err(
                "--metrics must be within 1..=1000 (MLflow's limit; mlscope-proxy forwards larger \
                 batches uninspected)"
                    .into(),
            );
        }
        if self.iterations == Some(0) {
            return Err("--iterations must be at least 1".into());
        }
        if self.duration < Duration::from_millis(100) || self.duration > MAX_DURATION {
            return Err("--duration must be between 100ms and 1h".into());
        }
        if self.warmup > MAX_DURATION {
            return Err("--warmup must be at most 1h".into());
        }
        Ok(())
    }
}

impl DedupRowsArgs {
    fn validate(&self) -> Result<(), String> {
        if self.ranks_per_node == 0 || self.nodes == 0 {
            return Err("--ranks-per-node and --nodes must be at least 1".into());
        }
        if u64::from(self.ranks_per_node) * u64::from(self.nodes) > u64::from(MAX_SIMULATED_RANKS) {
            return Err(format!(
                "--ranks-per-node × --nodes must be at most {MAX_SIMULATED_RANKS}"
            ));
        }
        if !(1..=MAX_PUBLISHES).contains(&self.publishes) {
            return Err(format!("--publishes must be within 1..={MAX_PUBLISHES}"));
        }
        if self.request_timeout.is_zero() || self.request_timeout > Duration::from_secs(300) {
            return Err("--request-timeout must be between 1ms and 5m".into());
        }
        self.stack.refuse_scoping_flags("dedup-rows")
    }

    /// Every simulated rank: ranks are numbered globally, node by node (`node-0` holds ranks
    /// `0..ranks_per_node`).
    pub(crate) fn ranks(&self) -> Vec<(String, u32)> {
        (0..self.nodes)
            .flat_map(|node| {
                (0..self.ranks_per_node)
                    .map(move |local| (format!("node-{node}"), node * self.ranks_per_node + local))
            })
            .collect()
    }
}

impl StackArgs {
    /// The comparison sets `--rewrite-system-metrics`/`--dedup` itself on each proxy.
    fn refuse_scoping_flags(&self, what: &str) -> Result<(), String> {
        let clash = self.proxy_args.iter().find(|arg| {
            SCOPING_FLAGS
                .iter()
                .any(|flag| arg.as_str() == *flag || arg.starts_with(&format!("{flag}=")))
        });
        match clash {
            Some(arg) => Err(format!(
                "{what} sets --rewrite-system-metrics and --dedup on each proxy itself; \
                 --proxy-arg {arg} would clash"
            )),
            None => Ok(()),
        }
    }
}

impl ArtifactArgs {
    fn validate(&self) -> Result<(), String> {
        if self.size.0 == 0 || self.size.0 > MAX_ARTIFACT_SIZE {
            return Err(format!(
                "--size must be between 1 byte and {}",
                ByteSize(MAX_ARTIFACT_SIZE)
            ));
        }
        if !(4 << 10..=64 << 20).contains(&self.chunk_size.0) {
            return Err("--chunk-size must be between 4KiB and 64MiB".into());
        }
        if self.transfer_timeout < Duration::from_secs(1)
            || self.transfer_timeout > Duration::from_secs(4 * 3_600)
        {
            return Err("--transfer-timeout must be between 1s and 4h".into());
        }
        Ok(())
    }
}

impl GatewayArgs {
    fn validate(&self) -> Result<(), String> {
        if self.size.0 == 0 || self.size.0 > MAX_GATEWAY_SIZE {
            return Err(format!(
                "--size must be between 1 byte and {}",
                ByteSize(MAX_GATEWAY_SIZE)
            ));
        }
        if self.small_size.0 == 0 || self.small_size.0 > self.size.0 {
            return Err("--small-size must be between 1 byte and --size".into());
        }
        if !(1..=MAX_GATEWAY_ROUNDS).contains(&self.rounds) {
            return Err(format!("--rounds must be within 1..={MAX_GATEWAY_ROUNDS}"));
        }
        if !(4 << 10..=64 << 20).contains(&self.chunk_size.0) {
            return Err("--chunk-size must be between 4KiB and 64MiB".into());
        }
        if self.transfer_timeout < Duration::from_secs(1)
            || self.transfer_timeout > Duration::from_secs(4 * 3_600)
        {
            return Err("--transfer-timeout must be between 1s and 4h".into());
        }
        if self.stack.stub_upstream {
            return Err(
                "--stub-upstream has no artifact API: the gateway benchmark needs MLflow".into(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("mlscope-bench").chain(args.iter().copied()))
            .expect("arguments parse")
    }

    #[test]
    fn passthrough_defaults_match_the_documented_benchmark() {
        let Command::Passthrough(args) = parse(&["passthrough"]).command else {
            panic!("wrong subcommand")
        };
        assert_eq!(args.rates, vec![20, 50]);
        assert_eq!(args.duration, Duration::from_secs(20));
        assert_eq!(args.warmup, Duration::from_secs(3));
        assert_eq!(args.slice, Duration::from_secs(5));
        assert_eq!(
            args.sorted_endpoints(),
            vec![Endpoint::LogBatch, Endpoint::RunsGet]
        );
        assert!(args.validate().is_ok());
    }

    #[test]
    fn rates_are_comma_separated_and_sorted_for_the_report() {
        let Command::Passthrough(args) =
            parse(&["passthrough", "--rates", "50,10,50", "--duration", "6s"]).command
        else {
            panic!("wrong subcommand")
        };
        assert_eq!(args.sorted_rates(), vec![10, 50]);
        assert_eq!(args.duration, Duration::from_secs(6));
    }

    #[test]
    fn a_zero_rate_is_rejected_by_validation() {
        assert!(parse(&["passthrough", "--rates", "0"]).validate().is_err());
    }

    #[test]
    fn artifact_size_accepts_binary_units() {
        let Command::Artifact(args) = parse(&["artifact", "--size", "64MiB"]).command else {
            panic!("wrong subcommand")
        };
        assert_eq!(args.size.0, 64 << 20);
        assert!(args.validate().is_ok());
    }

    #[test]
    fn system_metrics_replace_the_metric_count_and_refuse_scoping_proxy_args() {
        let Command::Passthrough(args) = parse(&["passthrough", "--system-metrics"]).command else {
            panic!("wrong subcommand")
        };
        assert!(args.system_metrics);
        assert!(args.validate().is_ok());
        assert!(Cli::try_parse_from([
            "mlscope-bench",
            "passthrough",
            "--system-metrics",
            "--metrics-per-request",
            "5"
        ])
        .is_err());
        let clash = parse(&[
            "passthrough",
            "--system-metrics",
            "--proxy-arg",
            "--dedup=false",
        ]);
        assert!(clash.validate().is_err());
        let fine = parse(&[
            "passthrough",
            "--system-metrics",
            "--proxy-arg",
            "--dedup-update-interval=2s",
        ]);
        assert!(fine.validate().is_ok());
    }

    #[test]
    fn rewrite_defaults_to_full_batches_for_ten_seconds() {
        let Command::Rewrite(args) = parse(&["rewrite"]).command else {
            panic!("wrong subcommand")
        };
        assert_eq!(args.metrics, 1000);
        assert_eq!(args.iterations, None);
        assert_eq!(args.duration, Duration::from_secs(10));
        assert!(args.validate().is_ok());
        assert!(parse(&["rewrite", "--metrics", "1001"]).validate().is_err());
        assert!(parse(&["rewrite", "--iterations", "0"]).validate().is_err());
    }

    #[test]
    fn dedup_rows_numbers_ranks_globally_node_by_node() {
        let Command::DedupRows(args) =
            parse(&["dedup-rows", "--ranks-per-node", "2", "--nodes", "2"]).command
        else {
            panic!("wrong subcommand")
        };
        assert_eq!(args.publishes, 20);
        assert_eq!(
            args.ranks(),
            vec![
                ("node-0".to_string(), 0),
                ("node-0".to_string(), 1),
                ("node-1".to_string(), 2),
                ("node-1".to_string(), 3)
            ]
        );
        assert!(parse(&["dedup-rows", "--nodes", "2000"])
            .validate()
            .is_err());
    }

    #[test]
    fn gateway_defaults_to_three_rounds_of_one_gib_and_a_one_mib_probe() {
        let Command::Gateway(args) = parse(&["gateway"]).command else {
            panic!("wrong subcommand")
        };
        assert_eq!(
            (args.size.0, args.small_size.0, args.rounds),
            (1 << 30, 1 << 20, 3)
        );
        assert!(args.validate().is_ok());
        assert!(parse(&["gateway", "--size", "512KiB"]).validate().is_err());
        assert!(parse(&["gateway", "--size", "3GiB"]).validate().is_err());
        assert!(parse(&["gateway", "--rounds", "0"]).validate().is_err());
        assert!(parse(&["gateway", "--stub-upstream"]).validate().is_err());
    }

    #[test]
    fn proxy_args_may_look_like_flags() {
        let Command::Artifact(args) =
            parse(&["artifact", "--proxy-arg", "--log-level=debug"]).command
        else {
            panic!("wrong subcommand")
        };
        assert_eq!(args.stack.proxy_args, vec!["--log-level=debug".to_string()]);
    }
}
