//! A data tree's fingerprint and file list: one walk in a fixed order (each directory's names
//! sorted by bytes), a SHA-256 over every file's (relative path, size, mtime), and a compact
//! list of the same to tell the next walk what vanished, appeared or changed.
//!
//! Nothing is read but directory listings and `stat`: file contents are never opened, and
//! nothing is ever written into the tree.
//!
//! Memory: the file list ([`FileList`]) is front-coded — each file costs two varints (the length
//! it shares with the previous path, the length of the rest), the rest of its path, and an 8-byte
//! key of its size and mtime (BENCHMARKS.md has the figure on a million files). The walk itself
//! holds one directory's sorted entries per level.

use std::ffi::OsStr;
use std::fs::{self, DirEntry, Metadata};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

pub use super::list::{Diff, FileList};

/// How much one scan may look at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScanBudget {
    pub max_files: u64,
    pub max_time: Duration,
}

/// Why a scan stopped before the end of the tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stopped {
    /// `max_files` files were listed.
    Files,
    /// `max_time` passed.
    Time,
    /// The collector is stopping.
    Cancelled,
}

/// One walk of a data path.
#[derive(Debug)]
pub struct Scan {
    pub files: u64,
    pub bytes: u64,
    pub digest: [u8; 32],
    /// `Some` when the walk stopped early: the digest, counts and list cover the files before.
    pub stopped: Option<Stopped>,
    /// Directories that could not be listed (their files are missing from the scan).
    pub unreadable: u64,
    pub list: FileList,
    pub took: Duration,
}

impl Scan {
    /// `sha256:` and the digest's first 16 hex digits (64 bits: enough to tell versions of one
    /// tree apart, and short enough for MLflow's 36-character dataset digest).
    pub fn fingerprint(&self) -> String {
        let hex: String = self.digest[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        format!("sha256:{hex}")
    }

    /// `sha256:<16 hex>`, with what a partial scan covers and what could not be read.
    pub fn fingerprint_tag(&self, budget: ScanBudget) -> String {
        let mut value = self.fingerprint();
        match self.stopped {
            Some(Stopped::Files) => value.push_str(&format!(
                " (partial: the first {} files, --data-max-files)",
                budget.max_files
            )),
            Some(Stopped::Time) => value.push_str(&format!(
                " (partial: {} files in {}, --data-max-scan-time)",
                self.files,
                humantime::format_duration(budget.max_time)
            )),
            Some(Stopped::Cancelled) | None => {}
        }
        if self.unreadable > 0 {
            value.push_str(&format!(" ({} directories not readable)", self.unreadable));
        }
        value
    }
}

/// Walks `root` within `budget`, logging progress every `progress` (`name` names the path in
/// the log); `cancel` stops it early. An error only when `root` itself cannot be read.
pub fn scan(
    root: &Path,
    budget: ScanBudget,
    cancel: &AtomicBool,
    progress: Duration,
    name: &str,
) -> io::Result<Scan> {
    let started = Instant::now();
    let mut walk = Walk {
        hasher: Sha256::new(),
        list: FileList::default(),
        files: 0,
        bytes: 0,
        unreadable: 0,
    };
    let top = fs::metadata(root)?;
    if !top.is_dir() {
        let name = root
            .file_name()
            .unwrap_or(OsStr::new("."))
            .as_bytes()
            .to_vec();
        walk.record(&name, &top);
        return Ok(walk.finish(None, started));
    }
    let mut stack = vec![Frame::read(root, Vec::new())?];
    let mut next_log = started + progress;
    let stopped = loop {
        let Some(frame) = stack.last_mut() else {
            break None;
        };
        let Some(entry) = frame.entries.get(frame.next) else {
            stack.pop();
            continue;
        };
        frame.next += 1;
        let mut rel = frame.rel.clone();
        rel.extend_from_slice(entry.file_name().as_bytes());
        let kind = entry.file_type();
        if kind.as_ref().is_ok_and(|k| k.is_dir()) {
            rel.push(b'/');
            match Frame::read(&entry.path(), rel) {
                Ok(frame) => stack.push(frame),
                Err(_) => walk.unreadable += 1,
            }
            continue;
        }
        // A symlink counts as what it points to, unless that is a directory (never followed:
        // no cycles) or nothing (then the link itself).
        let meta = match kind {
            Ok(k) if k.is_symlink() => fs::metadata(entry.path())
                .ok()
                .filter(|m| !m.is_dir())
                .map_or_else(|| entry.metadata(), Ok),
            _ => entry.metadata(),
        };
        if let Ok(meta) = meta {
            walk.record(&rel, &meta);
        }
        if walk.files >= budget.max_files {
            break Some(Stopped::Files);
        }
        if walk.files % 1024 == 0 {
            if cancel.load(Ordering::Relaxed) {
                break Some(Stopped::Cancelled);
            }
            let now = Instant::now();
            if now - started >= budget.max_time {
                break Some(Stopped::Time);
            }
            if now >= next_log {
                tracing::info!(
                    data = name,
                    files = walk.files,
                    seconds = (now - started).as_secs(),
                    "scanning the data path"
                );
                next_log = now + progress;
            }
        }
    };
    Ok(walk.finish(stopped, started))
}

struct Walk {
    hasher: Sha256,
    list: FileList,
    files: u64,
    bytes: u64,
    unreadable: u64,
}

impl Walk {
    fn record(&mut self, rel: &[u8], meta: &Metadata) {
        let size = meta.len();
        let mtime_ns = meta.mtime().saturating_mul(1_000_000_000) + meta.mtime_nsec();
        self.hasher.update(rel);
        self.hasher.update([0]);
        self.hasher.update(size.to_le_bytes());
        self.hasher.update(mtime_ns.to_le_bytes());
        self.list.push(rel, meta_key(size, mtime_ns));
        self.files += 1;
        self.bytes += size;
    }

    fn finish(mut self, stopped: Option<Stopped>, started: Instant) -> Scan {
        self.list.shrink();
        Scan {
            files: self.files,
            bytes: self.bytes,
            digest: self.hasher.finalize().into(),
            stopped,
            unreadable: self.unreadable,
            list: self.list,
            took: started.elapsed(),
        }
    }
}

/// One directory being walked: its entries sorted by name, and where the walk is.
struct Frame {
    /// The directory's path relative to the root, with a trailing `/` (empty for the root).
    rel: Vec<u8>,
    entries: Vec<DirEntry>,
    next: usize,
}

impl Frame {
    fn read(dir: &Path, rel: Vec<u8>) -> io::Result<Frame> {
        let mut entries: Vec<DirEntry> = fs::read_dir(dir)?.filter_map(Result::ok).collect();
        entries.sort_by(|a, b| a.file_name().as_bytes().cmp(b.file_name().as_bytes()));
        Ok(Frame {
            rel,
            entries,
            next: 0,
        })
    }
}

/// Size and mtime in one 64-bit key (splitmix64's finaliser): equal files have equal keys; a
/// change goes unseen only on a 2^-64 collision.
fn meta_key(size: u64, mtime_ns: i64) -> u64 {
    fn mix(mut z: u64) -> u64 {
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    mix(size ^ mix(mtime_ns as u64).rotate_left(17))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_real_tree_has_a_digest_that_moves_with_its_files_only() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir_all(dir.path().join("val/sub")).unwrap();
        fs::write(dir.path().join("val/a.tar"), b"aaaa").unwrap();
        fs::write(dir.path().join("val/sub/b.tar"), b"bb").unwrap();
        fs::write(dir.path().join("train.idx"), b"x").unwrap();
        let budget = ScanBudget {
            max_files: 1000,
            max_time: Duration::from_secs(60),
        };
        let run = || {
            scan(
                dir.path(),
                budget,
                &AtomicBool::new(false),
                Duration::from_secs(10),
                "t",
            )
            .unwrap()
        };
        let first = run();
        assert_eq!((first.files, first.bytes, first.stopped), (3, 7, None));
        assert_eq!(run().digest, first.digest);
        assert!(first.fingerprint().starts_with("sha256:") && first.fingerprint().len() == 23);
        fs::write(dir.path().join("val/a.tar"), b"aaaaa").unwrap();
        let second = run();
        assert_ne!(second.digest, first.digest);
        let diff = Diff::between(&first.list, false, &second.list, false);
        assert_eq!(diff.changed_paths, ["val/a.tar"]);
        let partial = scan(
            dir.path(),
            ScanBudget {
                max_files: 2,
                ..budget
            },
            &AtomicBool::new(false),
            Duration::from_secs(10),
            "t",
        )
        .unwrap();
        assert_eq!((partial.files, partial.stopped), (2, Some(Stopped::Files)));
        assert!(scan(
            &dir.path().join("nope"),
            budget,
            &AtomicBool::new(false),
            Duration::from_secs(10),
            "t"
        )
        .is_err());
    }

    #[test]
    fn a_partial_fingerprint_says_what_it_covers() {
        let budget = ScanBudget {
            max_files: 2,
            max_time: Duration::from_secs(60),
        };
        let scan = |stopped, unreadable| Scan {
            files: 2,
            bytes: 10,
            digest: [0xab; 32],
            stopped,
            unreadable,
            list: FileList::default(),
            took: Duration::ZERO,
        };
        assert_eq!(
            scan(None, 0).fingerprint_tag(budget),
            "sha256:abababababababab"
        );
        assert_eq!(
            scan(Some(Stopped::Files), 0).fingerprint_tag(budget),
            "sha256:abababababababab (partial: the first 2 files, --data-max-files)"
        );
        assert_eq!(
            scan(Some(Stopped::Time), 3).fingerprint_tag(budget),
            "sha256:abababababababab (partial: 2 files in 1m, --data-max-scan-time) (3 directories not readable)"
        );
    }
}
