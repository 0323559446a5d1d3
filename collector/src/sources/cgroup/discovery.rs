//! Finding the container's own cgroup: `/proc/self/cgroup` names a path per hierarchy,
//! `/proc/self/mountinfo` says where each hierarchy is mounted and which part of it (the mount's
//! root) the mount shows. The directory is the mount point joined with the path after that root.
//!
//! Layouts: cgroup v2 alone (`0::<path>`, one `cgroup2` mount), v1 alone (one `cgroup` mount per
//! controller group), and hybrid (v1 controllers plus a `cgroup2` mount that carries none of
//! them, as on this project's machines). The memory controller decides: v2 when the unified
//! hierarchy has it, v1 when a v1 hierarchy has it.

use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};

/// Where the cgroup files of the measured cgroup live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CgroupLayout {
    /// The unified hierarchy: every controller's files in one directory.
    V2 {
        dir: PathBuf,
        /// The mount point: limits are looked up in ancestors up to here.
        mount_point: PathBuf,
    },
    /// One directory per controller; a controller that is not mounted (or whose directory does
    /// not exist) is `None` and its series are omitted.
    V1(V1Dirs),
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct V1Dirs {
    pub memory: Option<PathBuf>,
    pub cpu: Option<PathBuf>,
    pub cpuacct: Option<PathBuf>,
    pub cpuset: Option<PathBuf>,
}

impl CgroupLayout {
    /// A short description for the log line that says what is measured.
    pub fn describe(&self) -> String {
        match self {
            CgroupLayout::V2 { dir, .. } => format!("cgroup v2 at {}", dir.display()),
            CgroupLayout::V1(dirs) => match &dirs.memory {
                Some(memory) => format!("cgroup v1 (memory at {})", memory.display()),
                None => "cgroup v1 without a memory controller".to_owned(),
            },
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("no cgroup hierarchy with a memory or cpu controller is mounted")]
    NoHierarchy,
    #[error("cgroup path {0} was not found under any cgroup mount")]
    NotFound(PathBuf),
}

/// One line of `/proc/<pid>/cgroup`: `hierarchy-id:controller-list:path`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcCgroupLine {
    pub hierarchy_id: u32,
    /// Empty for the unified (v2) hierarchy; named hierarchies keep their `name=` entry.
    pub controllers: Vec<String>,
    pub path: String,
}

pub fn parse_proc_cgroup(text: &str) -> Vec<ProcCgroupLine> {
    text.lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ':');
            let hierarchy_id = parts.next()?.trim().parse().ok()?;
            let controllers = parts.next()?;
            let path = parts.next()?;
            Some(ProcCgroupLine {
                hierarchy_id,
                controllers: controllers
                    .split(',')
                    .filter(|c| !c.is_empty())
                    .map(str::to_owned)
                    .collect(),
                path: path.to_owned(),
            })
        })
        .collect()
}

/// The parts of a `/proc/<pid>/mountinfo` line that cgroup discovery needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountInfo {
    /// The directory of the mounted filesystem that appears at the mount point.
    pub root: String,
    pub mount_point: PathBuf,
    pub fstype: String,
    pub super_options: Vec<String>,
}

/// Parses mountinfo lines (proc(5)): `id parent major:minor root mount-point options
/// [optional fields...] - fstype source super-options`. Paths have spaces and other bytes
/// escaped as `\ooo`.
pub fn parse_mountinfo(text: &str) -> Vec<MountInfo> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let separator = fields.iter().position(|f| *f == "-")?;
            if separator < 6 || fields.len() < separator + 3 {
                return None;
            }
            Some(MountInfo {
                root: unescape(fields[3]),
                mount_point: PathBuf::from(unescape(fields[4])),
                fstype: fields[separator + 1].to_owned(),
                super_options: fields
                    .get(separator + 3)
                    .map(|o| o.split(',').map(str::to_owned).collect())
                    .unwrap_or_default(),
            })
        })
        .collect()
}

fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let value = bytes[i + 1..i + 4]
                .iter()
                .fold(0u32, |acc, b| acc * 8 + u32::from(b - b'0'));
            if let Ok(byte) = u8::try_from(value) {
                out.push(byte);
                i += 4;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The files discovery reads: `<proc_self>/cgroup` and `<proc_self>/mountinfo`, with every mount
/// point taken below `fs_root` (`/` on a real machine, a fixture tree in tests).
#[derive(Clone, Debug)]
pub struct DiscoveryRoots {
    pub proc_self: PathBuf,
    pub fs_root: PathBuf,
}

impl Default for DiscoveryRoots {
    fn default() -> Self {
        DiscoveryRoots {
            proc_self: PathBuf::from("/proc/self"),
            fs_root: PathBuf::from("/"),
        }
    }
}

impl DiscoveryRoots {
    fn under_root(&self, absolute: &Path) -> PathBuf {
        let relative: PathBuf = absolute
            .components()
            .filter(|c| matches!(c, Component::Normal(_)))
            .collect();
        self.fs_root.join(relative)
    }
}

const V1_CONTROLLERS: [&str; 4] = ["memory", "cpu", "cpuacct", "cpuset"];

/// Finds the cgroup to measure: the process's own, or `override_path` — either a directory
/// below a cgroup mount (`/sys/fs/cgroup/memory/kubepods/pod1/c1`) or a path as
/// `/proc/<pid>/cgroup` prints it (`/kubepods/pod1/c1`), joined under every hierarchy.
pub fn discover(
    roots: &DiscoveryRoots,
    override_path: Option<&Path>,
) -> Result<CgroupLayout, DiscoveryError> {
    let read = |name: &str| {
        let path = roots.proc_self.join(name);
        fs::read_to_string(&path).map_err(|source| DiscoveryError::Read { path, source })
    };
    let mounts: Vec<MountInfo> = parse_mountinfo(&read("mountinfo")?)
        .into_iter()
        .filter(|m| m.fstype == "cgroup" || m.fstype == "cgroup2")
        .collect();
    if let Some(path) = override_path {
        if let Some(layout) = layout_for_directory(roots, &mounts, path) {
            return Ok(layout);
        }
    }
    let mut lines = parse_proc_cgroup(&read("cgroup")?);
    if let Some(path) = override_path {
        for line in &mut lines {
            line.path = path.to_string_lossy().into_owned();
        }
    }
    let layout = layout_for_lines(roots, &mounts, &lines);
    match (layout, override_path) {
        (Some(layout), _) => Ok(layout),
        (None, Some(path)) => Err(DiscoveryError::NotFound(path.to_owned())),
        (None, None) => Err(DiscoveryError::NoHierarchy),
    }
}

/// `path` names a directory below one of the cgroup mounts.
fn layout_for_directory(
    roots: &DiscoveryRoots,
    mounts: &[MountInfo],
    path: &Path,
) -> Option<CgroupLayout> {
    let (mount, relative) = mounts
        .iter()
        .filter_map(|m| path.strip_prefix(&m.mount_point).ok().map(|rel| (m, rel)))
        .max_by_key(|(m, _)| m.mount_point.as_os_str().len())?;
    if mount.fstype == "cgroup2" {
        let dir = roots.under_root(path);
        return dir.is_dir().then(|| CgroupLayout::V2 {
            dir,
            mount_point: roots.under_root(&mount.mount_point),
        });
    }
    // The same relative path in every v1 hierarchy; what does not exist there is left out.
    let mut dirs = V1Dirs::default();
    for controller in V1_CONTROLLERS {
        let dir = mounts
            .iter()
            .filter(|m| m.fstype == "cgroup" && m.super_options.iter().any(|o| o == controller))
            .map(|m| roots.under_root(&m.mount_point).join(relative))
            .find(|dir| dir.is_dir());
        set_v1(&mut dirs, controller, dir);
    }
    (dirs.memory.is_some() || dirs.cpuacct.is_some()).then_some(CgroupLayout::V1(dirs))
}

fn layout_for_lines(
    roots: &DiscoveryRoots,
    mounts: &[MountInfo],
    lines: &[ProcCgroupLine],
) -> Option<CgroupLayout> {
    let v2 = lines
        .iter()
        .find(|l| l.hierarchy_id == 0 && l.controllers.is_empty())
        .and_then(|line| {
            mounts
                .iter()
                .filter(|m| m.fstype == "cgroup2")
                .find_map(|m| Some((cgroup_dir(roots, m, &line.path)?, m)))
        })
        .map(|(dir, m)| CgroupLayout::V2 {
            dir,
            mount_point: roots.under_root(&m.mount_point),
        });

    let mut dirs = V1Dirs::default();
    for controller in V1_CONTROLLERS {
        let dir = lines
            .iter()
            .filter(|l| l.controllers.iter().any(|c| c == controller))
            .find_map(|line| {
                mounts
                    .iter()
                    .filter(|m| {
                        m.fstype == "cgroup" && m.super_options.iter().any(|o| o == controller)
                    })
                    .find_map(|m| cgroup_dir(roots, m, &line.path))
            });
        set_v1(&mut dirs, controller, dir);
    }
    let v2_has_memory = match &v2 {
        Some(CgroupLayout::V2 { dir, .. }) => fs::read_to_string(dir.join("cgroup.controllers"))
            .is_ok_and(|c| c.split_whitespace().any(|c| c == "memory")),
        _ => false,
    };
    if v2_has_memory || (dirs.memory.is_none() && dirs.cpuacct.is_none() && v2.is_some()) {
        v2
    } else if dirs.memory.is_some() || dirs.cpuacct.is_some() {
        Some(CgroupLayout::V1(dirs))
    } else {
        None
    }
}

/// The directory of cgroup `path` in mount `m`, when the mount shows it.
fn cgroup_dir(roots: &DiscoveryRoots, m: &MountInfo, path: &str) -> Option<PathBuf> {
    let root = m.root.trim_end_matches('/');
    let relative = if root.is_empty() {
        path
    } else {
        // The mount shows only the subtree at `root`; with a cgroup namespace the path is
        // already relative to it (`/`), without one it starts with it.
        match path.strip_prefix(root) {
            Some(rest) if rest.is_empty() || rest.starts_with('/') => rest,
            _ => path,
        }
    };
    let dir = roots
        .under_root(&m.mount_point)
        .join(relative.trim_start_matches('/'));
    dir.is_dir().then_some(dir)
}

fn set_v1(dirs: &mut V1Dirs, controller: &str, dir: Option<PathBuf>) {
    match controller {
        "memory" => dirs.memory = dir,
        "cpu" => dirs.cpu = dir,
        "cpuacct" => dirs.cpuacct = dir,
        "cpuset" => dirs.cpuset = dir,
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_cgroup_lines_keep_colons_in_paths_and_split_controllers() {
        let lines =
            parse_proc_cgroup("12:cpu,cpuacct:/kubepods/pod1/c1\n1:name=systemd:/x\n0::/a:b\n");
        assert_eq!(lines[0].controllers, ["cpu", "cpuacct"]);
        assert_eq!(lines[0].path, "/kubepods/pod1/c1");
        assert_eq!(lines[1].controllers, ["name=systemd"]);
        assert_eq!(
            lines[2],
            ProcCgroupLine {
                hierarchy_id: 0,
                controllers: vec![],
                path: "/a:b".into()
            }
        );
    }

    #[test]
    fn mountinfo_lines_with_optional_fields_and_escaped_spaces() {
        let text = "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime shared:9 master:2 - cgroup cgroup rw,memory\n\
                    41 31 0:38 /kube\\040pods /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw,nsdelegate\n\
                    garbage line\n";
        let mounts = parse_mountinfo(text);
        assert_eq!(mounts.len(), 2);
        assert_eq!(mounts[0].super_options, ["rw", "memory"]);
        assert_eq!(mounts[0].mount_point, Path::new("/sys/fs/cgroup/memory"));
        assert_eq!(mounts[1].root, "/kube pods");
        assert_eq!(mounts[1].fstype, "cgroup2");
    }
}
