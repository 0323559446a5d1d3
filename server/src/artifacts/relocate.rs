//! `mlscope-proxy relocate`: repairs history by copying stray objects into a run's artifacts.

/// Arguments of `relocate`.
#[derive(Debug, Clone, clap::Args)]
pub struct RelocateArgs {
    /// Prefix of the stray objects: s3://<bucket>/<prefix> or a key prefix in the destination's bucket.
    pub source: String,
    /// Run whose artifact path receives the copies.
    #[arg(long)]
    pub run_id: String,
}

/// Runs `relocate`; the exit code says whether everything was copied (and verified).
pub async fn run(_config: &crate::Config, _args: &RelocateArgs) -> anyhow::Result<std::process::ExitCode> {
    anyhow::bail!("relocate is not implemented yet")
}
