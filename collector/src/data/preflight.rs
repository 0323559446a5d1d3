//! The checks before the command starts: each data path (exists, readable, not empty, mounted
//! as expected) and the run (exists, `RUNNING`, artifacts through the proxy's gateway). Each
//! answer is a tag; each failed check is one line, which `--preflight enforce` refuses to
//! start the command on.

use std::fs;
use std::io::{self, Read};
use std::path::Path;

use super::mount::{MountTable, MountView};
use super::{cut, rank_tag, run_tag, DataConfig, DataPath, LINE_CHARS};
use crate::outbox::{RunClient, RunLookup};

/// Everything the pre-flight found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Preflight {
    /// Sent before the command starts.
    pub tags: Vec<(String, String)>,
    /// One line per failed check: `data val (/data/val): missing: ...`, `run: ...`.
    pub failures: Vec<String>,
    /// The run was `RUNNING` (so a refused start may end it `FAILED`).
    pub run_running: bool,
}

/// Checks every data path and, with a client, the run.
pub fn preflight(settings: &DataConfig, rank: u32, run: Option<(&RunClient, &str)>) -> Preflight {
    let mut found = Preflight::default();
    if !settings.paths.is_empty() {
        let table = MountTable::read().unwrap_or_else(|error| {
            tracing::warn!(%error, "cannot read /proc/self/mountinfo: mount flags are not checked");
            MountTable::default()
        });
        for data in &settings.paths {
            let check = check_path(data, &table);
            match &check.mount {
                Some(view) => {
                    tracing::info!(data = %data.name, path = %data.path.display(), mount = %view.describe(), "data path pre-flight")
                }
                None => {
                    tracing::info!(data = %data.name, path = %data.path.display(), "data path pre-flight")
                }
            }
            found.tags.extend(check.tags(data, rank));
            found.failures.extend(
                check
                    .failures
                    .iter()
                    .map(|f| format!("data {} ({}): {f}", data.name, data.path.display())),
            );
        }
    }
    if let Some((client, run_id)) = run {
        let lookup = client.get();
        found.run_running = matches!(&lookup, RunLookup::Found(info) if info.status == "RUNNING");
        if let RunLookup::Unavailable(reason) = &lookup {
            tracing::warn!(%reason, "cannot ask MLflow about the run before starting");
        }
        let check = check_run(&lookup, run_id, rank);
        found.tags.extend(check.tags);
        found
            .failures
            .extend(check.failure.map(|f| format!("run: {f}")));
    }
    for failure in &found.failures {
        tracing::warn!(check = %failure, "pre-flight check failed");
    }
    found
}

/// What the pre-flight found about one data path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathCheck {
    pub name: String,
    /// One line per failed check; empty when all passed.
    pub failures: Vec<String>,
    /// How the path is mounted, when it exists.
    pub mount: Option<MountView>,
}

impl PathCheck {
    pub fn ok(&self) -> bool {
        self.failures.is_empty()
    }

    /// `mlscope/data/<name>/path` (run level) and `mlscope/rank-<r>/data_<name>_preflight`
    /// (`ok` or the findings), `..._mount` (how this rank sees it mounted).
    pub fn tags(&self, data: &DataPath, rank: u32) -> Vec<(String, String)> {
        let mut tags = vec![
            (
                run_tag(&data.name, "path"),
                cut(&data.path.to_string_lossy(), LINE_CHARS),
            ),
            (
                rank_tag(rank, &format!("data_{}_preflight", data.name)),
                if self.ok() {
                    "ok".to_owned()
                } else {
                    cut(&self.failures.join("; "), LINE_CHARS)
                },
            ),
        ];
        if let Some(view) = &self.mount {
            tags.push((
                rank_tag(rank, &format!("data_{}_mount", data.name)),
                cut(&view.describe(), LINE_CHARS),
            ));
        }
        tags
    }
}

/// Checks one data path against `table` (the container's `/proc/self/mountinfo`). Reads one
/// directory entry or opens the file for reading; writes nothing.
pub fn check_path(data: &DataPath, table: &MountTable) -> PathCheck {
    let path = &data.path;
    let mut failures = Vec::new();
    let exists = match fs::metadata(path) {
        Ok(meta) => {
            if let Some(problem) = readable_and_not_empty(path, meta.is_dir()) {
                failures.push(problem);
            }
            true
        }
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            failures.push(format!("missing: {} does not exist", path.display()));
            false
        }
        Err(error) => {
            failures.push(format!("not readable: {}: {error}", path.display()));
            false
        }
    };
    let mount = exists.then(|| MountView::of(table, path)).flatten();
    if let Some(view) = &mount {
        let fs = format!("{} {}", view.mount.fstype, view.mount.source);
        match (data.writable, view.read_only()) {
            (false, false) => failures.push(format!(
                "expected read-only, found writable: {}; {fs}",
                view.flags()
            )),
            (true, true) => failures.push(format!(
                "expected writable, found read-only: {}; {fs}",
                view.flags()
            )),
            (false, true) => {
                let writable: Vec<String> = view
                    .writable_below()
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect();
                if !writable.is_empty() {
                    failures.push(format!(
                        "expected read-only, found writable mounts below: {}",
                        writable.join(" ")
                    ));
                }
            }
            (true, false) => {}
        }
    }
    PathCheck {
        name: data.name.clone(),
        failures,
        mount,
    }
}

/// `None` when a directory has an entry or a file a byte; else what is wrong.
fn readable_and_not_empty(path: &Path, is_dir: bool) -> Option<String> {
    if is_dir {
        match fs::read_dir(path) {
            Ok(mut entries) => match entries.next() {
                Some(Ok(_)) => None,
                Some(Err(error)) => Some(format!("not readable: {}: {error}", path.display())),
                None => Some(format!("empty: {} has no entries", path.display())),
            },
            Err(error) => Some(format!("not readable: {}: {error}", path.display())),
        }
    } else {
        let mut byte = [0u8; 1];
        match fs::File::open(path).and_then(|mut f| f.read(&mut byte)) {
            Ok(0) => Some(format!("empty: {} has no bytes", path.display())),
            Ok(_) => None,
            Err(error) => Some(format!("not readable: {}: {error}", path.display())),
        }
    }
}

/// What the pre-flight found about the run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunCheck {
    /// `mlscope/rank-<r>/preflight_run`, `mlscope/rank-<r>/artifact_root`.
    pub tags: Vec<(String, String)>,
    /// Set when MLflow answered that the run cannot take the command's results: it does not
    /// exist, is not `RUNNING`, or the credential is refused. No answer is no failure.
    pub failure: Option<String>,
}

/// Turns `runs/get`'s answer (through the proxy) into the run checks' tags.
pub fn check_run(lookup: &RunLookup, run_id: &str, rank: u32) -> RunCheck {
    let mut tags = Vec::new();
    let (value, failure) = match lookup {
        RunLookup::Found(info) if info.status == "RUNNING" => ("RUNNING".to_owned(), None),
        RunLookup::Found(info) => (
            info.status.clone(),
            Some(format!("run {run_id} is {}, not RUNNING", info.status)),
        ),
        RunLookup::NotFound => (
            "not found".to_owned(),
            Some(format!("run {run_id} does not exist")),
        ),
        RunLookup::Refused(message) => (
            format!("refused: {message}"),
            Some(format!("run {run_id} cannot be read: {message}")),
        ),
        RunLookup::Unavailable(reason) => (format!("unknown: {reason}"), None),
    };
    tags.push((rank_tag(rank, "preflight_run"), cut(&value, LINE_CHARS)));
    if let RunLookup::Found(info) = lookup {
        if !info.artifact_uri.is_empty() {
            tags.push((
                rank_tag(rank, "artifact_root"),
                artifact_root(&info.artifact_uri),
            ));
        }
    }
    RunCheck { tags, failure }
}

/// `through the proxy (mlflow-artifacts:)` when artifacts go through the tracking server's
/// gateway (the proxy serves and sees them); `direct: s3://…` when the client writes straight
/// to a store the proxy never sees.
pub fn artifact_root(uri: &str) -> String {
    if uri.starts_with("mlflow-artifacts:") {
        "through the proxy (mlflow-artifacts:)".to_owned()
    } else {
        cut(&format!("direct: {uri}"), LINE_CHARS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox::RunInfo;

    fn data(name: &str, path: &Path, writable: bool) -> DataPath {
        DataPath {
            name: name.into(),
            path: path.to_owned(),
            writable,
        }
    }

    #[test]
    fn a_missing_an_empty_and_a_full_path_are_told_apart() {
        let dir = tempfile::tempdir().unwrap();
        let table = MountTable::read().unwrap();
        let missing = check_path(&data("m", &dir.path().join("gone"), true), &table);
        assert_eq!(
            missing.failures,
            [format!(
                "missing: {}/gone does not exist",
                dir.path().display()
            )]
        );
        assert!(missing.mount.is_none());
        std::fs::create_dir(dir.path().join("empty")).unwrap();
        let empty = check_path(&data("e", &dir.path().join("empty"), true), &table);
        assert!(
            empty.failures[0].starts_with("empty: "),
            "{:?}",
            empty.failures
        );
        std::fs::write(dir.path().join("empty/f"), b"x").unwrap();
        // Temporary directories are writable: fine for `:rw`, a finding for read-only data.
        let rw = check_path(&data("e", &dir.path().join("empty"), true), &table);
        assert!(rw.ok(), "{:?}", rw.failures);
        assert_eq!(rw.tags(&data("e", Path::new("/x"), true), 2)[1].1, "ok");
        let ro = check_path(&data("e", &dir.path().join("empty"), false), &table);
        assert!(
            ro.failures[0].starts_with(
                "expected read-only, found writable: mount rw, superblock rw, statvfs rw; "
            ),
            "{:?}",
            ro.failures
        );
    }

    #[test]
    fn run_checks_fail_on_a_missing_or_ended_run_but_not_on_silence() {
        let found = |status: &str, uri: &str| {
            RunLookup::Found(RunInfo {
                status: status.into(),
                artifact_uri: uri.into(),
                latest_step: None,
            })
        };
        let running = check_run(&found("RUNNING", "mlflow-artifacts:/1/r/artifacts"), "r", 1);
        assert_eq!(running.failure, None);
        assert_eq!(
            running.tags,
            [
                ("mlscope/rank-1/preflight_run".into(), "RUNNING".into()),
                (
                    "mlscope/rank-1/artifact_root".into(),
                    "through the proxy (mlflow-artifacts:)".into()
                )
            ]
        );
        let direct = check_run(&found("FINISHED", "s3://bucket/1/r/artifacts"), "r", 1);
        assert_eq!(
            direct.failure.as_deref(),
            Some("run r is FINISHED, not RUNNING")
        );
        assert_eq!(direct.tags[1].1, "direct: s3://bucket/1/r/artifacts");
        assert!(check_run(&RunLookup::NotFound, "r", 0).failure.is_some());
        let silent = check_run(&RunLookup::Unavailable("connection refused".into()), "r", 0);
        assert_eq!(silent.failure, None);
        assert_eq!(silent.tags[0].1, "unknown: connection refused");
    }
}
