//! System-metric scoping on `runs/log-batch` and `runs/log-metric`: ambiguous `system/` keys are
//! renamed by the contract in `mlscope-scopes`, and node-wide samples are kept from one
//! reporting rank per (run, node). Everything else in the body passes through byte for byte.

pub mod body;
pub mod stats;

use std::sync::Arc;
use std::time::SystemTime;

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use http::{header, HeaderMap, HeaderValue, StatusCode};
use http_body_util::{BodyExt, Limited};
use mlscope_scopes::{scoped_key, Identity, KeyOutcome, OwnerPattern};

use crate::dedup::{Decision, DedupConfig, Deduplicator, Event};
use crate::error::mlflow_error;
use crate::telemetry::Metrics;
use body::{BodyError, Edit, Endpoint, MetricsBody};
pub use stats::RunStats;

/// Headers through which the collector (or a platform SDK) says who is sending.
pub const NODE_HEADER: &str = "x-mlscope-node";
pub const RANK_HEADER: &str = "x-mlscope-rank";

/// MLflow's own limits on one log-batch; larger batches go through untouched so MLflow answers.
const MAX_METRICS: usize = 1000;
const MAX_ITEMS: usize = 1000;

#[derive(Debug, Clone)]
pub struct ScopeConfig {
    /// Rename ambiguous `system/` keys.
    pub rewrite: bool,
    pub owner_pattern: OwnerPattern,
    /// Until then, also keep writing each renamed sample under its original key.
    pub keep_original_until: Option<SystemTime>,
    /// Keep node-wide samples from one rank per (run, node).
    pub dedup: bool,
    pub dedup_config: DedupConfig,
    /// Largest body read for inspection; larger ones get 413.
    pub max_inspect_bytes: usize,
}

impl Default for ScopeConfig {
    fn default() -> Self {
        Self {
            rewrite: true,
            owner_pattern: OwnerPattern::default(),
            keep_original_until: None,
            dedup: true,
            dedup_config: DedupConfig::default(),
            max_inspect_bytes: 16 * 1024 * 1024,
        }
    }
}

pub struct MetricsRewriter {
    config: ScopeConfig,
    dedup: Option<Deduplicator>,
    metrics: Metrics,
    pub stats: RunStats,
}

/// Per-node summary of one batch's node-wide samples.
struct NodeBatch {
    node: String,
    rank: u32,
    first_step: i64,
    last_step: i64,
    decision: Option<Decision>,
}

impl MetricsRewriter {
    pub fn new(config: ScopeConfig, dedup: Option<Deduplicator>, metrics: Metrics) -> Self {
        Self { config, dedup, metrics, stats: RunStats::default() }
    }

    pub fn deduplicator(&self) -> Option<&Deduplicator> {
        self.dedup.as_ref()
    }

    pub fn config(&self) -> &ScopeConfig {
        &self.config
    }

    /// Inspects a metrics request. `Ok` is the request to forward (rewritten or as it came);
    /// `Err` is an answer the proxy gives itself.
    pub async fn prepare(&self, request: Request, endpoint: Endpoint) -> Result<Request, Response> {
        if !is_json(request.headers()) {
            self.metrics.passed_through("content_type");
            return Ok(request);
        }
        let limit = self.config.max_inspect_bytes;
        let declared = request.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|len| len > limit as u64) {
            return Err(self.too_large());
        }
        let (parts, body) = request.into_parts();
        let bytes = match Limited::new(body, limit).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(e) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => return Err(self.too_large()),
            Err(e) => {
                return Err(mlflow_error(StatusCode::BAD_REQUEST, "BAD_REQUEST", &format!("the request body could not be read: {e}")));
            }
        };
        let parsed = match MetricsBody::parse(&bytes, endpoint) {
            Ok(parsed) => parsed,
            Err(BodyError::Conflict(message)) => {
                self.metrics.rejected("conflict");
                return Err(mlflow_error(StatusCode::BAD_REQUEST, "INVALID_PARAMETER_VALUE", &message));
            }
            Err(BodyError::Unreadable(reason)) => {
                tracing::debug!(reason, "metrics body passed through unread");
                self.metrics.passed_through("unreadable");
                return Ok(Request::from_parts(parts, Body::from(bytes)));
            }
        };
        if parsed.metrics.len() > MAX_METRICS || parsed.metrics.len() + parsed.other_items > MAX_ITEMS {
            self.metrics.passed_through("over_mlflow_limits");
            return Ok(Request::from_parts(parts, Body::from(bytes)));
        }

        let identity = identity_from_headers(&parts.headers);
        let edits = self.plan(&parsed, &identity).await?;
        if edits.iter().all(|e| *e == Edit::Keep) {
            return Ok(Request::from_parts(parts, Body::from(bytes)));
        }
        let (target, rendered) = parsed.render(&edits);
        let mut parts = parts;
        if target != endpoint {
            let path = parts.uri.path().replace("runs/log-metric", "runs/log-batch");
            let pq = match parts.uri.query() {
                Some(q) => format!("{path}?{q}"),
                None => path,
            };
            parts.uri = pq.parse().map_err(|_| mlflow_error(StatusCode::BAD_REQUEST, "BAD_REQUEST", "invalid request path"))?;
        }
        parts.headers.insert(header::CONTENT_LENGTH, HeaderValue::from(rendered.len()));
        Ok(Request::from_parts(parts, Body::from(rendered)))
    }

    fn too_large(&self) -> Response {
        self.metrics.rejected("too_large");
        mlflow_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "REQUEST_LIMIT_EXCEEDED",
            &format!(
                "the metrics request body is larger than {} bytes, the most mlscope-proxy inspects; send smaller batches (MLflow accepts at most 1000 metrics per log-batch)",
                self.config.max_inspect_bytes
            ),
        )
    }

    /// One edit per metric: the contract's key, and for node-wide samples the dedup decision.
    async fn plan(&self, body: &MetricsBody<'_>, request_identity: &Identity) -> Result<Vec<Edit>, Response> {
        let keep_original = self.config.keep_original_until.is_some_and(|until| SystemTime::now() < until);
        let run_id = body.run_id.as_deref();
        let mut edits = Vec::with_capacity(body.metrics.len());
        let mut node_batches: Vec<NodeBatch> = Vec::new();
        let mut per_metric_node: Vec<Option<usize>> = Vec::with_capacity(body.metrics.len());

        for metric in &body.metrics {
            let scoped = scoped_key(&metric.key, request_identity, &self.config.owner_pattern);
            if let Some(run_id) = run_id {
                self.stats.seen(run_id, &scoped.identity, 1);
            }
            let new_key = match &scoped.outcome {
                KeyOutcome::Untouched => None,
                KeyOutcome::Unchanged { family, .. } => {
                    self.metrics.key(family, "unchanged");
                    None
                }
                KeyOutcome::Rewritten { key, family, .. } => {
                    if self.config.rewrite {
                        self.metrics.key(family, "rewritten");
                        Some(key.clone())
                    } else {
                        None
                    }
                }
                KeyOutcome::Invalid { rejected, family, .. } => {
                    self.metrics.key(family, "invalid");
                    tracing::warn!(key = %metric.key, rejected, "scoped key would break MLflow's key rules; kept the original");
                    None
                }
            };
            // Node-wide samples with a known node and rank take part in deduplication.
            let node_slot = match (&scoped.outcome.scope(), &scoped.identity, run_id, metric.step) {
                (Some(scope), Identity { node: Some(node), rank: Some(rank) }, Some(_), Some(step))
                    if scope.is_node_wide() && self.dedup.is_some() && !matches!(scoped.outcome, KeyOutcome::Invalid { .. }) =>
                {
                    let slot = match node_batches.iter().position(|b| &b.node == node && b.rank == *rank) {
                        Some(i) => i,
                        None => {
                            node_batches.push(NodeBatch { node: node.clone(), rank: *rank, first_step: step, last_step: step, decision: None });
                            node_batches.len() - 1
                        }
                    };
                    let batch = &mut node_batches[slot];
                    batch.first_step = batch.first_step.min(step);
                    batch.last_step = batch.last_step.max(step);
                    Some(slot)
                }
                _ => None,
            };
            per_metric_node.push(node_slot);
            edits.push(match new_key {
                Some(key) => Edit::Change { key: Some(key), step: None, also_original: keep_original },
                None => Edit::Keep,
            });
        }

        if let (Some(dedup), Some(run_id)) = (&self.dedup, run_id) {
            for batch in &mut node_batches {
                let (decision, event) = dedup
                    .decide(run_id, &batch.node, i64::from(batch.rank), batch.first_step, batch.last_step)
                    .await
                    .map_err(|e| {
                        tracing::error!(error = %e, "lease store unavailable");
                        mlflow_error(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "TEMPORARILY_UNAVAILABLE",
                            "mlscope-proxy could not reach its state store to deduplicate node metrics; retry shortly",
                        )
                    })?;
                match event {
                    Event::Elected => self.metrics.election("elected"),
                    Event::Failover => self.metrics.election("failover"),
                    Event::None => {}
                }
                batch.decision = Some(decision);
            }
        }

        for ((edit, slot), metric) in edits.iter_mut().zip(&per_metric_node).zip(&body.metrics) {
            let Some(batch) = slot.map(|i| &node_batches[i]) else { continue };
            let identity = Identity { node: Some(batch.node.clone()), rank: Some(batch.rank) };
            match batch.decision {
                Some(Decision::Standby { .. }) => {
                    self.metrics.node_sample("dropped");
                    self.stats.node_sample(run_id.unwrap_or_default(), &identity, false);
                    *edit = Edit::Drop;
                }
                Some(Decision::Report { step_offset }) => {
                    self.metrics.node_sample("kept");
                    self.stats.node_sample(run_id.unwrap_or_default(), &identity, true);
                    if step_offset != 0 {
                        let step = metric.step.map(|s| s + step_offset);
                        *edit = match std::mem::replace(edit, Edit::Keep) {
                            // The original key (migration copy) keeps the rank's own steps.
                            Edit::Change { key, also_original, .. } => Edit::Change { key, step, also_original },
                            _ => Edit::Change { key: None, step, also_original: false },
                        };
                    }
                }
                None => {}
            }
        }
        Ok(edits)
    }
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|mime| mime.trim().eq_ignore_ascii_case("application/json"))
}

/// The identity request headers declare; parts that are absent or malformed stay unknown.
pub fn identity_from_headers(headers: &HeaderMap) -> Identity {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim).filter(|v| !v.is_empty());
    Identity {
        node: text(NODE_HEADER).filter(|n| n.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')).map(str::to_owned),
        rank: text(RANK_HEADER).and_then(|r| r.parse().ok()),
    }
}

/// Shared handle used by the proxy pipeline.
pub type SharedRewriter = Arc<MetricsRewriter>;
