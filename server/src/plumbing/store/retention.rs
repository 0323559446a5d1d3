//! Retention: rows that grow with client input (a lease per run and node, a failure counter per
//! run, a row per replica) are deleted once nothing has touched them for the retention period.
//! Each delete is one idempotent statement, so every replica may sweep at any time. Run health's
//! rows expire the same way, by its own statements (`health::store`).

use std::time::{Duration, SystemTime};

use super::{unix_millis, Store, StoreError};

/// Rows removed by one sweep.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Swept {
    pub leases: u64,
    pub upload_failures: u64,
    pub replicas: u64,
}

impl Store {
    /// Deletes leases not renewed, failure counters not updated and replicas not seen for
    /// `retention` (measured from `now`). A capability with rows of its own expires them the same
    /// way, with [`Store::delete_older`] (run health: `HealthStore::sweep_expired`).
    pub async fn sweep(&self, retention: Duration, now: SystemTime) -> Result<Swept, StoreError> {
        let cutoff = cutoff(retention, now);
        Ok(Swept {
            leases: self
                .delete_older("DELETE FROM node_leases WHERE renewed_at < $1", cutoff)
                .await?,
            upload_failures: self
                .delete_older(
                    "DELETE FROM artifact_upload_failures WHERE updated_at < $1",
                    cutoff,
                )
                .await?,
            replicas: self
                .delete_older("DELETE FROM proxy_replicas WHERE last_seen_at < $1", cutoff)
                .await?,
        })
    }

    /// Runs one retention `DELETE` whose `$1` is the cutoff (unix ms); the rows it removed.
    pub(crate) async fn delete_older(&self, sql: &str, cutoff: i64) -> Result<u64, StoreError> {
        Ok(on_backend!(self, |pool| sqlx::query(sql)
            .bind(cutoff)
            .execute(pool)
            .await?
            .rows_affected()))
    }
}

/// The time (unix ms) before which a row untouched for `retention`, as of `now`, has expired.
pub(crate) fn cutoff(retention: Duration, now: SystemTime) -> i64 {
    unix_millis(now) - retention.as_millis().min(i64::MAX as u128) as i64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plumbing::store::Replica;

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
            }
        );
        assert_eq!(
            store.sweep(14 * day, later).await.unwrap(),
            Swept::default()
        );
    }
}
