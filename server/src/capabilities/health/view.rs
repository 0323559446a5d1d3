//! `GET /runs/{run_id}/health` on the admin listener: a run's state, verdict, idle GPUs, bill
//! and findings, with its ranks one page at a time.

use serde::Serialize;

use super::bill::RunBill;
use super::judge::{self, judge};
use super::report::model::unsigned;
use super::store::BillRow;
use super::{basis, findings, gpu_idle_of, idle_gpus, truncate, Health};

/// `GET /runs/{run_id}/health`.
#[derive(Debug, Serialize)]
pub struct RunHealth {
    pub run_id: String,
    /// `live`, `ended` (every rank reported its end, or the client ended the run through the
    /// proxy), `dead` (judged by the next sweep),
    /// `being_judged`, `judged`.
    pub state: &'static str,
    pub outcome: Option<String>,
    pub detail: Option<String>,
    /// What the sweep did: `end`, `tag`, or `none` (the client had ended the run).
    pub action: Option<String>,
    pub stale_after_seconds: f64,
    pub gpu_idle_after_seconds: f64,
    /// GPUs of ranks that have not ended, and how many of those are idle.
    pub gpus_allocated: usize,
    pub gpus_idle: usize,
    /// What the run's `mlscope.gpus_idle` tag names (or would, once the sweep writes it).
    pub gpus_idle_tag: Option<String>,
    /// What idleness is judged on: the run's `mlscope.gpu_idle_basis` tag; absent without GPUs.
    pub gpu_idle_basis: Option<String>,
    /// The GPU bill: `running` (so far), `ended` (queued, not written yet), `billed` (the
    /// figures of the run's tags), `not_billed` (MLflow refused the run for good: deleted).
    pub bill: &'static str,
    pub gpu_hours: f64,
    pub gpu_idle_hours: f64,
    pub gpu_idle_fraction: f64,
    /// Declared data that changed under the run, as its collectors reported it (the newest
    /// reports, with the ranks' leftovers at most `findings::MAX_FINDINGS_PER_RUN`), oldest first.
    pub data_changes: Vec<findings::DataChange>,
    /// Every rank of the run (senders that named a rank); `ranks` holds one page of them.
    pub rank_count: usize,
    /// Senders of the run's system metrics that named no rank (MLflow's own system-metrics
    /// monitor, or a collector without `--rank`): heard from, but not ranks.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub writers_without_rank: Vec<UnidentifiedWriter>,
    pub ranks: Vec<RankHealth>,
    /// Where the next page starts (`?page_token=`); absent on the last page.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_page_token: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct RankHealth {
    pub node: String,
    pub rank: i64,
    pub pod: Option<String>,
    pub first_heard: String,
    pub last_heard: String,
    pub silent_for_seconds: f64,
    pub interval_seconds: Option<f64>,
    pub outcome: Option<String>,
    pub exit_code: Option<i64>,
    pub memory_limit_megabytes: Option<f64>,
    pub cpu_limit_cores: Option<f64>,
    pub gpu_model: Option<String>,
    /// `sm_active`, `utilization` or `mixed` (the collector's `gpu_idle_basis` tag;
    /// `utilization` when it sent none); absent without GPUs.
    pub gpu_idle_basis: Option<String>,
    pub gpus: Vec<GpuHealth>,
    /// This rank's share of the bill.
    pub gpu_hours: f64,
    pub gpu_idle_hours: f64,
    /// What its command left running when it exited, how that was ended, and GPU memory still
    /// held after (wrapper mode); absent when the rank reported none of it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leftovers: Option<findings::Leftovers>,
}

#[derive(Debug, Serialize)]
pub struct UnidentifiedWriter {
    /// The node it named, `""` when none.
    pub node: String,
    pub first_heard: String,
    pub last_heard: String,
}

#[derive(Debug, Serialize)]
pub struct GpuHealth {
    pub index: i64,
    /// Seconds idle as of now (the collector's last report plus the time since).
    pub idle_seconds: Option<f64>,
    pub idle: bool,
}

impl Health {
    /// The admin view of one run; `None` when no heartbeat of it is known.
    /// The run's health with the ranks of one page: `ranks[offset..offset + limit]` (the totals
    /// count every rank).
    pub async fn view(
        &self,
        run_id: &str,
        now_ms: i64,
        offset: usize,
        limit: usize,
    ) -> Result<Option<RunHealth>, String> {
        let ranks = self
            .inner
            .store
            .ranks_of_run(run_id)
            .await
            .map_err(|e| e.to_string())?;
        if ranks.is_empty() {
            return Ok(None);
        }
        let verdict = self
            .inner
            .store
            .verdict(run_id)
            .await
            .map_err(|e| e.to_string())?;
        let config = &self.inner.config;
        let idle_after = config.gpu_idle_after.as_secs_f64();
        let judgement = judge(&ranks, now_ms, config.stale_after);
        // The bill so far (a live run), or as billed (an ended one: the figures of its tags),
        // clipped as the bill is (MLflow's start and end of the run), so a rank's figures here
        // are those of its tags.
        let (_, billed, run_bill) = self.bill_so_far(run_id, &ranks, now_ms).await?;
        let state = match (&verdict, &judgement) {
            (Some(v), _) if v.done == 1 => "judged",
            (Some(_), _) => "being_judged",
            // Its client ended it through the proxy: the sweep leaves it alone.
            (None, _) if billed.as_ref().is_some_and(|b| b.reopened_ms.is_none()) => "ended",
            (None, Some(_)) => "dead",
            (None, None) if ranks.iter().all(|r| r.outcome.is_some()) => "ended",
            (None, None) => "live",
        };
        let (mut gpus_allocated, mut gpus_idle) = (0, 0);
        for r in ranks.iter().filter(|r| r.outcome.is_none()) {
            let idle = gpu_idle_of(r, now_ms);
            gpus_allocated += r.gpus.max(idle.len() as i64) as usize;
            gpus_idle += idle
                .iter()
                .filter(|s| s.is_some_and(|s| s >= idle_after))
                .count();
        }
        let finding_rows = self
            .inner
            .store
            .findings_of_run(run_id)
            .await
            .map_err(|e| e.to_string())?;
        let (gpu_seconds, idle_seconds) = match &billed {
            Some(BillRow {
                done: 1,
                gpu_seconds: Some(gpu),
                idle_seconds: Some(idle),
                ..
            }) => (*gpu, *idle),
            _ => (run_bill.gpu_seconds, run_bill.idle_seconds),
        };
        let totals = RunBill {
            gpu_seconds,
            idle_seconds,
            ranks: Vec::new(),
        };
        let named: Vec<&super::store::RankRow> = ranks.iter().filter(|r| r.rank >= 0).collect();
        let end = offset.saturating_add(limit).min(named.len());
        let rank_views: Vec<RankHealth> = named
            .get(offset.min(end)..end)
            .unwrap_or_default()
            .iter()
            .map(|r| {
                let idle = gpu_idle_of(r, now_ms);
                let gpus: Vec<GpuHealth> = (0..r.gpus.max(idle.len() as i64))
                    .map(|index| {
                        let idle_seconds = idle.get(index as usize).copied().flatten();
                        GpuHealth {
                            index,
                            idle_seconds,
                            idle: idle_seconds.is_some_and(|s| s >= idle_after),
                        }
                    })
                    .collect();
                let rank_bill = run_bill
                    .ranks
                    .iter()
                    .find(|b| b.node == r.node && b.rank == r.rank);
                RankHealth {
                    gpu_hours: unsigned(rank_bill.map_or(0.0, |b| b.gpu_seconds / 3600.0)),
                    gpu_idle_hours: unsigned(rank_bill.map_or(0.0, |b| b.idle_seconds / 3600.0)),
                    node: r.node.clone(),
                    rank: r.rank,
                    pod: r.pod.clone(),
                    first_heard: judge::timestamp(r.first_heard_ms),
                    last_heard: judge::timestamp(r.last_heard_ms),
                    silent_for_seconds: ((now_ms - r.last_heard_ms).max(0) as f64) / 1e3,
                    interval_seconds: r.interval_ms.map(|ms| ms as f64 / 1e3),
                    outcome: r.outcome.clone(),
                    exit_code: r.exit_code,
                    memory_limit_megabytes: r.memory_limit_mb,
                    cpu_limit_cores: r.cpu_limit_cores,
                    gpu_model: r.gpu_model.clone(),
                    gpu_idle_basis: basis::of_rank(r).map(str::to_owned),
                    gpus,
                    leftovers: findings::leftovers_of(&finding_rows, &r.node, r.rank),
                }
            })
            .collect();
        Ok(Some(RunHealth {
            run_id: run_id.to_owned(),
            state,
            outcome: verdict
                .as_ref()
                .map(|v| v.outcome.clone())
                .or_else(|| judgement.as_ref().map(|j| j.outcome.as_str().to_owned())),
            detail: verdict
                .as_ref()
                .map(|v| v.detail.clone())
                .or_else(|| judgement.as_ref().map(|j| j.detail.clone())),
            action: verdict.as_ref().map(|v| v.action.clone()),
            stale_after_seconds: config.stale_after.as_secs_f64(),
            gpu_idle_after_seconds: idle_after,
            gpus_allocated,
            gpus_idle,
            gpus_idle_tag: idle_gpus(&ranks, now_ms, idle_after),
            gpu_idle_basis: basis::of_run(&ranks).map(|b| truncate(&b)),
            bill: match &billed {
                Some(b) if b.done == 1 && b.failure.is_some() => "not_billed",
                Some(b) if b.done == 1 => "billed",
                Some(_) => "ended",
                None => "running",
            },
            gpu_hours: unsigned(totals.gpu_hours()),
            gpu_idle_hours: unsigned(totals.idle_hours()),
            gpu_idle_fraction: unsigned(totals.idle_fraction()),
            data_changes: findings::data_changes(&finding_rows),
            rank_count: named.len(),
            writers_without_rank: ranks
                .iter()
                .filter(|r| r.rank < 0)
                .map(|r| UnidentifiedWriter {
                    node: r.node.clone(),
                    first_heard: judge::timestamp(r.first_heard_ms),
                    last_heard: judge::timestamp(r.last_heard_ms),
                })
                .collect(),
            ranks: rank_views,
            next_page_token: (end < named.len()).then(|| end.to_string()),
        }))
    }
}
