//! Filesystem space: the root filesystem (the node partition behind the container's overlay,
//! `rootfs_*`) and each watched volume (`volume_<name>_*`), with psutil's `disk_usage`
//! formulas that MLflow's disk monitor uses.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use super::{round1, Named};

/// What `statvfs` says about a filesystem, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Space {
    pub total: u64,
    /// Free blocks, including those reserved for root.
    pub free_for_root: u64,
    /// Free blocks an unprivileged user may use.
    pub available: u64,
}

impl Space {
    // The statvfs field types are 32 bits wide on some targets.
    #[allow(clippy::useless_conversion)]
    pub fn of(path: &Path) -> Option<Space> {
        let st = nix::sys::statvfs::statvfs(path).ok()?;
        let block = u64::from(st.fragment_size());
        Some(Space {
            total: u64::from(st.blocks()) * block,
            free_for_root: u64::from(st.blocks_free()) * block,
            available: u64::from(st.blocks_available()) * block,
        })
    }

    /// psutil: used = total - free; the percentage is of what a user can have
    /// (used + available), so root's reserve does not count as free.
    pub fn used(&self) -> u64 {
        self.total.saturating_sub(self.free_for_root)
    }

    pub fn used_percentage(&self) -> f64 {
        let user_total = self.used() + self.available;
        if user_total == 0 {
            0.0
        } else {
            round1(self.used() as f64 / user_total as f64 * 100.0)
        }
    }

    /// `(usage_megabytes, usage_percentage, available_megabytes)`, rounded as MLflow rounds.
    pub fn series(&self) -> [f64; 3] {
        [
            round1(self.used() as f64 / 1e6),
            self.used_percentage(),
            round1(self.available as f64 / 1e6),
        ]
    }
}

/// A watched volume: its metric names are resolved once from the scope table.
#[derive(Clone, Debug)]
pub struct WatchedVolume {
    pub name: String,
    pub path: PathBuf,
    names: [String; 3],
}

impl WatchedVolume {
    /// `None` when the scope table does not accept the name.
    pub fn new(name: &str, path: PathBuf) -> Option<Self> {
        let names = ["usage_megabytes", "usage_percentage", "available_megabytes"]
            .map(|suffix| mlscope_scopes::volume_metric_name(name, suffix));
        let [Some(a), Some(b), Some(c)] = names else {
            return None;
        };
        Some(WatchedVolume {
            name: name.to_owned(),
            path,
            names: [a, b, c],
        })
    }
}

#[derive(Debug)]
pub struct DiskSource {
    rootfs: PathBuf,
    volumes: Vec<WatchedVolume>,
    /// Volumes whose path could not be read, so the warning is logged once.
    warned: Vec<bool>,
}

impl DiskSource {
    pub fn new(rootfs: PathBuf, volumes: Vec<WatchedVolume>) -> Self {
        let warned = vec![false; volumes.len()];
        DiskSource {
            rootfs,
            volumes,
            warned,
        }
    }

    pub fn sample(&mut self, out: &mut Vec<Named>) {
        if let Some(space) = Space::of(&self.rootfs) {
            let names = [
                "rootfs_usage_megabytes",
                "rootfs_usage_percentage",
                "rootfs_available_megabytes",
            ];
            out.extend(names.into_iter().map(Cow::Borrowed).zip(space.series()));
        }
        for (volume, warned) in self.volumes.iter().zip(self.warned.iter_mut()) {
            match Space::of(&volume.path) {
                Some(space) => {
                    out.extend(
                        volume
                            .names
                            .iter()
                            .map(|n| Cow::Owned(n.clone()))
                            .zip(space.series()),
                    );
                    *warned = false;
                }
                None if !*warned => {
                    tracing::warn!(volume = %volume.name, path = %volume.path.display(), "cannot statvfs the watched volume; its series are skipped until it can");
                    *warned = true;
                }
                None => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psutil_disk_usage_formulas() {
        // 1000 MB total, 300 MB free of which 50 MB reserved for root.
        let space = Space {
            total: 1_000_000_000,
            free_for_root: 300_000_000,
            available: 250_000_000,
        };
        assert_eq!(space.used(), 700_000_000);
        // 700 / (700 + 250) = 73.68...
        assert_eq!(space.series(), [700.0, 73.7, 250.0]);
        assert_eq!(
            Space {
                total: 0,
                free_for_root: 0,
                available: 0
            }
            .used_percentage(),
            0.0
        );
    }

    #[test]
    fn the_real_root_filesystem_has_space() {
        let space = Space::of(Path::new("/")).expect("statvfs /");
        assert!(
            space.total > 0
                && space.used() <= space.total
                && space.available <= space.free_for_root
        );
    }

    #[test]
    fn volume_names_come_from_the_scope_table() {
        let v = WatchedVolume::new("data", PathBuf::from("/data")).unwrap();
        assert_eq!(
            v.names,
            [
                "volume_data_usage_megabytes",
                "volume_data_usage_percentage",
                "volume_data_available_megabytes"
            ]
        );
        assert!(WatchedVolume::new("", PathBuf::from("/")).is_none());
    }
}
