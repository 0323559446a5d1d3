//! Node-wide CPU and memory, computed exactly as psutil computes what MLflow's monitor logs
//! (`psutil.cpu_percent()`, `psutil.virtual_memory().used`), so the numbers match what MLflow
//! users already see — under `node_*` names, because inside a container they describe the node.

use std::borrow::Cow;
use std::path::PathBuf;

use super::files::OpenFiles;
use super::{round1, Named};

/// The aggregate `cpu` line of `/proc/stat`: user, nice, system, idle, iowait, irq, softirq,
/// steal, guest, guest_nice (older kernels have fewer; missing ones are 0).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuTimes(pub [u64; 10]);

const IDLE: usize = 3;
const IOWAIT: usize = 4;
const GUEST: usize = 8;
const GUEST_NICE: usize = 9;

pub fn parse_proc_stat(text: &str) -> Option<CpuTimes> {
    let line = text
        .lines()
        .find(|l| l.split_whitespace().next() == Some("cpu"))?;
    let mut times = [0u64; 10];
    for (slot, field) in times.iter_mut().zip(line.split_whitespace().skip(1)) {
        *slot = field.parse().ok()?;
    }
    Some(CpuTimes(times))
}

/// psutil's `cpu_percent`: per-field deltas (negative ones count as 0); total is their sum less
/// guest and guest_nice (already counted in user and nice); busy is total less idle and iowait.
/// Rounded to one decimal like psutil.
pub fn cpu_percent(before: &CpuTimes, after: &CpuTimes) -> f64 {
    let mut delta = [0u64; 10];
    for (d, (b, a)) in delta.iter_mut().zip(before.0.iter().zip(after.0.iter())) {
        *d = a.saturating_sub(*b);
    }
    let total = delta
        .iter()
        .sum::<u64>()
        .saturating_sub(delta[GUEST] + delta[GUEST_NICE]);
    let busy = total.saturating_sub(delta[IDLE] + delta[IOWAIT]);
    if total == 0 {
        return 0.0;
    }
    round1(busy as f64 / total as f64 * 100.0)
}

/// The `/proc/meminfo` fields psutil uses, in bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemInfo {
    pub total: u64,
    pub free: u64,
    pub available: Option<u64>,
    pub cached: Option<u64>,
    pub active_file: Option<u64>,
    pub inactive_file: Option<u64>,
    pub sreclaimable: Option<u64>,
}

pub fn parse_meminfo(text: &str) -> Option<MemInfo> {
    let mut info = MemInfo::default();
    let (mut total, mut free) = (None, None);
    for line in text.lines() {
        let mut fields = line.split_whitespace();
        let (Some(key), Some(value)) = (fields.next(), fields.next()) else {
            continue;
        };
        let Ok(kib) = value.parse::<u64>() else {
            continue;
        };
        let bytes = kib * 1024;
        match key {
            "MemTotal:" => total = Some(bytes),
            "MemFree:" => free = Some(bytes),
            "MemAvailable:" => info.available = Some(bytes),
            "Cached:" => info.cached = Some(bytes),
            "Active(file):" => info.active_file = Some(bytes),
            "Inactive(file):" => info.inactive_file = Some(bytes),
            "SReclaimable:" => info.sreclaimable = Some(bytes),
            _ => {}
        }
    }
    info.total = total?;
    info.free = free?;
    Some(info)
}

/// psutil's `virtual_memory().used`: total less available. `MemAvailable` when the kernel gives
/// a non-zero one, else psutil's estimate from the zone low watermarks (`low_watermark_bytes`,
/// the sum of `/proc/zoneinfo`'s `low` lines in bytes); an available above total (LXC) means
/// free.
pub fn memory_used(info: &MemInfo, low_watermark_bytes: impl FnOnce() -> Option<u64>) -> u64 {
    let available = match info.available {
        Some(available) if available > 0 => available as f64,
        _ => estimate_available(info, low_watermark_bytes),
    };
    let available = if available < 0.0 {
        0
    } else if available > info.total as f64 {
        info.free
    } else {
        available as u64
    };
    info.total.saturating_sub(available)
}

fn estimate_available(info: &MemInfo, low_watermark_bytes: impl FnOnce() -> Option<u64>) -> f64 {
    let fallback = (info.free + info.cached.unwrap_or(0)) as f64;
    let (Some(active), Some(inactive), Some(reclaimable)) =
        (info.active_file, info.inactive_file, info.sreclaimable)
    else {
        return fallback;
    };
    let Some(low) = low_watermark_bytes() else {
        return fallback;
    };
    let low = low as f64;
    let pagecache = (active + inactive) as f64;
    let reclaimable = reclaimable as f64;
    info.free as f64 - low
        + (pagecache - (pagecache / 2.0).min(low))
        + (reclaimable - (reclaimable / 2.0).min(low))
}

pub fn parse_zoneinfo_low_pages(text: &str) -> u64 {
    text.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            (f.next() == Some("low"))
                .then(|| f.next()?.parse::<u64>().ok())
                .flatten()
        })
        .sum()
}

/// Node CPU and memory from `<proc>/stat`, `<proc>/meminfo` (and `<proc>/zoneinfo` on kernels
/// without `MemAvailable`).
#[derive(Debug)]
pub struct NodeSource {
    stat: PathBuf,
    meminfo: PathBuf,
    zoneinfo: PathBuf,
    files: OpenFiles,
    last_cpu: Option<CpuTimes>,
}

impl NodeSource {
    /// Reads the baseline CPU times, so the first sample covers the time since start.
    pub fn new(proc_root: PathBuf) -> Self {
        let mut source = NodeSource {
            stat: proc_root.join("stat"),
            meminfo: proc_root.join("meminfo"),
            zoneinfo: proc_root.join("zoneinfo"),
            files: OpenFiles::default(),
            last_cpu: None,
        };
        source.last_cpu = source.cpu_times();
        source
    }

    pub fn cpu_times(&mut self) -> Option<CpuTimes> {
        parse_proc_stat(self.files.read(&self.stat)?)
    }

    pub fn meminfo(&mut self) -> Option<MemInfo> {
        parse_meminfo(self.files.read(&self.meminfo)?)
    }

    fn low_watermark_bytes(&mut self) -> Option<u64> {
        let pages = parse_zoneinfo_low_pages(self.files.read(&self.zoneinfo)?);
        let page_size = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
            .ok()
            .flatten()
            .and_then(|p| u64::try_from(p).ok())?;
        Some(pages * page_size)
    }

    pub fn sample(&mut self, out: &mut Vec<Named>) {
        if let Some(now) = self.cpu_times() {
            if let Some(before) = self.last_cpu {
                out.push((
                    Cow::Borrowed("node_cpu_utilization_percentage"),
                    cpu_percent(&before, &now),
                ));
            }
            self.last_cpu = Some(now);
        }
        if let Some(info) = self.meminfo() {
            let used = memory_used(&info, || self.low_watermark_bytes());
            out.push((
                Cow::Borrowed("node_memory_usage_megabytes"),
                round1(used as f64 / 1e6),
            ));
            if info.total > 0 {
                out.push((
                    Cow::Borrowed("node_memory_usage_percentage"),
                    round1(used as f64 / info.total as f64 * 100.0),
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_percent_follows_psutil() {
        let before = parse_proc_stat("cpu  100 10 50 800 20 5 5 0 30 10\ncpu0 1 2 3 4\n").unwrap();
        // +40 user (of which +10 guest), +0 nice, +20 system, +120 idle, +10 iowait, +10 irq.
        let after = parse_proc_stat("cpu  140 10 70 920 30 15 5 0 40 10\n").unwrap();
        // total = 40+20+120+10+10+10(guest) - 10(guest) = 200; busy = 200 - 120 - 10 = 70.
        assert_eq!(cpu_percent(&before, &after), 35.0);
        assert_eq!(cpu_percent(&after, &after), 0.0);
        // A counter going back counts as 0, as in psutil and top.
        let odd = CpuTimes([130, 10, 70, 1000, 30, 15, 5, 0, 40, 10]);
        assert_eq!(cpu_percent(&after, &odd), 0.0);
    }

    #[test]
    fn old_kernels_with_fewer_cpu_fields_parse() {
        assert_eq!(
            parse_proc_stat("cpu 1 2 3 4\n").unwrap().0,
            [1, 2, 3, 4, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(parse_proc_stat("intr 1\n"), None);
    }

    const MEMINFO: &str = "MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    600 kB\nCached:          300 kB\nActive(file):    200 kB\nInactive(file):  100 kB\nSReclaimable:     40 kB\n";

    #[test]
    fn memory_used_is_total_less_available() {
        let info = parse_meminfo(MEMINFO).unwrap();
        assert_eq!(memory_used(&info, || panic!("not needed")), 400 * 1024);
    }

    #[test]
    fn without_mem_available_psutils_estimate_is_used() {
        let info = parse_meminfo(&MEMINFO.replace("MemAvailable:    600", "MemAvailable:      0"))
            .unwrap();
        // free - low + (pagecache - min(pagecache/2, low)) + (sreclaimable - min(sr/2, low))
        let low = 10 * 1024;
        let expected_available = 100 * 1024 - low + (300 * 1024 - low) + (40 * 1024 - low);
        assert_eq!(
            memory_used(&info, || Some(low)),
            1000 * 1024 - expected_available
        );
        // No zoneinfo: free + cached.
        assert_eq!(memory_used(&info, || None), 1000 * 1024 - 400 * 1024);
        assert_eq!(parse_zoneinfo_low_pages("Node 0, zone DMA\n  pages free 3\n        min 1\n        low 4\n        high 5\nNode 0, zone Normal\n        low 6\n"), 10);
    }

    #[test]
    fn available_above_total_means_free() {
        let info = parse_meminfo(&MEMINFO.replace("MemAvailable:    600", "MemAvailable:   5000"))
            .unwrap();
        assert_eq!(memory_used(&info, || None), 900 * 1024);
    }

    #[test]
    fn meminfo_without_total_is_no_reading() {
        assert_eq!(parse_meminfo("MemFree: 1 kB\n"), None);
    }
}
