//! Memory use of another process, from `/proc/<pid>/status`.
//!
//! A streaming proxy should hold a few buffers per transfer whatever the object's size; its peak
//! resident set (`VmHWM`, the kernel's high-water mark since the process started) read before and
//! after a 1 GiB transfer shows whether it does.

use std::fmt;

use anyhow::Context as _;

/// Resident memory of a process at one moment, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ResidentMemory {
    /// Highest resident set size since the process started (`VmHWM`).
    pub(crate) peak: u64,
    /// Resident set size now (`VmRSS`).
    pub(crate) current: u64,
}

impl ResidentMemory {
    pub(crate) fn of_process(pid: u32) -> anyhow::Result<ResidentMemory> {
        let path = format!("/proc/{pid}/status");
        let status = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
        parse_status(&status).with_context(|| format!("{path} has no VmHWM/VmRSS lines"))
    }
}

impl fmt::Display for ResidentMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "peak {:.1} MiB, now {:.1} MiB",
            mib(self.peak),
            mib(self.current)
        )
    }
}

/// The process's command name (`/proc/<pid>/comm`), to show the numbers belong to the proxy and
/// not to a wrapper that started it.
pub(crate) fn process_name(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|name| name.trim().to_string())
}

pub(crate) fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 20)
}

fn parse_status(status: &str) -> Option<ResidentMemory> {
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        let kib: u64 = line[name.len()..].split_whitespace().next()?.parse().ok()?;
        Some(kib * 1024)
    };
    Some(ResidentMemory {
        peak: field("VmHWM:")?,
        current: field("VmRSS:")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_and_current_resident_memory_are_read_in_bytes() {
        let status = "Name:\tmlscope-proxy\nVmPeak:\t  900000 kB\nVmHWM:\t   20480 kB\nVmRSS:\t   10240 kB\n";
        assert_eq!(
            parse_status(status),
            Some(ResidentMemory {
                peak: 20 << 20,
                current: 10 << 20
            })
        );
    }

    #[test]
    fn this_process_has_a_readable_status() {
        let memory = ResidentMemory::of_process(std::process::id()).expect("own status");
        assert!(
            memory.peak >= memory.current && memory.current > 0,
            "{memory:?}"
        );
    }
}
