//! What `/proc` says about a process: its parent and start time (`stat`), its resident memory
//! (`status`), its command line and the files it holds open (`fd/`). Every read may fail — the
//! process can end between two reads — and a failed read is "unknown", never an error.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

/// The fields of `/proc/<pid>/stat` the collector needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcStat {
    pub pid: i32,
    /// The kernel's short name (`comm`, at most 15 bytes).
    pub comm: String,
    /// `R`, `S`, `D`, `Z`, ...
    pub state: char,
    pub ppid: i32,
    /// Clock ticks after boot: with the pid, it names one process, so a pid reused after the
    /// process ended is told apart.
    pub start_time: u64,
}

impl ProcStat {
    /// A zombie (or a process being torn down) has ended; only its exit status is left.
    pub fn has_ended(&self) -> bool {
        matches!(self.state, 'Z' | 'X' | 'x')
    }
}

/// Parses `/proc/<pid>/stat`: `pid (comm) state ppid ... starttime(22) ...`. The name may hold
/// spaces and parentheses, so it ends at the *last* `)`.
pub fn parse_stat(text: &str) -> Option<ProcStat> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    if close < open {
        return None;
    }
    let pid = text[..open].trim().parse().ok()?;
    let comm = text[open + 1..close].to_owned();
    // Fields from the third on (state is field 3, ppid 4, starttime 22).
    let rest: Vec<&str> = text[close + 1..].split_whitespace().collect();
    let state = rest.first()?.chars().next()?;
    let ppid = rest.get(1)?.parse().ok()?;
    let start_time = rest.get(22 - 3)?.parse().ok()?;
    Some(ProcStat {
        pid,
        comm,
        state,
        ppid,
        start_time,
    })
}

/// `VmRSS` of `/proc/<pid>/status`, in bytes (the file counts kB of 1024 bytes). Kernel threads
/// and zombies have none.
pub fn parse_vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?;
    let kilobytes: u64 = line.split_whitespace().next()?.parse().ok()?;
    Some(kilobytes * 1024)
}

/// A command line for people: `/proc/<pid>/cmdline`'s NUL-separated arguments joined by spaces,
/// at most `max_chars` characters (`...` marks a cut); the kernel's name in brackets when the
/// process has no command line (a kernel thread, a zombie).
pub fn command_line(cmdline: &[u8], comm: &str, max_chars: usize) -> String {
    let joined = String::from_utf8_lossy(cmdline)
        .split('\0')
        .filter(|a| !a.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    let text = if joined.trim().is_empty() {
        format!("[{comm}]")
    } else {
        joined
    };
    truncate(&text, max_chars)
}

/// At most `max_chars` characters, the last three `...` when cut.
pub(super) fn truncate(text: &str, max_chars: usize) -> String {
    if text.chars().count() <= max_chars {
        return text.to_owned();
    }
    let kept: String = text.chars().take(max_chars.saturating_sub(3)).collect();
    format!("{kept}...")
}

/// Reads one `/proc` tree (`/proc` itself, or a fixture in tests).
#[derive(Clone, Debug)]
pub struct ProcFs {
    root: PathBuf,
}

impl ProcFs {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        ProcFs { root: root.into() }
    }

    fn path(&self, pid: i32, file: &str) -> PathBuf {
        self.root.join(pid.to_string()).join(file)
    }

    pub fn stat(&self, pid: i32) -> Option<ProcStat> {
        parse_stat(&fs::read_to_string(self.path(pid, "stat")).ok()?)
    }

    /// Every process (thread-group leader) `/proc` lists now. Threads are not listed at the top
    /// of `/proc`, so the collector's own threads never appear as processes.
    pub fn all(&self) -> Vec<ProcStat> {
        let Ok(entries) = fs::read_dir(&self.root) else {
            return Vec::new();
        };
        entries
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
            .filter_map(|pid| self.stat(pid))
            .collect()
    }

    pub fn rss_bytes(&self, pid: i32) -> Option<u64> {
        parse_vm_rss(&fs::read_to_string(self.path(pid, "status")).ok()?)
    }

    pub fn command_line(&self, pid: i32, comm: &str, max_chars: usize) -> String {
        let cmdline = fs::read(self.path(pid, "cmdline")).unwrap_or_default();
        command_line(&cmdline, comm, max_chars)
    }

    /// The targets of the process's open file descriptors that start with `prefix`, sorted and
    /// without repeats (a CUDA process holds `/dev/nvidiactl`, `/dev/nvidia-uvm` and one
    /// `/dev/nvidia<N>` per GPU it uses, several times each).
    pub fn open_files_under(&self, pid: i32, prefix: &Path) -> Vec<String> {
        let Ok(entries) = fs::read_dir(self.path(pid, "fd")) else {
            return Vec::new();
        };
        let prefix = prefix.to_string_lossy();
        let mut files: Vec<String> = entries
            .filter_map(|e| fs::read_link(e.ok()?.path()).ok())
            .map(|target| target.to_string_lossy().into_owned())
            .filter(|target| target.starts_with(prefix.as_ref()))
            .collect();
        files.sort();
        files.dedup();
        files
    }
}

/// The processes among `table` whose chain of parents leads to `ancestor` (not `ancestor`
/// itself), in pid order. A chain that loops or runs past the table ends the walk.
pub fn descendants(table: &[ProcStat], ancestor: i32) -> Vec<i32> {
    let parents: HashMap<i32, i32> = table.iter().map(|p| (p.pid, p.ppid)).collect();
    let mut found: Vec<i32> = table
        .iter()
        .filter(|p| p.pid != ancestor)
        .filter(|p| {
            let mut current = p.ppid;
            for _ in 0..parents.len() {
                if current == ancestor {
                    return true;
                }
                match parents.get(&current) {
                    Some(&parent) if parent != current => current = parent,
                    _ => return false,
                }
            }
            false
        })
        .map(|p| p.pid)
        .collect();
    found.sort_unstable();
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "4121 (python3 (a) b) S 1 4121 4121 0 -1 4194560 2863 0 0 0 5 2 0 0 20 0 1 0 873456 25100288 2385 18446744073709551615 1 1 0 0 0 0 0 16781312 2 0 0 0 17 3 0 0 0 0 0 0 0 0 0 0 0 0 0\n";

    #[test]
    fn stat_is_read_past_a_name_with_spaces_and_parentheses() {
        assert_eq!(
            parse_stat(STAT),
            Some(ProcStat {
                pid: 4121,
                comm: "python3 (a) b".into(),
                state: 'S',
                ppid: 1,
                start_time: 873456,
            })
        );
        assert!(parse_stat("12 (x) Z 1").is_none(), "too few fields");
        assert!(parse_stat("").is_none());
        let zombie = parse_stat(&STAT.replace(") S 1", ") Z 1")).unwrap();
        assert!(zombie.has_ended());
    }

    #[test]
    fn vm_rss_is_kilobytes_of_1024_bytes() {
        let status =
            "Name:\tpython3\nVmPeak:\t  30000 kB\nVmRSS:\t    9540 kB\nRssAnon:\t 4000 kB\n";
        assert_eq!(parse_vm_rss(status), Some(9540 * 1024));
        assert_eq!(
            parse_vm_rss("Name:\tkthreadd\nState:\tS (sleeping)\n"),
            None
        );
    }

    #[test]
    fn a_command_line_is_joined_cut_and_falls_back_to_the_kernel_name() {
        assert_eq!(
            command_line(b"python3\0train.py\0--lr\x000.1\0", "python3", 80),
            "python3 train.py --lr 0.1"
        );
        assert_eq!(command_line(b"", "kworker/0:1", 80), "[kworker/0:1]");
        assert_eq!(command_line(b"abcdefghij\0", "x", 8), "abcde...");
        assert_eq!(truncate("åäö", 3), "åäö");
    }

    fn stat(pid: i32, ppid: i32) -> ProcStat {
        ProcStat {
            pid,
            comm: "x".into(),
            state: 'S',
            ppid,
            start_time: 1,
        }
    }

    #[test]
    fn descendants_are_every_process_whose_parents_lead_to_the_ancestor() {
        // 10 is the collector: 11 its child, 12 and 13 below 11, 14 re-parented to it; 20 and
        // its child 21 are elsewhere; 30 and 31 are each other's parent.
        let table = [
            stat(1, 0),
            stat(10, 1),
            stat(11, 10),
            stat(12, 11),
            stat(13, 12),
            stat(14, 10),
            stat(20, 1),
            stat(21, 20),
            stat(30, 31),
            stat(31, 30),
        ];
        assert_eq!(descendants(&table, 10), [11, 12, 13, 14]);
        assert_eq!(descendants(&table, 13), Vec::<i32>::new());
        assert_eq!(descendants(&table, 1).len(), 7, "all but 1, 30 and 31");
    }

    #[test]
    fn the_real_proc_shows_this_process_its_memory_and_its_open_files() {
        let proc = ProcFs::new("/proc");
        let me = std::process::id() as i32;
        let stat = proc.stat(me).unwrap();
        assert_eq!(stat.pid, me);
        assert!(proc.rss_bytes(me).unwrap() > 0);
        assert!(proc.all().iter().any(|p| p.pid == me));
        let dir = tempfile::tempdir().unwrap();
        let device = dir.path().join("nvidia0");
        let _open = fs::File::create(&device).unwrap();
        assert_eq!(
            proc.open_files_under(me, &dir.path().join("nvidia")),
            [device.to_string_lossy().into_owned()]
        );
    }
}
