//! System-metric scoping on `runs/log-batch` and `runs/log-metric`: ambiguous `system/` keys are
//! renamed by the contract in `mlscope-scopes`, and node-wide samples are kept from one
//! reporting rank per (run, node). Everything else in the body passes through byte for byte.

pub mod body;
pub mod intake;
mod nodes;
pub mod stats;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::body::Body;

use axum::extract::Request;
use http::{header, HeaderValue};
use mlscope_scopes::{scoped_key, Identity, KeyOutcome, OwnerPattern, ScopedKey, SYSTEM_PREFIX};

use crate::capabilities::authz::{self, Authorizer};
use crate::capabilities::dedup::{self, Decision, DedupConfig, DedupOptions, Deduplicator};
use crate::capabilities::health::Beat;
use crate::plumbing::error::Error;
use crate::plumbing::proxy::X_REQUEST_ID;
use crate::plumbing::telemetry::Metrics;
use crate::plumbing::writes::Prepared;
use body::{BodyError, Edit, Endpoint, MetricsBody, Scanned};
use intake::{Charge, Intake, IntakeError};

use crate::plumbing::identity::identity_from_headers;
use crate::plumbing::proxy::is_json;
use stats::RunStats;

// MLflow's own limits on one log-batch; larger batches go through untouched so MLflow answers.
use crate::plumbing::writes::{MAX_BATCH_ITEMS as MAX_ITEMS, MAX_BATCH_METRICS as MAX_METRICS};

/// The metric routes' settings: whether and how `system/` keys are scoped (the owner pattern, the
/// migration period that keeps original keys), node deduplication, and the limits on bodies under
/// inspection.
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
    /// Bytes all bodies being inspected at once may hold together, charged as they arrive; a
    /// request that would pass it gets 503 and is retried by the client. Its last quarter is kept
    /// for clients that hold less than a quarter of it.
    pub max_inspect_total: usize,
    /// How long a body under inspection may take to arrive whole.
    pub inspect_deadline: Duration,
}

impl Default for ScopeConfig {
    fn default() -> Self {
        Self {
            rewrite: true,
            owner_pattern: OwnerPattern::default(),
            keep_original_until: None,
            dedup: dedup::ENABLED_BY_DEFAULT,
            dedup_config: DedupConfig::default(),
            max_inspect_bytes: 16 * 1024 * 1024,
            max_inspect_total: 256 * 1024 * 1024,
            inspect_deadline: Duration::from_secs(60),
        }
    }
}

impl ScopeConfig {
    pub fn validate(&self) -> Result<(), String> {
        self.dedup_config.validate()?;
        if self.max_inspect_bytes < 1024 {
            return Err("max-inspect-body must be at least 1KiB".into());
        }
        if self.max_inspect_total < self.max_inspect_bytes {
            return Err(format!(
                "max-inspect-total ({} bytes) must be at least max-inspect-body ({} bytes)",
                self.max_inspect_total, self.max_inspect_bytes
            ));
        }
        if self.inspect_deadline < Duration::from_secs(1) {
            return Err(format!(
                "inspect-body-deadline must be at least 1s (a whole metrics body must arrive within it), not {:?}",
                self.inspect_deadline
            ));
        }
        Ok(())
    }
}

/// The metric routes' settings as given (see [`crate::plumbing::settings`]); `None`: not given here.
/// Node deduplication's part of [`ScopeConfig`] is set by [`crate::capabilities::dedup::DedupOptions`].
#[derive(Debug, Clone, Default, clap::Args, serde::Deserialize)]
pub struct ScopeOptions {
    /// Rename ambiguous `system/` metric keys to scoped names [default: true].
    #[arg(long, env = "MLSCOPE_REWRITE_SYSTEM_METRICS", value_name = "BOOL", action = clap::ArgAction::Set)]
    pub rewrite_system_metrics: Option<bool>,
    /// Regular expression for the owner segment(s) of `system/<owner>/<name>` keys, with named
    /// groups `node` and/or `rank` (default: `rank-<r>`, `rank_<r>`, `rank<r>`, `<node>/rank-<r>`).
    #[arg(long, env = "MLSCOPE_OWNER_PATTERN", value_name = "REGEX")]
    pub owner_pattern: Option<String>,
    /// Migration period: until this time (RFC 3339, e.g. 2027-03-01T00:00:00Z) each renamed
    /// sample is also written under its original key so existing dashboards keep working.
    #[arg(long, env = "MLSCOPE_KEEP_ORIGINAL_KEYS_UNTIL", value_name = "TIME", value_parser = crate::plumbing::settings::parse_time)]
    #[serde(default, with = "humantime_serde")]
    pub keep_original_keys_until: Option<SystemTime>,
    /// Largest metrics body inspected; larger ones get 413 (e.g. 16MiB, 512KiB) [default: 16MiB].
    #[arg(long, env = "MLSCOPE_MAX_INSPECT_BODY", value_parser = crate::plumbing::settings::parse_size, value_name = "SIZE")]
    #[serde(default, deserialize_with = "crate::plumbing::settings::size")]
    pub max_inspect_body: Option<usize>,
    /// Memory all metrics bodies under inspection may hold together; beyond it requests get 503
    /// and are retried (e.g. 256MiB) [default: 256MiB].
    #[arg(long, env = "MLSCOPE_MAX_INSPECT_TOTAL", value_parser = crate::plumbing::settings::parse_size, value_name = "SIZE")]
    #[serde(default, deserialize_with = "crate::plumbing::settings::size")]
    pub max_inspect_total: Option<usize>,
    /// How long a metrics body may take to arrive whole; a slower one gets 408 and frees what it
    /// held of --max-inspect-total (which bodies are charged as bytes arrive; its last quarter is
    /// kept for clients holding less than a quarter) [default: 60s].
    #[arg(long, env = "MLSCOPE_INSPECT_BODY_DEADLINE", value_parser = crate::plumbing::settings::parse_duration, value_name = "DURATION")]
    #[serde(default, with = "humantime_serde")]
    pub inspect_body_deadline: Option<Duration>,
}

impl ScopeOptions {
    /// The given values over the defaults, with deduplication's; an owner pattern that is not a
    /// valid regular expression with the right groups is refused.
    pub fn resolve(self, dedup: DedupOptions) -> Result<ScopeConfig, String> {
        let d = ScopeConfig::default();
        let owner_pattern = match self.owner_pattern {
            Some(pattern) => OwnerPattern::new(&pattern).map_err(|e| e.to_string())?,
            None => d.owner_pattern,
        };
        let (dedup, dedup_config) = dedup.resolve();
        Ok(ScopeConfig {
            rewrite: self.rewrite_system_metrics.unwrap_or(d.rewrite),
            owner_pattern,
            keep_original_until: self.keep_original_keys_until.or(d.keep_original_until),
            dedup,
            dedup_config,
            max_inspect_bytes: self.max_inspect_body.unwrap_or(d.max_inspect_bytes),
            max_inspect_total: self.max_inspect_total.unwrap_or(d.max_inspect_total),
            inspect_deadline: self.inspect_body_deadline.unwrap_or(d.inspect_deadline),
        })
    }
}

/// The metric routes' rewriter: reads a `log-batch` or `log-metric` body once (within the
/// inspection budget), applies the scope contract to its `system/` keys, keeps node-wide samples
/// from one reporter per (run, node), caps the identities a request and a run may carry, and hands
/// the coalescer what it found (with the rank's beat for run health).
pub struct MetricsRewriter {
    config: ScopeConfig,
    /// The memory budget of bodies under inspection.
    intake: Arc<Intake>,
    /// Gateways whose `X-Forwarded-For` names the client.
    trusted_proxies: crate::plumbing::client::TrustedProxies,
    dedup: Option<Deduplicator>,
    /// Asks MLflow whether a client may log to a run before its samples change a lease; `None`
    /// trusts every client (tests, and MLflow without authentication).
    authz: Option<Authorizer>,
    metrics: Metrics,
    pub stats: RunStats,
    /// Attach a [`Beat`] to every metrics request that names ranks (run health is on).
    beats: bool,
}

/// The contract applied to one distinct key of a batch.
struct KeyPlan {
    scoped: ScopedKey,
    /// The renamed key, when the contract renames it.
    new_key: Option<String>,
    /// `(node, rank)` when these samples take part in deduplication.
    dedup_identity: Option<(String, u32)>,
    samples: u64,
}

impl KeyPlan {
    fn new(scoped: ScopedKey, dedup: bool) -> Self {
        let new_key = match &scoped.outcome {
            KeyOutcome::Rewritten { key, .. } => Some(key.clone()),
            _ => None,
        };
        let node_wide = scoped.outcome.scope().is_some_and(|s| s.is_node_wide())
            && !matches!(scoped.outcome, KeyOutcome::Invalid { .. });
        let dedup_identity = match (&scoped.identity.node, scoped.identity.rank) {
            (Some(node), Some(rank)) if dedup && node_wide => Some((node.clone(), rank)),
            _ => None,
        };
        Self {
            scoped,
            new_key,
            dedup_identity,
            samples: 0,
        }
    }
}

impl MetricsRewriter {
    pub fn new(config: ScopeConfig, dedup: Option<Deduplicator>, metrics: Metrics) -> Self {
        let intake = Arc::new(Intake::new(
            config.max_inspect_total,
            config.max_inspect_bytes,
        ));
        Self {
            config,
            intake,
            trusted_proxies: Default::default(),
            dedup,
            authz: None,
            metrics,
            stats: RunStats::default(),
            beats: false,
        }
    }

    /// Counts a request from one of these gateways against the client its `X-Forwarded-For`
    /// names.
    pub fn with_trusted_proxies(
        mut self,
        trusted: crate::plumbing::client::TrustedProxies,
    ) -> Self {
        self.trusted_proxies = trusted;
        self
    }

    /// Hands on with each request what it says about its run's ranks (the [`Inspected::beat`]),
    /// for run health to record once MLflow accepted it.
    pub fn with_beats(mut self) -> Self {
        self.beats = true;
        self
    }

    /// Lets node-wide samples change deduplication state only for clients MLflow allows to log
    /// to the run (asked only while MLflow authenticates, see [`crate::capabilities::authz`]).
    pub fn with_authorizer(mut self, authz: Authorizer) -> Self {
        self.authz = Some(authz);
        self
    }

    pub fn deduplicator(&self) -> Option<&Deduplicator> {
        self.dedup.as_ref()
    }

    pub fn config(&self) -> &ScopeConfig {
        &self.config
    }

    /// Inspects a metrics request. `Ok` is the request to forward (rewritten or as it came);
    /// `Err` is the proxy's own refusal, the client's answer.
    pub async fn prepare(&self, request: Request, endpoint: Endpoint) -> Result<Request, Error> {
        self.inspect(request, endpoint)
            .await
            .map(|inspected| inspected.outgoing.into_request())
    }

    /// As [`MetricsRewriter::prepare`], with what the rewriter found in the request, handed on
    /// with it so that nothing downstream reads the body again.
    pub async fn inspect(&self, request: Request, endpoint: Endpoint) -> Result<Inspected, Error> {
        match self.read(request).await? {
            Read::Unread(request) => Ok(Inspected::unread(request)),
            Read::Whole(read) => self.inspect_read(read, endpoint, None).await,
        }
    }

    /// A metrics request's body, read whole under the intake's budget and as MLflow reads it
    /// (see [`crate::plumbing::writes::normalized`]); a body that is not JSON stays unread.
    pub async fn read(&self, request: Request) -> Result<Read, Error> {
        if !is_json(request.headers()) {
            self.metrics.passed_through("content_type");
            return Ok(Read::Unread(request));
        }
        let limit = self.config.max_inspect_bytes;
        let declared = request
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|len| len > limit as u64) {
            return Err(self.too_large());
        }
        let (parts, body) = request.into_parts();
        let peer = crate::plumbing::client::peer_of(&parts.extensions).ip();
        let client = self.trusted_proxies.client(peer, &parts.headers);
        let (bytes, charge) = match self
            .intake
            .read(body, client, limit, self.config.inspect_deadline)
            .await
        {
            Ok(read) => read,
            Err(error) => return Err(self.intake_refusal(error)),
        };
        // What MLflow reads out of a byte-order mark, UTF-16 or a double-encoded body is read
        // here too, and sent on as plain JSON.
        let (bytes, parts) = crate::plumbing::writes::normalized(bytes, parts);
        Ok(Read::Whole(ReadBody::from_parts(parts, bytes, charge)))
    }

    /// As [`MetricsRewriter::inspect`], for a body [`MetricsRewriter::read`] read; `scanned`
    /// is its one-pass read where the caller made it (a `log-batch`, [`MetricsBody::scan`] of
    /// these bytes).
    pub async fn inspect_read(
        &self,
        read: ReadBody,
        endpoint: Endpoint,
        scanned: Option<Scanned<'_>>,
    ) -> Result<Inspected, Error> {
        let (parts, bytes, _charge) = read.into_parts();
        let parsed = match scanned.map_or_else(
            || MetricsBody::parse(&bytes, endpoint),
            MetricsBody::parse_scanned,
        ) {
            Ok(parsed) => parsed,
            Err(BodyError::Conflict(message)) => {
                self.metrics.rejected("conflict");
                return Err(Error::InvalidParameter(message));
            }
            Err(BodyError::Unreadable(reason)) => {
                tracing::debug!(reason, "metrics body passed through unread");
                self.metrics.passed_through("unreadable");
                return Ok(Inspected::uninspected(parts, bytes, 1));
            }
        };
        let weight = parsed.metrics.len() + parsed.other_items;
        if parsed.metrics.len() > MAX_METRICS || weight > MAX_ITEMS {
            self.metrics.passed_through("over_mlflow_limits");
            return Ok(Inspected::uninspected(parts, bytes, weight));
        }

        let identity = identity_from_headers(&parts.headers);
        let mut plans = Vec::new();
        let (edits, beat) = self.plan(&parsed, &identity, &parts, &mut plans).await?;
        let mut parts = parts;
        let beat = beat.map(|mut beat| {
            // With no ranks it still says that the run is written to (a sign of life).
            observe_rank_tags(&mut beat, &identity, &parsed, &bytes);
            beat.workspace = crate::plumbing::workspace::of_request(&parts.headers)
                .ok()
                .flatten()
                .map(str::to_owned);
            beat
        });
        if edits.iter().all(|e| *e == Edit::Keep) {
            // Sent as it came: the coalescer gets what it needs of the body from this read.
            let writes = parsed
                .writes(parts.uri.path(), &bytes, None, edits.first())
                .map(Prepared);
            return Ok(Inspected {
                outgoing: Outgoing::Read { parts, body: bytes },
                weight,
                beat,
                writes,
            });
        }
        let (target, rendered, spans) = parsed.render_spans(&edits);
        let rendered = bytes::Bytes::from(rendered);
        let prepared = parsed.writes(
            parts.uri.path(),
            &rendered,
            Some((target, &spans)),
            edits.first(),
        );
        if target != endpoint {
            let path = parts
                .uri
                .path()
                .replace("runs/log-metric", "runs/log-batch");
            let pq = match parts.uri.query() {
                Some(q) => format!("{path}?{q}"),
                None => path,
            };
            parts.uri = pq
                .parse()
                .map_err(|_| Error::BadRequest("invalid request path".into()))?;
        }
        parts
            .headers
            .insert(header::CONTENT_LENGTH, HeaderValue::from(rendered.len()));
        Ok(Inspected {
            outgoing: Outgoing::Read {
                parts,
                body: rendered,
            },
            weight,
            beat,
            writes: prepared.map(Prepared),
        })
    }

    /// Whether run health hears what metrics bodies say of their runs.
    pub fn hears_beats(&self) -> bool {
        self.beats
    }

    /// What a batch of the run's own metrics that went to MLflow before the rest of it was read
    /// (see [`body::Scanned::plain`]) says of its run, read once its answer has gone, as
    /// [`MetricsRewriter::inspect`] reads it: how far the run got. `workspace` is the request's.
    pub fn plain_beat(&self, bytes: &[u8], workspace: Option<String>) -> Option<Beat> {
        if !self.beats {
            return None;
        }
        let parsed = MetricsBody::parse(bytes, Endpoint::LogBatch).ok()?;
        let mut beat = own_steps(&parsed)?;
        beat.workspace = workspace;
        Some(beat)
    }

    fn intake_refusal(&self, error: IntakeError) -> Error {
        match error {
            IntakeError::TooLarge => self.too_large(),
            IntakeError::Budget => {
                self.metrics.rejected("memory_budget");
                Error::Overloaded(format!(
                    "mlscope-proxy is holding its limit of {} bytes of metrics bodies under inspection; retry with backoff.",
                    self.config.max_inspect_total
                ))
            }
            IntakeError::ClientShare { held, share } => {
                self.metrics.rejected("client_share");
                Error::OverShare {
                    message: format!(
                        "this client's metrics bodies under inspection hold {held} bytes, more than the {share} one client may hold while the budget is nearly full; send fewer at a time and retry with backoff."
                    ),
                    retry_after: 1,
                }
            }
            IntakeError::TooSlow { deadline, received } => {
                self.metrics.rejected("too_slow");
                Error::TooSlow(format!(
                    "the metrics request body did not arrive whole within {deadline:?} ({received} bytes came); nothing of it was stored. Check the client's connection."
                ))
            }
            IntakeError::Unreadable(reason) => {
                Error::BadRequest(format!("the request body could not be read: {reason}"))
            }
        }
    }

    fn too_large(&self) -> Error {
        self.metrics.rejected("too_large");
        Error::TooLarge(format!(
            "the metrics request body is larger than {} bytes, the most mlscope-proxy inspects; send smaller batches (MLflow accepts at most 1000 metrics per log-batch)",
            self.config.max_inspect_bytes
        ))
    }

    /// One edit per metric: the contract's key, and for node-wide samples the dedup decision.
    /// `plans` receives the contract's result per distinct key; the edits borrow their new keys
    /// from it.
    async fn plan<'k>(
        &self,
        body: &MetricsBody<'_>,
        request_identity: &Identity,
        request: &http::request::Parts,
        plans: &'k mut Vec<KeyPlan>,
    ) -> Result<(Vec<Edit<'k>>, Option<Beat>), Error> {
        // Only keys under `system/` are the contract's (see `scoped_key`): a body without one
        // holds the run's own metrics, sent as they came, with no identity to admit, no key to
        // count and no node series to deduplicate. The write path's common case takes none of
        // that code (which, out of the caches, is most of its time), only the run's step.
        if !body
            .metrics
            .iter()
            .any(|m| m.key.starts_with(SYSTEM_PREFIX))
        {
            let beat = self.beats.then(|| own_steps(body)).flatten();
            return Ok((vec![Edit::Keep; body.metrics.len()], beat));
        }
        let keep_original = self
            .config
            .keep_original_until
            .is_some_and(|until| SystemTime::now() < until);
        // A run id MLflow would refuse gets nothing of the proxy's state: no lease, no counters,
        // no heartbeat (MLflow answers the request with its refusal).
        let run_id = body
            .run_id
            .as_deref()
            .filter(|id| crate::plumbing::writes::is_valid_run_id(id));
        // A batch repeats a handful of keys (one set per monitor publish): apply the contract once
        // per distinct key and count, instead of once per sample.
        let mut plan_of: HashMap<&str, usize> = HashMap::with_capacity(body.metrics.len());
        let mut metric_plans = Vec::with_capacity(body.metrics.len());
        for metric in &body.metrics {
            let index = *plan_of.entry(metric.key.as_ref()).or_insert_with(|| {
                plans.push(KeyPlan::new(
                    scoped_key(&metric.key, request_identity, &self.config.owner_pattern),
                    self.dedup.is_some(),
                ));
                plans.len() - 1
            });
            plans[index].samples += 1;
            metric_plans.push(index);
        }
        let plans: &'k [KeyPlan] = plans;
        self.admit(run_id, plans)?;
        let beat = self
            .beats
            .then(|| beat_of(body, plans, &metric_plans))
            .flatten();
        for plan in plans {
            self.account(run_id, plan);
        }

        let nodes = self
            .decide_nodes(body, plans, &metric_plans, run_id, request)
            .await?;

        let edits = body
            .metrics
            .iter()
            .zip(metric_plans.iter().zip(nodes.slots()))
            .map(|(metric, (&index, slot))| {
                let new_key = plans[index]
                    .new_key
                    .as_deref()
                    .filter(|_| self.config.rewrite);
                let decision = nodes.decision_of(*slot);
                match decision {
                    Some(_) if !nodes::keeps(decision, metric) => Edit::Drop,
                    Some(Decision::Report { step_offset, .. }) if step_offset != 0 => {
                        // A migration copy under the original key keeps the bytes as sent.
                        let also_original = keep_original && new_key.is_some();
                        Edit::Change {
                            key: new_key,
                            step: metric.step.map(|s| s + step_offset),
                            also_original,
                        }
                    }
                    _ => match new_key {
                        key @ Some(_) => Edit::Change {
                            key,
                            step: None,
                            also_original: keep_original,
                        },
                        None => Edit::Keep,
                    },
                }
            })
            .collect();
        Ok((edits, beat))
    }

    /// Whether the client that sent `request` may log to `run_id` in MLflow, so that its
    /// node-wide samples may elect or renew a reporter. When MLflow refuses it (no credential, no
    /// EDIT grant, no such run), its samples change nothing here and the request goes on as it is:
    /// MLflow gives it the same refusal. `Err` when MLflow cannot be asked.
    async fn may_log(&self, run_id: &str, request: &http::request::Parts) -> Result<bool, Error> {
        let Some(authz) = &self.authz else {
            return Ok(true);
        };
        let peer = crate::plumbing::client::peer_of(&request.extensions);
        let request_id = request
            .headers
            .get(&X_REQUEST_ID)
            .cloned()
            .unwrap_or_else(|| HeaderValue::from_static("-"));
        match authz
            .check(
                authz::Action::WriteRun,
                run_id,
                &request.headers,
                peer,
                &request_id,
            )
            .await
        {
            authz::Decision::Allowed(_) => Ok(true),
            authz::Decision::Denied(_) | authz::Decision::MlflowAnswers => Ok(false),
            authz::Decision::Unverifiable(error) => Err(error),
        }
    }

    /// Refuses a request whose system metrics name more (node, rank) identities than one
    /// request, or its run, may have: nothing of it is kept or forwarded, and the client is told
    /// why. What MLflow itself would refuse (no valid run id) goes on to MLflow's refusal.
    fn admit(&self, run_id: Option<&str>, plans: &[KeyPlan]) -> Result<(), Error> {
        let identities: HashSet<&Identity> = plans
            .iter()
            .filter(|p| !matches!(p.scoped.outcome, KeyOutcome::Untouched))
            .map(|p| &p.scoped.identity)
            .collect();
        let refuse = |reason: &'static str, message: String| {
            self.metrics.rejected(reason);
            Err(Error::InvalidParameter(format!(
                "{message}. Nothing of this request was stored."
            )))
        };
        if identities.len() > MAX_IDENTITIES_PER_REQUEST {
            return refuse(
                "identities_per_request",
                format!(
                    "this request carries system metrics of {} (node, rank) identities; mlscope-proxy takes at most {MAX_IDENTITIES_PER_REQUEST} per request (a collector or MLflow's monitor sends one)",
                    identities.len()
                ),
            );
        }
        match run_id.map(|run_id| self.stats.admit(run_id, identities.iter().copied())) {
            Some(Err(cap)) => refuse("identities_per_run", cap.to_string()),
            _ => Ok(()),
        }
    }

    /// Counters and per-run stats for one distinct key of a batch.
    fn account(&self, run_id: Option<&str>, plan: &KeyPlan) {
        let (family, outcome) = match &plan.scoped.outcome {
            KeyOutcome::Untouched => return,
            KeyOutcome::Unchanged { family, .. } => (*family, "unchanged"),
            KeyOutcome::Rewritten { family, .. } => (
                *family,
                if self.config.rewrite {
                    "rewritten"
                } else {
                    "unchanged"
                },
            ),
            KeyOutcome::Invalid {
                family, rejected, ..
            } => {
                // The key is the client's: log a bounded prefix of it, never all of it.
                let shown: String = rejected.chars().take(256).collect();
                tracing::warn!(
                    rejected = shown,
                    length = rejected.len(),
                    "scoped key would break MLflow's key rules; kept the original"
                );
                (*family, "invalid")
            }
        };
        self.metrics.keys(family, outcome, plan.samples);
        if let Some(run_id) = run_id {
            self.stats.seen(run_id, &plan.scoped.identity, plan.samples);
        }
    }
}

/// What a metrics body says about the ranks of its run: who sent system samples (each one a
/// heartbeat), with their GPUs and limits. `metric_plans` is each metric's index in `plans`.
/// `None` without a run id. The work is per distinct key; only the few keys whose values matter
/// (GPU idle time, container limits) are looked at per sample.
fn beat_of(body: &MetricsBody<'_>, plans: &[KeyPlan], metric_plans: &[usize]) -> Option<Beat> {
    let mut beat = beat_of_run(body)?;
    // Per key plan: its first metric, and the span of its samples' timestamps (billing), in one
    // pass; the ranks are looked up once per plan, not once per sample.
    let mut first = vec![usize::MAX; plans.len()];
    let mut spans: Vec<Option<(i64, i64)>> = vec![None; plans.len()];
    for (metric, &index) in metric_plans.iter().enumerate() {
        if first[index] == usize::MAX {
            first[index] = metric;
        }
        let sample = &body.metrics[metric];
        let Some(at) = sample.timestamp_ms() else {
            continue;
        };
        let scoped = &plans[index].scoped;
        if matches!(scoped.outcome, KeyOutcome::Untouched) && scoped.name.is_none() {
            // The run's own metric: its step says how far the run got by `at`.
            if let Some(step) = sample.step {
                beat.observe_step(step, at);
            }
            continue;
        }
        spans[index] = Some(spans[index].map_or((at, at), |(a, b)| (a.min(at), b.max(at))));
    }
    let mut valued = vec![false; plans.len()];
    for (index, plan) in plans.iter().enumerate() {
        if matches!(
            plan.scoped.outcome,
            KeyOutcome::Untouched | KeyOutcome::Invalid { .. }
        ) || first[index] == usize::MAX
        {
            continue;
        }
        let Some(name) = plan.scoped.name.as_deref() else {
            continue;
        };
        let identity = &plan.scoped.identity;
        let (node, rank) = (
            identity.node.as_deref().unwrap_or_default(),
            identity.rank.map_or(-1, i64::from),
        );
        valued[index] = Beat::needs_value(name);
        beat.observe_metric(node, rank, name, f64::NAN, None);
    }
    // The span each rank's system samples cover (billing), from every scoped key's samples.
    for (index, plan) in plans.iter().enumerate() {
        let Some((from, to)) = spans[index] else {
            continue;
        };
        if matches!(
            plan.scoped.outcome,
            KeyOutcome::Untouched | KeyOutcome::Invalid { .. }
        ) {
            continue;
        }
        let identity = &plan.scoped.identity;
        let (node, rank) = (
            identity.node.as_deref().unwrap_or_default(),
            identity.rank.map_or(-1, i64::from),
        );
        beat.observe_time(node, rank, from);
        beat.observe_time(node, rank, to);
    }
    if valued.contains(&true) {
        for (metric, &index) in body.metrics.iter().zip(metric_plans) {
            if !valued[index] {
                continue;
            }
            let plan = &plans[index];
            let Some(name) = plan.scoped.name.as_deref() else {
                continue;
            };
            beat.observe_metric(
                plan.scoped.identity.node.as_deref().unwrap_or_default(),
                plan.scoped.identity.rank.map_or(-1, i64::from),
                name,
                metric.value().unwrap_or(f64::NAN),
                metric.timestamp_ms(),
            );
        }
    }
    Some(beat)
}

/// The beat of a body of the run's own metrics only (no key under `system/`): how far the run
/// got, its highest step at that sample's timestamp. As [`beat_of`] reads such a body.
fn own_steps(body: &MetricsBody<'_>) -> Option<Beat> {
    let mut beat = beat_of_run(body)?;
    for metric in &body.metrics {
        if let (Some(step), Some(at)) = (metric.step, metric.timestamp_ms()) {
            beat.observe_step(step, at);
        }
    }
    Some(beat)
}

/// A beat of the body's run with nothing heard yet; `None` without a run id MLflow would take.
fn beat_of_run(body: &MetricsBody<'_>) -> Option<Beat> {
    Some(Beat {
        run_id: body
            .run_id
            .clone()
            .filter(|id| crate::plumbing::writes::is_valid_run_id(id))?,
        ranks: Vec::new(),
        workspace: None,
        findings: Vec::new(),
        step: None,
    })
}

/// Adds the collector's `mlscope/rank-<r>/...` tags (how a rank ended, where it ran, what it
/// left running) and `mlscope/data/...` tags (declared data that changed) of a body to `beat`;
/// its tags are decoded only when the body holds such a key.
fn observe_rank_tags(beat: &mut Beat, request: &Identity, body: &MetricsBody<'_>, bytes: &[u8]) {
    // One pass over the body for both prefixes.
    if memchr::memmem::find(bytes, b"mlscope/").is_none() {
        return;
    }
    for tag in body.tags().iter().take(MAX_ITEMS) {
        beat.observe_tag(request.node.as_deref(), request.rank, &tag.key, &tag.value);
    }
}

/// The (node, rank) identities one metrics request may carry system metrics of.
pub const MAX_IDENTITIES_PER_REQUEST: usize = 16;

/// Shared handle used by the proxy pipeline.
pub type SharedRewriter = Arc<MetricsRewriter>;

/// What goes on to MLflow: the request with its body unread (not JSON, so not the rewriter's to
/// read), or its head and the body as read (as it came, normalized, or rewritten).
pub enum Outgoing {
    Unread(Request),
    Read {
        parts: http::request::Parts,
        body: bytes::Bytes,
    },
}

impl Outgoing {
    pub fn into_request(self) -> Request {
        match self {
            Outgoing::Unread(request) => request,
            Outgoing::Read { parts, body } => Request::from_parts(parts, Body::from(body)),
        }
    }
}

/// A metrics request as the rewriter read it: its body whole, or unread (not JSON).
pub enum Read {
    Unread(Request),
    Whole(ReadBody),
}

/// A metrics request's head and whole body, which holds its share of the intake's budget until
/// it is handed on or dropped.
pub struct ReadBody {
    pub parts: http::request::Parts,
    pub bytes: bytes::Bytes,
    charge: Charge,
}

impl ReadBody {
    pub fn into_parts(self) -> (http::request::Parts, bytes::Bytes, Charge) {
        (self.parts, self.bytes, self.charge)
    }

    pub fn from_parts(parts: http::request::Parts, bytes: bytes::Bytes, charge: Charge) -> Self {
        ReadBody {
            parts,
            bytes,
            charge,
        }
    }
}

/// A metrics request as the rewriter hands it on: what to send and what its one read of the
/// body found.
pub struct Inspected {
    pub outgoing: Outgoing,
    /// The metrics, params and tags it carries (1 when its body was not read).
    pub weight: usize,
    /// What it says about its run's ranks (with run health on), to record once MLflow accepted it.
    pub beat: Option<Beat>,
    /// Its run and writes as sent, for the coalescer; `None` when the body was not parsed.
    pub writes: Option<Prepared>,
}

impl Inspected {
    pub(crate) fn unread(request: Request) -> Inspected {
        Inspected {
            outgoing: Outgoing::Unread(request),
            weight: 1,
            beat: None,
            writes: None,
        }
    }

    /// A body read but not inspected (unreadable as MLflow's JSON, or over MLflow's limits):
    /// it goes on as it came and MLflow answers it.
    fn uninspected(parts: http::request::Parts, body: bytes::Bytes, weight: usize) -> Inspected {
        Inspected {
            outgoing: Outgoing::Read { parts, body },
            weight,
            beat: None,
            writes: None,
        }
    }
}

#[cfg(test)]
mod tests;
