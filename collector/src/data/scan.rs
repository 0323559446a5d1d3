//! A data tree's fingerprint and file list: one walk in a fixed order (each directory's names
//! sorted by bytes), a SHA-256 over every file's (relative path, size, mtime), and a compact
//! list of the same to tell the next walk what vanished, appeared or changed.
//!
//! Nothing is read but directory listings and `stat`: file contents are never opened, and
//! nothing is ever written into the tree.
//!
//! Memory: the list is front-coded — each file costs two varints (the length it shares with the
//! previous path, the length of the rest), the rest of its path, and an 8-byte key of its size
//! and mtime; on the benchmark's tree that is about 20 bytes a file (BENCHMARKS.md). The walk
//! itself holds one directory's sorted names per level.

use std::cmp::Ordering;
use std::ffi::OsStr;
use std::fs::{self, DirEntry, Metadata};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

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
            if cancel.load(AtomicOrdering::Relaxed) {
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

    fn finish(self, stopped: Option<Stopped>, started: Instant) -> Scan {
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

/// The walk's order: by components, i.e. bytes with `/` below every other byte.
fn walk_order(a: &[u8], b: &[u8]) -> Ordering {
    let key = |c: &u8| if *c == b'/' { 0 } else { *c };
    a.iter().map(key).cmp(b.iter().map(key))
}

// === impl FileList ===

/// The files of one scan in walk order, front-coded (see the module's note on memory).
#[derive(Clone, Debug, Default)]
pub struct FileList {
    bytes: Vec<u8>,
    len: u64,
    last: Vec<u8>,
}

fn put_varint(out: &mut Vec<u8>, mut value: usize) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn get_varint(bytes: &[u8], at: &mut usize) -> usize {
    let (mut value, mut shift) = (0usize, 0);
    loop {
        let byte = bytes[*at];
        *at += 1;
        value |= usize::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            return value;
        }
        shift += 7;
    }
}

impl FileList {
    fn push(&mut self, path: &[u8], key: u64) {
        let shared = self
            .last
            .iter()
            .zip(path)
            .take_while(|(a, b)| a == b)
            .count();
        put_varint(&mut self.bytes, shared);
        put_varint(&mut self.bytes, path.len() - shared);
        self.bytes.extend_from_slice(&path[shared..]);
        self.bytes.extend_from_slice(&key.to_le_bytes());
        self.last.truncate(shared);
        self.last.extend_from_slice(&path[shared..]);
        self.len += 1;
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held, for the benchmark's memory figure.
    pub fn heap_bytes(&self) -> usize {
        self.bytes.capacity() + self.last.capacity()
    }

    /// The last path, where a partial scan stopped.
    pub fn last_path(&self) -> &[u8] {
        &self.last
    }

    fn cursor(&self) -> Cursor<'_> {
        Cursor {
            list: self,
            at: 0,
            path: Vec::new(),
        }
    }
}

struct Cursor<'a> {
    list: &'a FileList,
    at: usize,
    path: Vec<u8>,
}

impl Cursor<'_> {
    /// The next path and key; the path is valid until the next call.
    fn next(&mut self) -> Option<(&[u8], u64)> {
        let bytes = &self.list.bytes;
        if self.at >= bytes.len() {
            return None;
        }
        let shared = get_varint(bytes, &mut self.at);
        let rest = get_varint(bytes, &mut self.at);
        self.path.truncate(shared);
        self.path.extend_from_slice(&bytes[self.at..self.at + rest]);
        self.at += rest;
        let key = u64::from_le_bytes(bytes[self.at..self.at + 8].try_into().expect("8 bytes"));
        self.at += 8;
        Some((&self.path, key))
    }
}

// === impl Diff ===

/// What changed between two scans of one path.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Diff {
    pub vanished: u64,
    pub appeared: u64,
    pub changed: u64,
    /// The first few paths of each kind, in walk order.
    pub vanished_paths: Vec<String>,
    pub appeared_paths: Vec<String>,
    pub changed_paths: Vec<String>,
}

/// Paths kept of each kind.
pub const EXAMPLES: usize = 5;

impl Diff {
    pub fn is_empty(&self) -> bool {
        self.vanished + self.appeared + self.changed == 0
    }

    /// Compares `old` with `new`. When either stopped early, only paths up to the earlier stop
    /// are compared: past it, neither scan says what is there.
    pub fn between(old: &FileList, old_partial: bool, new: &FileList, new_partial: bool) -> Diff {
        let limit: Option<Vec<u8>> = match (old_partial, new_partial) {
            (false, false) => None,
            (true, false) => Some(old.last_path().to_vec()),
            (false, true) => Some(new.last_path().to_vec()),
            (true, true) => Some(
                std::cmp::min_by(old.last_path(), new.last_path(), |a, b| walk_order(a, b))
                    .to_vec(),
            ),
        };
        let within = |p: &[u8]| {
            limit
                .as_deref()
                .is_none_or(|l| walk_order(p, l) != Ordering::Greater)
        };
        let mut diff = Diff::default();
        let note = |count: &mut u64, paths: &mut Vec<String>, p: &[u8]| {
            *count += 1;
            if paths.len() < EXAMPLES {
                paths.push(String::from_utf8_lossy(p).into_owned());
            }
        };
        let (mut a, mut b) = (old.cursor(), new.cursor());
        let (mut x, mut y) = (
            a.next().map(|(p, k)| (p.to_vec(), k)),
            b.next().map(|(p, k)| (p.to_vec(), k)),
        );
        loop {
            let order = match (&x, &y) {
                (None, None) => break,
                (Some(_), None) => Ordering::Less,
                (None, Some(_)) => Ordering::Greater,
                (Some((p, _)), Some((q, _))) => walk_order(p, q),
            };
            match order {
                Ordering::Less => {
                    let (p, _) = x.take().expect("present");
                    if within(&p) {
                        note(&mut diff.vanished, &mut diff.vanished_paths, &p);
                    }
                    x = a.next().map(|(p, k)| (p.to_vec(), k));
                }
                Ordering::Greater => {
                    let (q, _) = y.take().expect("present");
                    if within(&q) {
                        note(&mut diff.appeared, &mut diff.appeared_paths, &q);
                    }
                    y = b.next().map(|(p, k)| (p.to_vec(), k));
                }
                Ordering::Equal => {
                    let ((p, k), (_, l)) = (x.take().expect("present"), y.take().expect("present"));
                    if k != l && within(&p) {
                        note(&mut diff.changed, &mut diff.changed_paths, &p);
                    }
                    x = a.next().map(|(p, k)| (p.to_vec(), k));
                    y = b.next().map(|(p, k)| (p.to_vec(), k));
                }
            }
        }
        diff
    }

    /// `3 vanished, 0 appeared, 1 changed: val/a.tar, val/b.tar, val/c.tar, …` — the paths
    /// vanished first, then changed, then appeared, at most [`EXAMPLES`].
    pub fn describe(&self) -> String {
        let mut text = format!(
            "{} vanished, {} appeared, {} changed",
            self.vanished, self.appeared, self.changed
        );
        let shown: Vec<&str> = self
            .vanished_paths
            .iter()
            .chain(&self.changed_paths)
            .chain(&self.appeared_paths)
            .take(EXAMPLES)
            .map(String::as_str)
            .collect();
        if !shown.is_empty() {
            text.push_str(": ");
            text.push_str(&shown.join(", "));
            if (shown.len() as u64) < self.vanished + self.appeared + self.changed {
                text.push_str(", …");
            }
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(paths: &[(&str, u64)]) -> FileList {
        let mut list = FileList::default();
        for (p, k) in paths {
            list.push(p.as_bytes(), *k);
        }
        list
    }

    #[test]
    fn the_front_coded_list_gives_back_every_path_and_key() {
        let paths = [("a/b/c.tar", 1), ("a/b/d.tar", 2), ("a/c", 3), ("b", 4)];
        let l = list(&paths);
        let mut cursor = l.cursor();
        for (p, k) in paths {
            let (q, key) = cursor.next().unwrap();
            assert_eq!((q, key), (p.as_bytes(), k));
        }
        assert!(cursor.next().is_none());
        assert_eq!(l.len(), 4);
        // Shared prefixes are stored once: "a/b/" is not repeated for d.tar.
        assert!(l.bytes.len() < paths.iter().map(|(p, _)| p.len() + 10).sum());
    }

    #[test]
    fn a_diff_names_what_vanished_appeared_and_changed() {
        let old = list(&[("a", 1), ("b/x", 1), ("b/y", 1), ("c", 1)]);
        let new = list(&[("a", 1), ("b/y", 2), ("c", 1), ("d", 1)]);
        let diff = Diff::between(&old, false, &new, false);
        assert_eq!((diff.vanished, diff.appeared, diff.changed), (1, 1, 1));
        assert_eq!(
            diff.describe(),
            "1 vanished, 1 appeared, 1 changed: b/x, b/y, d"
        );
        assert!(Diff::between(&old, false, &old.clone(), false).is_empty());
    }

    #[test]
    fn only_the_first_few_paths_are_named() {
        let old = list(
            &(0..9)
                .map(|i| (["f0", "f1", "f2", "f3", "f4", "f5", "f6", "f7", "f8"][i], 1))
                .collect::<Vec<_>>(),
        );
        let diff = Diff::between(&old, false, &FileList::default(), false);
        assert_eq!(diff.vanished, 9);
        assert_eq!(
            diff.describe(),
            "9 vanished, 0 appeared, 0 changed: f0, f1, f2, f3, f4, …"
        );
    }

    #[test]
    fn the_walk_order_compares_by_components() {
        assert_eq!(walk_order(b"a/x", b"a.txt"), Ordering::Less);
        assert_eq!(walk_order(b"a/x", b"a-b"), Ordering::Less);
        assert_eq!(walk_order(b"a", b"a/x"), Ordering::Less);
    }

    #[test]
    fn partial_scans_are_compared_up_to_the_earlier_stop() {
        let old = list(&[("a", 1), ("b", 1)]);
        let new = list(&[("a", 2), ("b", 1), ("c", 1), ("d", 1)]);
        let diff = Diff::between(&old, true, &new, false);
        assert_eq!((diff.vanished, diff.appeared, diff.changed), (0, 0, 1));
    }

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
}
