//! The bill queue: a run queued once when it ends, claimed by one replica, done with its figures
//! or given up when MLflow refused the run for good; a run its client resumed is open again.

use super::HealthStore;
use crate::plumbing::store::{on_backend, StoreError};

/// A `run_bills` row.
#[derive(Debug, Clone, Default, PartialEq, sqlx::FromRow)]
pub struct BillRow {
    pub run_id: String,
    pub ended_by: String,
    pub end_ms: Option<i64>,
    pub due_ms: i64,
    pub replica: String,
    pub claimed_ms: i64,
    pub done: i64,
    pub gpu_seconds: Option<f64>,
    pub idle_seconds: Option<f64>,
    /// Why the run was not billed, when MLflow refused it for good (done, without figures).
    pub failure: Option<String>,
    /// When its client resumed the run after it was billed (it is live again, billed once).
    pub reopened_ms: Option<i64>,
    /// The run's report: `written`, or why it could not be.
    pub report: Option<String>,
}

const BILL_COLUMNS: &str = "run_id, ended_by, end_ms, due_ms, replica, claimed_ms, done, \
     gpu_seconds, idle_seconds, failure, reopened_ms, report";

/// SQL that holds when the run `run_id` (an SQL expression) is settled: a replica has claimed its
/// bill (due once every replica had time to flush what it heard before the run ended), and its
/// client has not resumed it since. The bill and the report are made from what the store holds
/// then, so what replicas hear of the run later (ranks that sample on after the run failed, a
/// flush that comes late) is not added to its usage, its GPUs' idle clocks or its ranks' sampled
/// spans.
pub(super) fn settled(run_id: &str) -> String {
    format!(
        "EXISTS (SELECT 1 FROM run_bills b WHERE b.run_id = {run_id} \
         AND b.claimed_ms > 0 AND b.reopened_ms IS NULL)"
    )
}

impl HealthStore {
    /// Queues `run_id` for billing once `due_ms` has passed; a run already queued (or billed)
    /// keeps its first entry: a run is billed once.
    pub async fn queue_bill(
        &self,
        run_id: &str,
        ended_by: &str,
        end_ms: Option<i64>,
        due_ms: i64,
    ) -> Result<(), StoreError> {
        let sql =
            "INSERT INTO run_bills (run_id, ended_by, end_ms, due_ms) VALUES ($1, $2, $3, $4) \
                   ON CONFLICT (run_id) DO NOTHING";
        on_backend!(&self.0, |pool| sqlx::query(sql)
            .bind(run_id)
            .bind(ended_by)
            .bind(end_ms)
            .bind(due_ms)
            .execute(pool)
            .await?
            .rows_affected());
        Ok(())
    }

    /// A run its client resumed (MLflow accepted `runs/update` RUNNING): a bill not done yet is
    /// dropped and the sweep's verdict forgotten, so the run is live again for the sweep; a
    /// bill done stays (the run is not billed again) and is marked reopened at `now`.
    pub async fn reopen_run(&self, run_id: &str, now: i64) -> Result<(), StoreError> {
        on_backend!(&self.0, |pool| {
            let mut tx = pool.begin().await?;
            for sql in [
                "DELETE FROM run_bills WHERE run_id = $1 AND done = 0",
                "DELETE FROM run_verdicts WHERE run_id = $1 AND done = 1",
            ] {
                sqlx::query(sql).bind(run_id).execute(&mut *tx).await?;
            }
            sqlx::query("UPDATE run_bills SET reopened_ms = $2 WHERE run_id = $1 AND done = 1")
                .bind(run_id)
                .bind(now)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
        });
        Ok(())
    }

    /// Up to `limit` bills not done, due at `now` and free to claim (never claimed, or claimed
    /// before `abandoned_before`): those never tried first, then the ones whose last try is
    /// oldest, so a bill that keeps failing never holds back the ones behind it.
    pub async fn due_bills(
        &self,
        now: i64,
        abandoned_before: i64,
        limit: i64,
    ) -> Result<Vec<BillRow>, StoreError> {
        let sql = format!(
            "SELECT {BILL_COLUMNS} FROM run_bills \
             WHERE done = 0 AND due_ms <= $1 AND claimed_ms < $2 \
             ORDER BY claimed_ms, due_ms, run_id LIMIT $3"
        );
        Ok(on_backend!(&self.0, |pool| sqlx::query_as(&sql)
            .bind(now)
            .bind(abandoned_before)
            .bind(limit)
            .fetch_all(pool)
            .await?))
    }

    /// Marks a claimed bill done without figures, with why it cannot be billed (MLflow refused
    /// the run for good): true when `replica` still held the claim.
    pub async fn give_up_bill(
        &self,
        run_id: &str,
        replica: &str,
        failure: &str,
    ) -> Result<bool, StoreError> {
        let sql = "UPDATE run_bills SET done = 1, failure = $3 \
                   WHERE run_id = $1 AND replica = $2 AND done = 0";
        let failure: String = failure.chars().take(500).collect();
        let affected = on_backend!(&self.0, |pool| sqlx::query(sql)
            .bind(run_id)
            .bind(replica)
            .bind(failure)
            .execute(pool)
            .await?
            .rows_affected());
        Ok(affected == 1)
    }

    /// Claims a due bill for `replica`, as a verdict is claimed: true when this replica may bill
    /// the run. A claim never finished may be taken over once older than `abandoned_before`.
    pub async fn claim_bill(
        &self,
        run_id: &str,
        replica: &str,
        now: i64,
        abandoned_before: i64,
    ) -> Result<bool, StoreError> {
        let sql = "UPDATE run_bills SET replica = $2, claimed_ms = $3 \
                   WHERE run_id = $1 AND done = 0 AND due_ms <= $3 AND claimed_ms < $4 \
                   RETURNING run_id";
        let claimed: Option<String> = on_backend!(&self.0, |pool| sqlx::query_scalar(sql)
            .bind(run_id)
            .bind(replica)
            .bind(now)
            .bind(abandoned_before)
            .fetch_optional(pool)
            .await?);
        Ok(claimed.is_some())
    }

    /// Marks a claimed bill done with its figures: true when `replica` still held the claim.
    pub async fn finish_bill(
        &self,
        run_id: &str,
        replica: &str,
        gpu_seconds: f64,
        idle_seconds: f64,
    ) -> Result<bool, StoreError> {
        let sql = "UPDATE run_bills SET done = 1, gpu_seconds = $3, idle_seconds = $4 \
                   WHERE run_id = $1 AND replica = $2 AND done = 0";
        let affected = on_backend!(&self.0, |pool| sqlx::query(sql)
            .bind(run_id)
            .bind(replica)
            .bind(gpu_seconds)
            .bind(idle_seconds)
            .execute(pool)
            .await?
            .rows_affected());
        Ok(affected == 1)
    }

    /// Records what became of a run's report (`written`, or why not).
    pub async fn record_report(&self, run_id: &str, state: &str) -> Result<(), StoreError> {
        let sql = "UPDATE run_bills SET report = $2 WHERE run_id = $1";
        on_backend!(&self.0, |pool| {
            sqlx::query(sql)
                .bind(run_id)
                .bind(state)
                .execute(pool)
                .await?;
        });
        Ok(())
    }

    pub async fn bill_of(&self, run_id: &str) -> Result<Option<BillRow>, StoreError> {
        let sql = format!("SELECT {BILL_COLUMNS} FROM run_bills WHERE run_id = $1");
        Ok(on_backend!(&self.0, |pool| sqlx::query_as(&sql)
            .bind(run_id)
            .fetch_optional(pool)
            .await?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capabilities::health::store::{beat, opened};
    use crate::plumbing::store::Store;

    /// 250 bills that fail every time (claimed, never finished) ahead of a fresh one, and one
    /// MLflow refuses for good.
    async fn bills_that_fail_never_hold_back_the_fresh_ones(store: &HealthStore) {
        for i in 0..250 {
            let run = format!("stuck-{i:03}");
            store.queue_bill(&run, "FINISHED", None, i).await.unwrap();
            assert!(store.claim_bill(&run, "a", 1_000, 1).await.unwrap());
        }
        store
            .queue_bill("fresh", "FINISHED", None, 900)
            .await
            .unwrap();
        // Claimed moments ago: none of the stuck ones is offered; the fresh one is.
        let due = store.due_bills(1_500, 1_000, 200).await.unwrap();
        assert_eq!(
            due.iter().map(|b| b.run_id.as_str()).collect::<Vec<_>>(),
            ["fresh"]
        );
        // Once their claims are old, the fresh one still comes first.
        let due = store.due_bills(100_000, 90_000, 200).await.unwrap();
        assert_eq!((due.len(), due[0].run_id.as_str()), (200, "fresh"));
        // A run MLflow no longer has: done, with the reason, and never offered again.
        assert!(store
            .give_up_bill(
                "stuck-000",
                "a",
                "MLflow answered 404 Not Found to runs/get"
            )
            .await
            .unwrap());
        assert!(!store.give_up_bill("stuck-001", "b", "x").await.unwrap());
        let bill = store.bill_of("stuck-000").await.unwrap().unwrap();
        assert_eq!(
            (bill.done, bill.gpu_seconds, bill.failure.as_deref()),
            (1, None, Some("MLflow answered 404 Not Found to runs/get"))
        );
        let due = store.due_bills(100_000, 90_000, 1_000).await.unwrap();
        assert_eq!(due.len(), 250);
        assert!(due.iter().all(|b| b.run_id != "stuck-000"));
    }

    #[tokio::test]
    async fn a_run_is_queued_for_its_bill_once_and_billed_by_one_claimant() {
        let dir = tempfile::tempdir().unwrap();
        let store = opened(&dir).await;
        store
            .queue_bill("r", "FINISHED", Some(5_000), 10_000)
            .await
            .unwrap();
        // The sweep's verdict later: the first entry stays.
        store.queue_bill("r", "lost", Some(9_000), 0).await.unwrap();
        assert!(store.due_bills(9_999, 1, 10).await.unwrap().is_empty());
        let due = store.due_bills(10_000, 1, 10).await.unwrap();
        assert_eq!(
            (due[0].ended_by.as_str(), due[0].end_ms),
            ("FINISHED", Some(5_000))
        );
        assert!(store.claim_bill("r", "a", 10_000, 1).await.unwrap());
        assert!(!store.claim_bill("r", "b", 10_100, 1).await.unwrap());
        // a died: b takes the claim over once it is old enough; a can no longer finish it.
        assert!(store.claim_bill("r", "b", 200_000, 100_000).await.unwrap());
        assert!(!store.finish_bill("r", "a", 1.0, 0.5).await.unwrap());
        assert!(store.finish_bill("r", "b", 7_200.0, 3_600.0).await.unwrap());
        assert!(!store.claim_bill("r", "c", 900_000, 800_000).await.unwrap());
        let bill = store.bill_of("r").await.unwrap().unwrap();
        assert_eq!(
            (bill.done, bill.gpu_seconds, bill.idle_seconds),
            (1, Some(7_200.0), Some(3_600.0))
        );
        // An ended run is no longer open for the sweep.
        store.record_ranks(&[beat("r", 0, 1, 2)]).await.unwrap();
        assert!(store.ranks_of_open_runs(0, 10).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn bills_that_fail_never_hold_back_the_fresh_ones_in_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        bills_that_fail_never_hold_back_the_fresh_ones(&opened(&dir).await).await;
    }

    /// Against the PostgreSQL server the project's CI starts (as the store's own test).
    #[tokio::test]
    async fn bills_that_fail_never_hold_back_the_fresh_ones_in_postgresql() {
        let db = crate::plumbing::store::TestDatabase::create().await;
        let store = HealthStore::new(Store::open(&db.url).await.unwrap());
        bills_that_fail_never_hold_back_the_fresh_ones(&store).await;
        store.0.close().await;
        db.drop().await;
    }

    #[tokio::test]
    async fn a_resumed_run_is_open_again_and_billed_at_most_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = opened(&dir).await;
        let open = |store: HealthStore| async move {
            let rows = store.ranks_of_open_runs(0, 10).await.unwrap();
            rows.into_iter().map(|r| r.run_id).collect::<Vec<_>>()
        };
        store
            .record_ranks(&[beat("queued", 0, 1, 2)])
            .await
            .unwrap();
        store
            .record_ranks(&[beat("billed", 0, 1, 2)])
            .await
            .unwrap();
        store
            .queue_bill("queued", "FINISHED", None, 0)
            .await
            .unwrap();
        store
            .queue_bill("billed", "FINISHED", None, 0)
            .await
            .unwrap();
        assert!(store.claim_bill("billed", "a", 10, 1).await.unwrap());
        assert!(store
            .finish_bill("billed", "a", 3_600.0, 0.0)
            .await
            .unwrap());
        assert!(open(store.clone()).await.is_empty());
        store.reopen_run("queued", 20).await.unwrap();
        store.reopen_run("billed", 20).await.unwrap();
        assert_eq!(open(store.clone()).await, ["billed", "queued"]);
        // Not yet billed: gone, so its next end queues it afresh.
        assert!(store.bill_of("queued").await.unwrap().is_none());
        // Billed: the bill stands, and its next end does not bill it again.
        store
            .queue_bill("billed", "FAILED", None, 30)
            .await
            .unwrap();
        let bill = store.bill_of("billed").await.unwrap().unwrap();
        assert_eq!(
            (bill.done, bill.ended_by.as_str(), bill.gpu_seconds),
            (1, "FINISHED", Some(3_600.0))
        );
        assert!(store.due_bills(100, 50, 10).await.unwrap().is_empty());
    }
}
