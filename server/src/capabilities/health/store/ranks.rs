//! Heartbeats per (run, node, rank): merged across replicas, marked by the run's accepted writes,
//! read per run and for every open run.

use super::HealthStore;
use crate::plumbing::store::{on_backend, StoreError};

/// A `run_ranks` row, and what one replica heard of one (run, node, rank) since its last flush
/// (`interval_ms` then: the gap between the last two heartbeats it saw, when it saw two).
#[derive(Debug, Clone, Default, PartialEq, sqlx::FromRow)]
pub struct RankRow {
    pub run_id: String,
    pub node: String,
    pub rank: i64,
    pub first_heard_ms: i64,
    pub last_heard_ms: i64,
    pub interval_ms: Option<i64>,
    pub outcome: Option<String>,
    pub exit_code: Option<i64>,
    pub ended_ms: Option<i64>,
    pub pod: Option<String>,
    pub memory_limit_mb: Option<f64>,
    pub cpu_limit_cores: Option<f64>,
    pub gpu_model: Option<String>,
    /// What the rank's collector judged GPU idleness on: `sm_active`, `utilization`, `mixed`.
    pub gpu_idle_basis: Option<String>,
    pub gpus: i64,
    pub gpu_idle: Option<String>,
    pub gpu_idle_ms: Option<i64>,
    /// The MLflow workspace the run's heartbeats named; `None`: the default one.
    pub workspace: Option<String>,
    /// The latest write MLflow accepted for the run (any metric), as far as the store knows.
    pub last_write_ms: Option<i64>,
    /// The latest system sample of this rank (a heartbeat that is not only tags).
    pub last_sample_ms: Option<i64>,
    /// The earliest and latest timestamp of the rank's system samples (the sender's clock): the
    /// span its GPUs are billed for.
    pub bill_first_ms: Option<i64>,
    pub bill_last_ms: Option<i64>,
}

/// How long after a rank's reported end a sample of the same rank must come to clear that end:
/// the collector's last sample may follow its outcome tags by a few seconds.
pub const SUPERSEDE_AFTER_MS: i64 = 10_000;

const RANK_COLUMNS: &str = "run_id, node, rank, first_heard_ms, last_heard_ms, interval_ms, \
     outcome, exit_code, ended_ms, pod, memory_limit_mb, cpu_limit_cores, gpu_model, gpus, \
     gpu_idle, gpu_idle_ms, workspace, last_write_ms, last_sample_ms, bill_first_ms, bill_last_ms, \
     gpu_idle_basis";

impl HealthStore {
    /// Merges one replica's heartbeats into the shared rows: the latest heartbeat wins, the
    /// earliest first heartbeat stays, and facts (outcome, placement, GPUs) fill in or update.
    /// A settled run's sampled spans stay as they were billed.
    pub async fn record_ranks(&self, updates: &[RankRow]) -> Result<(), StoreError> {
        // A sample of the rank well after its stored end: the end no longer holds.
        let revived = format!(
            "(excluded.last_sample_ms IS NOT NULL AND run_ranks.ended_ms IS NOT NULL \
             AND excluded.last_sample_ms > run_ranks.ended_ms + {SUPERSEDE_AFTER_MS})"
        );
        let settled = super::bills::settled("run_ranks.run_id");
        let sql = format!(
            "INSERT INTO run_ranks ({RANK_COLUMNS}) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, \
               $18, $19, $20, $21, $22) \
             ON CONFLICT (run_id, node, rank) DO UPDATE SET \
               first_heard_ms = CASE WHEN excluded.first_heard_ms < run_ranks.first_heard_ms \
                 THEN excluded.first_heard_ms ELSE run_ranks.first_heard_ms END, \
               interval_ms = COALESCE(excluded.interval_ms, \
                 CASE WHEN excluded.last_heard_ms > run_ranks.last_heard_ms \
                   THEN excluded.last_heard_ms - run_ranks.last_heard_ms \
                   ELSE run_ranks.interval_ms END), \
               last_heard_ms = CASE WHEN excluded.last_heard_ms > run_ranks.last_heard_ms \
                 THEN excluded.last_heard_ms ELSE run_ranks.last_heard_ms END, \
               outcome = CASE WHEN excluded.outcome IS NOT NULL THEN excluded.outcome \
                 WHEN {revived} THEN NULL ELSE run_ranks.outcome END, \
               exit_code = CASE WHEN excluded.exit_code IS NOT NULL THEN excluded.exit_code \
                 WHEN {revived} THEN NULL ELSE run_ranks.exit_code END, \
               ended_ms = CASE WHEN excluded.ended_ms IS NOT NULL THEN excluded.ended_ms \
                 WHEN {revived} THEN NULL ELSE run_ranks.ended_ms END, \
               last_write_ms = CASE WHEN run_ranks.last_write_ms IS NULL \
                 OR excluded.last_write_ms > run_ranks.last_write_ms \
                 THEN COALESCE(excluded.last_write_ms, run_ranks.last_write_ms) \
                 ELSE run_ranks.last_write_ms END, \
               last_sample_ms = CASE WHEN run_ranks.last_sample_ms IS NULL \
                 OR excluded.last_sample_ms > run_ranks.last_sample_ms \
                 THEN COALESCE(excluded.last_sample_ms, run_ranks.last_sample_ms) \
                 ELSE run_ranks.last_sample_ms END, \
               bill_first_ms = CASE WHEN {settled} THEN run_ranks.bill_first_ms \
                 WHEN run_ranks.bill_first_ms IS NULL \
                 OR excluded.bill_first_ms < run_ranks.bill_first_ms \
                 THEN COALESCE(excluded.bill_first_ms, run_ranks.bill_first_ms) \
                 ELSE run_ranks.bill_first_ms END, \
               bill_last_ms = CASE WHEN {settled} THEN run_ranks.bill_last_ms \
                 WHEN run_ranks.bill_last_ms IS NULL \
                 OR excluded.bill_last_ms > run_ranks.bill_last_ms \
                 THEN COALESCE(excluded.bill_last_ms, run_ranks.bill_last_ms) \
                 ELSE run_ranks.bill_last_ms END, \
               pod = COALESCE(excluded.pod, run_ranks.pod), \
               memory_limit_mb = COALESCE(excluded.memory_limit_mb, run_ranks.memory_limit_mb), \
               cpu_limit_cores = COALESCE(excluded.cpu_limit_cores, run_ranks.cpu_limit_cores), \
               gpu_model = COALESCE(excluded.gpu_model, run_ranks.gpu_model), \
               gpu_idle_basis = COALESCE(excluded.gpu_idle_basis, run_ranks.gpu_idle_basis), \
               workspace = COALESCE(excluded.workspace, run_ranks.workspace), \
               gpus = CASE WHEN excluded.gpus > run_ranks.gpus \
                 THEN excluded.gpus ELSE run_ranks.gpus END, \
               gpu_idle = CASE WHEN excluded.gpu_idle_ms IS NOT NULL \
                 AND (run_ranks.gpu_idle_ms IS NULL OR excluded.gpu_idle_ms >= run_ranks.gpu_idle_ms) \
                 THEN excluded.gpu_idle ELSE run_ranks.gpu_idle END, \
               gpu_idle_ms = CASE WHEN excluded.gpu_idle_ms IS NOT NULL \
                 AND (run_ranks.gpu_idle_ms IS NULL OR excluded.gpu_idle_ms >= run_ranks.gpu_idle_ms) \
                 THEN excluded.gpu_idle_ms ELSE run_ranks.gpu_idle_ms END"
        );
        // In key order: two replicas' transactions lock rows in one order and never deadlock.
        let mut updates: Vec<&RankRow> = updates.iter().collect();
        updates.sort_by(|a, b| (&a.run_id, &a.node, a.rank).cmp(&(&b.run_id, &b.node, b.rank)));
        on_backend!(&self.0, |pool| {
            let mut tx = pool.begin().await?;
            for u in &updates {
                sqlx::query(&sql)
                    .bind(&u.run_id)
                    .bind(&u.node)
                    .bind(u.rank)
                    .bind(u.first_heard_ms)
                    .bind(u.last_heard_ms)
                    .bind(u.interval_ms)
                    .bind(&u.outcome)
                    .bind(u.exit_code)
                    .bind(u.ended_ms)
                    .bind(&u.pod)
                    .bind(u.memory_limit_mb)
                    .bind(u.cpu_limit_cores)
                    .bind(&u.gpu_model)
                    .bind(u.gpus)
                    .bind(&u.gpu_idle)
                    .bind(u.gpu_idle_ms)
                    .bind(&u.workspace)
                    .bind(u.last_write_ms)
                    .bind(u.last_sample_ms)
                    .bind(u.bill_first_ms)
                    .bind(u.bill_last_ms)
                    .bind(&u.gpu_idle_basis)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
        });
        Ok(())
    }

    /// Marks the runs' rows with the time of a write MLflow accepted (`(run_id, ms)`): only runs
    /// that have rows (ranks heard from) are touched, no row is added.
    pub async fn record_writes(&self, writes: &[(String, i64)]) -> Result<(), StoreError> {
        let sql = "UPDATE run_ranks SET last_write_ms = $2 \
                   WHERE run_id = $1 AND (last_write_ms IS NULL OR last_write_ms < $2)";
        // In key order, as `record_ranks`.
        let mut writes: Vec<&(String, i64)> = writes.iter().collect();
        writes.sort();
        on_backend!(&self.0, |pool| {
            let mut tx = pool.begin().await?;
            for (run_id, ms) in writes.iter().copied() {
                sqlx::query(sql)
                    .bind(run_id)
                    .bind(ms)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
        });
        Ok(())
    }

    pub async fn ranks_of_run(&self, run_id: &str) -> Result<Vec<RankRow>, StoreError> {
        let sql =
            format!("SELECT {RANK_COLUMNS} FROM run_ranks WHERE run_id = $1 ORDER BY rank, node");
        Ok(on_backend!(&self.0, |pool| sqlx::query_as(&sql)
            .bind(run_id)
            .fetch_all(pool)
            .await?))
    }

    /// Every rank of up to `limit` runs that have no finished verdict and no bill (the run
    /// ended) or one its client reopened, heard from since
    /// `heard_since`, ordered by run.
    pub async fn ranks_of_open_runs(
        &self,
        heard_since: i64,
        limit: i64,
    ) -> Result<Vec<RankRow>, StoreError> {
        let sql = format!(
            "SELECT {RANK_COLUMNS} FROM run_ranks WHERE run_id IN ( \
               SELECT DISTINCT r.run_id FROM run_ranks r \
               WHERE r.last_heard_ms >= $1 AND NOT EXISTS ( \
                 SELECT 1 FROM run_verdicts v WHERE v.run_id = r.run_id AND v.done = 1) \
               AND NOT EXISTS (SELECT 1 FROM run_bills b WHERE b.run_id = r.run_id \
                 AND b.reopened_ms IS NULL) \
               ORDER BY r.run_id LIMIT $2) \
             ORDER BY run_id, rank, node"
        );
        Ok(on_backend!(&self.0, |pool| sqlx::query_as(&sql)
            .bind(heard_since)
            .bind(limit)
            .fetch_all(pool)
            .await?))
    }
}
#[cfg(test)]
mod tests {
    use crate::capabilities::health::store::{beat, opened};

    #[tokio::test]
    async fn heartbeats_from_two_replicas_merge_into_one_row_per_rank() {
        let dir = tempfile::tempdir().unwrap();
        let store = opened(&dir).await;
        store
            .record_ranks(&[beat("r", 0, 1_000, 5_000)])
            .await
            .unwrap();
        // Another replica flushes an older heartbeat later, with the rank's pod.
        let mut older = beat("r", 0, 500, 4_000);
        older.pod = Some("train-0".into());
        older.gpus = 2;
        older.gpu_idle_basis = Some("sm_active".into());
        store.record_ranks(&[older]).await.unwrap();
        // A newer one: the interval is the gap to the stored heartbeat.
        store
            .record_ranks(&[beat("r", 0, 6_000, 6_000)])
            .await
            .unwrap();
        let rows = store.ranks_of_run("r").await.unwrap();
        assert_eq!(rows.len(), 1);
        let row = &rows[0];
        assert_eq!(
            (row.first_heard_ms, row.last_heard_ms, row.interval_ms),
            (500, 6_000, Some(1_000))
        );
        assert_eq!((row.pod.as_deref(), row.gpus), (Some("train-0"), 2));
        // A fact heard once stays until the rank says otherwise.
        assert_eq!(row.gpu_idle_basis.as_deref(), Some("sm_active"));
        let mut changed = beat("r", 0, 7_000, 7_000);
        changed.gpu_idle_basis = Some("utilization".into());
        store.record_ranks(&[changed]).await.unwrap();
        let row = &store.ranks_of_run("r").await.unwrap()[0];
        assert_eq!(row.gpu_idle_basis.as_deref(), Some("utilization"));
    }

    #[tokio::test]
    async fn a_ranks_later_samples_supersede_its_end_and_writes_mark_only_known_runs() {
        let dir = tempfile::tempdir().unwrap();
        let store = opened(&dir).await;
        let mut ended = beat("r", 0, 1_000, 10_000);
        ended.outcome = Some("killed".into());
        ended.exit_code = Some(-9);
        ended.ended_ms = Some(10_000);
        store.record_ranks(&[ended]).await.unwrap();
        // The collector's last sample, just after its end: the end stands.
        let mut sample = beat("r", 0, 12_000, 12_000);
        sample.last_sample_ms = Some(12_000);
        store.record_ranks(&[sample]).await.unwrap();
        let row = &store.ranks_of_run("r").await.unwrap()[0];
        assert_eq!(
            (row.outcome.as_deref(), row.exit_code, row.ended_ms),
            (Some("killed"), Some(-9), Some(10_000))
        );
        // Samples well after it: the rank lives, the end is gone.
        let mut sample = beat("r", 0, 30_000, 30_000);
        sample.last_sample_ms = Some(30_000);
        store.record_ranks(&[sample]).await.unwrap();
        let row = &store.ranks_of_run("r").await.unwrap()[0];
        assert_eq!(
            (row.outcome.as_deref(), row.exit_code, row.ended_ms),
            (None, None, None)
        );
        assert_eq!(
            (row.last_sample_ms, row.last_heard_ms),
            (Some(30_000), 30_000)
        );

        store
            .record_writes(&[("r".into(), 40_000), ("unknown".into(), 40_000)])
            .await
            .unwrap();
        store.record_writes(&[("r".into(), 35_000)]).await.unwrap();
        assert_eq!(
            store.ranks_of_run("r").await.unwrap()[0].last_write_ms,
            Some(40_000)
        );
        assert!(store.ranks_of_run("unknown").await.unwrap().is_empty());
    }
}
