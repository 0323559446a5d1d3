//! cgroup v1 files, one directory per controller.

use super::{affinity_cpus, count_cpu_list, keyed, read_text, read_u64, CgroupReading, CpuQuota, V1Dirs};

/// v1 writes "no limit" as the largest page-aligned `i64` (`9223372036854771712` with 4 KiB
/// pages); anything this large is no limit.
const V1_UNLIMITED: u64 = 1 << 62;

pub(super) fn read(dirs: &V1Dirs) -> CgroupReading {
    let mut reading = CgroupReading::default();
    if let Some(memory) = &dirs.memory {
        let stat = read_text(&memory.join("memory.stat"));
        let stat = stat.as_deref();
        reading.memory_usage = read_u64(&memory.join("memory.usage_in_bytes"));
        reading.inactive_file = stat.and_then(|s| keyed(s, "total_inactive_file").or_else(|| keyed(s, "inactive_file")));
        // `hierarchical_memory_limit` already is the lowest limit up the tree.
        let own = read_u64(&memory.join("memory.limit_in_bytes"));
        let hierarchical = stat.and_then(|s| keyed(s, "hierarchical_memory_limit"));
        reading.memory_limit = [own, hierarchical].into_iter().flatten().filter(|&l| l < V1_UNLIMITED).min();
        reading.memory_peak = read_u64(&memory.join("memory.max_usage_in_bytes"));
        reading.oom_kills = read_text(&memory.join("memory.oom_control")).and_then(|s| keyed(&s, "oom_kill"));
    }
    if let Some(cpuacct) = &dirs.cpuacct {
        reading.cpu_usage_usec = read_u64(&cpuacct.join("cpuacct.usage")).map(|ns| ns / 1000);
    }
    if let Some(cpu) = &dirs.cpu {
        let quota = read_text(&cpu.join("cpu.cfs_quota_us")).and_then(|q| q.trim().parse::<i64>().ok());
        let period = read_u64(&cpu.join("cpu.cfs_period_us"));
        reading.cpu_quota = match (quota, period) {
            (Some(q), Some(p)) if q > 0 && p > 0 => Some(CpuQuota { quota_usec: q.unsigned_abs(), period_usec: p }),
            _ => None,
        };
        let stat = read_text(&cpu.join("cpu.stat"));
        reading.nr_periods = stat.as_deref().and_then(|s| keyed(s, "nr_periods"));
        reading.nr_throttled = stat.as_deref().and_then(|s| keyed(s, "nr_throttled"));
    }
    reading.cpus_allowed = dirs
        .cpuset
        .as_ref()
        .and_then(|dir| read_text(&dir.join("cpuset.effective_cpus")).or_else(|| read_text(&dir.join("cpuset.cpus"))))
        .and_then(|list| count_cpu_list(&list))
        .or_else(affinity_cpus);
    reading
}
