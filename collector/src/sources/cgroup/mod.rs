//! The container's truth: its cgroup's memory and CPU against its own limits
//! (field-notes §1; `container_*` in the scope contract).

mod discovery;
mod v1;
mod v2;

use std::borrow::Cow;
use std::time::{Duration, Instant};

pub use discovery::{
    discover, parse_mountinfo, parse_proc_cgroup, CgroupLayout, DiscoveryError, DiscoveryRoots,
    MountInfo, ProcCgroupLine, V1Dirs,
};

use super::files::OpenFiles;
use super::Named;

/// One reading of a cgroup's files. `None`: the file or field is not there (an old kernel, a
/// controller that is not mounted), and the series that need it are omitted.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CgroupReading {
    /// `memory.current` (v2), `memory.usage_in_bytes` (v1).
    pub memory_usage: Option<u64>,
    /// `inactive_file` (v2), `total_inactive_file` (v1) from `memory.stat`.
    pub inactive_file: Option<u64>,
    /// The lowest limit of the cgroup and its ancestors; `None` when unlimited.
    pub memory_limit: Option<u64>,
    /// `memory.peak` (v2), `memory.max_usage_in_bytes` (v1).
    pub memory_peak: Option<u64>,
    /// `oom_kill` of `memory.events` (v2) or `memory.oom_control` (v1).
    pub oom_kills: Option<u64>,
    /// Total CPU time used, in microseconds.
    pub cpu_usage_usec: Option<u64>,
    /// The CFS quota; `None` when there is none.
    pub cpu_quota: Option<CpuQuota>,
    /// CPUs the cgroup may run on (its cpuset, else this process's affinity).
    pub cpus_allowed: Option<u32>,
    pub nr_periods: Option<u64>,
    pub nr_throttled: Option<u64>,
}

/// `cpu.max` / `cpu.cfs_quota_us` + `cpu.cfs_period_us`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuQuota {
    pub quota_usec: u64,
    pub period_usec: u64,
}

impl CpuQuota {
    pub fn cores(self) -> f64 {
        self.quota_usec as f64 / self.period_usec as f64
    }
}

impl CgroupLayout {
    /// Reads the cgroup's files once.
    pub fn read(&self) -> CgroupReading {
        self.read_with(&mut OpenFiles::default())
    }

    /// Reads through `files`, which keeps them open for the next reading.
    pub fn read_with(&self, files: &mut OpenFiles) -> CgroupReading {
        match self {
            CgroupLayout::V2 { dir, mount_point } => v2::read(dir, mount_point, files),
            CgroupLayout::V1(dirs) => v1::read(dirs, files),
        }
    }
}

/// The container series from two readings `elapsed` apart: working set (`usage -
/// inactive_file`, floored at 0, as cAdvisor and kubelet compute it), the limit and the share
/// of it, the peak, CPU use as a share of the quota (or of the allowed CPUs), the quota in
/// cores, the throttled share of CFS periods and the OOM kill count. Limit series are omitted
/// when there is no limit, never invented.
pub fn container_metrics(
    prev: &CgroupReading,
    cur: &CgroupReading,
    elapsed: Duration,
    out: &mut Vec<Named>,
) {
    let mut push = |name: &'static str, value: f64| out.push((Cow::Borrowed(name), value));
    if let Some(usage) = cur.memory_usage {
        let working_set = usage.saturating_sub(cur.inactive_file.unwrap_or(0));
        push(
            "container_memory_working_set_megabytes",
            megabytes(working_set),
        );
        if let Some(limit) = cur.memory_limit.filter(|&l| l > 0) {
            push("container_memory_limit_megabytes", megabytes(limit));
            push(
                "container_memory_working_set_percentage",
                working_set as f64 / limit as f64 * 100.0,
            );
        }
    }
    if let Some(peak) = cur.memory_peak {
        push("container_memory_peak_megabytes", megabytes(peak));
    }
    let elapsed_usec = elapsed.as_secs_f64() * 1e6;
    if let (Some(before), Some(now)) = (prev.cpu_usage_usec, cur.cpu_usage_usec) {
        let capacity = cur
            .cpu_quota
            .map(CpuQuota::cores)
            .or(cur.cpus_allowed.map(f64::from))
            .filter(|&c| c > 0.0);
        if let (Some(capacity), true) = (capacity, elapsed_usec > 0.0) {
            let used_cores = now.saturating_sub(before) as f64 / elapsed_usec;
            push(
                "container_cpu_utilization_percentage",
                used_cores / capacity * 100.0,
            );
        }
    }
    if let Some(quota) = cur.cpu_quota {
        push("container_cpu_limit_cores", quota.cores());
        if let (Some(p0), Some(p1), Some(t0), Some(t1)) = (
            prev.nr_periods,
            cur.nr_periods,
            prev.nr_throttled,
            cur.nr_throttled,
        ) {
            let periods = p1.saturating_sub(p0);
            let throttled = t1.saturating_sub(t0);
            push(
                "container_cpu_throttled_percentage",
                if periods == 0 {
                    0.0
                } else {
                    throttled as f64 / periods as f64 * 100.0
                },
            );
        }
    }
    if let Some(kills) = cur.oom_kills {
        push("container_oom_kill_count", kills as f64);
    }
}

fn megabytes(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

// === impl ContainerSource ===

/// Samples one cgroup; keeps the previous reading for the CPU deltas.
#[derive(Debug)]
pub struct ContainerSource {
    layout: CgroupLayout,
    files: OpenFiles,
    last: CgroupReading,
    last_at: Instant,
}

impl ContainerSource {
    /// Takes the baseline reading, so the first sample already has CPU use.
    pub fn new(layout: CgroupLayout) -> Self {
        let mut files = OpenFiles::default();
        let last = layout.read_with(&mut files);
        ContainerSource {
            layout,
            files,
            last,
            last_at: Instant::now(),
        }
    }

    pub fn layout(&self) -> &CgroupLayout {
        &self.layout
    }

    pub fn sample(&mut self, out: &mut Vec<Named>) {
        let now = Instant::now();
        let cur = self.layout.read_with(&mut self.files);
        container_metrics(&self.last, &cur, now - self.last_at, out);
        self.last = cur;
        self.last_at = now;
    }

    /// The OOM kill counter now (wrapper mode compares it before and after the child).
    pub fn oom_kills(&self) -> Option<u64> {
        self.layout.read().oom_kills
    }
}

// === helpers shared by v1 and v2 ===

/// A value from a flat keyed file (`memory.stat`, `cpu.stat`, `memory.events`, ...).
fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(char::is_whitespace)?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// Counts the CPUs in a cpuset list such as `0-3,8,10-11`.
pub fn count_cpu_list(list: &str) -> Option<u32> {
    let list = list.trim();
    if list.is_empty() {
        return None;
    }
    let mut count = 0u32;
    for part in list.split(',') {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (u32, u32) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                count += b.checked_sub(a)? + 1;
            }
            None => {
                part.trim().parse::<u32>().ok()?;
                count += 1;
            }
        }
    }
    Some(count)
}

/// CPUs this process may run on, when no cpuset file says it.
fn affinity_cpus() -> Option<u32> {
    let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).ok()?;
    let count = (0..nix::sched::CpuSet::count())
        .filter(|&i| set.is_set(i).unwrap_or(false))
        .count();
    u32::try_from(count).ok().filter(|&c| c > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(out: &[Named]) -> Vec<&str> {
        out.iter().map(|(n, _)| n.as_ref()).collect()
    }

    fn value(out: &[Named], name: &str) -> f64 {
        out.iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no {name} in {:?}", names(out)))
            .1
    }

    #[test]
    fn working_set_subtracts_inactive_file_and_is_measured_against_the_limit() {
        let cur = CgroupReading {
            memory_usage: Some(600_000_000),
            inactive_file: Some(100_000_000),
            memory_limit: Some(1_000_000_000),
            memory_peak: Some(700_000_000),
            oom_kills: Some(2),
            ..Default::default()
        };
        let mut out = Vec::new();
        container_metrics(
            &CgroupReading::default(),
            &cur,
            Duration::from_secs(1),
            &mut out,
        );
        assert_eq!(value(&out, "container_memory_working_set_megabytes"), 500.0);
        assert_eq!(value(&out, "container_memory_limit_megabytes"), 1000.0);
        assert_eq!(value(&out, "container_memory_working_set_percentage"), 50.0);
        assert_eq!(value(&out, "container_memory_peak_megabytes"), 700.0);
        assert_eq!(value(&out, "container_oom_kill_count"), 2.0);
    }

    #[test]
    fn working_set_is_floored_at_zero() {
        let cur = CgroupReading {
            memory_usage: Some(10),
            inactive_file: Some(20),
            ..Default::default()
        };
        let mut out = Vec::new();
        container_metrics(&cur, &cur, Duration::from_secs(1), &mut out);
        assert_eq!(value(&out, "container_memory_working_set_megabytes"), 0.0);
    }

    #[test]
    fn cpu_use_is_a_share_of_the_quota_and_throttling_a_share_of_periods() {
        let quota = Some(CpuQuota {
            quota_usec: 200_000,
            period_usec: 100_000,
        });
        let prev = CgroupReading {
            cpu_usage_usec: Some(1_000_000),
            cpu_quota: quota,
            nr_periods: Some(10),
            nr_throttled: Some(1),
            cpus_allowed: Some(8),
            ..Default::default()
        };
        // One core busy for 2 s against a quota of 2 cores: 50 %.
        let cur = CgroupReading {
            cpu_usage_usec: Some(3_000_000),
            nr_periods: Some(30),
            nr_throttled: Some(6),
            ..prev.clone()
        };
        let mut out = Vec::new();
        container_metrics(&prev, &cur, Duration::from_secs(2), &mut out);
        assert!((value(&out, "container_cpu_utilization_percentage") - 50.0).abs() < 1e-9);
        assert_eq!(value(&out, "container_cpu_limit_cores"), 2.0);
        assert_eq!(value(&out, "container_cpu_throttled_percentage"), 25.0);
    }

    #[test]
    fn without_limits_the_limit_series_are_omitted_and_cpu_is_a_share_of_the_allowed_cpus() {
        let prev = CgroupReading {
            memory_usage: Some(5_000_000),
            cpu_usage_usec: Some(0),
            cpus_allowed: Some(4),
            nr_periods: Some(0),
            nr_throttled: Some(0),
            ..Default::default()
        };
        let cur = CgroupReading {
            cpu_usage_usec: Some(2_000_000),
            ..prev.clone()
        };
        let mut out = Vec::new();
        container_metrics(&prev, &cur, Duration::from_secs(1), &mut out);
        assert_eq!(
            names(&out),
            [
                "container_memory_working_set_megabytes",
                "container_cpu_utilization_percentage"
            ]
        );
        assert!((value(&out, "container_cpu_utilization_percentage") - 50.0).abs() < 1e-9);
    }

    #[test]
    fn nothing_known_gives_no_series() {
        let mut out = Vec::new();
        container_metrics(
            &CgroupReading::default(),
            &CgroupReading::default(),
            Duration::from_secs(1),
            &mut out,
        );
        assert!(out.is_empty(), "{out:?}");
    }

    #[test]
    fn cpu_lists_are_counted() {
        assert_eq!(count_cpu_list("0-3,8,10-11\n"), Some(7));
        assert_eq!(count_cpu_list("0"), Some(1));
        assert_eq!(count_cpu_list(""), None);
        assert_eq!(count_cpu_list("3-1"), None);
    }
}
