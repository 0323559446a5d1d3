//! `/proc` and cgroup files kept open between samples. Such a file, read again from offset 0,
//! shows current values; keeping it open saves the path lookup, open and close that otherwise
//! dominate a sample's CPU time.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

#[derive(Debug, Default)]
pub struct OpenFiles {
    files: HashMap<PathBuf, File>,
    bytes: Vec<u8>,
}

impl OpenFiles {
    /// The file's whole content now; `None` when it does not exist or cannot be read. A handle
    /// that stopped working (its cgroup was removed and created again) is reopened once.
    pub fn read(&mut self, path: &Path) -> Option<&str> {
        let reused = match self.files.get_mut(path) {
            Some(file) => read_from_start(file, &mut self.bytes).is_ok(),
            None => false,
        };
        if !reused {
            self.files.remove(path);
            let mut file = File::open(path).ok()?;
            read_from_start(&mut file, &mut self.bytes).ok()?;
            self.files.insert(path.to_owned(), file);
        }
        std::str::from_utf8(&self.bytes).ok()
    }

    pub fn read_u64(&mut self, path: &Path) -> Option<u64> {
        self.read(path)?.trim().parse().ok()
    }
}

/// Reads until end of file into `bytes` (cleared first). Plain reads: `File::read_to_end`
/// would ask the size of a file that has none (every /proc and cgroup file reports 0).
fn read_from_start(file: &mut File, bytes: &mut Vec<u8>) -> std::io::Result<()> {
    bytes.clear();
    file.seek(SeekFrom::Start(0))?;
    let mut chunk = [0u8; 4096];
    loop {
        match file.read(&mut chunk)? {
            0 => return Ok(()),
            n => bytes.extend_from_slice(&chunk[..n]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_file_shows_its_current_content_and_a_replaced_one_is_reopened() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory.current");
        std::fs::write(&path, "1\n").unwrap();
        let mut files = OpenFiles::default();
        assert_eq!(files.read_u64(&path), Some(1));
        std::fs::write(&path, "22\n").unwrap();
        assert_eq!(files.read_u64(&path), Some(22));
        std::fs::remove_file(&path).unwrap();
        // The open handle still reads the unlinked file; a new file under the name is found
        // only when the old handle fails, as a removed cgroup's do.
        assert!(files.read(&dir.path().join("missing")).is_none());
    }

    #[test]
    fn proc_files_read_again_show_new_values() {
        let mut files = OpenFiles::default();
        let path = Path::new("/proc/thread-self/schedstat");
        let cpu_ns = |files: &mut OpenFiles| {
            files
                .read(path)
                .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
                .unwrap()
        };
        let before = cpu_ns(&mut files);
        let mut spin = 0u64;
        for i in 0..20_000_000u64 {
            spin = std::hint::black_box(spin ^ i);
        }
        assert!(
            cpu_ns(&mut files) > before,
            "the same handle shows the CPU time just spent"
        );
    }
}
