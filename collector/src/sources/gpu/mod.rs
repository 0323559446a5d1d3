//! GPUs injected into the container. NVML sees exactly the device files the runtime put in the
//! container, and indexes them from 0: the index in `gpu_<i>_*` is that in-container index, as in
//! MLflow's own monitor. No library or no device is normal (CPU pods): one info line and no GPU
//! series. Devices are read through the [`Gpus`] trait: [`nvml::NvmlGpus`] in production, a fake
//! in tests (these machines have no GPU).

pub mod idle;
pub mod nvml;

use std::borrow::Cow;
use std::time::Instant;

use super::{round1, Named};
use idle::{rank_basis, IdleBasis, IdleClock};

pub use idle::{DEFAULT_SM_IDLE_BELOW, IDLE_THRESHOLD_PERCENT};

/// What NVML reports for one device; a query that failed is `None` and its series are skipped.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GpuReading {
    /// `nvmlDeviceGetUtilizationRates().gpu`, percent: time at least one kernel ran.
    pub utilization: Option<u32>,
    /// `nvmlDeviceGetUtilizationRates().memory`: time the memory controller was busy, percent.
    pub memory_activity: Option<u32>,
    /// `(total, free)` frame buffer bytes.
    pub memory: Option<(u64, u64)>,
    /// `nvmlDeviceGetPowerUsage`, milliwatts.
    pub power_milliwatts: Option<u32>,
    /// `nvmlDeviceGetEnforcedPowerLimit`, milliwatts.
    pub power_limit_milliwatts: Option<u32>,
    /// GPM's view of the interval since the previous reading.
    pub gpm: Gpm,
}

/// A device's GPM (GPU Performance Monitoring) state at one reading.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Gpm {
    /// No GPM: an older GPU or driver, or its readings kept failing. Judged by utilisation.
    #[default]
    Unsupported,
    /// GPM is supported but has no reading this time: the first sample waits for a second one
    /// to compare with, or this read failed. Judged by utilisation for this tick.
    Pending,
    /// The interval since the previous reading.
    Measured(GpmReading),
}

/// GPM metrics over one sampling interval, in percent (NVML's `nvmlGpmMetricsGet`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GpmReading {
    /// `NVML_GPM_METRIC_SM_UTIL`: the share of SMs that had work (at least one warp assigned),
    /// averaged over the interval. What idleness is judged by.
    pub sm_active: f64,
    /// `NVML_GPM_METRIC_SM_OCCUPANCY`: resident warps against the SMs' maximum.
    pub sm_occupancy: Option<f64>,
    /// `NVML_GPM_METRIC_ANY_TENSOR_UTIL`: the share of time any tensor pipe (HMMA, IMMA, DFMA,
    /// ...) was active, rather than one precision's pipe.
    pub tensor_active: Option<f64>,
    /// `NVML_GPM_METRIC_DRAM_BW_UTIL`: DRAM bandwidth used against the theoretical maximum.
    pub dram_active: Option<f64>,
}

/// MLflow's `gpu_<i>_*` series for device `index`: utilization %, memory used in MB and % of
/// total (used = total - free, what pynvml's default `nvmlDeviceGetMemoryInfo` reports), power
/// in W (NVML gives mW) and % of the enforced limit, rounded as MLflow rounds; then, with a GPM
/// reading, `sm_active`, `sm_occupancy`, `tensor_active` and `dram_active` percentages in the same
/// form (one decimal, within 0-100: the counters count cycles, so clock changes can push them
/// past).
pub fn gpu_metrics(index: u32, reading: &GpuReading, out: &mut Vec<Named>) {
    let mut push =
        |suffix: &str, value: f64| out.push((Cow::Owned(format!("gpu_{index}_{suffix}")), value));
    if let Some(utilization) = reading.utilization {
        push("utilization_percentage", f64::from(utilization));
    }
    if let Some((total, free)) = reading.memory {
        let used = total.saturating_sub(free);
        push("memory_usage_megabytes", round1(used as f64 / 1e6));
        if total > 0 {
            push(
                "memory_usage_percentage",
                round1(used as f64 / total as f64 * 100.0),
            );
        }
    }
    if let Some(power) = reading.power_milliwatts {
        push("power_usage_watts", round1(f64::from(power) / 1000.0));
        if let Some(limit) = reading.power_limit_milliwatts.filter(|&l| l > 0) {
            push(
                "power_usage_percentage",
                round1(f64::from(power) / f64::from(limit) * 100.0),
            );
        }
    }
    if let Gpm::Measured(gpm) = reading.gpm {
        for (suffix, value) in [
            ("sm_active_percentage", Some(gpm.sm_active)),
            ("sm_occupancy_percentage", gpm.sm_occupancy),
            ("tensor_active_percentage", gpm.tensor_active),
            ("dram_active_percentage", gpm.dram_active),
        ] {
            if let Some(value) = value.filter(|v| v.is_finite()) {
                push(suffix, round1(value.clamp(0.0, 100.0)));
            }
        }
    }
}

/// The GPUs of the container, as the collector reads them. A trait so that everything above
/// NVML (series, idle clock, basis tag) is tested without a GPU.
pub trait Gpus: GpuMemory {
    /// Devices in the container.
    fn count(&self) -> u32;
    /// One reading of device `index`, its GPM part covering the time since the previous call
    /// for that device; `None` when the device cannot be opened at all (no series, the idle
    /// clock keeps running).
    fn read(&mut self, index: u32) -> Option<GpuReading>;
    /// The device's model, e.g. "NVIDIA H100 80GB HBM3".
    fn name(&self, index: u32) -> Option<String>;
}

/// Frame-buffer memory allocated on each GPU now, for the check after a rank's leftover
/// processes are gone (`crate::leftovers`). A trait so that check is tested without a GPU.
pub trait GpuMemory {
    /// `(index, bytes)`: NVML's `used` (`nvmlDeviceGetMemoryInfo_v2`), which leaves out the
    /// driver's reserve, so an idle GPU shows next to nothing. A device that cannot be read is
    /// left out.
    fn allocated_bytes(&self) -> Vec<(u32, u64)>;
}

// === impl GpuSource ===

/// The GPU series of each sample, the idle clocks and the rank's idle basis.
pub struct GpuSource {
    gpus: Box<dyn Gpus>,
    idle: IdleClock,
    /// What the last sample's idle clocks were judged on (see [`rank_basis`]).
    basis: Option<&'static str>,
}

impl std::fmt::Debug for GpuSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuSource")
            .field("devices", &self.gpus.count())
            .field("basis", &self.basis)
            .finish()
    }
}

impl GpuSource {
    /// NVML's GPUs; `None` (after one info line) when there is no library, no driver or no
    /// device. SM activity under `sm_idle_below` percent counts as idle where GPM measures it.
    pub fn load(sm_idle_below: f64) -> Option<GpuSource> {
        let gpus = nvml::NvmlGpus::load()?;
        Some(GpuSource::new(Box::new(gpus), sm_idle_below))
    }

    pub fn new(gpus: Box<dyn Gpus>, sm_idle_below: f64) -> GpuSource {
        GpuSource {
            gpus,
            idle: IdleClock::new(sm_idle_below),
            basis: None,
        }
    }

    pub fn sample(&mut self, out: &mut Vec<Named>) {
        self.sample_at(out, Instant::now());
    }

    fn sample_at(&mut self, out: &mut Vec<Named>, now: Instant) {
        let mut bases = Vec::new();
        for index in 0..self.gpus.count() {
            let Some(reading) = self.gpus.read(index) else {
                continue;
            };
            gpu_metrics(index, &reading, out);
            if let Some(idle) = self.idle.observe(index, &reading, now) {
                out.push((Cow::Owned(format!("gpu_{index}_idle_seconds")), idle));
            }
            bases.push(IdleBasis::of(&reading));
        }
        self.basis = rank_basis(&bases);
    }

    /// What the last sample judged idleness on: `sm_active`, `utilization` or `mixed` (its GPUs
    /// differ); `None` before the first sample and while a GPU's GPM has no reading yet.
    pub fn idle_basis(&self) -> Option<&'static str> {
        self.basis
    }

    /// The model of the first GPU (NVML's name, e.g. "NVIDIA H100 80GB HBM3") and how many the
    /// container has, for the run's placement tags.
    pub fn inventory(&self) -> (Option<String>, u32) {
        (self.gpus.name(0), self.gpus.count())
    }
}

impl GpuMemory for GpuSource {
    fn allocated_bytes(&self) -> Vec<(u32, u64)> {
        self.gpus.allocated_bytes()
    }
}

#[cfg(test)]
mod tests;
