//! `mlscope-bench gateway`: one large object up and down, in one run, through three routes to the
//! same bucket — boto3 straight to the S3 store (the limit), MLflow's own artifact proxy, and
//! mlscope-proxy's artifact gateway — with the time to first byte of a large and a small
//! download, the servers' CPU time, disk writes and peak memory, and SHA-256 checks of every
//! download.
//!
//! The targets: gateway throughput at least 0.9× the direct store's both ways, a time to
//! first byte that does not grow with the object (MLflow's proxy fetches the whole object to its
//! disk first), gateway peak RSS under 128 MiB, and no bytes written to the gateway's local disk.

mod boto3;
pub(crate) mod procfs;
mod report;
mod transfer;

use std::fmt;
use std::fs;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context as _};
use bytes::{Bytes, BytesMut};
use sha2::{Digest as _, Sha256};

use crate::artifact::generator::PseudoRandomChunks;
use crate::artifact::memory::{self, ResidentMemory};
use crate::cli::GatewayArgs;
use crate::http;
use crate::mlflow;
use crate::progress;
use crate::stack::{BenchStack, Target, TargetKind};
use crate::Report;
use boto3::{Boto3, Boto3Settings, Op};
use procfs::Usage;
use transfer::Content;

/// MLflow's artifact route, served by MLflow itself and by the gateway.
const ARTIFACTS_ROUTE: &str = "/api/2.0/mlflow-artifacts/artifacts";
/// Where tmpfs is mounted: boto3's source and destination files live there, in memory.
const SHM: &str = "/dev/shm";

/// One way to the bucket. The order is the report's row order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Route {
    /// boto3's managed transfer straight to the store: the limit.
    Direct,
    /// MLflow's own artifact proxy (`mlflow server --serve-artifacts`).
    Mlflow,
    /// mlscope-proxy serving the artifact API from the store itself.
    Gateway,
}

const ROUTES: [Route; 3] = [Route::Direct, Route::Mlflow, Route::Gateway];

impl Route {
    fn label(self) -> &'static str {
        match self {
            Route::Direct => "boto3 → SeaweedFS (direct)",
            Route::Mlflow => "MLflow artifact proxy",
            Route::Gateway => "mlscope-proxy gateway",
        }
    }

    fn slug(self) -> &'static str {
        match self {
            Route::Direct => "direct",
            Route::Mlflow => "mlflow",
            Route::Gateway => "gateway",
        }
    }
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// One timed upload or download and what the processes on its way used meanwhile.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timed {
    pub(crate) elapsed: Duration,
    /// The client's CPU time: boto3's Python process, or this process for the HTTP routes.
    pub(crate) client_cpu: Duration,
    /// MLflow's or the gateway's process group; `None` for the direct route, which has none.
    pub(crate) server: Option<Usage>,
    /// SeaweedFS.
    pub(crate) store: Usage,
}

/// One round of one route: the large object up and down, and the small one for its first byte.
#[derive(Debug, Clone)]
pub(crate) struct Trip {
    /// From 1.
    pub(crate) round: u32,
    pub(crate) route: Route,
    pub(crate) put: Timed,
    pub(crate) get: Timed,
    pub(crate) large_received: Content,
    pub(crate) large_first_byte: Duration,
    pub(crate) small_received: Content,
    pub(crate) small_first_byte: Duration,
}

/// What the report says about the run besides the trips.
pub(crate) struct Facts {
    pub(crate) command_line: String,
    pub(crate) size: u64,
    pub(crate) small_size: u64,
    pub(crate) rounds: u32,
    pub(crate) chunk_size: u64,
    pub(crate) proxy_args: Vec<String>,
    pub(crate) large: Content,
    pub(crate) small: Content,
    pub(crate) boto3: Option<Boto3Settings>,
    pub(crate) mlflow_version: Option<String>,
    pub(crate) cpus: usize,
    pub(crate) load_before: Option<String>,
    pub(crate) load_after: Option<String>,
    pub(crate) gateway_pid: u32,
    pub(crate) gateway_process: String,
    pub(crate) gateway_memory_before: Option<ResidentMemory>,
    pub(crate) gateway_memory_after: Option<ResidentMemory>,
    /// The gateway's disk writes from before the warm-up to the end.
    pub(crate) gateway_run_writes: u64,
    /// How much the gateway's log file (its stdout, which the harness sends to a file on disk)
    /// grew over the same time.
    pub(crate) gateway_log_growth: u64,
    pub(crate) mlflow_peak_rss: Option<u64>,
    pub(crate) mlflow_processes: usize,
}

/// Everything the rounds need, set up once.
struct Bench<'a> {
    args: &'a GatewayArgs,
    chunk_size: usize,
    /// One client per route: routes never share connections.
    clients: [reqwest::Client; 3],
    mlflow: Target,
    gateway: Target,
    store_url: String,
    bucket: String,
    /// `<experiment>/<run>/artifacts`: where every object goes.
    artifact_root: String,
    boto3: Boto3,
    /// The large object, held whole so that no route pays for generating it.
    large: Bytes,
    small: Bytes,
    shm: ShmDir,
    /// boto3's source: `large` as a file in /dev/shm.
    large_file: PathBuf,
    mlflow_pid: u32,
    gateway_pid: u32,
    store_pid: u32,
}

pub(crate) async fn run(
    args: &GatewayArgs,
    stack: &BenchStack,
    command_line: &str,
) -> anyhow::Result<Report> {
    let load_before = load_average();
    let mlflow = stack
        .target(TargetKind::Direct)
        .context("the stack has no MLflow")?;
    let gateway = stack
        .target(TargetKind::Proxy)
        .context("the stack has no gateway")?;
    let (store_url, bucket) = stack.store();
    let bucket = bucket.to_string();
    let gateway_pid = stack.proxy_pid();
    let mlflow_pid = stack.mlflow_pid();
    let store_pid = stack.store_pid();

    let client = http::client(2)?;
    let experiment = mlflow::create_experiment(
        &mlflow,
        &format!("mlscope-bench-gateway-{}", uuid::Uuid::new_v4()),
    )
    .await?;
    let run_id = mlflow::create_run(&client, &mlflow, &experiment, "gateway").await?;

    let generating = progress::spinner(format!(
        "generating the {} object in memory and in {SHM}",
        crate::ByteSize(args.size.0)
    ));
    let large = generate(args.size.0, args.chunk_size.0)?;
    let small = large.slice(..usize::try_from(args.small_size.0)?);
    let shm = ShmDir::create()?;
    let large_file = shm.path.join("source.bin");
    fs::write(&large_file, &large)
        .with_context(|| format!("writing boto3's source {}", large_file.display()))?;
    // Downloads land here; filled once so that no download pays for faulting its pages in.
    let mut buffer = vec![0xA5u8; large.len()];
    generating.finish_and_clear();

    let bench = Bench {
        args,
        chunk_size: usize::try_from(args.chunk_size.0)?,
        clients: [http::client(2)?, http::client(2)?, http::client(2)?],
        mlflow,
        gateway,
        store_url,
        boto3: Boto3 {
            python: mlscope_tests::venv().join("bin/python"),
            endpoint: stack.store().0,
            bucket: bucket.clone(),
        },
        bucket,
        artifact_root: format!("{experiment}/{run_id}/artifacts"),
        large_file,
        shm,
        mlflow_pid,
        gateway_pid,
        store_pid,
        large,
        small,
    };
    let large_content = Content::of(&bench.large);
    let small_content = Content::of(&bench.small);

    let gateway_memory_before = ResidentMemory::of_process(gateway_pid).ok();
    let (gateway_start, _) = procfs::group_usage(gateway_pid);
    let log_path = stack.proxy_log_path();
    let log_size = || fs::metadata(log_path).map_or(0, |m| m.len());
    let log_start = log_size();
    // The first artifact request makes MLflow build its S3 client, the gateway check the run
    // with MLflow, and the store set up its volumes: a small unmeasured round trip per route.
    for route in ROUTES {
        let file = format!("warmup-{}.bin", route.slug());
        bench
            .small_round_trip(route, &file, &mut buffer)
            .await
            .with_context(|| format!("warm-up via {route}"))?;
        bench.delete(&file).await?;
    }

    let mut trips = Vec::new();
    let mut boto3_settings = None;
    for round in 1..=args.rounds {
        for route in rotated(round) {
            let (trip, settings) = bench
                .trip(round, route, &mut buffer)
                .await
                .with_context(|| format!("round {round} via {route}"))?;
            boto3_settings = boto3_settings.or(settings);
            trips.push(trip);
        }
    }

    let (gateway_end, _) = procfs::group_usage(gateway_pid);
    let (_, mlflow_processes) = procfs::group_usage(mlflow_pid);
    let facts = Facts {
        command_line: command_line.to_string(),
        size: args.size.0,
        small_size: args.small_size.0,
        rounds: args.rounds,
        chunk_size: args.chunk_size.0,
        proxy_args: args.stack.proxy_args.clone(),
        large: large_content,
        small: small_content,
        boto3: boto3_settings,
        mlflow_version: mlflow::version(&bench.mlflow).await,
        cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_before,
        load_after: load_average(),
        gateway_pid,
        gateway_process: memory::process_name(gateway_pid).unwrap_or_else(|| "?".into()),
        gateway_memory_before,
        gateway_memory_after: ResidentMemory::of_process(gateway_pid).ok(),
        gateway_run_writes: gateway_end.since(gateway_start).write_bytes,
        gateway_log_growth: log_size().saturating_sub(log_start),
        mlflow_peak_rss: procfs::group_peak_rss(mlflow_pid),
        mlflow_processes,
    };
    let problems = report::verify(&facts, &trips);
    let markdown = report::render(&facts, &trips);
    Ok(Report { markdown, problems })
}

// === impl Bench ===

impl Bench<'_> {
    fn client(&self, route: Route) -> &reqwest::Client {
        &self.clients[route as usize]
    }

    /// The object key of an artifact file of the benchmark run.
    fn key(&self, file: &str) -> String {
        format!(
            "{}/{}/{file}",
            mlscope_tests::S3Store::PREFIX,
            self.artifact_root
        )
    }

    /// The URL `route` reads and writes `file` at; for the direct route, the object's own URL at
    /// the store (plain unsigned requests: the store has no identities).
    fn url(&self, route: Route, file: &str) -> String {
        match route {
            Route::Direct => format!("{}/{}/{}", self.store_url, self.bucket, self.key(file)),
            Route::Mlflow => format!(
                "{}{ARTIFACTS_ROUTE}/{}/{file}",
                self.mlflow.base_url, self.artifact_root
            ),
            Route::Gateway => format!(
                "{}{ARTIFACTS_ROUTE}/{}/{file}",
                self.gateway.base_url, self.artifact_root
            ),
        }
    }

    fn server_pid(&self, route: Route) -> Option<u32> {
        match route {
            Route::Direct => None,
            Route::Mlflow => Some(self.mlflow_pid),
            Route::Gateway => Some(self.gateway_pid),
        }
    }

    fn snapshot(&self, route: Route) -> Snapshot {
        Snapshot {
            client: procfs::own_usage(),
            server: self.server_pid(route).map(|pid| procfs::group_usage(pid).0),
            store: procfs::group_usage(self.store_pid).0,
        }
    }

    /// One round of `route`: the large object up (timed), its first byte, the large object down
    /// (timed), the small object up and down for its first byte, then both deleted so that the
    /// store never holds more than one large copy. The page cache is flushed after each upload
    /// (see [`settle`]), so no download or first byte is measured while the store is still
    /// writing the previous upload back.
    async fn trip(
        &self,
        round: u32,
        route: Route,
        buffer: &mut [u8],
    ) -> anyhow::Result<(Trip, Option<Boto3Settings>)> {
        let large_file = format!("{}-r{round}.bin", route.slug());
        let small_file = format!("{}-r{round}-small.bin", route.slug());
        let limit = self.args.transfer_timeout;
        let client = self.client(route);
        let url = self.url(route, &large_file);
        let mut settings = None;
        let (put, get, large_received, large_first_byte) = match route {
            Route::Direct => {
                let key = self.key(&large_file);
                let before = self.snapshot(route);
                let up = self
                    .boto3
                    .transfer(Op::Upload, &key, &self.large_file, limit)
                    .await?;
                let uploaded = self.snapshot(route);
                if up.bytes != self.large.len() as u64 {
                    bail!("boto3 read {} bytes from its source file", up.bytes);
                }
                settle().await?;
                // boto3's ranged, concurrent download has no single first byte: the store's
                // own, from one plain GET by the same client as the other routes.
                let first_byte = within(
                    limit,
                    transfer::first_byte(client, &url, "first byte, direct"),
                )
                .await?;
                let download = self.shm.path.join("download.bin");
                let before_download = self.snapshot(route);
                let down = self
                    .boto3
                    .transfer(Op::Download, &key, &download, limit)
                    .await?;
                let downloaded = self.snapshot(route);
                let received = hash_file(&download)?;
                fs::remove_file(&download)
                    .with_context(|| format!("removing {}", download.display()))?;
                settings = Some(down.settings.clone());
                (
                    uploaded.timed_since(&before, up.elapsed, Some(up.cpu)),
                    downloaded.timed_since(&before_download, down.elapsed, Some(down.cpu)),
                    received,
                    first_byte,
                )
            }
            Route::Mlflow | Route::Gateway => {
                let before = self.snapshot(route);
                let put_elapsed = within(
                    limit,
                    transfer::put(client, &url, &self.large, self.chunk_size, route.slug()),
                )
                .await?;
                let uploaded = self.snapshot(route);
                settle().await?;
                let before_download = self.snapshot(route);
                let received =
                    within(limit, transfer::get(client, &url, buffer, route.slug())).await?;
                let downloaded = self.snapshot(route);
                (
                    uploaded.timed_since(&before, put_elapsed, None),
                    downloaded.timed_since(&before_download, received.elapsed, None),
                    received.content,
                    received.first_byte,
                )
            }
        };
        let (small_received, small_first_byte) =
            self.small_round_trip(route, &small_file, buffer).await?;
        for file in [&large_file, &small_file] {
            self.delete(file).await?;
        }
        let trip = Trip {
            round,
            route,
            put,
            get,
            large_received,
            large_first_byte,
            small_received,
            small_first_byte,
        };
        Ok((trip, settings))
    }

    /// Deletes an artifact file straight at the store, whichever route wrote it.
    async fn delete(&self, file: &str) -> anyhow::Result<()> {
        transfer::delete(self.client(Route::Direct), &self.url(Route::Direct, file)).await
    }

    /// PUTs the small object through `route` (straight to the store for the direct route),
    /// flushes the page cache and GETs it back; returns what came and its time to first byte.
    async fn small_round_trip(
        &self,
        route: Route,
        file: &str,
        buffer: &mut [u8],
    ) -> anyhow::Result<(Content, Duration)> {
        let url = self.url(route, file);
        let client = self.client(route);
        let limit = self.args.transfer_timeout;
        let what = format!("{}, small", route.slug());
        within(
            limit,
            transfer::put(client, &url, &self.small, self.chunk_size, &what),
        )
        .await?;
        settle().await?;
        let received = within(
            limit,
            transfer::get(client, &url, &mut buffer[..self.small.len()], &what),
        )
        .await?;
        Ok((received.content, received.first_byte))
    }
}

/// Counters at one instant.
struct Snapshot {
    client: Usage,
    server: Option<Usage>,
    store: Usage,
}

impl Snapshot {
    /// The transfer between `earlier` and `self`; `client_cpu` replaces this process's CPU time
    /// when another process (boto3) was the client.
    fn timed_since(
        &self,
        earlier: &Snapshot,
        elapsed: Duration,
        client_cpu: Option<Duration>,
    ) -> Timed {
        Timed {
            elapsed,
            client_cpu: client_cpu.unwrap_or_else(|| self.client.since(earlier.client).cpu()),
            server: self
                .server
                .zip(earlier.server)
                .map(|(now, then)| now.since(then)),
            store: self.store.since(earlier.store),
        }
    }
}

/// Flushes the page cache to disk (`sync`) and waits for it: what an upload left dirty in the
/// store's (or MLflow's) files is written back now, outside every clock, instead of during the
/// next transfer.
async fn settle() -> anyhow::Result<()> {
    let status = tokio::process::Command::new("sync")
        .status()
        .await
        .context("running sync")?;
    if !status.success() {
        bail!("sync failed ({status})");
    }
    Ok(())
}

/// The routes in round `round`'s order: rotated by one each round, so that no route always goes
/// first (after the previous route's deletes) or last.
fn rotated(round: u32) -> [Route; 3] {
    let mut order = ROUTES;
    order.rotate_left((round as usize - 1) % ROUTES.len());
    order
}

async fn within<T>(
    limit: Duration,
    transfer: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(limit, transfer).await {
        Ok(result) => result,
        Err(_) => bail!(
            "a transfer took longer than {}",
            humantime::format_duration(limit)
        ),
    }
}

/// The object: `size` pseudo-random bytes (the `artifact` benchmark's generator), whole in memory.
fn generate(size: u64, chunk_size: u64) -> anyhow::Result<Bytes> {
    let size_in_memory = usize::try_from(size).context("the object does not fit in memory")?;
    let mut object = BytesMut::with_capacity(size_in_memory);
    for chunk in PseudoRandomChunks::new(size, usize::try_from(chunk_size)?, 0x6761_7465_7761_7921)
    {
        object.extend_from_slice(&chunk);
    }
    Ok(object.freeze())
}

fn hash_file(path: &Path) -> anyhow::Result<Content> {
    let mut file = fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 8 << 20];
    let mut bytes = 0u64;
    loop {
        let n = file
            .read(&mut buffer)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
        bytes += n as u64;
    }
    Ok(Content {
        bytes,
        sha256: hasher.finalize().into(),
    })
}

/// `/proc/loadavg`'s three averages, for the report.
fn load_average() -> Option<String> {
    let text = fs::read_to_string("/proc/loadavg").ok()?;
    let averages: Vec<&str> = text.split_whitespace().take(3).collect();
    (averages.len() == 3).then(|| averages.join(" "))
}

/// A directory of its own in /dev/shm, removed with everything in it when dropped.
struct ShmDir {
    path: PathBuf,
}

impl ShmDir {
    fn create() -> anyhow::Result<ShmDir> {
        let path = Path::new(SHM).join(format!("mlscope-bench-{}", uuid::Uuid::new_v4()));
        fs::create_dir(&path).with_context(|| {
            format!(
                "creating {} (boto3's files stay in memory there; this benchmark needs a tmpfs \
                 at {SHM})",
                path.display()
            )
        })?;
        Ok(ShmDir { path })
    }
}

impl Drop for ShmDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_takes_every_place_once_in_three_rounds() {
        let rounds: Vec<[Route; 3]> = (1..=3).map(rotated).collect();
        assert_eq!(rounds[0], ROUTES);
        for place in 0..3 {
            let mut seen: Vec<Route> = rounds.iter().map(|order| order[place]).collect();
            seen.sort();
            assert_eq!(seen, ROUTES);
        }
        assert_eq!(rotated(4), rotated(1));
    }
}
