//! `POST runs/update` through the proxy: forwarded, and once MLflow accepted an end the run's
//! bill is queued (a resumed run is open again).

use std::net::SocketAddr;
use std::time::SystemTime;

use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::response::{IntoResponse, Response};
use tracing::Instrument as _;

use super::bill::Clip;
use super::Health;
use crate::plumbing::mlflow::{RunUpdate, UpdatedRun};
use crate::plumbing::proxy::{Forwarder, Small};
use crate::plumbing::store::unix_millis;

/// `POST runs/update`: forwarded; once MLflow accepted a terminal status (`FINISHED`,
/// `FAILED`, `KILLED`) the run's GPU bill is queued. The run is the one MLflow acts on
/// (`run_id`, else `run_uuid`, read as MLflow reads them), so a client bills only a run MLflow
/// let it end. A body the handler does not read (over [`MAX_UPDATE_BYTES`]) goes on to MLflow
/// unchanged and unbilled; MLflow's answer is the client's in every case, and never waits on
/// the store.
pub async fn update_run(
    State(health): State<Health>,
    State(forwarder): State<Forwarder>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    request: Request,
) -> Response {
    if !health.inner.config.enabled {
        return forwarder.forward(request, peer).await;
    }
    let (parts, body) = match forwarder.read_small(request, MAX_UPDATE_BYTES, peer).await {
        Ok(Small::Read(parts, body)) => (parts, body),
        Ok(Small::Forwarded(answer)) => return answer,
        Err(error) => return error.into_response(),
    };
    let ended = ended_by(&body);
    let response = forwarder
        .forward(Request::from_parts(parts, Body::from(body)), peer)
        .await;
    let Some((asked_run, status, end_ms)) = ended.filter(|_| response.status().is_success()) else {
        return response;
    };
    // The run MLflow updated is the one its answer describes: however the body spelled its run,
    // only that run is billed.
    let (response, updated) = updated_run(response).await;
    let run_id = match updated {
        Some(run_id) => run_id,
        // An answer without `run_info` (none of the versions in the field sends one): the body,
        // read as MLflow reads it.
        None => asked_run,
    };
    let now = unix_millis(SystemTime::now());
    health.after_update(run_id, status, end_ms, now).await;
    response
}

/// The run MLflow's answer to `runs/update` describes (`run_info.run_id`), and the answer,
/// whole again, for the client. An answer longer than [`MAX_UPDATE_BYTES`] is passed on as it
/// came, describing nothing.
async fn updated_run(response: Response) -> (Response, Option<String>) {
    let (parts, body) = response.into_parts();
    match crate::plumbing::proxy::read_up_to(body, MAX_UPDATE_BYTES).await {
        Ok(Ok(bytes)) => {
            let run = serde_json::from_slice::<UpdatedRun>(&bytes)
                .ok()
                .and_then(|answer| answer.run_info.run_id)
                .filter(|id| crate::plumbing::writes::is_valid_run_id(id));
            (Response::from_parts(parts, Body::from(bytes)), run)
        }
        Ok(Err(unread)) => (Response::from_parts(parts, unread), None),
        Err(error) => {
            tracing::warn!(%error, "MLflow's answer to runs/update could not be read");
            (
                crate::plumbing::error::Error::StoreFailed(
                    "mlscope-proxy lost MLflow's answer to runs/update while reading it; the update may have been applied, read the run before retrying".into(),
                )
                .into_response(),
                None,
            )
        }
    }
}

/// The longest `runs/update` body read for billing; a longer one is forwarded unread.
const MAX_UPDATE_BYTES: usize = crate::capabilities::coalesce::MAX_BATCH_BYTES;
/// Bills being queued in the background at once; beyond it the next waits for the store.
pub(super) const MAX_QUEUEING_BILLS: usize = 64;

/// The run a `runs/update` body ends (or resumes: `RUNNING`), with its status and the end it
/// names.
fn ended_by(body: &[u8]) -> Option<(String, String, Option<i64>)> {
    let run_id = crate::plumbing::writes::run_of(body)?;
    let update: RunUpdate = serde_json::from_slice(body).ok()?;
    let status = update.status?;
    matches!(
        status.as_str(),
        "FINISHED" | "FAILED" | "KILLED" | "RUNNING"
    )
    .then_some((run_id, status, update.end_time))
}

impl Health {
    /// After MLflow accepted a `runs/update` that ends or resumes a run: the store hears of it in
    /// the background, so the client's answer does not wait on the store; with
    /// [`MAX_QUEUEING_BILLS`] already under way, in line.
    async fn after_update(&self, run_id: String, status: String, end_ms: Option<i64>, now_ms: i64) {
        match self.inner.queueing.clone().try_acquire_owned() {
            Ok(permit) => {
                let health = self.clone();
                tokio::spawn(
                    async move {
                        health
                            .updated_by_client(&run_id, &status, end_ms, now_ms)
                            .await;
                        drop(permit);
                    }
                    .in_current_span(),
                );
            }
            Err(_) => {
                self.updated_by_client(&run_id, &status, end_ms, now_ms)
                    .await
            }
        }
    }

    /// A run its client ended is queued for its bill; one it resumed (`RUNNING`) is open again.
    async fn updated_by_client(
        &self,
        run_id: &str,
        status: &str,
        end_ms: Option<i64>,
        now_ms: i64,
    ) {
        if status != "RUNNING" {
            return self.ended_by_client(run_id, status, end_ms, now_ms).await;
        }
        if let Err(error) = self.inner.store.reopen_run(run_id, now_ms).await {
            tracing::warn!(%error, run_id, "reopening a run its client resumed failed");
            self.inner.metrics.health_error("store");
        }
    }

    /// A terminal status queues the run's bill, due once every replica has flushed what it
    /// heard until now.
    async fn ended_by_client(&self, run_id: &str, status: &str, end_ms: Option<i64>, now_ms: i64) {
        let settle = 2 * self.inner.config.flush_interval.as_millis() as i64 + 1_000;
        // The client's end as far as it can be true now (one at or before the epoch, or none:
        // now; one in the future: now); one before the run's start is dropped at billing.
        let end_ms = Clip::new(None, end_ms, now_ms).end_ms.unwrap_or(now_ms);
        if let Err(error) = self
            .inner
            .store
            .queue_bill(run_id, status, Some(end_ms), now_ms + settle)
            .await
        {
            tracing::warn!(%error, run_id, "queueing the bill of a run its client ended failed");
            self.inner.metrics.health_error("store");
        }
    }
}
