//! The metric routes: `runs/log-batch` and `runs/log-metric` go through the scope contract
//! ([`crate::capabilities::rewrite`]) and then the run's write queue ([`crate::capabilities::coalesce`]); `runs/log-parameter`
//! and `runs/set-tag` through the write queue alone. Once MLflow stored a write, what it said about
//! its run's ranks goes to run health ([`crate::capabilities::health`]). The body is read once, by whoever reads
//! it first, and travels on as its head and bytes.

use std::net::SocketAddr;
use std::time::SystemTime;

use axum::extract::{ConnectInfo, Request, State};
use axum::response::{IntoResponse, Response};

use crate::capabilities::coalesce::{Coalescer, Early};
use crate::capabilities::health::{Beat, Health};
use crate::capabilities::rewrite::body::Endpoint;
use crate::capabilities::rewrite::plain::plain_run;
use crate::capabilities::rewrite::{Inspected, Outgoing, Read, ReadBody, SharedRewriter};
use crate::plumbing::after;
use crate::plumbing::proxy::Small;
use crate::plumbing::writes::WriteWeight;

/// What the metric writes need, held once: the MLflow-facing service answers a `POST` to
/// `runs/log-batch` (the contract and deduplication applied, then merged with other writes to
/// the run or forwarded) or `runs/log-metric` (the same; a renamed sample may go on as a
/// log-batch) through it directly, without the route table's routing and extractors (see
/// `shell::app::Mlflow`).
pub(crate) struct MetricWrites {
    pub(crate) rewriter: SharedRewriter,
    pub(crate) coalescer: Coalescer,
    pub(crate) health: Health,
}

impl MetricWrites {
    /// Answers `POST runs/log-batch` or `runs/log-metric` (`endpoint`) from `peer`.
    pub(crate) async fn write(
        &self,
        request: Request,
        endpoint: Endpoint,
        peer: SocketAddr,
    ) -> Response {
        let body = match self.rewriter.read(request).await {
            Ok(Read::Body(body)) => body,
            Ok(Read::Unread(request)) => {
                let inspected = Inspected::unread(request);
                return submit(&self.coalescer, &self.health, inspected, peer).await;
            }
            Err(error) => return error.into_response(),
        };
        if let Some(early) = plain_run(&body.bytes).and_then(|run| self.coalescer.claim_idle(run)) {
            return self.write_early(early, body, endpoint, peer).await;
        }
        match self.rewriter.inspect_read(body, endpoint).await {
            Ok(inspected) => submit(&self.coalescer, &self.health, inspected, peer).await,
            Err(error) => error.into_response(),
        }
    }

    /// A write of the run's own metrics (the contract leaves it as it came, see
    /// [`crate::capabilities::rewrite::plain`]) to a run with nothing queued or at MLflow: it
    /// goes to MLflow at once, holding the whole run, and is read while MLflow stores it. What
    /// the read finds (its params and tags for the run's later batches, its weight, its beat) is
    /// what the write path would have found before sending it; the client's answer is MLflow's.
    async fn write_early(
        &self,
        mut early: Early,
        body: ReadBody,
        endpoint: Endpoint,
        peer: SocketAddr,
    ) -> Response {
        let mut request = Request::new(axum::body::Body::from(body.bytes.clone()));
        *request.method_mut() = body.parts.method.clone();
        *request.uri_mut() = body.parts.uri.clone();
        *request.headers_mut() = body.parts.headers.clone();
        let sent = self.coalescer.send_early(request, peer);
        let read = async {
            // The request is handed to the upstream connection's task, which writes it when
            // this task gives way: the read waits for that.
            tokio::task::yield_now().await;
            let mut inspected = self.rewriter.inspect_read(body, endpoint).await;
            let prepared = match inspected {
                Ok(ref mut inspected) => inspected.writes.take(),
                Err(_) => None,
            };
            (inspected, early.read(prepared))
        };
        let (mut response, (inspected, stored)) = tokio::join!(sent, read);
        early.answered(&mut response, stored);
        match inspected {
            Ok(inspected) => settle(&self.health, response, inspected.weight, inspected.beat),
            Err(error) => {
                // Not reached: the scan passes no body the read refuses. MLflow had it first.
                tracing::warn!(%error, "a metrics write sent before it was read reads as refused");
                response
            }
        }
    }
}

/// Sends an inspected request on, records its heartbeats once MLflow stored them, and marks the
/// answer with the request's weight for the client's share of samples.
async fn submit(
    coalescer: &Coalescer,
    health: &Health,
    inspected: Inspected,
    peer: SocketAddr,
) -> Response {
    let Inspected {
        outgoing,
        weight,
        beat,
        writes,
    } = inspected;
    let response = match outgoing {
        Outgoing::Read { parts, body } => coalescer.submit_read(parts, body, writes, peer).await,
        Outgoing::Unread(request) => coalescer.submit(request, writes, peer).await,
    };
    settle(health, response, weight, beat)
}

/// Marks MLflow's answer to a metrics write with the write's weight, and records its beat once
/// the answer has gone, when MLflow stored it.
fn settle(health: &Health, mut response: Response, weight: usize, beat: Option<Beat>) -> Response {
    response.extensions_mut().insert(WriteWeight(weight));
    if let Some(beat) = beat.filter(|_| response.status().is_success()) {
        // Heard as MLflow answered; recorded once the answer has gone (see `after`).
        let now = crate::plumbing::store::unix_millis(SystemTime::now());
        let health = health.clone();
        after::defer(&mut response, move || {
            if beat.ranks.is_empty() {
                health.touch(&beat.run_id, now);
            }
            // A batch of the run's own metrics only still says its step (the report's "at step").
            if !beat.ranks.is_empty() || !beat.findings.is_empty() || beat.step.is_some() {
                health.record(beat, now);
            }
        });
    }
    response
}

/// `POST runs/log-parameter` and `runs/set-tag`: through the coalescer; once MLflow accepted
/// one, it is a sign of life for its run, as a metric write is (a run that logs only params and
/// tags for a while is not lost).
pub(crate) async fn log_pair(
    State(coalescer): State<Coalescer>,
    State(health): State<Health>,
    State(forwarder): State<crate::plumbing::proxy::Forwarder>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    request: Request,
) -> Response {
    // A body longer than a batch cannot share one: it goes on unread, as it comes, and MLflow
    // answers it (MLflow stores tags and params of megabytes).
    let (parts, body) = match forwarder
        .read_small(
            request,
            crate::capabilities::coalesce::MAX_BATCH_BYTES,
            peer,
        )
        .await
    {
        Ok(Small::Read(parts, body)) => (parts, body),
        Ok(Small::Forwarded(answer)) => return answer,
        Err(error) => return error.into_response(),
    };
    let (body, parts) = crate::plumbing::writes::normalized(body, parts);
    let run_id = crate::plumbing::writes::run_of(&body);
    let mut response = coalescer.submit_read(parts, body, None, peer).await;
    if let Some(run_id) = run_id.filter(|_| response.status().is_success()) {
        let now = crate::plumbing::store::unix_millis(SystemTime::now());
        let health = health.clone();
        after::defer(&mut response, move || health.touch(&run_id, now));
    }
    response
}
