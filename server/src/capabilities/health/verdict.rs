//! A dead run's verdict: claimed once across replicas, checked against MLflow (a run its client
//! ended meanwhile is left alone), written as run tags (the outcome where the UI shows it, and
//! the facts behind it), the run ended `FAILED` at its last sign of life (`--stale-run-action
//! end`), and its bill queued.

use super::calls::failure;
use super::judge::{self, Judgement};
use super::store::{RankRow, VerdictRow};
use super::{truncate, Health, StaleAction, MAX_RANK_TAGS};
use crate::plumbing::mlflow::UpdateRun;

enum Acted {
    Done,
    EndedByClient(String),
}

impl Health {
    /// Claims the run, asks MLflow whether it still runs, and tags and ends it.
    pub(super) async fn carry_out(
        &self,
        run_id: &str,
        ranks: &[RankRow],
        judgement: &Judgement,
        now_ms: i64,
    ) {
        let config = &self.inner.config;
        let claim = VerdictRow {
            run_id: run_id.to_owned(),
            outcome: judgement.outcome.as_str().to_owned(),
            action: config.action.as_str().to_owned(),
            detail: judgement.detail.clone(),
            replica: self.inner.replica_id.clone(),
            claimed_ms: now_ms,
            done: 0,
        };
        // A claim older than a few sweeps was abandoned by a replica that died mid-way.
        let abandoned_before = now_ms - 4 * config.sweep_interval.as_millis() as i64;
        match self
            .inner
            .store
            .claim_verdict(&claim, abandoned_before)
            .await
        {
            Ok(true) => {}
            Ok(false) => return,
            Err(error) => {
                tracing::warn!(%error, run_id, "claiming a stale run failed");
                self.inner.metrics.health_error("store");
                return;
            }
        }
        let finished = match self.act(run_id, ranks, judgement).await {
            Ok(Acted::Done) => (judgement.outcome.as_str(), config.action.as_str()),
            Ok(Acted::EndedByClient(status)) => {
                tracing::info!(
                    run_id,
                    status,
                    "run judged dead was ended by its client meanwhile; left as it is"
                );
                ("ended_by_client", "none")
            }
            Err((reason, error)) => {
                tracing::warn!(
                    run_id,
                    error,
                    "acting on a dead run failed; retried in a later sweep"
                );
                self.inner.metrics.health_error(reason);
                return;
            }
        };
        self.inner.metrics.run_judged(finished.0, finished.1);
        tracing::info!(
            run_id,
            outcome = finished.0,
            action = finished.1,
            detail = judgement.detail,
            "stale run judged"
        );
        if let Err(error) = self
            .inner
            .store
            .finish_verdict(
                run_id,
                &self.inner.replica_id,
                finished.0,
                finished.1,
                &judgement.detail,
            )
            .await
        {
            tracing::warn!(%error, run_id, "recording a verdict failed");
            self.inner.metrics.health_error("store");
        }
        // Billed at its last sign of life; a run its client had ended, at MLflow's end time.
        let end_ms = (finished.1 != "none").then_some(judgement.end_time_ms);
        if let Err(error) = self
            .inner
            .store
            .queue_bill(run_id, finished.0, end_ms, now_ms)
            .await
        {
            tracing::warn!(%error, run_id, "queueing the bill of a judged run failed");
            self.inner.metrics.health_error("store");
        }
    }

    async fn act(
        &self,
        run_id: &str,
        ranks: &[RankRow],
        judgement: &Judgement,
    ) -> Result<Acted, (&'static str, String)> {
        let caller = self.run_caller(ranks);
        let run = self.get_run(&caller, run_id).await?;
        let status = run.info.status.as_deref().unwrap_or_default();
        if status != "RUNNING" {
            return Ok(Acted::EndedByClient(status.to_owned()));
        }
        let note = run.tag("mlflow.note.content").unwrap_or_default();
        let tags = self.tags(ranks, judgement, note);
        // The verdict's tags join the run's write queue, as every tag the proxy writes: a rank
        // that comes back to life meanwhile has its writes stored in order with them.
        self.write_tags(run_id, &caller, &tags).await?;
        if self.inner.config.action == StaleAction::End {
            let update = UpdateRun {
                run_id,
                run_uuid: run_id,
                status: "FAILED",
                end_time: Some(judgement.end_time_ms),
            };
            self.inner
                .mlflow
                .update_run(&caller, &update)
                .await
                .map_err(failure)?;
        }
        Ok(Acted::Done)
    }

    /// The tags a judged run gets: the outcome where the UI shows it (the description), and the
    /// facts behind it.
    fn tags(&self, ranks: &[RankRow], judgement: &Judgement, note: &str) -> Vec<(String, String)> {
        let outcome = judgement.outcome.as_str();
        let action = match self.inner.config.action {
            StaleAction::End => format!(
                "ended the run as FAILED at its last sign of life, {}",
                judge::timestamp(judgement.end_time_ms)
            ),
            StaleAction::Tag => {
                "tagged the run and left it RUNNING (--stale-run-action tag)".to_owned()
            }
        };
        let mut last_heard: Vec<String> = ranks
            .iter()
            .map(|r| {
                let mut text = format!(
                    "{}: {}",
                    judge::rank_label(&r.node, r.rank),
                    judge::timestamp(r.last_heard_ms)
                );
                if let Some(outcome) = &r.outcome {
                    text.push_str(&format!(" ({outcome})"));
                }
                text
            })
            .collect();
        last_heard.sort();
        let summary = format!(
            "**mlscope: outcome {outcome}.** {}. mlscope-proxy {action}.",
            judgement.detail
        );
        let description = if note.is_empty() {
            summary.clone()
        } else {
            format!("{note}\n\n{summary}")
        };
        let mut tags = vec![
            ("mlscope.outcome".to_owned(), outcome.to_owned()),
            (
                "mlscope.outcome_detail".to_owned(),
                truncate(&judgement.detail),
            ),
            (
                "mlscope.last_heard".to_owned(),
                truncate(&last_heard.join("; ")),
            ),
            (
                "mlscope.silent_nodes".to_owned(),
                truncate(&judgement.silent_nodes.join(",")),
            ),
            (
                "mlscope.judged_by".to_owned(),
                format!("mlscope-proxy {}", self.inner.replica_id),
            ),
            ("mlflow.note.content".to_owned(), truncate(&description)),
        ];
        // One tag per rank, for the first ranks only: a run's tags stay bounded however many
        // ranks it had (the health view lists them all).
        for r in ranks.iter().filter(|r| r.rank >= 0).take(MAX_RANK_TAGS) {
            tags.push((
                format!("mlscope/rank-{}/last_heard", r.rank),
                judge::timestamp(r.last_heard_ms),
            ));
        }
        tags
    }
}
