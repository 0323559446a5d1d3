//! Retention: rows that grow with client input (a lease per run and node, a failure counter per
//! run, a row per replica) are deleted once nothing has touched them for the retention period.
//! Each delete is one idempotent statement, so every replica may sweep at any time.

use std::time::{Duration, SystemTime};

use super::{unix_millis, Store, StoreError};

/// Rows removed by one sweep.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Swept {
    pub leases: u64,
    pub upload_failures: u64,
    pub replicas: u64,
    /// Heartbeat rows of runs not heard from, and verdicts about runs judged, that long ago.
    pub run_ranks: u64,
    pub verdicts: u64,
    /// GPU idle windows, bills and idle-tag records of runs that old.
    pub gpu_idle: u64,
    pub bills: u64,
    pub idle_tags: u64,
    /// What collectors reported about runs (data changes, leftover processes) heard that long ago.
    pub findings: u64,
}

impl Store {
    /// Deletes leases not renewed, failure counters not updated and replicas not seen for
    /// `retention` (measured from `now`).
    pub async fn sweep(&self, retention: Duration, now: SystemTime) -> Result<Swept, StoreError> {
        let cutoff = unix_millis(now) - retention.as_millis().min(i64::MAX as u128) as i64;
        let delete = |sql: &'static str| async move {
            let affected = on_backend!(self, |pool| sqlx::query(sql)
                .bind(cutoff)
                .execute(pool)
                .await?
                .rows_affected());
            Ok::<u64, StoreError>(affected)
        };
        Ok(Swept {
            leases: delete("DELETE FROM node_leases WHERE renewed_at < $1").await?,
            upload_failures: delete("DELETE FROM artifact_upload_failures WHERE updated_at < $1")
                .await?,
            replicas: delete("DELETE FROM proxy_replicas WHERE last_seen_at < $1").await?,
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
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Replica;

    /// The store's own rows here; run health's rows expire by the same sweep (its test is in
    /// `health::store`).
    #[tokio::test]
    async fn rows_untouched_for_the_retention_period_are_swept_and_fresh_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&format!("sqlite://{}/s.db", dir.path().display()))
            .await
            .unwrap();
        let now = SystemTime::now();
        let day = Duration::from_secs(86_400);
        let old = unix_millis(now - 20 * day);
        store
            .elect("old-run", "n1", 0, old, old - 1, 0)
            .await
            .unwrap();
        store
            .elect(
                "new-run",
                "n1",
                0,
                unix_millis(now),
                unix_millis(now) - 1,
                0,
            )
            .await
            .unwrap();
        store
            .record_upload_failure("new-run", "a", "e")
            .await
            .unwrap();
        store.refresh_replica(&Replica::new()).await.unwrap();

        let swept = store.sweep(14 * day, now).await.unwrap();
        assert_eq!(
            swept,
            Swept {
                leases: 1,
                upload_failures: 0,
                replicas: 0,
                ..Swept::default()
            }
        );
        assert!(store.lease("old-run", "n1").await.unwrap().is_none());
        assert!(store.lease("new-run", "n1").await.unwrap().is_some());
        // A month later everything has expired; sweeping again is harmless.
        let later = now + 30 * day;
        assert_eq!(
            store.sweep(14 * day, later).await.unwrap(),
            Swept {
                leases: 1,
                upload_failures: 1,
                replicas: 1,
                ..Swept::default()
            }
        );
        assert_eq!(
            store.sweep(14 * day, later).await.unwrap(),
            Swept::default()
        );
    }
}
