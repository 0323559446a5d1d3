//! What one accepted metrics request says about the ranks of its run: a heartbeat of each (node,
//! rank) that sent system samples, with what the samples and the collector's rank tags report
//! (GPUs and their idleness, container limits, how a rank ended, placement). The scope contract
//! builds it while it reads the body; run health records it once MLflow accepted the write.

use super::usage::Series;
use super::{basis, findings};

/// GPU indexes read from keys (`gpu_<i>_...`): beyond this an index is not a real device.
pub(super) const MAX_GPUS_PER_RANK: i64 = 64;

/// What one accepted metrics request said about the ranks of its run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Beat {
    pub run_id: String,
    pub ranks: Vec<RankBeat>,
    /// The MLflow workspace the request named (`X-MLFLOW-WORKSPACE`).
    pub workspace: Option<String>,
    /// What its collectors' tags reported the run stood on (data changes, leftovers).
    pub findings: Vec<findings::Finding>,
    /// The run's own step as of this request: the highest step of its metrics outside
    /// `system/`, with that sample's timestamp (the report says at which step a peak came).
    pub step: Option<(i64, i64)>,
}

/// One (node, rank) of a [`Beat`]: `node` is `""` and `rank` `-1` where the sender named none.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RankBeat {
    pub node: String,
    pub rank: i64,
    /// GPUs its samples name (highest `gpu_<i>_` index + 1).
    pub gpus: i64,
    /// Seconds each GPU has been idle, by index, when the collector reports it.
    pub gpu_idle: Vec<Option<f64>>,
    pub memory_limit_mb: Option<f64>,
    pub cpu_limit_cores: Option<f64>,
    /// From the collector's tags `mlscope/rank-<r>/<fact>`.
    pub outcome: Option<String>,
    pub exit_code: Option<i64>,
    pub pod: Option<String>,
    pub gpu_model: Option<String>,
    /// What its collector judged GPU idleness on (`health::basis`).
    pub gpu_idle_basis: Option<&'static str>,
    /// Whether the request carried system samples of this rank (not only its tags).
    pub sampled: bool,
    /// Timestamps (the sender's, unix ms) of the rank's system samples: earliest and latest.
    pub sampled_between: Option<(i64, i64)>,
    /// Each idle-clock reading: (GPU index, timestamp, idle seconds).
    pub idle_readings: Vec<(i64, i64, f64)>,
    /// Each reading of a series the run's report keeps: (series, timestamp, value).
    pub usage: Vec<(Series, i64, f64)>,
}

impl Beat {
    /// The entry for `(node, rank)`, added when new.
    pub fn rank_mut(&mut self, node: &str, rank: i64) -> &mut RankBeat {
        let index = match self
            .ranks
            .iter()
            .position(|r| r.node == node && r.rank == rank)
        {
            Some(i) => i,
            None => {
                self.ranks.push(RankBeat {
                    node: node.to_owned(),
                    rank,
                    ..RankBeat::default()
                });
                self.ranks.len() - 1
            }
        };
        &mut self.ranks[index]
    }

    /// Whether [`Beat::observe_metric`] uses the value of metric `name` (otherwise any sample
    /// of it says the same).
    pub fn needs_value(name: &str) -> bool {
        matches!(
            name,
            "container_memory_limit_megabytes" | "container_cpu_limit_cores"
        ) || gpu_name(name).is_some_and(|(_, suffix)| suffix == "idle_seconds")
            || Series::of_metric(name).is_some()
    }

    /// Notes a sample of the run's own metrics (outside `system/`): its step, when higher.
    pub fn observe_step(&mut self, step: i64, at_ms: i64) {
        if self.step.is_none_or(|(s, _)| step > s) {
            self.step = Some((step, at_ms));
        }
    }

    /// Reads one system metric of a rank: GPU count and idleness, container limits, and the
    /// series of its report.
    /// `at_ms` is the sample's timestamp, when its value is read (idle clocks are billed by it).
    pub fn observe_metric(
        &mut self,
        node: &str,
        rank: i64,
        name: &str,
        value: f64,
        at_ms: Option<i64>,
    ) {
        let entry = self.rank_mut(node, rank);
        entry.sampled = true;
        if let (Some(series), Some(at), true) = (Series::of_metric(name), at_ms, value.is_finite())
        {
            entry.usage.push((series, at, value));
        }
        if let Some((index, suffix)) = gpu_name(name) {
            entry.gpus = entry.gpus.max(index + 1);
            if suffix == "idle_seconds" && value.is_finite() && value >= 0.0 {
                if let Some(at) = at_ms {
                    entry.idle_readings.push((index, at, value));
                }
                let index = index as usize;
                if entry.gpu_idle.len() <= index {
                    entry.gpu_idle.resize(index + 1, None);
                }
                entry.gpu_idle[index] = Some(value);
            }
        } else if value.is_finite() && value > 0.0 {
            match name {
                "container_memory_limit_megabytes" => entry.memory_limit_mb = Some(value),
                "container_cpu_limit_cores" => entry.cpu_limit_cores = Some(value),
                _ => {}
            }
        }
    }

    /// Notes the timestamp of one system sample of a rank (its billed span).
    pub fn observe_time(&mut self, node: &str, rank: i64, at_ms: i64) {
        let entry = self.rank_mut(node, rank);
        entry.sampled_between = Some(match entry.sampled_between {
            Some((first, last)) => (first.min(at_ms), last.max(at_ms)),
            None => (at_ms, at_ms),
        });
    }

    /// Reads one run tag: the collector's `mlscope/rank-<r>/<fact>`, taken only from rank `r`
    /// itself (the request's `X-Mlscope-Rank` header, `header_rank`): another sender cannot end
    /// a rank it is not. Other tags are ignored.
    pub fn observe_tag(
        &mut self,
        header_node: Option<&str>,
        header_rank: Option<u32>,
        key: &str,
        value: &str,
    ) {
        if let Some(finding) = findings::of_tag(header_node, header_rank, key, value) {
            self.findings.push(finding);
        }
        let Some(rest) = key.strip_prefix("mlscope/rank-") else {
            return;
        };
        let Some((rank, fact)) = rest.split_once('/') else {
            return;
        };
        let Ok(rank) = rank.parse::<u32>() else {
            return;
        };
        if header_rank != Some(rank) {
            return;
        }
        let value: String = value.chars().take(256).collect();
        // The node a rank reports itself on; the request's header otherwise.
        let node = header_node.unwrap_or_default().to_owned();
        let entry = self.rank_mut(&node, i64::from(rank));
        match fact {
            "outcome" => entry.outcome = Some(value),
            "exit_code" => entry.exit_code = value.parse().ok(),
            "pod" => entry.pod = Some(value),
            "gpu_model" => entry.gpu_model = Some(value),
            "gpu_idle_basis" => entry.gpu_idle_basis = basis::parse(&value),
            "gpu_count" => {
                if let Ok(count) = value.parse::<i64>() {
                    entry.gpus = entry.gpus.max(count.clamp(0, MAX_GPUS_PER_RANK));
                }
            }
            _ => {}
        }
    }
}

/// `gpu_<i>_<suffix>` → `(i, suffix)`.
fn gpu_name(name: &str) -> Option<(i64, &str)> {
    let rest = name.strip_prefix("gpu_")?;
    let (index, suffix) = rest.split_once('_')?;
    let index: i64 = index.parse().ok()?;
    (index < MAX_GPUS_PER_RANK).then_some((index, suffix))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_beat_reads_gpus_limits_and_the_wrappers_tags() {
        let mut beat = Beat {
            run_id: "r".into(),
            ..Beat::default()
        };
        beat.observe_metric("n", 3, "gpu_1_utilization_percentage", 0.0, Some(1));
        beat.observe_metric("n", 3, "gpu_1_idle_seconds", 120.0, Some(1));
        beat.observe_metric("n", 3, "container_memory_limit_megabytes", 65536.0, Some(1));
        beat.observe_metric("n", 3, "container_cpu_limit_cores", 8.0, Some(1));
        beat.observe_metric("n", 3, "gpu_99_idle_seconds", 1.0, Some(1));
        beat.observe_tag(Some("n"), Some(3), "mlscope/rank-3/outcome", "oom_killed");
        beat.observe_tag(Some("n"), Some(3), "mlscope/rank-3/exit_code", "137");
        beat.observe_tag(Some("n"), Some(3), "mlscope/rank-3/pod", "train-3");
        beat.observe_tag(
            Some("n"),
            Some(3),
            "mlscope/rank-3/gpu_idle_basis",
            "sm_active",
        );
        beat.observe_tag(Some("n"), Some(3), "mlflow.user", "x");
        beat.observe_tag(Some("n"), Some(3), "mlscope/rank-x/outcome", "killed");
        // Another rank's sender, or one that names no rank, cannot end rank 3 (nor add a rank).
        beat.observe_tag(Some("n"), Some(0), "mlscope/rank-3/outcome", "killed");
        beat.observe_tag(None, None, "mlscope/rank-4/outcome", "killed");
        assert_eq!(beat.ranks.len(), 1);
        let rank = &beat.ranks[0];
        assert_eq!(rank.gpus, 2);
        // The idle clock with its sample's time, for the bill (GPU 99 is no device).
        assert_eq!(rank.idle_readings, [(1, 1, 120.0)]);
        assert_eq!(rank.gpu_idle, [None, Some(120.0)]);
        assert_eq!(
            (rank.memory_limit_mb, rank.cpu_limit_cores),
            (Some(65536.0), Some(8.0))
        );
        assert_eq!(rank.outcome.as_deref(), Some("oom_killed"));
        assert_eq!(
            (rank.exit_code, rank.pod.as_deref()),
            (Some(137), Some("train-3"))
        );
        assert_eq!(rank.gpu_idle_basis, Some("sm_active"));
        // Only the words the contract knows.
        beat.observe_tag(
            Some("n"),
            Some(3),
            "mlscope/rank-3/gpu_idle_basis",
            "<b>idle</b>",
        );
        assert_eq!(beat.ranks[0].gpu_idle_basis, None);
    }

    #[test]
    fn the_gpu_count_tag_and_sample_times_make_a_ranks_allocation_and_span() {
        let mut beat = Beat::default();
        beat.observe_time("n", 0, 5_000);
        beat.observe_time("n", 0, 1_000);
        beat.observe_tag(Some("n"), Some(0), "mlscope/rank-0/gpu_count", "8");
        // Beyond any real device: capped.
        beat.observe_tag(Some("n"), Some(1), "mlscope/rank-1/gpu_count", "100000");
        assert_eq!(beat.ranks[0].sampled_between, Some((1_000, 5_000)));
        assert_eq!(beat.ranks[0].gpus, 8);
        assert_eq!(beat.ranks[1].gpus, MAX_GPUS_PER_RANK);
    }
}
