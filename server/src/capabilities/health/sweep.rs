//! The sweep, every `--health-sweep-interval`: the live runs' gauges on every replica; on the
//! replica holding the sweep lease, the verdicts on dead runs ([`super::verdict`]), the bills of
//! runs that ended ([`super::bill`]) and the idle-GPU tags of live ones ([`super::idle`]).

use super::judge::judge;
use super::store::RankRow;
use super::{gpu_idle_of, Health, MAX_GAUGE_RUNS};

/// Runs examined per sweep.
const MAX_SWEPT_RUNS: i64 = 5_000;
/// The lease name of the stale-run sweep.
const SWEEP_LEASE: &str = "stale-run-sweep";
/// Runs whose ranks all exited 0 asked about at MLflow per sweep (ended there, not through the
/// proxy, they are billed).
const MAX_CLEAN_ENDS_PER_SWEEP: usize = 50;
/// Series of the run report merged into wider buckets per sweep, at most.
const MAX_COMPACTED_PER_SWEEP: i64 = 200;

impl Health {
    /// Refreshes the gauges and, on the replica holding the sweep lease, judges open runs.
    pub async fn sweep(&self, now_ms: i64) {
        let config = &self.inner.config;
        let stale_ms = config.stale_after.as_millis() as i64;
        // Every open run the store still keeps (retention drops older rows), read once: the
        // live ones are gauged, and the replica holding the sweep lease judges them all.
        let rows = match self.inner.store.ranks_of_open_runs(0, MAX_SWEPT_RUNS).await {
            Ok(rows) => rows,
            Err(error) => {
                tracing::warn!(%error, "reading open runs failed");
                self.inner.metrics.health_error("store");
                return;
            }
        };
        let live = by_run(&rows)
            .filter(|ranks| ranks.iter().any(|r| r.last_heard_ms >= now_ms - stale_ms))
            .take(MAX_GAUGE_RUNS);
        self.inner.metrics.set_live_runs(&self.gauges(live, now_ms));
        let lease_until = now_ms + 3 * config.sweep_interval.as_millis() as i64;
        match self
            .inner
            .store
            .shared()
            .hold_lease(SWEEP_LEASE, &self.inner.replica_id, now_ms, lease_until)
            .await
        {
            Ok(true) => {}
            Ok(false) => return,
            Err(error) => {
                tracing::warn!(%error, "taking the stale-run sweep lease failed");
                self.inner.metrics.health_error("store");
                return;
            }
        }
        let mut clean_ends_asked = 0;
        for ranks in by_run(&rows) {
            match judge(ranks, now_ms, config.stale_after) {
                Some(judgement) => {
                    self.carry_out(&ranks[0].run_id, ranks, &judgement, now_ms)
                        .await
                }
                None if ended_cleanly(ranks) && clean_ends_asked < MAX_CLEAN_ENDS_PER_SWEEP => {
                    clean_ends_asked += 1;
                    self.bill_clean_end(&ranks[0].run_id, ranks, now_ms).await;
                }
                None => {}
            }
        }
        // Series of more than a report's points are merged into wider buckets.
        if let Err(error) = self
            .inner
            .store
            .compact_series(MAX_COMPACTED_PER_SWEEP)
            .await
        {
            tracing::warn!(%error, "merging the report's series failed");
            self.inner.metrics.health_error("store");
        }
        let billed = self.bill_due(now_ms).await;
        let live = by_run(&rows)
            .filter(|ranks| ranks.iter().any(|r| r.last_heard_ms >= now_ms - stale_ms))
            .filter(|ranks| !billed.contains(&ranks[0].run_id))
            .take(MAX_GAUGE_RUNS);
        self.mark_idle_gpus(live, now_ms).await;
    }

    /// Per live run: GPUs allocated and GPUs idle past `--gpu-idle-after`.
    fn gauges<'a>(
        &self,
        runs: impl Iterator<Item = &'a [RankRow]>,
        now_ms: i64,
    ) -> Vec<(String, i64, i64)> {
        let idle_after = self.inner.config.gpu_idle_after.as_secs_f64();
        runs.map(|ranks| {
            let live = ranks.iter().filter(|r| r.outcome.is_none());
            let (mut allocated, mut idle) = (0, 0);
            for rank in live {
                let gpus = gpu_idle_of(rank, now_ms);
                allocated += rank.gpus.max(gpus.len() as i64);
                idle += gpus
                    .iter()
                    .filter(|s| s.is_some_and(|s| s >= idle_after))
                    .count() as i64;
            }
            (ranks[0].run_id.clone(), allocated, idle)
        })
        .collect()
    }
}

/// Whether every rank of the run reported its end with exit status 0 (the wrapper's word).
fn ended_cleanly(ranks: &[RankRow]) -> bool {
    !ranks.is_empty()
        && ranks
            .iter()
            .all(|r| r.outcome.as_deref() == Some("exited") && r.exit_code.unwrap_or(0) == 0)
}

/// Consecutive rows of one run (rows come ordered by run).
fn by_run(rows: &[RankRow]) -> impl Iterator<Item = &[RankRow]> {
    rows.chunk_by(|a, b| a.run_id == b.run_id)
}
