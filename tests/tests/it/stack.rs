//! The harness itself: the stack it starts works, and nothing it starts outlives it.

use std::fs;
use std::process::Command;
use std::time::Duration;

use mlscope_tests::{eventually_blocking, Process, StackOptions, TestStack};

#[tokio::test]
async fn a_stack_stores_mlflow_artifacts_in_its_bucket_and_leaves_nothing_behind() {
    let stack = TestStack::start(StackOptions {
        proxy: false,
        ..StackOptions::default()
    })
    .expect("starting the stack");
    let client = reqwest::Client::builder().no_proxy().build().unwrap();

    let upload = client
        .put(format!(
            "{}/api/2.0/mlflow-artifacts/artifacts/harness/probe.txt",
            stack.mlflow.url
        ))
        .body("stored in SeaweedFS")
        .send()
        .await
        .unwrap();
    assert_eq!(upload.status().as_u16(), 200);
    let listing = client
        .get(format!(
            "{}/{}?list-type=2&prefix=artifacts/harness/",
            stack.s3.url, stack.s3.bucket
        ))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        listing.contains("<Key>artifacts/harness/probe.txt</Key>"),
        "bucket listing: {listing}"
    );

    let groups = [stack.s3.process.pid(), stack.mlflow.process.pid()];
    let dir = stack.dir.path().to_owned();
    assert!(groups.iter().all(|&group| !group_members(group).is_empty()));
    drop(stack);
    for group in groups {
        assert_eq!(
            group_members(group),
            Vec::<u32>::new(),
            "processes left in group {group}"
        );
    }
    assert!(!dir.exists(), "{} is still there", dir.display());
}

#[test]
fn a_dropped_process_takes_its_whole_process_group_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut command = Command::new("sh");
    command.args(["-c", "sleep 300 & sleep 300"]);
    let process = Process::spawn("sleepers", &command, &dir.path().join("sleepers.log")).unwrap();
    let group = process.pid();
    eventually_blocking(
        Duration::from_secs(10),
        "the shell's two sleeps in its process group",
        || {
            let sleeps = group_members(group)
                .into_iter()
                .filter(|pid| {
                    fs::read_to_string(format!("/proc/{pid}/comm"))
                        .is_ok_and(|comm| comm.trim() == "sleep")
                })
                .count();
            if sleeps == 2 {
                Ok(())
            } else {
                Err(format!(
                    "{sleeps} sleeps; members {:?}",
                    group_members(group)
                ))
            }
        },
    );

    drop(process);

    // SIGKILL is delivered asynchronously to the members that are not our children.
    eventually_blocking(
        Duration::from_secs(10),
        format_args!("no process left in group {group}"),
        || match group_members(group) {
            members if members.is_empty() => Ok(()),
            members => Err(format!("{members:?}")),
        },
    );
}

#[test]
fn a_terminated_process_reports_its_own_exit_status() {
    let dir = tempfile::tempdir().unwrap();
    let mut command = Command::new("sh");
    command.args([
        "-c",
        "trap 'exit 3' TERM; echo trapping; while :; do sleep 0.1; done",
    ]);
    let log = dir.path().join("trapper.log");
    let mut process = Process::spawn("trapper", &command, &log).unwrap();
    eventually_blocking(
        Duration::from_secs(10),
        "the shell's trap set",
        || match fs::read_to_string(&log) {
            Ok(text) if text.contains("trapping") => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );

    assert_eq!(process.terminate().code(), Some(3));
}

/// Live processes whose process group is `group` (zombies count as gone).
fn group_members(group: u32) -> Vec<u32> {
    let mut members = Vec::new();
    for entry in fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid pgrp ...; comm may contain spaces, so split after the ')'.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map_or("", |(_, rest)| rest)
            .split_whitespace()
            .collect();
        if fields.first() != Some(&"Z") && fields.get(2) == Some(&group.to_string().as_str()) {
            members.push(pid);
        }
    }
    members
}

// === the quick-start stack (scripts/up runs mlscope-stack) ===

/// `mlscope-stack` in `data_dir` on free ports with a fast demo run; returns the process and the
/// text it printed once it says the stack is up.
fn start_quick_stack(data_dir: &std::path::Path, log: &std::path::Path) -> (Process, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_mlscope-stack"));
    command.arg("--data-dir").arg(data_dir);
    for flag in ["--proxy-port", "--admin-port", "--mlflow-port", "--s3-port"] {
        command.args([flag, &mlscope_tests::free_port().to_string()]);
    }
    command.args(["--demo-interval", "1"]);
    let _ = fs::remove_file(log);
    let mut process = Process::spawn("mlscope-stack", &command, log).unwrap();
    let text = eventually_blocking(Duration::from_secs(180), "mlscope-stack up", || {
        let text = fs::read_to_string(log).unwrap_or_default();
        if text.contains("press Ctrl-C to stop") {
            return Ok(text);
        }
        if let Some(status) = process.try_status() {
            panic!("mlscope-stack exited ({status}) before it came up:\n{text}");
        }
        Err(text)
    });
    (process, text)
}

/// The value printed after `label` on the line that starts with it.
fn printed<'a>(text: &'a str, label: &str) -> &'a str {
    text.lines()
        .find_map(|line| line.strip_prefix(label))
        .unwrap_or_else(|| panic!("no {label:?} line in:\n{text}"))
        .trim()
}

#[test]
fn the_quick_start_stack_keeps_its_runs_and_artifacts_across_a_restart() {
    let data = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("stack.log");
    let client = reqwest::blocking::Client::builder()
        .no_proxy()
        .build()
        .unwrap();

    let (mut first, text) = start_quick_stack(data.path(), &log);
    let demo = printed(&text, "demo run (mlscope-demo):");
    // The run's page: `.../runs/<id>?workflowType=machine_learning` (MLflow's ML view).
    let (page, view) = demo.split_once('?').unwrap_or((demo, ""));
    assert_eq!(view, "workflowType=machine_learning", "{demo}");
    let first_run = page.rsplit('/').next().unwrap().to_owned();
    let proxy = printed(&text, "MLflow UI and API (through mlscope):").to_owned();
    // The collector's samples reach MLflow before the stop.
    eventually_blocking(
        Duration::from_secs(60),
        "a sample of the demo run's collector in MLflow",
        || {
            let run: serde_json::Value = client
                .get(format!("{proxy}/api/2.0/mlflow/runs/get"))
                .query(&[("run_id", &first_run)])
                .send()
                .and_then(|r| r.json())
                .map_err(|e| e.to_string())?;
            let sampled = run["run"]["data"]["metrics"].as_array().is_some_and(|m| {
                m.iter().any(|m| {
                    m["key"]
                        .as_str()
                        .is_some_and(|k| k.starts_with("system/rank-0/"))
                })
            });
            if sampled {
                Ok(())
            } else {
                Err(run.to_string())
            }
        },
    );
    assert_eq!(first.terminate().code(), Some(0), "{}", first.log_tail());

    let (mut second, text) = start_quick_stack(data.path(), &log);
    let mlflow = printed(&text, "MLflow directly:").to_owned();
    let api = |path: &str, query: &[(&str, &str)]| -> serde_json::Value {
        let response = client
            .get(format!("{mlflow}/api/2.0/mlflow/{path}"))
            .query(query)
            .send()
            .unwrap();
        assert!(response.status().is_success(), "{path}: {response:?}");
        response.json().unwrap()
    };
    let run = api("runs/get", &[("run_id", &first_run)]);
    assert_eq!(
        run["run"]["info"]["status"], "FINISHED",
        "stopping the stack ends its demo run: {run}"
    );
    let metrics = run["run"]["data"]["metrics"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(
        metrics.iter().any(|m| m["key"]
            .as_str()
            .is_some_and(|k| k.starts_with("system/rank-0/"))),
        "the collector's samples of the first start are still there: {run}"
    );
    let experiment = api(
        "experiments/get",
        &[(
            "experiment_id",
            run["run"]["info"]["experiment_id"].as_str().unwrap(),
        )],
    );
    let tags = experiment["experiment"]["tags"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(
        tags.iter().any(
            |t| t["key"] == "mlflow.experimentKind" && t["value"] == "custom_model_development"
        ),
        "the demo experiment opens in MLflow's classic ML view: {experiment}"
    );
    // The first start's checkpoint, through the restarted proxy's artifact gateway.
    let checkpoint = client
        .get(format!(
            "{proxy_now}/api/2.0/mlflow-artifacts/artifacts/{}/{first_run}/artifacts/checkpoints/epoch_0.txt",
            run["run"]["info"]["experiment_id"].as_str().unwrap(),
            proxy_now = printed(&text, "MLflow UI and API (through mlscope):"),
        ))
        .send()
        .unwrap();
    assert_eq!(checkpoint.status().as_u16(), 200, "the earlier checkpoint");
    assert_eq!(checkpoint.text().unwrap(), "demo checkpoint\n");
    assert_eq!(second.terminate().code(), Some(0), "{}", second.log_tail());
    assert!(
        !data.path().join("stack.pid").exists(),
        "a stopped stack releases its data directory"
    );
}

/// A directory holding a `cargo` that fails: on `PATH` with an environment that cannot be created
/// (`MLSCOPE_VENV=/nonexistent/venv`), a script that succeeds neither built nor set anything up.
fn failing_cargo() -> tempfile::TempDir {
    let bin = tempfile::tempdir().unwrap();
    let cargo = bin.path().join("cargo");
    fs::write(&cargo, "#!/bin/sh\nexit 99\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&cargo, fs::Permissions::from_mode(0o755)).unwrap();
    bin
}

/// A mistyped option of `scripts/up` is answered in one line, before anything is set up or built
/// (a `cargo` that fails and an environment that cannot be created prove neither ran).
#[test]
fn scripts_up_refuses_a_mistyped_option_before_setup_or_build() {
    let root = mlscope_tests::repo_root();
    let bin = failing_cargo();
    let run = |args: &[&str]| {
        Command::new("bash")
            .arg(root.join("scripts/up"))
            .args(args)
            .env("PATH", format!("{}:/usr/bin:/bin", bin.path().display()))
            .env("MLSCOPE_VENV", "/nonexistent/venv")
            .output()
            .unwrap()
    };
    for (args, says) in [
        (
            &["--prxy-port", "5002"][..],
            "unknown option '--prxy-port'; did you mean '--proxy-port'?",
        ),
        (&["--fresh=yes"][..], "--fresh takes no value"),
        (
            &["--no-demo", "--proxy-port"][..],
            "--proxy-port needs a value",
        ),
        (&["--fresh", "demo"][..], "unexpected argument 'demo'"),
    ] {
        let out = run(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {out:?}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}

#[test]
fn scripts_up_help_answers_at_once_with_the_stacks_options() {
    let root = mlscope_tests::repo_root();
    // A `cargo` that fails and an environment that cannot be created: `--help` succeeds only if
    // it neither builds nor sets anything up.
    let bin = failing_cargo();
    let up = Command::new("bash")
        .arg(root.join("scripts/up"))
        .arg("--help")
        .env("PATH", format!("{}:/usr/bin:/bin", bin.path().display()))
        .env("MLSCOPE_VENV", "/nonexistent/venv")
        .output()
        .unwrap();
    assert!(up.status.success(), "{up:?}");
    let up = String::from_utf8(up.stdout).unwrap();
    let stack = Command::new(env!("CARGO_BIN_EXE_mlscope-stack"))
        .arg("--help")
        .output()
        .unwrap();
    let stack = String::from_utf8(stack.stdout).unwrap();
    // The flags named in the Options section, e.g. `--proxy-arg` of `--proxy-arg=--x`.
    let options = |help: &str| -> std::collections::BTreeSet<String> {
        help.split("Options:")
            .nth(1)
            .unwrap_or_default()
            .split_whitespace()
            .filter(|w| w.starts_with("--") && w.len() > 2)
            .map(|w| {
                w.split('=')
                    .next()
                    .unwrap()
                    .trim_end_matches(|c: char| !c.is_alphanumeric())
                    .to_owned()
            })
            .collect()
    };
    assert_eq!(options(&up), options(&stack), "scripts/up --help:\n{up}");
}
