//! The artifact gateway: MLflow's artifact API (`/api/2.0/mlflow-artifacts/...` and its
//! `/ajax-api` twin) served straight from an S3-compatible store, laid out exactly as MLflow's
//! own `--artifacts-destination`, so MLflow and mlscope read and write the same objects.
//!
//! - `routes` is the route table, one handler per artifact operation under both API prefixes,
//!   and `handlers` the [`Gateway`] that answers each operation (authorized by MLflow, placed in
//!   the request's workspace);
//! - [`objects`] is the object-store facade: every call on the store, the provider's quirks and
//!   the store's errors ([`StoreError`](objects::StoreError)); [`s3`] builds its clients and names the destination;
//! - [`upload`] streams request bodies to the store (one PUT or a multipart upload);
//! - [`policy`] keeps writes inside the artifact roots of runs, models and traces that exist;
//! - [`failures`] records failed uploads on the run as tags;
//! - [`listing`] lists a directory as MLflow does, without directory markers;
//!   [`legacy_listing`] removes them from the listings of older MLflow servers;
//! - [`path`] validates and decodes artifact paths as MLflow does;
//! - [`quirks`] is the table of what each S3-compatible store needs.

pub mod failures;
mod handlers;
pub mod legacy_listing;
pub mod listing;
mod metrics;
pub mod objects;
pub mod path;
pub mod policy;
pub mod quirks;
mod routes;
pub mod s3;
pub mod upload;

use std::time::Duration;

use serde::Deserialize;

use crate::plumbing::settings::{parse_duration, parse_size};

pub use handlers::Gateway;
pub use metrics::GatewayMetrics;
pub use routes::router;
pub(crate) use routes::PREFIXES;

use quirks::Quirks;
use s3::{Destination, S3Config};

/// What happens to a write outside the artifact root of an existing run, model or trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum WritePolicy {
    /// Refuse it with 403 and say where the file must go.
    Enforce,
    /// Allow it and log a warning.
    Warn,
    /// Allow it.
    Off,
}

/// The gateway's settings (`--artifacts-destination` and the `--s3-*` / `--artifact-*` flags).
#[derive(Debug, Clone)]
pub struct ArtifactsConfig {
    /// `None`: artifact requests are forwarded to MLflow like any other.
    pub destination: Option<Destination>,
    pub s3: S3Config,
    pub part_size: usize,
    pub upload_concurrency: usize,
    pub multipart_threshold: usize,
    /// Uploads handled at once; one more is answered 503 (retried by the client).
    pub max_concurrent_uploads: usize,
    pub write_policy: WritePolicy,
    pub owner_cache_ttl: Duration,
    /// How long MLflow's "allowed" for one client, operation and path is reused; 0 asks every time.
    pub authz_cache_ttl: Duration,
    pub presign_expiry: Duration,
}

impl Default for ArtifactsConfig {
    fn default() -> Self {
        Self {
            destination: None,
            s3: S3Config::default(),
            part_size: 8 << 20,
            upload_concurrency: 4,
            multipart_threshold: 8 << 20,
            max_concurrent_uploads: 32,
            write_policy: WritePolicy::Enforce,
            owner_cache_ttl: Duration::from_secs(300),
            authz_cache_ttl: Duration::from_secs(10),
            presign_expiry: Duration::from_secs(3600),
        }
    }
}

impl ArtifactsConfig {
    pub fn validate(&self) -> Result<(), String> {
        if !(upload::MIN_PART_SIZE..=upload::MAX_PART_SIZE).contains(&self.part_size) {
            return Err(format!(
                "artifact-part-size must be between 5MiB and 5GiB (S3's limits), not {} bytes",
                self.part_size
            ));
        }
        if self.upload_concurrency == 0 || self.upload_concurrency > 64 {
            return Err("artifact-upload-concurrency must be between 1 and 64".into());
        }
        if self.multipart_threshold > upload::MAX_PART_SIZE {
            return Err("artifact-multipart-threshold must be at most 5GiB".into());
        }
        if self.max_concurrent_uploads == 0 {
            return Err("artifact-max-concurrent-uploads must be at least 1".into());
        }
        if self.presign_expiry.is_zero() || self.presign_expiry > self.s3.quirks.max_presign_expiry
        {
            return Err(format!(
                "artifact-presign-expiry must be above 0 and at most {:?} for the {} profile",
                self.s3.quirks.max_presign_expiry, self.s3.quirks
            ));
        }
        for (name, url) in [
            ("s3-endpoint-url", &self.s3.endpoint_url),
            ("s3-presign-endpoint-url", &self.s3.presign_endpoint_url),
        ] {
            if let Some(url) = url {
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    return Err(format!("{name} {url:?} must be an http:// or https:// URL"));
                }
            }
        }
        if self.destination.is_none() && self.s3.endpoint_url.is_some() {
            return Err("s3-endpoint-url is set but artifacts-destination is not; set --artifacts-destination s3://<bucket>/<prefix> to serve artifacts".into());
        }
        Ok(())
    }

    /// Memory one upload may hold at most.
    pub fn upload_memory_bound(&self) -> usize {
        self.multipart_threshold + 1 + self.part_size * self.upload_concurrency
    }
}

/// The gateway's settings as given (see [`crate::plumbing::settings`]); `None`: not given here. The store
/// settings are global flags, so that `relocate` takes them after its name too.
#[derive(Debug, Clone, Default, clap::Args, Deserialize)]
pub struct ArtifactsOptions {
    /// Serve MLflow's artifact API from this S3 location, laid out as MLflow's own
    /// `--artifacts-destination` (e.g. s3://mlflow/artifacts). Unset: artifact requests are forwarded.
    #[arg(
        long,
        global = true,
        env = "MLSCOPE_ARTIFACTS_DESTINATION",
        value_name = "URI"
    )]
    pub artifacts_destination: Option<String>,
    /// S3 endpoint of an S3-compatible store (e.g. http://seaweedfs:8333); unset for AWS S3.
    #[arg(
        long,
        global = true,
        env = "MLSCOPE_S3_ENDPOINT_URL",
        value_name = "URL"
    )]
    pub s3_endpoint_url: Option<String>,
    /// Region to sign requests for [default: the quirks profile's, us-east-1 for most].
    #[arg(long, global = true, env = "MLSCOPE_S3_REGION", value_name = "REGION")]
    pub s3_region: Option<String>,
    /// Path-style addressing (endpoint/bucket/key) [default: the quirks profile's].
    #[arg(long, global = true, env = "MLSCOPE_S3_PATH_STYLE", value_name = "BOOL", action = clap::ArgAction::Set)]
    pub s3_path_style: Option<bool>,
    /// Store quirks profile: generic, aws, seaweedfs, minio, ceph, r2 [default: generic].
    #[arg(long, global = true, env = "MLSCOPE_S3_QUIRKS", value_name = "PROFILE")]
    pub s3_quirks: Option<String>,
    /// Endpoint written into presigned multipart URLs when clients reach the store under
    /// another address than the proxy [default: --s3-endpoint-url].
    #[arg(
        long,
        global = true,
        env = "MLSCOPE_S3_PRESIGN_ENDPOINT_URL",
        value_name = "URL"
    )]
    pub s3_presign_endpoint_url: Option<String>,
    /// Part size of multipart uploads; memory per upload is bounded by part size x
    /// (concurrency + 1) [default: 8MiB, at least 5MiB].
    #[arg(long, env = "MLSCOPE_ARTIFACT_PART_SIZE", value_parser = parse_size, value_name = "SIZE")]
    #[serde(default, deserialize_with = "crate::plumbing::settings::size")]
    pub artifact_part_size: Option<usize>,
    /// Parts of one upload sent to the store at once [default: 4].
    #[arg(long, env = "MLSCOPE_ARTIFACT_UPLOAD_CONCURRENCY", value_name = "N")]
    pub artifact_upload_concurrency: Option<usize>,
    /// Uploads up to this size go to the store as one PUT; larger or unknown-length ones as
    /// multipart uploads [default: 8MiB].
    #[arg(long, env = "MLSCOPE_ARTIFACT_MULTIPART_THRESHOLD", value_parser = parse_size, value_name = "SIZE")]
    #[serde(default, deserialize_with = "crate::plumbing::settings::size")]
    pub artifact_multipart_threshold: Option<usize>,
    /// Artifact uploads handled at once; more get 503 and are retried by the client [default: 32].
    #[arg(
        long,
        env = "MLSCOPE_ARTIFACT_MAX_CONCURRENT_UPLOADS",
        value_name = "N"
    )]
    pub artifact_max_concurrent_uploads: Option<usize>,
    /// Writes outside MLflow-owned roots (`<exp>/<run>/artifacts`, `<exp>/models/<id>/artifacts`,
    /// `<exp>/traces/<id>/artifacts`): enforce (403), warn (log and allow) or off [default: enforce].
    #[arg(long, env = "MLSCOPE_ARTIFACT_WRITE_POLICY", value_enum)]
    pub artifact_write_policy: Option<WritePolicy>,
    /// How long a run's, model's or trace's existence is cached for the write policy [default: 5m].
    #[arg(long, env = "MLSCOPE_ARTIFACT_OWNER_CACHE_TTL", value_parser = parse_duration, value_name = "DURATION")]
    #[serde(default, with = "humantime_serde")]
    pub artifact_owner_cache_ttl: Option<Duration>,
    /// When MLflow authenticates, how long its "allowed" for one client, operation and path is
    /// reused before MLflow is asked again; 0 asks on every request [default: 10s].
    #[arg(long, env = "MLSCOPE_ARTIFACT_AUTHZ_CACHE_TTL", value_parser = parse_duration, value_name = "DURATION")]
    #[serde(default, with = "humantime_serde")]
    pub artifact_authz_cache_ttl: Option<Duration>,
    /// Validity of presigned multipart part URLs [default: 1h].
    #[arg(long, env = "MLSCOPE_ARTIFACT_PRESIGN_EXPIRY", value_parser = parse_duration, value_name = "DURATION")]
    #[serde(default, with = "humantime_serde")]
    pub artifact_presign_expiry: Option<Duration>,
}

impl ArtifactsOptions {
    /// The given values over the defaults; a destination that is not `s3://` and an unknown
    /// quirks profile are refused. The store's stall grace stays the default: it is the
    /// forwarder's body idle timeout, which the caller sets.
    pub fn resolve(self) -> Result<ArtifactsConfig, String> {
        let d = ArtifactsConfig::default();
        let destination = match self.artifacts_destination {
            Some(uri) => Some(Destination::parse(&uri)?),
            None => d.destination,
        };
        let quirks = match self.s3_quirks {
            Some(name) => Quirks::named(&name)?,
            None => d.s3.quirks,
        };
        Ok(ArtifactsConfig {
            destination,
            s3: S3Config {
                endpoint_url: self.s3_endpoint_url.or(d.s3.endpoint_url),
                region: self.s3_region.or(d.s3.region),
                path_style: self.s3_path_style.or(d.s3.path_style),
                quirks,
                presign_endpoint_url: self.s3_presign_endpoint_url.or(d.s3.presign_endpoint_url),
                stall_grace: d.s3.stall_grace,
            },
            part_size: self.artifact_part_size.unwrap_or(d.part_size),
            upload_concurrency: self
                .artifact_upload_concurrency
                .unwrap_or(d.upload_concurrency),
            multipart_threshold: self
                .artifact_multipart_threshold
                .unwrap_or(d.multipart_threshold),
            max_concurrent_uploads: self
                .artifact_max_concurrent_uploads
                .unwrap_or(d.max_concurrent_uploads),
            write_policy: self.artifact_write_policy.unwrap_or(d.write_policy),
            owner_cache_ttl: self.artifact_owner_cache_ttl.unwrap_or(d.owner_cache_ttl),
            authz_cache_ttl: self.artifact_authz_cache_ttl.unwrap_or(d.authz_cache_ttl),
            presign_expiry: self.artifact_presign_expiry.unwrap_or(d.presign_expiry),
        })
    }
}
