//! The reference: boto3 from the project's virtual environment, straight to the S3 store, with
//! its default managed transfer (`upload_fileobj`/`download_fileobj`, which split anything above
//! 8 MiB into concurrent 8 MiB parts or ranged GETs).
//!
//! Each transfer is one `python -c` process. The script opens its client and one connection
//! (`head_bucket`) before the clock starts, then times only the managed transfer and reports its
//! wall time and its own CPU time as one line of JSON. Source and destination are files in
//! /dev/shm: the default transfer reads and writes seekable files, and tmpfs keeps the local disk
//! out of the measurement.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context as _};
use serde_json::Value;

/// Times one managed transfer: `op endpoint bucket key path`, op `upload` or `download`.
const SCRIPT: &str = r#"
import json, os, resource, sys, time

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

op, endpoint, bucket, key, path = sys.argv[1:6]
client = boto3.client(
    "s3",
    endpoint_url=endpoint,
    region_name="us-east-1",
    config=Config(
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    ),
)
# Endpoint rules, signing and the first connection before the clock starts.
client.head_bucket(Bucket=bucket)


def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


if op == "upload":
    with open(path, "rb") as f:
        cpu0, t0 = cpu(), time.perf_counter()
        client.upload_fileobj(f, bucket, key)
        t1, cpu1 = time.perf_counter(), cpu()
elif op == "download":
    with open(path, "wb") as f:
        cpu0, t0 = cpu(), time.perf_counter()
        client.download_fileobj(bucket, key, f)
        f.flush()
        t1, cpu1 = time.perf_counter(), cpu()
else:
    sys.exit(f"unknown operation {op!r}")

defaults = TransferConfig()
print(json.dumps({
    "seconds": t1 - t0,
    "cpu_seconds": cpu1 - cpu0,
    "bytes": os.path.getsize(path),
    "boto3": boto3.__version__,
    "multipart_threshold": defaults.multipart_threshold,
    "multipart_chunksize": defaults.multipart_chunksize,
    "max_concurrency": defaults.max_request_concurrency,
}))
"#;

/// How long the script may take beyond the transfer's own limit (interpreter start, imports).
const STARTUP_ALLOWANCE: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Upload,
    Download,
}

impl Op {
    fn arg(self) -> &'static str {
        match self {
            Op::Upload => "upload",
            Op::Download => "download",
        }
    }
}

/// What the script printed about one transfer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Boto3Transfer {
    pub(crate) elapsed: Duration,
    /// CPU time of the Python process (all its threads) during the transfer.
    pub(crate) cpu: Duration,
    /// Size of the local file afterwards.
    pub(crate) bytes: u64,
    pub(crate) settings: Boto3Settings,
}

/// boto3's version and the defaults of its managed transfer, for the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Boto3Settings {
    pub(crate) version: String,
    pub(crate) multipart_threshold: u64,
    pub(crate) part_size: u64,
    pub(crate) max_concurrency: u64,
}

/// boto3 talking to one bucket.
pub(crate) struct Boto3 {
    pub(crate) python: PathBuf,
    pub(crate) endpoint: String,
    pub(crate) bucket: String,
}

impl Boto3 {
    /// Runs one managed transfer between `key` and the local file `path`.
    pub(crate) async fn transfer(
        &self,
        op: Op,
        key: &str,
        path: &Path,
        limit: Duration,
    ) -> anyhow::Result<Boto3Transfer> {
        let mut command = tokio::process::Command::new(&self.python);
        command
            .arg("-c")
            .arg(SCRIPT)
            .arg(op.arg())
            .arg(&self.endpoint)
            .arg(&self.bucket)
            .arg(key)
            .arg(path)
            // The store has no identities and accepts any signature; the values only have to be
            // there. No instance-metadata probing, no system proxy for loopback.
            .env("AWS_ACCESS_KEY_ID", "mlscope")
            .env("AWS_SECRET_ACCESS_KEY", "mlscope")
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .env("NO_PROXY", "127.0.0.1,localhost")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let output = tokio::time::timeout(limit + STARTUP_ALLOWANCE, command.output())
            .await
            .with_context(|| {
                format!(
                    "boto3 {} of {key} took longer than {}",
                    op.arg(),
                    humantime::format_duration(limit)
                )
            })?
            .with_context(|| format!("starting {}", self.python.display()))?;
        if !output.status.success() {
            bail!(
                "boto3 {} of {key} failed ({}): {}",
                op.arg(),
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        let stdout = String::from_utf8_lossy(&output.stdout);
        parse_report(&stdout)
            .with_context(|| format!("reading what the boto3 {} script printed", op.arg()))
    }
}

/// Reads the script's last line of output.
fn parse_report(stdout: &str) -> anyhow::Result<Boto3Transfer> {
    let line = stdout
        .lines()
        .rev()
        .find(|line| !line.trim().is_empty())
        .context("the script printed nothing")?;
    let report: Value = serde_json::from_str(line).with_context(|| format!("not JSON: {line}"))?;
    let number = |name: &str| {
        report
            .get(name)
            .and_then(Value::as_f64)
            .filter(|n| n.is_finite() && *n >= 0.0)
            .with_context(|| format!("no {name} in {line}"))
    };
    let whole = |name: &str| {
        report
            .get(name)
            .and_then(Value::as_u64)
            .with_context(|| format!("no {name} in {line}"))
    };
    Ok(Boto3Transfer {
        elapsed: Duration::from_secs_f64(number("seconds")?),
        cpu: Duration::from_secs_f64(number("cpu_seconds")?),
        bytes: whole("bytes")?,
        settings: Boto3Settings {
            version: report
                .get("boto3")
                .and_then(Value::as_str)
                .unwrap_or("?")
                .to_string(),
            multipart_threshold: whole("multipart_threshold")?,
            part_size: whole("multipart_chunksize")?,
            max_concurrency: whole("max_concurrency")?,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scripts_last_line_is_the_report() {
        let stdout = "some warning from a library\n\
            {\"seconds\": 6.25, \"cpu_seconds\": 4.5, \"bytes\": 1073741824, \"boto3\": \"1.44.8\", \
            \"multipart_threshold\": 8388608, \"multipart_chunksize\": 8388608, \
            \"max_concurrency\": 10}\n\n";
        let report = parse_report(stdout).expect("parses");
        assert_eq!(report.elapsed, Duration::from_millis(6_250));
        assert_eq!(report.cpu, Duration::from_millis(4_500));
        assert_eq!(report.bytes, 1 << 30);
        assert_eq!(
            report.settings,
            Boto3Settings {
                version: "1.44.8".into(),
                multipart_threshold: 8 << 20,
                part_size: 8 << 20,
                max_concurrency: 10,
            }
        );
    }

    #[test]
    fn a_report_without_its_figures_is_an_error() {
        assert!(parse_report("").is_err());
        assert!(parse_report("Traceback (most recent call last):").is_err());
        assert!(parse_report("{\"seconds\": -1, \"cpu_seconds\": 0, \"bytes\": 1}").is_err());
    }
}
