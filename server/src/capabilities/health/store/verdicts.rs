//! The stale-run sweep's verdicts: a run claimed once across replicas, done with what was
//! finally decided.

use super::HealthStore;
use crate::plumbing::store::{on_backend, StoreError};

/// A `run_verdicts` row.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct VerdictRow {
    pub run_id: String,
    pub outcome: String,
    pub action: String,
    pub detail: String,
    pub replica: String,
    pub claimed_ms: i64,
    pub done: i64,
}

const VERDICT_COLUMNS: &str = "run_id, outcome, action, detail, replica, claimed_ms, done";

impl HealthStore {
    pub async fn verdict(&self, run_id: &str) -> Result<Option<VerdictRow>, StoreError> {
        let sql = format!("SELECT {VERDICT_COLUMNS} FROM run_verdicts WHERE run_id = $1");
        Ok(on_backend!(&self.0, |pool| sqlx::query_as(&sql)
            .bind(run_id)
            .fetch_optional(pool)
            .await?))
    }

    /// Claims `run_id` for carrying out a verdict: true when this replica may act. A run is
    /// claimed once; a claim that was never finished may be taken over after `abandoned_before`.
    pub async fn claim_verdict(
        &self,
        verdict: &VerdictRow,
        abandoned_before: i64,
    ) -> Result<bool, StoreError> {
        let sql = format!(
            "INSERT INTO run_verdicts ({VERDICT_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, 0) \
             ON CONFLICT (run_id) DO UPDATE SET outcome = excluded.outcome, \
               action = excluded.action, detail = excluded.detail, replica = excluded.replica, \
               claimed_ms = excluded.claimed_ms \
             WHERE run_verdicts.done = 0 AND run_verdicts.claimed_ms < $7 \
             RETURNING run_id"
        );
        let claimed: Option<String> = on_backend!(&self.0, |pool| sqlx::query_scalar(&sql)
            .bind(&verdict.run_id)
            .bind(&verdict.outcome)
            .bind(&verdict.action)
            .bind(&verdict.detail)
            .bind(&verdict.replica)
            .bind(verdict.claimed_ms)
            .bind(abandoned_before)
            .fetch_optional(pool)
            .await?);
        Ok(claimed.is_some())
    }

    /// Marks a claimed verdict done, with what was finally decided (e.g. the client had ended
    /// the run meanwhile).
    pub async fn finish_verdict(
        &self,
        run_id: &str,
        replica: &str,
        outcome: &str,
        action: &str,
        detail: &str,
    ) -> Result<(), StoreError> {
        let sql = "UPDATE run_verdicts SET done = 1, outcome = $3, action = $4, detail = $5 \
                   WHERE run_id = $1 AND replica = $2";
        on_backend!(&self.0, |pool| sqlx::query(sql)
            .bind(run_id)
            .bind(replica)
            .bind(outcome)
            .bind(action)
            .bind(detail)
            .execute(pool)
            .await?
            .rows_affected());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capabilities::health::store::{beat, opened};

    #[tokio::test]
    async fn a_verdict_is_claimed_once_and_an_abandoned_claim_is_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let store = opened(&dir).await;
        let verdict = |replica: &str, at: i64| VerdictRow {
            run_id: "r".into(),
            outcome: "lost".into(),
            action: "end".into(),
            detail: String::new(),
            replica: replica.into(),
            claimed_ms: at,
            done: 0,
        };
        assert!(store.claim_verdict(&verdict("a", 1_000), 0).await.unwrap());
        assert!(!store.claim_verdict(&verdict("b", 1_100), 0).await.unwrap());
        // a never finished: b may take over once the claim is old enough.
        assert!(store
            .claim_verdict(&verdict("b", 70_000), 10_000)
            .await
            .unwrap());
        store
            .finish_verdict("r", "b", "lost", "end", "done")
            .await
            .unwrap();
        assert!(!store
            .claim_verdict(&verdict("a", 900_000), 800_000)
            .await
            .unwrap());
        let row = store.verdict("r").await.unwrap().unwrap();
        assert_eq!((row.replica.as_str(), row.done), ("b", 1));
        // A run with a finished verdict is not open any more.
        store.record_ranks(&[beat("r", 0, 1, 2)]).await.unwrap();
        store.record_ranks(&[beat("s", 0, 1, 2)]).await.unwrap();
        let open = store.ranks_of_open_runs(0, 100).await.unwrap();
        assert_eq!(
            open.iter().map(|r| r.run_id.as_str()).collect::<Vec<_>>(),
            ["s"]
        );
    }
}
