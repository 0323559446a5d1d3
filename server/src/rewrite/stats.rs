//! What this replica has seen per run, for the admin view that answers "why is rank 3's memory
//! chart empty?". Kept in memory, bounded; the leases themselves are in the store.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::SystemTime;

use mlscope_scopes::Identity;
use serde::Serialize;

use crate::store::unix_millis;

/// Runs remembered before the least recently seen ones are forgotten.
const MAX_RUNS: usize = 10_000;
/// (node, rank) identities remembered per run before the least recently seen is forgotten: far
/// above any real job, so only a client inventing identities loses its oldest ones.
const MAX_IDENTITIES_PER_RUN: usize = 4_096;

#[derive(Debug, Default, Clone, Serialize)]
pub struct IdentityStats {
    pub node: Option<String>,
    pub rank: Option<u32>,
    pub last_seen_ms: i64,
    pub samples: u64,
    pub node_samples_kept: u64,
    pub node_samples_dropped: u64,
}

#[derive(Debug, Default)]
struct RunEntry {
    last_seen_ms: i64,
    identities: BTreeMap<(Option<String>, Option<u32>), IdentityStats>,
}

#[derive(Debug, Default)]
pub struct RunStats {
    runs: Mutex<HashMap<String, RunEntry>>,
}

/// The admin view of one run.
#[derive(Debug, Serialize)]
pub struct RunView {
    pub run_id: String,
    pub identities: Vec<IdentityStats>,
    pub reporters: Vec<ReporterView>,
    pub update_interval_ms: u64,
    pub failover_timeout_ms: u64,
}

#[derive(Debug, Serialize)]
pub struct ReporterView {
    pub node: String,
    pub rank: i64,
    pub epoch: i64,
    pub renewed_at_ms: i64,
    pub silent_for_ms: i64,
    pub step_offset: i64,
    pub last_step: i64,
}

impl RunStats {
    fn with_identity(&self, run_id: &str, identity: &Identity, f: impl FnOnce(&mut IdentityStats)) {
        let now = unix_millis(SystemTime::now());
        let mut runs = self.runs.lock().expect("run stats lock");
        if runs.len() >= MAX_RUNS && !runs.contains_key(run_id) {
            if let Some(oldest) = runs
                .iter()
                .min_by_key(|(_, e)| e.last_seen_ms)
                .map(|(k, _)| k.clone())
            {
                runs.remove(&oldest);
            }
        }
        let run = runs.entry(run_id.to_owned()).or_default();
        run.last_seen_ms = now;
        let key = (identity.node.clone(), identity.rank);
        if run.identities.len() >= MAX_IDENTITIES_PER_RUN && !run.identities.contains_key(&key) {
            if let Some(oldest) = run
                .identities
                .iter()
                .min_by_key(|(_, s)| s.last_seen_ms)
                .map(|(k, _)| k.clone())
            {
                run.identities.remove(&oldest);
            }
        }
        let stats = run.identities.entry(key).or_insert_with(|| IdentityStats {
            node: identity.node.clone(),
            rank: identity.rank,
            ..Default::default()
        });
        stats.last_seen_ms = now;
        f(stats);
    }

    pub fn seen(&self, run_id: &str, identity: &Identity, samples: u64) {
        self.with_identity(run_id, identity, |s| s.samples += samples);
    }

    pub fn node_samples(&self, run_id: &str, identity: &Identity, kept: bool, samples: u64) {
        self.with_identity(run_id, identity, |s| {
            if kept {
                s.node_samples_kept += samples
            } else {
                s.node_samples_dropped += samples
            }
        });
    }

    pub fn identities(&self, run_id: &str) -> Vec<IdentityStats> {
        let runs = self.runs.lock().expect("run stats lock");
        runs.get(run_id)
            .map(|r| r.identities.values().cloned().collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_inventing_identities_keeps_a_run_bounded() {
        let stats = RunStats::default();
        for rank in 0..(MAX_IDENTITIES_PER_RUN as u32 + 500) {
            let identity = Identity {
                node: Some("n".into()),
                rank: Some(rank),
            };
            stats.seen("run", &identity, 1);
        }
        assert_eq!(stats.identities("run").len(), MAX_IDENTITIES_PER_RUN);
    }
}
