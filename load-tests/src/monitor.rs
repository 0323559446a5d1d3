//! What MLflow's system-metrics monitor sends, so the benchmarks log the keys and shapes that real
//! training jobs do.
//!
//! MLflow 3 (`mlflow/system_metrics`) samples every 10 s and publishes one `runs/log-batch` per
//! sample: every value under `system/<node_id>/<name>` with one step counter per monitor and one
//! timestamp. A platform that sets `MLFLOW_SYSTEM_METRICS_NODE_ID=<node>/rank-<r>` makes the owner
//! `<node>/rank-<r>`, which mlscope-proxy reads as the sender's identity.

use mlscope_scopes::{rule_for, Scope, SystemKey};

/// CPU, memory and disk monitor names: what every rank on a node measures alike (node-wide in
/// the scope contract, deduplicated by the proxy).
pub(crate) const NODE_WIDE_NAMES: [&str; 6] = [
    "cpu_utilization_percentage",
    "system_memory_usage_megabytes",
    "system_memory_usage_percentage",
    "disk_usage_megabytes",
    "disk_usage_percentage",
    "disk_available_megabytes",
];

/// Network monitor names: the pod's own network namespace, one series per rank.
pub(crate) const POD_NAMES: [&str; 2] = ["network_receive_megabytes", "network_transmit_megabytes"];

/// GPU monitor names after `gpu_<i>_`, as the NVIDIA monitor writes them.
pub(crate) const GPU_SUFFIXES: [&str; 5] = [
    "memory_usage_percentage",
    "memory_usage_megabytes",
    "utilization_percentage",
    "power_usage_watts",
    "power_usage_percentage",
];

/// MLflow's default sampling interval (`MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`), in ms.
pub(crate) const SAMPLING_INTERVAL_MILLIS: u64 = 10_000;

/// Memory of the simulated node, for plausible percentages.
const NODE_MEMORY_MEGABYTES: f64 = 1_031_000.0;
/// Size of the simulated node's root partition.
const ROOTFS_MEGABYTES: f64 = 480_000.0;
/// Memory of the simulated GPU (an 80 GB part).
const GPU_MEMORY_MEGABYTES: f64 = 81_559.0;

/// One training process: the monitor of rank `rank` on node `node`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MonitoredRank {
    pub(crate) node: String,
    pub(crate) rank: u32,
}

/// How a stored key counts in the row report: by the scope contract's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum SeriesKind {
    /// `node_*`/`rootfs_*`, or the CPU/memory/disk names they replace.
    NodeWide,
    /// `network_*`.
    Pod,
    /// Anything else (GPU series, training metrics).
    Other,
}

// === impl MonitoredRank ===

impl MonitoredRank {
    pub(crate) fn new(node: impl Into<String>, rank: u32) -> MonitoredRank {
        MonitoredRank {
            node: node.into(),
            rank,
        }
    }

    /// `system/<node>/rank-<r>/`: MLflow's prefix with `MLFLOW_SYSTEM_METRICS_NODE_ID=<node>/rank-<r>`.
    pub(crate) fn key_prefix(&self) -> String {
        format!("system/{}/rank-{}/", self.node, self.rank)
    }

    /// The keys and values of publish number `publish` (0, 1, ...) in the monitor's order: CPU
    /// and memory, disk, network, then `gpus` GPUs.
    ///
    /// Values are deterministic. Node-wide values are the node's value plus a little per-rank
    /// noise (the ranks' monitors sample at slightly different moments), so two ranks never send
    /// the very same sample; network counters grow per rank.
    pub(crate) fn publish(&self, publish: u64, gpus: u32) -> Vec<(String, f64)> {
        let prefix = self.key_prefix();
        let node = hash_str(&self.node);
        let rank = u64::from(self.rank);
        let node_noise = |what: u64| unit(node ^ mix(publish ^ (what << 40)));
        let rank_noise = |what: u64| unit(mix(node ^ (rank << 20) ^ (publish << 32) ^ what));

        let cpu = 35.0 + 50.0 * node_noise(1) + 0.5 * rank_noise(1);
        let memory_used = NODE_MEMORY_MEGABYTES * (0.30 + 0.2 * node_noise(2)) + rank_noise(2);
        let disk_used = ROOTFS_MEGABYTES * 0.4 + 3.0 * publish as f64 + 0.01 * rank_noise(3);
        let received = publish as f64 * (120.0 + 10.0 * rank_noise(4));
        let sent = publish as f64 * (95.0 + 10.0 * rank_noise(5));
        let mut values = vec![
            ("cpu_utilization_percentage".to_string(), round(cpu, 1)),
            (
                "system_memory_usage_megabytes".to_string(),
                round(memory_used, 3),
            ),
            (
                "system_memory_usage_percentage".to_string(),
                round(100.0 * memory_used / NODE_MEMORY_MEGABYTES, 1),
            ),
            (
                "disk_usage_percentage".to_string(),
                round(100.0 * disk_used / ROOTFS_MEGABYTES, 1),
            ),
            ("disk_usage_megabytes".to_string(), round(disk_used, 3)),
            (
                "disk_available_megabytes".to_string(),
                round(ROOTFS_MEGABYTES - disk_used, 3),
            ),
            ("network_receive_megabytes".to_string(), round(received, 6)),
            ("network_transmit_megabytes".to_string(), round(sent, 6)),
        ];
        for gpu in 0..u64::from(gpus) {
            let load = rank_noise(10 + gpu);
            let memory = GPU_MEMORY_MEGABYTES * (0.5 + 0.4 * load);
            let watts = 250.0 + 400.0 * load;
            // In the order of GPU_SUFFIXES.
            let gpu_values = [
                round(100.0 * memory / GPU_MEMORY_MEGABYTES, 1),
                round(memory, 3),
                (90.0 + 10.0 * load).floor(),
                round(watts, 3),
                round(100.0 * watts / 700.0, 1),
            ];
            values.extend(
                GPU_SUFFIXES
                    .iter()
                    .zip(gpu_values)
                    .map(|(suffix, value)| (format!("gpu_{gpu}_{suffix}"), value)),
            );
        }
        values
            .into_iter()
            .map(|(name, value)| (format!("{prefix}{name}"), value))
            .collect()
    }
}

/// The collector's names of one sample (`mlscope-collector`), GPUs left out: node-wide first,
/// then the rank's container and pod.
pub(crate) const COLLECTOR_NAMES: [&str; 16] = [
    "node_cpu_utilization_percentage",
    "node_memory_usage_megabytes",
    "node_memory_usage_percentage",
    "rootfs_usage_megabytes",
    "rootfs_usage_percentage",
    "rootfs_available_megabytes",
    "container_cpu_utilization_percentage",
    "container_cpu_limit_cores",
    "container_cpu_throttled_percentage",
    "container_memory_working_set_megabytes",
    "container_memory_working_set_percentage",
    "container_memory_limit_megabytes",
    "container_memory_peak_megabytes",
    "container_oom_kill_count",
    "network_receive_megabytes",
    "network_transmit_megabytes",
];

impl MonitoredRank {
    /// Sample number `publish` of `mlscope-collector` beside this rank: the collector's names
    /// under the keys the scope contract gives them (`system/<node>/node_*`,
    /// `system/rank-<r>/container_*`, ...), with `gpus` GPUs. The monitor's values where the
    /// names measure the same (node CPU, memory, disk; network; GPUs), the container's own
    /// for the rest.
    pub(crate) fn collector_publish(&self, publish: u64, gpus: u32) -> Vec<(String, f64)> {
        let monitor: std::collections::HashMap<String, f64> = self
            .publish(publish, gpus)
            .into_iter()
            .map(|(key, value)| (key.trim_start_matches(&self.key_prefix()).to_owned(), value))
            .collect();
        let from_monitor = |name: &str| monitor.get(name).copied().unwrap_or_default();
        let rank_noise = unit(mix(hash_str(&self.node)
            ^ (u64::from(self.rank) << 20)
            ^ publish));
        let limit_megabytes = 65_536.0;
        let working_set = limit_megabytes * (0.4 + 0.3 * rank_noise);
        let values = [
            from_monitor("cpu_utilization_percentage"),
            from_monitor("system_memory_usage_megabytes"),
            from_monitor("system_memory_usage_percentage"),
            from_monitor("disk_usage_megabytes"),
            from_monitor("disk_usage_percentage"),
            from_monitor("disk_available_megabytes"),
            round(60.0 + 35.0 * rank_noise, 1),
            8.0,
            round(5.0 * rank_noise, 1),
            round(working_set, 3),
            round(100.0 * working_set / limit_megabytes, 1),
            limit_megabytes,
            round(working_set * 1.1, 3),
            0.0,
            from_monitor("network_receive_megabytes"),
            from_monitor("network_transmit_megabytes"),
        ];
        let identity = mlscope_scopes::Identity {
            node: Some(self.node.clone()),
            rank: Some(self.rank),
        };
        let gpu_names = (0..gpus).flat_map(|gpu| {
            GPU_SUFFIXES
                .iter()
                .map(move |suffix| format!("gpu_{gpu}_{suffix}"))
        });
        COLLECTOR_NAMES
            .iter()
            .map(|name| (*name).to_owned())
            .zip(values)
            .chain(gpu_names.map(|name| {
                let value = from_monitor(&name);
                (name, value)
            }))
            .map(|(name, value)| (mlscope_scopes::collector_key(&name, &identity), value))
            .collect()
    }
}

// === impl SeriesKind ===

impl SeriesKind {
    /// The kind of a stored key, by the contract's table (`mlscope-scopes`), whatever its owner.
    pub(crate) fn of_key(key: &str) -> SeriesKind {
        let Some(rule) = SystemKey::parse(key).and_then(|parts| rule_for(parts.name)) else {
            return SeriesKind::Other;
        };
        match rule.scope {
            scope if scope.is_node_wide() => SeriesKind::NodeWide,
            Scope::Pod => SeriesKind::Pod,
            _ => SeriesKind::Other,
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            SeriesKind::NodeWide => "node-wide (cpu, memory, disk)",
            SeriesKind::Pod => "pod (network)",
            SeriesKind::Other => "other",
        }
    }
}

// === deterministic noise ===

/// SplitMix64's finaliser: spreads every input bit over the output.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn hash_str(text: &str) -> u64 {
    text.bytes()
        .fold(0xCBF2_9CE4_8422_2325, |h, b| mix(h ^ u64::from(b)))
}

/// A number in `0.0..1.0` from a hash.
fn unit(hash: u64) -> f64 {
    (hash >> 11) as f64 / (1u64 << 53) as f64
}

fn round(value: f64, decimals: i32) -> f64 {
    let scale = 10f64.powi(decimals);
    (value * scale).round() / scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_publish_carries_the_monitor_keys_under_the_ranks_node_id() {
        let publish = MonitoredRank::new("node-a", 3).publish(0, 1);
        let keys: Vec<&str> = publish.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            keys.len(),
            NODE_WIDE_NAMES.len() + POD_NAMES.len() + GPU_SUFFIXES.len()
        );
        assert_eq!(keys[0], "system/node-a/rank-3/cpu_utilization_percentage");
        assert!(keys.contains(&"system/node-a/rank-3/gpu_0_power_usage_watts"));
        for name in NODE_WIDE_NAMES.iter().chain(&POD_NAMES) {
            assert!(
                keys.contains(&format!("system/node-a/rank-3/{name}").as_str()),
                "{name}"
            );
        }
        assert!(publish.iter().all(|(_, v)| v.is_finite() && *v >= 0.0));
    }

    #[test]
    fn a_collector_sample_carries_the_contracts_keys_for_its_node_and_rank() {
        let sample = MonitoredRank::new("node-a", 3).collector_publish(2, 1);
        let keys: Vec<&str> = sample.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys.len(), COLLECTOR_NAMES.len() + GPU_SUFFIXES.len());
        assert_eq!(keys[0], "system/node-a/node_cpu_utilization_percentage");
        assert!(keys.contains(&"system/node-a/rootfs_available_megabytes"));
        assert!(keys.contains(&"system/rank-3/container_memory_working_set_megabytes"));
        assert!(keys.contains(&"system/rank-3/network_receive_megabytes"));
        assert!(keys.contains(&"system/rank-3/gpu_0_utilization_percentage"));
        let node_wide = keys
            .iter()
            .filter(|k| SeriesKind::of_key(k) == SeriesKind::NodeWide)
            .count();
        assert_eq!(node_wide, 6);
        assert!(sample.iter().all(|(_, v)| v.is_finite() && *v >= 0.0));
    }

    #[test]
    fn ranks_of_one_node_send_close_but_distinct_node_values() {
        let a = MonitoredRank::new("node-a", 0).publish(4, 0);
        let b = MonitoredRank::new("node-a", 1).publish(4, 0);
        let (cpu_a, cpu_b) = (a[0].1, b[0].1);
        assert!((cpu_a - cpu_b).abs() <= 1.0, "{cpu_a} vs {cpu_b}");
        assert_ne!(a[1].1, b[1].1, "memory samples of two ranks differ");
    }

    #[test]
    fn series_kinds_follow_the_scope_table_in_original_and_scoped_form() {
        for key in [
            "system/node-a/rank-3/cpu_utilization_percentage",
            "system/node-a/node_cpu_utilization_percentage",
            "system/node-a/rootfs_available_megabytes",
            "system/disk_usage_percentage",
        ] {
            assert_eq!(SeriesKind::of_key(key), SeriesKind::NodeWide, "{key}");
        }
        assert_eq!(
            SeriesKind::of_key("system/rank-3/network_receive_megabytes"),
            SeriesKind::Pod
        );
        assert_eq!(
            SeriesKind::of_key("system/rank-3/gpu_0_utilization_percentage"),
            SeriesKind::Other
        );
        assert_eq!(SeriesKind::of_key("loss"), SeriesKind::Other);
    }
}
