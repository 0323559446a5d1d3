//! A sample: every metric of one tick, with one timestamp and one step, as MLflow's monitor
//! publishes them — and the keys the scope contract gives each name.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use mlscope_scopes::{collector_key, Identity};

/// MLflow's limit on metrics in one `runs/log-batch`.
pub const MAX_METRICS_PER_BATCH: usize = 1000;

#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// Milliseconds since the Unix epoch, shared by every metric of the sample.
    pub timestamp_ms: i64,
    /// 0 for the first sample, one more for each after.
    pub step: i64,
    pub metrics: Vec<(Arc<str>, f64)>,
}

impl Sample {
    /// The sample as batches MLflow accepts (at most 1000 metrics each).
    pub fn into_batches(self) -> Vec<Sample> {
        if self.metrics.len() <= MAX_METRICS_PER_BATCH {
            return vec![self];
        }
        self.metrics
            .chunks(MAX_METRICS_PER_BATCH)
            .map(|chunk| Sample {
                timestamp_ms: self.timestamp_ms,
                step: self.step,
                metrics: chunk.to_vec(),
            })
            .collect()
    }
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Keys from the shared scope table, computed once per name: `system/<node>/node_*` and
/// `system/<node>/rootfs_*`, `system/rank-<r>/...` for the rest.
#[derive(Debug)]
pub struct KeyBook {
    identity: Identity,
    keys: HashMap<String, Arc<str>>,
}

impl KeyBook {
    pub fn new(identity: Identity) -> Self {
        KeyBook {
            identity,
            keys: HashMap::new(),
        }
    }

    pub fn key(&mut self, name: &str) -> Arc<str> {
        if let Some(key) = self.keys.get(name) {
            return key.clone();
        }
        let key: Arc<str> = collector_key(name, &self.identity).into();
        self.keys.insert(name.to_owned(), key.clone());
        key
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_the_contract_for_each_scope() {
        let mut book = KeyBook::new(Identity {
            node: Some("gpu-node-1".into()),
            rank: Some(3),
        });
        assert_eq!(
            &*book.key("node_cpu_utilization_percentage"),
            "system/gpu-node-1/node_cpu_utilization_percentage"
        );
        assert_eq!(
            &*book.key("rootfs_available_megabytes"),
            "system/gpu-node-1/rootfs_available_megabytes"
        );
        assert_eq!(
            &*book.key("container_memory_working_set_megabytes"),
            "system/rank-3/container_memory_working_set_megabytes"
        );
        assert_eq!(
            &*book.key("network_receive_megabytes"),
            "system/rank-3/network_receive_megabytes"
        );
        assert_eq!(
            &*book.key("gpu_0_power_usage_watts"),
            "system/rank-3/gpu_0_power_usage_watts"
        );
        assert_eq!(
            &*book.key("volume_data_usage_percentage"),
            "system/rank-3/volume_data_usage_percentage"
        );
    }

    #[test]
    fn large_samples_split_into_batches_mlflow_accepts() {
        let metrics = (0..2500)
            .map(|i| (Arc::<str>::from(format!("m{i}")), 1.0))
            .collect();
        let batches = Sample {
            timestamp_ms: 7,
            step: 2,
            metrics,
        }
        .into_batches();
        assert_eq!(
            batches.iter().map(|b| b.metrics.len()).collect::<Vec<_>>(),
            [1000, 1000, 500]
        );
        assert!(batches.iter().all(|b| b.step == 2 && b.timestamp_ms == 7));
    }
}
