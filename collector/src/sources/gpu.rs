//! GPUs injected into the container, through NVML loaded at run time (`libnvidia-ml.so.1`).
//! NVML sees exactly the device files the runtime put in the container, and indexes them from 0:
//! the index in `gpu_<i>_*` is that in-container index, as in MLflow's own monitor. No library or
//! no device is normal (CPU pods): one info line and no GPU series.

use std::borrow::Cow;
use std::ffi::OsStr;
use std::time::Instant;

use nvml_wrapper::Nvml;

use super::{round1, Named};

/// What NVML reports for one device; a query that failed is `None` and its series are skipped.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GpuReading {
    /// `nvmlDeviceGetUtilizationRates().gpu`, percent.
    pub utilization: Option<u32>,
    /// `nvmlDeviceGetUtilizationRates().memory`: time the memory controller was busy, percent.
    pub memory_activity: Option<u32>,
    /// `(total, free)` frame buffer bytes.
    pub memory: Option<(u64, u64)>,
    /// `nvmlDeviceGetPowerUsage`, milliwatts.
    pub power_milliwatts: Option<u32>,
    /// `nvmlDeviceGetEnforcedPowerLimit`, milliwatts.
    pub power_limit_milliwatts: Option<u32>,
}

/// MLflow's `gpu_<i>_*` series for device `index`: utilization %, memory used in MB and % of
/// total (used = total - free, what pynvml's default `nvmlDeviceGetMemoryInfo` reports), power
/// in W (NVML gives mW) and % of the enforced limit. Rounded as MLflow rounds.
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
}

/// Utilisation and memory activity at or under this count as idle, in percent: a process that
/// holds a GPU but only waits (a stalled loader, a notebook between cells) stays at 0-2 %.
pub const IDLE_THRESHOLD_PERCENT: u32 = 5;

/// How long each GPU has been idle: both NVML utilisation rates at or under
/// [`IDLE_THRESHOLD_PERCENT`] since the first idle reading, 0 while busy.
#[derive(Debug, Default)]
pub struct IdleClock {
    since: Vec<Option<Instant>>,
}

impl IdleClock {
    /// Seconds device `index` has been idle as of `now`; `None` when NVML did not report both
    /// rates (then the series is left out and the clock restarts).
    pub fn observe(&mut self, index: u32, reading: &GpuReading, now: Instant) -> Option<f64> {
        let index = index as usize;
        if self.since.len() <= index {
            self.since.resize(index + 1, None);
        }
        let (Some(gpu), Some(memory)) = (reading.utilization, reading.memory_activity) else {
            self.since[index] = None;
            return None;
        };
        if gpu > IDLE_THRESHOLD_PERCENT || memory > IDLE_THRESHOLD_PERCENT {
            self.since[index] = None;
            return Some(0.0);
        }
        let since = *self.since[index].get_or_insert(now);
        Some(round1(now.saturating_duration_since(since).as_secs_f64()))
    }
}

/// The library names tried in order: the versioned one the NVIDIA container runtime injects,
/// then the development symlink.
const LIBRARIES: [&str; 2] = ["libnvidia-ml.so.1", "libnvidia-ml.so"];

pub struct GpuSource {
    nvml: Nvml,
    devices: u32,
    idle: IdleClock,
}

impl std::fmt::Debug for GpuSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuSource")
            .field("devices", &self.devices)
            .finish()
    }
}

impl GpuSource {
    /// Loads NVML; `None` (after one info line) when there is no library, no driver or no device.
    pub fn load() -> Option<GpuSource> {
        let mut last_error = None;
        for library in LIBRARIES {
            match Nvml::builder().lib_path(OsStr::new(library)).init() {
                Ok(nvml) => {
                    let devices = nvml.device_count().unwrap_or(0);
                    if devices == 0 {
                        tracing::info!("NVML has no GPU in this container; no GPU series");
                        return None;
                    }
                    tracing::info!(devices, "measuring GPUs through NVML");
                    return Some(GpuSource {
                        nvml,
                        devices,
                        idle: IdleClock::default(),
                    });
                }
                Err(error) => last_error = Some(error),
            }
        }
        let reason = last_error.map(|e| e.to_string()).unwrap_or_default();
        tracing::info!(reason = %reason, "no NVML library or driver; no GPU series");
        None
    }

    pub fn sample(&mut self, out: &mut Vec<Named>) {
        for index in 0..self.devices {
            let Ok(device) = self.nvml.device_by_index(index) else {
                continue;
            };
            let rates = device.utilization_rates().ok();
            let reading = GpuReading {
                utilization: rates.as_ref().map(|u| u.gpu),
                memory_activity: rates.as_ref().map(|u| u.memory),
                memory: device.memory_info().ok().map(|m| (m.total, m.free)),
                power_milliwatts: device.power_usage().ok(),
                power_limit_milliwatts: device.enforced_power_limit().ok(),
            };
            gpu_metrics(index, &reading, out);
            if let Some(idle) = self.idle.observe(index, &reading, Instant::now()) {
                out.push((Cow::Owned(format!("gpu_{index}_idle_seconds")), idle));
            }
        }
    }

    /// The model of the first GPU (NVML's name, e.g. "NVIDIA H100 80GB HBM3") and how many the
    /// container has, for the run's placement tags.
    pub fn inventory(&self) -> (Option<String>, u32) {
        let model = self
            .nvml
            .device_by_index(0)
            .ok()
            .and_then(|d| d.name().ok());
        (model, self.devices)
    }
}

/// Frame-buffer memory allocated on each GPU now, for the check after a rank's leftover
/// processes are gone (`crate::leftovers`). A trait so that check is tested without a GPU.
pub trait GpuMemory {
    /// `(index, bytes)`: NVML's `used` (`nvmlDeviceGetMemoryInfo_v2`), which leaves out the
    /// driver's reserve, so an idle GPU shows next to nothing. A device that cannot be read is
    /// left out.
    fn allocated_bytes(&self) -> Vec<(u32, u64)>;
}

impl GpuMemory for GpuSource {
    fn allocated_bytes(&self) -> Vec<(u32, u64)> {
        (0..self.devices)
            .filter_map(|index| {
                let memory = self.nvml.device_by_index(index).ok()?.memory_info().ok()?;
                Some((index, memory.used))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn by_name(out: &[Named]) -> Vec<(&str, f64)> {
        out.iter().map(|(n, v)| (n.as_ref(), *v)).collect()
    }

    #[test]
    fn nvml_units_become_mlflows_names_and_units() {
        let reading = GpuReading {
            utilization: Some(87),
            memory_activity: Some(40),
            memory: Some((80_000_000_000, 20_000_000_000)),
            power_milliwatts: Some(350_000),
            power_limit_milliwatts: Some(700_000),
        };
        let mut out = Vec::new();
        gpu_metrics(3, &reading, &mut out);
        assert_eq!(
            by_name(&out),
            [
                ("gpu_3_utilization_percentage", 87.0),
                ("gpu_3_memory_usage_megabytes", 60_000.0),
                ("gpu_3_memory_usage_percentage", 75.0),
                ("gpu_3_power_usage_watts", 350.0),
                ("gpu_3_power_usage_percentage", 50.0),
            ]
        );
    }

    #[test]
    fn failed_queries_and_a_zero_limit_leave_series_out() {
        let reading = GpuReading {
            power_milliwatts: Some(123_456),
            power_limit_milliwatts: Some(0),
            ..Default::default()
        };
        let mut out = Vec::new();
        gpu_metrics(0, &reading, &mut out);
        assert_eq!(by_name(&out), [("gpu_0_power_usage_watts", 123.5)]);
    }

    #[test]
    fn a_gpu_counts_as_idle_from_its_first_quiet_reading_until_either_rate_rises() {
        let start = Instant::now();
        let at = |s: u64| start + std::time::Duration::from_secs(s);
        let reading = |gpu: u32, memory: u32| GpuReading {
            utilization: Some(gpu),
            memory_activity: Some(memory),
            ..Default::default()
        };
        let mut clock = IdleClock::default();
        assert_eq!(clock.observe(1, &reading(97, 60), at(0)), Some(0.0));
        assert_eq!(clock.observe(1, &reading(0, 0), at(10)), Some(0.0));
        assert_eq!(clock.observe(1, &reading(3, 5), at(70)), Some(60.0));
        // Memory traffic alone (e.g. a copy) is work.
        assert_eq!(clock.observe(1, &reading(0, 30), at(80)), Some(0.0));
        assert_eq!(clock.observe(1, &reading(0, 0), at(90)), Some(0.0));
        assert_eq!(clock.observe(1, &reading(0, 0), at(100)), Some(10.0));
        // A failed query: no series, and idleness counts anew.
        let unknown = GpuReading::default();
        assert_eq!(clock.observe(1, &unknown, at(110)), None);
        assert_eq!(clock.observe(1, &reading(0, 0), at(120)), Some(0.0));
        // Device 0 has its own clock.
        assert_eq!(clock.observe(0, &reading(0, 0), at(120)), Some(0.0));
        assert_eq!(
            mlscope_scopes::rule_for("gpu_1_idle_seconds").map(|r| r.scope),
            Some(mlscope_scopes::Scope::Device)
        );
    }

    #[test]
    fn every_gpu_name_is_a_device_series_in_the_scope_table() {
        let mut out = Vec::new();
        gpu_metrics(
            12,
            &GpuReading {
                utilization: Some(1),
                memory_activity: Some(1),
                memory: Some((2, 1)),
                power_milliwatts: Some(1),
                power_limit_milliwatts: Some(2),
            },
            &mut out,
        );
        for (name, _) in &out {
            assert_eq!(
                mlscope_scopes::rule_for(name).map(|r| r.scope),
                Some(mlscope_scopes::Scope::Device),
                "{name}"
            );
        }
    }
}
