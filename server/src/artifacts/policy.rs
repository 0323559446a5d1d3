//! The write policy's lookups: does the run, logged model or trace a path names exist in MLflow,
//! in the experiment the path names? Answers are cached; lookups go through the upstream with the
//! client's credentials, so MLflow's own authorization applies.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::{HeaderMap, Method, StatusCode};

use super::path::Owner;
use crate::proxy::Forwarder;

/// How long a "does not exist" answer is kept: short, so a run created a moment later is seen.
const MISSING_TTL: Duration = Duration::from_secs(5);
/// Entries kept at most; the oldest half is dropped when full.
const MAX_ENTRIES: usize = 100_000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The owner exists and belongs to the experiment in the path.
    Owned,
    /// The path is not under any MLflow-owned root.
    Stray,
    /// The path names an owner that MLflow does not know (or in another experiment).
    Missing(String),
    /// MLflow could not be asked.
    Unverifiable(String),
}

#[derive(Clone)]
pub struct OwnerCheck {
    forwarder: Forwarder,
    ttl: Duration,
    /// Keyed by the client's credential fingerprint as well: what MLflow showed one client is
    /// never an answer for another.
    cache: Arc<Mutex<HashMap<([u8; 32], Owner), (Verdict, Instant)>>>,
}

impl OwnerCheck {
    pub fn new(forwarder: Forwarder, ttl: Duration) -> Self {
        Self {
            forwarder,
            ttl,
            cache: Arc::default(),
        }
    }

    pub async fn check(&self, owner: &Owner, headers: &HeaderMap) -> Verdict {
        let key = (crate::credential::fingerprint(headers), owner.clone());
        if let Some((verdict, at)) = self.cache.lock().expect("owner cache").get(&key) {
            let ttl = if *verdict == Verdict::Owned {
                self.ttl
            } else {
                MISSING_TTL
            };
            if at.elapsed() < ttl {
                return verdict.clone();
            }
        }
        let verdict = self.lookup(owner, headers).await;
        if matches!(verdict, Verdict::Owned | Verdict::Missing(_)) {
            let mut cache = self.cache.lock().expect("owner cache");
            if cache.len() >= MAX_ENTRIES {
                let mut ages: Vec<(([u8; 32], Owner), Instant)> =
                    cache.iter().map(|(k, (_, at))| (k.clone(), *at)).collect();
                ages.sort_by_key(|(_, at)| *at);
                for (k, _) in ages.into_iter().take(MAX_ENTRIES / 2) {
                    cache.remove(&k);
                }
            }
            cache.insert(key, (verdict.clone(), Instant::now()));
        }
        verdict
    }

    async fn lookup(&self, owner: &Owner, headers: &HeaderMap) -> Verdict {
        let (path, pointer, what) = match owner {
            Owner::Run { run, .. } => (
                format!("/api/2.0/mlflow/runs/get?run_id={}", encode(run)),
                "/run/info/experiment_id",
                "run",
            ),
            Owner::Model { model, .. } => (
                format!("/api/2.0/mlflow/logged-models/{}", encode(model)),
                "/model/info/experiment_id",
                "logged model",
            ),
            Owner::Trace { trace, .. } => (
                format!("/api/3.0/mlflow/traces/{}", encode(trace)),
                "/trace/trace_info/trace_location/mlflow_experiment/experiment_id",
                "trace",
            ),
        };
        let (status, body) = match self.forwarder.call(Method::GET, &path, headers, None).await {
            Ok(answer) => answer,
            Err(e) => return Verdict::Unverifiable(e.to_string()),
        };
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        match status {
            StatusCode::OK => match json.pointer(pointer).and_then(|v| v.as_str()) {
                Some(experiment) if experiment == owner.experiment() => Verdict::Owned,
                Some(experiment) => {
                    Verdict::Missing(format!("that {what} belongs to experiment {experiment}"))
                }
                None => Verdict::Unverifiable(format!(
                    "MLflow's answer for the {what} has no experiment id"
                )),
            },
            StatusCode::NOT_FOUND | StatusCode::BAD_REQUEST => {
                Verdict::Missing(format!("MLflow has no such {what}"))
            }
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => Verdict::Missing(format!(
                "MLflow refused to show that {what} to this client (HTTP {status})"
            )),
            other => {
                Verdict::Unverifiable(format!("MLflow answered HTTP {other} to the {what} lookup"))
            }
        }
    }
}

fn encode(segment: &str) -> String {
    percent_encoding::utf8_percent_encode(segment, percent_encoding::NON_ALPHANUMERIC).to_string()
}
