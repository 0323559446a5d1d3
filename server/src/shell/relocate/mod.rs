//! `mlscope-proxy relocate`: repairs history by copying stray objects into a run's artifacts.
//!
//! An upload hook that writes checkpoints to `<bucket>/<experiment-name>/...` leaves them where
//! MLflow cannot see them: a run shows only what lies under its `artifact_uri`
//! (`<experiment>/<run>/artifacts/`). `relocate` asks MLflow where the run's artifacts live and
//! copies every object under the stray prefix there, server-side (no byte passes through here):
//!
//! - objects up to the quirks profile's `max_single_copy` with one CopyObject, larger ones with
//!   UploadPartCopy; a multipart copy is aborted on any failure and on Ctrl-C;
//! - every call on the store goes through the gateway's object-store facade
//!   ([`crate::capabilities::artifacts::objects::Bucket`]), one client for both buckets ([`Bucket::other`]);
//! - tags are never read or written (several stores reject GetObjectTagging, see [`crate::capabilities::artifacts::quirks`]);
//! - resumable: an object whose copy already exists with the same size (and the same MD5 ETag,
//!   where both sides have one) is skipped;
//! - every copy is verified with HeadObject: size, and ETag for one-request copies;
//! - sources are kept unless `--delete-source`, which deletes each one only once its copy is
//!   verified (or was found in place).

use std::collections::HashMap;
use std::fmt;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::plumbing::credential::ServiceCredential;
use anyhow::{anyhow, Context};
use futures_util::{StreamExt, TryStreamExt};
use http::StatusCode;
use indicatif::{HumanBytes, ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::sync::Semaphore;

use crate::capabilities::artifacts::listing::is_marker;
use crate::capabilities::artifacts::objects::{Bucket, Part, StoredObject};
use crate::capabilities::artifacts::s3::Destination;
use crate::capabilities::artifacts::upload::part_size_for;
use crate::plumbing::mlflow::{self, Caller, MlflowClient, MlflowError, Run};
use crate::plumbing::proxy::Forwarder;
use crate::plumbing::telemetry::Metrics;
use crate::shell::config::RelocateArgs;

/// Exit status after Ctrl-C (128 + SIGINT), as shells report it.
const EXIT_INTERRUPTED: u8 = 130;

// === the plan ===

/// A bucket and a key prefix without leading or trailing `/`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Location {
    bucket: String,
    key: String,
}

impl Location {
    /// The listing prefix of the directory the key names.
    fn dir(&self) -> String {
        if self.key.is_empty() {
            String::new()
        } else {
            format!("{}/", self.key)
        }
    }

    fn child(&self, relative: &str) -> String {
        join(&[&self.key, relative])
    }

    fn uri(&self, key: &str) -> String {
        format!("s3://{}/{key}", self.bucket)
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s3://{}/{}", self.bucket, self.key)
    }
}

/// Joins key segments with `/`, leaving out empty ones.
fn join(parts: &[&str]) -> String {
    parts
        .iter()
        .map(|p| p.trim_matches('/'))
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("/")
}

/// `s3://<bucket>/<prefix>`, or a key prefix in the destination's bucket (from its root).
fn parse_source(source: &str, destination: Option<&Destination>) -> Result<Location, String> {
    let (bucket, key) = match source.strip_prefix("s3://") {
        Some(rest) => {
            let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(format!(
                    "source {source:?} names no bucket; write s3://<bucket>/<prefix>"
                ));
            }
            (bucket.to_owned(), key)
        }
        None if source.contains("://") => {
            return Err(format!("source {source:?}: only s3://<bucket>/<prefix> URIs and key prefixes are supported"));
        }
        None => {
            let destination = destination.ok_or_else(|| {
                format!(
                    "source {source:?} is a key prefix, which is looked up in the bucket of --artifacts-destination; \
                     set --artifacts-destination or write s3://<bucket>/{source}"
                )
            })?;
            (destination.bucket.clone(), source)
        }
    };
    let key = key.trim_matches('/');
    if key.is_empty() {
        return Err(format!(
            "source {source:?} names a whole bucket; name the prefix the stray objects are under, e.g. s3://{bucket}/<experiment-name>"
        ));
    }
    Ok(Location {
        bucket,
        key: key.to_owned(),
    })
}

/// Where a run's artifacts are stored, from its `artifact_uri`: `mlflow-artifacts:/<path>` lies
/// under the artifacts destination (MLflow's `--artifacts-destination`, which the gateway shares);
/// `s3://<bucket>/<key>` is used as it is.
fn artifact_root(uri: &str, destination: Option<&Destination>) -> Result<Location, String> {
    if let Some(rest) = uri.strip_prefix("mlflow-artifacts:") {
        // `mlflow-artifacts://host:port/<path>` names the server too; the path is what counts.
        let path = match rest.strip_prefix("//") {
            Some(after_host) => after_host.split_once('/').map_or("", |(_, path)| path),
            None => rest,
        };
        let path = path.trim_matches('/');
        if path.is_empty() {
            return Err(format!("its artifact_uri {uri:?} names no path"));
        }
        let destination = destination.ok_or_else(|| {
            format!(
                "its artifact_uri {uri:?} lies under MLflow's --artifacts-destination; pass the same \
                 location as --artifacts-destination s3://<bucket>/<prefix>"
            )
        })?;
        return Ok(Location {
            bucket: destination.bucket.clone(),
            key: destination.key(path),
        });
    }
    if let Some(rest) = uri.strip_prefix("s3://") {
        let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(format!("its artifact_uri {uri:?} names no bucket"));
        }
        return Ok(Location {
            bucket: bucket.to_owned(),
            key: key.trim_matches('/').to_owned(),
        });
    }
    Err(format!(
        "its artifact_uri {uri:?} is neither mlflow-artifacts:/... nor s3://...; relocate copies only within S3-compatible stores"
    ))
}

/// `--to`: a relative directory without `.` or `..` segments; `""` is the artifact root.
fn validate_to(to: &str) -> Result<String, String> {
    let trimmed = to.trim_matches('/');
    if trimmed.is_empty() {
        return Ok(String::new());
    }
    if trimmed.split('/').any(|segment| {
        segment.is_empty() || segment == "." || segment == ".." || segment.contains('\\')
    }) {
        return Err(format!("--to {to:?} must be a relative directory such as checkpoints or models/epochs (no '.', '..', '\\' or empty segments)"));
    }
    Ok(trimmed.to_owned())
}

/// Refuses a target inside the source (a rerun would copy the copies) or a source inside the target.
fn check_overlap(source: &Location, target: &Location) -> Result<(), String> {
    if source.bucket != target.bucket {
        return Ok(());
    }
    let (s, t) = (source.dir(), target.dir());
    if t.starts_with(&s) {
        return Err(format!("the target {target} lies inside the source {source}; name a narrower source or another --to"));
    }
    if s.starts_with(&t) {
        return Err(format!(
            "the source {source} already lies inside the target {target}"
        ));
    }
    Ok(())
}

/// An ETag that is the MD5 of the content (not that of a multipart upload, `<md5>-<parts>`).
fn content_md5(etag: Option<&str>) -> Option<&str> {
    let etag = etag?.trim_matches('"');
    (!etag.is_empty() && !etag.contains('-')).then_some(etag)
}

/// Same size and, where both ETags are content MD5s, the same ETag.
fn same_content(a: &StoredObject, b: &StoredObject) -> bool {
    a.size == b.size
        && match (
            content_md5(a.etag.as_deref()),
            content_md5(b.etag.as_deref()),
        ) {
            (Some(x), Some(y)) => x.eq_ignore_ascii_case(y),
            _ => true,
        }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CopyMethod {
    /// One CopyObject.
    Single,
    /// CreateMultipartUpload, one UploadPartCopy per range, CompleteMultipartUpload.
    Multipart { part_size: u64, parts: u64 },
}

fn copy_method(size: u64, max_single_copy: u64, part_size: u64) -> CopyMethod {
    if size <= max_single_copy {
        return CopyMethod::Single;
    }
    let part_size = part_size_for(Some(size), part_size as usize) as u64;
    CopyMethod::Multipart {
        part_size,
        parts: size.div_ceil(part_size),
    }
}

/// Inclusive byte ranges of the parts, as `x-amz-copy-source-range` wants them.
fn part_ranges(size: u64, part_size: u64) -> Vec<(u64, u64)> {
    (0..size.div_ceil(part_size))
        .map(|i| (i * part_size, ((i + 1) * part_size).min(size) - 1))
        .collect()
}

/// One object to relocate.
#[derive(Debug, Clone)]
struct Task {
    source: StoredObject,
    target_key: String,
    method: CopyMethod,
    /// The target exists with the same content: nothing to copy.
    already_there: bool,
}

fn plan(
    sources: Vec<(String, StoredObject)>,
    target: &Location,
    existing: &HashMap<String, StoredObject>,
    max_single_copy: u64,
    part_size: u64,
) -> Vec<Task> {
    sources
        .into_iter()
        .map(|(relative, source)| {
            let target_key = target.child(&relative);
            let already_there = existing
                .get(&target_key)
                .is_some_and(|t| same_content(&source, t));
            let method = copy_method(source.size, max_single_copy, part_size);
            Task {
                source,
                target_key,
                method,
                already_there,
            }
        })
        .collect()
}

// === the run, from MLflow ===

#[derive(Debug, Clone, PartialEq, Eq)]
struct RunInfo {
    run_id: String,
    experiment_id: String,
    artifact_uri: String,
    lifecycle_stage: String,
}

async fn lookup_run(
    config: &crate::shell::config::Config,
    args: &RelocateArgs,
) -> anyhow::Result<RunInfo> {
    let mlflow = MlflowClient::new(Forwarder::new(&config.forwarder, Metrics::new()));
    let credential = match (
        &args.mlflow_token,
        &args.mlflow_username,
        &args.mlflow_password,
    ) {
        (Some(token), _, _) => ServiceCredential::Token(token.clone()),
        (None, Some(user), Some(password)) => ServiceCredential::Basic {
            username: user.clone(),
            password: password.clone(),
        },
        _ => ServiceCredential::None,
    };
    if !matches!(credential, ServiceCredential::None) && credential.header().is_none() {
        anyhow::bail!("the MLflow credentials contain characters an HTTP header cannot carry");
    }
    let answer = mlflow
        .get_run(&Caller::service(&credential), &args.run_id)
        .await;
    if let Err(MlflowError::Unanswered(e)) = &answer {
        anyhow::bail!("{e}; set --upstream (before `relocate`) or MLSCOPE_UPSTREAM to the MLflow tracking server");
    }
    run_info(answer, &args.run_id, &config.forwarder.upstream.url()).map_err(anyhow::Error::msg)
}

/// MLflow's answer to `runs/get`, or why there is no run to copy into.
fn run_info(
    answer: Result<Run, MlflowError>,
    run_id: &str,
    upstream: &str,
) -> Result<RunInfo, String> {
    let info = match answer {
        Ok(run) => run.info,
        Err(MlflowError::Refused {
            status,
            error_code,
            message,
            shown,
            ..
        }) => {
            let message = message.unwrap_or_else(|| shown.chars().take(200).collect());
            if status == StatusCode::NOT_FOUND
                || error_code.as_deref() == Some("RESOURCE_DOES_NOT_EXIST")
            {
                return Err(format!(
                    "MLflow at {upstream} has no run {run_id:?} ({message}); check --run-id and --upstream"
                ));
            }
            if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
                return Err(format!(
                    "MLflow at {upstream} refused to show run {run_id:?} (HTTP {status}); set MLFLOW_TRACKING_TOKEN, or \
                     MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"
                ));
            }
            return Err(format!("MLflow at {upstream} answered HTTP {status} to the lookup of run {run_id:?}: {message}"));
        }
        // A success that is no JSON object: no field of it is there.
        Err(MlflowError::Unreadable { .. }) => mlflow::RunInfo::default(),
        Err(MlflowError::Unanswered(e)) => return Err(e.to_string()),
    };
    let field = |value: Option<String>, name: &str| {
        value.ok_or_else(|| format!("MLflow's answer for run {run_id:?} has no run.info.{name}; is {upstream} an MLflow tracking server?"))
    };
    Ok(RunInfo {
        run_id: info.run_id.unwrap_or_else(|| run_id.to_owned()),
        experiment_id: field(info.experiment_id, "experiment_id")?,
        artifact_uri: field(info.artifact_uri, "artifact_uri")?,
        lifecycle_stage: info.lifecycle_stage.unwrap_or_default(),
    })
}

// === the store ===

/// The objects to copy, each with its path relative to the source, and how many directory
/// markers (keys ending in `/`, which MLflow cannot show) were left out.
struct Sources {
    objects: Vec<(String, StoredObject)>,
    markers: usize,
}

/// `bucket` is the source's.
async fn find_sources(bucket: &Bucket, source: &Location) -> anyhow::Result<Sources> {
    let dir = source.dir();
    let listed = bucket
        .list_all(&dir)
        .await
        .with_context(|| format!("listing {}", source.uri(&dir)))?;
    let mut sources = Sources {
        objects: Vec::new(),
        markers: 0,
    };
    for object in listed {
        if object.key.ends_with('/') {
            // Zero-byte ones are "folder" markers; any other has no name MLflow could show.
            if !is_marker(&object.key, object.size as i64) {
                tracing::warn!(
                    key = object.key,
                    size = object.size,
                    "skipping an object whose key ends in '/'"
                );
            }
            sources.markers += 1;
            continue;
        }
        let relative = object
            .key
            .strip_prefix(&dir)
            .unwrap_or(&object.key)
            .to_owned();
        sources.objects.push((relative, object));
    }
    if sources.objects.is_empty() && sources.markers == 0 {
        // Perhaps the source is the key of one object.
        match bucket.head(&source.key).await {
            Ok(head) => {
                let name = source
                    .key
                    .rsplit('/')
                    .next()
                    .unwrap_or(&source.key)
                    .to_owned();
                let object = StoredObject {
                    key: source.key.clone(),
                    size: head.size.unwrap_or(0),
                    etag: head.etag,
                };
                sources.objects.push((name, object));
            }
            Err(error) => {
                if !error.is_not_found() {
                    return Err(anyhow!("{error}")).with_context(|| format!("looking up {source}"));
                }
            }
        }
    }
    sources.objects.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(sources)
}

// === impl Copier ===

/// What happened to one object.
#[derive(Debug, Default)]
struct ObjectReport {
    copied: bool,
    multipart: bool,
    already_there: bool,
    verified: bool,
    deleted: bool,
    bytes: u64,
    failure: Option<String>,
}

/// Runs the copies of one relocation, at most `concurrency` copy requests at once.
struct Copier {
    /// The source's bucket and the target's (the same one, or two of the same store).
    source: Bucket,
    target: Bucket,
    verify: bool,
    delete_source: bool,
    concurrency: usize,
    permits: Semaphore,
    progress: ProgressBar,
    /// Multipart uploads in flight (upload id → target key), aborted on Ctrl-C.
    uploads: Mutex<HashMap<String, String>>,
}

impl Copier {
    async fn relocate(&self, task: &Task) -> ObjectReport {
        let mut report = ObjectReport {
            already_there: task.already_there,
            ..ObjectReport::default()
        };
        if !task.already_there {
            let copied = match task.method {
                CopyMethod::Single => self.copy_single(task).await,
                CopyMethod::Multipart { part_size, .. } => {
                    self.copy_multipart(task, part_size).await
                }
            };
            if let Err(e) = copied {
                report.failure = Some(format!("copy failed: {e}"));
                return report;
            }
            report.copied = true;
            report.multipart = matches!(task.method, CopyMethod::Multipart { .. });
            report.bytes = task.source.size;
            if self.verify {
                if let Err(e) = self.check(task).await {
                    report.failure = Some(format!("verification failed: {e}"));
                    return report;
                }
                report.verified = true;
            }
        }
        // --delete-source excludes --no-verify: here the copy was verified or found in place.
        if self.delete_source {
            match self.delete(&task.source.key).await {
                Ok(()) => report.deleted = true,
                Err(e) => {
                    report.failure = Some(format!("copied, but deleting the source failed: {e}"))
                }
            }
        }
        report
    }

    async fn copy_single(&self, task: &Task) -> Result<(), String> {
        let _permit = self.permits.acquire().await.map_err(|e| e.to_string())?;
        self.target
            .copy(&task.target_key, &self.source, &task.source.key)
            .await
            .map_err(|e| e.to_string())?;
        self.progress.inc(task.source.size);
        Ok(())
    }

    async fn copy_multipart(&self, task: &Task, part_size: u64) -> Result<(), String> {
        // A multipart upload starts without the source's headers and metadata: carry them over
        // (tags stay behind; reading them is what breaks on many stores).
        let head = self
            .source
            .head(&task.source.key)
            .await
            .map_err(|e| e.to_string())?;
        let size = head.size.map_or(-1, |n| n as i64);
        if size != task.source.size as i64 {
            return Err(format!(
                "the source changed since it was listed ({} bytes, now {size}); run again",
                task.source.size
            ));
        }
        let upload_id = self
            .target
            .start_multipart(&task.target_key, &head.headers)
            .await
            .map_err(|e| e.to_string())?
            .ok_or("the store started a multipart upload without an upload id")?;
        self.uploads_in_flight()
            .insert(upload_id.clone(), task.target_key.clone());
        let result = self.copy_parts(task, &upload_id, part_size).await;
        if result.is_err() {
            self.abort(&task.target_key, &upload_id).await;
        }
        self.uploads_in_flight().remove(&upload_id);
        result
    }

    async fn copy_parts(&self, task: &Task, upload_id: &str, part_size: u64) -> Result<(), String> {
        let copy_part = |(index, (first, last)): (usize, (u64, u64))| async move {
            let _permit = self.permits.acquire().await.map_err(|e| e.to_string())?;
            let number = index as i32 + 1;
            let part = self
                .target
                .copy_part(
                    &task.target_key,
                    upload_id,
                    number,
                    &self.source,
                    &task.source.key,
                    (first, last),
                )
                .await
                .map_err(|e| format!("part {number} (bytes {first}-{last}): {e}"))?;
            self.progress.inc(last - first + 1);
            if part.etag.is_none() {
                return Err(format!("the store answered part {number} without an ETag"));
            }
            Ok::<Part, String>(part)
        };
        let parts: Vec<Part> = futures_util::stream::iter(
            part_ranges(task.source.size, part_size)
                .into_iter()
                .enumerate(),
        )
        .map(copy_part)
        .buffer_unordered(self.concurrency)
        .try_collect()
        .await?;
        let _permit = self.permits.acquire().await.map_err(|e| e.to_string())?;
        self.target
            .finish_multipart(&task.target_key, upload_id, parts)
            .await
            .map_err(|e| format!("completing the multipart copy: {e}"))?;
        Ok(())
    }

    /// HeadObject on the copy: the source's size, and its ETag after a one-request copy of an
    /// object whose ETag is its MD5 (a multipart copy has an ETag of its own).
    async fn check(&self, task: &Task) -> Result<(), String> {
        let _permit = self.permits.acquire().await.map_err(|e| e.to_string())?;
        let head = self
            .target
            .head(&task.target_key)
            .await
            .map_err(|e| e.to_string())?;
        let size = head.size.map_or(-1, |n| n as i64);
        if size != task.source.size as i64 {
            return Err(format!(
                "the copy has {size} bytes, the source {}",
                task.source.size
            ));
        }
        if task.method == CopyMethod::Single {
            if let (Some(source), Some(copy)) = (
                content_md5(task.source.etag.as_deref()),
                content_md5(head.etag.as_deref()),
            ) {
                if !source.eq_ignore_ascii_case(copy) {
                    return Err(format!(
                        "the copy's ETag {copy} differs from the source's {source}"
                    ));
                }
            }
        }
        Ok(())
    }

    async fn delete(&self, key: &str) -> Result<(), String> {
        let _permit = self.permits.acquire().await.map_err(|e| e.to_string())?;
        self.source.delete(key).await.map_err(|e| e.to_string())?;
        Ok(())
    }

    async fn abort(&self, key: &str, upload_id: &str) {
        if let Err(e) = self.target.abort_multipart(key, upload_id).await {
            let line = format!(
                "warning: aborting the multipart copy to {key} (upload {upload_id}) failed: {e}; the store's lifecycle rules must clean it up"
            );
            self.progress.suspend(|| eprintln!("{line}"));
        }
    }

    /// Aborts every multipart copy still in flight (after Ctrl-C); returns how many there were.
    async fn abort_all(&self) -> usize {
        let uploads: Vec<(String, String)> = self.uploads_in_flight().drain().collect();
        for (upload_id, key) in &uploads {
            self.abort(key, upload_id).await;
        }
        uploads.len()
    }

    fn uploads_in_flight(&self) -> std::sync::MutexGuard<'_, HashMap<String, String>> {
        self.uploads
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

fn progress_bar(total_bytes: u64, quiet: bool) -> ProgressBar {
    let target = if quiet {
        ProgressDrawTarget::hidden()
    } else {
        ProgressDrawTarget::stderr()
    };
    let bar = ProgressBar::with_draw_target(Some(total_bytes), target);
    let style = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} eta {eta} {msg}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

// === the command ===

/// Counts for the summary.
#[derive(Debug, Default)]
struct Summary {
    copied: usize,
    multipart: usize,
    already_there: usize,
    verified: usize,
    deleted: usize,
    bytes: u64,
    /// `(source key, reason)`.
    failures: Vec<(String, String)>,
}

impl Summary {
    fn add(&mut self, key: &str, report: ObjectReport) {
        self.copied += usize::from(report.copied);
        self.multipart += usize::from(report.multipart);
        self.already_there += usize::from(report.already_there);
        self.verified += usize::from(report.verified);
        self.deleted += usize::from(report.deleted);
        self.bytes += report.bytes;
        if let Some(reason) = report.failure {
            self.failures.push((key.to_owned(), reason));
        }
    }
}

/// Runs `relocate`; the exit code says whether everything was copied (and verified).
pub async fn run(
    config: &crate::shell::config::Config,
    args: &RelocateArgs,
) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    let destination = config.artifacts.destination.as_ref();
    let to = validate_to(&args.to).map_err(anyhow::Error::msg)?;
    let source = parse_source(&args.source, destination).map_err(anyhow::Error::msg)?;
    let run = lookup_run(config, args).await?;
    let root = artifact_root(&run.artifact_uri, destination)
        .map_err(|e| anyhow!("run {}: {e}", run.run_id))?;
    let target = Location {
        bucket: root.bucket.clone(),
        key: root.child(&to),
    };
    check_overlap(&source, &target).map_err(anyhow::Error::msg)?;

    // The store's client, built once; the source and the target each address their own bucket
    // with it (the destination only names the store in messages; without one, the target's).
    let bucket_destination = destination.cloned().unwrap_or_else(|| Destination {
        bucket: target.bucket.clone(),
        prefix: String::new(),
    });
    let store = Bucket::connect(&config.artifacts.s3, bucket_destination, 1).await;
    let max_single_copy = args
        .max_single_copy
        .unwrap_or(store.quirks().max_single_copy);
    let (source_bucket, target_bucket) = (store.other(&source.bucket), store.other(&target.bucket));

    let sources = find_sources(&source_bucket, &source)
        .await
        .with_context(|| format!("at {}", store.endpoint()))?;
    if sources.objects.is_empty() {
        anyhow::bail!(
            "no objects under {} at {} ({} directory markers); keys are case-sensitive and a bare prefix is read from the bucket's root",
            source.uri(&source.dir()),
            store.endpoint(),
            sources.markers
        );
    }
    let target_dir = target.dir();
    let existing: HashMap<String, StoredObject> = target_bucket
        .list_all(&target_dir)
        .await
        .with_context(|| {
            format!(
                "listing {} at {}",
                target.uri(&target_dir),
                store.endpoint()
            )
        })?
        .into_iter()
        .map(|o| (o.key.clone(), o))
        .collect();
    let found = sources.objects.len();
    let tasks = plan(
        sources.objects,
        &target,
        &existing,
        max_single_copy,
        args.part_size,
    );
    let to_copy: Vec<&Task> = tasks.iter().filter(|t| !t.already_there).collect();
    let bytes_to_copy: u64 = to_copy.iter().map(|t| t.source.size).sum();

    if run.lifecycle_stage == "deleted" {
        eprintln!(
            "warning: run {} is deleted; MLflow shows its artifacts only once it is restored",
            run.run_id
        );
    }
    println!(
        "run {} (experiment {}): artifacts at {root}",
        run.run_id, run.experiment_id
    );
    println!(
        "from {} to {}: {found} objects, {} to copy ({}), {} already there, {} directory markers ignored",
        source.uri(&source.dir()),
        target.uri(&target_dir),
        to_copy.len(),
        HumanBytes(bytes_to_copy),
        found - to_copy.len(),
        sources.markers,
    );

    if args.dry_run {
        for task in &tasks {
            let (action, how) = match (task.already_there, task.method) {
                (true, _) => ("skip", "already there".to_owned()),
                (false, CopyMethod::Single) => ("copy", "CopyObject".to_owned()),
                (false, CopyMethod::Multipart { parts, part_size }) => (
                    "copy",
                    format!("multipart copy, {parts} parts of {}", HumanBytes(part_size)),
                ),
            };
            println!(
                "{action} {} -> {} ({}, {} bytes; {how})",
                source.uri(&task.source.key),
                target.uri(&task.target_key),
                HumanBytes(task.source.size),
                task.source.size
            );
        }
        println!(
            "dry run: nothing was copied{}",
            if args.delete_source {
                " or deleted"
            } else {
                ""
            }
        );
        println!("objects found:   {found}");
        println!(
            "would copy:      {} ({}, {} bytes)",
            to_copy.len(),
            HumanBytes(bytes_to_copy),
            bytes_to_copy
        );
        println!("already there:   {}", found - to_copy.len());
        return Ok(ExitCode::SUCCESS);
    }

    let concurrency = usize::from(args.concurrency);
    let copier = Copier {
        source: source_bucket,
        target: target_bucket,
        verify: !args.no_verify,
        delete_source: args.delete_source,
        concurrency,
        permits: Semaphore::new(concurrency),
        progress: progress_bar(bytes_to_copy, args.quiet),
        uploads: Mutex::new(HashMap::new()),
    };
    let mut summary = Summary::default();
    let interrupted = {
        let mut done = 0;
        let copier = &copier;
        let mut reports = futures_util::stream::iter(&tasks)
            .map(|task| async move { (task, copier.relocate(task).await) })
            .buffer_unordered(concurrency);
        let work = async {
            while let Some((task, report)) = reports.next().await {
                summary.add(&task.source.key, report);
                done += 1;
                copier
                    .progress
                    .set_message(format!("{done}/{found} objects"));
            }
        };
        tokio::select! {
            () = work => false,
            _ = tokio::signal::ctrl_c() => true,
        }
    };
    copier.progress.finish_and_clear();
    if interrupted {
        let aborted = copier.abort_all().await;
        eprintln!(
            "interrupted: {} objects copied so far, {aborted} multipart copies aborted; run the same command again to resume (copied objects are skipped)",
            summary.copied
        );
        return Ok(ExitCode::from(EXIT_INTERRUPTED));
    }

    println!("objects found:   {found}");
    println!(
        "copied:          {} ({} by multipart copy)",
        summary.copied, summary.multipart
    );
    println!("already there:   {}", summary.already_there);
    println!("failed:          {}", summary.failures.len());
    println!(
        "bytes copied:    {} ({} bytes)",
        HumanBytes(summary.bytes),
        summary.bytes
    );
    if args.no_verify {
        println!("verified:        0 (--no-verify)");
    } else {
        println!("verified:        {}", summary.verified);
    }
    if args.delete_source {
        println!("sources deleted: {}", summary.deleted);
    } else {
        println!(
            "sources deleted: 0 (kept; --delete-source deletes each once its copy is verified)"
        );
    }
    println!("elapsed:         {:.1?}", started.elapsed());
    if summary.failures.is_empty() {
        return Ok(ExitCode::SUCCESS);
    }
    summary.failures.sort();
    for (key, reason) in &summary.failures {
        eprintln!("failed: {}: {reason}", source.uri(key));
    }
    eprintln!(
        "{} of {found} objects failed; run the same command again to retry them (objects already copied are skipped)",
        summary.failures.len()
    );
    Ok(ExitCode::FAILURE)
}

#[cfg(test)]
mod tests;
