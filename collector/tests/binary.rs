//! The `mlscope-collector` binary against a scripted MLflow stand-in on loopback: what it posts,
//! how it behaves when MLflow fails, signals, exit codes and wrapper mode.

mod support;

use std::collections::BTreeSet;
use std::fs;
use std::time::Duration;

use support::{
    collector, collector_ignoring, finish, sigterm, spawn, venv_python, wait_for, MockMlflow,
};

const EXIT: Duration = Duration::from_secs(20);
const WAIT: Duration = Duration::from_secs(30);

fn stderr_lines_with<'a>(stderr: &'a str, needle: &str) -> Vec<&'a str> {
    stderr.lines().filter(|l| l.contains(needle)).collect()
}

/// Accepted `runs/log-batch` requests (not the pre-flight's `runs/get`), in order.
fn log_batches(mlflow: &MockMlflow) -> Vec<support::Received> {
    mlflow
        .accepted()
        .into_iter()
        .filter(|r| r.path == "/api/2.0/mlflow/runs/log-batch")
        .collect()
}

#[test]
fn help_documents_every_flag_and_mlflow_variable() {
    let output = collector("http://127.0.0.1:1", &["--help"])
        .output()
        .unwrap();
    assert!(output.status.success());
    let help = String::from_utf8(output.stdout).unwrap();
    for word in [
        "--tracking-uri",
        "--run-id",
        "--node",
        "--rank",
        "--interval",
        "--volume",
        "--cgroup-path",
        "--buffer",
        "--flush-timeout",
        "--max-backoff",
        "--request-timeout",
        "--log-format",
        "--log-level",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_RUN_ID",
        "MLFLOW_TRACKING_TOKEN",
        "MLFLOW_TRACKING_USERNAME",
        "MLFLOW_TRACKING_INSECURE_TLS",
        "MLFLOW_TRACKING_SERVER_CERT_PATH",
        "NODE_NAME",
        "MLSCOPE_RANK",
        "OMPI_COMM_WORLD_RANK",
        "MLSCOPE_VOLUMES",
        "MLSCOPE_CGROUP_PATH",
        "MLFLOW_SYSTEM_METRICS_NODE_ID",
        "Wrapper mode",
        "--leftover-grace",
        "MLSCOPE_LEFTOVER_GRACE",
        "--leave-leftovers",
        "MLSCOPE_LEAVE_LEFTOVERS",
        "leftover_processes",
        "--data",
        "MLSCOPE_DATA",
        "--data-interval",
        "MLSCOPE_DATA_INTERVAL",
        "--data-max-files",
        "--data-max-scan-time",
        "--preflight",
        "MLSCOPE_PREFLIGHT",
        "data_<name>_preflight",
        "mlscope/data/<name>/changed",
    ] {
        assert!(
            help.contains(word),
            "--help does not mention {word}:\n{help}"
        );
    }
}

#[test]
fn invalid_settings_exit_64_with_one_line() {
    for (args, env_uri) in [
        (&["--interval", "0"][..], true),
        (&["--volume", "no-equals-sign"][..], true),
        (&["--data", "val=relative/path"][..], true),
        (&["--preflight", "strict"][..], true),
        (&[][..], false),
    ] {
        let mut command = collector("http://127.0.0.1:1", args);
        if !env_uri {
            command.env_remove("MLFLOW_TRACKING_URI");
        }
        let output = command.output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(64), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        assert!(
            stderr.starts_with("mlscope-collector: invalid configuration: "),
            "{stderr}"
        );
    }
}

#[test]
fn a_misspelled_flag_is_answered_with_the_flag_meant() {
    let output = collector("http://127.0.0.1:1", &["--intervl", "5s"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(64), "{stderr}");
    assert!(
        stderr.starts_with("mlscope-collector: invalid configuration: ")
            && stderr.contains("tip: a similar argument exists: '--interval'"),
        "{stderr}"
    );
}

#[test]
fn samples_carry_identity_headers_the_contracts_keys_one_timestamp_and_rising_steps() {
    let mlflow = MockMlflow::ok();
    let child = spawn(
        collector(
            &mlflow.url,
            &["--interval", "200ms", "--volume", "scratch=/tmp"],
        )
        .env("NODE_NAME", "node-t")
        .env("RANK", "5"),
    );
    wait_for("four samples", WAIT, || mlflow.samples().len() >= 4);
    sigterm(&child);
    let (status, _, stderr) = finish(child, EXIT);
    assert!(status.success(), "{status}: {stderr}");

    let samples = mlflow.samples();
    for (step, sample) in samples.iter().enumerate() {
        assert_eq!(sample.path, "/api/2.0/mlflow/runs/log-batch");
        assert_eq!(
            sample.headers.get("x-mlscope-node").map(String::as_str),
            Some("node-t")
        );
        assert_eq!(
            sample.headers.get("x-mlscope-rank").map(String::as_str),
            Some("5")
        );
        assert_eq!(sample.body["run_id"], "run-1");
        let metrics = sample.body["metrics"].as_array().unwrap();
        let timestamps: BTreeSet<i64> = metrics
            .iter()
            .map(|m| m["timestamp"].as_i64().unwrap())
            .collect();
        let steps: BTreeSet<i64> = metrics
            .iter()
            .map(|m| m["step"].as_i64().unwrap())
            .collect();
        assert_eq!(timestamps.len(), 1, "one timestamp per sample");
        assert_eq!(
            steps,
            BTreeSet::from([step as i64]),
            "steps rise by one from 0"
        );
    }
    let keys: BTreeSet<String> = samples.iter().flat_map(|s| s.metric_keys()).collect();
    for key in [
        "system/node-t/node_cpu_utilization_percentage",
        "system/node-t/node_memory_usage_megabytes",
        "system/node-t/node_memory_usage_percentage",
        "system/node-t/rootfs_usage_megabytes",
        "system/node-t/rootfs_usage_percentage",
        "system/node-t/rootfs_available_megabytes",
        "system/rank-5/network_receive_megabytes",
        "system/rank-5/network_transmit_megabytes",
        "system/rank-5/volume_scratch_usage_megabytes",
        "system/rank-5/volume_scratch_usage_percentage",
        "system/rank-5/volume_scratch_available_megabytes",
        "system/rank-5/container_memory_working_set_megabytes",
        "system/rank-5/container_cpu_utilization_percentage",
    ] {
        assert!(keys.contains(key), "missing {key} in {keys:?}");
    }
    for key in &keys {
        assert!(mlscope_scopes::is_valid_mlflow_key(key), "{key}");
        let name = key.rsplit('/').next().unwrap();
        let rule = mlscope_scopes::rule_for(name)
            .unwrap_or_else(|| panic!("{key} is not in the scope table"));
        // Already in scoped form: the proxy leaves it alone.
        assert!(rule.scoped.is_none(), "{key} is not in scoped form");
        let owner = if rule.scope.is_node_wide() {
            "node-t"
        } else {
            "rank-5"
        };
        assert_eq!(key, &format!("system/{owner}/{name}"));
    }
    // No NVML here: one info line says so, and there is no GPU series.
    assert!(!keys.iter().any(|k| k.contains("/gpu_")), "{keys:?}");
    assert_eq!(stderr_lines_with(&stderr, "NVML").len(), 1, "{stderr}");
}

#[test]
fn sigterm_takes_a_final_sample_and_flushes_it_before_exit() {
    let mlflow = MockMlflow::ok();
    // An interval of an hour: the only sample is the final one.
    let child = spawn(&mut collector(&mlflow.url, &["--interval", "1h"]));
    wait_for("the collector to start", WAIT, || {
        fs::read_to_string(format!("/proc/{}/status", child.id()))
            .is_ok_and(|s| s.contains("Threads:\t3"))
    });
    sigterm(&child);
    let (status, _, stderr) = finish(child, EXIT);
    assert!(status.success(), "{stderr}");
    let samples = mlflow.samples();
    assert_eq!(samples.len(), 1, "{stderr}");
    assert_eq!(samples[0].step(), Some(0));
}

#[test]
fn while_mlflow_answers_503_and_429_samples_are_buffered_and_sent_in_order() {
    let mlflow = MockMlflow::start(|i| match i {
        0..=3 => (
            503,
            r#"{"error_code":"TEMPORARILY_UNAVAILABLE","message":"MLflow is restarting"}"#.into(),
        ),
        4 | 5 => (
            429,
            r#"{"error_code":"REQUEST_LIMIT_EXCEEDED","message":"slow down"}"#.into(),
        ),
        _ => (200, "{}".into()),
    });
    let child = spawn(&mut collector(
        &mlflow.url,
        &["--interval", "200ms", "--max-backoff", "300ms"],
    ));
    wait_for("eight stored samples", WAIT, || mlflow.samples().len() >= 8);
    sigterm(&child);
    let (status, _, stderr) = finish(child, EXIT);
    assert!(status.success(), "{stderr}");
    let steps: Vec<i64> = mlflow.samples().iter().filter_map(|s| s.step()).collect();
    assert_eq!(
        steps,
        (0..steps.len() as i64).collect::<Vec<_>>(),
        "every sample, in order, exactly once"
    );
    assert_eq!(
        stderr_lines_with(&stderr, "MLflow is unreachable").len(),
        1,
        "{stderr}"
    );
}

#[test]
fn a_refused_batch_is_logged_once_and_sampling_goes_on() {
    let mlflow = MockMlflow::start(|_| {
        (
            404,
            r#"{"error_code":"RESOURCE_DOES_NOT_EXIST","message":"Run 'run-1' not found"}"#.into(),
        )
    });
    let child = spawn(&mut collector(&mlflow.url, &["--interval", "100ms"]));
    wait_for("five refused batches", WAIT, || {
        mlflow.received().len() >= 5
    });
    sigterm(&child);
    let (status, _, stderr) = finish(child, EXIT);
    assert!(status.success(), "{stderr}");
    let steps: Vec<i64> = mlflow.received().iter().filter_map(|r| r.step()).collect();
    assert_eq!(
        steps,
        (0..steps.len() as i64).collect::<Vec<_>>(),
        "each refused batch is sent once, then the next"
    );
    assert_eq!(
        stderr_lines_with(&stderr, "Run 'run-1' not found").len(),
        1,
        "{stderr}"
    );
}

#[test]
fn unreachable_mlflow_never_makes_the_collector_fail_and_a_full_buffer_drops_the_oldest() {
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let child = spawn(&mut collector(
        &url,
        &[
            "--interval",
            "100ms",
            "--buffer",
            "300ms",
            "--flush-timeout",
            "300ms",
        ],
    ));
    // Long enough for five times the samples the buffer holds.
    std::thread::sleep(Duration::from_millis(1500));
    sigterm(&child);
    let (status, _, stderr) = finish(child, EXIT);
    assert!(status.success(), "{status}: {stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    let stats: serde_json::Value = serde_json::from_str(last).unwrap();
    assert_eq!(
        stats["message"], "stopped with samples that never reached MLflow",
        "{stderr}"
    );
    assert!(stats["dropped"].as_u64().unwrap() > 0, "{last}");
    assert_eq!(
        stats["unsent"].as_u64(),
        Some(4),
        "the buffer holds 300ms / 100ms samples, and the final sample is never dropped: {last}"
    );
}

#[test]
fn the_bearer_token_is_sent_and_never_logged() {
    let mlflow = MockMlflow::ok();
    let child = spawn(
        collector(
            &mlflow.url,
            &["--interval", "100ms", "--log-level", "trace"],
        )
        .env("MLFLOW_TRACKING_TOKEN", "tok-secret-123"),
    );
    wait_for("a sample", WAIT, || !mlflow.samples().is_empty());
    sigterm(&child);
    let (_, _, stderr) = finish(child, EXIT);
    assert_eq!(
        mlflow.samples()[0]
            .headers
            .get("authorization")
            .map(String::as_str),
        Some("Bearer tok-secret-123")
    );
    assert!(!stderr.contains("tok-secret-123"), "{stderr}");
}

// === wrapper mode ===

#[test]
fn wrapper_mode_passes_the_exit_status_through_sets_the_node_id_and_tags_the_run() {
    let mlflow = MockMlflow::ok();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("node-id");
    let script = format!(
        "echo \"$MLFLOW_SYSTEM_METRICS_NODE_ID\" > '{}'; exit 3",
        file.display()
    );
    let child = spawn(
        collector(
            &mlflow.url,
            &["--interval", "1h", "--", "sh", "-c", &script],
        )
        .env("NODE_NAME", "node-w")
        .env("OMPI_COMM_WORLD_RANK", "2"),
    );
    let (status, _, stderr) = finish(child, EXIT);
    assert_eq!(status.code(), Some(3), "{stderr}");
    assert_eq!(fs::read_to_string(&file).unwrap().trim(), "node-w/rank-2");
    let tags = mlflow.tags();
    assert_eq!(
        tags.get("mlscope/rank-2/outcome").map(String::as_str),
        Some("exited"),
        "{tags:?}"
    );
    assert_eq!(
        tags.get("mlscope/rank-2/exit_code").map(String::as_str),
        Some("3")
    );
    assert_eq!(
        tags.get("mlscope/rank-2/node").map(String::as_str),
        Some("node-w")
    );
    assert_eq!(
        tags.get("mlscope/rank-2/oom_kills").map(String::as_str),
        Some("0")
    );
    // Nothing the rank said last was dropped: the pre-flight's tags (before the command
    // started), the placement tags, then the final sample, then the outcome tags, in that order.
    let received = log_batches(&mlflow);
    assert!(
        received.len() == 4
            && received[0]
                .tags()
                .contains_key("mlscope/rank-2/preflight_run")
            && received[1].tags().contains_key("mlscope/rank-2/node")
            && received[2].step() == Some(0)
            && !received[3].tags().is_empty(),
        "{received:?}"
    );
}

#[test]
fn with_an_hour_interval_and_mlflow_refusing_at_first_the_last_sample_and_outcome_still_arrive() {
    // The buffer holds two payloads (`--buffer 1s` / `--interval 1h`, at least 2) and MLflow
    // answers 503 to the first five attempts, so all three payloads of a rank that ends at once
    // (pre-flight tags, placement tags, final sample, outcome tags) wait in the buffer together;
    // the pre-flight's runs/get gets one of the 503s and is not retried.
    let mlflow = MockMlflow::start(|i| match i {
        0..=4 => (
            503,
            r#"{"error_code":"TEMPORARILY_UNAVAILABLE","message":"MLflow is restarting"}"#.into(),
        ),
        _ => (200, "{}".into()),
    });
    let child = spawn(
        collector(
            &mlflow.url,
            &[
                "--interval",
                "1h",
                "--buffer",
                "1s",
                "--max-backoff",
                "100ms",
                "--",
                "sh",
                "-c",
                "exit 0",
            ],
        )
        .env("RANK", "1"),
    );
    let (status, _, stderr) = finish(child, EXIT);
    assert_eq!(status.code(), Some(0), "{stderr}");
    let received = log_batches(&mlflow);
    assert!(
        received.len() == 4
            && received[0]
                .tags()
                .contains_key("mlscope/rank-1/preflight_run")
            && received[1].tags().contains_key("mlscope/rank-1/node")
            && received[2].step() == Some(0)
            && received[3]
                .tags()
                .get("mlscope/rank-1/outcome")
                .map(String::as_str)
                == Some("exited"),
        "pre-flight, placement, final sample, outcome, in that order: {received:?}\n{stderr}"
    );
    assert!(
        stderr_lines_with(&stderr, "dropping").is_empty(),
        "nothing was dropped: {stderr}"
    );
}

#[test]
fn wrapper_mode_keeps_a_node_id_the_pod_already_set() {
    let mlflow = MockMlflow::ok();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("node-id");
    let script = format!(
        "echo \"$MLFLOW_SYSTEM_METRICS_NODE_ID\" > '{}'",
        file.display()
    );
    let child = spawn(
        collector(
            &mlflow.url,
            &["--interval", "1h", "--", "sh", "-c", &script],
        )
        .env("MLFLOW_SYSTEM_METRICS_NODE_ID", "set-by-pod"),
    );
    let (status, _, _) = finish(child, EXIT);
    assert!(status.success());
    assert_eq!(fs::read_to_string(&file).unwrap().trim(), "set-by-pod");
}

#[test]
fn sigterm_reaches_the_wrapped_command_and_its_status_is_returned() {
    let mlflow = MockMlflow::ok();
    let dir = tempfile::tempdir().unwrap();
    let ready = dir.path().join("ready");
    // The command exits 7 on SIGTERM; the loop is bounded at 60 s.
    let script = format!(
        "trap 'exit 7' TERM; touch '{}'; i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done",
        ready.display()
    );
    let child = spawn(&mut collector(
        &mlflow.url,
        &["--interval", "200ms", "--", "sh", "-c", &script],
    ));
    wait_for("the command to start", WAIT, || ready.exists());
    sigterm(&child);
    let (status, _, stderr) = finish(child, EXIT);
    assert_eq!(status.code(), Some(7), "{stderr}");
    assert_eq!(
        mlflow
            .tags()
            .get("mlscope/rank-0/exit_code")
            .map(String::as_str),
        Some("7")
    );
}

#[test]
fn sigint_sent_to_the_wrapper_reaches_the_wrapped_command() {
    let mlflow = MockMlflow::ok();
    let dir = tempfile::tempdir().unwrap();
    let ready = dir.path().join("ready");
    let script = format!(
        "trap 'exit 8' INT; touch '{}'; i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done",
        ready.display()
    );
    let child = spawn(&mut collector(
        &mlflow.url,
        &["--interval", "1h", "--", "sh", "-c", &script],
    ));
    wait_for("the command to start", WAIT, || ready.exists());
    let status = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let (status, _, stderr) = finish(child, EXIT);
    assert_eq!(status.code(), Some(8), "{stderr}");
}

/// A Python program that traps SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2: each handler
/// appends the signal's name to `argv[1]`, SIGTERM's then exits 42. Once the handlers are in
/// place it writes its `/proc/self/status` signal lines to `argv[2]` (Python itself neither
/// blocks nor unblocks anything) and waits, at most 60 s.
const TRAPPING_PROGRAM: &str = r#"
import os, signal, sys, time
marker, ready = sys.argv[1], sys.argv[2]
def on(number, frame):
    with open(marker, "a") as f:
        f.write(signal.Signals(number).name + "\n")
    if number == signal.SIGTERM:
        os._exit(42)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(s, on)
with open("/proc/self/status") as f:
    lines = [l for l in f if l.startswith("Sig")]
with open(ready + ".tmp", "w") as f:
    f.writelines(lines)
os.rename(ready + ".tmp", ready)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    time.sleep(0.05)
"#;

/// `kill -<signal> <pid>`.
fn kill(signal: &str, pid: u32) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

/// The field `name` of `/proc/<pid>/status` text, as a number.
fn status_field(status: &str, name: &str) -> u64 {
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(":"))
        .unwrap_or_else(|| panic!("no {name} in {status}"));
    u64::from_str_radix(line.trim(), 16).unwrap()
}

#[test]
fn the_wrapped_command_starts_unblocked_and_gets_each_forwarded_signal_once() {
    let mlflow = MockMlflow::ok();
    let dir = tempfile::tempdir().unwrap();
    let (marker, ready) = (dir.path().join("marker"), dir.path().join("ready"));
    let python = venv_python();
    let child = spawn(&mut collector(
        &mlflow.url,
        &[
            "--interval",
            "1h",
            "--",
            python.to_str().unwrap(),
            "-c",
            TRAPPING_PROGRAM,
            marker.to_str().unwrap(),
            ready.to_str().unwrap(),
        ],
    ));
    wait_for("the command's handlers", WAIT, || ready.exists());
    let status = fs::read_to_string(&ready).unwrap();
    // Blocked, SIGTERM would stay pending in the command until the kubelet's SIGKILL.
    assert_eq!(
        status_field(&status, "SigBlk"),
        0,
        "the command started with signals blocked:\n{status}"
    );
    let received = || fs::read_to_string(&marker).unwrap_or_default();
    let mut expected = String::new();
    for signal in ["USR1", "USR2", "HUP", "INT"] {
        kill(signal, child.id());
        expected += &format!("SIG{signal}\n");
        wait_for(&format!("SIG{signal} to reach the command"), WAIT, || {
            received() == expected
        });
    }
    sigterm(&child);
    // The collector waits for the command and ends as it did: the handler's exit 42.
    let (status, _, stderr) = finish(child, EXIT);
    assert_eq!(status.code(), Some(42), "{stderr}");
    assert_eq!(
        received(),
        "SIGUSR1\nSIGUSR2\nSIGHUP\nSIGINT\nSIGTERM\n",
        "each signal handled once"
    );
    let tags = mlflow.tags();
    assert_eq!(
        tags.get("mlscope/rank-0/outcome").map(String::as_str),
        Some("exited"),
        "{tags:?}"
    );
    assert_eq!(
        tags.get("mlscope/rank-0/exit_code").map(String::as_str),
        Some("42")
    );
}

#[test]
fn the_wrapped_command_starts_with_the_default_action_for_every_signal_the_collector_changed() {
    // SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2 and SIGPIPE; `cat` is exec'd directly, so no
    // shell resets anything on the way. SIGHUP and SIGINT come ignored from the collector's
    // parent, as a shell starts a background job.
    let mlflow = MockMlflow::ok();
    let child = spawn(&mut collector_ignoring(
        "HUP INT",
        &mlflow.url,
        &["--interval", "1h", "--", "cat", "/proc/self/status"],
    ));
    let (status, stdout, stderr) = finish(child, EXIT);
    assert!(status.success(), "{stderr}");
    let changed: u64 = [15, 2, 1, 10, 12, 13].iter().map(|n| 1 << (n - 1)).sum();
    let signals: String = stdout
        .lines()
        .filter(|l| l.starts_with("Sig"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(status_field(&signals, "SigBlk"), 0, "{signals}");
    assert_eq!(status_field(&signals, "SigIgn") & changed, 0, "{signals}");
}

#[test]
fn a_command_killed_by_a_signal_exits_128_plus_the_signal() {
    let mlflow = MockMlflow::ok();
    let child = spawn(&mut collector(
        &mlflow.url,
        &["--interval", "1h", "--", "sh", "-c", "kill -KILL $$"],
    ));
    let (status, _, stderr) = finish(child, EXIT);
    assert_eq!(status.code(), Some(137), "{stderr}");
    let tags = mlflow.tags();
    assert_eq!(
        tags.get("mlscope/rank-0/outcome").map(String::as_str),
        Some("killed"),
        "no OOM kill happened: {tags:?}"
    );
    assert_eq!(
        tags.get("mlscope/rank-0/signal").map(String::as_str),
        Some("SIGKILL")
    );
}

#[test]
fn without_mlflow_settings_the_command_still_runs() {
    let child = spawn(
        collector("", &["--", "sh", "-c", "exit 5"])
            .env_remove("MLFLOW_TRACKING_URI")
            .env_remove("MLFLOW_RUN_ID"),
    );
    let (status, _, stderr) = finish(child, EXIT);
    assert_eq!(status.code(), Some(5), "{stderr}");
    assert!(stderr.contains("without measuring it"), "{stderr}");
}

#[test]
fn a_command_that_does_not_exist_exits_127() {
    let mlflow = MockMlflow::ok();
    let child = spawn(&mut collector(&mlflow.url, &["--", "/no/such/command"]));
    let (status, _, stderr) = finish(child, EXIT);
    assert_eq!(status.code(), Some(127), "{stderr}");
    assert_eq!(
        mlflow
            .tags()
            .get("mlscope/rank-0/outcome")
            .map(String::as_str),
        Some("not_started")
    );
}

// === what the wrapped command leaves behind ===

/// A program that leaves a process behind: it forks a child that starts a session of its own
/// and forks the process left behind, then exits; that one opens `argv[1]` (a fake GPU device
/// file), ignores SIGTERM when `argv[3]` is `1`, writes its pid to `argv[2]`, tells the program
/// through a pipe, and sleeps, at most 120 s. The program exits 0 once it was told. The process
/// left behind reads and writes nothing else, so the collector's output pipes close when the
/// collector exits.
const LEAVING_PROGRAM: &str = r#"
import os, signal, sys, time
device, pid_file, ignore_term = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.close(r)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        if ignore_term:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        held = open(device, "rb")
        with open(pid_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(pid_file + ".tmp", pid_file)
        os.write(w, b"x")
        os.close(w)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.05)
    os._exit(0)
os.close(w)
os.read(r, 1)
os.wait()
"#;

/// The process a test's command left behind; SIGKILLed on drop if still there, so a failing test
/// leaves nothing running.
struct LeftBehind {
    pid: i32,
    /// In its command line: tells it from a later process with the same pid.
    marker: String,
}

impl LeftBehind {
    fn read(pid_file: &std::path::Path, marker: &std::path::Path) -> LeftBehind {
        LeftBehind {
            pid: fs::read_to_string(pid_file)
                .unwrap()
                .trim()
                .parse()
                .unwrap(),
            marker: marker.to_string_lossy().into_owned(),
        }
    }

    /// Running (not a zombie) and still the process that was left behind.
    fn running(&self) -> bool {
        let cmdline = fs::read(format!("/proc/{}/cmdline", self.pid)).unwrap_or_default();
        let state = fs::read_to_string(format!("/proc/{}/stat", self.pid)).unwrap_or_default();
        let state = state.rsplit(')').next().unwrap_or_default().trim_start();
        String::from_utf8_lossy(&cmdline).contains(&self.marker) && !state.starts_with('Z')
    }
}

impl LeftBehind {
    fn kill(&self) {
        if self.running() {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &self.pid.to_string()])
                .status();
        }
    }
}

impl Drop for LeftBehind {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs the collector around [`LEAVING_PROGRAM`] with `args` before `--`; returns the exit
/// status, stderr, how long the collector ran and the process left behind.
fn run_leaving(
    mlflow: &MockMlflow,
    dir: &std::path::Path,
    args: &[&str],
    env: &[(&str, &str)],
    ignore_term: bool,
) -> (std::process::ExitStatus, String, Duration, LeftBehind) {
    let device = dir.join("nvidia0");
    fs::write(&device, b"").unwrap();
    let pid_file = dir.join("left-behind.pid");
    let python = venv_python();
    let mut argv = vec!["--interval", "1h"];
    argv.extend_from_slice(args);
    argv.extend_from_slice(&[
        "--",
        python.to_str().unwrap(),
        "-c",
        LEAVING_PROGRAM,
        device.to_str().unwrap(),
        pid_file.to_str().unwrap(),
        if ignore_term { "1" } else { "0" },
    ]);
    let mut command = collector(&mlflow.url, &argv);
    command.env("RANK", "3");
    for (name, value) in env {
        command.env(name, value);
    }
    let started = std::time::Instant::now();
    let child = spawn(&mut command);
    let (status, _, stderr) = finish(child, Duration::from_secs(60));
    let took = started.elapsed();
    assert!(pid_file.exists(), "nothing was left behind: {stderr}");
    (status, stderr, took, LeftBehind::read(&pid_file, &device))
}

#[test]
fn a_process_the_command_leaves_behind_is_tagged_with_its_gpu_device_and_ended_by_sigterm() {
    let mlflow = MockMlflow::ok();
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("nvidia");
    let (status, stderr, took, left) = run_leaving(
        &mlflow,
        dir.path(),
        &["--leftover-grace", "30s"],
        &[("MLSCOPE_GPU_DEVICE_PREFIX", prefix.to_str().unwrap())],
        false,
    );
    assert_eq!(status.code(), Some(0), "the command's own status: {stderr}");
    assert!(!left.running(), "pid {} still runs: {stderr}", left.pid);
    assert!(
        took < Duration::from_secs(30),
        "ended within the grace: {took:?}"
    );
    let tags = mlflow.tags();
    let listing = tags
        .get("mlscope/rank-3/leftover_processes")
        .unwrap_or_else(|| panic!("{tags:?}\n{stderr}"));
    let device = dir.path().join("nvidia0");
    assert!(
        listing.starts_with(&format!("1: {} ", left.pid))
            && listing.ends_with(&format!(", {})", device.display())),
        "{listing}"
    );
    assert_eq!(
        tags.get("mlscope/rank-3/leftover_processes_ended")
            .map(String::as_str),
        Some("1 by SIGTERM, 0 by SIGKILL"),
        "{tags:?}"
    );
    assert_eq!(
        tags.get("mlscope/rank-3/outcome").map(String::as_str),
        Some("exited")
    );
    // What was left is sent with the outcome, before the ending; what was ended after it.
    let received = mlflow.accepted();
    let last = &received[received.len() - 1].tags();
    let before = &received[received.len() - 2].tags();
    assert!(
        before.contains_key("mlscope/rank-3/outcome")
            && before.contains_key("mlscope/rank-3/leftover_processes")
            && last.contains_key("mlscope/rank-3/leftover_processes_ended"),
        "{received:?}"
    );
    assert_eq!(
        stderr_lines_with(&stderr, "sent SIGTERM to a process the command left behind").len(),
        1,
        "{stderr}"
    );
}

#[test]
fn a_leftover_that_ignores_sigterm_is_sigkilled_after_the_grace() {
    let mlflow = MockMlflow::ok();
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("nvidia");
    let (status, stderr, took, left) = run_leaving(
        &mlflow,
        dir.path(),
        &[
            "--leftover-grace",
            "1s",
            "--gpu-device-prefix",
            prefix.to_str().unwrap(),
        ],
        &[],
        true,
    );
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(!left.running(), "pid {} still runs: {stderr}", left.pid);
    assert!(
        took >= Duration::from_secs(1),
        "the grace was given: {took:?}"
    );
    let tags = mlflow.tags();
    assert!(
        tags["mlscope/rank-3/leftover_processes"].starts_with(&format!("1: {} ", left.pid)),
        "{tags:?}"
    );
    assert_eq!(
        tags.get("mlscope/rank-3/leftover_processes_ended")
            .map(String::as_str),
        Some("0 by SIGTERM, 1 by SIGKILL"),
        "{tags:?}\n{stderr}"
    );
    assert_eq!(
        stderr_lines_with(&stderr, "sent SIGKILL to a leftover process").len(),
        1,
        "{stderr}"
    );
}

#[test]
fn with_leave_leftovers_the_leftover_is_tagged_but_left_running() {
    let mlflow = MockMlflow::ok();
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("nvidia");
    let (status, stderr, _, left) = run_leaving(
        &mlflow,
        dir.path(),
        &["--gpu-device-prefix", prefix.to_str().unwrap()],
        &[("MLSCOPE_LEAVE_LEFTOVERS", "1")],
        false,
    );
    assert_eq!(status.code(), Some(0), "{stderr}");
    assert!(left.running(), "pid {} was ended: {stderr}", left.pid);
    let tags = mlflow.tags();
    let listing = &tags["mlscope/rank-3/leftover_processes"];
    assert!(
        listing.starts_with(&format!("1: {} ", left.pid))
            && listing.contains(&format!("{}0", prefix.display())),
        "{listing}"
    );
    assert_eq!(
        tags.get("mlscope/rank-3/leftover_processes_ended")
            .map(String::as_str),
        Some("none (--leave-leftovers)")
    );
    left.kill();
    wait_for("the process left behind to be killed", WAIT, || {
        !left.running()
    });
}

#[test]
fn a_command_that_leaves_nothing_behind_is_tagged_with_none() {
    let mlflow = MockMlflow::ok();
    let child = spawn(&mut collector(
        &mlflow.url,
        &["--interval", "1h", "--", "sh", "-c", "sleep 0.1 & wait"],
    ));
    let (status, _, stderr) = finish(child, EXIT);
    assert_eq!(status.code(), Some(0), "{stderr}");
    let tags = mlflow.tags();
    assert_eq!(
        tags.get("mlscope/rank-0/leftover_processes")
            .map(String::as_str),
        Some("0"),
        "{tags:?}"
    );
    assert!(!tags.contains_key("mlscope/rank-0/leftover_processes_ended"));
}
