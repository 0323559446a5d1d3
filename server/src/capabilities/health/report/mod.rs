//! The run report: one page per run that says what it used, what it wasted and what to ask for
//! next time. Built from what run health keeps ([`super::usage`] series and histograms, ranks,
//! the bill, the verdict) by [`model`], drawn by [`render`]; written into the run once, when its
//! bill is (one replica, once), as the artifact `mlscope/report.html` plus summary tags, and
//! served live on the admin listener (`GET /runs/{run_id}/report`).
//!
//! The artifact goes through the proxy's artifact gateway when it is on (its own route table, as a
//! client's upload would), else through MLflow's artifact API; a run whose report cannot be
//! written gets `mlscope.report_error` saying why, and its end is never held up by it.

pub mod model;
pub mod render;

use std::collections::BTreeMap;

use axum::body::Body;
use bytes::Bytes;
use http::{header, HeaderValue, Method, Request};
use tower::ServiceExt as _;

use super::bill::RunBill;
use super::calls::REJECTED;
use super::store::{self as rows, RankRow};
use super::usage::Series;
use super::{findings, truncate, Health};
use crate::plumbing::mlflow::{Caller, Run};

pub use model::RunReport;

/// Where the report goes in the run's artifacts.
pub const REPORT_PATH: &str = "mlscope/report.html";
/// The run's summary in one line.
pub const SUMMARY_TAG: &str = "mlscope.summary";
/// Where the report is (`REPORT_PATH`), once written.
pub const REPORT_TAG: &str = "mlscope.report";
/// The advice, one line each.
pub const ADVICE_TAG: &str = "mlscope.advice";
/// Why the report could not be written.
pub const REPORT_ERROR_TAG: &str = "mlscope.report_error";

impl Health {
    /// Sends reports through the artifact gateway's routes (`router`) rather than to MLflow.
    pub fn write_reports_through(&self, router: axum::Router) {
        let _ = self.inner.artifact_router.set(router);
    }

    /// The report of `run_id` as the store has it at `now_ms`; `None` when no rank of it is known.
    pub async fn report(&self, run_id: &str, now_ms: i64) -> Result<Option<RunReport>, String> {
        let ranks = self
            .inner
            .store
            .ranks_of_run(run_id)
            .await
            .map_err(|e| e.to_string())?;
        if ranks.is_empty() {
            return Ok(None);
        }
        let (run, billed, run_bill) = self.bill_so_far(run_id, &ranks, now_ms).await?;
        let ended = billed.is_some_and(|b| b.reopened_ms.is_none());
        self.assemble(run_id, &ranks, run.as_ref(), &run_bill, !ended, now_ms)
            .await
            .map(Some)
    }

    /// Reads the rest of what the report needs and builds it.
    async fn assemble(
        &self,
        run_id: &str,
        ranks: &[RankRow],
        run: Option<&Run>,
        run_bill: &RunBill,
        live: bool,
        now_ms: i64,
    ) -> Result<RunReport, String> {
        let store = &self.inner.store;
        let text = |e: crate::plumbing::store::StoreError| e.to_string();
        let series_rows = store.series_of_run(run_id).await.map_err(text)?;
        let histogram_rows = store.histograms_of_run(run_id).await.map_err(text)?;
        let finding_rows = store.findings_of_run(run_id).await.map_err(text)?;
        let verdict = store.verdict(run_id).await.map_err(text)?;
        let series = rows::by_rank(&series_rows);
        let mut histograms: BTreeMap<(String, i64), Vec<(i32, i64)>> = BTreeMap::new();
        for h in histogram_rows
            .iter()
            .filter(|h| Series::parse(&h.series) == Some(Series::Memory))
        {
            histograms
                .entry((h.node.clone(), h.rank))
                .or_default()
                .push((h.bucket as i32, h.n));
        }
        let leftovers = |node: &str, rank: i64| findings::leftovers_of(&finding_rows, node, rank);
        let status = run.and_then(|r| r.info.status.clone());
        // A run MLflow still has running is live, whatever was queued for it.
        let live = live || status.as_deref() == Some("RUNNING");
        let (outcome, outcome_detail) = match &verdict {
            Some(v) => (Some(v.outcome.clone()), Some(v.detail.clone())),
            None => {
                // Without a verdict, the ranks' own word: the worst end one reported.
                let worst = ranks
                    .iter()
                    .filter(|r| r.rank >= 0)
                    .filter_map(|r| r.outcome.as_deref())
                    .find(|o| *o != "exited");
                (worst.map(str::to_owned), None)
            }
        };
        Ok(model::build(model::Inputs {
            run_id,
            run_name: run.and_then(|r| r.tag("mlflow.runName").map(str::to_owned)),
            status,
            start_ms: run.and_then(|r| r.info.start_time),
            end_ms: run.and_then(|r| r.info.end_time),
            live,
            now_ms,
            outcome,
            outcome_detail,
            ranks,
            series: &series,
            histograms: &histograms,
            bill: run_bill,
            data_changes: findings::data_changes(&finding_rows),
            leftovers: &leftovers,
        }))
    }

    /// Writes the report of an ended run being billed: the artifact, then the summary tags; on
    /// failure, `mlscope.report_error`. Never fails the bill: returns nothing.
    pub(super) async fn write_report(
        &self,
        run_id: &str,
        ranks: &[RankRow],
        run: &Run,
        run_bill: &RunBill,
        caller: &Caller,
        now_ms: i64,
    ) {
        // `ranks` were read once the bill was claimed, when the run was settled (see
        // `store::bills::settled`): the live report is served from the same rows afterwards.
        let written = match self
            .assemble(run_id, ranks, Some(run), run_bill, false, now_ms)
            .await
        {
            Ok(report) => self.put_report(run, &report, caller).await.map(|()| report),
            Err(error) => Err(format!("reading what the run used failed: {error}")),
        };
        let (tags, outcome) = match &written {
            Ok(report) => {
                let mut tags = vec![
                    (SUMMARY_TAG.to_owned(), truncate(&report.summary)),
                    (REPORT_TAG.to_owned(), REPORT_PATH.to_owned()),
                ];
                if !report.advice.is_empty() {
                    tags.push((ADVICE_TAG.to_owned(), truncate(&report.advice.join("\n"))));
                }
                (tags, "written")
            }
            Err(error) => {
                tracing::warn!(run_id, error, "writing a run's report failed");
                (
                    vec![(
                        REPORT_ERROR_TAG.to_owned(),
                        truncate(&format!(
                            "mlscope could not write {REPORT_PATH}: {error}; the report is served at /runs/{run_id}/report on the proxy's admin listener"
                        )),
                    )],
                    "failed",
                )
            }
        };
        if let Err((reason, error)) = self.write_tags(run_id, caller, &tags).await {
            tracing::warn!(run_id, error, "writing a run's report tags failed");
            self.inner.metrics.health_error(reason);
        }
        self.inner.metrics.report(outcome);
        let state = written
            .as_ref()
            .map_or_else(|e| e.clone(), |_| "written".into());
        if let Err(error) = self
            .inner
            .store
            .record_report(run_id, &truncate(&state))
            .await
        {
            tracing::warn!(%error, run_id, "recording a run's report failed");
            self.inner.metrics.health_error("store");
        }
    }

    /// Puts the report's page into the run's artifacts; `Err` says why not, for a person.
    async fn put_report(
        &self,
        run: &Run,
        report: &RunReport,
        caller: &Caller,
    ) -> Result<(), String> {
        let uri = run.info.artifact_uri.as_deref().unwrap_or_default();
        let Some(root) = proxied_root(uri) else {
            return Err(format!(
                "the run's artifact root {uri:?} is not served through MLflow's artifact API (mlflow-artifacts:/...), so neither MLflow nor this proxy can write into it"
            ));
        };
        let path = format!("{root}/{REPORT_PATH}");
        let page = Bytes::from(render::html(report));
        match self.inner.artifact_router.get() {
            Some(router) => {
                let mut request = Request::new(Body::from(page.clone()));
                *request.method_mut() = Method::PUT;
                *request.uri_mut() = crate::plumbing::mlflow::artifact_request_path(&path)
                    .parse()
                    .map_err(|e| format!("the report's path {path:?} is no URI: {e}"))?;
                *request.headers_mut() = caller.headers().clone();
                request
                    .headers_mut()
                    .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/html"));
                request
                    .headers_mut()
                    .insert(header::CONTENT_LENGTH, HeaderValue::from(page.len()));
                let response = router
                    .clone()
                    .oneshot(request)
                    .await
                    .map_err(|e| e.to_string())?;
                let status = response.status();
                if status.is_success() {
                    return Ok(());
                }
                let body = crate::plumbing::proxy::read_up_to(response.into_body(), 4096)
                    .await
                    .ok()
                    .and_then(Result::ok)
                    .unwrap_or_default();
                Err(format!(
                    "the artifact gateway answered {status}: {}",
                    String::from_utf8_lossy(&body)
                        .chars()
                        .take(300)
                        .collect::<String>()
                ))
            }
            None => self
                .inner
                .mlflow
                .put_artifact(caller, &path, "text/html", page)
                .await
                .map_err(|e| {
                    let (reason, text) = super::calls::failure(e);
                    if reason == REJECTED {
                        format!("MLflow refused it: {text}")
                    } else {
                        text
                    }
                }),
        }
    }
}

/// The path of a run's artifact root in MLflow's artifact API, from its URI
/// (`mlflow-artifacts:/1/<run>/artifacts` or `mlflow-artifacts://host/1/<run>/artifacts`);
/// `None` for a root MLflow does not serve (`s3://...`, a local path).
fn proxied_root(uri: &str) -> Option<String> {
    let rest = uri.strip_prefix("mlflow-artifacts:")?;
    let path = match rest.strip_prefix("//") {
        Some(authority_and_path) => authority_and_path.split_once('/').map(|(_, p)| p)?,
        None => rest,
    };
    let path = path.trim_matches('/');
    (!path.is_empty()).then(|| path.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_roots_that_mlflow_serves_take_a_report() {
        assert_eq!(
            proxied_root("mlflow-artifacts:/1/abc/artifacts").as_deref(),
            Some("1/abc/artifacts")
        );
        assert_eq!(
            proxied_root("mlflow-artifacts://mlflow:5000/1/abc/artifacts").as_deref(),
            Some("1/abc/artifacts")
        );
        assert_eq!(proxied_root("s3://bucket/1/abc/artifacts"), None);
        assert_eq!(proxied_root("/mlruns/1/abc/artifacts"), None);
        assert_eq!(proxied_root("mlflow-artifacts:/"), None);
    }
}
