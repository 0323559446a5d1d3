//! The container series on a real cgroup: a child memory cgroup (cgroup v1, as on this
//! project's machines) with a limit, a process inside that allocates a known amount, and one
//! that exceeds the limit and must be reported OOM-killed. Needs root; cgroup v2 is covered by
//! the fixture trees.

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use mlscope_collector::sources::cgroup::{
    container_metrics, discover, CgroupLayout, DiscoveryRoots,
};
use mlscope_tests::MemoryCgroup;
use support::{
    collector, collector_binary, finish, spawn, venv_python, wait_for, with_clean_environment,
    MockMlflow,
};

const MIB: u64 = 1 << 20;

/// These tests need root and a cgroup v1 memory controller, which this project's machines and
/// CI have: without them the test fails rather than passing unchecked.
fn skip(test: &str) -> ! {
    panic!(
        "{test}: needs root and a cgroup v1 memory controller (this project's machines have both)"
    );
}

#[test]
fn a_child_allocating_a_known_amount_shows_it_as_working_set_and_share_of_the_limit() {
    let Some(cgroup) = MemoryCgroup::create("mlscope-working-set", 256 * MIB) else {
        skip("working set")
    };
    let allocate = 100 * MIB;
    // Every page written, then held until stdin closes.
    let program = format!(
        "import sys\nb = b'x' * {allocate}\nprint('ready', flush=True)\nsys.stdin.readline()"
    );
    let python = venv_python();
    let argv = cgroup.run_inside(&[python.to_str().unwrap(), "-c", &program]);
    let mut child = Command::new(&argv[0])
        .args(&argv[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "ready");

    let layout = discover(&DiscoveryRoots::default(), Some(&cgroup.dir)).unwrap();
    assert!(
        matches!(&layout, CgroupLayout::V1(dirs) if dirs.memory.as_deref() == Some(cgroup.dir.as_path())),
        "{layout:?}"
    );
    let reading = layout.read();
    let mut out = Vec::new();
    container_metrics(&reading, &reading, Duration::from_secs(1), &mut out);
    let value = |name: &str| {
        out.iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no {name} in {out:?}"))
            .1
    };
    let working_set = value("container_memory_working_set_megabytes");
    eprintln!(
        "allocated {} MB; working set {working_set} MB, {} % of the limit",
        allocate as f64 / 1e6,
        value("container_memory_working_set_percentage")
    );
    // The allocation plus the interpreter (about 10 MB) and the pages of the files it read.
    assert!(
        working_set >= allocate as f64 / 1e6 && working_set <= allocate as f64 / 1e6 + 40.0,
        "{working_set} MB"
    );
    assert_eq!(
        value("container_memory_limit_megabytes"),
        (256 * MIB) as f64 / 1e6
    );
    let expected = working_set / value("container_memory_limit_megabytes") * 100.0;
    assert!((value("container_memory_working_set_percentage") - expected).abs() < 1e-9);
    assert!((39.0..55.0).contains(&expected), "{expected} %");
    assert_eq!(value("container_oom_kill_count"), 0.0);

    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
}

#[test]
fn a_wrapped_command_that_exceeds_its_limit_is_reported_oom_killed() {
    let Some(cgroup) = MemoryCgroup::create("mlscope-oom", 64 * MIB) else {
        skip("OOM")
    };
    let mlflow = MockMlflow::ok();
    let python = venv_python();
    let command = cgroup.run_inside(&[python.to_str().unwrap(), "-c", "b = b'x' * (256 << 20)"]);
    let dir = cgroup.dir.to_str().unwrap().to_owned();
    let mut args = vec!["--cgroup-path", dir.as_str(), "--interval", "200ms", "--"];
    args.extend(command.iter().map(String::as_str));
    let child = spawn(
        collector(&mlflow.url, &args)
            .env("NODE_NAME", "node-o")
            .env("RANK", "1"),
    );
    let (status, _, stderr) = finish(child, Duration::from_secs(60));

    assert_eq!(
        status.code(),
        Some(137),
        "the wrapper exits as its command did: {stderr}"
    );
    let tags = mlflow.tags();
    assert_eq!(
        tags.get("mlscope/rank-1/outcome").map(String::as_str),
        Some("oom_killed"),
        "{tags:?}\n{stderr}"
    );
    assert_eq!(
        tags.get("mlscope/rank-1/signal").map(String::as_str),
        Some("SIGKILL")
    );
    assert_eq!(
        tags.get("mlscope/rank-1/oom_kills").map(String::as_str),
        Some("1")
    );
    assert_eq!(
        tags.get("mlscope/rank-1/exit_code").map(String::as_str),
        Some("137")
    );
    let last = mlflow.samples().pop().expect("the final sample");
    assert_eq!(
        last.metric("system/rank-1/container_oom_kill_count"),
        Some(1.0)
    );
    assert_eq!(
        last.metric("system/rank-1/container_memory_limit_megabytes"),
        Some((64 * MIB) as f64 / 1e6)
    );
}

#[test]
fn a_process_in_the_container_cgroup_but_not_below_the_collector_is_a_leftover_too() {
    // The collector is the cgroup's first process (its parent, this test, is outside), as a
    // container's entrypoint is; a `sleep` this test puts into the cgroup stands for what
    // `kubectl exec` starts: not below the collector, but the rank's.
    let Some(cgroup) = MemoryCgroup::create("mlscope-leftovers", 256 * MIB) else {
        skip("leftovers in the cgroup")
    };
    let procs = cgroup.dir.join("cgroup.procs");
    let beside = cgroup.run_inside(&["sleep", "60"]);
    let mut beside = Command::new(&beside[0])
        .args(&beside[1..])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = beside.id();
    wait_for(
        "the sleep to be in the cgroup",
        Duration::from_secs(30),
        || {
            std::fs::read_to_string(&procs).is_ok_and(|p| p.lines().any(|l| l == pid.to_string()))
                && std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| c.starts_with("sleep"))
        },
    );
    let mlflow = MockMlflow::ok();
    let binary = collector_binary();
    let argv = cgroup.run_inside(&[
        binary.to_str().unwrap(),
        "--interval",
        "1h",
        "--leftover-grace",
        "20s",
        "--",
        "sh",
        "-c",
        "exit 0",
    ]);
    let mut command = Command::new(&argv[0]);
    command.args(&argv[1..]);
    with_clean_environment(&mut command, &mlflow.url);
    let (status, _, stderr) = finish(spawn(&mut command), Duration::from_secs(60));
    assert_eq!(status.code(), Some(0), "{stderr}");
    let tags = mlflow.tags();
    assert!(
        tags.get("mlscope/rank-0/leftover_processes")
            .is_some_and(|l| l.starts_with(&format!("1: {pid} sleep 60 ("))),
        "{tags:?}\n{stderr}"
    );
    assert_eq!(
        tags.get("mlscope/rank-0/leftover_processes_ended")
            .map(String::as_str),
        Some("1 by SIGTERM, 0 by SIGKILL")
    );
    assert!(stderr.contains("CgroupMember"), "{stderr}");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(beside.wait().unwrap().signal(), Some(15));
}
