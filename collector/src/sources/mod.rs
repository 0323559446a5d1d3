//! What the collector measures, one module per scope: the container's cgroup, the node's CPU
//! and memory, filesystems (root and watched volumes), the pod's network and its GPUs.
//! Every source appends bare metric names (`node_cpu_utilization_percentage`, ...) with values;
//! [`Sampler`] turns them into one [`Sample`] with the scope contract's keys.

pub mod cgroup;
pub mod disk;
pub mod files;
pub mod gauges;
pub mod gpu;
pub mod network;
pub mod node;

use std::borrow::Cow;
use std::path::PathBuf;
use std::sync::Arc;

use mlscope_scopes::Identity;

use crate::sample::{KeyBook, Sample};
use cgroup::{CgroupLayout, ContainerSource};
use disk::{DiskSource, WatchedVolume};
use gauges::Gauges;
use gpu::GpuSource;
use network::NetworkSource;
use node::NodeSource;

/// A bare metric name and its value.
pub type Named = (Cow<'static, str>, f64);

/// Rounds to one decimal, as MLflow's monitor rounds what it logs.
pub fn round1(value: f64) -> f64 {
    (value * 10.0).round() / 10.0
}

/// Where the sources read from.
#[derive(Debug)]
pub struct SourceConfig {
    /// `/proc` (node CPU and memory, network).
    pub proc_root: PathBuf,
    /// The root filesystem whose space `rootfs_*` reports.
    pub rootfs: PathBuf,
    pub volumes: Vec<WatchedVolume>,
    /// The cgroup to measure; `None`: no container series.
    pub cgroup: Option<CgroupLayout>,
    /// Try NVML.
    pub gpus: bool,
    /// GPM's SM activity under this (percent) counts as idle (`--gpu-idle-below`).
    pub gpu_idle_below: f64,
    /// Values other threads measure (the data watch's file counts).
    pub gauges: Option<Arc<Gauges>>,
}

/// Reads every source once per tick and stamps the result with one timestamp and one step.
#[derive(Debug)]
pub struct Sampler {
    node: NodeSource,
    disk: DiskSource,
    network: NetworkSource,
    container: Option<ContainerSource>,
    gpu: Option<GpuSource>,
    gauges: Option<Arc<Gauges>>,
    keys: KeyBook,
    step: i64,
    scratch: Vec<Named>,
}

impl Sampler {
    /// Takes the baselines (CPU times, network counters), so the first sample covers the time
    /// since now.
    pub fn new(settings: SourceConfig, identity: Identity) -> Self {
        Sampler {
            node: NodeSource::new(settings.proc_root.clone()),
            disk: DiskSource::new(settings.rootfs, settings.volumes),
            network: NetworkSource::new(settings.proc_root),
            container: settings.cgroup.map(ContainerSource::new),
            gpu: if settings.gpus {
                GpuSource::load(settings.gpu_idle_below)
            } else {
                None
            },
            gauges: settings.gauges,
            keys: KeyBook::new(identity),
            step: 0,
            scratch: Vec::with_capacity(64),
        }
    }

    pub fn container(&self) -> Option<&ContainerSource> {
        self.container.as_ref()
    }

    /// GPU model and count, when NVML sees GPUs.
    pub fn gpu_inventory(&self) -> Option<(Option<String>, u32)> {
        self.gpu.as_ref().map(GpuSource::inventory)
    }

    /// What the last sample judged GPU idleness on (`sm_active`, `utilization`, `mixed`); `None`
    /// without GPUs, before the first sample and while GPM waits for its first reading.
    pub fn gpu_idle_basis(&self) -> Option<&'static str> {
        self.gpu.as_ref().and_then(GpuSource::idle_basis)
    }

    /// The GPUs' memory, when NVML sees GPUs.
    pub fn gpu_memory(&self) -> Option<&dyn gpu::GpuMemory> {
        self.gpu.as_ref().map(|gpu| gpu as &dyn gpu::GpuMemory)
    }

    /// One sample of everything, at the next step.
    pub fn sample(&mut self) -> Sample {
        let timestamp_ms = crate::sample::now_ms();
        self.scratch.clear();
        if let Some(container) = &mut self.container {
            container.sample(&mut self.scratch);
        }
        self.node.sample(&mut self.scratch);
        self.disk.sample(&mut self.scratch);
        self.network.sample(&mut self.scratch);
        if let Some(gpu) = &mut self.gpu {
            gpu.sample(&mut self.scratch);
        }
        if let Some(gauges) = &self.gauges {
            gauges.sample(&mut self.scratch);
        }
        let metrics = self
            .scratch
            .iter()
            .filter(|(_, value)| value.is_finite())
            .map(|(name, value)| (self.keys.key(name), *value))
            .collect();
        let sample = Sample {
            timestamp_ms,
            step: self.step,
            metrics,
        };
        self.step += 1;
        sample
    }
}
