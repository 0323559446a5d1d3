//! Arguments of `mlscope-proxy relocate` (the tool lives in [`crate::shell::relocate`]); here so that
//! the command line is declared in one module and the tool depends on it, not the other way.

use crate::capabilities::artifacts::upload::{MAX_PART_SIZE, MIN_PART_SIZE};
use crate::plumbing::settings::parse_size;

/// Arguments of `relocate`. The store is reached as the gateway reaches it (`--artifacts-destination`,
/// `--s3-*`, AWS credentials from the environment); MLflow at `--upstream` names the run's path.
#[derive(Debug, Clone, clap::Args)]
#[command(
    after_help = "Example: mlscope-proxy --upstream http://mlflow:5000 relocate s3://mlflow/my-experiment \
--run-id 0123abcd --artifacts-destination s3://mlflow/artifacts --s3-endpoint-url http://seaweedfs:8333\n\n\
Exit status: 0 when every object is in place (and verified), 1 when any failed (each is named on \
stderr; rerunning the same command retries them and skips what is already copied), 130 on Ctrl-C."
)]
pub struct RelocateArgs {
    /// Prefix of the stray objects: `s3://<bucket>/<prefix>`, or a key prefix from the root of the
    /// --artifacts-destination bucket. Every object below it is copied, keeping its path relative
    /// to the prefix; a prefix that is the key of one object copies that object.
    #[arg(value_name = "SOURCE")]
    pub source: String,
    /// Run whose artifact path receives the copies (its artifact_uri is read from MLflow at --upstream).
    #[arg(long, value_name = "ID")]
    pub run_id: String,
    /// Directory inside the run's artifacts that receives the copies ("" for the artifact root).
    #[arg(long, value_name = "DIR", default_value = "checkpoints")]
    pub to: String,
    /// Print the plan (each source, its target and size) and copy nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Delete each source object once its copy is verified, or was found already in place with the
    /// same size. Needs verification, so it cannot be combined with --no-verify.
    #[arg(long, conflicts_with = "no_verify")]
    pub delete_source: bool,
    /// Skip checking each copy with HeadObject (size, and ETag where the store's ETags are
    /// comparable).
    #[arg(long)]
    pub no_verify: bool,
    /// Copy requests (CopyObject or UploadPartCopy) in flight at once.
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub concurrency: u16,
    /// Part size of multipart copies (5MiB to 5GiB; grown when 10,000 parts would not do).
    #[arg(long, value_name = "SIZE", default_value = "64MiB", value_parser = parse_part_size)]
    pub part_size: u64,
    /// Objects above this size are copied part by part with UploadPartCopy [default: the --s3-quirks
    /// profile's, 1GiB for generic, 5GiB for most].
    #[arg(long, value_name = "SIZE", value_parser = parse_single_copy_limit)]
    pub max_single_copy: Option<u64>,
    /// No progress bar (the plan or summary is still printed).
    #[arg(long, short)]
    pub quiet: bool,
    /// Bearer token for an MLflow behind token authentication.
    #[arg(
        long,
        env = "MLFLOW_TRACKING_TOKEN",
        hide_env_values = true,
        value_name = "TOKEN"
    )]
    pub mlflow_token: Option<Secret>,
    /// User name for an MLflow behind basic authentication (with --mlflow-password).
    #[arg(long, env = "MLFLOW_TRACKING_USERNAME", value_name = "USER")]
    pub mlflow_username: Option<String>,
    /// Password for an MLflow behind basic authentication.
    #[arg(
        long,
        env = "MLFLOW_TRACKING_PASSWORD",
        hide_env_values = true,
        value_name = "PASSWORD"
    )]
    pub mlflow_password: Option<Secret>,
}

fn parse_part_size(s: &str) -> Result<u64, String> {
    let size = parse_size(s)?;
    if !(MIN_PART_SIZE..=MAX_PART_SIZE).contains(&size) {
        return Err(format!(
            "part size must be between 5MiB and 5GiB (S3's limits), not {size} bytes"
        ));
    }
    Ok(size as u64)
}

fn parse_single_copy_limit(s: &str) -> Result<u64, String> {
    let size = parse_size(s)?;
    if size == 0 || size > MAX_PART_SIZE {
        return Err(format!(
            "must be between 1 byte and 5GiB (S3's CopyObject limit), not {size} bytes"
        ));
    }
    Ok(size as u64)
}

use crate::plumbing::credential::Secret;
