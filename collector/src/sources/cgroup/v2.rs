//! cgroup v2 (unified hierarchy) files.

use std::path::Path;

use super::{affinity_cpus, count_cpu_list, keyed, read_text, read_u64, CgroupReading, CpuQuota};

pub(super) fn read(dir: &Path, mount_point: &Path) -> CgroupReading {
    let memory_stat = read_text(&dir.join("memory.stat"));
    let cpu_stat = read_text(&dir.join("cpu.stat"));
    let cpu_stat = cpu_stat.as_deref();
    CgroupReading {
        memory_usage: read_u64(&dir.join("memory.current")),
        inactive_file: memory_stat.as_deref().and_then(|s| keyed(s, "inactive_file")),
        memory_limit: lowest(dir, mount_point, |d| read_text(&d.join("memory.max")).and_then(|t| parse_memory_max(&t))),
        memory_peak: read_u64(&dir.join("memory.peak")),
        oom_kills: read_text(&dir.join("memory.events")).and_then(|s| keyed(&s, "oom_kill")),
        cpu_usage_usec: cpu_stat.and_then(|s| keyed(s, "usage_usec")),
        cpu_quota: lowest(dir, mount_point, |d| read_text(&d.join("cpu.max")).and_then(|t| parse_cpu_max(&t)))
            .map(|Cores(quota)| quota),
        cpus_allowed: read_text(&dir.join("cpuset.cpus.effective")).and_then(|l| count_cpu_list(&l)).or_else(affinity_cpus),
        nr_periods: cpu_stat.and_then(|s| keyed(s, "nr_periods")),
        nr_throttled: cpu_stat.and_then(|s| keyed(s, "nr_throttled")),
    }
}

/// The smallest limit set on the cgroup or any ancestor below the mount point: a container's
/// limit may sit on its pod's cgroup only.
fn lowest<T: PartialOrd>(dir: &Path, mount_point: &Path, limit: impl Fn(&Path) -> Option<T>) -> Option<T> {
    dir.ancestors()
        .take_while(|d| d.starts_with(mount_point))
        .filter_map(limit)
        .fold(None, |lowest, l| match lowest {
            Some(low) if low <= l => Some(low),
            _ => Some(l),
        })
}

/// `memory.max`: bytes, or `max` for none.
pub(super) fn parse_memory_max(text: &str) -> Option<u64> {
    text.trim().parse().ok()
}

/// A CPU quota ordered by the cores it allows.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Cores(CpuQuota);

impl PartialOrd for Cores {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        self.0.cores().partial_cmp(&other.0.cores())
    }
}

/// `cpu.max`: `<quota> <period>` or `max <period>`.
fn parse_cpu_max(text: &str) -> Option<Cores> {
    let mut parts = text.split_whitespace();
    let quota = parts.next()?.parse().ok()?;
    let period = parts.next().map_or(Some(100_000), |p| p.parse().ok())?;
    (period > 0).then_some(Cores(CpuQuota { quota_usec: quota, period_usec: period }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_means_no_limit() {
        assert_eq!(parse_memory_max("max\n"), None);
        assert_eq!(parse_memory_max("1073741824\n"), Some(1 << 30));
        assert_eq!(parse_cpu_max("max 100000\n"), None);
        assert_eq!(parse_cpu_max("150000 100000\n").map(|c| c.0.cores()), Some(1.5));
        assert_eq!(parse_cpu_max("50000 0"), None);
    }
}
