//! Oracle: node CPU and memory agree with psutil (what MLflow's monitor logs) sampled at the
//! same moment on this machine, and rootfs with `psutil.disk_usage("/")`.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use mlscope_collector::sources::disk::Space;
use mlscope_collector::sources::node::{cpu_percent, memory_used, NodeSource};

/// Runs psutil in a child that answers one line per line it is sent.
const ORACLE: &str = r#"
import json, sys, psutil
psutil.cpu_percent(None)
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "cpu":
        print(json.dumps(psutil.cpu_percent(None)), flush=True)
    elif line.strip() == "memory":
        m = psutil.virtual_memory()
        print(json.dumps([m.used, m.total]), flush=True)
    elif line.strip() == "disk":
        d = psutil.disk_usage("/")
        print(json.dumps([d.used, d.free, d.percent]), flush=True)
"#;

struct Oracle {
    child: std::process::Child,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

impl Oracle {
    fn start() -> Oracle {
        let mut child = Command::new(support::venv_python())
            .args(["-c", ORACLE])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        assert_eq!(lines.next().unwrap().unwrap(), "ready");
        Oracle { child, lines }
    }

    fn ask(&mut self, what: &str) -> serde_json::Value {
        writeln!(self.child.stdin.as_mut().unwrap(), "{what}").unwrap();
        serde_json::from_str(&self.lines.next().unwrap().unwrap()).unwrap()
    }
}

impl Drop for Oracle {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn node() -> NodeSource {
    NodeSource::new(PathBuf::from("/proc"))
}

#[test]
fn node_cpu_percent_agrees_with_psutil_over_a_loaded_interval() {
    let mut node = node();
    let mut oracle = Oracle::start();
    // Both baselines now: psutil's was taken just before "ready".
    let before = node.cpu_times().unwrap();
    // One core busy for 1.5 s, the rest of the machine as it is.
    let stop = Arc::new(AtomicBool::new(false));
    let busy = {
        let stop = stop.clone();
        thread::spawn(move || {
            let mut x = 0u64;
            while !stop.load(Ordering::Relaxed) {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
        })
    };
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(1500) {
        thread::sleep(Duration::from_millis(50));
    }
    let after = node.cpu_times().unwrap();
    let psutil = oracle.ask("cpu").as_f64().unwrap();
    stop.store(true, Ordering::Relaxed);
    busy.join().unwrap();
    let ours = cpu_percent(&before, &after);
    eprintln!("node CPU over the loaded interval: collector {ours} %, psutil {psutil} %");
    assert!(
        ours > 100.0 / num_cpus() as f64 * 0.8,
        "the loaded interval shows load: {ours}"
    );
    assert!(
        (ours - psutil).abs() <= 3.0,
        "collector {ours} % vs psutil {psutil} %"
    );
}

fn num_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[test]
fn node_memory_used_agrees_with_psutil_within_one_percent() {
    let mut node = node();
    let mut oracle = Oracle::start();
    let ours_before = memory_used(&node.meminfo().unwrap(), || None);
    let answer = oracle.ask("memory");
    let ours_after = memory_used(&node.meminfo().unwrap(), || None);
    let (psutil_used, psutil_total) = (answer[0].as_u64().unwrap(), answer[1].as_u64().unwrap());
    assert_eq!(node.meminfo().unwrap().total, psutil_total);
    eprintln!("node memory used: collector {ours_before} / {ours_after} B, psutil {psutil_used} B");
    for ours in [ours_before, ours_after] {
        let diff = (ours as f64 - psutil_used as f64).abs() / psutil_used as f64;
        assert!(diff <= 0.01, "collector {ours} B vs psutil {psutil_used} B");
    }
}

#[test]
fn rootfs_space_agrees_with_psutil_disk_usage() {
    let mut oracle = Oracle::start();
    let space = Space::of(Path::new("/")).unwrap();
    let answer = oracle.ask("disk");
    let (used, free, percent) = (
        answer[0].as_f64().unwrap(),
        answer[1].as_f64().unwrap(),
        answer[2].as_f64().unwrap(),
    );
    let close = |a: f64, b: f64| (a - b).abs() <= b.abs() * 0.001 + 64.0 * 1024.0 * 1024.0;
    assert!(
        close(space.used() as f64, used),
        "used {} vs {used}",
        space.used()
    );
    assert!(
        close(space.available as f64, free),
        "available {} vs {free}",
        space.available
    );
    assert!(
        (space.used_percentage() - percent).abs() <= 0.2,
        "{} vs {percent}",
        space.used_percentage()
    );
}
