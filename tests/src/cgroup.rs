//! Child memory cgroups (cgroup v1) for tests that need a real memory limit: a working set
//! measured against it, a process the kernel OOM-kills in it; optionally with a CPU quota too
//! (cpu and cpuacct cgroups at the same path), for a CPU use and throttling measured against it.

use std::fs;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::Duration;

/// Where the v1 hierarchies are mounted.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// The CFS period [`MemoryCgroup::limit_cpu`] sets, in microseconds (the kernel's default).
const CFS_PERIOD_US: u64 = 100_000;

/// A child memory cgroup under this process's own (cgroup v1), removed on drop. Needs root.
pub struct MemoryCgroup {
    pub dir: PathBuf,
    /// The cpu and cpuacct cgroups of [`MemoryCgroup::limit_cpu`].
    cpu_dirs: Vec<PathBuf>,
    /// Directories created above them, parents first: removed after them, when empty.
    created: Vec<PathBuf>,
}

impl MemoryCgroup {
    /// `None` when this machine has no v1 memory controller or the cgroup cannot be created
    /// (not root). The project's machines have both: callers fail, they do not skip.
    pub fn create(name: &str, limit_bytes: u64) -> Option<MemoryCgroup> {
        let own = fs::read_to_string("/proc/self/cgroup").ok()?;
        let path = own.lines().find_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            controllers
                .split(',')
                .any(|c| c == "memory")
                .then(|| path.to_owned())
        })?;
        let parent = Path::new(CGROUP_ROOT)
            .join("memory")
            .join(path.trim_start_matches('/'));
        let dir = parent.join(format!("{name}-{}", std::process::id()));
        if !parent.is_dir() || fs::create_dir(&dir).is_err() {
            return None;
        }
        let cgroup = MemoryCgroup {
            dir,
            cpu_dirs: Vec::new(),
            created: Vec::new(),
        };
        fs::write(
            cgroup.dir.join("memory.limit_in_bytes"),
            limit_bytes.to_string(),
        )
        .expect("setting memory.limit_in_bytes");
        Some(cgroup)
    }

    /// Puts the cgroup's processes under the CPU controllers too: a cpu and a cpuacct cgroup at
    /// the memory cgroup's path below their own hierarchies (where the collector given
    /// `--cgroup-path <dir>` looks for them), with a CFS quota of `cores` (`None`: no quota).
    /// `None` when they cannot be created.
    pub fn limit_cpu(mut self, cores: Option<f64>) -> Option<MemoryCgroup> {
        let relative = self
            .dir
            .strip_prefix(Path::new(CGROUP_ROOT).join("memory"))
            .ok()?
            .to_owned();
        let mut roots: Vec<PathBuf> = Vec::new();
        for controller in ["cpu", "cpuacct"] {
            // `cpu` and `cpuacct` are one hierarchy where they are mounted together.
            let root = fs::canonicalize(Path::new(CGROUP_ROOT).join(controller)).ok()?;
            if !roots.contains(&root) {
                roots.push(root);
            }
        }
        for root in roots {
            let mut at = root.clone();
            for part in relative.components() {
                at.push(part);
                if !at.is_dir() {
                    fs::create_dir(&at).ok()?;
                    self.created.push(at.clone());
                }
            }
            // The leaf is the cgroup itself, removed as such.
            if self.created.last() == Some(&at) {
                self.created.pop();
            }
            self.cpu_dirs.push(at);
        }
        if let Some(cores) = cores {
            let cpu = self
                .cpu_dirs
                .iter()
                .find(|d| d.join("cpu.cfs_quota_us").exists())?;
            fs::write(cpu.join("cpu.cfs_period_us"), CFS_PERIOD_US.to_string()).ok()?;
            let quota = (cores * CFS_PERIOD_US as f64).round() as u64;
            fs::write(cpu.join("cpu.cfs_quota_us"), quota.to_string()).ok()?;
        }
        Some(self)
    }

    /// `sh -c 'echo $$ > cgroup.procs; exec "$@"' sh <program...>`: the program runs inside
    /// (inside the CPU cgroups of [`MemoryCgroup::limit_cpu`] too).
    pub fn run_inside(&self, program: &[&str]) -> Vec<String> {
        let joins: Vec<String> = std::iter::once(&self.dir)
            .chain(&self.cpu_dirs)
            .map(|dir| format!("echo $$ > '{}/cgroup.procs'", dir.display()))
            .collect();
        let mut argv = vec![
            "sh".to_owned(),
            "-c".to_owned(),
            format!("{} && exec \"$@\"", joins.join(" && ")),
            "sh".to_owned(),
        ];
        argv.extend(program.iter().map(|s| (*s).to_owned()));
        argv
    }
}

/// Removes a cgroup directory once the last process in it has gone (exiting ones get a moment).
fn remove_cgroup(dir: &Path) {
    for _ in 0..100 {
        if fs::remove_dir(dir).is_ok() || !dir.exists() {
            return;
        }
        thread::sleep(Duration::from_millis(50));
    }
    eprintln!("could not remove {}", dir.display());
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        remove_cgroup(&self.dir);
        for dir in &self.cpu_dirs {
            remove_cgroup(dir);
        }
        // Parents this cgroup created, deepest first; one another cgroup still uses stays.
        for dir in self.created.iter().rev() {
            let _ = fs::remove_dir(dir);
        }
    }
}
