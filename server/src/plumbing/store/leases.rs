//! Node leases: the election state of node-series deduplication. Every change of reporter is a
//! compare-and-set in one statement, correct when several proxy replicas share one PostgreSQL.
//! Work leases: one holder at a time of work one replica does for all (the stale-run sweep).

use super::{Store, StoreError};

/// A lease row as stored.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct NodeLease {
    pub run_id: String,
    pub node: String,
    pub reporter_rank: i64,
    pub epoch: i64,
    pub renewed_at: i64,
    pub step_offset: i64,
    pub last_step: i64,
    /// Latest sample time written to the node series (unix ms), -1 if none.
    pub last_timestamp: i64,
    /// The previous reporters' latest sample time at this reporter's election (unix ms), -1 if
    /// none: the reporter's samples measured at or before it are dropped, the series having them.
    pub covered_until: i64,
}

const COLUMNS: &str = "run_id, node, reporter_rank, epoch, renewed_at, step_offset, last_step, \
                       last_timestamp, covered_until";

impl Store {
    pub async fn lease(&self, run_id: &str, node: &str) -> Result<Option<NodeLease>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM node_leases WHERE run_id = $1 AND node = $2");
        let lease = on_backend!(self, |pool| sqlx::query_as(&sql)
            .bind(run_id)
            .bind(node)
            .fetch_optional(pool)
            .await?);
        Ok(lease)
    }

    pub async fn leases_of_run(&self, run_id: &str) -> Result<Vec<NodeLease>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM node_leases WHERE run_id = $1 ORDER BY node");
        let leases = on_backend!(self, |pool| sqlx::query_as(&sql)
            .bind(run_id)
            .fetch_all(pool)
            .await?);
        Ok(leases)
    }

    /// Makes `rank` the reporter if the (run, node) has none, or if the current one has not
    /// renewed since `expired_before`. Returns the new lease, or `None` when another rank holds
    /// a live one. `first_step` is the candidate's first node-series step: its offset continues
    /// the series after the highest step written so far.
    pub async fn elect(
        &self,
        run_id: &str,
        node: &str,
        rank: i64,
        now: i64,
        expired_before: i64,
        first_step: i64,
    ) -> Result<Option<NodeLease>, StoreError> {
        let insert = format!(
            "INSERT INTO node_leases ({COLUMNS}) VALUES ($1, $2, $3, 1, $4, 0, -1, -1, -1) \
             ON CONFLICT (run_id, node) DO NOTHING RETURNING {COLUMNS}"
        );
        let inserted: Option<NodeLease> = on_backend!(self, |pool| sqlx::query_as(&insert)
            .bind(run_id)
            .bind(node)
            .bind(rank)
            .bind(now)
            .fetch_optional(pool)
            .await?);
        if inserted.is_some() {
            return Ok(inserted);
        }
        let takeover = format!(
            "UPDATE node_leases SET reporter_rank = $3, epoch = epoch + 1, renewed_at = $4, \
             step_offset = CASE WHEN last_step + 1 > $6 THEN last_step + 1 - $6 ELSE 0 END, \
             covered_until = last_timestamp \
             WHERE run_id = $1 AND node = $2 AND renewed_at < $5 RETURNING {COLUMNS}"
        );
        let taken = on_backend!(self, |pool| sqlx::query_as(&takeover)
            .bind(run_id)
            .bind(node)
            .bind(rank)
            .bind(now)
            .bind(expired_before)
            .bind(first_step)
            .fetch_optional(pool)
            .await?);
        Ok(taken)
    }

    /// Extends the reporter's seat and records the highest step and sample time written. Fails (returns false)
    /// when the lease changed hands since `epoch`.
    pub async fn renew(&self, lease: &NodeLease, now: i64) -> Result<bool, StoreError> {
        let sql = "UPDATE node_leases SET renewed_at = $5, \
                   last_step = CASE WHEN last_step < $6 THEN $6 ELSE last_step END, \
                   last_timestamp = CASE WHEN last_timestamp < $7 THEN $7 ELSE last_timestamp END \
                   WHERE run_id = $1 AND node = $2 AND reporter_rank = $3 AND epoch = $4";
        let result = on_backend!(self, |pool| sqlx::query(sql)
            .bind(&lease.run_id)
            .bind(&lease.node)
            .bind(lease.reporter_rank)
            .bind(lease.epoch)
            .bind(now)
            .bind(lease.last_step)
            .bind(lease.last_timestamp)
            .execute(pool)
            .await?
            .rows_affected());
        Ok(result == 1)
    }

    /// Takes or extends the named lease until `expires_ms`: true when `holder` holds it.
    pub async fn hold_lease(
        &self,
        name: &str,
        holder: &str,
        now: i64,
        expires_ms: i64,
    ) -> Result<bool, StoreError> {
        let sql = "INSERT INTO work_leases (name, holder, expires_ms) VALUES ($1, $2, $3) \
                   ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, \
                     expires_ms = excluded.expires_ms \
                   WHERE work_leases.holder = excluded.holder OR work_leases.expires_ms < $4 \
                   RETURNING holder";
        let held: Option<String> = on_backend!(self, |pool| sqlx::query_scalar(sql)
            .bind(name)
            .bind(holder)
            .bind(expires_ms)
            .bind(now)
            .fetch_optional(pool)
            .await?);
        Ok(held.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_holder_at_a_time_until_the_lease_expires() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&format!("sqlite://{}/s.db", dir.path().display()))
            .await
            .unwrap();
        assert!(store.hold_lease("sweep", "a", 0, 100).await.unwrap());
        assert!(!store.hold_lease("sweep", "b", 50, 150).await.unwrap());
        assert!(store.hold_lease("sweep", "a", 60, 160).await.unwrap());
        assert!(store.hold_lease("sweep", "b", 161, 261).await.unwrap());
        assert!(!store.hold_lease("sweep", "a", 200, 300).await.unwrap());
    }
}
