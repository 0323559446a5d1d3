//! GPUs injected into the container, through NVML loaded at run time (`libnvidia-ml.so.1`).
//! NVML sees exactly the device files the runtime put in the container, and indexes them from 0:
//! the index in `gpu_<i>_*` is that in-container index, as in MLflow's own monitor. No library or
//! no device is normal (CPU pods): one info line and no GPU series.

use std::borrow::Cow;
use std::ffi::OsStr;

use nvml_wrapper::Nvml;

use super::{round1, Named};

/// What NVML reports for one device; a query that failed is `None` and its series are skipped.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GpuReading {
    /// `nvmlDeviceGetUtilizationRates().gpu`, percent.
    pub utilization: Option<u32>,
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

/// The library names tried in order: the versioned one the NVIDIA container runtime injects,
/// then the development symlink.
const LIBRARIES: [&str; 2] = ["libnvidia-ml.so.1", "libnvidia-ml.so"];

pub struct GpuSource {
    nvml: Nvml,
    devices: u32,
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
                    return Some(GpuSource { nvml, devices });
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
            let reading = GpuReading {
                utilization: device.utilization_rates().ok().map(|u| u.gpu),
                memory: device.memory_info().ok().map(|m| (m.total, m.free)),
                power_milliwatts: device.power_usage().ok(),
                power_limit_milliwatts: device.enforced_power_limit().ok(),
            };
            gpu_metrics(index, &reading, out);
        }
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
    fn every_gpu_name_is_a_device_series_in_the_scope_table() {
        let mut out = Vec::new();
        gpu_metrics(
            12,
            &GpuReading {
                utilization: Some(1),
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
