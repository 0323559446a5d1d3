//! CPU time, disk writes and peak memory of the processes a transfer passes through, from
//! `/proc`.
//!
//! The harness starts every server in a process group of its own (the group id is the server's
//! pid), so counting a server means summing over its group: MLflow's `mlflow server` runs the
//! real server as a uvicorn child, and the watchdog shell of each group does nothing measurable.

use std::fs;
use std::time::Duration;

use crate::artifact::memory::ResidentMemory;

/// The kernel's unit for `utime`/`stime` in `/proc/<pid>/stat` (`USER_HZ`, 100 on every Linux
/// architecture this runs on; `getconf CLK_TCK` prints it).
const TICKS_PER_SECOND: u64 = 100;

/// What a group of processes has used so far. Differences of two snapshots say what happened
/// in between.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Usage {
    /// User plus system CPU time of all threads, in clock ticks.
    pub(crate) cpu_ticks: u64,
    /// `write_bytes` of `/proc/<pid>/io`: bytes the processes caused to be written to a
    /// disk-backed file system (counted when they dirty the page cache, so a temporary file
    /// deleted before writeback still counts; tmpfs does not count).
    pub(crate) write_bytes: u64,
}

impl Usage {
    /// What was used between `earlier` and `self` (zero where a process of `earlier` has exited
    /// and taken its counts along).
    pub(crate) fn since(self, earlier: Usage) -> Usage {
        Usage {
            cpu_ticks: self.cpu_ticks.saturating_sub(earlier.cpu_ticks),
            write_bytes: self.write_bytes.saturating_sub(earlier.write_bytes),
        }
    }

    pub(crate) fn cpu(self) -> Duration {
        Duration::from_millis(self.cpu_ticks * 1_000 / TICKS_PER_SECOND)
    }
}

/// The summed usage of every live process in process group `pgid`, and how many there are.
pub(crate) fn group_usage(pgid: u32) -> (Usage, usize) {
    let mut total = Usage::default();
    let mut members = 0;
    for pid in group_members(pgid) {
        let Some(stat) = read_stat(pid) else {
            continue;
        };
        // A process that exits between the two reads counts with its CPU time only.
        let write_bytes = fs::read_to_string(format!("/proc/{pid}/io"))
            .ok()
            .and_then(|io| parse_write_bytes(&io))
            .unwrap_or(0);
        total.cpu_ticks += stat.cpu_ticks;
        total.write_bytes += write_bytes;
        members += 1;
    }
    (total, members)
}

/// CPU time of this process (all its threads) so far. Its disk writes are not counted: the
/// bench writes only to /dev/shm.
pub(crate) fn own_usage() -> Usage {
    Usage {
        cpu_ticks: read_stat(std::process::id()).map_or(0, |stat| stat.cpu_ticks),
        write_bytes: 0,
    }
}

/// The summed resident set (`VmRSS`) of the processes in group `pgid` now.
pub(crate) fn group_rss(pgid: u32) -> u64 {
    group_members(pgid)
        .into_iter()
        .filter_map(|pid| ResidentMemory::of_process(pid).ok())
        .map(|memory| memory.current)
        .sum()
}

/// The highest peak resident set (`VmHWM`) of any process in group `pgid`: for a server that
/// runs as one process, its peak memory since it started.
pub(crate) fn group_peak_rss(pgid: u32) -> Option<u64> {
    group_members(pgid)
        .into_iter()
        .filter_map(|pid| ResidentMemory::of_process(pid).ok())
        .map(|memory| memory.peak)
        .max()
}

/// Fields of `/proc/<pid>/stat` this module needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stat {
    pgrp: u32,
    cpu_ticks: u64,
}

fn read_stat(pid: u32) -> Option<Stat> {
    parse_stat(&fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

fn group_members(pgid: u32) -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| read_stat(pid).is_some_and(|stat| stat.pgrp == pgid))
        .collect()
}

/// Parses `pid (comm) state ppid pgrp ... utime stime ...`. The command name may hold spaces and
/// parentheses, so fields are counted from the last `)`.
fn parse_stat(stat: &str) -> Option<Stat> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state (field 3 of proc(5)), ppid (4), pgrp (5), ... utime (14), stime (15).
    let field = |number: usize| fields.get(number - 3)?.parse::<u64>().ok();
    Some(Stat {
        pgrp: u32::try_from(field(5)?).ok()?,
        cpu_ticks: field(14)? + field(15)?,
    })
}

fn parse_write_bytes(io: &str) -> Option<u64> {
    io.lines()
        .find_map(|line| line.strip_prefix("write_bytes:"))?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_from_the_end_of_the_command_name() {
        let stat = "4242 (uvicorn (w) 1) S 4200 4199 4199 0 -1 4194560 5000 0 0 0 \
                    250 75 0 0 20 0 9 0 1234 600000000 60000 18446744073709551615";
        assert_eq!(
            parse_stat(stat),
            Some(Stat {
                pgrp: 4199,
                cpu_ticks: 325
            })
        );
        assert_eq!(parse_stat("4242 (truncated"), None);
    }

    #[test]
    fn write_bytes_is_read_from_the_io_accounting() {
        let io = "rchar: 900\nwchar: 1073741824\nsyscr: 10\nsyscw: 1024\nread_bytes: 0\n\
                  write_bytes: 1073745920\ncancelled_write_bytes: 1073741824\n";
        assert_eq!(parse_write_bytes(io), Some(1_073_745_920));
        assert_eq!(parse_write_bytes("rchar: 1\n"), None);
    }

    #[test]
    fn usage_differences_never_go_negative() {
        let before = Usage {
            cpu_ticks: 150,
            write_bytes: 8192,
        };
        let after = Usage {
            cpu_ticks: 400,
            write_bytes: 4096,
        };
        let used = after.since(before);
        assert_eq!(used.write_bytes, 0);
        assert_eq!(used.cpu(), Duration::from_millis(2_500));
    }

    #[test]
    fn this_process_is_found_in_its_own_group() {
        let own = read_stat(std::process::id()).expect("own stat");
        let (_, members) = group_usage(own.pgrp);
        assert!(members >= 1);
        assert!(group_peak_rss(own.pgrp).is_some_and(|peak| peak > 0));
    }
}
