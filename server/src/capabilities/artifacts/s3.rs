//! The S3 client's construction, once from the configuration with the provider's quirks applied,
//! and the artifact destination it writes under. The calls on the store are the facade's
//! ([`super::objects`]).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use aws_config::BehaviorVersion;
use aws_sdk_s3::config::{
    Region, RequestChecksumCalculation, ResponseChecksumValidation, SharedHttpClient,
    StalledStreamProtectionConfig,
};
use aws_sdk_s3::Client;

use super::quirks::{Checksums, Quirks};

/// `s3://<bucket>/<prefix>`: where artifacts live, laid out as MLflow's
/// `--artifacts-destination` lays them out (`<prefix>/<experiment>/<run>/artifacts/...`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    pub bucket: String,
    /// Without leading or trailing `/`; empty for the bucket's root.
    pub prefix: String,
}

impl Destination {
    pub fn parse(uri: &str) -> Result<Self, String> {
        let rest = uri.strip_prefix("s3://").ok_or_else(|| {
            format!("artifacts destination {uri:?} must be an s3://<bucket>/<prefix> URI")
        })?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(format!("artifacts destination {uri:?} names no bucket"));
        }
        Ok(Self {
            bucket: bucket.to_owned(),
            prefix: prefix.trim_matches('/').to_owned(),
        })
    }

    /// The object key for an artifact path relative to the destination (already validated).
    pub fn key(&self, path: &str) -> String {
        let path = path.trim_matches('/');
        match (self.prefix.is_empty(), path.is_empty()) {
            (true, _) => path.to_owned(),
            (false, true) => self.prefix.clone(),
            (false, false) => format!("{}/{}", self.prefix, path),
        }
    }

    /// The listing prefix for a directory: its key followed by `/` (empty at the bucket root).
    pub fn dir_prefix(&self, path: &str) -> String {
        let key = self.key(path);
        if key.is_empty() {
            key
        } else {
            key + "/"
        }
    }
}

impl fmt::Display for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.prefix.is_empty() {
            write!(f, "s3://{}", self.bucket)
        } else {
            write!(f, "s3://{}/{}", self.bucket, self.prefix)
        }
    }
}

/// How to reach the store. Credentials come from the standard AWS chain (environment,
/// shared config/credentials files and profile, web identity, container and instance metadata).
#[derive(Debug, Clone)]
pub struct S3Config {
    /// `--s3-endpoint-url`; `None` means AWS S3 itself.
    pub endpoint_url: Option<String>,
    pub region: Option<String>,
    /// Overrides the quirks profile's addressing style.
    pub path_style: Option<bool>,
    pub quirks: &'static Quirks,
    /// Endpoint written into presigned URLs, when clients reach the store under another address
    /// than the proxy does.
    pub presign_endpoint_url: Option<String>,
    /// How long a transfer may make no progress before it is aborted (`--body-idle-timeout`):
    /// to or from the store, and the client's upload body. Slow transfers that keep moving are
    /// never cut.
    pub stall_grace: Duration,
}

impl Default for S3Config {
    fn default() -> Self {
        Self {
            endpoint_url: None,
            region: None,
            path_style: None,
            quirks: Quirks::generic(),
            presign_endpoint_url: None,
            stall_grace: Duration::from_secs(120),
        }
    }
}

/// The HTTP client of every AWS call the proxy makes (S3, and the credential providers' STS,
/// IMDS and container endpoints): hyper with rustls on ring, trusting the system's roots; plain
/// `http://` endpoints (a store inside the cluster) need no TLS at all.
pub fn https_client() -> SharedHttpClient {
    use aws_smithy_http_client::tls::{rustls_provider::CryptoMode, Provider};
    aws_smithy_http_client::Builder::new()
        .tls_provider(Provider::Rustls(CryptoMode::Ring))
        .build_https()
}

/// The clients of a store, with the provider's quirks applied (addressing style, checksums,
/// region, and the stall grace on every operation): `pools` that make calls, each with a
/// connection pool of its own (one per serving thread and one for every other thread, as
/// [`crate::plumbing::proxy::Forwarder`]'s), and one that signs presigned URLs (the first of
/// them unless a presign endpoint is configured). Only the object-store facade
/// ([`super::objects::Bucket`]) holds them.
pub(super) async fn clients(settings: &S3Config, pools: usize) -> (Arc<[Client]>, Client) {
    let quirks = settings.quirks;
    let region = settings
        .region
        .clone()
        .unwrap_or_else(|| quirks.default_region.to_owned());
    let shared = aws_config::defaults(BehaviorVersion::latest())
        .http_client(https_client())
        .region(Region::new(region))
        .load()
        .await;
    let build = |endpoint: Option<&String>, http: SharedHttpClient| {
        let (calculation, validation) = match quirks.checksums {
            Checksums::WhenRequired => (
                RequestChecksumCalculation::WhenRequired,
                ResponseChecksumValidation::WhenRequired,
            ),
            Checksums::WhenSupported => (
                RequestChecksumCalculation::WhenSupported,
                ResponseChecksumValidation::WhenSupported,
            ),
        };
        let mut builder = aws_sdk_s3::config::Builder::from(&shared)
            .http_client(http)
            .force_path_style(settings.path_style.unwrap_or(quirks.path_style))
            .request_checksum_calculation(calculation)
            .response_checksum_validation(validation)
            // Every operation, not only bodies: a store that accepts the connection and never
            // answers fails the request after the stall grace instead of holding it forever.
            .timeout_config(
                aws_sdk_s3::config::timeout::TimeoutConfig::builder()
                    .connect_timeout(Duration::from_secs(5))
                    .read_timeout(settings.stall_grace)
                    .build(),
            )
            .stalled_stream_protection(
                StalledStreamProtectionConfig::enabled()
                    .grace_period(settings.stall_grace)
                    .build(),
            );
        if let Some(url) = endpoint {
            builder = builder.endpoint_url(url);
        }
        Client::from_conf(builder.build())
    };
    let clients: Arc<[Client]> = (0..pools.max(1))
        .map(|_| build(settings.endpoint_url.as_ref(), https_client()))
        .collect();
    let presigner = match &settings.presign_endpoint_url {
        Some(url) => build(Some(url), https_client()),
        None => clients[0].clone(),
    };
    (clients, presigner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn destinations_map_artifact_paths_to_keys_like_mlflow() {
        let d = Destination::parse("s3://mlflow/artifacts/").unwrap();
        assert_eq!(d.bucket, "mlflow");
        assert_eq!(
            d.key("1/abc/artifacts/model.pt"),
            "artifacts/1/abc/artifacts/model.pt"
        );
        assert_eq!(
            d.dir_prefix("1/abc/artifacts"),
            "artifacts/1/abc/artifacts/"
        );
        assert_eq!(d.dir_prefix(""), "artifacts/");
        assert_eq!(d.to_string(), "s3://mlflow/artifacts");
        let root = Destination::parse("s3://bucket").unwrap();
        assert_eq!(root.key("0/r/artifacts/a"), "0/r/artifacts/a");
        assert_eq!(root.dir_prefix(""), "");
        assert!(Destination::parse("gs://b/p")
            .unwrap_err()
            .contains("s3://"));
        assert!(Destination::parse("s3:///p").is_err());
    }
}
