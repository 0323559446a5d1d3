//! Data paths (`--data`) with the real binary, real files, real bind mounts and a scripted MLflow
//! on loopback: the pre-flight's tags and its refusal, the fingerprint as a dataset input, and
//! the watch tagging a tree that moved or a mount whose flags changed while a command ran.
//! The mount tests need root (this project's machines and CI run as root): without it they
//! fail, they never skip.

mod support;

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::{collector, finish, spawn, wait_for, MockMlflow, Received};

const EXIT: Duration = Duration::from_secs(30);
const WAIT: Duration = Duration::from_secs(30);

/// What the stand-in answers to everything: a `runs/get` answer for a `RUNNING` run whose
/// training is at step 41200 (the collector ignores the bodies of its other calls' answers).
const RUNNING: &str = r#"{"run": {"info": {"run_id": "run-1", "status": "RUNNING", "artifact_uri": "mlflow-artifacts:/1/run-1/artifacts"}, "data": {"metrics": [{"key": "loss", "value": 0.5, "timestamp": 1, "step": 41200}]}}}"#;

fn mlflow_with_a_running_run() -> MockMlflow {
    MockMlflow::start(|_| (200, RUNNING.to_owned()))
}

/// A tree of three files under `<dir>/<name>`.
fn tree(dir: &Path, name: &str) -> PathBuf {
    let root = dir.join(name);
    fs::create_dir_all(root.join("sub")).unwrap();
    for (file, bytes) in [("a.tar", 4), ("b.tar", 2), ("sub/c.tar", 1)] {
        fs::write(root.join(file), vec![b'x'; bytes]).unwrap();
    }
    root
}

/// A command that runs until `marker` exists, then exits with `code`.
fn wait_for_marker(marker: &Path, code: i32) -> Vec<String> {
    vec![
        "sh".into(),
        "-c".into(),
        format!(
            "while [ ! -e '{}' ]; do sleep 0.05; done; exit {code}",
            marker.display()
        ),
    ]
}

fn tag<'a>(tags: &'a HashMap<String, String>, key: &str) -> &'a str {
    tags.get(key)
        .map(String::as_str)
        .unwrap_or_else(|| panic!("no tag {key} in {tags:#?}"))
}

fn inputs(mlflow: &MockMlflow) -> Vec<Received> {
    mlflow
        .accepted()
        .into_iter()
        .filter(|r| r.path == "/api/2.0/mlflow/runs/log-inputs")
        .collect()
}

fn digest(input: &Received) -> String {
    input.body["datasets"][0]["dataset"]["digest"]
        .as_str()
        .unwrap()
        .to_owned()
}

fn run_collector(mlflow: &MockMlflow, flags: &[String], command: &[String]) -> std::process::Child {
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    args.push("--");
    args.extend(command.iter().map(String::as_str));
    spawn(&mut collector(&mlflow.url, &args))
}

#[test]
fn a_data_tree_moved_during_a_wrapped_run_is_tagged_within_one_interval_with_what_vanished() {
    let mlflow = mlflow_with_a_running_run();
    let dir = tempfile::tempdir().unwrap();
    let val = tree(dir.path(), "val");
    let marker = dir.path().join("end");
    let interval = Duration::from_secs(1);
    let child = run_collector(
        &mlflow,
        &[
            "--interval".into(),
            "200ms".into(),
            "--data".into(),
            format!("val={}", val.display()),
            "--data-interval".into(),
            "1s".into(),
        ],
        &wait_for_marker(&marker, 1),
    );
    wait_for("the first fingerprint", WAIT, || {
        mlflow.tags().contains_key("mlscope/data/val/fingerprint")
    });
    let before = mlflow.tags();
    assert_eq!(tag(&before, "mlscope/data/val/files"), "3");
    assert_eq!(tag(&before, "mlscope/data/val/bytes"), "7");
    assert_eq!(tag(&before, "mlscope/data/val/path"), val.to_str().unwrap());
    assert_eq!(tag(&before, "mlscope/rank-0/preflight_run"), "RUNNING");
    assert_eq!(
        tag(&before, "mlscope/rank-0/artifact_root"),
        "through the proxy (mlflow-artifacts:)"
    );

    fs::rename(&val, dir.path().join("val-reorganised")).unwrap();
    let moved = Instant::now();
    wait_for("the change tag", WAIT, || {
        mlflow.tags().contains_key("mlscope/data/val/changed")
    });
    let took = moved.elapsed();
    assert!(
        took <= interval + Duration::from_millis(1000),
        "tagged {took:?} after the move, with a {interval:?} interval"
    );
    let changed = mlflow.tags()["mlscope/data/val/changed"].clone();
    assert!(
        changed.ends_with(
            ", step 41200, rank 0: path gone: 3 vanished, 0 appeared, 0 changed: a.tar, b.tar, sub/c.tar"
        ),
        "{changed}"
    );
    assert!(
        changed.starts_with("20") && changed.contains("Z, step"),
        "{changed}"
    );

    fs::write(&marker, b"").unwrap();
    let (status, _, stderr) = finish(child, EXIT);
    assert_eq!(status.code(), Some(1), "{stderr}");
    let tags = mlflow.tags();
    assert_eq!(tag(&tags, "mlscope/rank-0/outcome"), "exited");
    assert_eq!(
        tag(&tags, "mlscope/rank-0/data_changed_before_exit"),
        format!("val: {changed}")
    );
    assert_eq!(tag(&tags, "mlscope/data/val/history"), changed);
    // The series: 3 files, then 0 once the path was gone.
    let files: Vec<f64> = mlflow
        .samples()
        .iter()
        .filter_map(|s| s.metric("system/rank-0/data_val_files"))
        .collect();
    assert!(
        files.contains(&3.0) && files.last() == Some(&0.0),
        "{files:?}"
    );
}

#[test]
fn the_dataset_inputs_digest_changes_when_a_file_changes_and_not_otherwise() {
    let mlflow = mlflow_with_a_running_run();
    let dir = tempfile::tempdir().unwrap();
    let val = tree(dir.path(), "val");
    let marker = dir.path().join("end");
    let child = run_collector(
        &mlflow,
        &[
            "--data".into(),
            format!("val={}:ro", val.display()),
            "--data-interval".into(),
            "200ms".into(),
        ],
        &wait_for_marker(&marker, 0),
    );
    wait_for("the first dataset input", WAIT, || {
        !inputs(&mlflow).is_empty()
    });
    let first = inputs(&mlflow)[0].clone();
    let dataset = &first.body["datasets"][0];
    assert_eq!(dataset["dataset"]["name"], "val");
    assert_eq!(dataset["dataset"]["source_type"], "local");
    let source: Value =
        serde_json::from_str(dataset["dataset"]["source"].as_str().unwrap()).unwrap();
    assert_eq!(source["uri"], val.to_str().unwrap());
    assert_eq!(dataset["tags"][0]["key"], "mlflow.data.context");
    let d1 = digest(&first);
    assert!(d1.starts_with("sha256:") && d1.len() <= 36, "{d1}");
    assert_eq!(mlflow.tags()["mlscope/data/val/fingerprint"], d1);
    assert_eq!(
        first.headers.get("x-mlscope-rank").map(String::as_str),
        Some("0")
    );

    // Ten rounds of an unchanged tree (reading files changes nothing either): no new input.
    fs::read(val.join("a.tar")).unwrap();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(inputs(&mlflow).len(), 1);
    assert!(!mlflow.tags().contains_key("mlscope/data/val/changed"));

    fs::write(val.join("sub/c.tar"), b"a longer file").unwrap();
    wait_for("a second dataset input", WAIT, || {
        inputs(&mlflow).len() >= 2
    });
    let d2 = digest(&inputs(&mlflow)[1]);
    assert_ne!(d1, d2);
    let tags = mlflow.tags();
    assert_eq!(tags["mlscope/data/val/fingerprint"], d2);
    assert_eq!(tags["mlscope/data/val/bytes"], "19");
    assert!(
        tags["mlscope/data/val/changed"].ends_with("0 vanished, 0 appeared, 1 changed: sub/c.tar"),
        "{tags:?}"
    );
    fs::write(&marker, b"").unwrap();
    let (status, _, stderr) = finish(child, EXIT);
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert_eq!(inputs(&mlflow).len(), 2);
    // A command that succeeded is not blamed on the data.
    assert!(!mlflow
        .tags()
        .contains_key("mlscope/rank-0/data_changed_before_exit"));
}

#[test]
fn a_path_gone_when_the_command_fails_between_two_scans_is_named_in_the_outcome() {
    let mlflow = mlflow_with_a_running_run();
    let dir = tempfile::tempdir().unwrap();
    let val = tree(dir.path(), "val");
    let marker = dir.path().join("end");
    // An hour between scans: only the last look when the command fails can see the move.
    let child = run_collector(
        &mlflow,
        &[
            "--data".into(),
            format!("val={}", val.display()),
            "--data-interval".into(),
            "1h".into(),
        ],
        &wait_for_marker(&marker, 2),
    );
    wait_for("the first fingerprint", WAIT, || {
        mlflow.tags().contains_key("mlscope/data/val/fingerprint")
    });
    fs::remove_dir_all(&val).unwrap();
    fs::write(&marker, b"").unwrap();
    let (status, _, stderr) = finish(child, EXIT);
    assert_eq!(status.code(), Some(2), "{stderr}");
    let tags = mlflow.tags();
    let changed = tag(&tags, "mlscope/data/val/changed");
    assert!(
        changed.ends_with(
            "rank 0: path gone: 3 vanished, 0 appeared, 0 changed: a.tar, b.tar, sub/c.tar"
        ),
        "{changed}"
    );
    assert_eq!(
        tag(&tags, "mlscope/rank-0/data_changed_before_exit"),
        format!("val: {changed}")
    );
}

#[test]
fn in_sidecar_mode_data_paths_are_checked_and_watched_until_sigterm() {
    let mlflow = mlflow_with_a_running_run();
    let dir = tempfile::tempdir().unwrap();
    let val = tree(dir.path(), "val");
    let child = spawn(&mut collector(
        &mlflow.url,
        &[
            "--interval",
            "200ms",
            "--data",
            &format!("val={}", val.display()),
            "--data-interval",
            "200ms",
            "--preflight",
            "enforce",
        ],
    ));
    wait_for("the first fingerprint", WAIT, || {
        mlflow.tags().contains_key("mlscope/data/val/fingerprint")
    });
    fs::write(val.join("d.tar"), b"new").unwrap();
    wait_for("the change", WAIT, || {
        mlflow.tags().contains_key("mlscope/data/val/changed")
    });
    support::sigterm(&child);
    let (status, _, stderr) = finish(child, EXIT);
    assert!(status.success(), "{stderr}");
    let tags = mlflow.tags();
    // A temporary directory is writable: a finding, which sidecar mode tags and logs only.
    assert!(tag(&tags, "mlscope/rank-0/data_val_preflight")
        .starts_with("expected read-only, found writable"));
    assert!(
        stderr.contains("in sidecar mode failed checks are tagged and logged only"),
        "{stderr}"
    );
    assert!(
        tags["mlscope/data/val/changed"].ends_with("0 vanished, 1 appeared, 0 changed: d.tar"),
        "{tags:?}"
    );
    assert_eq!(tags["mlscope/data/val/files"], "4");
    assert!(mlflow
        .samples()
        .iter()
        .any(|s| s.metric("system/rank-0/data_val_files") == Some(4.0)));
}

#[test]
fn preflight_enforce_refuses_a_missing_path_with_its_reason_and_ends_the_run_failed() {
    let mlflow = mlflow_with_a_running_run();
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("val");
    let ran = dir.path().join("ran");
    let child = spawn(
        collector(
            &mlflow.url,
            &[
                "--data",
                &format!("val={}", missing.display()),
                "--preflight",
                "enforce",
                "--",
                "touch",
                ran.to_str().unwrap(),
            ],
        )
        .env("RANK", "2"),
    );
    let (status, _, stderr) = finish(child, EXIT);
    assert_eq!(status.code(), Some(78), "{stderr}");
    assert!(!ran.exists(), "the command must not start");
    let reasons: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("mlscope-collector: pre-flight failed: "))
        .collect();
    assert_eq!(
        reasons,
        [format!(
            "mlscope-collector: pre-flight failed: data val ({0}): missing: {0} does not exist",
            missing.display()
        )],
        "{stderr}"
    );
    let tags = mlflow.tags();
    assert_eq!(tag(&tags, "mlscope/rank-2/outcome"), "preflight_failed");
    assert_eq!(tag(&tags, "mlscope/rank-2/exit_code"), "78");
    assert_eq!(
        tag(&tags, "mlscope/rank-2/data_val_preflight"),
        format!("missing: {} does not exist", missing.display())
    );
    let updates: Vec<Received> = mlflow
        .accepted()
        .into_iter()
        .filter(|r| r.path == "/api/2.0/mlflow/runs/update")
        .collect();
    assert_eq!(updates.len(), 1, "{:?}", mlflow.received());
    assert_eq!(updates[0].body["status"], "FAILED");
    assert_eq!(updates[0].body["run_id"], "run-1");
    // The tags went first: the run is never FAILED without its reason.
    let last = mlflow.received().last().unwrap().path.clone();
    assert_eq!(last, "/api/2.0/mlflow/runs/update");
}

#[test]
fn preflight_warn_starts_the_command_and_tags_what_failed() {
    let mlflow = mlflow_with_a_running_run();
    let dir = tempfile::tempdir().unwrap();
    fs::create_dir(dir.path().join("empty")).unwrap();
    let child = spawn(&mut collector(
        &mlflow.url,
        &[
            "--data",
            &format!("empty={}/empty:rw", dir.path().display()),
            "--",
            "true",
        ],
    ));
    let (status, _, stderr) = finish(child, EXIT);
    assert_eq!(status.code(), Some(0), "{stderr}");
    let tags = mlflow.tags();
    assert_eq!(
        tag(&tags, "mlscope/rank-0/data_empty_preflight"),
        format!("empty: {}/empty has no entries", dir.path().display())
    );
    assert!(tag(&tags, "mlscope/rank-0/data_empty_mount").starts_with("writable: "));
    assert!(mlflow
        .accepted()
        .iter()
        .all(|r| r.path != "/api/2.0/mlflow/runs/update"));
}

// === real mounts ===

/// Bind mounts made for one test, unmounted (in reverse order) when it ends, whatever happens.
struct Mounts(Vec<PathBuf>);

impl Mounts {
    fn run(args: &[&str]) {
        let output = Command::new("mount").args(args).output().unwrap();
        assert!(
            output.status.success(),
            "mount {args:?} failed (these tests need root and mount(8)): {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }

    fn bind(&mut self, source: &Path, target: &Path) {
        fs::create_dir_all(target).unwrap();
        Self::run(&["--bind", source.to_str().unwrap(), target.to_str().unwrap()]);
        self.0.push(target.to_owned());
    }

    /// Read-only per mount: the superblock (the source's file system) stays writable.
    fn read_only(target: &Path) {
        Self::run(&["-o", "remount,bind,ro", target.to_str().unwrap()]);
    }
}

impl Drop for Mounts {
    fn drop(&mut self) {
        for target in self.0.iter().rev() {
            let _ = Command::new("umount").arg(target).status();
        }
    }
}

#[test]
fn a_bind_mount_read_only_per_mount_but_not_per_superblock_and_a_writable_one_are_reported_as_such()
{
    let mlflow = mlflow_with_a_running_run();
    let dir = tempfile::tempdir().unwrap();
    let source = tree(dir.path(), "source");
    let (ro, rw) = (dir.path().join("ro"), dir.path().join("rw"));
    // Declared after `dir`: unmounted before the directory is removed.
    let mut mounts = Mounts(Vec::new());
    mounts.bind(&source, &ro);
    Mounts::read_only(&ro);
    mounts.bind(&source, &rw);
    assert!(
        fs::write(ro.join("probe"), b"").is_err(),
        "the ro bind mount took a write"
    );
    let marker = dir.path().join("end");
    let child = run_collector(
        &mlflow,
        &[
            "--data".into(),
            format!("ro={}", ro.display()),
            "--data".into(),
            format!("rw={}", rw.display()),
            "--data-interval".into(),
            "300ms".into(),
        ],
        &wait_for_marker(&marker, 0),
    );
    wait_for("both fingerprints", WAIT, || {
        let tags = mlflow.tags();
        tags.contains_key("mlscope/data/ro/fingerprint")
            && tags.contains_key("mlscope/data/rw/fingerprint")
    });
    let tags = mlflow.tags();
    assert_eq!(tag(&tags, "mlscope/rank-0/data_ro_preflight"), "ok");
    let ro_mount = tag(&tags, "mlscope/rank-0/data_ro_mount");
    assert!(
        ro_mount.starts_with("read-only: mount ro, superblock rw, statvfs ro; ")
            && ro_mount.ends_with(&format!(" at {}", ro.display())),
        "{ro_mount}"
    );
    let rw_found = tag(&tags, "mlscope/rank-0/data_rw_preflight");
    assert!(
        rw_found.starts_with(
            "expected read-only, found writable: mount rw, superblock rw, statvfs rw; "
        ),
        "{rw_found}"
    );
    assert!(tag(&tags, "mlscope/rank-0/data_rw_mount").starts_with("writable: mount rw, "));
    // Both views of one tree: one fingerprint.
    assert_eq!(
        tags["mlscope/data/ro/fingerprint"],
        tags["mlscope/data/rw/fingerprint"]
    );

    // The writable one turns read-only while the command runs.
    Mounts::read_only(&rw);
    wait_for("the mount change", WAIT, || {
        mlflow.tags().contains_key("mlscope/data/rw/changed")
    });
    let changed = mlflow.tags()["mlscope/data/rw/changed"].clone();
    assert!(
        changed.ends_with(
            "rank 0: mount flags changed: rw → ro (now mount ro, superblock rw, statvfs ro)"
        ),
        "{changed}"
    );
    assert!(!mlflow.tags().contains_key("mlscope/data/ro/changed"));
    fs::write(&marker, b"").unwrap();
    let (status, _, stderr) = finish(child, EXIT);
    assert_eq!(status.code(), Some(0), "{stderr}");
    drop(mounts);
}
