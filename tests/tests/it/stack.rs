//! The harness itself: the stack it starts works, and nothing it starts outlives it.

use std::fs;
use std::process::Command;
use std::time::{Duration, Instant};

use mlscope_tests::{Process, StackOptions, TestStack};

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
    let deadline = Instant::now() + Duration::from_secs(5);
    while group_members(group).len() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        group_members(group).len() >= 2,
        "expected the shell and its background sleep"
    );

    drop(process);

    assert_eq!(group_members(group), Vec::<u32>::new());
}

#[test]
fn a_terminated_process_reports_its_own_exit_status() {
    let dir = tempfile::tempdir().unwrap();
    let mut command = Command::new("sh");
    command.args(["-c", "trap 'exit 3' TERM; while :; do sleep 0.1; done"]);
    let mut process = Process::spawn("trapper", &command, &dir.path().join("trapper.log")).unwrap();
    std::thread::sleep(Duration::from_millis(300));

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
