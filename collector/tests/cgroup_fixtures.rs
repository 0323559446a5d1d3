//! Cgroup discovery and readings on fixture trees (`tests/fixtures/cgroup/<layout>/`): each
//! holds `proc/self/{cgroup,mountinfo}` and the cgroup files below the mount points, as a
//! process in that layout would see them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use mlscope_collector::sources::cgroup::{
    container_metrics, discover, CgroupLayout, CgroupReading, CpuQuota, DiscoveryRoots, V1Dirs,
};

fn fixture(layout: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/cgroup")
        .join(layout)
}

fn roots(layout: &str) -> DiscoveryRoots {
    let root = fixture(layout);
    DiscoveryRoots {
        proc_self: root.join("proc/self"),
        fs_root: root,
    }
}

fn metrics(prev: &CgroupReading, cur: &CgroupReading, elapsed: Duration) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    container_metrics(prev, cur, elapsed, &mut out);
    out.into_iter()
        .map(|(name, value)| (name.into_owned(), value))
        .collect()
}

fn value(metrics: &[(String, f64)], name: &str) -> Option<f64> {
    metrics.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
}

#[test]
fn v2_nested_container_is_found_and_takes_its_limits_from_the_pod_cgroup() {
    let root = fixture("v2-nested");
    let layout = discover(&roots("v2-nested"), None).unwrap();
    let dir = root.join("sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod12.slice/cri-containerd-abc.scope");
    assert_eq!(
        layout,
        CgroupLayout::V2 {
            dir,
            mount_point: root.join("sys/fs/cgroup")
        }
    );
    let reading = layout.read();
    assert_eq!(
        reading,
        CgroupReading {
            memory_usage: Some(1_100_000_000),
            inactive_file: Some(100_000_000),
            memory_limit: Some(2_147_483_648),
            memory_peak: Some(1_300_000_000),
            oom_kills: Some(1),
            cpu_usage_usec: Some(5_000_000),
            cpu_quota: Some(CpuQuota {
                quota_usec: 200_000,
                period_usec: 100_000
            }),
            cpus_allowed: Some(8),
            nr_periods: Some(100),
            nr_throttled: Some(10),
        }
    );
    // One more second of one busy core, 10 more periods of which 5 throttled.
    let later = CgroupReading {
        cpu_usage_usec: Some(6_000_000),
        nr_periods: Some(110),
        nr_throttled: Some(15),
        ..reading.clone()
    };
    let m = metrics(&reading, &later, Duration::from_secs(1));
    assert_eq!(
        value(&m, "container_memory_working_set_megabytes"),
        Some(1000.0)
    );
    assert_eq!(
        value(&m, "container_memory_limit_megabytes"),
        Some(2147.483648)
    );
    assert!((value(&m, "container_memory_working_set_percentage").unwrap() - 46.566).abs() < 0.001);
    assert_eq!(value(&m, "container_cpu_limit_cores"), Some(2.0));
    assert!((value(&m, "container_cpu_utilization_percentage").unwrap() - 50.0).abs() < 1e-9);
    assert_eq!(value(&m, "container_cpu_throttled_percentage"), Some(50.0));
    assert_eq!(value(&m, "container_oom_kill_count"), Some(1.0));
}

#[test]
fn v2_in_a_cgroup_namespace_on_an_old_kernel_omits_what_is_missing() {
    let root = fixture("v2-namespace");
    let layout = discover(&roots("v2-namespace"), None).unwrap();
    assert_eq!(
        layout,
        CgroupLayout::V2 {
            dir: root.join("sys/fs/cgroup"),
            mount_point: root.join("sys/fs/cgroup")
        }
    );
    let reading = layout.read();
    assert_eq!((reading.memory_peak, reading.oom_kills), (None, None));
    let m = metrics(&reading, &reading, Duration::from_secs(10));
    let names: Vec<&str> = m.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "container_memory_working_set_megabytes",
            "container_memory_limit_megabytes",
            "container_memory_working_set_percentage",
            "container_cpu_utilization_percentage",
            "container_cpu_limit_cores",
            "container_cpu_throttled_percentage",
        ]
    );
    assert_eq!(
        value(&m, "container_memory_working_set_percentage"),
        Some(25.0)
    );
    assert_eq!(value(&m, "container_cpu_limit_cores"), Some(0.5));
    // No period has passed: nothing was throttled.
    assert_eq!(value(&m, "container_cpu_throttled_percentage"), Some(0.0));
}

#[test]
fn v1_docker_layout_strips_the_mount_root_and_reads_the_hierarchical_limit() {
    let root = fixture("v1-docker");
    let layout = discover(&roots("v1-docker"), None).unwrap();
    let cgroup = root.join("sys/fs/cgroup");
    assert_eq!(
        layout,
        CgroupLayout::V1(V1Dirs {
            memory: Some(cgroup.join("memory")),
            cpu: Some(cgroup.join("cpu,cpuacct")),
            cpuacct: Some(cgroup.join("cpu,cpuacct")),
            cpuset: Some(cgroup.join("cpuset")),
        })
    );
    let reading = layout.read();
    // The container's own limit is v1's "unlimited"; its parent's 512 MiB applies.
    assert_eq!(reading.memory_limit, Some(536_870_912));
    // total_inactive_file (hierarchical) wins over inactive_file.
    assert_eq!(reading.inactive_file, Some(100_000_000));
    assert_eq!(
        (reading.memory_peak, reading.oom_kills),
        (Some(450_000_000), Some(3))
    );
    assert_eq!(
        (
            reading.cpu_usage_usec,
            reading.cpu_quota,
            reading.cpus_allowed
        ),
        (Some(7_000_000), None, Some(4))
    );
    let later = CgroupReading {
        cpu_usage_usec: Some(9_000_000),
        ..reading.clone()
    };
    let m = metrics(&reading, &later, Duration::from_secs(1));
    assert_eq!(
        value(&m, "container_memory_working_set_megabytes"),
        Some(300.0)
    );
    // No quota: 2 cores busy of the 4 allowed.
    assert!((value(&m, "container_cpu_utilization_percentage").unwrap() - 50.0).abs() < 1e-9);
    assert_eq!(value(&m, "container_cpu_limit_cores"), None);
    assert_eq!(value(&m, "container_cpu_throttled_percentage"), None);
}

#[test]
fn hybrid_layout_uses_v1_when_the_unified_hierarchy_has_no_memory_controller() {
    let root = fixture("hybrid");
    let cgroup = root.join("sys/fs/cgroup");
    let layout = discover(&roots("hybrid"), None).unwrap();
    assert_eq!(
        layout,
        CgroupLayout::V1(V1Dirs {
            memory: Some(cgroup.join("memory/process_api/1125b4f2")),
            cpu: Some(cgroup.join("cpu")),
            cpuacct: Some(cgroup.join("cpuacct")),
            cpuset: Some(cgroup.join("cpuset")),
        })
    );
    let reading = layout.read();
    assert_eq!(reading.memory_limit, Some(268_435_456));
    assert_eq!(
        reading.cpu_quota,
        Some(CpuQuota {
            quota_usec: 150_000,
            period_usec: 100_000
        })
    );
    let m = metrics(&reading, &reading, Duration::from_secs(1));
    assert_eq!(
        value(&m, "container_memory_working_set_megabytes"),
        Some(150.0)
    );
    assert_eq!(value(&m, "container_cpu_limit_cores"), Some(1.5));
    assert_eq!(value(&m, "container_oom_kill_count"), Some(0.0));
}

#[test]
fn an_override_may_name_a_directory_under_a_mount_or_a_cgroup_path() {
    let root = fixture("hybrid");
    let cgroup = root.join("sys/fs/cgroup");
    // A directory below the v1 memory mount: the same relative path in the other hierarchies,
    // where it does not exist there, is left out.
    let by_dir = discover(
        &roots("hybrid"),
        Some(Path::new("/sys/fs/cgroup/memory/process_api/other")),
    )
    .unwrap();
    assert_eq!(
        by_dir,
        CgroupLayout::V1(V1Dirs {
            memory: Some(cgroup.join("memory/process_api/other")),
            ..V1Dirs::default()
        })
    );
    let reading = by_dir.read();
    assert_eq!(
        (reading.memory_usage, reading.memory_limit),
        (Some(10_000_000), None)
    );
    // A path as /proc/<pid>/cgroup prints it.
    let by_path = discover(&roots("hybrid"), Some(Path::new("/process_api/other"))).unwrap();
    assert_eq!(by_path, by_dir);
    // v2: a directory under the cgroup2 mount.
    let v2_root = fixture("v2-nested");
    let pod =
        "/sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod12.slice";
    let layout = discover(&roots("v2-nested"), Some(Path::new(pod))).unwrap();
    assert_eq!(
        layout,
        CgroupLayout::V2 {
            dir: v2_root.join(&pod[1..]),
            mount_point: v2_root.join("sys/fs/cgroup")
        }
    );
    assert!(discover(&roots("hybrid"), Some(Path::new("/no/such/cgroup"))).is_err());
}

#[test]
fn missing_files_are_an_error_only_for_discovery_never_for_readings() {
    let empty = tempfile::tempdir().unwrap();
    let roots = DiscoveryRoots {
        proc_self: empty.path().join("proc/self"),
        fs_root: empty.path().to_owned(),
    };
    assert!(discover(&roots, None).is_err());
    let gone = CgroupLayout::V2 {
        dir: empty.path().join("gone"),
        mount_point: empty.path().to_owned(),
    };
    let reading = gone.read();
    assert_eq!(
        CgroupReading {
            cpus_allowed: None,
            ..reading.clone()
        },
        CgroupReading::default()
    );
    assert!(metrics(&reading, &reading, Duration::from_secs(1)).is_empty());
}
