//! `mlscope-bench artifact`: a streamed upload and download of one large generated object through
//! mlscope-proxy, checked end to end with SHA-256, and the same transfers straight to MLflow for
//! comparison.
//!
//! The field notes' reason for this benchmark: MLflow's own artifact proxy spools every upload to
//! the server's disk, which got pods evicted. mlscope-proxy must stream, so its peak memory should
//! not grow with the object; the report shows its `VmHWM` before and after.

pub(crate) mod generator;
pub(crate) mod memory;

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context as _};
use bytes::Bytes;
use futures_util::StreamExt as _;
use indicatif::ProgressBar;
use reqwest::header::{CONTENT_LENGTH, CONTENT_TYPE};
use sha2::{Digest as _, Sha256};
use tokio::time::Instant;

use crate::cli::ArtifactArgs;
use crate::http;
use crate::markdown::{command_block, Align, Table};
use crate::progress;
use crate::stack::{BenchStack, Target, TargetKind};
use crate::units::{hex, megabytes_per_second, ByteSize};
use crate::Report;
use generator::PseudoRandomChunks;
use memory::{mib, ResidentMemory};

/// MLflow's artifact route; objects go to `bench/<uuid>/blob` under it.
const ARTIFACTS_ROUTE: &str = "/api/2.0/mlflow-artifacts/artifacts";
/// Size of the unmeasured round trip per target before the measured ones.
const WARMUP_SIZE: u64 = 1 << 20;

/// One direction of one transfer.
struct Transfer {
    bytes: u64,
    elapsed: Duration,
    sha256: [u8; 32],
}

/// An upload and the download of the same object.
struct RoundTrip {
    target: TargetKind,
    put: Transfer,
    get: Transfer,
}

/// Bytes handed to the HTTP client so far and their running hash.
#[derive(Default)]
struct Tally {
    bytes: u64,
    hasher: Sha256,
}

pub(crate) async fn run(
    args: &ArtifactArgs,
    stack: &BenchStack,
    command_line: &str,
) -> anyhow::Result<Report> {
    let client = http::client(2)?;
    let proxy = stack
        .target(TargetKind::Proxy)
        .context("the stack has no proxy")?;
    let pid = stack.proxy_pid();
    let process = memory::process_name(pid).unwrap_or_else(|| "?".into());

    let direct = if args.no_direct {
        None
    } else {
        let direct = stack
            .target(TargetKind::Direct)
            .context("the stack has no direct target")?;
        Some(direct)
    };

    // The first artifact request initialises MLflow's S3 client and the store's volumes; a small
    // unmeasured round trip per target keeps that cost out of whichever target goes first.
    for target in std::iter::once(&proxy).chain(&direct) {
        round_trip(&client, target, WARMUP_SIZE, args)
            .await
            .with_context(|| format!("warm-up round trip via {}", target.kind))?;
    }

    let before = ResidentMemory::of_process(pid)
        .context("reading the proxy's memory before the transfers")?;
    let through_proxy = round_trip(&client, &proxy, args.size.0, args).await?;
    let after = ResidentMemory::of_process(pid)
        .context("reading the proxy's memory after the transfers")?;
    let direct = match &direct {
        Some(direct) => Some(round_trip(&client, direct, args.size.0, args).await?),
        None => None,
    };

    let mut trips = vec![through_proxy];
    trips.extend(direct);
    let problems = verify(args, &trips);
    let markdown = render(args, command_line, &trips, (pid, &process, before, after));
    Ok(Report { markdown, problems })
}

/// Uploads a fresh object of `size` bytes to `target`, downloads it again, then deletes it (best
/// effort) so two copies of a large object never fill the store's disk at once.
async fn round_trip(
    client: &reqwest::Client,
    target: &Target,
    size: u64,
    args: &ArtifactArgs,
) -> anyhow::Result<RoundTrip> {
    let chunk_size =
        usize::try_from(args.chunk_size.0).context("chunk size does not fit in memory")?;
    let id = uuid::Uuid::new_v4();
    let url = format!("{}{ARTIFACTS_ROUTE}/bench/{id}/blob", target.base_url);
    let seed = id.as_u64_pair().0;
    let put = tokio::time::timeout(
        args.transfer_timeout,
        upload(client, &url, size, chunk_size, seed, target.kind),
    )
    .await
    .with_context(|| {
        format!(
            "PUT via {} took longer than {}",
            target.kind,
            humantime::format_duration(args.transfer_timeout)
        )
    })??;
    let get = tokio::time::timeout(
        args.transfer_timeout,
        download(client, &url, size, target.kind),
    )
    .await
    .with_context(|| {
        format!(
            "GET via {} took longer than {}",
            target.kind,
            humantime::format_duration(args.transfer_timeout)
        )
    })??;
    match client
        .delete(&url)
        .timeout(Duration::from_secs(60))
        .send()
        .await
    {
        Ok(response) if response.status().is_success() => {}
        Ok(response) => eprintln!(
            "note: deleting the benchmark object via {} answered {}",
            target.kind,
            response.status()
        ),
        Err(error) => eprintln!(
            "note: deleting the benchmark object via {} failed: {error}",
            target.kind
        ),
    }
    Ok(RoundTrip {
        target: target.kind,
        put,
        get,
    })
}

async fn upload(
    client: &reqwest::Client,
    url: &str,
    size: u64,
    chunk_size: usize,
    seed: u64,
    via: TargetKind,
) -> anyhow::Result<Transfer> {
    let bar = progress::bytes_bar(size, format!("PUT via {via}"));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let chunks = tallied(
        PseudoRandomChunks::new(size, chunk_size, seed),
        tally.clone(),
        bar.clone(),
    );

    let started = Instant::now();
    let response = client
        .put(url)
        // The length is known in advance: say so, instead of chunked encoding, as every S3 client
        // does (stores reject uploads without Content-Length, see the field notes §4).
        .header(CONTENT_LENGTH, size)
        .header(CONTENT_TYPE, "application/octet-stream")
        .body(reqwest::Body::wrap_stream(futures_util::stream::iter(
            chunks,
        )))
        .send()
        .await
        .with_context(|| format!("PUT {url} via {via}"))?;
    let status = response.status();
    let answer = response.text().await.unwrap_or_default();
    let elapsed = started.elapsed();
    bar.finish_and_clear();
    if !status.is_success() {
        bail!("PUT {url} via {via} answered {status}: {answer}");
    }
    let tally = std::mem::take(&mut *tally.lock().expect("tally lock"));
    if tally.bytes != size {
        bail!(
            "PUT via {via} sent {} of {size} bytes before the answer came",
            tally.bytes
        );
    }
    Ok(Transfer {
        bytes: tally.bytes,
        elapsed,
        sha256: tally.hasher.finalize().into(),
    })
}

/// Passes `chunks` on while adding each to `tally` and to the progress bar: the hash of what was
/// really handed to the HTTP client, whatever it did with it.
fn tallied(
    chunks: PseudoRandomChunks,
    tally: Arc<Mutex<Tally>>,
    bar: ProgressBar,
) -> impl Iterator<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    chunks.map(move |chunk| {
        let mut tally = tally.lock().expect("tally lock");
        tally.hasher.update(&chunk);
        tally.bytes += chunk.len() as u64;
        bar.inc(chunk.len() as u64);
        Ok(chunk)
    })
}

async fn download(
    client: &reqwest::Client,
    url: &str,
    expected: u64,
    via: TargetKind,
) -> anyhow::Result<Transfer> {
    let bar = progress::bytes_bar(expected, format!("GET via {via}"));
    let started = Instant::now();
    let response = client
        .get(url)
        .send()
        .await
        .with_context(|| format!("GET {url} via {via}"))?;
    let status = response.status();
    if !status.is_success() {
        let answer = response.text().await.unwrap_or_default();
        bail!("GET {url} via {via} answered {status}: {answer}");
    }
    let mut tally = Tally::default();
    let mut body = response.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.with_context(|| format!("reading the body of GET {url} via {via}"))?;
        tally.hasher.update(&chunk);
        tally.bytes += chunk.len() as u64;
        bar.inc(chunk.len() as u64);
    }
    let elapsed = started.elapsed();
    bar.finish_and_clear();
    Ok(Transfer {
        bytes: tally.bytes,
        elapsed,
        sha256: tally.hasher.finalize().into(),
    })
}

/// Everything that makes the run a failure: lost or changed bytes in either direction.
fn verify(args: &ArtifactArgs, trips: &[RoundTrip]) -> Vec<String> {
    let mut problems = Vec::new();
    for trip in trips {
        if trip.get.bytes != args.size.0 {
            problems.push(format!(
                "GET via {} returned {} bytes, expected {}",
                trip.target, trip.get.bytes, args.size.0
            ));
        }
        if trip.get.sha256 != trip.put.sha256 {
            problems.push(format!(
                "GET via {} returned different content: sha256 {} after uploading {}",
                trip.target,
                hex(&trip.get.sha256),
                hex(&trip.put.sha256)
            ));
        }
    }
    problems
}

fn render(
    args: &ArtifactArgs,
    command_line: &str,
    trips: &[RoundTrip],
    (pid, process, before, after): (u32, &str, ResidentMemory, ResidentMemory),
) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "### Artifact streaming\n");
    out.push_str(&command_block(command_line));
    let _ = writeln!(
        out,
        "\nOne {} object of pseudo-random bytes, generated in {} chunks while it is sent (never held \
         whole in memory or on disk by the client), PUT to and read back from \
         `{ARTIFACTS_ROUTE}/bench/<uuid>/blob`, then deleted; measured after an unmeasured {} round \
         trip per target; {} logical CPUs shared by the client, mlscope-proxy, MLflow and the S3 \
         store.\n",
        args.size,
        args.chunk_size,
        ByteSize(WARMUP_SIZE),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
    );
    let mut table = Table::new(&[
        ("target", Align::Left),
        ("direction", Align::Left),
        ("bytes", Align::Right),
        ("time s", Align::Right),
        ("MB/s", Align::Right),
        ("sha256", Align::Left),
        ("matches upload", Align::Left),
    ]);
    for trip in trips {
        for (direction, transfer) in [("PUT", &trip.put), ("GET", &trip.get)] {
            let matches = match direction {
                "PUT" => "—",
                _ if transfer.sha256 == trip.put.sha256 && transfer.bytes == trip.put.bytes => {
                    "yes"
                }
                _ => "**NO**",
            };
            table.row(vec![
                trip.target.to_string(),
                direction.to_string(),
                transfer.bytes.to_string(),
                format!("{:.2}", transfer.elapsed.as_secs_f64()),
                format!(
                    "{:.1}",
                    megabytes_per_second(transfer.bytes, transfer.elapsed)
                ),
                format!("`{}…`", &hex(&transfer.sha256)[..16]),
                matches.to_string(),
            ]);
        }
    }
    out.push_str(&table.render());

    if let [proxy, direct] = trips {
        let ratio = |p: &Transfer, d: &Transfer| {
            p.elapsed.as_secs_f64() / d.elapsed.as_secs_f64().max(1e-9)
        };
        let _ = writeln!(
            out,
            "\nTime via mlscope-proxy ÷ time direct: PUT {:.2}×, GET {:.2}×.",
            ratio(&proxy.put, &direct.put),
            ratio(&proxy.get, &direct.get)
        );
    }
    let _ = writeln!(
        out,
        "\nmlscope-proxy memory (pid {pid}, `{process}`, from /proc/{pid}/status): before the \
         measured transfers {before}; after {after}. Peak (VmHWM) grew by {:.1} MiB while moving {} \
         through it.",
        mib(after.peak.saturating_sub(before.peak)),
        ByteSize(args.size.0 * 2),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_is_lowercase_and_two_digits_per_byte() {
        assert_eq!(hex(&[0x00, 0xab, 0x0f]), "00ab0f");
    }

    #[test]
    fn the_upload_body_hashes_exactly_what_it_yields() {
        let tally = Arc::new(Mutex::new(Tally::default()));
        let mut yielded = Sha256::new();
        let mut total = 0;
        for chunk in tallied(
            PseudoRandomChunks::new(100_000, 4_096, 9),
            tally.clone(),
            ProgressBar::hidden(),
        ) {
            let chunk = chunk.expect("generated chunks never fail");
            yielded.update(&chunk);
            total += chunk.len();
        }
        let tally = std::mem::take(&mut *tally.lock().expect("lock"));
        assert_eq!((total, tally.bytes), (100_000, 100_000));
        assert_eq!(tally.hasher.finalize(), yielded.finalize());
    }

    /// Accepts one HTTP/1.1 request on loopback, reads its body by Content-Length, answers 200 and
    /// returns the request head and the body's SHA-256.
    async fn receive_one_upload(listener: tokio::net::TcpListener) -> (String, [u8; 32], u64) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let (mut socket, _) = listener.accept().await.expect("accept");
        let mut buffer = Vec::new();
        let head_end = loop {
            let mut chunk = [0u8; 8192];
            let n = socket.read(&mut chunk).await.expect("read head");
            assert!(n > 0, "connection closed before the request head ended");
            buffer.extend_from_slice(&chunk[..n]);
            if let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
                break end + 4;
            }
        };
        let head = String::from_utf8_lossy(&buffer[..head_end]).to_ascii_lowercase();
        let length: u64 = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map(|v| v.trim().parse().expect("numeric length"))
            .unwrap_or(0);
        let mut hasher = Sha256::new();
        hasher.update(&buffer[head_end..]);
        let mut received = (buffer.len() - head_end) as u64;
        let mut chunk = vec![0u8; 64 << 10];
        while received < length {
            let n = socket.read(&mut chunk).await.expect("read body");
            assert!(
                n > 0,
                "connection closed after {received} of {length} body bytes"
            );
            hasher.update(&chunk[..n]);
            received += n as u64;
        }
        socket
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            .await
            .expect("answer");
        (head, hasher.finalize().into(), received)
    }

    #[tokio::test]
    async fn uploads_declare_their_length_instead_of_chunked_encoding() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let url = format!(
            "http://{}/api/2.0/mlflow-artifacts/artifacts/bench/x/blob",
            listener.local_addr().expect("address")
        );
        let server = tokio::spawn(receive_one_upload(listener));

        let sent = upload(
            &http::client(1).expect("client"),
            &url,
            300_000,
            64 << 10,
            5,
            TargetKind::Direct,
        )
        .await
        .expect("upload");
        let (head, received_sha256, received_bytes) = server.await.expect("server task");

        assert!(head.contains("content-length: 300000"), "{head}");
        assert!(!head.contains("transfer-encoding"), "{head}");
        assert_eq!((sent.bytes, received_bytes), (300_000, 300_000));
        assert_eq!(sent.sha256, received_sha256);
    }
}
