//! Run health in the store: its rows and every statement on them, apart from the proxy's other
//! state: heartbeats per (run, node, rank) ([`ranks`]), GPU idle clocks and the idle-GPU tags
//! written ([`gpu_idle`]), bills ([`bills`]), verdicts ([`verdicts`]) and what runs stood on
//! ([`findings`]). Every write is one statement, correct when several replicas share one
//! PostgreSQL; the statements are in the SQL both backends share (see [`crate::plumbing::store`]).

mod bills;
mod findings;
mod gpu_idle;
mod ranks;
mod usage;
mod verdicts;

pub use bills::BillRow;
pub use findings::{FindingRow, MAX_FINDINGS_PER_RUN};
pub use gpu_idle::GpuIdleRow;
pub use ranks::{RankRow, SUPERSEDE_AFTER_MS};
pub use usage::{by_rank, rows_of, HistogramRow, SeriesRow};
pub use verdicts::VerdictRow;

use std::time::{Duration, SystemTime};

use crate::plumbing::store::{cutoff, Store, StoreError};

/// Run health's rows in the proxy's store; cheap to clone.
#[derive(Debug, Clone)]
pub struct HealthStore(Store);

impl HealthStore {
    pub fn new(store: Store) -> Self {
        Self(store)
    }

    /// The proxy's store these rows are in (its work leases, for one).
    pub fn shared(&self) -> &Store {
        &self.0
    }

    /// Deletes run health's rows untouched for `retention` (measured from `now`), as the store
    /// deletes its own (`Store::sweep`): heartbeats of runs not heard from, verdicts, idle
    /// clocks, bills, idle-tag records and findings that old.
    pub async fn sweep_expired(
        &self,
        retention: Duration,
        now: SystemTime,
    ) -> Result<HealthSwept, StoreError> {
        let cutoff = cutoff(retention, now);
        let delete = |sql: &'static str| self.0.delete_older(sql, cutoff);
        Ok(HealthSwept {
            run_ranks: delete("DELETE FROM run_ranks WHERE last_heard_ms < $1").await?,
            verdicts: delete("DELETE FROM run_verdicts WHERE claimed_ms < $1").await?,
            gpu_idle: delete("DELETE FROM rank_gpu_idle WHERE last_ms < $1").await?,
            // A bill outlives the run's heartbeat rows (deleted above): while they are kept the
            // run would be judged and billed again without it.
            bills: delete(
                "DELETE FROM run_bills WHERE due_ms < $1 AND NOT EXISTS \
                 (SELECT 1 FROM run_ranks r WHERE r.run_id = run_bills.run_id)",
            )
            .await?,
            idle_tags: delete("DELETE FROM run_idle_tags WHERE written_ms < $1").await?,
            findings: delete("DELETE FROM run_findings WHERE heard_ms < $1").await?,
            // A live run's early buckets are as old as the run: only a run without heartbeat
            // rows (deleted above) loses its usage.
            usage: delete(
                "DELETE FROM rank_series WHERE bucket_ms < $1 AND NOT EXISTS \
                 (SELECT 1 FROM run_ranks r WHERE r.run_id = rank_series.run_id)",
            )
            .await?
                + delete(
                    "DELETE FROM rank_histogram WHERE last_ms < $1 AND NOT EXISTS \
                     (SELECT 1 FROM run_ranks r WHERE r.run_id = rank_histogram.run_id)",
                )
                .await?,
        })
    }
}

/// Run health's rows removed by one retention sweep.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HealthSwept {
    /// Heartbeat rows of runs not heard from, and verdicts about runs judged, that long ago.
    pub run_ranks: u64,
    pub verdicts: u64,
    /// GPU idle windows, bills and idle-tag records of runs that old.
    pub gpu_idle: u64,
    pub bills: u64,
    pub idle_tags: u64,
    /// What collectors reported about runs (data changes, leftover processes) heard that long ago.
    pub findings: u64,
    /// The report's buckets and histogram rows of runs gone from the store that long ago.
    pub usage: u64,
}

/// A store of run health's own, in a fresh SQLite file of `dir`.
#[cfg(test)]
async fn opened(dir: &tempfile::TempDir) -> HealthStore {
    HealthStore::new(
        Store::open(&format!("sqlite://{}/s.db", dir.path().display()))
            .await
            .unwrap(),
    )
}

#[cfg(test)]
fn beat(run: &str, rank: i64, first: i64, last: i64) -> RankRow {
    RankRow {
        run_id: run.into(),
        node: "n1".into(),
        rank,
        first_heard_ms: first,
        last_heard_ms: last,
        ..RankRow::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run health's rows expire as the store's own do (`Store::sweep`).
    #[tokio::test]
    async fn health_rows_untouched_for_the_retention_period_are_swept_and_fresh_ones_kept() {
        use std::time::{Duration, SystemTime};

        use crate::plumbing::store::unix_millis;

        let dir = tempfile::tempdir().unwrap();
        let store = opened(&dir).await;
        let now = SystemTime::now();
        let day = Duration::from_secs(86_400);
        let old = unix_millis(now - 20 * day);
        store
            .record_ranks(&[RankRow {
                run_id: "old-run".into(),
                first_heard_ms: old,
                last_heard_ms: old,
                ..Default::default()
            }])
            .await
            .unwrap();

        // Two old bills: one of a run still heard from (kept with its rows), one of a run whose
        // rows go in this sweep (goes too).
        for run in ["old-run", "heard-run"] {
            store.queue_bill(run, "FINISHED", None, old).await.unwrap();
        }
        store
            .record_ranks(&[RankRow {
                run_id: "heard-run".into(),
                first_heard_ms: old,
                last_heard_ms: unix_millis(now),
                ..Default::default()
            }])
            .await
            .unwrap();

        // A data change heard long ago goes; one heard now stays.
        for (detail, heard_ms) in [("old", old), ("new", unix_millis(now))] {
            store
                .record_findings(&[FindingRow {
                    run_id: "heard-run".into(),
                    kind: "data_changed".into(),
                    detail: detail.into(),
                    heard_ms,
                    ..Default::default()
                }])
                .await
                .unwrap();
        }

        let swept = store.sweep_expired(14 * day, now).await.unwrap();
        assert_eq!(
            swept,
            HealthSwept {
                run_ranks: 1,
                verdicts: 0,
                bills: 1,
                findings: 1,
                ..HealthSwept::default()
            }
        );
        assert!(store.bill_of("old-run").await.unwrap().is_none());
        assert!(store.bill_of("heard-run").await.unwrap().is_some());
        // A month later everything has expired; sweeping again is harmless.
        let later = now + 30 * day;
        assert_eq!(
            store.sweep_expired(14 * day, later).await.unwrap(),
            HealthSwept {
                run_ranks: 1,
                verdicts: 0,
                bills: 1,
                findings: 1,
                ..HealthSwept::default()
            }
        );
        assert_eq!(
            store.sweep_expired(14 * day, later).await.unwrap(),
            HealthSwept::default()
        );
    }
}
