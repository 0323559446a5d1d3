//! mlscope-collector: the thin in-pod agent that measures what a training container really
//! uses and posts it to MLflow (through the mlscope proxy) under the scope contract's keys
//! (`docs/metric-scopes.md`, the table in `mlscope-scopes`).
//!
//! ```text
//! main.rs      thin binary: signals blocked first, config (exit 64), logging, run
//! config.rs    flags and the environment a training pod already has
//! agent.rs     the sampling schedule, sidecar and wrapper modes, final flush
//! placement.rs where the rank runs (node, pod, limits, GPUs), tagged with the first sample
//! sources/     one module per scope: cgroup/ (v1, v2, discovery), node, disk, network, gpu
//! sample.rs    one timestamp and one step per sample; keys from the scope table
//! outbox/      bounded buffer, sender thread with backoff, MLflow's runs/log-batch
//! wrapper.rs   the wrapped command: spawn, wait, exit status, OOM verdict, run tags
//! leftovers/   what the command left running: find (descendants, the container's cgroup),
//!              describe (memory, GPU device files), end (SIGTERM, grace, SIGKILL), tags
//! data/        data paths: pre-flight (mountinfo, statvfs, the run), fingerprint scan,
//!              the watch thread and its tags
//! signals.rs   signalfd listener
//! ```

pub mod agent;
pub mod config;
pub mod data;
pub(crate) mod flags;
pub mod leftovers;
pub mod outbox;
mod placement;
pub mod sample;
pub mod signals;
pub mod sources;
pub mod telemetry;
pub mod wrapper;

pub use agent::run;

/// Copies the running binary into `dir` as `mlscope-collector` (executable by all), through a
/// temporary name so that a training container never sees half a binary; the path written.
pub fn install(dir: &std::path::Path) -> std::io::Result<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let source = std::env::current_exe()?;
    let target = dir.join("mlscope-collector");
    let partial = dir.join(".mlscope-collector.partial");
    std::fs::copy(&source, &partial)?;
    std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(0o755))?;
    std::fs::rename(&partial, &target)?;
    Ok(target)
}
