//! The metric routes: `runs/log-batch` and `runs/log-metric` go through the scope contract
//! ([`crate::capabilities::rewrite`]) and then the run's write queue ([`crate::capabilities::coalesce`]); `runs/log-parameter`
//! and `runs/set-tag` through the write queue alone. Once MLflow stored a write, what it said about
//! its run's ranks goes to run health ([`crate::capabilities::health`]). The body is read once, by whoever reads
//! it first, and travels on as its head and bytes.

use std::net::SocketAddr;
use std::time::SystemTime;

use axum::extract::{ConnectInfo, Request, State};
use axum::response::{IntoResponse, Response};

use crate::capabilities::coalesce::Coalescer;
use crate::capabilities::health::{Beat, Health};
use crate::capabilities::rewrite::body::{Endpoint, MetricsBody, Plain, Scanned};
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
        let read = match self.rewriter.read(request).await {
            Ok(Read::Whole(read)) => read,
            Ok(Read::Unread(request)) => {
                let inspected = Inspected::unread(request);
                return submit(&self.coalescer, &self.health, inspected, peer).await;
            }
            Err(error) => return error.into_response(),
        };
        // A batch is scanned once: for the lane below, and for the rest of its read.
        let body = read.bytes.clone();
        let scanned = (endpoint == Endpoint::LogBatch).then(|| MetricsBody::scan(&body));
        let read = match scanned.as_ref().and_then(Scanned::plain) {
            Some(plain) => match self.at_once(read, plain, peer) {
                Ok(sent) => return sent.await,
                Err(read) => read,
            },
            None => read,
        };
        match self.rewriter.inspect_read(read, endpoint, scanned).await {
            Ok(inspected) => submit(&self.coalescer, &self.health, inspected, peer).await,
            Err(error) => error.into_response(),
        }
    }

    /// A batch of the run's own metrics (`plain`, see [`Scanned::plain`]) to a run with nothing
    /// queued or at MLflow goes at once, as it came ([`Coalescer::at_once`]); what it says of its
    /// run is read after its answer has gone. `Err` gives back any other request, to be read whole.
    #[allow(clippy::result_large_err)]
    fn at_once(
        &self,
        read: ReadBody,
        plain: Plain<'_>,
        peer: SocketAddr,
    ) -> Result<impl std::future::Future<Output = Response> + Send + 'static, ReadBody> {
        let metrics = plain.metrics;
        let workspace = self.rewriter.hears_beats().then(|| {
            crate::plumbing::workspace::of_request(&read.parts.headers)
                .ok()
                .flatten()
                .map(str::to_owned)
        });
        let (parts, bytes, charge) = read.into_parts();
        let sent = match self
            .coalescer
            .at_once(plain.run_id, parts, bytes.clone(), metrics, peer)
        {
            Ok(sent) => sent,
            Err((parts, bytes)) => return Err(ReadBody::from_parts(parts, bytes, charge)),
        };
        // The coalescer holds the body from here, under its own budget.
        drop(charge);
        let (rewriter, health) = (self.rewriter.clone(), self.health.clone());
        Ok(async move {
            let mut response = sent.await;
            response.extensions_mut().insert(WriteWeight(metrics));
            if response.status().is_success() && rewriter.hears_beats() {
                let now = crate::plumbing::store::unix_millis(SystemTime::now());
                after::defer(&mut response, move || {
                    if let Some(beat) = rewriter.plain_beat(&bytes, workspace.flatten()) {
                        record(&health, beat, now);
                    }
                });
            }
            response
        })
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
    let mut response = match outgoing {
        Outgoing::Read { parts, body } => coalescer.submit_read(parts, body, writes, peer).await,
        Outgoing::Unread(request) => coalescer.submit(request, writes, peer).await,
    };
    response.extensions_mut().insert(WriteWeight(weight));
    if let Some(beat) = beat.filter(|_| response.status().is_success()) {
        // Heard as MLflow answered; recorded once the answer has gone (see `after`).
        let now = crate::plumbing::store::unix_millis(SystemTime::now());
        let health = health.clone();
        after::defer(&mut response, move || record(&health, beat, now));
    }
    response
}

/// What a write MLflow stored says of its run, heard at `now`.
fn record(health: &Health, beat: Beat, now: i64) {
    if beat.ranks.is_empty() {
        health.touch(&beat.run_id, now);
    }
    // A batch of the run's own metrics only still says its step (the report's "at step").
    if !beat.ranks.is_empty() || !beat.findings.is_empty() || beat.step.is_some() {
        health.record(beat, now);
    }
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
