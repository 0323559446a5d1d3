//! The write policy's lookups: does the run, logged model or trace a path names exist in MLflow,
//! in the experiment the path names? Answers are cached; lookups go through the upstream with the
//! client's credentials, so MLflow's own authorization applies.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::{HeaderMap, StatusCode};

use super::path::Owner;
use crate::plumbing::mlflow::{Caller, MlflowClient, MlflowError};
use crate::plumbing::proxy::Forwarder;

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
    mlflow: MlflowClient,
    ttl: Duration,
    /// Keyed by the client's credential fingerprint as well: what MLflow showed one client is
    /// never an answer for another.
    cache: Arc<Mutex<OwnerCache>>,
}

/// MLflow's verdict on an owner for one client, and when it was asked.
type OwnerCache = HashMap<([u8; 32], Owner), (Verdict, Instant)>;

impl OwnerCheck {
    pub fn new(forwarder: Forwarder, ttl: Duration) -> Self {
        Self {
            mlflow: MlflowClient::new(forwarder),
            ttl,
            cache: Arc::default(),
        }
    }

    pub async fn check(&self, owner: &Owner, headers: &HeaderMap) -> Verdict {
        let key = (
            crate::plumbing::credential::fingerprint(headers),
            owner.clone(),
        );
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
        let caller = Caller::client(headers);
        let (experiment, what) = match owner {
            Owner::Run { run, .. } => (
                self.mlflow
                    .get_run(&caller, run)
                    .await
                    .map(|run| run.info.experiment_id),
                "run",
            ),
            Owner::Model { model, .. } => (
                self.mlflow
                    .get_logged_model(&caller, model)
                    .await
                    .map(|model| model.experiment_id().map(str::to_owned)),
                "logged model",
            ),
            Owner::Trace { trace, .. } => (
                self.mlflow
                    .get_trace(&caller, trace)
                    .await
                    .map(|trace| trace.experiment_id().map(str::to_owned)),
                "trace",
            ),
        };
        match experiment {
            Ok(Some(experiment)) if experiment == owner.experiment() => Verdict::Owned,
            Ok(Some(experiment)) => {
                Verdict::Missing(format!("that {what} belongs to experiment {experiment}"))
            }
            Ok(None) | Err(MlflowError::Unreadable { .. }) => Verdict::Unverifiable(format!(
                "MLflow's answer for the {what} has no experiment id"
            )),
            Err(MlflowError::Unanswered(e)) => Verdict::Unverifiable(e.to_string()),
            Err(e) => match e.status() {
                Some(StatusCode::NOT_FOUND | StatusCode::BAD_REQUEST) => {
                    Verdict::Missing(format!("MLflow has no such {what}"))
                }
                Some(status @ (StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN)) => {
                    Verdict::Missing(format!(
                        "MLflow refused to show that {what} to this client (HTTP {status})"
                    ))
                }
                status => Verdict::Unverifiable(format!(
                    "MLflow answered HTTP {} to the {what} lookup",
                    status.map_or_else(String::new, |s| s.to_string())
                )),
            },
        }
    }
}
