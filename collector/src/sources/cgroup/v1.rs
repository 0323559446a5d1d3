//! cgroup v1 files, one directory per controller.

use super::{affinity_cpus, count_cpu_list, keyed, CgroupReading, CpuQuota, V1Dirs};
use crate::sources::files::OpenFiles;

/// v1 writes "no limit" as the largest page-aligned `i64` (`9223372036854771712` with 4 KiB
/// pages); anything this large is no limit.
const V1_UNLIMITED: u64 = 1 << 62;

pub(super) fn read(dirs: &V1Dirs, files: &mut OpenFiles) -> CgroupReading {
    let mut reading = CgroupReading::default();
    if let Some(memory) = &dirs.memory {
        reading.memory_usage = files.read_u64(&memory.join("memory.usage_in_bytes"));
        let own_limit = files.read_u64(&memory.join("memory.limit_in_bytes"));
        let mut hierarchical_limit = None;
        if let Some(stat) = files.read(&memory.join("memory.stat")) {
            reading.inactive_file =
                keyed(stat, "total_inactive_file").or_else(|| keyed(stat, "inactive_file"));
            // Already the lowest limit up the tree.
            hierarchical_limit = keyed(stat, "hierarchical_memory_limit");
        }
        reading.memory_limit = [own_limit, hierarchical_limit]
            .into_iter()
            .flatten()
            .filter(|&l| l < V1_UNLIMITED)
            .min();
        reading.memory_peak = files.read_u64(&memory.join("memory.max_usage_in_bytes"));
        reading.oom_kills = files
            .read(&memory.join("memory.oom_control"))
            .and_then(|s| keyed(s, "oom_kill"));
    }
    if let Some(cpuacct) = &dirs.cpuacct {
        reading.cpu_usage_usec = files
            .read_u64(&cpuacct.join("cpuacct.usage"))
            .map(|ns| ns / 1000);
    }
    if let Some(cpu) = &dirs.cpu {
        let quota = files
            .read(&cpu.join("cpu.cfs_quota_us"))
            .and_then(|q| q.trim().parse::<i64>().ok());
        let period = files.read_u64(&cpu.join("cpu.cfs_period_us"));
        reading.cpu_quota = match (quota, period) {
            (Some(q), Some(p)) if q > 0 && p > 0 => Some(CpuQuota {
                quota_usec: q.unsigned_abs(),
                period_usec: p,
            }),
            _ => None,
        };
        if let Some(stat) = files.read(&cpu.join("cpu.stat")) {
            reading.nr_periods = keyed(stat, "nr_periods");
            reading.nr_throttled = keyed(stat, "nr_throttled");
        }
    }
    reading.cpus_allowed = dirs
        .cpuset
        .as_ref()
        .and_then(|dir| {
            match files
                .read(&dir.join("cpuset.effective_cpus"))
                .and_then(count_cpu_list)
            {
                Some(count) => Some(count),
                None => files
                    .read(&dir.join("cpuset.cpus"))
                    .and_then(count_cpu_list),
            }
        })
        .or_else(affinity_cpus);
    reading
}
