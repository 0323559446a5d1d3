//! GPU idle clocks per (run, node, rank, GPU), merged across replicas as the bill merges them,
//! and the idle-GPU tags written on live runs.

use super::HealthStore;
use crate::plumbing::store::{on_backend, StoreError};

/// A `rank_gpu_idle` row: one GPU's idle clock over the samples known (see
/// `health::bill::IdleWindow`).
#[derive(Debug, Clone, Default, PartialEq, sqlx::FromRow)]
pub struct GpuIdleRow {
    pub run_id: String,
    pub node: String,
    pub rank: i64,
    pub gpu: i64,
    pub first_ms: i64,
    pub first_idle: f64,
    pub last_ms: i64,
    pub last_idle: f64,
    pub idle_s: f64,
}

const GPU_IDLE_COLUMNS: &str =
    "run_id, node, rank, gpu, first_ms, first_idle, last_ms, last_idle, idle_s";
/// SQL for `bill::idle_increase` between two readings `(t1, c1)` and `(t2, c2)` (column
/// expressions): the clock's rise, or its value where it fell, within 0 and the gap in seconds.
fn idle_increase_sql(t1: &str, c1: &str, t2: &str, c2: &str) -> String {
    let gap = format!("(CASE WHEN {t2} > {t1} THEN ({t2} - {t1}) / 1000.0 ELSE 0.0 END)");
    let rise = format!("(CASE WHEN {c2} >= {c1} THEN {c2} - {c1} ELSE {c2} END)");
    format!("(CASE WHEN {rise} < 0.0 THEN 0.0 WHEN {rise} > {gap} THEN {gap} ELSE {rise} END)")
}

impl HealthStore {
    /// Merges one replica's idle windows into the shared rows, one statement each: a window
    /// after (or before) the stored one is bridged by the clock's increase across the gap, an
    /// overlapping one changes nothing (`bill::IdleWindow::merge` is the same rule). Windows of
    /// a settled run are not added (see `bills::settled`): its idle clocks stay as its bill read
    /// them, until its client resumes it.
    pub async fn record_gpu_idle(&self, windows: &[GpuIdleRow]) -> Result<(), StoreError> {
        if windows.is_empty() {
            return Ok(());
        }
        let (t, e) = ("rank_gpu_idle", "excluded");
        let after = format!("{e}.first_ms >= {t}.last_ms");
        let before = format!("({e}.last_ms <= {t}.first_ms AND {e}.first_ms < {t}.last_ms)");
        let bridge_after = idle_increase_sql(
            &format!("{t}.last_ms"),
            &format!("{t}.last_idle"),
            &format!("{e}.first_ms"),
            &format!("{e}.first_idle"),
        );
        let bridge_before = idle_increase_sql(
            &format!("{e}.last_ms"),
            &format!("{e}.last_idle"),
            &format!("{t}.first_ms"),
            &format!("{t}.first_idle"),
        );
        let sql = format!(
            "INSERT INTO rank_gpu_idle ({GPU_IDLE_COLUMNS}) \
             SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9 WHERE NOT {settled} \
             ON CONFLICT (run_id, node, rank, gpu) DO UPDATE SET \
               idle_s = CASE WHEN {after} THEN {t}.idle_s + {bridge_after} + {e}.idle_s \
                 WHEN {before} THEN {e}.idle_s + {bridge_before} + {t}.idle_s \
                 ELSE {t}.idle_s END, \
               last_ms = CASE WHEN {after} THEN {e}.last_ms ELSE {t}.last_ms END, \
               last_idle = CASE WHEN {after} THEN {e}.last_idle ELSE {t}.last_idle END, \
               first_ms = CASE WHEN NOT ({after}) AND {before} THEN {e}.first_ms \
                 ELSE {t}.first_ms END, \
               first_idle = CASE WHEN NOT ({after}) AND {before} THEN {e}.first_idle \
                 ELSE {t}.first_idle END",
            settled = super::bills::settled("$1")
        );
        // In key order, as `record_ranks`.
        let mut windows: Vec<&GpuIdleRow> = windows.iter().collect();
        windows.sort_by(|a, b| {
            (&a.run_id, &a.node, a.rank, a.gpu).cmp(&(&b.run_id, &b.node, b.rank, b.gpu))
        });
        on_backend!(&self.0, |pool| {
            let mut tx = pool.begin().await?;
            for w in &windows {
                sqlx::query(&sql)
                    .bind(&w.run_id)
                    .bind(&w.node)
                    .bind(w.rank)
                    .bind(w.gpu)
                    .bind(w.first_ms)
                    .bind(w.first_idle)
                    .bind(w.last_ms)
                    .bind(w.last_idle)
                    .bind(w.idle_s)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
        });
        Ok(())
    }

    pub async fn gpu_idle_of_run(&self, run_id: &str) -> Result<Vec<GpuIdleRow>, StoreError> {
        let sql = format!(
            "SELECT {GPU_IDLE_COLUMNS} FROM rank_gpu_idle WHERE run_id = $1 ORDER BY rank, node, gpu"
        );
        Ok(on_backend!(&self.0, |pool| sqlx::query_as(&sql)
            .bind(run_id)
            .fetch_all(pool)
            .await?))
    }

    /// Every idle-GPU tag written on a live run: (run id, value).
    pub async fn idle_tags(&self, limit: i64) -> Result<Vec<(String, String)>, StoreError> {
        let sql = "SELECT run_id, value FROM run_idle_tags ORDER BY run_id LIMIT $1";
        Ok(on_backend!(&self.0, |pool| sqlx::query_as(sql)
            .bind(limit)
            .fetch_all(pool)
            .await?))
    }

    /// Whether an idle-GPU tag is recorded as written on `run_id`.
    pub async fn idle_tags_of(&self, run_id: &str) -> Result<bool, StoreError> {
        let sql = "SELECT run_id FROM run_idle_tags WHERE run_id = $1";
        let found: Option<String> = on_backend!(&self.0, |pool| sqlx::query_scalar(sql)
            .bind(run_id)
            .fetch_optional(pool)
            .await?);
        Ok(found.is_some())
    }

    /// Records the idle-GPU tag now on `run_id`; `None`: it was removed.
    pub async fn set_idle_tag(
        &self,
        run_id: &str,
        value: Option<&str>,
        now: i64,
    ) -> Result<(), StoreError> {
        match value {
            Some(value) => {
                let sql =
                    "INSERT INTO run_idle_tags (run_id, value, written_ms) VALUES ($1, $2, $3) \
                           ON CONFLICT (run_id) DO UPDATE SET value = excluded.value, \
                             written_ms = excluded.written_ms";
                on_backend!(&self.0, |pool| sqlx::query(sql)
                    .bind(run_id)
                    .bind(value)
                    .bind(now)
                    .execute(pool)
                    .await?
                    .rows_affected());
            }
            None => {
                let sql = "DELETE FROM run_idle_tags WHERE run_id = $1";
                on_backend!(&self.0, |pool| sqlx::query(sql)
                    .bind(run_id)
                    .execute(pool)
                    .await?
                    .rows_affected());
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capabilities::health::store::opened;

    fn window(gpu: i64, first: (i64, f64), last: (i64, f64), idle_s: f64) -> GpuIdleRow {
        GpuIdleRow {
            run_id: "r".into(),
            node: "n1".into(),
            rank: 0,
            gpu,
            first_ms: first.0,
            first_idle: first.1,
            last_ms: last.0,
            last_idle: last.1,
            idle_s,
        }
    }

    #[tokio::test]
    async fn idle_windows_from_replicas_merge_in_sql_as_in_the_billing_rule() {
        let dir = tempfile::tempdir().unwrap();
        let store = opened(&dir).await;
        // Idle from 0 on: the clock reads 60 s per minute. Windows arrive out of order.
        store
            .record_gpu_idle(&[window(0, (120_000, 120.0), (180_000, 180.0), 60.0)])
            .await
            .unwrap();
        // After: bridged 180 -> 240 (60 s) plus its own 60 s.
        store
            .record_gpu_idle(&[window(0, (240_000, 240.0), (300_000, 300.0), 60.0)])
            .await
            .unwrap();
        // Before: its own 60 s, bridged 60 -> 120 (60 s).
        store
            .record_gpu_idle(&[window(0, (0, 0.0), (60_000, 60.0), 60.0)])
            .await
            .unwrap();
        // Overlapping (a sample another replica flushed late): nothing changes.
        store
            .record_gpu_idle(&[window(0, (90_000, 90.0), (90_000, 90.0), 0.0)])
            .await
            .unwrap();
        // A clock that fell (a new idle stretch) and one that jumps past the gap, on GPU 1.
        store
            .record_gpu_idle(&[window(1, (0, 500.0), (0, 500.0), 0.0)])
            .await
            .unwrap();
        store
            .record_gpu_idle(&[window(1, (60_000, 30.0), (60_000, 30.0), 0.0)])
            .await
            .unwrap();
        store
            .record_gpu_idle(&[window(1, (120_000, 99_999.0), (120_000, 99_999.0), 0.0)])
            .await
            .unwrap();
        let rows = store.gpu_idle_of_run("r").await.unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(
            (rows[0].first_ms, rows[0].last_ms, rows[0].idle_s),
            (0, 300_000, 300.0)
        );
        assert_eq!((rows[1].last_idle, rows[1].idle_s), (99_999.0, 90.0));
    }

    /// Idle windows a replica flushes once the run's bill was claimed (a GPU idle on after the
    /// run failed, a late flush) leave its idle clocks as the bill read them, new GPUs included;
    /// a run its client resumed takes them again.
    #[tokio::test]
    async fn a_settled_runs_idle_clocks_stay_as_billed_until_it_is_resumed() {
        let dir = tempfile::tempdir().unwrap();
        let store = opened(&dir).await;
        let hear = async |windows: &[GpuIdleRow]| store.record_gpu_idle(windows).await.unwrap();
        let idle_of = async || -> Vec<(i64, i64, f64)> {
            let rows = store.gpu_idle_of_run("r").await.unwrap();
            rows.iter().map(|r| (r.gpu, r.last_ms, r.idle_s)).collect()
        };
        hear(&[window(0, (0, 0.0), (60_000, 60.0), 60.0)]).await;
        // Ended and queued: what the replicas flush before the claim counts.
        store
            .queue_bill("r", "FAILED", Some(120_000), 130_000)
            .await
            .unwrap();
        hear(&[window(0, (120_000, 120.0), (120_000, 120.0), 0.0)]).await;
        let billed = vec![(0, 120_000, 120.0)];
        assert_eq!(idle_of().await, billed);

        // Claimed: neither a later window of that GPU nor a GPU first heard of now counts,
        // before or after the bill is done.
        assert!(store.claim_bill("r", "a", 130_000, 1).await.unwrap());
        hear(&[
            window(0, (180_000, 180.0), (180_000, 180.0), 0.0),
            window(1, (180_000, 50.0), (240_000, 110.0), 60.0),
        ])
        .await;
        assert_eq!(idle_of().await, billed);
        assert!(store.finish_bill("r", "a", 0.0, 120.0).await.unwrap());
        hear(&[window(0, (240_000, 240.0), (240_000, 240.0), 0.0)]).await;
        assert_eq!(idle_of().await, billed);

        // Resumed by its client: live again, its windows count (bridged from the billed one).
        store.reopen_run("r", 250_000).await.unwrap();
        hear(&[window(0, (300_000, 300.0), (300_000, 300.0), 0.0)]).await;
        assert_eq!(idle_of().await, vec![(0, 300_000, 300.0)]);
    }
}
