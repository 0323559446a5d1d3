//! The parsers on this machine's real `/proc` and `/sys/fs/cgroup`.

use std::fs;
use std::path::PathBuf;

use mlscope_collector::sources::cgroup::{
    discover, parse_proc_cgroup, CgroupLayout, DiscoveryRoots,
};
use mlscope_collector::sources::gpu::GpuSource;
use mlscope_collector::sources::network::parse_net_dev;
use mlscope_collector::sources::node::{parse_meminfo, parse_proc_stat, NodeSource};

#[test]
fn discovery_finds_this_processs_own_cgroup_and_reads_its_memory() {
    let layout = discover(&DiscoveryRoots::default(), None).expect("this machine mounts cgroups");
    let own = parse_proc_cgroup(&fs::read_to_string("/proc/self/cgroup").unwrap());
    match &layout {
        CgroupLayout::V1(dirs) => {
            let memory_path = own
                .iter()
                .find(|l| l.controllers.iter().any(|c| c == "memory"))
                .unwrap()
                .path
                .clone();
            let dir = dirs.memory.as_ref().expect("a v1 memory directory");
            assert!(
                dir.ends_with(memory_path.trim_start_matches('/')),
                "{} for {memory_path}",
                dir.display()
            );
        }
        CgroupLayout::V2 { dir, .. } => {
            let path = own
                .iter()
                .find(|l| l.hierarchy_id == 0)
                .unwrap()
                .path
                .clone();
            assert!(
                dir.ends_with(path.trim_start_matches('/')),
                "{} for {path}",
                dir.display()
            );
        }
    }
    let reading = layout.read();
    assert!(reading.memory_usage.unwrap_or(0) > 0, "{reading:?}");
    assert!(reading.cpu_usage_usec.unwrap_or(0) > 0, "{reading:?}");
    assert!(
        reading.oom_kills.is_some(),
        "this kernel reports oom_kill: {reading:?}"
    );
}

#[test]
fn node_values_from_the_real_proc_are_plausible() {
    let stat = parse_proc_stat(&fs::read_to_string("/proc/stat").unwrap()).unwrap();
    assert!(stat.0[..4].iter().sum::<u64>() > 0);
    let meminfo = parse_meminfo(&fs::read_to_string("/proc/meminfo").unwrap()).unwrap();
    assert!(meminfo.total > 0 && meminfo.available.is_some());
    let mut node = NodeSource::new(PathBuf::from("/proc"));
    let mut out = Vec::new();
    node.sample(&mut out);
    let value = |name: &str| {
        out.iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no {name}"))
            .1
    };
    assert!((0.0..=100.0).contains(&value("node_cpu_utilization_percentage")));
    assert!(
        value("node_memory_usage_percentage") > 0.0
            && value("node_memory_usage_percentage") <= 100.0
    );
    assert!(value("node_memory_usage_megabytes") > 0.0);
}

#[test]
fn network_counters_parse_on_this_machine_without_loopback() {
    let text = fs::read_to_string("/proc/net/dev").unwrap();
    let counters = parse_net_dev(&text);
    let interfaces = text.lines().skip(2).filter(|l| l.contains(':')).count();
    let has_lo = text.lines().any(|l| l.trim_start().starts_with("lo:"));
    assert_eq!(counters.len(), interfaces - usize::from(has_lo));
    assert!(!counters.contains_key("lo"));
}

#[test]
fn without_an_nvidia_driver_there_is_no_gpu_source_and_no_error() {
    if PathBuf::from("/dev/nvidiactl").exists() {
        eprintln!("skipped: this machine has an NVIDIA driver");
        return;
    }
    assert!(GpuSource::load(5.0).is_none());
}
