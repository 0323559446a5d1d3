//! The production [`Gpus`]: NVML loaded at run time (`libnvidia-ml.so.1`), with GPM where the
//! device has it (Hopper and newer, a driver from R520 on).
//!
//! GPM compares two samples of the device's counters (`nvmlGpmSampleGet`, then
//! `nvmlGpmMetricsGet` over the pair): each tick takes one sample and compares it with the
//! previous tick's, so a reading covers exactly one sampling interval and the first tick has
//! none (`Gpm::Pending`). NVML wants more than 100 ms between the two samples, the shortest
//! `--interval`. Support is asked once per device (a GPU in MIG mode counts as unsupported: its
//! device counters are every slice's); a device whose GPM reads keep failing (counters held by
//! another profiler) is judged by utilisation from then on, after one warning.

use std::ffi::OsStr;

use nvml_wrapper::enums::gpm::GpmMetricId;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::gpm::{gpm_metrics_get, GpmSample};
use nvml_wrapper::struct_wrappers::gpm::GpmMetricResult;
use nvml_wrapper::{Device, Nvml};

use super::{Gpm, GpmReading, GpuMemory, GpuReading, Gpus};

/// The library names tried in order: the versioned one the NVIDIA container runtime injects,
/// then the development symlink.
const LIBRARIES: [&str; 2] = ["libnvidia-ml.so.1", "libnvidia-ml.so"];

/// The GPM metrics read each tick, in [`GpmReading`]'s order.
const GPM_METRICS: [GpmMetricId; 4] = [
    GpmMetricId::SmUtil,
    GpmMetricId::SmOccupancy,
    GpmMetricId::AnyTensorUtil,
    GpmMetricId::DramBwUtil,
];

/// Consecutive failed GPM reads after which a device is judged by utilisation for good.
const GPM_FAILURES_TO_GIVE_UP: u32 = 3;

/// One device's GPM state between ticks.
enum DeviceGpm {
    Unsupported,
    Supported {
        /// The previous tick's sample: the first of the next pair.
        previous: Option<GpmSample<'static>>,
        failures: u32,
    },
}

pub struct NvmlGpus {
    /// One NVML handle for the life of the process: GPM samples borrow it from one tick to the
    /// next, so it is never shut down (the process's exit releases it).
    nvml: &'static Nvml,
    devices: u32,
    gpm: Vec<DeviceGpm>,
}

impl NvmlGpus {
    /// Loads NVML; `None` (after one info line) when there is no library, no driver or no device.
    pub fn load() -> Option<NvmlGpus> {
        let mut last_error = None;
        for library in LIBRARIES {
            match Nvml::builder().lib_path(OsStr::new(library)).init() {
                Ok(nvml) => {
                    let devices = nvml.device_count().unwrap_or(0);
                    if devices == 0 {
                        tracing::info!("NVML has no GPU in this container; no GPU series");
                        return None;
                    }
                    let nvml: &'static Nvml = Box::leak(Box::new(nvml));
                    let gpm: Vec<DeviceGpm> = (0..devices)
                        .map(|index| {
                            let supported =
                                nvml.device_by_index(index).is_ok_and(|d| gpm_measures(&d));
                            if supported {
                                DeviceGpm::Supported {
                                    previous: None,
                                    failures: 0,
                                }
                            } else {
                                DeviceGpm::Unsupported
                            }
                        })
                        .collect();
                    let with_gpm = gpm
                        .iter()
                        .filter(|g| matches!(g, DeviceGpm::Supported { .. }))
                        .count();
                    tracing::info!(devices, with_gpm, "measuring GPUs through NVML");
                    if with_gpm < devices as usize {
                        tracing::info!(
                            without_gpm = devices as usize - with_gpm,
                            "no GPM (SM activity) on some GPUs: their idleness is judged by utilisation"
                        );
                    }
                    return Some(NvmlGpus { nvml, devices, gpm });
                }
                Err(error) => last_error = Some(error),
            }
        }
        let reason = last_error.map(|e| e.to_string()).unwrap_or_default();
        tracing::info!(reason = %reason, "no NVML library or driver; no GPU series");
        None
    }

    /// This tick's GPM reading of device `index` (see the module's description).
    fn gpm(&mut self, index: u32, device: &Device<'static>) -> Gpm {
        let nvml = self.nvml;
        let Some(slot) = self.gpm.get_mut(index as usize) else {
            return Gpm::Unsupported;
        };
        let DeviceGpm::Supported { previous, failures } = slot else {
            return Gpm::Unsupported;
        };
        let outcome = match device.gpm_sample() {
            Ok(current) => {
                let reading = match previous.as_ref() {
                    Some(first) => gpm_metrics_get(nvml, first, &current, &GPM_METRICS)
                        .map_err(|e| e.to_string())
                        .and_then(|results| reading_of(&results).map(Some)),
                    None => Ok(None),
                };
                *previous = Some(current);
                reading
            }
            Err(error) => Err(error.to_string()),
        };
        match outcome {
            Ok(Some(reading)) => {
                *failures = 0;
                Gpm::Measured(reading)
            }
            Ok(None) => Gpm::Pending,
            Err(error) => {
                *failures += 1;
                if *failures < GPM_FAILURES_TO_GIVE_UP {
                    tracing::debug!(gpu = index, %error, "a GPM read failed");
                    return Gpm::Pending;
                }
                tracing::warn!(gpu = index, %error, "GPM reads keep failing: this GPU's idleness is judged by utilisation from now on");
                *slot = DeviceGpm::Unsupported;
                Gpm::Unsupported
            }
        }
    }
}

/// Whether GPM measures the device as the container has it: supported, and not a GPU in MIG
/// mode (its device-level counters would be the whole GPU's, every tenant's slice included; a
/// slice's own need `nvmlGpmMigSampleGet` and its GPU instance).
fn gpm_measures(device: &Device<'_>) -> bool {
    let mig = device.mig_mode().is_ok_and(|mode| mode.current == 1);
    !mig && device.gpm_support().unwrap_or(false)
}

/// The metrics of one `nvmlGpmMetricsGet`, in [`GPM_METRICS`]' order; an error when SM
/// activity itself is missing (the others may be, one by one).
fn reading_of(results: &[Result<GpmMetricResult, NvmlError>]) -> Result<GpmReading, String> {
    let value = |i: usize| {
        results
            .get(i)
            .and_then(|r| r.as_ref().ok())
            .map(|r| r.value)
    };
    let sm_active = match results.first() {
        Some(Ok(result)) => result.value,
        Some(Err(error)) => return Err(format!("SM activity: {error}")),
        None => return Err("no SM activity in NVML's answer".to_owned()),
    };
    Ok(GpmReading {
        sm_active,
        sm_occupancy: value(1),
        tensor_active: value(2),
        dram_active: value(3),
    })
}

impl Gpus for NvmlGpus {
    fn count(&self) -> u32 {
        self.devices
    }

    fn read(&mut self, index: u32) -> Option<GpuReading> {
        let device = self.nvml.device_by_index(index).ok()?;
        let rates = device.utilization_rates().ok();
        Some(GpuReading {
            utilization: rates.as_ref().map(|u| u.gpu),
            memory_activity: rates.as_ref().map(|u| u.memory),
            memory: device.memory_info().ok().map(|m| (m.total, m.free)),
            power_milliwatts: device.power_usage().ok(),
            power_limit_milliwatts: device.enforced_power_limit().ok(),
            gpm: self.gpm(index, &device),
        })
    }

    fn name(&self, index: u32) -> Option<String> {
        self.nvml.device_by_index(index).ok()?.name().ok()
    }
}

impl GpuMemory for NvmlGpus {
    fn allocated_bytes(&self) -> Vec<(u32, u64)> {
        (0..self.devices)
            .filter_map(|index| {
                let memory = self.nvml.device_by_index(index).ok()?.memory_info().ok()?;
                Some((index, memory.used))
            })
            .collect()
    }
}
