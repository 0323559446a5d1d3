//! Where a rank runs, recorded on the run with its first sample: node, pod, the container's
//! limits and its GPUs, as tags under `mlscope/rank-<r>/`.

/// The rank's placement: `mlscope/rank-<r>/node`, `pod`, the container's limits and GPUs.
#[derive(Debug, Clone)]
pub(crate) struct Placement {
    pub(crate) node: String,
    pub(crate) rank: u32,
    pub(crate) pod: String,
}

impl Placement {
    /// The tags, with the container limits read from the first sample's values.
    pub(crate) fn tags(
        &self,
        sample: &crate::sample::Sample,
        gpus: Option<(Option<String>, u32)>,
    ) -> Vec<(String, String)> {
        let key = |fact: &str| format!("mlscope/rank-{}/{fact}", self.rank);
        let mut tags = vec![(key("node"), self.node.clone())];
        if !self.pod.is_empty() {
            tags.push((key("pod"), self.pod.clone()));
        }
        for (name, fact) in [
            ("container_memory_limit_megabytes", "memory_limit_megabytes"),
            ("container_cpu_limit_cores", "cpu_limit_cores"),
        ] {
            let limit = sample
                .metrics
                .iter()
                .find(|(key, _)| key.rsplit('/').next() == Some(name))
                .map(|(_, value)| *value);
            // No limit set: the cgroup's "max", which the collector reports as no series.
            tags.push((
                key(fact),
                limit.map_or_else(|| "unlimited".to_owned(), |v| v.to_string()),
            ));
        }
        if let Some((model, count)) = gpus {
            tags.push((key("gpu_count"), count.to_string()));
            if let Some(model) = model {
                tags.push((key("gpu_model"), model));
            }
        }
        tags
    }
}

/// The rank tag `mlscope/rank-<r>/gpu_idle_basis`: what the idle clocks are judged on, sent once
/// it is known (with GPM, from the second sample) and again whenever it changes.
#[derive(Debug)]
pub(crate) struct BasisTag {
    pub(crate) rank: u32,
    pub(crate) sent: Option<&'static str>,
}

impl BasisTag {
    /// The tag to send after a sample whose basis was `basis`, if it says something new.
    pub(crate) fn update(&mut self, basis: Option<&'static str>) -> Option<(String, String)> {
        let basis = basis?;
        if self.sent == Some(basis) {
            return None;
        }
        self.sent = Some(basis);
        Some((
            format!("mlscope/rank-{}/gpu_idle_basis", self.rank),
            basis.to_owned(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placement_tags_name_node_pod_limits_and_gpus_of_the_rank() {
        let placement = Placement {
            node: "gpu-node-1".into(),
            rank: 3,
            pod: "train-worker-3".into(),
        };
        let sample = crate::sample::Sample {
            timestamp_ms: 0,
            step: 0,
            metrics: vec![
                (
                    "system/rank-3/container_memory_limit_megabytes".into(),
                    65536.0,
                ),
                (
                    "system/gpu-node-1/node_cpu_utilization_percentage".into(),
                    10.0,
                ),
            ],
        };
        let tags = placement.tags(&sample, Some((Some("NVIDIA H200".into()), 8)));
        let get = |k: &str| {
            tags.iter()
                .find(|(key, _)| key == &format!("mlscope/rank-3/{k}"))
                .map(|(_, v)| v.as_str())
        };
        assert_eq!(get("node"), Some("gpu-node-1"));
        assert_eq!(get("pod"), Some("train-worker-3"));
        assert_eq!(get("memory_limit_megabytes"), Some("65536"));
        assert_eq!(get("cpu_limit_cores"), Some("unlimited"));
        assert_eq!(get("gpu_count"), Some("8"));
        assert_eq!(get("gpu_model"), Some("NVIDIA H200"));
        assert!(placement
            .tags(&sample, None)
            .iter()
            .all(|(k, _)| !k.contains("gpu")));
    }

    #[test]
    fn the_idle_basis_tag_is_sent_once_known_and_again_when_it_changes() {
        let mut tag = BasisTag {
            rank: 2,
            sent: None,
        };
        assert_eq!(tag.update(None), None);
        assert_eq!(
            tag.update(Some("sm_active")),
            Some((
                "mlscope/rank-2/gpu_idle_basis".to_owned(),
                "sm_active".to_owned()
            ))
        );
        assert_eq!(tag.update(Some("sm_active")), None);
        assert_eq!(tag.update(None), None);
        assert_eq!(
            tag.update(Some("utilization")).map(|(_, v)| v).as_deref(),
            Some("utilization")
        );
    }
}
