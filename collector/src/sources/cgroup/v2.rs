//! cgroup v2 (unified hierarchy) files.

use std::path::Path;

use super::{affinity_cpus, count_cpu_list, keyed, CgroupReading, CpuQuota};
use crate::sources::files::OpenFiles;

pub(super) fn read(dir: &Path, mount_point: &Path, files: &mut OpenFiles) -> CgroupReading {
    let mut reading = CgroupReading {
        memory_usage: files.read_u64(&dir.join("memory.current")),
        memory_peak: files.read_u64(&dir.join("memory.peak")),
        ..Default::default()
    };
    reading.inactive_file = files
        .read(&dir.join("memory.stat"))
        .and_then(|s| keyed(s, "inactive_file"));
    reading.oom_kills = files
        .read(&dir.join("memory.events"))
        .and_then(|s| keyed(s, "oom_kill"));
    if let Some(stat) = files.read(&dir.join("cpu.stat")) {
        reading.cpu_usage_usec = keyed(stat, "usage_usec");
        reading.nr_periods = keyed(stat, "nr_periods");
        reading.nr_throttled = keyed(stat, "nr_throttled");
    }
    reading.cpus_allowed = files
        .read(&dir.join("cpuset.cpus.effective"))
        .and_then(count_cpu_list)
        .or_else(affinity_cpus);
    // A container's limit may sit on its pod's cgroup only: the lowest limit set on the cgroup
    // or any ancestor below the mount point applies.
    for ancestor in dir.ancestors().take_while(|d| d.starts_with(mount_point)) {
        if let Some(limit) = files
            .read(&ancestor.join("memory.max"))
            .and_then(parse_memory_max)
        {
            reading.memory_limit = Some(reading.memory_limit.map_or(limit, |l| l.min(limit)));
        }
        if let Some(quota) = files
            .read(&ancestor.join("cpu.max"))
            .and_then(parse_cpu_max)
        {
            reading.cpu_quota = Some(match reading.cpu_quota {
                Some(lowest) if lowest.cores() <= quota.cores() => lowest,
                _ => quota,
            });
        }
    }
    reading
}

/// `memory.max`: bytes, or `max` for none.
pub(super) fn parse_memory_max(text: &str) -> Option<u64> {
    text.trim().parse().ok()
}

/// `cpu.max`: `<quota> <period>` or `max <period>`.
fn parse_cpu_max(text: &str) -> Option<CpuQuota> {
    let mut parts = text.split_whitespace();
    let quota = parts.next()?.parse().ok()?;
    let period = parts.next().map_or(Some(100_000), |p| p.parse().ok())?;
    (period > 0).then_some(CpuQuota {
        quota_usec: quota,
        period_usec: period,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_means_no_limit() {
        assert_eq!(parse_memory_max("max\n"), None);
        assert_eq!(parse_memory_max("1073741824\n"), Some(1 << 30));
        assert_eq!(parse_cpu_max("max 100000\n"), None);
        assert_eq!(
            parse_cpu_max("150000 100000\n").map(CpuQuota::cores),
            Some(1.5)
        );
        assert_eq!(parse_cpu_max("50000 0"), None);
    }
}
