//! What the run stands on (field notes §9, "Data under the training's paths"): the data paths
//! the collector is told about (`--data NAME=PATH`) are checked before the command starts and
//! watched while it runs.
//!
//! - **Pre-flight** ([`preflight`](mod@preflight)): the path exists, is readable and not empty; how it is
//!   mounted as the container sees it ([`mount`]: per-mount and superblock flags, source, file
//!   system, mounts below) and what `statvfs` answers; whether the run exists, is `RUNNING`, and
//!   where its artifacts go. Nothing is ever written into a data path to find out.
//! - **Fingerprint** ([`scan`]): a SHA-256 over every file's (relative path, size, mtime), within
//!   a budget of files and time, logged as the run's dataset input (`runs/log-inputs`) and as
//!   tags, so MLflow's Datasets panel shows a pin that moves when the files do.
//! - **Watch** ([`watch`]): a re-scan every `--data-interval` on a thread of its own at low
//!   priority; a path whose files vanished, appeared or changed, that disappeared, or whose
//!   mount flags changed, is tagged at once, and the wrapped command's outcome says when it
//!   failed after such a change.

mod list;
pub mod mount;
pub mod preflight;
pub mod scan;
pub mod watch;

use std::path::PathBuf;
use std::time::Duration;

pub use preflight::{check_path, check_run, preflight, PathCheck, Preflight, RunCheck};
pub use scan::{Diff, Scan, ScanBudget, Stopped};
pub use watch::{DataWatch, Watcher};

/// The exit status of a wrapper whose `--preflight enforce` refused to start the command
/// (EX_CONFIG from sysexits.h: what it stands on is not as configured).
pub const EXIT_PREFLIGHT: u8 = 78;

/// The outcome tag's value when the pre-flight refused to start the command.
pub const OUTCOME_PREFLIGHT_FAILED: &str = "preflight_failed";

/// Tag values are cut to this many characters (the `changed` line's contract).
pub const LINE_CHARS: usize = 500;

/// Change lines kept in the `history` tag.
pub const HISTORY_LINES: usize = 10;

/// One data path to check and watch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataPath {
    /// `[A-Za-z0-9_-]+`: in tag keys and in `data_<name>_files`.
    pub name: String,
    pub path: PathBuf,
    /// `:rw`: the path is meant to be writable; otherwise it is expected read-only.
    pub writable: bool,
}

/// What a failed check does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PreflightMode {
    /// Log and tag it; start the command anyway.
    #[default]
    Warn,
    /// Wrapper mode: do not start the command, end the run `FAILED`, exit [`EXIT_PREFLIGHT`].
    Enforce,
}

/// The data paths and how they are watched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataConfig {
    pub paths: Vec<DataPath>,
    /// Between the starts of two scans.
    pub interval: Duration,
    pub budget: ScanBudget,
    pub preflight: PreflightMode,
}

/// Five minutes: a scan of a typical data set (thousands of shards) costs milliseconds, one of
/// a million local files about 2.5 s of CPU warm (BENCHMARKS.md), under 1 % of a core at this
/// interval; a path moved mid-run is on the run page minutes after, usually long before the
/// validation pass that would read it. NFS costs a round trip per file: see docs/collector.md.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(300);

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            paths: Vec::new(),
            interval: DEFAULT_INTERVAL,
            budget: ScanBudget {
                max_files: 1_000_000,
                max_time: Duration::from_secs(60),
            },
            preflight: PreflightMode::Warn,
        }
    }
}

impl DataConfig {
    pub fn validate(&self) -> Result<(), String> {
        let mut names = std::collections::HashSet::new();
        for data in &self.paths {
            if !names.insert(&data.name) {
                return Err(format!("data {:?} is given twice", data.name));
            }
        }
        if self.interval < Duration::from_millis(100) || self.interval > Duration::from_secs(86_400)
        {
            return Err("--data-interval must be between 100ms and 24h".to_owned());
        }
        if self.budget.max_files == 0 || self.budget.max_time.is_zero() {
            return Err("--data-max-files and --data-max-scan-time must be more than 0".to_owned());
        }
        Ok(())
    }
}

/// `NAME=PATH`, `NAME=PATH:rw` or `NAME=PATH:ro`, with a name the scope table accepts in
/// `data_<name>_files` and an absolute path.
pub fn parse_data_path(text: &str) -> Result<DataPath, String> {
    let (name, rest) = crate::flags::named(text, "data", |name| {
        mlscope_scopes::data_metric_name(name, "files").is_some()
            && mlscope_scopes::is_valid_mlflow_key(&run_tag(name, "changed"))
    })?;
    let (path, writable) = match (rest.strip_suffix(":rw"), rest.strip_suffix(":ro")) {
        (Some(path), _) => (path, true),
        (_, Some(path)) => (path, false),
        _ => (rest, false),
    };
    let path = crate::flags::absolute("data", path)?;
    Ok(DataPath {
        name: name.to_owned(),
        path,
        writable,
    })
}

/// `mlscope/data/<name>/<fact>`: a run-level fact about a data path, written by any rank.
pub fn run_tag(name: &str, fact: &str) -> String {
    format!("mlscope/data/{name}/{fact}")
}

/// `mlscope/rank-<r>/<fact>`: what one rank saw (mount views differ per node).
pub fn rank_tag(rank: u32, fact: &str) -> String {
    format!("mlscope/rank-{rank}/{fact}")
}

/// `text` cut to `max` characters, with `…` when cut.
pub fn cut(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_owned();
    }
    let mut out: String = text.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn data_paths_are_names_and_absolute_paths_read_only_unless_marked_rw() {
        assert_eq!(
            parse_data_path("val=/data/val"),
            Ok(DataPath {
                name: "val".into(),
                path: PathBuf::from("/data/val"),
                writable: false
            })
        );
        let rw = parse_data_path("cache=/mnt/cache:rw").unwrap();
        assert!(rw.writable && rw.path == Path::new("/mnt/cache"));
        assert!(!parse_data_path("x=/a:b:ro").unwrap().writable);
        assert_eq!(
            parse_data_path("x=/a:b").unwrap().path,
            PathBuf::from("/a:b")
        );
        for bad in ["val", "v/al=/x", "=/x", "val=relative", "val=relative:rw"] {
            assert!(parse_data_path(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn settings_refuse_a_name_twice_and_empty_budgets() {
        let path = |name: &str| parse_data_path(&format!("{name}=/x")).unwrap();
        let mut settings = DataConfig {
            paths: vec![path("a"), path("b")],
            ..DataConfig::default()
        };
        assert!(settings.validate().is_ok());
        settings.paths.push(path("a"));
        assert!(settings.validate().is_err());
        let settings = DataConfig {
            budget: ScanBudget {
                max_files: 0,
                max_time: Duration::from_secs(1),
            },
            ..DataConfig::default()
        };
        assert!(settings.validate().is_err());
    }

    #[test]
    fn tag_keys_are_valid_mlflow_keys_and_lines_are_cut() {
        assert!(mlscope_scopes::is_valid_mlflow_key(&run_tag(
            "train-2",
            "fingerprint"
        )));
        assert_eq!(
            rank_tag(3, "data_val_preflight"),
            "mlscope/rank-3/data_val_preflight"
        );
        assert_eq!(cut("abcdef", 4), "abc…");
        assert_eq!(cut("abc", 4), "abc");
    }
}
