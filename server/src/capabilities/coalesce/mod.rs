//! Write coalescing: the writes of one run (`runs/log-batch`, `runs/log-metric`,
//! `runs/log-parameter`, `runs/set-tag`) that arrive close together are sent to MLflow as one batch.
//!
//! MLflow spends most of a `log-batch` on the request itself, not on its samples (about 14 ms per
//! request against 0.35 ms per sample on SQLite), and in distributed training every rank writes
//! into the same run. Merging their small writes is the largest capacity lever in front of
//! MLflow. The rules:
//!
//! - **Only what MLflow stored as sent is acknowledged.** A client gets 200 only after MLflow
//!   answered 200 for the batch that holds its writes, and a request joins a batch only when
//!   MLflow's parser takes each of its elements exactly as written ([`writes`]): MLflow stores an
//!   element it cannot parse as zeros, drops the rest of the batch and still answers 200, so an
//!   unparsable neighbour would cost every other member its samples.
//! - **Every client gets MLflow's own answer.** A merged batch MLflow refuses (or cannot take) is
//!   sent again as the original requests, one by one in arrival order, so each client gets what
//!   MLflow would have told it alone (its own 400 for its own invalid metric or changed param),
//!   and one bad request never fails another. MLflow stores a sample it already has only once and
//!   accepts a param re-logged with its value, so resending after a partly written batch
//!   duplicates nothing.
//! - **Never across credentials.** Requests merge only with requests carrying the same credential
//!   headers (see [`crate::plumbing::credential::fingerprint`]; the workspace header is one of them)
//!   and the same API path, so MLflow authorizes the batch exactly as each request.
//! - **A run's writes keep their order where MLflow shows it.** All writes of a run share one
//!   queue and leave it in arrival order. Batches of a run may be at MLflow at once unless they
//!   write the same param or tag with different values, or one MLflow does not hold yet
//!   ([`claims`]): such a batch waits until the earlier one is stored, and [`batch`] ends a batch
//!   before a conflicting value. Metrics commute, and so do params and tags MLflow already holds
//!   with the value written.
//! - **As many at once as help.** How many batches of a run overlap is learned from what they
//!   cost MLflow, up to `in_flight_per_run` (8) ([`concurrency`]): MLflow's workers are used,
//!   not queued behind.
//! - **No deadlocks.** MLflow before 3.16 deadlocks on PostgreSQL when writes to one run overlap
//!   (40P01, answered 503). The coalescer learns it from MLflow's `/version` at start; from then
//!   on one batch of a run is at MLflow at a time. A later MLflow that still answers a deadlock
//!   halves the overlap, like any failed batch.
//! - **Group commit.** A write for a run with nothing at MLflow goes at once (no latency added).
//!   While the run has a batch there, writes gather: the next batch leaves when its oldest
//!   request has waited `window`, or at once when it is full, once the run may send again; so
//!   batches grow with the load and shrink back when it falls.
//! - **Bounded.** Queued bodies are bounded per run (items) and overall (bytes); past either a
//!   request gets 429 with `Retry-After`, which the MLflow client retries.
//! - Requests the coalescer cannot merge (see [`writes::Alone`]) go to MLflow as they came, in
//!   their run's order: queued with the run they name, alone, with nothing of it beside them.
//!   Scoping and deduplication happen before (the rewriter prepared the body). Timestamps, steps
//!   and values are never re-encoded.

mod batch;
mod claims;
mod concurrency;
mod metrics;
mod settings;

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::time::Instant;

use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::future::BoxFuture;
use http::{header, HeaderMap, HeaderValue, Method, Uri};
use http_body_util::{BodyExt, Limited};
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};
use tracing::Instrument as _;

use crate::plumbing::after;
use crate::plumbing::credential::fingerprint as credential_fingerprint;
use crate::plumbing::error::Error;
use crate::plumbing::error::ProxyError;
use crate::plumbing::identity::{NODE_HEADER, RANK_HEADER};
use crate::plumbing::mlflow::{self, Caller, MlflowError, MlflowVersion, RunTag};
use crate::plumbing::mlflow_version::LearnedVersion;
use crate::plumbing::proxy::is_json;
use crate::plumbing::proxy::{request_id, Forwarder, UpstreamTime};
use crate::plumbing::telemetry::Metrics;
use claims::{Claims, Settled};
use concurrency::Concurrency;
use metrics::CoalesceMetrics;

use crate::plumbing::writes::{self, Alone, Prepared, Writes};
pub use batch::MAX_BATCH_BYTES;
pub use settings::{CoalesceConfig, CoalesceOptions};

/// Batches of one run at MLflow at once before MLflow's answers say how many help.
const START_IN_FLIGHT: usize = 2;

/// The longest MLflow answer to a batch read back (`{}`, or an error JSON).
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// Merges concurrent writes per run; cheap to clone.
#[derive(Clone)]
pub struct Coalescer {
    inner: Arc<Inner>,
}

struct Inner {
    config: CoalesceConfig,
    forwarder: Arc<dyn Sender>,
    metrics: CoalesceMetrics,
    /// Queued body bytes, in KiB.
    budget: Arc<Semaphore>,
    runs: Mutex<HashMap<Arc<str>, RunQueue>>,
    /// Batches of one run at MLflow at once, learned; 1 once the upstream is known to deadlock
    /// on overlapping writes.
    concurrency: Mutex<Concurrency>,
    /// Params and tags MLflow is known to hold, per run: batches writing them with those
    /// values may overlap.
    settled: Mutex<Settled>,
}

/// What may share a batch besides the run: the API path it goes to and the client's credential,
/// worked out from the request's headers the first time another request is compared with it (a
/// run's lone batch, the usual case while MLflow keeps up, never needs it).
struct MergeKey {
    path: Arc<str>,
    credential: OnceLock<[u8; 32]>,
}

/// One run's queued writes and what of the run is at MLflow.
#[derive(Default)]
struct RunQueue {
    queue: VecDeque<Member>,
    items: usize,
    in_flight: usize,
    /// What the batches at MLflow write that a later batch must not race (see [`claims`]).
    at_mlflow: Vec<Arc<Claims>>,
    timer: bool,
}

/// A batch taken from its run's queue to be sent, and what it holds at MLflow.
struct Formed {
    batch: Vec<Member>,
    claims: Arc<Claims>,
}

/// A batch of a run on its way to MLflow: when it is done, or abandoned (its client went away
/// while it was sent on the client's own task), its place at MLflow is given back and the run's
/// queue goes on.
struct Sending {
    this: Arc<Inner>,
    run_id: Arc<str>,
    claims: Arc<Claims>,
}

impl Drop for Sending {
    fn drop(&mut self) {
        let Sending {
            this,
            run_id,
            claims,
        } = self;
        if let Some(run) = this.runs.lock().expect("coalescer lock").get_mut(run_id) {
            run.in_flight -= 1;
            run.at_mlflow.retain(|c| !Arc::ptr_eq(c, claims));
        }
        Inner::pump(this, run_id);
    }
}

/// One client request waiting in a batch.
struct Member {
    merge: MergeKey,
    writes: Writes,
    /// A request that cannot share a batch (see [`Inner::alone`]): it goes as it came, alone,
    /// with nothing of its run at MLflow beside it.
    solo: bool,
    /// The request as the rewriter prepared it, to be sent alone if the batch fails.
    original: Original,
    enqueued: Instant,
    /// Which request this is, among all the coalescer queued.
    ticket: u64,
    reply: oneshot::Sender<Response>,
    _budget: OwnedSemaphorePermit,
}

struct Original {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
    peer: SocketAddr,
}

impl Member {
    /// A request waiting for its batch to `path` (its merge key is the path and the client's
    /// credential), and where its answer arrives.
    fn new(
        path: Arc<str>,
        writes: Writes,
        solo: bool,
        (parts, body, peer): (http::request::Parts, Bytes, SocketAddr),
        budget: OwnedSemaphorePermit,
    ) -> (Member, oneshot::Receiver<Response>) {
        static TICKETS: AtomicU64 = AtomicU64::new(0);
        let (reply, answer) = oneshot::channel();
        let member = Member {
            merge: MergeKey {
                path,
                credential: OnceLock::new(),
            },
            writes,
            solo,
            original: Original {
                method: parts.method,
                uri: parts.uri,
                headers: parts.headers,
                body,
                peer,
            },
            enqueued: Instant::now(),
            ticket: TICKETS.fetch_add(1, Ordering::Relaxed),
            reply,
            _budget: budget,
        };
        (member, answer)
    }

    /// Whether `other` may share a batch with this request (see [`MergeKey`]).
    fn merges_with(&self, other: &Member) -> bool {
        std::ptr::eq(self, other)
            || (self.merge.path == other.merge.path && self.credential() == other.credential())
    }

    fn credential(&self) -> &[u8; 32] {
        self.merge
            .credential
            .get_or_init(|| merge_fingerprint(&self.original.headers))
    }
}

impl Original {
    /// The request as it came, for the last time: nothing sends it again, so its head goes on
    /// as it is, not copied (a lone batch's).
    fn take_request(&mut self) -> Request {
        let mut request = Request::new(Body::from(self.body.clone()));
        *request.method_mut() = self.method.clone();
        *request.uri_mut() = std::mem::take(&mut self.uri);
        *request.headers_mut() = std::mem::take(&mut self.headers);
        request
    }

    fn request(&self) -> Request {
        let mut request = Request::new(Body::from(self.body.clone()));
        *request.method_mut() = self.method.clone();
        *request.uri_mut() = self.uri.clone();
        *request.headers_mut() = self.headers.clone();
        request
    }
}

/// Where the coalescer's requests go: MLflow, through the forwarder; a stand-in in the tests of
/// its batching, ordering and splitting, which run under tokio's paused clock.
trait Sender: Send + Sync + 'static {
    /// A request as it came; the answer is MLflow's, or the proxy's error answer.
    fn forward(&self, request: Request, peer: SocketAddr) -> BoxFuture<'_, Response>;
    /// A merged batch; an error when MLflow gave no answer.
    fn send(
        &self,
        request: Request,
        peer: SocketAddr,
        id: HeaderValue,
    ) -> BoxFuture<'_, Result<Response, ProxyError>>;
}

impl Sender for Forwarder {
    fn forward(&self, request: Request, peer: SocketAddr) -> BoxFuture<'_, Response> {
        Box::pin(Forwarder::forward(self, request, peer))
    }

    fn send(
        &self,
        request: Request,
        peer: SocketAddr,
        id: HeaderValue,
    ) -> BoxFuture<'_, Result<Response, ProxyError>> {
        Box::pin(async move { Forwarder::send(self, request, peer, &id).await })
    }
}

impl Coalescer {
    pub fn new(config: CoalesceConfig, forwarder: Forwarder, metrics: Metrics) -> Self {
        Self::with_sender(config, Arc::new(forwarder), metrics)
    }

    /// A coalescer that sends through `sender` (the forwarder, or a test's stand-in).
    fn with_sender(config: CoalesceConfig, forwarder: Arc<dyn Sender>, metrics: Metrics) -> Self {
        let permits = (config.max_pending_bytes >> 10).clamp(1, Semaphore::MAX_PERMITS);
        let metrics = CoalesceMetrics::new(&metrics);
        let concurrency = Concurrency::new(START_IN_FLIGHT, config.in_flight_per_run);
        metrics.in_flight_limit(concurrency.limit() as i64);
        Self {
            inner: Arc::new(Inner {
                config,
                forwarder,
                metrics,
                budget: Arc::new(Semaphore::new(permits)),
                runs: Mutex::new(HashMap::new()),
                concurrency: Mutex::new(concurrency),
                settled: Mutex::new(Settled::default()),
            }),
        }
    }

    /// Once MLflow's version is known, sends one batch of a run at a time to a version before
    /// 3.16, which deadlocks on PostgreSQL when they overlap.
    pub fn adapt_to(&self, upstream: LearnedVersion) -> tokio::task::JoinHandle<()> {
        let inner = self.inner.clone();
        tokio::spawn(async move {
            let version = upstream.learned().await;
            if deadlocks_on_overlapping_writes(version) {
                inner.one_batch_per_run(&format!("MLflow {version}"));
            }
        })
    }

    /// Answers a write request: through a batch when it can be merged, else forwarded as it is.
    /// `prepared` is what the rewriter read of the body, when it did: the body is not read again.
    pub async fn submit(
        &self,
        request: Request,
        prepared: Option<Prepared>,
        peer: SocketAddr,
    ) -> Response {
        let inner = &self.inner;
        if inner.config.window.is_zero() || !mergeable_head(request.method(), request.headers()) {
            return inner.forwarder.forward(request, peer).await;
        }
        let (parts, body) = request.into_parts();
        let body = match read_body(body).await {
            Ok(body) => body,
            Err(error) => return error.into_response(),
        };
        self.submit_read(parts, body, prepared, peer).await
    }

    /// As [`Coalescer::submit`], for a request whose body was read already (the metric routes
    /// read it to inspect it): it goes on as these bytes, never collected again.
    pub async fn submit_read(
        &self,
        parts: http::request::Parts,
        body: Bytes,
        prepared: Option<Prepared>,
        peer: SocketAddr,
    ) -> Response {
        let inner = &self.inner;
        if inner.config.window.is_zero() || !mergeable_head(&parts.method, &parts.headers) {
            let request = Request::from_parts(parts, Body::from(body));
            return inner.forwarder.forward(request, peer).await;
        }
        let parsed = match prepared.map_or_else(|| writes::parse(parts.uri.path(), &body), |p| p.0)
        {
            Ok(parsed) => parsed,
            Err(alone) => return Inner::alone(inner, alone, parts, body, peer).await,
        };
        let Some(permit) = inner.charge(&body) else {
            return inner.reject("pending_bytes", "its limit of queued write bodies");
        };
        let (member, answer) = Member::new(
            parsed.batch_path.into(),
            parsed.writes,
            false,
            (parts, body, peer),
            permit,
        );
        Inner::wait_in_queue(inner, parsed.run_id.into(), member, answer).await
    }
}

impl Coalescer {
    /// Sends a batch of the run's own metrics (`items` of them, see
    /// [`crate::capabilities::rewrite::body::Scanned::plain`]) at once when its run has
    /// nothing queued and nothing at MLflow: the common case while MLflow keeps up, which then
    /// needs nothing more of the body than its run. It takes the run's place at MLflow claiming
    /// nothing (metrics commute with every other write), so the run's next writes queue behind
    /// it and may overlap it as any metrics batch's would. `Err` gives the request back when the
    /// run is busy (it is then read whole and queued), or when the coalescer would not take it
    /// at all.
    #[allow(clippy::result_large_err)]
    pub fn at_once(
        &self,
        run_id: &str,
        parts: http::request::Parts,
        body: Bytes,
        items: usize,
        peer: SocketAddr,
    ) -> Result<
        impl std::future::Future<Output = Response> + Send + 'static,
        (http::request::Parts, Bytes),
    > {
        let inner = &self.inner;
        if inner.config.window.is_zero() || !mergeable_head(&parts.method, &parts.headers) {
            return Err((parts, body));
        }
        let claims = Arc::new(Claims::default());
        let (run_id, permit) = {
            let mut runs = inner.runs.lock().expect("coalescer lock");
            if runs.contains_key(run_id) {
                return Err((parts, body));
            }
            // Charged once it goes: a busy run's write is charged where it queues.
            let Some(permit) = inner.charge(&body) else {
                return Err((parts, body));
            };
            let run_id: Arc<str> = run_id.into();
            runs.insert(
                run_id.clone(),
                RunQueue {
                    in_flight: 1,
                    at_mlflow: vec![claims.clone()],
                    ..RunQueue::default()
                },
            );
            inner.metrics.runs(1);
            (run_id, permit)
        };
        let sending = Sending {
            this: inner.clone(),
            run_id,
            claims,
        };
        Ok(async move {
            let _budget = permit;
            sending.this.metrics.waited(Duration::ZERO);
            let request = Request::from_parts(parts, Body::from(body));
            let mut response = sending
                .this
                .send_alone(
                    &sending.run_id,
                    request,
                    peer,
                    Writes::default(),
                    (items, items),
                )
                .await;
            // Its place at MLflow is given back once the answer has gone, as a lone batch's.
            after::defer(&mut response, move || drop(sending));
            response
        })
    }

    /// Writes run tags as `caller`, through the run's write queue (at most
    /// [`writes::MAX_BATCH_TAGS`] a `runs/log-batch`), so that they keep their order with the
    /// client's writes to the run and never overlap them at MLflow: the one way the proxy writes
    /// tags of its own (run health's verdicts, bills and idle GPUs, the gateway's upload
    /// failures). Stops at the first batch MLflow did not take.
    pub(crate) async fn set_tags(
        &self,
        caller: &Caller,
        run_id: &str,
        tags: &[RunTag],
    ) -> Result<(), MlflowError> {
        // The proxy's own request, from no client's address.
        let peer = SocketAddr::from(([127, 0, 0, 1], 0));
        for chunk in tags.chunks(writes::MAX_BATCH_TAGS) {
            let request = mlflow::tags_request(caller, run_id, chunk);
            mlflow::answer_of(self.submit(request, None, peer).await).await?;
        }
        Ok(())
    }
}

/// A write's body, whole (at most one batch's bytes); a body that cannot be read is the client's
/// 400.
pub async fn read_body(body: Body) -> Result<Bytes, Error> {
    match Limited::new(body, MAX_BATCH_BYTES).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) => Err(Error::BadRequest(format!(
            "the request body could not be read: {e}"
        ))),
    }
}

impl Inner {
    /// From now on one batch of a run is at MLflow at a time.
    fn one_batch_per_run(&self, because: &str) {
        if self
            .concurrency
            .lock()
            .expect("coalescer lock")
            .pin_to_one()
        {
            tracing::info!(
                because,
                "MLflow deadlocks on overlapping writes to one run; sending one batch per run at a time"
            );
        }
        self.metrics.in_flight_limit(1);
    }

    fn reject(&self, reason: &'static str, what: &str) -> Response {
        self.metrics.rejected(reason);
        Error::Overloaded(format!(
            "mlscope-proxy is holding {what} while MLflow catches up; retry with backoff"
        ))
        .into_response()
    }

    /// A request that cannot share a batch goes to MLflow as it came. When it names a run it
    /// takes its place in that run's queue: it leaves in arrival order, alone, once nothing of
    /// the run is at MLflow, and nothing of the run leaves while it is there (MLflow may store
    /// part of it, or act on it otherwise than the coalescer reads it).
    async fn alone(
        this: &Arc<Inner>,
        why: Alone,
        parts: http::request::Parts,
        body: Bytes,
        peer: SocketAddr,
    ) -> Response {
        this.metrics.skipped(why.reason());
        let run_id = writes::run_of(&body).filter(|r| writes::is_valid_run_id(r));
        let permit = this.charge(&body);
        let (Some(run_id), Some(permit)) = (run_id, permit) else {
            // No run MLflow would act on (it refuses the request), or no room to queue it.
            return this
                .forwarder
                .forward(Request::from_parts(parts, Body::from(body)), peer)
                .await;
        };
        let path = parts.uri.path().into();
        let (member, answer) =
            Member::new(path, Writes::default(), true, (parts, body, peer), permit);
        Inner::wait_in_queue(this, run_id.into(), member, answer).await
    }

    /// The queue budget a body holds while it waits; `None` when the queued bodies are at their
    /// limit.
    fn charge(&self, body: &Bytes) -> Option<OwnedSemaphorePermit> {
        self.budget
            .clone()
            .try_acquire_many_owned(((body.len() >> 10) + 1) as u32)
            .ok()
    }

    /// Queues `member` with its run's writes and waits for its answer.
    async fn wait_in_queue(
        this: &Arc<Inner>,
        run_id: Arc<str>,
        member: Member,
        answer: oneshot::Receiver<Response>,
    ) -> Response {
        let ticket = member.ticket;
        match Inner::enqueue(this, run_id.clone(), member, ticket) {
            Err(_) => {
                return this.reject("pending_per_run", "its limit of queued writes for this run")
            }
            // Its batch is itself alone: sent on this request's own task, with no hand-over to
            // another task and back. A client that goes away takes it along, as it would a
            // request forwarded as it came; the run's next batch goes meanwhile.
            Ok(Some(own)) => {
                let sending = Sending {
                    this: this.clone(),
                    run_id,
                    claims: own.claims,
                };
                this.send(&sending.run_id, own.batch).await;
                // Its place at MLflow is given back, and the run's queue goes on, once the
                // answer has gone (what `send` learned of the batch is attached first, so it
                // is known before the next batch forms).
                let Ok(mut response) = answer.await else {
                    return lost_in_shutdown();
                };
                after::defer(&mut response, move || drop(sending));
                return response;
            }
            // A batch shared with others is sent by its own task: a client that goes away loses
            // only its answer.
            Ok(None) => {}
        }
        answer.await.unwrap_or_else(|_| lost_in_shutdown())
    }

    /// Queues `member` and sends what is ready; the batch of `own` (a ticket) alone, when it is
    /// ready, is handed back to be sent by the caller.
    fn enqueue(
        this: &Arc<Inner>,
        run_id: Arc<str>,
        member: Member,
        own: u64,
    ) -> Result<Option<Formed>, Box<Member>> {
        {
            let mut runs = this.runs.lock().expect("coalescer lock");
            let run = runs.entry(run_id.clone()).or_insert_with(|| {
                this.metrics.runs(1);
                RunQueue::default()
            });
            let items = member.writes.items();
            if run.items + items > this.config.max_pending_per_run && !run.queue.is_empty() {
                return Err(Box::new(member));
            }
            run.items += items;
            run.queue.push_back(member);
            this.metrics.queued(1);
        }
        Ok(Inner::pump_keeping(this, &run_id, Some(own)))
    }

    /// Sends what is ready of the run's queue, or arms the timer for when it will be.
    fn pump(this: &Arc<Inner>, run_id: &Arc<str>) {
        Inner::pump_keeping(this, run_id, None);
    }

    /// As [`Inner::pump`]; a batch of the request `own` (a ticket) alone is not given a task but
    /// handed back, to be sent by the caller.
    fn pump_keeping(this: &Arc<Inner>, run_id: &Arc<str>, own: Option<u64>) -> Option<Formed> {
        let mut kept = None;
        loop {
            let mut runs = this.runs.lock().expect("coalescer lock");
            let Some(run) = runs.get_mut(run_id) else {
                return kept;
            };
            let Some(oldest) = run.queue.front().map(|m| m.enqueued) else {
                if run.in_flight == 0 && !run.timer {
                    runs.remove(run_id);
                    this.metrics.runs(-1);
                }
                return kept;
            };
            let limit = this.concurrency.lock().expect("coalescer lock").limit();
            if run.in_flight >= limit {
                // The batch at MLflow pumps again when it returns.
                return kept;
            }
            let members = plan(&run.queue);
            let claims = {
                let mut settled = this.settled.lock().expect("coalescer lock");
                let settled = settled.of(run_id);
                let claims = if run.queue.front().is_some_and(|m| m.solo) {
                    Claims::everything()
                } else {
                    Claims::of(run.queue.iter().take(members).map(|m| &m.writes), settled)
                };
                if claims.conflicts(&run.at_mlflow, settled) {
                    // A param or tag another batch at MLflow writes: it waits until that one
                    // is stored.
                    return kept;
                }
                Arc::new(claims)
            };
            let waited = oldest.elapsed();
            // Nothing more can join: the next request does not fit.
            let full = members < run.queue.len();
            // A run with nothing at MLflow sends at once: merging costs no latency while there
            // is nothing to wait for, and starts as soon as writes overlap.
            let idle = run.in_flight == 0;
            if waited < this.config.window && !full && !idle {
                if !run.timer {
                    run.timer = true;
                    let this = this.clone();
                    let run_id = run_id.clone();
                    let wait = this.config.window - waited;
                    // The batch's log lines carry the span (the request id) of the request that
                    // armed the timer.
                    tokio::spawn(
                        async move {
                            tokio::time::sleep(wait).await;
                            if let Some(run) =
                                this.runs.lock().expect("coalescer lock").get_mut(&run_id)
                            {
                                run.timer = false;
                            }
                            Inner::pump(&this, &run_id);
                        }
                        .in_current_span(),
                    );
                }
                return kept;
            }
            let batch: Vec<Member> = run.queue.drain(..members).collect();
            run.items -= batch.iter().map(|m| m.writes.items()).sum::<usize>();
            this.metrics.queued(-(batch.len() as i64));
            run.in_flight += 1;
            run.at_mlflow.push(claims.clone());
            drop(runs);
            if let [only] = batch.as_slice() {
                if Some(only.ticket) == own && kept.is_none() {
                    kept = Some(Formed { batch, claims });
                    continue;
                }
            }
            let sending = Sending {
                this: this.clone(),
                run_id: run_id.clone(),
                claims,
            };
            // Sent in the span of the request that completed the batch (its request id).
            tokio::spawn(
                async move {
                    sending.this.send(&sending.run_id, batch).await;
                }
                .in_current_span(),
            );
        }
    }

    /// Sends one batch and answers its members.
    async fn send(self: &Arc<Self>, run_id: &Arc<str>, batch: Vec<Member>) {
        let now = Instant::now();
        for member in &batch {
            self.metrics.waited(now.duration_since(member.enqueued));
        }
        let samples: usize = batch.iter().map(|m| m.writes.metrics.len()).sum();
        let items: usize = batch.iter().map(|m| m.writes.items()).sum();
        let held = self.held_params(run_id, &batch);
        if batch.len() == 1 && held.is_empty() {
            let mut member = batch.into_iter().next().expect("one member");
            let request = member.original.take_request();
            let response = self
                .send_alone(
                    run_id,
                    request,
                    member.original.peer,
                    member.writes,
                    (samples, items),
                )
                .await;
            let _ = member.reply.send(response);
            return;
        }
        self.metrics.batch(batch.len(), samples);
        let first = &batch[0];
        let body = batch::merged_body(run_id, batch.iter().map(|m| &m.writes), &held);
        let mut headers = first.original.headers.clone();
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let mut request = Request::new(Body::from(body));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = match first.merge.path.parse() {
            Ok(uri) => uri,
            Err(_) => return self.split(batch, "unparsable path").await,
        };
        *request.headers_mut() = headers;
        let id = request_id(request.headers());
        let asked = Instant::now();
        let answer = match self.forwarder.send(request, first.original.peer, id).await {
            Ok(response) => response,
            Err(e) => return self.split(batch, &e.to_string()).await,
        };
        let (parts, body) = answer.into_parts();
        let body = match Limited::new(body, MAX_ANSWER_BYTES).collect().await {
            Ok(body) => body.to_bytes(),
            Err(e) => return self.split(batch, &format!("answer unreadable: {e}")).await,
        };
        if !parts.status.is_success() {
            let shown = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
            if names_a_deadlock(&body) {
                tracing::info!(
                    "MLflow answered a batch with a deadlock; fewer batches of a run overlap"
                );
            }
            return self
                .split(batch, &format!("MLflow answered {}: {shown}", parts.status))
                .await;
        }
        self.metrics.outcome("merged");
        self.stored(
            run_id,
            batch.iter().map(|m| &m.writes),
            items,
            now.elapsed(),
        );
        let upstream = UpstreamTime(asked.elapsed());
        for member in batch {
            let mut response = Response::new(Body::from(body.clone()));
            *response.status_mut() = parts.status;
            *response.headers_mut() = parts.headers.clone();
            response.headers_mut().remove(header::CONTENT_LENGTH);
            response.extensions_mut().insert(upstream);
            let _ = member.reply.send(response);
        }
    }

    /// Sends a batch of one request (`writes`, of `samples` metrics and `items` elements in
    /// all) as it came: its answer is MLflow's as MLflow sent it.
    async fn send_alone(
        self: &Arc<Self>,
        run_id: &Arc<str>,
        request: Request,
        peer: SocketAddr,
        writes: Writes,
        (samples, items): (usize, usize),
    ) -> Response {
        let now = Instant::now();
        self.metrics.batch(1, samples);
        self.metrics.outcome("single");
        let mut response = self.forwarder.forward(request, peer).await;
        if response.status().is_success() {
            // Learned once the answer has gone (see `after`), before its run's next batch
            // is formed: that waits for this one's place at MLflow, given back after this.
            let (this, run_id, took) = (self.clone(), run_id.clone(), now.elapsed());
            after::defer(&mut response, move || {
                this.stored(&run_id, std::iter::once(&writes), items, took);
            });
        } else if response.status().is_server_error() {
            self.failed();
        }
        response
    }

    /// The params of `batch` MLflow holds with the value written: MLflow would skip them, so they
    /// need not go again. None when nothing else is in the batch, which then goes as written
    /// (MLflow's answer about the run stays its own).
    fn held_params(&self, run_id: &Arc<str>, batch: &[Member]) -> HashSet<Box<str>> {
        let others = batch
            .iter()
            .any(|m| !m.writes.metrics.is_empty() || !m.writes.tags.is_empty());
        if !others {
            return HashSet::new();
        }
        let mut settled = self.settled.lock().expect("coalescer lock");
        let Some(known) = settled.of(run_id) else {
            return HashSet::new();
        };
        batch
            .iter()
            .flat_map(|m| &m.writes.params)
            .filter(|p| known.param(&p.key) == Some(&*p.value))
            .map(|p| p.key.clone())
            .collect()
    }

    /// MLflow stored `batch` (`items` elements) in `took`: its params and tags are settled, and
    /// the cost tells how many batches may overlap.
    fn stored<'a>(
        &self,
        run_id: &Arc<str>,
        batch: impl IntoIterator<Item = &'a Writes>,
        items: usize,
        took: Duration,
    ) {
        self.settled
            .lock()
            .expect("coalescer lock")
            .learn(run_id, batch.into_iter());
        let mut concurrency = self.concurrency.lock().expect("coalescer lock");
        concurrency.stored(items, took, Instant::now());
        self.metrics.in_flight_limit(concurrency.limit() as i64);
    }

    fn failed(&self) {
        let mut concurrency = self.concurrency.lock().expect("coalescer lock");
        concurrency.failed();
        self.metrics.in_flight_limit(concurrency.limit() as i64);
    }

    /// The merged batch did not go through: each request goes alone, in arrival order, and gets
    /// MLflow's own answer.
    async fn split(&self, batch: Vec<Member>, reason: &str) {
        tracing::info!(
            requests = batch.len(),
            reason,
            "merged batch not stored; sending its requests one by one"
        );
        self.metrics.outcome("split");
        self.failed();
        for member in batch {
            let response = self
                .forwarder
                .forward(member.original.request(), member.original.peer)
                .await;
            let _ = member.reply.send(response);
        }
    }
}

/// The answer of a request whose batch went with the proxy's runtime.
fn lost_in_shutdown() -> Response {
    Error::Unavailable("mlscope-proxy lost this request's batch while shutting down; retry".into())
        .into_response()
}

/// Whether an MLflow of this version deadlocks on PostgreSQL when writes to one run overlap
/// (fixed in 3.16: MLflow issue 24923).
fn deadlocks_on_overlapping_writes(version: MlflowVersion) -> bool {
    version < MlflowVersion::new(3, 16, 0)
}

/// Whether an MLflow error answer is a database deadlock (PostgreSQL 40P01, MySQL 1213).
fn names_a_deadlock(body: &[u8]) -> bool {
    let text = String::from_utf8_lossy(&body[..body.len().min(4096)]).to_ascii_lowercase();
    text.contains("deadlock")
}

/// How many requests from the front of `queue` the next batch takes: those sharing the first
/// one's merge key while they fit (see [`batch`]).
fn plan(queue: &VecDeque<Member>) -> usize {
    let mut builder = batch::Builder::default();
    let Some(first) = queue.front() else {
        return 0;
    };
    if first.solo {
        return 1;
    }
    for member in queue {
        if member.solo || !first.merges_with(member) || !builder.add(&member.writes) {
            break;
        }
    }
    builder.members()
}

/// The credential a request merges under: every header that could identify the client to
/// MLflow (see [`credential_fingerprint`]), without mlscope's own identity headers, which the
/// rewriter has already applied to the keys and which say nothing to MLflow.
fn merge_fingerprint(headers: &HeaderMap) -> [u8; 32] {
    if !headers.contains_key(NODE_HEADER) && !headers.contains_key(RANK_HEADER) {
        return credential_fingerprint(headers);
    }
    let mut headers = headers.clone();
    headers.remove(NODE_HEADER);
    headers.remove(RANK_HEADER);
    credential_fingerprint(&headers)
}

/// Whether the head allows a merge: a JSON body of known length within MLflow's limit.
fn mergeable_head(method: &Method, headers: &HeaderMap) -> bool {
    let json = is_json(headers);
    let length = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    method == Method::POST
        && json
        && length.is_some_and(|len| len <= MAX_BATCH_BYTES)
        && !headers.contains_key(header::CONTENT_ENCODING)
}

#[cfg(test)]
mod tests;
