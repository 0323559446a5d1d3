//! Write coalescing: metric-only `runs/log-batch` and `runs/log-metric` requests for the same run
//! (and the same credential) that arrive close together are sent to MLflow as one batch.
//!
//! MLflow spends most of a `log-batch` on the request itself, not on its samples (about 14 ms per
//! request against 0.35 ms per sample on SQLite), and in distributed training every rank writes
//! into the same run. Merging their small batches is the largest capacity lever in front of
//! MLflow. The rules:
//!
//! - **Only what MLflow stored is acknowledged.** A client gets 200 only after MLflow answered 200
//!   for the batch that holds its metrics.
//! - **Every client gets MLflow's own answer.** A merged batch MLflow refuses (or cannot take) is
//!   sent again as the original requests, one by one in arrival order, so each client gets what
//!   MLflow would have told it alone (its own 400 for its own invalid metric), and one bad request
//!   never fails another. MLflow stores a sample it already has only once, so resending after a
//!   partly written batch duplicates nothing.
//! - **Never across credentials.** Requests merge only with requests carrying the same credential
//!   headers (see [`crate::authz::credential_fingerprint`]), the same run and the same API path,
//!   so MLflow authorizes the batch exactly as each request.
//! - **Group commit.** A request for a run with no batch at MLflow goes at once (nothing to wait
//!   for, no latency added). While the run has one, requests gather: the next batch leaves when
//!   its oldest request has waited `window`, or at once when it is full (1000 metrics or MLflow's
//!   1 MB body limit), as long as fewer than `in_flight_per_run` batches of the run are at
//!   MLflow; while that many are, requests keep gathering, so batches grow with the load and
//!   shrink back when it falls.
//! - **Bounded.** Queued bodies are bounded per run (metrics) and overall (bytes); past either a
//!   request gets 503 with `Retry-After`, which the MLflow client retries.
//! - Requests with params or tags, fields the proxy does not know, more than 1000 metrics, bodies
//!   that are not JSON or not within MLflow's size limit are forwarded as they came. Scoping and
//!   deduplication happen before (the rewriter prepared the body). A client's own metrics keep
//!   their order; timestamps and steps are untouched. Exact duplicate samples inside one batch are
//!   sent once, as MLflow would store them once.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use bytes::{BufMut, Bytes, BytesMut};
use http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use http_body_util::{BodyExt, Limited};
use serde::Deserialize;
use serde_json::value::RawValue;
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

use crate::authz::credential_fingerprint;
use crate::error::mlflow_error;
use crate::proxy::{request_id, Forwarder};
use crate::rewrite::{is_json, NODE_HEADER, RANK_HEADER};
use crate::telemetry::Metrics;

/// MLflow's limit on metrics per `log-batch`.
pub const MAX_BATCH_METRICS: usize = 1000;
/// MLflow refuses `log-batch` bodies over 1,000,000 characters; merged bodies stay below it with
/// room for the envelope.
pub const MAX_BATCH_BYTES: usize = 1_000_000 - 1024;
/// The longest MLflow answer to a batch read back (`{}`, or an error JSON).
const MAX_ANSWER_BYTES: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoalesceConfig {
    /// How long a request for a run that already has a batch at MLflow waits for others; zero
    /// turns coalescing off.
    pub window: Duration,
    /// Batches of one run at MLflow at once; more requests gather meanwhile.
    pub in_flight_per_run: usize,
    /// Metrics queued per run before requests get 503.
    pub max_pending_per_run: usize,
    /// Bytes of request bodies queued over all runs before requests get 503.
    pub max_pending_bytes: usize,
}

impl Default for CoalesceConfig {
    fn default() -> Self {
        Self {
            window: Duration::from_millis(5),
            in_flight_per_run: 2,
            max_pending_per_run: 50_000,
            max_pending_bytes: 64 << 20,
        }
    }
}

/// Merges concurrent metric writes per run; cheap to clone.
#[derive(Clone)]
pub struct Coalescer {
    inner: Arc<Inner>,
}

struct Inner {
    config: CoalesceConfig,
    forwarder: Forwarder,
    metrics: Metrics,
    /// Queued body bytes, in KiB.
    budget: Arc<Semaphore>,
    runs: Mutex<HashMap<BatchKey, RunQueue>>,
}

/// What may share a batch: the API path it goes to, the run, and the client's credential.
#[derive(Clone, PartialEq, Eq, Hash)]
struct BatchKey {
    path: Arc<str>,
    run_id: Arc<str>,
    credential: [u8; 32],
}

#[derive(Default)]
struct RunQueue {
    queue: VecDeque<Member>,
    metrics: usize,
    bytes: usize,
    in_flight: usize,
    timer: bool,
}

/// One client request waiting in a batch.
struct Member {
    /// Each metric as the JSON object the batch carries.
    elements: Vec<Bytes>,
    bytes: usize,
    /// The request as the rewriter prepared it, to be sent alone if the batch fails.
    original: Original,
    enqueued: Instant,
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

impl Original {
    fn request(&self) -> Request {
        let mut request = Request::new(Body::from(self.body.clone()));
        *request.method_mut() = self.method.clone();
        *request.uri_mut() = self.uri.clone();
        *request.headers_mut() = self.headers.clone();
        request
    }
}

/// `log-batch` as the coalescer takes it: a run id and metrics, nothing else.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchBody<'a> {
    run_id: String,
    #[serde(borrow)]
    metrics: Vec<&'a RawValue>,
    #[serde(default, borrow)]
    params: Vec<&'a RawValue>,
    #[serde(default, borrow)]
    tags: Vec<&'a RawValue>,
}

/// `log-metric` as the coalescer takes it: the fields whose meaning is the same in a batch, in
/// the types MLflow's `log-metric` accepts without conversion.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MetricBody<'a> {
    run_id: String,
    key: String,
    #[serde(borrow)]
    value: &'a RawValue,
    timestamp: i64,
    #[serde(default)]
    step: Option<i64>,
}

/// A request the coalescer can merge: where its batch goes and its metrics.
struct Parsed {
    batch_path: String,
    run_id: String,
    elements: Vec<Bytes>,
}

impl Coalescer {
    pub fn new(config: CoalesceConfig, forwarder: Forwarder, metrics: Metrics) -> Self {
        let permits = (config.max_pending_bytes >> 10).clamp(1, Semaphore::MAX_PERMITS);
        Self {
            inner: Arc::new(Inner {
                config,
                forwarder,
                metrics,
                budget: Arc::new(Semaphore::new(permits)),
                runs: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Answers a prepared metrics request: through a batch when it can be merged, else forwarded
    /// as it is.
    pub async fn submit(&self, request: Request, peer: SocketAddr) -> Response {
        let inner = &self.inner;
        if inner.config.window.is_zero() || !mergeable_head(&request) {
            return inner.forwarder.forward(request, peer).await;
        }
        let (parts, body) = request.into_parts();
        // The rewriter left the body in memory with its length: collecting it copies nothing.
        let body = match Limited::new(body, MAX_BATCH_BYTES).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(e) => {
                return mlflow_error(
                    StatusCode::BAD_REQUEST,
                    "BAD_REQUEST",
                    &format!("the request body could not be read: {e}"),
                )
            }
        };
        let Some(parsed) = parse(parts.uri.path(), &body) else {
            inner.metrics.coalesce_skipped();
            return inner
                .forwarder
                .forward(Request::from_parts(parts, Body::from(body)), peer)
                .await;
        };
        let Ok(permit) = inner
            .budget
            .clone()
            .try_acquire_many_owned(((body.len() >> 10) + 1) as u32)
        else {
            return inner.reject("pending_bytes", "its limit of queued metric bodies");
        };
        let key = BatchKey {
            path: parsed.batch_path.into(),
            run_id: parsed.run_id.into(),
            credential: merge_fingerprint(&parts.headers),
        };
        let (reply, answer) = oneshot::channel();
        let member = Member {
            bytes: parsed.elements.iter().map(Bytes::len).sum::<usize>() + parsed.elements.len(),
            elements: parsed.elements,
            original: Original {
                method: parts.method,
                uri: parts.uri,
                headers: parts.headers,
                body,
                peer,
            },
            enqueued: Instant::now(),
            reply,
            _budget: permit,
        };
        if let Err(member) = Inner::enqueue(inner, key, member) {
            drop(member);
            return inner.reject(
                "pending_per_run",
                "its limit of queued metrics for this run",
            );
        }
        // The batch is sent by its own task: a client that goes away loses only its answer.
        answer.await.unwrap_or_else(|_| {
            mlflow_error(
                StatusCode::SERVICE_UNAVAILABLE,
                "TEMPORARILY_UNAVAILABLE",
                "mlscope-proxy lost this request's batch while shutting down; retry",
            )
        })
    }
}

impl Inner {
    fn reject(&self, reason: &'static str, what: &str) -> Response {
        self.metrics.coalesce_rejected(reason);
        mlflow_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "TEMPORARILY_UNAVAILABLE",
            &format!("mlscope-proxy is holding {what} while MLflow catches up; retry with backoff"),
        )
    }

    fn enqueue(this: &Arc<Inner>, key: BatchKey, member: Member) -> Result<(), Box<Member>> {
        {
            let mut runs = this.runs.lock().expect("coalescer lock");
            let run = runs.entry(key.clone()).or_default();
            if run.metrics + member.elements.len() > this.config.max_pending_per_run
                && !run.queue.is_empty()
            {
                return Err(Box::new(member));
            }
            run.metrics += member.elements.len();
            run.bytes += member.bytes;
            run.queue.push_back(member);
        }
        Inner::pump(this, &key);
        Ok(())
    }

    /// Sends what is ready of `key`'s queue, or arms the timer for when it will be.
    fn pump(this: &Arc<Inner>, key: &BatchKey) {
        loop {
            let mut runs = this.runs.lock().expect("coalescer lock");
            let Some(run) = runs.get_mut(key) else { return };
            let Some(oldest) = run.queue.front().map(|m| m.enqueued) else {
                if run.in_flight == 0 && !run.timer {
                    runs.remove(key);
                }
                return;
            };
            if run.in_flight >= this.config.in_flight_per_run {
                // The batch at MLflow pumps again when it returns.
                return;
            }
            let waited = oldest.elapsed();
            let full = run.metrics >= MAX_BATCH_METRICS || run.bytes >= MAX_BATCH_BYTES;
            // A run with nothing at MLflow sends at once: merging costs no latency while there
            // is nothing to wait for, and starts as soon as writes overlap.
            let idle = run.in_flight == 0;
            if waited < this.config.window && !full && !idle {
                if !run.timer {
                    run.timer = true;
                    let this = this.clone();
                    let key = key.clone();
                    let wait = this.config.window - waited;
                    tokio::spawn(async move {
                        tokio::time::sleep(wait).await;
                        if let Some(run) = this.runs.lock().expect("coalescer lock").get_mut(&key) {
                            run.timer = false;
                        }
                        Inner::pump(&this, &key);
                    });
                }
                return;
            }
            let batch = take_batch(run);
            run.in_flight += 1;
            drop(runs);
            let this = this.clone();
            let key = key.clone();
            tokio::spawn(async move {
                this.send(&key, batch).await;
                if let Some(run) = this.runs.lock().expect("coalescer lock").get_mut(&key) {
                    run.in_flight -= 1;
                }
                Inner::pump(&this, &key);
            });
        }
    }

    /// Sends one batch and answers its members.
    async fn send(&self, key: &BatchKey, batch: Vec<Member>) {
        let now = Instant::now();
        for member in &batch {
            self.metrics
                .coalesce_waited(now.duration_since(member.enqueued));
        }
        let samples: usize = batch.iter().map(|m| m.elements.len()).sum();
        self.metrics.coalesce_batch(batch.len(), samples);
        if batch.len() == 1 {
            // Alone: the request goes as it came, and its answer comes back as MLflow sent it.
            self.metrics.coalesce_outcome("single");
            let member = batch.into_iter().next().expect("one member");
            let response = self
                .forwarder
                .forward(member.original.request(), member.original.peer)
                .await;
            let _ = member.reply.send(response);
            return;
        }
        let first = &batch[0].original;
        let body = merged_body(&key.run_id, &batch);
        let mut headers = first.headers.clone();
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let mut request = Request::new(Body::from(body));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = match key.path.parse() {
            Ok(uri) => uri,
            Err(_) => return self.split(batch, "unparsable path").await,
        };
        *request.headers_mut() = headers;
        let id = request_id(request.headers());
        let answer = match self.forwarder.send(request, first.peer, &id).await {
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
            return self
                .split(batch, &format!("MLflow answered {}: {shown}", parts.status))
                .await;
        }
        self.metrics.coalesce_outcome("merged");
        for member in batch {
            let mut response = Response::new(Body::from(body.clone()));
            *response.status_mut() = parts.status;
            *response.headers_mut() = parts.headers.clone();
            response.headers_mut().remove(header::CONTENT_LENGTH);
            let _ = member.reply.send(response);
        }
    }

    /// The merged batch did not go through: each request goes alone, in arrival order, and gets
    /// MLflow's own answer.
    async fn split(&self, batch: Vec<Member>, reason: &str) {
        tracing::info!(
            requests = batch.len(),
            reason,
            "merged metrics batch not stored; sending its requests one by one"
        );
        self.metrics.coalesce_outcome("split");
        for member in batch {
            let response = self
                .forwarder
                .forward(member.original.request(), member.original.peer)
                .await;
            let _ = member.reply.send(response);
        }
    }
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
fn mergeable_head(request: &Request) -> bool {
    let headers = request.headers();
    let json = is_json(headers);
    let length = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    request.method() == Method::POST
        && json
        && length.is_some_and(|len| len <= MAX_BATCH_BYTES)
        && !headers.contains_key(header::CONTENT_ENCODING)
}

/// The batch path and metrics of a mergeable body; `None` forwards it as it came.
fn parse(path: &str, body: &Bytes) -> Option<Parsed> {
    if let Some(prefix) = path.strip_suffix("/runs/log-batch") {
        let parsed: BatchBody = serde_json::from_slice(body).ok()?;
        if parsed.metrics.is_empty()
            || parsed.metrics.len() > MAX_BATCH_METRICS
            || !parsed.params.is_empty()
            || !parsed.tags.is_empty()
            || parsed.metrics.iter().any(|m| !m.get().starts_with('{'))
        {
            return None;
        }
        let elements = parsed
            .metrics
            .iter()
            .map(|raw| body.slice_ref(raw.get().as_bytes()))
            .collect();
        return Some(Parsed {
            batch_path: format!("{prefix}/runs/log-batch"),
            run_id: parsed.run_id,
            elements,
        });
    }
    let prefix = path.strip_suffix("/runs/log-metric")?;
    let parsed: MetricBody = serde_json::from_slice(body).ok()?;
    // A JSON number MLflow reads as a double (not a string, not out of range).
    let value = parsed.value.get();
    if value.starts_with('"') || serde_json::from_str::<f64>(value).is_err() {
        return None;
    }
    let mut element = serde_json::json!({ "key": parsed.key, "timestamp": parsed.timestamp });
    if let Some(step) = parsed.step {
        element["step"] = step.into();
    }
    // The value's text as the client wrote it.
    let mut text = element.to_string();
    text.pop();
    text.push_str(",\"value\":");
    text.push_str(value);
    text.push('}');
    Some(Parsed {
        batch_path: format!("{prefix}/runs/log-batch"),
        run_id: parsed.run_id,
        elements: vec![Bytes::from(text)],
    })
}

/// Takes requests from the front of the queue while the batch stays within MLflow's limits;
/// always at least one.
fn take_batch(run: &mut RunQueue) -> Vec<Member> {
    let mut batch = Vec::new();
    let (mut metrics, mut bytes) = (0, 0);
    while let Some(next) = run.queue.front() {
        let fits = metrics + next.elements.len() <= MAX_BATCH_METRICS
            && bytes + next.bytes <= MAX_BATCH_BYTES;
        if !batch.is_empty() && !fits {
            break;
        }
        let member = run.queue.pop_front().expect("front exists");
        metrics += member.elements.len();
        bytes += member.bytes;
        run.metrics -= member.elements.len();
        run.bytes -= member.bytes;
        batch.push(member);
    }
    batch
}

/// `{"run_id": ..., "metrics": [...]}` with every member's metrics in arrival order; a sample
/// repeated byte for byte is sent once.
fn merged_body(run_id: &str, batch: &[Member]) -> Bytes {
    let size: usize = batch.iter().map(|m| m.bytes).sum();
    let mut out = BytesMut::with_capacity(size + run_id.len() + 64);
    out.put_slice(b"{\"run_id\":");
    out.put_slice(
        serde_json::to_string(run_id)
            .expect("a string serializes")
            .as_bytes(),
    );
    out.put_slice(b",\"metrics\":[");
    let mut seen: HashSet<&[u8]> = HashSet::new();
    let mut first = true;
    for element in batch.iter().flat_map(|m| &m.elements) {
        if !seen.insert(element) {
            continue;
        }
        if !first {
            out.put_u8(b',');
        }
        first = false;
        out.put_slice(element);
    }
    out.put_slice(b"]}");
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(elements: &[&str]) -> Member {
        let (reply, _) = oneshot::channel();
        let budget = Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap();
        let elements: Vec<Bytes> = elements
            .iter()
            .map(|e| Bytes::from(e.to_string()))
            .collect();
        Member {
            bytes: elements.iter().map(Bytes::len).sum::<usize>() + elements.len(),
            elements,
            original: Original {
                method: Method::POST,
                uri: Uri::from_static("/api/2.0/mlflow/runs/log-batch"),
                headers: HeaderMap::new(),
                body: Bytes::new(),
                peer: SocketAddr::from(([127, 0, 0, 1], 1)),
            },
            enqueued: Instant::now(),
            reply,
            _budget: budget,
        }
    }

    #[test]
    fn metric_only_batches_merge_and_anything_else_is_left_alone() {
        let body = Bytes::from_static(
            br#"{"run_id": "r1", "metrics": [{"key": "a", "value": 1, "timestamp": 5, "step": 0}], "params": [], "tags": []}"#,
        );
        let parsed = parse("/api/2.0/mlflow/runs/log-batch", &body).unwrap();
        assert_eq!(parsed.batch_path, "/api/2.0/mlflow/runs/log-batch");
        assert_eq!(parsed.run_id, "r1");
        assert_eq!(
            parsed.elements,
            [Bytes::from_static(
                br#"{"key": "a", "value": 1, "timestamp": 5, "step": 0}"#
            )]
        );
        for refused in [
            // params, tags, another spelling of the run, unknown fields, no metrics, not objects
            r#"{"run_id": "r1", "metrics": [{"key": "a"}], "params": [{"key": "p", "value": "v"}]}"#,
            r#"{"run_id": "r1", "metrics": [{"key": "a"}], "tags": [{"key": "t", "value": "v"}]}"#,
            r#"{"run_uuid": "r1", "metrics": [{"key": "a"}]}"#,
            r#"{"run_id": "r1", "run_uuid": "r2", "metrics": [{"key": "a"}]}"#,
            r#"{"run_id": "r1", "metrics": []}"#,
            r#"{"run_id": "r1", "metrics": [1]}"#,
            r#"{"run_id": 7, "metrics": [{"key": "a"}]}"#,
            r#"{"run_id": "r1", "run_id": "r2", "metrics": [{"key": "a"}]}"#,
            "not json",
        ] {
            assert!(
                parse("/api/2.0/mlflow/runs/log-batch", &Bytes::from(refused)).is_none(),
                "{refused}"
            );
        }
        let over: Vec<String> = (0..=MAX_BATCH_METRICS)
            .map(|i| format!(r#"{{"key": "k{i}", "value": 1, "timestamp": 1}}"#))
            .collect();
        let over = format!(r#"{{"run_id": "r", "metrics": [{}]}}"#, over.join(","));
        assert!(parse("/api/2.0/mlflow/runs/log-batch", &Bytes::from(over)).is_none());
        assert!(parse("/api/2.0/mlflow/runs/get", &body).is_none());
    }

    #[test]
    fn a_log_metric_becomes_one_batch_element_with_its_value_as_written() {
        let body = Bytes::from_static(
            br#"{"run_id": "r1", "key": "loss", "value": 0.1000000000000000055511151231257827, "timestamp": 7, "step": 3}"#,
        );
        let parsed = parse("/ajax-api/2.0/mlflow/runs/log-metric", &body).unwrap();
        assert_eq!(parsed.batch_path, "/ajax-api/2.0/mlflow/runs/log-batch");
        let element: serde_json::Value = serde_json::from_slice(&parsed.elements[0]).unwrap();
        assert_eq!(
            element,
            serde_json::json!({"key": "loss", "timestamp": 7, "step": 3, "value": 0.1})
        );
        assert!(std::str::from_utf8(&parsed.elements[0])
            .unwrap()
            .ends_with("\"value\":0.1000000000000000055511151231257827}"));
        // Values and fields whose meaning a batch could change go as they came.
        for refused in [
            r#"{"run_id": "r1", "key": "loss", "value": "NaN", "timestamp": 7}"#,
            r#"{"run_id": "r1", "key": "loss", "value": 1e999, "timestamp": 7}"#,
            r#"{"run_id": "r1", "key": "loss", "value": 1, "timestamp": 7.5}"#,
            r#"{"run_id": "r1", "key": "loss", "value": 1, "timestamp": "7"}"#,
            r#"{"run_id": "r1", "key": "loss", "value": 1, "timestamp": 7, "model_id": "m"}"#,
            r#"{"run_uuid": "r1", "key": "loss", "value": 1, "timestamp": 7}"#,
        ] {
            assert!(
                parse("/api/2.0/mlflow/runs/log-metric", &Bytes::from(refused)).is_none(),
                "{refused}"
            );
        }
    }

    #[test]
    fn ranks_of_one_client_merge_and_other_credentials_do_not() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut map = HeaderMap::new();
            for (name, value) in pairs {
                map.insert(*name, HeaderValue::from_static(value));
            }
            map
        };
        let rank = |r: &'static str| {
            merge_fingerprint(&headers(&[
                ("authorization", "Basic dTpw"),
                ("x-mlscope-node", "n1"),
                ("x-mlscope-rank", r),
            ]))
        };
        assert_eq!(rank("0"), rank("1"));
        assert_ne!(
            rank("0"),
            merge_fingerprint(&headers(&[("authorization", "Basic b3RoZXI6cA==")]))
        );
        assert_ne!(
            merge_fingerprint(&headers(&[("cookie", "session=a")])),
            merge_fingerprint(&headers(&[("cookie", "session=b")]))
        );
    }

    #[test]
    fn batches_stay_within_mlflows_limits_and_keep_arrival_order() {
        let mut run = RunQueue::default();
        let big: Vec<String> = (0..600).map(|i| format!(r#"{{"key":"k{i}"}}"#)).collect();
        let big: Vec<&str> = big.iter().map(String::as_str).collect();
        for m in [member(&big), member(&big), member(&[r#"{"key":"x"}"#])] {
            run.metrics += m.elements.len();
            run.bytes += m.bytes;
            run.queue.push_back(m);
        }
        // 600 + 600 would pass 1000: the first batch holds one request.
        assert_eq!(take_batch(&mut run).len(), 1);
        let second = take_batch(&mut run);
        assert_eq!(second.len(), 2);
        assert_eq!(second[1].elements[0], Bytes::from_static(br#"{"key":"x"}"#));
        assert_eq!((run.metrics, run.bytes, run.queue.len()), (0, 0, 0));
    }

    #[test]
    fn a_merged_body_is_one_valid_batch_without_repeated_samples() {
        let batch = [
            member(&[r#"{"key":"a","value":1,"timestamp":1,"step":0}"#]),
            member(&[
                r#"{"key":"a","value":1,"timestamp":1,"step":0}"#,
                r#"{"key":"b","value":2,"timestamp":1,"step":0}"#,
            ]),
        ];
        let body = merged_body("run \"1\"", &batch);
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["run_id"], "run \"1\"");
        let keys: Vec<&str> = json["metrics"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["key"].as_str().unwrap())
            .collect();
        assert_eq!(keys, ["a", "b"]);
    }
}
