//! What this replica has seen per run, for the admin view that answers "why is rank 3's memory
//! chart empty?", and the per-run caps on the (node, rank) identities a run may have. Kept in
//! memory, bounded; the leases themselves are in the store.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::SystemTime;

use mlscope_scopes::Identity;
use serde::Serialize;

use crate::plumbing::store::unix_millis;

/// Runs remembered before the least recently seen ones are forgotten.
const MAX_RUNS: usize = 10_000;
/// (node, rank) identities one run may have (ranks): far above any job a tracking server
/// carries. A request that would add more is refused, so no client can make the proxy keep
/// state (leases, heartbeats, stats) for an unbounded number of identities of one run.
pub const MAX_IDENTITIES_PER_RUN: usize = 4_096;
/// Nodes one run may have.
pub const MAX_NODES_PER_RUN: usize = 1_024;
/// Identities remembered over all runs: beyond, the least recently seen runs are forgotten
/// (their caps start again from zero on this replica).
const MAX_IDENTITIES_TOTAL: usize = 200_000;

/// Why a run cannot take a request's identities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CapExceeded {
    Ranks { had: usize, new: usize },
    Nodes { had: usize, new: usize },
}

impl std::fmt::Display for CapExceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CapExceeded::Ranks { had, new } => write!(
                f,
                "the run has system metrics of {had} (node, rank) identities and this request would add {new}; mlscope-proxy takes at most {MAX_IDENTITIES_PER_RUN} per run"
            ),
            CapExceeded::Nodes { had, new } => write!(
                f,
                "the run has system metrics of {had} nodes and this request would add {new}; mlscope-proxy takes at most {MAX_NODES_PER_RUN} per run"
            ),
        }
    }
}

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

impl RunEntry {
    fn nodes(&self) -> BTreeSet<&str> {
        self.identities
            .keys()
            .filter_map(|(node, _)| node.as_deref())
            .collect()
    }
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
    /// Whether `run_id` may have `identities` (those of one request) on top of the ones it has:
    /// within [`MAX_IDENTITIES_PER_RUN`] and [`MAX_NODES_PER_RUN`].
    pub fn admit<'a>(
        &self,
        run_id: &str,
        identities: impl IntoIterator<Item = &'a Identity>,
    ) -> Result<(), CapExceeded> {
        let runs = self.runs.lock().expect("run stats lock");
        let empty = RunEntry::default();
        let run = runs.get(run_id).unwrap_or(&empty);
        let new_identities: BTreeSet<(Option<String>, Option<u32>)> = identities
            .into_iter()
            .map(|identity| (identity.node.clone(), identity.rank))
            .filter(|key| !run.identities.contains_key(key))
            .collect();
        // A steady fleet sends identities its run has: nothing more to count.
        if new_identities.is_empty() {
            return Ok(());
        }
        let known_nodes = run.nodes();
        let new_nodes: BTreeSet<&str> = new_identities
            .iter()
            .filter_map(|(node, _)| node.as_deref())
            .filter(|node| !known_nodes.contains(node))
            .collect();
        let had = run.identities.len();
        if had + new_identities.len() > MAX_IDENTITIES_PER_RUN {
            return Err(CapExceeded::Ranks {
                had,
                new: new_identities.len(),
            });
        }
        if known_nodes.len() + new_nodes.len() > MAX_NODES_PER_RUN {
            return Err(CapExceeded::Nodes {
                had: known_nodes.len(),
                new: new_nodes.len(),
            });
        }
        Ok(())
    }

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
        let key = (identity.node.clone(), identity.rank);
        let new = runs
            .get(run_id)
            .is_none_or(|run| !run.identities.contains_key(&key));
        // Counted only when an identity is added, which a steady fleet no longer does.
        if new && runs.values().map(|r| r.identities.len()).sum::<usize>() >= MAX_IDENTITIES_TOTAL {
            if let Some(oldest) = runs
                .iter()
                .filter(|(k, _)| k.as_str() != run_id)
                .min_by_key(|(_, e)| e.last_seen_ms)
                .map(|(k, _)| k.clone())
            {
                runs.remove(&oldest);
            }
        }
        let run = runs.entry(run_id.to_owned()).or_default();
        run.last_seen_ms = now;
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

    #[test]
    fn a_run_takes_identities_up_to_its_caps() {
        let stats = RunStats::default();
        let identity = |node: &str, rank: u32| Identity {
            node: Some(node.into()),
            rank: Some(rank),
        };
        // 4 ranks per node up to the rank cap.
        for i in 0..MAX_IDENTITIES_PER_RUN as u32 {
            let id = identity(&format!("n{}", i / 4), i);
            stats.admit("run", [&id]).unwrap();
            stats.seen("run", &id, 1);
        }
        // Known identities always pass; one more is refused.
        stats.admit("run", [&identity("n0", 0)]).unwrap();
        assert_eq!(
            stats.admit("run", [&identity("n0", 99_999)]),
            Err(CapExceeded::Ranks {
                had: MAX_IDENTITIES_PER_RUN,
                new: 1
            })
        );
        // Nodes: one rank each up to the node cap, then a new node is refused.
        for i in 0..MAX_NODES_PER_RUN as u32 {
            let id = identity(&format!("node-{i}"), 0);
            stats.admit("other", [&id]).unwrap();
            stats.seen("other", &id, 1);
        }
        assert!(matches!(
            stats.admit("other", [&identity("node-new", 0)]),
            Err(CapExceeded::Nodes { .. })
        ));
        // Another run is not affected.
        stats.admit("third", [&identity("node-new", 0)]).unwrap();
    }
}
