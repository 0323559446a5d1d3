use std::time::Duration;

use super::*;

fn by_name(out: &[Named]) -> Vec<(&str, f64)> {
    out.iter().map(|(n, v)| (n.as_ref(), *v)).collect()
}

/// GPUs that answer from a script: device `i`'s `n`-th reading is `script[i][n]` (the last
/// one again once the script runs out).
struct FakeGpus {
    script: Vec<Vec<Option<GpuReading>>>,
    reads: Vec<usize>,
}

impl FakeGpus {
    fn new(script: Vec<Vec<Option<GpuReading>>>) -> Box<FakeGpus> {
        let reads = vec![0; script.len()];
        Box::new(FakeGpus { script, reads })
    }
}

impl Gpus for FakeGpus {
    fn count(&self) -> u32 {
        self.script.len() as u32
    }

    fn read(&mut self, index: u32) -> Option<GpuReading> {
        let script = &self.script[index as usize];
        let n = &mut self.reads[index as usize];
        let reading = script[(*n).min(script.len() - 1)];
        *n += 1;
        reading
    }

    fn name(&self, _index: u32) -> Option<String> {
        Some("NVIDIA H200".into())
    }
}

impl GpuMemory for FakeGpus {
    fn allocated_bytes(&self) -> Vec<(u32, u64)> {
        vec![(0, 1)]
    }
}

fn spinning(gpm: Gpm) -> GpuReading {
    GpuReading {
        utilization: Some(100),
        memory_activity: Some(0),
        memory: Some((80_000_000_000, 60_000_000_000)),
        gpm,
        ..Default::default()
    }
}

fn sm(sm_active: f64) -> Gpm {
    Gpm::Measured(GpmReading {
        sm_active,
        sm_occupancy: Some(0.4),
        tensor_active: Some(0.0),
        dram_active: Some(0.0),
    })
}

/// The values of one series over the ticks of `source`, sampled every 10 s.
fn series(source: &mut GpuSource, ticks: usize, name: &str) -> Vec<Option<f64>> {
    let start = Instant::now();
    (0..ticks)
        .map(|tick| {
            let mut out = Vec::new();
            source.sample_at(&mut out, start + Duration::from_secs(10 * tick as u64));
            out.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
        })
        .collect()
}

#[test]
fn nvml_units_become_mlflows_names_and_units() {
    let reading = GpuReading {
        utilization: Some(87),
        memory_activity: Some(40),
        memory: Some((80_000_000_000, 20_000_000_000)),
        power_milliwatts: Some(350_000),
        power_limit_milliwatts: Some(700_000),
        gpm: Gpm::Pending,
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
fn gpm_readings_become_four_percentages_rounded_as_mlflow_rounds() {
    let reading = GpuReading {
        utilization: Some(100),
        gpm: Gpm::Measured(GpmReading {
            sm_active: 0.757_575,
            sm_occupancy: Some(33.349),
            tensor_active: Some(101.2),
            dram_active: Some(-0.01),
        }),
        ..Default::default()
    };
    let mut out = Vec::new();
    gpu_metrics(1, &reading, &mut out);
    assert_eq!(
        by_name(&out),
        [
            ("gpu_1_utilization_percentage", 100.0),
            ("gpu_1_sm_active_percentage", 0.8),
            ("gpu_1_sm_occupancy_percentage", 33.3),
            ("gpu_1_tensor_active_percentage", 100.0),
            ("gpu_1_dram_active_percentage", 0.0),
        ]
    );
    // A metric NVML could not compute is left out, not invented.
    let partial = GpuReading {
        gpm: Gpm::Measured(GpmReading {
            sm_active: 12.0,
            sm_occupancy: None,
            tensor_active: Some(f64::NAN),
            dram_active: Some(3.04),
        }),
        ..Default::default()
    };
    let mut out = Vec::new();
    gpu_metrics(0, &partial, &mut out);
    assert_eq!(
        by_name(&out),
        [
            ("gpu_0_sm_active_percentage", 12.0),
            ("gpu_0_dram_active_percentage", 3.0),
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
fn a_gpu_at_full_utilization_and_one_percent_sm_activity_grows_its_idle_clock() {
    // GPM's first tick has no pair to compare yet: judged by utilisation (busy) until then.
    let mut source = GpuSource::new(
        FakeGpus::new(vec![vec![
            Some(spinning(Gpm::Pending)),
            Some(spinning(sm(1.0))),
        ]]),
        DEFAULT_SM_IDLE_BELOW,
    );
    assert_eq!(
        series(&mut source, 4, "gpu_0_idle_seconds"),
        [Some(0.0), Some(0.0), Some(10.0), Some(20.0)]
    );
    assert_eq!(source.idle_basis(), Some("sm_active"));
    assert_eq!(
        series(&mut source, 1, "gpu_0_utilization_percentage"),
        [Some(100.0)]
    );
    assert_eq!(
        series(&mut source, 1, "gpu_0_sm_active_percentage"),
        [Some(1.0)]
    );
}

#[test]
fn without_gpm_a_spinning_gpu_stays_busy_and_a_quiet_one_idles_as_before() {
    let quiet = GpuReading {
        utilization: Some(0),
        memory_activity: Some(0),
        ..Default::default()
    };
    let mut source = GpuSource::new(
        FakeGpus::new(vec![
            vec![Some(spinning(Gpm::Unsupported))],
            vec![Some(quiet)],
        ]),
        DEFAULT_SM_IDLE_BELOW,
    );
    let start = Instant::now();
    let mut last = Vec::new();
    for tick in 0..3 {
        last.clear();
        source.sample_at(&mut last, start + Duration::from_secs(10 * tick));
    }
    assert_eq!(
        by_name(&last),
        [
            ("gpu_0_utilization_percentage", 100.0),
            ("gpu_0_memory_usage_megabytes", 20_000.0),
            ("gpu_0_memory_usage_percentage", 25.0),
            ("gpu_0_idle_seconds", 0.0),
            ("gpu_1_utilization_percentage", 0.0),
            ("gpu_1_idle_seconds", 20.0),
        ]
    );
    assert_eq!(source.idle_basis(), Some("utilization"));
}

#[test]
fn the_basis_is_known_once_gpm_has_its_first_reading() {
    let mut source = GpuSource::new(
        FakeGpus::new(vec![
            vec![Some(spinning(Gpm::Pending)), Some(spinning(sm(50.0)))],
            vec![None, Some(spinning(Gpm::Unsupported))],
        ]),
        DEFAULT_SM_IDLE_BELOW,
    );
    assert_eq!(source.idle_basis(), None);
    source.sample(&mut Vec::new());
    // Device 0 waits for its second GPM sample; device 1 could not be opened.
    assert_eq!(source.idle_basis(), None);
    source.sample(&mut Vec::new());
    assert_eq!(source.idle_basis(), Some("mixed"));
    assert_eq!(source.inventory(), (Some("NVIDIA H200".into()), 2));
    assert_eq!(source.allocated_bytes(), [(0, 1)]);
}

#[test]
fn every_gpu_name_is_a_device_series_in_the_scope_table() {
    let every_series = GpuReading {
        utilization: Some(1),
        memory_activity: Some(1),
        memory: Some((2, 1)),
        power_milliwatts: Some(1),
        power_limit_milliwatts: Some(2),
        gpm: sm(1.0),
    };
    let mut source = GpuSource::new(
        FakeGpus::new(vec![vec![Some(every_series)]; 13]),
        DEFAULT_SM_IDLE_BELOW,
    );
    let mut out = Vec::new();
    source.sample(&mut out);
    let names: Vec<&str> = out.iter().map(|(n, _)| n.as_ref()).collect();
    for suffix in mlscope_scopes::GPU_SUFFIXES {
        assert!(
            names.contains(&format!("gpu_12_{suffix}").as_str()),
            "{suffix}"
        );
    }
    for name in names {
        assert_eq!(
            mlscope_scopes::rule_for(name).map(|r| r.scope),
            Some(mlscope_scopes::Scope::Device),
            "{name}"
        );
        let suffix = name.split_once('_').unwrap().1.split_once('_').unwrap().1;
        assert!(mlscope_scopes::GPU_SUFFIXES.contains(&suffix), "{name}");
    }
}
