//! Run health in the store: its rows and every statement on them, apart from the proxy's other
//! state: heartbeats per (run, node, rank) ([`ranks`]), GPU idle clocks and the idle-GPU tags
//! written ([`gpu_idle`]), bills ([`bills`]), verdicts ([`verdicts`]) and what runs stood on
//! ([`findings`]). Every write is one statement, correct when several replicas share one
//! PostgreSQL; the statements are in the SQL both backends share (see [`crate::store`]).

mod bills;
mod findings;
mod gpu_idle;
mod ranks;
mod verdicts;

pub use bills::BillRow;
pub use findings::{FindingRow, MAX_FINDINGS_PER_RUN};
pub use gpu_idle::GpuIdleRow;
pub use ranks::{RankRow, SUPERSEDE_AFTER_MS};
pub use verdicts::VerdictRow;

use crate::store::Store;

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

    /// Run health's rows go with the store's retention sweep (`Store::sweep`), as the store's
    /// own do.
    #[tokio::test]
    async fn health_rows_untouched_for_the_retention_period_are_swept_and_fresh_ones_kept() {
        use std::time::{Duration, SystemTime};

        use crate::store::{unix_millis, Swept};

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

        let swept = store.0.sweep(14 * day, now).await.unwrap();
        assert_eq!(
            swept,
            Swept {
                run_ranks: 1,
                verdicts: 0,
                bills: 1,
                findings: 1,
                ..Swept::default()
            }
        );
        assert!(store.bill_of("old-run").await.unwrap().is_none());
        assert!(store.bill_of("heard-run").await.unwrap().is_some());
        // A month later everything has expired; sweeping again is harmless.
        let later = now + 30 * day;
        assert_eq!(
            store.0.sweep(14 * day, later).await.unwrap(),
            Swept {
                run_ranks: 1,
                verdicts: 0,
                bills: 1,
                findings: 1,
                ..Swept::default()
            }
        );
        assert_eq!(
            store.0.sweep(14 * day, later).await.unwrap(),
            Swept::default()
        );
    }
}
