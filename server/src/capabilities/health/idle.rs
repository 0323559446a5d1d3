//! Idle GPUs of live runs: a GPU idle past `--gpu-idle-after` (the collector's idle clock, grown
//! by the time since its report) is named in its run's [`IDLE_TAG`] beside what idleness was
//! judged on ([`super::basis`]), written when the set changes and deleted when the GPUs work again
//! or the run is no longer live; the same figures feed the gauges and the health view.

use std::collections::HashMap;

use super::calls::failure;
use super::store::RankRow;
use super::{basis, truncate, Health, MAX_GAUGE_RUNS};
use crate::plumbing::mlflow::Caller;

/// The tag naming a live run's GPUs idle past `--gpu-idle-after`.
pub const IDLE_TAG: &str = "mlscope.gpus_idle";

impl Health {
    /// Names the GPUs of each live run idle past `--gpu-idle-after` in its [`IDLE_TAG`], written
    /// when the set changes (the store remembers what was written, whichever replica sweeps) and
    /// deleted when they all work again or the run is no longer live.
    pub(super) async fn mark_idle_gpus<'a>(
        &self,
        live: impl Iterator<Item = &'a [RankRow]>,
        now_ms: i64,
    ) {
        let written = match self.inner.store.idle_tags(2 * MAX_GAUGE_RUNS as i64).await {
            Ok(rows) => rows,
            Err(error) => {
                tracing::warn!(%error, "reading idle-GPU tags failed");
                self.inner.metrics.health_error("store");
                return;
            }
        };
        let mut written: HashMap<String, String> = written.into_iter().collect();
        let idle_after = self.inner.config.gpu_idle_after.as_secs_f64();
        for ranks in live {
            let run_id = ranks[0].run_id.as_str();
            let value = idle_gpus(ranks, now_ms, idle_after);
            let before = written.remove(run_id);
            if before.as_deref() == value.as_deref() {
                continue;
            }
            let caller = self.run_caller(ranks);
            let done = match &value {
                Some(value) => {
                    let mut tags = vec![(IDLE_TAG.to_owned(), value.clone())];
                    tags.extend(
                        basis::of_run(ranks).map(|b| (basis::BASIS_TAG.to_owned(), truncate(&b))),
                    );
                    match self.write_tags(run_id, &caller, &tags).await {
                        Ok(()) => self
                            .inner
                            .store
                            .set_idle_tag(run_id, Some(value), now_ms)
                            .await
                            .map(|_| ())
                            .map_err(|e| ("store", e.to_string())),
                        Err(e) => Err(e),
                    }
                }
                None => self.clear_idle_tag(run_id, &caller).await,
            };
            if let Err((reason, error)) = done {
                tracing::warn!(
                    run_id,
                    error,
                    "updating the idle-GPU tag failed; retried next sweep"
                );
                self.inner.metrics.health_error(reason);
            }
        }
        // Tags of runs no longer live (silent, or ended without a bill yet).
        for run_id in written.into_keys() {
            let ranks = self
                .inner
                .store
                .ranks_of_run(&run_id)
                .await
                .unwrap_or_default();
            if let Err((reason, error)) =
                self.clear_idle_tag(&run_id, &self.run_caller(&ranks)).await
            {
                tracing::warn!(run_id, error, "removing an idle-GPU tag failed");
                self.inner.metrics.health_error(reason);
            }
        }
    }

    /// Deletes the run's [`IDLE_TAG`] in MLflow when the store says it was written.
    pub(super) async fn clear_idle_tag(
        &self,
        run_id: &str,
        caller: &Caller,
    ) -> Result<(), (&'static str, String)> {
        let written = self
            .inner
            .store
            .idle_tags_of(run_id)
            .await
            .map_err(|e| ("store", e.to_string()))?;
        if !written {
            return Ok(());
        }
        match self.inner.mlflow.delete_tag(caller, run_id, IDLE_TAG).await {
            Ok(()) => {}
            // Already gone (deleted by someone, or never stored): nothing left to remove.
            Err(e)
                if !e.refused_credential() && e.error_code() == Some("RESOURCE_DOES_NOT_EXIST") => {
            }
            Err(e) => return Err(failure(e)),
        }
        self.inner
            .store
            .set_idle_tag(run_id, None, 0)
            .await
            .map_err(|e| ("store", e.to_string()))
    }
}

/// The value of a live run's [`IDLE_TAG`]: its GPUs idle for at least `idle_after` seconds, as
/// `rank-0:gpu1, rank-1:gpu0`; `None` when none is.
pub(super) fn idle_gpus(ranks: &[RankRow], now_ms: i64, idle_after: f64) -> Option<String> {
    let mut idle: Vec<(i64, String, i64)> = Vec::new();
    for r in ranks.iter().filter(|r| r.outcome.is_none()) {
        for (gpu, seconds) in gpu_idle_of(r, now_ms).into_iter().enumerate() {
            if seconds.is_some_and(|s| s >= idle_after) {
                idle.push((r.rank, r.node.clone(), gpu as i64));
            }
        }
    }
    if idle.is_empty() {
        return None;
    }
    idle.sort();
    let names: Vec<String> = idle
        .into_iter()
        .map(|(rank, node, gpu)| match (rank >= 0, node.is_empty()) {
            (true, _) => format!("rank-{rank}:gpu{gpu}"),
            (false, false) => format!("{node}:gpu{gpu}"),
            (false, true) => format!("monitor:gpu{gpu}"),
        })
        .collect();
    Some(truncate(&names.join(", ")))
}

/// The rank's GPU idle seconds as of `now_ms`: a GPU idle at the last report has stayed idle
/// since, as far as anyone knows.
pub(super) fn gpu_idle_of(rank: &RankRow, now_ms: i64) -> Vec<Option<f64>> {
    let Some(text) = &rank.gpu_idle else {
        return Vec::new();
    };
    let since = ((now_ms - rank.gpu_idle_ms.unwrap_or(now_ms)).max(0) as f64) / 1e3;
    serde_json::from_str::<Vec<Option<f64>>>(text)
        .unwrap_or_default()
        .into_iter()
        .map(|idle| idle.map(|s| if s > 0.0 { s + since } else { s }))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_idle_tag_names_ranks_and_gpus_idle_past_the_threshold() {
        let row = |rank: i64, idle: &str| RankRow {
            run_id: "r".into(),
            node: "n".into(),
            rank,
            gpus: 2,
            gpu_idle: Some(idle.into()),
            gpu_idle_ms: Some(10_000),
            ..RankRow::default()
        };
        let ranks = [row(0, "[0,1800]"), row(1, "[1800,10]")];
        assert_eq!(
            idle_gpus(&ranks, 10_000, 1800.0).as_deref(),
            Some("rank-0:gpu1, rank-1:gpu0")
        );
        assert_eq!(idle_gpus(&ranks, 10_000, 3600.0), None);
    }

    #[test]
    fn idle_seconds_grow_with_the_time_since_the_report() {
        let row = RankRow {
            run_id: "r".into(),
            node: "n".into(),
            rank: 0,
            first_heard_ms: 0,
            last_heard_ms: 0,
            interval_ms: None,
            outcome: None,
            exit_code: None,
            ended_ms: None,
            pod: None,
            memory_limit_mb: None,
            cpu_limit_cores: None,
            gpu_model: None,
            gpus: 2,
            gpu_idle: Some("[0,100.5]".into()),
            gpu_idle_ms: Some(10_000),
            ..RankRow::default()
        };
        assert_eq!(gpu_idle_of(&row, 12_000), [Some(0.0), Some(102.5)]);
    }
}
