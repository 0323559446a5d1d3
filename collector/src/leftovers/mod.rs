//! What a wrapped command leaves behind (field-notes §9, "Processes that outlive the rank"):
//! DataLoader workers and multiprocessing children that outlive a killed or finished rank keep
//! their CUDA context and the GPU's memory, and in a container nobody sees them — NVML reports
//! host PIDs, so `nvidia-smi` in the pod lists nothing.
//!
//! In wrapper mode the collector is the child subreaper, so every orphan of the command is
//! re-parented to it. When the command ends, [`Scope::find`] lists what is still alive of it —
//! the collector's descendants, and the container cgroup's processes when the collector is the
//! container's first process — with memory and the GPU device files each holds open (how a
//! container attributes GPU use). [`end`] ends them: SIGTERM, a grace, SIGKILL. The run gets
//! tags that say what was found, what was ended, and what GPU memory was still allocated after.

mod end;
mod proc;

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use end::{end, Ending};
pub use proc::{command_line, descendants, parse_stat, parse_vm_rss, ProcFs, ProcStat};

use crate::sources::cgroup::{discover, CgroupLayout, DiscoveryRoots};
use crate::sources::gpu::GpuMemory;

/// MLflow refuses tag values longer than this (`MAX_TAG_VAL_LENGTH`).
pub const MLFLOW_TAG_VALUE_LIMIT: usize = 8000;

/// The processes the `leftover_processes` tag names, largest resident memory first.
pub const LISTED_IN_TAG: usize = 5;

/// Characters of a command line kept for logs and tags.
pub const COMMAND_CHARS: usize = 60;

/// GPU memory still allocated above this after the leftovers are gone is tagged. A CUDA context
/// alone holds a few hundred MB; NVML's `used` leaves out the driver's own reserve.
pub const GPU_MEMORY_LEFT_THRESHOLD_BYTES: u64 = 100_000_000;

/// How long the GPU memory check waits for the driver to free what ended processes held.
pub const GPU_MEMORY_SETTLE: Duration = Duration::from_secs(3);

/// The longest `--leftover-grace` accepted.
pub const MAX_GRACE: Duration = Duration::from_secs(600);

/// What wrapper mode does about leftover processes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeftoverConfig {
    /// Between SIGTERM and SIGKILL.
    pub grace: Duration,
    /// List and tag them, but end nothing (`--leave-leftovers`).
    pub leave: bool,
    /// An open file whose path starts with this is a GPU device file (`/dev/nvidia`: the GPUs
    /// `/dev/nvidia<N>`, `/dev/nvidiactl`, `/dev/nvidia-uvm`).
    pub device_prefix: PathBuf,
}

impl Default for LeftoverConfig {
    fn default() -> Self {
        LeftoverConfig {
            grace: Duration::from_secs(10),
            leave: false,
            device_prefix: PathBuf::from("/dev/nvidia"),
        }
    }
}

impl LeftoverConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.grace > MAX_GRACE {
            return Err(format!(
                "--leftover-grace must be at most {}",
                humantime::format_duration(MAX_GRACE)
            ));
        }
        if !self.device_prefix.is_absolute() {
            return Err(format!(
                "--gpu-device-prefix must be an absolute path, not {:?}",
                self.device_prefix.display()
            ));
        }
        Ok(())
    }
}

/// How a leftover was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FoundAs {
    /// Its parents lead to the collector (re-parented to it as the subreaper, or below such).
    Descendant,
    /// In the container's cgroup, but not below the collector (e.g. started by `kubectl exec`).
    CgroupMember,
}

/// One process still alive after the wrapped command ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leftover {
    pub pid: i32,
    /// With the pid, names the process (see [`ProcStat::start_time`]).
    pub start_time: u64,
    pub command: String,
    /// `VmRSS`; `None` when it could not be read.
    pub rss_bytes: Option<u64>,
    /// Open files under the GPU device prefix.
    pub devices: Vec<String>,
    pub found_as: FoundAs,
}

impl Leftover {
    /// `4121 python train.py (812 MB, /dev/nvidia0 /dev/nvidiactl)`.
    pub fn describe(&self) -> String {
        let memory = match self.rss_bytes {
            Some(bytes) => format!("{} MB", (bytes as f64 / 1e6).round()),
            None => "? MB".to_owned(),
        };
        if self.devices.is_empty() {
            format!("{} {} ({memory})", self.pid, self.command)
        } else {
            format!(
                "{} {} ({memory}, {})",
                self.pid,
                self.command,
                self.devices.join(" ")
            )
        }
    }
}

// === impl Scope ===

/// Where leftovers are looked for.
#[derive(Clone, Debug)]
pub struct Scope {
    pub proc: ProcFs,
    /// The collector's pid: its descendants are the command's leftovers.
    pub collector: i32,
    /// The container's `cgroup.procs`, when its processes are the rank's (see
    /// [`is_first_process`]).
    pub cgroup_procs: Option<PathBuf>,
    pub device_prefix: PathBuf,
}

impl Scope {
    /// The collector's own: `/proc`, its pid, and its cgroup when it is the container's first
    /// process.
    pub fn of_this_process(device_prefix: &Path) -> Scope {
        let proc = ProcFs::new("/proc");
        let collector = std::process::id() as i32;
        let parent = nix::unistd::getppid().as_raw();
        let cgroup_procs = match discover(&DiscoveryRoots::default(), None) {
            Ok(layout) => match procs_file(&layout) {
                Some(file) => {
                    let members = fs::read_to_string(&file)
                        .map(|text| parse_pids(&text))
                        .unwrap_or_default();
                    if is_first_process(&members, collector, parent) {
                        Some(file)
                    } else {
                        tracing::debug!(file = %file.display(), parent, "the collector's cgroup holds its parent (or not the collector): only its descendants count as leftovers");
                        None
                    }
                }
                None => None,
            },
            Err(error) => {
                tracing::debug!(%error, "no cgroup: only the collector's descendants count as leftovers");
                None
            }
        };
        Scope {
            proc,
            collector,
            cgroup_procs,
            device_prefix: device_prefix.to_owned(),
        }
    }

    /// The live processes that count as leftovers now, each with its `stat`.
    pub fn processes(&self) -> Vec<(ProcStat, FoundAs)> {
        let table = self.proc.all();
        let below = descendants(&table, self.collector);
        let mut found: Vec<(ProcStat, FoundAs)> = table
            .iter()
            .filter(|p| below.binary_search(&p.pid).is_ok() && !p.has_ended())
            .map(|p| (p.clone(), FoundAs::Descendant))
            .collect();
        if let Some(file) = &self.cgroup_procs {
            let members = fs::read_to_string(file)
                .map(|t| parse_pids(&t))
                .unwrap_or_default();
            for pid in members {
                if pid == self.collector || found.iter().any(|(p, _)| p.pid == pid) {
                    continue;
                }
                if let Some(stat) = self.proc.stat(pid).filter(|s| !s.has_ended()) {
                    found.push((stat, FoundAs::CgroupMember));
                }
            }
        }
        found
    }

    /// The leftovers now, described, largest resident memory first.
    pub fn find(&self) -> Vec<Leftover> {
        let mut leftovers: Vec<Leftover> = self
            .processes()
            .into_iter()
            .map(|(stat, found_as)| Leftover {
                pid: stat.pid,
                start_time: stat.start_time,
                command: self.proc.command_line(stat.pid, &stat.comm, COMMAND_CHARS),
                rss_bytes: self.proc.rss_bytes(stat.pid),
                devices: self.proc.open_files_under(stat.pid, &self.device_prefix),
                found_as,
            })
            .collect();
        leftovers.sort_by_key(|l| (std::cmp::Reverse(l.rss_bytes.unwrap_or(0)), l.pid));
        leftovers
    }
}

/// The `cgroup.procs` of a layout: v2's directory, or the first mounted v1 controller's.
pub fn procs_file(layout: &CgroupLayout) -> Option<PathBuf> {
    let dir = match layout {
        CgroupLayout::V2 { dir, .. } => dir,
        CgroupLayout::V1(dirs) => [&dirs.memory, &dirs.cpu, &dirs.cpuacct, &dirs.cpuset]
            .into_iter()
            .flatten()
            .next()?,
    };
    Some(dir.join("cgroup.procs"))
}

/// The pids in a `cgroup.procs` file.
pub fn parse_pids(text: &str) -> Vec<i32> {
    text.lines().filter_map(|l| l.trim().parse().ok()).collect()
}

/// The cgroup's processes are the rank's only when the collector is in it and whoever started
/// the collector is not: the container's entrypoint (parent 0 from inside its pid namespace,
/// or a runtime outside the cgroup). Started from a shell, a CI job or a test, the cgroup also
/// holds that shell and everything beside it, which are not the rank's to end.
pub fn is_first_process(members: &[i32], collector: i32, parent: i32) -> bool {
    members.contains(&collector) && (parent == 0 || !members.contains(&parent))
}

// === tags ===

fn key(rank: u32, name: &str) -> String {
    format!("mlscope/rank-{rank}/{name}")
}

/// `mlscope/rank-<r>/leftover_processes`: the count, then the largest few by resident memory,
/// e.g. `2: 4121 python train.py (812 MB, /dev/nvidia0), 4130 sleep 1000 (1 MB)`.
pub fn listing_tags(rank: u32, leftovers: &[Leftover]) -> Vec<(String, String)> {
    let mut value = leftovers.len().to_string();
    for (i, leftover) in leftovers.iter().take(LISTED_IN_TAG).enumerate() {
        value.push_str(if i == 0 { ": " } else { ", " });
        value.push_str(&leftover.describe());
    }
    if leftovers.len() > LISTED_IN_TAG {
        value.push_str(&format!(", ... {} more", leftovers.len() - LISTED_IN_TAG));
    }
    vec![(
        key(rank, "leftover_processes"),
        proc::truncate(&value, MLFLOW_TAG_VALUE_LIMIT),
    )]
}

/// `mlscope/rank-<r>/leftover_processes_ended`: `2 by SIGTERM, 1 by SIGKILL`, with what could
/// not be ended; `none (--leave-leftovers)` when ending is turned off.
pub fn ended_tags(rank: u32, ending: Option<&Ending>) -> Vec<(String, String)> {
    let value = match ending {
        None => "none (--leave-leftovers)".to_owned(),
        Some(ending) => ending.summary(),
    };
    vec![(key(rank, "leftover_processes_ended"), value)]
}

/// `mlscope/rank-<r>/gpu_<i>_memory_left_megabytes` for each `(index, bytes)`.
pub fn gpu_memory_left_tags(rank: u32, left: &[(u32, u64)]) -> Vec<(String, String)> {
    left.iter()
        .map(|(index, bytes)| {
            (
                key(rank, &format!("gpu_{index}_memory_left_megabytes")),
                crate::sources::round1(*bytes as f64 / 1e6).to_string(),
            )
        })
        .collect()
}

/// The GPUs with more than [`GPU_MEMORY_LEFT_THRESHOLD_BYTES`] allocated, read until none has or
/// `settle` has passed (the driver frees an ended process's memory shortly after it is gone).
pub fn gpu_memory_left(gpus: &dyn GpuMemory, settle: Duration) -> Vec<(u32, u64)> {
    let deadline = Instant::now() + settle;
    loop {
        let left: Vec<(u32, u64)> = gpus
            .allocated_bytes()
            .into_iter()
            .filter(|(_, bytes)| *bytes > GPU_MEMORY_LEFT_THRESHOLD_BYTES)
            .collect();
        if left.is_empty() || Instant::now() >= deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leftover(pid: i32, megabytes: u64, devices: &[&str]) -> Leftover {
        Leftover {
            pid,
            start_time: 1,
            command: format!("python worker-{pid}"),
            rss_bytes: Some(megabytes * 1_000_000),
            devices: devices.iter().map(|d| d.to_string()).collect(),
            found_as: FoundAs::Descendant,
        }
    }

    #[test]
    fn the_listing_tag_counts_and_names_the_largest_with_their_gpu_devices() {
        let tags = listing_tags(
            3,
            &[
                leftover(4121, 812, &["/dev/nvidia0", "/dev/nvidiactl"]),
                leftover(4130, 2, &[]),
            ],
        );
        assert_eq!(
            tags,
            [(
                "mlscope/rank-3/leftover_processes".to_owned(),
                "2: 4121 python worker-4121 (812 MB, /dev/nvidia0 /dev/nvidiactl), 4130 python worker-4130 (2 MB)".to_owned()
            )]
        );
        assert_eq!(listing_tags(0, &[])[0].1, "0");
        let many: Vec<Leftover> = (0..40).map(|i| leftover(100 + i, 1, &[])).collect();
        let value = &listing_tags(0, &many)[0].1;
        assert!(value.starts_with("40: 100 "), "{value}");
        assert!(value.ends_with(", ... 35 more"), "{value}");
    }

    #[test]
    fn the_listing_stays_within_mlflows_tag_value_limit() {
        let mut huge = leftover(1, 1, &[]);
        huge.devices = (0..2000).map(|i| format!("/dev/nvidia{i}")).collect();
        let value = &listing_tags(0, &[huge])[0].1;
        assert_eq!(value.chars().count(), MLFLOW_TAG_VALUE_LIMIT);
        assert!(value.ends_with("..."));
    }

    #[test]
    fn the_cgroup_counts_only_when_the_collector_is_its_first_process() {
        // The container's entrypoint: parent 0 (another pid namespace) or outside the cgroup.
        assert!(is_first_process(&[1, 40, 41], 1, 0));
        assert!(is_first_process(&[7, 8], 7, 3));
        // Started from a shell in the same cgroup, or a cgroup the collector is not in.
        assert!(!is_first_process(&[3, 7, 8], 7, 3));
        assert!(!is_first_process(&[8], 7, 0));
        assert_eq!(parse_pids("12\n 13\n\nx\n"), [12, 13]);
    }

    #[test]
    fn a_v1_layout_reads_the_memory_controllers_procs() {
        let layout = CgroupLayout::V1(crate::sources::cgroup::V1Dirs {
            memory: None,
            cpu: Some("/sys/fs/cgroup/cpu/pod".into()),
            ..Default::default()
        });
        assert_eq!(
            procs_file(&layout),
            Some(PathBuf::from("/sys/fs/cgroup/cpu/pod/cgroup.procs"))
        );
        let v2 = CgroupLayout::V2 {
            dir: "/sys/fs/cgroup/pod".into(),
            mount_point: "/sys/fs/cgroup".into(),
        };
        assert_eq!(
            procs_file(&v2),
            Some(PathBuf::from("/sys/fs/cgroup/pod/cgroup.procs"))
        );
    }

    #[test]
    fn settings_refuse_a_relative_device_prefix_and_an_endless_grace() {
        assert!(LeftoverConfig::default().validate().is_ok());
        let relative = LeftoverConfig {
            device_prefix: "dev/nvidia".into(),
            ..Default::default()
        };
        assert!(relative.validate().is_err());
        let endless = LeftoverConfig {
            grace: Duration::from_secs(3600),
            ..Default::default()
        };
        assert!(endless.validate().is_err());
    }

    /// GPUs whose memory is freed after `frees_after` readings.
    struct FakeGpus {
        readings: std::cell::Cell<u32>,
        frees_after: u32,
    }

    impl GpuMemory for FakeGpus {
        fn allocated_bytes(&self) -> Vec<(u32, u64)> {
            let n = self.readings.get();
            self.readings.set(n + 1);
            let held = if n < self.frees_after {
                2_000_000_000
            } else {
                0
            };
            vec![(0, 5_000_000), (1, held), (2, 812_300_000)]
        }
    }

    #[test]
    fn memory_left_on_a_gpu_is_tagged_once_the_driver_had_time_to_free_it() {
        let gpus = FakeGpus {
            readings: 0.into(),
            frees_after: 2,
        };
        // GPU 1 is freed on the third reading (of about five); GPU 2 keeps its memory; GPU 0 is
        // under the threshold.
        let left = gpu_memory_left(&gpus, Duration::from_millis(500));
        assert_eq!(left, [(2, 812_300_000)]);
        assert_eq!(
            gpu_memory_left_tags(4, &left),
            [(
                "mlscope/rank-4/gpu_2_memory_left_megabytes".to_owned(),
                "812.3".to_owned()
            )]
        );
        // Nothing settles within no time: what is held at the first reading is reported.
        let stuck = FakeGpus {
            readings: 0.into(),
            frees_after: 100,
        };
        assert_eq!(gpu_memory_left(&stuck, Duration::ZERO).len(), 2);
    }

    #[test]
    fn every_tag_key_is_a_valid_mlflow_key() {
        let ending = Ending::default();
        for (key, _) in listing_tags(4095, &[])
            .into_iter()
            .chain(ended_tags(4095, Some(&ending)))
            .chain(ended_tags(4095, None))
            .chain(gpu_memory_left_tags(4095, &[(15, 1)]))
        {
            assert!(mlscope_scopes::is_valid_mlflow_key(&key), "{key}");
        }
    }
}
