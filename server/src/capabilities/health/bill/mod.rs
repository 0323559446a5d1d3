//! The GPU bill of every run that ends: queued when its client ends it through the proxy
//! ([`super::update`]), when the sweep's verdict ends it, or when the sweep finds it ended at MLflow
//! after all its ranks exited cleanly; claimed by one replica once every replica has flushed what
//! it heard; written as run tags and counted in the fleet counters. The figures themselves are
//! [`figures`], from the ranks' spans and the GPUs' idle clocks ([`idle_clock`]).

mod figures;
mod idle_clock;

pub use figures::{bill, hours, Clip, RankBill, RunBill};
pub use idle_clock::{idle_increase, IdleWindow};

use super::calls::REJECTED;
use super::store::{BillRow, RankRow};
use super::{basis, truncate, Health, MAX_RANK_TAGS};
use crate::plumbing::mlflow::Run;

/// Bills carried out per sweep.
const MAX_BILLS_PER_SWEEP: i64 = 200;

impl Health {
    /// A run whose ranks all exited 0 is its client's to end, and the sweep leaves it alone;
    /// once MLflow has it ended (straight, not through the proxy) its bill is queued here.
    pub(super) async fn bill_clean_end(&self, run_id: &str, ranks: &[RankRow], now_ms: i64) {
        let status = match self.get_run(&self.run_caller(ranks), run_id).await {
            Ok(run) => run.info.status.unwrap_or_default(),
            Err((reason, error)) => {
                tracing::warn!(run_id, error, "asking MLflow whether a run ended failed");
                self.inner.metrics.health_error(reason);
                return;
            }
        };
        if !matches!(status.as_str(), "FINISHED" | "FAILED" | "KILLED") {
            return;
        }
        // MLflow's end time clips the bill (read again when it is billed).
        let settle = 2 * self.inner.config.flush_interval.as_millis() as i64 + 1_000;
        if let Err(error) = self
            .inner
            .store
            .queue_bill(run_id, &status, None, now_ms + settle)
            .await
        {
            tracing::warn!(%error, run_id, "queueing the bill of a run ended at MLflow failed");
            self.inner.metrics.health_error("store");
        }
    }

    /// Bills every run whose bill is due, each claimed first so that one replica bills it;
    /// returns the runs due (ended: no idle-GPU tag for them any more).
    pub(super) async fn bill_due(&self, now_ms: i64) -> std::collections::HashSet<String> {
        // A claim older than a few sweeps was abandoned (its replica died) or failed: due again.
        let abandoned_before = now_ms - 4 * self.inner.config.sweep_interval.as_millis() as i64;
        let due = match self
            .inner
            .store
            .due_bills(now_ms, abandoned_before, MAX_BILLS_PER_SWEEP)
            .await
        {
            Ok(due) => due,
            Err(error) => {
                tracing::warn!(%error, "reading due bills failed");
                self.inner.metrics.health_error("store");
                return Default::default();
            }
        };
        let ended = due.iter().map(|b| b.run_id.clone()).collect();
        for bill in due {
            match self
                .inner
                .store
                .claim_bill(
                    &bill.run_id,
                    &self.inner.replica_id,
                    now_ms,
                    abandoned_before,
                )
                .await
            {
                Ok(true) => self.bill_run(&bill, now_ms).await,
                Ok(false) => {}
                Err(error) => {
                    tracing::warn!(%error, run_id = bill.run_id, "claiming a bill failed");
                    self.inner.metrics.health_error("store");
                }
            }
        }
        ended
    }

    /// Bills one claimed run: its figures as run tags, the fleet counters, the bill row done.
    /// A failure leaves the claim to be taken over in a later sweep.
    async fn bill_run(&self, claimed: &BillRow, now_ms: i64) {
        let run_id = claimed.run_id.as_str();
        let (ranks, idle) = match (
            self.inner.store.ranks_of_run(run_id).await,
            self.inner.store.gpu_idle_of_run(run_id).await,
        ) {
            (Ok(ranks), Ok(idle)) => (ranks, idle),
            (Err(error), _) | (_, Err(error)) => {
                tracing::warn!(%error, run_id, "reading a run to bill failed");
                self.inner.metrics.health_error("store");
                return;
            }
        };
        let caller = self.run_caller(&ranks);
        let run = match self.get_run(&caller, run_id).await {
            Ok(run) => run,
            Err((REJECTED, error)) => return self.give_up_bill(run_id, &error).await,
            Err((reason, error)) => {
                tracing::warn!(run_id, error, "reading a run to bill failed; retried later");
                self.inner.metrics.health_error(reason);
                return;
            }
        };
        let clip = clip_of(&run, claimed.end_ms, now_ms);
        let bill = figures::bill(&ranks, &idle, clip);
        let holds_gpus = bill.ranks.iter().any(|r| r.gpus > 0);
        if holds_gpus {
            let tags = bill_tags(&bill, basis::of_run(&ranks));
            if let Err((reason, error)) = self.write_tags(run_id, &caller, &tags).await {
                if reason == REJECTED {
                    return self.give_up_bill(run_id, &error).await;
                }
                tracing::warn!(
                    run_id,
                    error,
                    "writing a run's GPU bill failed; retried later"
                );
                self.inner.metrics.health_error(reason);
                return;
            }
        }
        // The run ended: its idle-GPU tag goes with it.
        if let Err((reason, error)) = self.clear_idle_tag(run_id, &caller).await {
            tracing::warn!(
                run_id,
                error,
                "removing the idle-GPU tag of an ended run failed"
            );
            self.inner.metrics.health_error(reason);
        }
        match self
            .inner
            .store
            .finish_bill(
                run_id,
                &self.inner.replica_id,
                bill.gpu_seconds,
                bill.idle_seconds,
            )
            .await
        {
            Ok(true) => {
                for (model, busy, idle) in bill.by_model() {
                    self.inner.metrics.gpu_seconds(&model, busy, idle);
                }
                if holds_gpus {
                    self.inner.metrics.run_billed();
                }
                tracing::info!(
                    run_id,
                    ended_by = claimed.ended_by,
                    gpu_hours = bill.gpu_hours(),
                    gpu_idle_hours = bill.idle_hours(),
                    "run billed"
                );
                // Its report, once: this replica finished the bill, no other will take it over.
                self.write_report(run_id, &ranks, &run, &bill, &caller, now_ms)
                    .await;
            }
            // Another replica took the claim over meanwhile: it counts the run.
            Ok(false) => {}
            Err(error) => {
                tracing::warn!(%error, run_id, "recording a bill failed");
                self.inner.metrics.health_error("store");
            }
        }
    }

    /// Marks a claimed bill done unbilled: MLflow refused the run for good (deleted, or
    /// garbage-collected), so retrying would only hold the queue.
    async fn give_up_bill(&self, run_id: &str, error: &str) {
        tracing::warn!(
            run_id,
            error,
            "MLflow refused a run's GPU bill for good; not billed"
        );
        self.inner.metrics.health_error(REJECTED);
        if let Err(error) = self
            .inner
            .store
            .give_up_bill(run_id, &self.inner.replica_id, error)
            .await
        {
            tracing::warn!(%error, run_id, "recording an unbillable run failed");
            self.inner.metrics.health_error("store");
        }
    }
}

impl Health {
    /// The run as MLflow answers it (when it does), its bill row, and its bill so far, clipped as
    /// its bill is (MLflow's start and end of it; without MLflow's answer, the queued end): for
    /// the admin views of a run.
    pub(super) async fn bill_so_far(
        &self,
        run_id: &str,
        ranks: &[RankRow],
        now_ms: i64,
    ) -> Result<(Option<Run>, Option<BillRow>, RunBill), String> {
        let store = &self.inner.store;
        let billed = store.bill_of(run_id).await.map_err(|e| e.to_string())?;
        let idle = store
            .gpu_idle_of_run(run_id)
            .await
            .map_err(|e| e.to_string())?;
        let queued_end = billed.as_ref().and_then(|b| b.end_ms);
        let run = match self.get_run(&self.run_caller(ranks), run_id).await {
            Ok(run) => Some(run),
            Err((_, error)) => {
                tracing::debug!(run_id, error, "a run's view without MLflow's start time");
                None
            }
        };
        let clip = match &run {
            Some(run) => clip_of(run, queued_end, now_ms),
            None => Clip::new(None, queued_end, now_ms),
        };
        Ok((run, billed, figures::bill(ranks, &idle, clip)))
    }
}

/// The tags of a billed run: totals under `mlscope.` with what idleness was judged on
/// (`basis`, [`basis::BASIS_TAG`]), and per rank (the first [`MAX_RANK_TAGS`]) under
/// `mlscope/rank-<r>/`, as the sweep's other tags.
fn bill_tags(bill: &RunBill, basis: Option<String>) -> Vec<(String, String)> {
    let mut tags = vec![
        ("mlscope.gpu_hours".to_owned(), hours(bill.gpu_hours())),
        (
            "mlscope.gpu_idle_hours".to_owned(),
            hours(bill.idle_hours()),
        ),
        (
            "mlscope.gpu_idle_fraction".to_owned(),
            format!("{:.4}", bill.idle_fraction()),
        ),
    ];
    if let Some(basis) = basis {
        tags.push((basis::BASIS_TAG.to_owned(), truncate(&basis)));
    }
    for (rank, gpu_seconds, idle_seconds) in bill.per_rank().into_iter().take(MAX_RANK_TAGS) {
        tags.push((
            format!("mlscope/rank-{rank}/gpu_hours"),
            hours(gpu_seconds / 3600.0),
        ));
        tags.push((
            format!("mlscope/rank-{rank}/gpu_idle_hours"),
            hours(idle_seconds / 3600.0),
        ));
    }
    tags
}

/// The clip of a run's bill: MLflow's start and end of it (`runs/get`'s answer) and the end its
/// bill was queued with, the earlier end winning. Each end is checked on its own: a wild one
/// (the client's, stored by MLflow as sent) is ignored rather than winning the minimum.
pub(super) fn clip_of(run: &Run, queued_end: Option<i64>, now_ms: i64) -> Clip {
    let start_ms = run.info.start_time;
    let queued = Clip::new(start_ms, queued_end, now_ms).end_ms;
    let mlflow_end = Clip::new(start_ms, run.info.end_time, now_ms).end_ms;
    Clip {
        start_ms: Clip::new(start_ms, None, now_ms).start_ms,
        end_ms: match (queued, mlflow_end) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bill_is_tagged_with_its_totals_and_what_idleness_was_judged_on() {
        let row = |rank: i64, idle: &str| RankRow {
            run_id: "r".into(),
            node: "n".into(),
            rank,
            gpus: 2,
            gpu_idle: Some(idle.into()),
            gpu_idle_ms: Some(10_000),
            ..RankRow::default()
        };
        let ranks = [row(0, "[0,1800]"), row(1, "[1800,10]")];
        let bill = RunBill {
            gpu_seconds: 7200.0,
            idle_seconds: 1800.0,
            ranks: Vec::new(),
        };
        let totals = [
            ("mlscope.gpu_hours".to_owned(), "2.0000".to_owned()),
            ("mlscope.gpu_idle_hours".to_owned(), "0.5000".to_owned()),
            ("mlscope.gpu_idle_fraction".to_owned(), "0.2500".to_owned()),
        ];
        assert_eq!(bill_tags(&bill, None), totals);
        assert_eq!(
            bill_tags(&bill, basis::of_run(&ranks)),
            [
                totals.to_vec(),
                vec![(
                    "mlscope.gpu_idle_basis".to_owned(),
                    "utilization".to_owned()
                )]
            ]
            .concat()
        );
    }
}
