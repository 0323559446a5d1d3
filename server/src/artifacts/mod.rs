//! The artifact gateway: MLflow's artifact API (`/api/2.0/mlflow-artifacts/...` and its
//! `/ajax-api` twin) served straight from an S3-compatible store, laid out exactly as MLflow's
//! own `--artifacts-destination`, so MLflow and mlscope read and write the same objects.
//!
//! - `routes` is the route table, one handler per artifact operation under both API prefixes,
//!   and `handlers` the [`Gateway`] that answers each operation (authorized by MLflow, placed in
//!   the request's workspace);
//! - [`objects`] is the object-store facade: every call on the store, the provider's quirks and
//!   the store's errors ([`StoreError`]); [`s3`] builds its clients and names the destination;
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
pub mod objects;
pub mod path;
pub mod policy;
pub mod quirks;
mod routes;
pub mod s3;
pub mod upload;

use std::time::Duration;

use serde::Deserialize;

pub use handlers::Gateway;
pub use objects::{Bucket, StoreError};
pub use quirks::Quirks;
pub use routes::router;
pub use s3::{Destination, S3Settings};

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
    pub s3: S3Settings,
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
            s3: S3Settings::default(),
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
