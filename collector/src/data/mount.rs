//! How a data path is mounted as the container sees it: `/proc/self/mountinfo` keeps the
//! per-mount options (field 6) apart from the superblock's (the field after the source), which
//! `/proc/mounts` merges into one `ro`. Field notes §9, "Read-only that is not": a runtime that
//! re-mounts a bind mount `rw` clears the per-mount flag while the share's superblock may still
//! be read-only, or the other way round; only both, and `statvfs`, tell what a write would meet.

use std::ffi::OsString;
use std::io;
use std::os::unix::ffi::OsStringExt;
use std::path::{Component, Path, PathBuf};

/// One line of `/proc/self/mountinfo`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    pub id: u32,
    pub parent: u32,
    /// Where the mount point is, as this process sees it (escapes undone).
    pub point: PathBuf,
    /// The per-mount `ro` flag (field 6).
    pub mount_ro: bool,
    pub fstype: String,
    pub source: String,
    /// The superblock's `ro` flag (the last field).
    pub super_ro: bool,
}

impl Mount {
    /// Read-only for a writer: either flag is enough.
    pub fn read_only(&self) -> bool {
        self.mount_ro || self.super_ro
    }
}

/// Undoes mountinfo's octal escapes (`\040` space, `\011` tab, `\012` newline, `\134` `\`).
pub fn unescape(field: &str) -> OsString {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).filter(|d| {
            bytes[i] == b'\\' && d.iter().all(|b| (b'0'..=b'7').contains(b)) && d[0] <= b'3'
        });
        match octal {
            Some(d) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    OsString::from_vec(out)
}

fn has_ro(options: &str) -> bool {
    options.split(',').any(|o| o == "ro")
}

/// Parses one mountinfo line; `None` for a line that does not have its fields.
pub fn parse_line(line: &str) -> Option<Mount> {
    let mut fields = line.split(' ');
    let id = fields.next()?.parse().ok()?;
    let parent = fields.next()?.parse().ok()?;
    let _device = fields.next()?;
    let _root = fields.next()?;
    let point = PathBuf::from(unescape(fields.next()?));
    let mount_options = fields.next()?;
    // Optional fields (`shared:1`, `master:2`, ...) until the `-` separator.
    fields.by_ref().find(|f| *f == "-")?;
    let fstype = unescape(fields.next()?).to_string_lossy().into_owned();
    let source = unescape(fields.next()?).to_string_lossy().into_owned();
    let super_options = fields.next()?;
    Some(Mount {
        id,
        parent,
        point,
        mount_ro: has_ro(mount_options),
        fstype,
        source,
        super_ro: has_ro(super_options),
    })
}

/// Every mount this process sees, in the file's order.
#[derive(Clone, Debug, Default)]
pub struct MountTable {
    mounts: Vec<Mount>,
}

/// `path` is `point` or below it, compared by components (`/data` does not cover `/database`).
fn covers(point: &Path, path: &Path) -> bool {
    path.starts_with(point)
}

impl MountTable {
    pub fn parse(text: &str) -> Self {
        MountTable {
            mounts: text.lines().filter_map(parse_line).collect(),
        }
    }

    pub fn read() -> io::Result<Self> {
        Ok(Self::parse(&std::fs::read_to_string(
            "/proc/self/mountinfo",
        )?))
    }

    /// The mount a lookup of `path` (absolute, symlinks resolved) ends in. Walks the mount tree
    /// from the root: at each mount, the last of its children whose mount point covers the path
    /// is on top (a mount over `/a` hides an older `/a/b`; a second mount on the same point is
    /// the first one's child). The file's order is not the mount order (a pivoted root comes
    /// after its children), so parent ids decide, not positions.
    pub fn covering(&self, path: &Path) -> Option<&Mount> {
        let ids: std::collections::HashSet<u32> = self.mounts.iter().map(|m| m.id).collect();
        let mut current = self
            .mounts
            .iter()
            .rfind(|m| !ids.contains(&m.parent) && covers(&m.point, path))?;
        loop {
            let next = self
                .mounts
                .iter()
                .rfind(|m| m.parent == current.id && m.id != current.id && covers(&m.point, path));
            match next {
                Some(child) => current = child,
                None => return Some(current),
            }
        }
    }

    /// Mounts visible strictly below `path` whose top mount is `top`: its descendants there.
    pub fn below(&self, top: &Mount, path: &Path) -> Vec<&Mount> {
        let mut found = Vec::new();
        let mut parents = vec![top.id];
        while let Some(parent) = parents.pop() {
            for m in self
                .mounts
                .iter()
                .filter(|m| m.parent == parent && m.id != parent)
            {
                if covers(&m.point, path) && m.point.as_path() != path {
                    // Between the top mount and the path: not below it.
                    continue;
                }
                if covers(path, &m.point) {
                    found.push(m);
                    parents.push(m.id);
                }
            }
        }
        found.sort_by(|a, b| a.point.cmp(&b.point));
        found
    }
}

/// What a data path stands on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountView {
    /// The path as resolved (symlinks followed).
    pub resolved: PathBuf,
    pub mount: Mount,
    /// `statvfs`'s `ST_RDONLY`: what the kernel answers a write with, both flags together.
    pub statvfs_ro: Option<bool>,
    /// Mounts below the path, with whether each is read-only.
    pub below: Vec<(PathBuf, bool)>,
}

/// `path` made absolute and with symlinks resolved as far as it exists (a missing path is
/// looked up at its deepest existing ancestor).
pub fn resolve(path: &Path) -> PathBuf {
    if let Ok(real) = std::fs::canonicalize(path) {
        return real;
    }
    let mut tail = Vec::new();
    let mut at = path;
    while let Some(parent) = at.parent() {
        if let Some(name) = at.file_name() {
            tail.push(name.to_owned());
        }
        at = parent;
        if let Ok(real) = std::fs::canonicalize(at) {
            return tail.iter().rev().fold(real, |p, name| p.join(name));
        }
    }
    path.components()
        .filter(|c| !matches!(c, Component::CurDir))
        .collect()
}

impl MountView {
    /// How `path` is mounted according to `table`; `None` when no mount covers it.
    pub fn of(table: &MountTable, path: &Path) -> Option<MountView> {
        let resolved = resolve(path);
        let mount = table.covering(&resolved)?.clone();
        let below = table
            .below(&mount, &resolved)
            .into_iter()
            .map(|m| (m.point.clone(), m.read_only()))
            .collect();
        let statvfs_ro = nix::sys::statvfs::statvfs(&resolved)
            .ok()
            .map(|st| st.flags().contains(nix::sys::statvfs::FsFlags::ST_RDONLY));
        Some(MountView {
            resolved,
            mount,
            statvfs_ro,
            below,
        })
    }

    /// What a write would meet: `statvfs` when it answered, else the flags.
    pub fn read_only(&self) -> bool {
        self.statvfs_ro.unwrap_or_else(|| self.mount.read_only())
    }

    /// Mounts below the path that a write would not be refused on.
    pub fn writable_below(&self) -> Vec<&Path> {
        self.below
            .iter()
            .filter(|(_, ro)| !ro)
            .map(|(p, _)| p.as_path())
            .collect()
    }

    /// `mount ro, superblock rw, statvfs ro`.
    pub fn flags(&self) -> String {
        let word = |ro: bool| if ro { "ro" } else { "rw" };
        format!(
            "mount {}, superblock {}, statvfs {}",
            word(self.mount.mount_ro),
            word(self.mount.super_ro),
            self.statvfs_ro.map_or("?", word)
        )
    }

    /// `read-only: mount ro, superblock rw, statvfs ro; ext4 /dev/vda at /mnt/x; 2 mounts below,
    /// writable: /mnt/x/cache`.
    pub fn describe(&self) -> String {
        let mut text = format!(
            "{}: {}; {} {} at {}",
            if self.read_only() {
                "read-only"
            } else {
                "writable"
            },
            self.flags(),
            self.mount.fstype,
            self.mount.source,
            self.mount.point.display()
        );
        if !self.below.is_empty() {
            let writable = self.writable_below();
            text.push_str(&format!("; {} mounts below", self.below.len()));
            if writable.is_empty() {
                text.push_str(", all read-only");
            } else {
                let names: Vec<String> = writable.iter().map(|p| p.display().to_string()).collect();
                text.push_str(&format!(", writable: {}", names.join(" ")));
            }
        }
        text
    }

    /// Whether a watch sees no change: the same flags, file system, source and mounts below.
    pub fn same_as(&self, other: &MountView) -> bool {
        (
            self.mount.mount_ro,
            self.mount.super_ro,
            self.statvfs_ro,
            &self.below,
        ) == (
            other.mount.mount_ro,
            other.mount.super_ro,
            other.statvfs_ro,
            &other.below,
        ) && (&self.mount.fstype, &self.mount.source) == (&other.mount.fstype, &other.mount.source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This machine's shape: the pivoted root (27) listed after its children, a bind mount that
    /// is read-only per mount on a writable superblock, a stacked mount, a path with a space.
    const MOUNTINFO: &str = "\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
45 27 254:0 /tmp/a /mnt/ro\\040data ro,relatime shared:1 - ext4 /dev/vda rw,discard
46 27 0:50 / /mnt/nfs rw,relatime - nfs4 10.0.0.1:/share ro,vers=4.1
47 46 0:51 / /mnt/nfs/cache rw - tmpfs tmpfs rw
48 27 0:52 / /mnt/stack rw - tmpfs first rw
49 48 0:53 / /mnt/stack ro - tmpfs second ro
50 27 0:54 / /mnt/a/b rw - tmpfs old rw
51 27 0:55 / /mnt/a rw - tmpfs over rw
";

    #[test]
    fn mountinfo_fields_are_parsed_with_octal_escapes_and_optional_fields() {
        let table = MountTable::parse(MOUNTINFO);
        let ro = table.covering(Path::new("/mnt/ro data/x")).unwrap();
        assert_eq!(ro.id, 45);
        assert_eq!(ro.point, PathBuf::from("/mnt/ro data"));
        assert!(ro.mount_ro && !ro.super_ro && ro.read_only());
        assert_eq!(
            (ro.fstype.as_str(), ro.source.as_str()),
            ("ext4", "/dev/vda")
        );
        assert_eq!(
            unescape(r"a\040b\011c\134d\012"),
            OsString::from("a b\tc\\d\n")
        );
        assert_eq!(unescape(r"\999 \0"), OsString::from(r"\999 \0"));
        assert!(parse_line("1 2 3").is_none());
    }

    #[test]
    fn the_covering_mount_is_found_through_the_tree_not_by_file_order() {
        let table = MountTable::parse(MOUNTINFO);
        let at = |p: &str| table.covering(Path::new(p)).unwrap().id;
        assert_eq!(at("/etc/passwd"), 27);
        assert_eq!(at("/proc/self"), 22);
        // `/mnt/nfsx` is not below `/mnt/nfs`.
        assert_eq!(at("/mnt/nfsx"), 27);
        // The second mount on one point is the first one's child, and on top.
        assert_eq!(at("/mnt/stack/f"), 49);
        // A later mount over `/mnt/a` hides the older `/mnt/a/b`.
        assert_eq!(at("/mnt/a/b/f"), 51);
        let nfs = table.covering(Path::new("/mnt/nfs/train")).unwrap();
        assert!(!nfs.mount_ro && nfs.super_ro && nfs.read_only());
    }

    #[test]
    fn mounts_below_a_path_are_listed_with_their_flags() {
        let table = MountTable::parse(MOUNTINFO);
        let nfs = table.covering(Path::new("/mnt/nfs")).unwrap().clone();
        let below = table.below(&nfs, Path::new("/mnt/nfs"));
        assert_eq!(below.iter().map(|m| m.id).collect::<Vec<_>>(), [47]);
        assert!(table.below(&nfs, Path::new("/mnt/nfs/train")).is_empty());
        let root = table.covering(Path::new("/mnt")).unwrap().clone();
        let ids: Vec<u32> = table
            .below(&root, Path::new("/mnt"))
            .iter()
            .map(|m| m.id)
            .collect();
        // Everything under /mnt, the hidden /mnt/a/b included (it is still a mount there).
        assert_eq!(ids, [51, 50, 46, 47, 45, 48, 49]);
    }

    #[test]
    fn a_view_describes_flags_file_system_and_writable_mounts_below() {
        let view = MountView {
            resolved: PathBuf::from("/mnt/nfs"),
            mount: MountTable::parse(MOUNTINFO)
                .covering(Path::new("/mnt/nfs"))
                .unwrap()
                .clone(),
            statvfs_ro: Some(true),
            below: vec![(PathBuf::from("/mnt/nfs/cache"), false)],
        };
        assert!(view.read_only());
        assert_eq!(
            view.describe(),
            "read-only: mount rw, superblock ro, statvfs ro; nfs4 10.0.0.1:/share at /mnt/nfs; \
             1 mounts below, writable: /mnt/nfs/cache"
        );
    }

    #[test]
    fn this_processs_root_is_found() {
        let table = MountTable::read().unwrap();
        let view = MountView::of(&table, Path::new("/")).unwrap();
        assert_eq!(view.mount.point, PathBuf::from("/"));
        assert!(view.statvfs_ro.is_some());
    }
}
