//! The files of one scan, kept until the next: paths front-coded in walk order with an 8-byte
//! key of size and mtime each, and the comparison of two such lists.

use std::cmp::Ordering;

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
    pub(super) fn push(&mut self, path: &[u8], key: u64) {
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

    /// Frees what the list grew beyond its contents (once, when its scan is done).
    pub(super) fn shrink(&mut self) {
        self.bytes.shrink_to_fit();
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
pub(super) const EXAMPLES: usize = 5;

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
}
