//! Run health in the store: heartbeats per (run, node, rank), the stale-run sweep's verdicts and
//! the lease that lets one replica sweep at a time. Every write is one statement, correct when
//! several replicas share one PostgreSQL.

use super::{Store, StoreError};

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
}

const BILL_COLUMNS: &str = "run_id, ended_by, end_ms, due_ms, replica, claimed_ms, done, \
     gpu_seconds, idle_seconds, failure, reopened_ms";

/// SQL for `bill::idle_increase` between two readings `(t1, c1)` and `(t2, c2)` (column
/// expressions): the clock's rise, or its value where it fell, within 0 and the gap in seconds.
fn idle_increase_sql(t1: &str, c1: &str, t2: &str, c2: &str) -> String {
    let gap = format!("(CASE WHEN {t2} > {t1} THEN ({t2} - {t1}) / 1000.0 ELSE 0.0 END)");
    let rise = format!("(CASE WHEN {c2} >= {c1} THEN {c2} - {c1} ELSE {c2} END)");
    format!("(CASE WHEN {rise} < 0.0 THEN 0.0 WHEN {rise} > {gap} THEN {gap} ELSE {rise} END)")
}

/// How long after a rank's reported end a sample of the same rank must come to clear that end:
/// the collector's last sample may follow its outcome tags by a few seconds.
pub const SUPERSEDE_AFTER_MS: i64 = 10_000;

const RANK_COLUMNS: &str = "run_id, node, rank, first_heard_ms, last_heard_ms, interval_ms, \
     outcome, exit_code, ended_ms, pod, memory_limit_mb, cpu_limit_cores, gpu_model, gpus, \
     gpu_idle, gpu_idle_ms, workspace, last_write_ms, last_sample_ms, bill_first_ms, bill_last_ms, \
     gpu_idle_basis";

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

impl Store {
    /// Merges one replica's heartbeats into the shared rows: the latest heartbeat wins, the
    /// earliest first heartbeat stays, and facts (outcome, placement, GPUs) fill in or update.
    pub async fn record_ranks(&self, updates: &[RankRow]) -> Result<(), StoreError> {
        // A sample of the rank well after its stored end: the end no longer holds.
        let revived = format!(
            "(excluded.last_sample_ms IS NOT NULL AND run_ranks.ended_ms IS NOT NULL \
             AND excluded.last_sample_ms > run_ranks.ended_ms + {SUPERSEDE_AFTER_MS})"
        );
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
               bill_first_ms = CASE WHEN run_ranks.bill_first_ms IS NULL \
                 OR excluded.bill_first_ms < run_ranks.bill_first_ms \
                 THEN COALESCE(excluded.bill_first_ms, run_ranks.bill_first_ms) \
                 ELSE run_ranks.bill_first_ms END, \
               bill_last_ms = CASE WHEN run_ranks.bill_last_ms IS NULL \
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
        on_backend!(self, |pool| {
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

    /// Merges one replica's idle windows into the shared rows, one statement each: a window
    /// after (or before) the stored one is bridged by the clock's increase across the gap, an
    /// overlapping one changes nothing (`bill::IdleWindow::merge` is the same rule).
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
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
             ON CONFLICT (run_id, node, rank, gpu) DO UPDATE SET \
               idle_s = CASE WHEN {after} THEN {t}.idle_s + {bridge_after} + {e}.idle_s \
                 WHEN {before} THEN {e}.idle_s + {bridge_before} + {t}.idle_s \
                 ELSE {t}.idle_s END, \
               last_ms = CASE WHEN {after} THEN {e}.last_ms ELSE {t}.last_ms END, \
               last_idle = CASE WHEN {after} THEN {e}.last_idle ELSE {t}.last_idle END, \
               first_ms = CASE WHEN NOT ({after}) AND {before} THEN {e}.first_ms \
                 ELSE {t}.first_ms END, \
               first_idle = CASE WHEN NOT ({after}) AND {before} THEN {e}.first_idle \
                 ELSE {t}.first_idle END"
        );
        // In key order, as `record_ranks`.
        let mut windows: Vec<&GpuIdleRow> = windows.iter().collect();
        windows.sort_by(|a, b| {
            (&a.run_id, &a.node, a.rank, a.gpu).cmp(&(&b.run_id, &b.node, b.rank, b.gpu))
        });
        on_backend!(self, |pool| {
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
        Ok(on_backend!(self, |pool| sqlx::query_as(&sql)
            .bind(run_id)
            .fetch_all(pool)
            .await?))
    }

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
        on_backend!(self, |pool| sqlx::query(sql)
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
        on_backend!(self, |pool| {
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
        Ok(on_backend!(self, |pool| sqlx::query_as(&sql)
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
        let affected = on_backend!(self, |pool| sqlx::query(sql)
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
        let claimed: Option<String> = on_backend!(self, |pool| sqlx::query_scalar(sql)
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
        let affected = on_backend!(self, |pool| sqlx::query(sql)
            .bind(run_id)
            .bind(replica)
            .bind(gpu_seconds)
            .bind(idle_seconds)
            .execute(pool)
            .await?
            .rows_affected());
        Ok(affected == 1)
    }

    pub async fn bill_of(&self, run_id: &str) -> Result<Option<BillRow>, StoreError> {
        let sql = format!("SELECT {BILL_COLUMNS} FROM run_bills WHERE run_id = $1");
        Ok(on_backend!(self, |pool| sqlx::query_as(&sql)
            .bind(run_id)
            .fetch_optional(pool)
            .await?))
    }

    /// Every idle-GPU tag written on a live run: (run id, value).
    pub async fn idle_tags(&self, limit: i64) -> Result<Vec<(String, String)>, StoreError> {
        let sql = "SELECT run_id, value FROM run_idle_tags ORDER BY run_id LIMIT $1";
        Ok(on_backend!(self, |pool| sqlx::query_as(sql)
            .bind(limit)
            .fetch_all(pool)
            .await?))
    }

    /// Whether an idle-GPU tag is recorded as written on `run_id`.
    pub async fn idle_tags_of(&self, run_id: &str) -> Result<bool, StoreError> {
        let sql = "SELECT run_id FROM run_idle_tags WHERE run_id = $1";
        let found: Option<String> = on_backend!(self, |pool| sqlx::query_scalar(sql)
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
                on_backend!(self, |pool| sqlx::query(sql)
                    .bind(run_id)
                    .bind(value)
                    .bind(now)
                    .execute(pool)
                    .await?
                    .rows_affected());
            }
            None => {
                let sql = "DELETE FROM run_idle_tags WHERE run_id = $1";
                on_backend!(self, |pool| sqlx::query(sql)
                    .bind(run_id)
                    .execute(pool)
                    .await?
                    .rows_affected());
            }
        }
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
        on_backend!(self, |pool| {
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
        Ok(on_backend!(self, |pool| sqlx::query_as(&sql)
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
        Ok(on_backend!(self, |pool| sqlx::query_as(&sql)
            .bind(heard_since)
            .bind(limit)
            .fetch_all(pool)
            .await?))
    }

    pub async fn verdict(&self, run_id: &str) -> Result<Option<VerdictRow>, StoreError> {
        let sql = format!("SELECT {VERDICT_COLUMNS} FROM run_verdicts WHERE run_id = $1");
        Ok(on_backend!(self, |pool| sqlx::query_as(&sql)
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
        let claimed: Option<String> = on_backend!(self, |pool| sqlx::query_scalar(&sql)
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
        on_backend!(self, |pool| sqlx::query(sql)
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

    async fn store(dir: &tempfile::TempDir) -> Store {
        Store::open(&format!("sqlite://{}/s.db", dir.path().display()))
            .await
            .unwrap()
    }

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

    #[tokio::test]
    async fn heartbeats_from_two_replicas_merge_into_one_row_per_rank() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir).await;
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
        let store = store(&dir).await;
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

    #[tokio::test]
    async fn a_verdict_is_claimed_once_and_an_abandoned_claim_is_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir).await;
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
        let store = store(&dir).await;
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

    #[tokio::test]
    async fn a_run_is_queued_for_its_bill_once_and_billed_by_one_claimant() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir).await;
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

    /// 250 bills that fail every time (claimed, never finished) ahead of a fresh one, and one
    /// MLflow refuses for good.
    async fn bills_that_fail_never_hold_back_the_fresh_ones(store: &Store) {
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
    async fn bills_that_fail_never_hold_back_the_fresh_ones_in_sqlite() {
        let dir = tempfile::tempdir().unwrap();
        bills_that_fail_never_hold_back_the_fresh_ones(&store(&dir).await).await;
    }

    /// Against the PostgreSQL server the project's CI starts (as the store's own test).
    #[tokio::test]
    async fn bills_that_fail_never_hold_back_the_fresh_ones_in_postgresql() {
        let db = crate::store::TestDatabase::create().await;
        let store = Store::open(&db.url).await.unwrap();
        bills_that_fail_never_hold_back_the_fresh_ones(&store).await;
        store.close().await;
        db.drop().await;
    }

    #[tokio::test]
    async fn a_resumed_run_is_open_again_and_billed_at_most_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir).await;
        let open = |store: Store| async move {
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

    #[tokio::test]
    async fn one_holder_at_a_time_until_the_lease_expires() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(&dir).await;
        assert!(store.hold_lease("sweep", "a", 0, 100).await.unwrap());
        assert!(!store.hold_lease("sweep", "b", 50, 150).await.unwrap());
        assert!(store.hold_lease("sweep", "a", 60, 160).await.unwrap());
        assert!(store.hold_lease("sweep", "b", 161, 261).await.unwrap());
        assert!(!store.hold_lease("sweep", "a", 200, 300).await.unwrap());
    }
}
