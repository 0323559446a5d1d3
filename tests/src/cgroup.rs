//! Child memory cgroups (cgroup v1) for tests that need a real memory limit: a working set
//! measured against it, a process the kernel OOM-kills in it.

use std::fs;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::Duration;

/// A child memory cgroup under this process's own (cgroup v1), removed on drop. Needs root.
pub struct MemoryCgroup {
    pub dir: PathBuf,
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
        let parent = Path::new("/sys/fs/cgroup/memory").join(path.trim_start_matches('/'));
        let dir = parent.join(format!("{name}-{}", std::process::id()));
        if !parent.is_dir() || fs::create_dir(&dir).is_err() {
            return None;
        }
        let cgroup = MemoryCgroup { dir };
        fs::write(
            cgroup.dir.join("memory.limit_in_bytes"),
            limit_bytes.to_string(),
        )
        .expect("setting memory.limit_in_bytes");
        Some(cgroup)
    }

    /// `sh -c 'echo $$ > cgroup.procs; exec "$@"' sh <program...>`: the program runs inside.
    pub fn run_inside(&self, program: &[&str]) -> Vec<String> {
        let mut argv = vec![
            "sh".to_owned(),
            "-c".to_owned(),
            format!(
                "echo $$ > '{}/cgroup.procs' && exec \"$@\"",
                self.dir.display()
            ),
            "sh".to_owned(),
        ];
        argv.extend(program.iter().map(|s| (*s).to_owned()));
        argv
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        // rmdir succeeds once the last process in it has gone; give exiting ones a moment.
        for _ in 0..100 {
            if fs::remove_dir(&self.dir).is_ok() || !self.dir.exists() {
                return;
            }
            thread::sleep(Duration::from_millis(50));
        }
        eprintln!("could not remove {}", self.dir.display());
    }
}
