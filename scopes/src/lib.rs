//! The metric scope contract (`docs/metric-scopes.md`): which MLflow `system/` metric measures
//! what, and the scoped name it is stored under.
//!
//! The proxy (rewriting ambiguous keys) and the collector (emitting keys) both use [`RULES`]
//! and [`scoped_key`], so the two can never disagree on a name.

use std::fmt;

use regex::Regex;

/// The prefix MLflow's system-metrics monitor puts in front of every key.
pub const SYSTEM_PREFIX: &str = "system/";

/// The launcher variables that carry a process's global rank, in the order the collector tries
/// them (the proxy's injection webhook copies them to the collector's sidecar).
pub const RANK_VARIABLES: [&str; 7] = [
    "RANK",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "PMIX_RANK",
    "SLURM_PROCID",
    "MV2_COMM_WORLD_RANK",
    "JOB_COMPLETION_INDEX",
];

/// What a value describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scope {
    /// The whole node: `/proc/stat`, `/proc/meminfo` read inside a container.
    Node,
    /// The node partition behind the container's overlay root filesystem.
    Rootfs,
    /// The pod's network namespace.
    Pod,
    /// A GPU injected into the container.
    Device,
    /// The container's cgroup, against its own limits.
    Container,
    /// A volume the collector was told to watch.
    Volume,
    /// A data path the collector was told to watch (`--data NAME=PATH`).
    Data,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Node => "node",
            Scope::Rootfs => "rootfs",
            Scope::Pod => "pod",
            Scope::Device => "device",
            Scope::Container => "container",
            Scope::Volume => "volume",
            Scope::Data => "data",
        }
    }

    /// Node-wide values: one reporting rank per (run, node) is enough.
    pub fn is_node_wide(self) -> bool {
        matches!(self, Scope::Node | Scope::Rootfs)
    }

    /// Whose name goes in the owner segment when it is known.
    fn owner(self, identity: &Identity) -> Option<String> {
        if self.is_node_wide() {
            identity.node.clone()
        } else {
            identity.rank.map(|r| format!("rank-{r}"))
        }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a rule recognises a metric name.
#[derive(Clone, Copy, Debug)]
pub enum NameMatch {
    /// An exact name.
    Exact(&'static str),
    /// `<prefix><digits>_<anything>`, e.g. `gpu_0_utilization_percentage`.
    Indexed(&'static str),
    /// `<prefix><name>_<suffix>`, e.g. `volume_data_usage_megabytes`.
    Named {
        prefix: &'static str,
        suffixes: &'static [&'static str],
    },
}

impl NameMatch {
    fn matches(&self, name: &str) -> bool {
        match *self {
            NameMatch::Exact(exact) => name == exact,
            NameMatch::Indexed(prefix) => name
                .strip_prefix(prefix)
                .and_then(|rest| rest.split_once('_'))
                .is_some_and(|(index, tail)| {
                    !index.is_empty()
                        && index.bytes().all(|b| b.is_ascii_digit())
                        && !tail.is_empty()
                }),
            NameMatch::Named { prefix, suffixes } => {
                name.strip_prefix(prefix).is_some_and(|rest| {
                    suffixes.iter().any(|s| {
                        rest.strip_suffix(s)
                            .is_some_and(|n| n.len() > 1 && n.ends_with('_'))
                    })
                })
            }
        }
    }
}

/// One row of the contract's rewrite table.
#[derive(Clone, Copy, Debug)]
pub struct ScopeRule {
    /// Short name for metrics and logs (`cpu`, `memory`, ...).
    pub family: &'static str,
    /// The name MLflow (or the collector) sends.
    pub matches: NameMatch,
    /// The scoped name; `None` keeps the name (only the owner changes).
    pub scoped: Option<&'static str>,
    pub scope: Scope,
}

/// The metric names a watched volume gets, after `volume_<name>_`.
pub const VOLUME_SUFFIXES: &[&str] =
    &["usage_megabytes", "usage_percentage", "available_megabytes"];

/// The GPU series mlscope knows, after `gpu_<i>_`: MLflow's (its NVIDIA monitor), then the
/// collector's idle clock and, where NVML's GPM measures them, SM activity, SM occupancy, tensor
/// pipe activity and DRAM activity. All are device series of the one `gpu_<i>_*` row, which also
/// keeps any other suffix (MLflow's ROCm monitor writes its own) as a device series.
pub const GPU_SUFFIXES: &[&str] = &[
    "utilization_percentage",
    "memory_usage_megabytes",
    "memory_usage_percentage",
    "power_usage_watts",
    "power_usage_percentage",
    "idle_seconds",
    "sm_active_percentage",
    "sm_occupancy_percentage",
    "tensor_active_percentage",
    "dram_active_percentage",
];

/// The bare metric name of one of a watched volume's series (`volume_<volume>_<suffix>`), or
/// `None` when the table would not recognise it (an empty volume name or an unknown suffix), so
/// the collector cannot invent a name the proxy does not know.
pub fn volume_metric_name(volume: &str, suffix: &str) -> Option<String> {
    let name = format!("volume_{volume}_{suffix}");
    rule_for(&name)
        .filter(|rule| rule.scope == Scope::Volume)
        .map(|_| name)
}

/// The metric names a watched data path gets, after `data_<name>_`.
pub const DATA_SUFFIXES: &[&str] = &["files"];

/// The bare metric name of one of a watched data path's series (`data_<name>_<suffix>`), or
/// `None` when the table would not recognise it, as for [`volume_metric_name`].
pub fn data_metric_name(data: &str, suffix: &str) -> Option<String> {
    let name = format!("data_{data}_{suffix}");
    rule_for(&name)
        .filter(|rule| rule.scope == Scope::Data)
        .map(|_| name)
}

/// The rewrite table. Scoped names are listed as rules of their own so rewriting is idempotent:
/// a key already in scoped form (what the collector sends) maps to itself.
pub const RULES: &[ScopeRule] = &[
    rule(
        "cpu",
        NameMatch::Exact("cpu_utilization_percentage"),
        Some("node_cpu_utilization_percentage"),
        Scope::Node,
    ),
    rule(
        "memory",
        NameMatch::Exact("system_memory_usage_megabytes"),
        Some("node_memory_usage_megabytes"),
        Scope::Node,
    ),
    rule(
        "memory",
        NameMatch::Exact("system_memory_usage_percentage"),
        Some("node_memory_usage_percentage"),
        Scope::Node,
    ),
    rule(
        "disk",
        NameMatch::Exact("disk_usage_megabytes"),
        Some("rootfs_usage_megabytes"),
        Scope::Rootfs,
    ),
    rule(
        "disk",
        NameMatch::Exact("disk_usage_percentage"),
        Some("rootfs_usage_percentage"),
        Scope::Rootfs,
    ),
    rule(
        "disk",
        NameMatch::Exact("disk_available_megabytes"),
        Some("rootfs_available_megabytes"),
        Scope::Rootfs,
    ),
    rule(
        "cpu",
        NameMatch::Exact("node_cpu_utilization_percentage"),
        None,
        Scope::Node,
    ),
    rule(
        "memory",
        NameMatch::Exact("node_memory_usage_megabytes"),
        None,
        Scope::Node,
    ),
    rule(
        "memory",
        NameMatch::Exact("node_memory_usage_percentage"),
        None,
        Scope::Node,
    ),
    rule(
        "disk",
        NameMatch::Exact("rootfs_usage_megabytes"),
        None,
        Scope::Rootfs,
    ),
    rule(
        "disk",
        NameMatch::Exact("rootfs_usage_percentage"),
        None,
        Scope::Rootfs,
    ),
    rule(
        "disk",
        NameMatch::Exact("rootfs_available_megabytes"),
        None,
        Scope::Rootfs,
    ),
    rule(
        "network",
        NameMatch::Exact("network_receive_megabytes"),
        None,
        Scope::Pod,
    ),
    rule(
        "network",
        NameMatch::Exact("network_transmit_megabytes"),
        None,
        Scope::Pod,
    ),
    rule("gpu", NameMatch::Indexed("gpu_"), None, Scope::Device),
    rule(
        "container",
        NameMatch::Exact("container_memory_working_set_megabytes"),
        None,
        Scope::Container,
    ),
    rule(
        "container",
        NameMatch::Exact("container_memory_limit_megabytes"),
        None,
        Scope::Container,
    ),
    rule(
        "container",
        NameMatch::Exact("container_memory_working_set_percentage"),
        None,
        Scope::Container,
    ),
    rule(
        "container",
        NameMatch::Exact("container_memory_peak_megabytes"),
        None,
        Scope::Container,
    ),
    rule(
        "container",
        NameMatch::Exact("container_cpu_utilization_percentage"),
        None,
        Scope::Container,
    ),
    rule(
        "container",
        NameMatch::Exact("container_cpu_limit_cores"),
        None,
        Scope::Container,
    ),
    rule(
        "container",
        NameMatch::Exact("container_cpu_throttled_percentage"),
        None,
        Scope::Container,
    ),
    rule(
        "container",
        NameMatch::Exact("container_oom_kill_count"),
        None,
        Scope::Container,
    ),
    rule(
        "volume",
        NameMatch::Named {
            prefix: "volume_",
            suffixes: VOLUME_SUFFIXES,
        },
        None,
        Scope::Volume,
    ),
    rule(
        "data",
        NameMatch::Named {
            prefix: "data_",
            suffixes: DATA_SUFFIXES,
        },
        None,
        Scope::Data,
    ),
];

const fn rule(
    family: &'static str,
    matches: NameMatch,
    scoped: Option<&'static str>,
    scope: Scope,
) -> ScopeRule {
    ScopeRule {
        family,
        matches,
        scoped,
        scope,
    }
}

/// The rule for a bare metric name (without `system/` and owner), if the contract has one.
pub fn rule_for(name: &str) -> Option<&'static ScopeRule> {
    RULES.iter().find(|r| r.matches.matches(name))
}

/// A node name in the contract's form, `[a-z0-9.-]+` starting with a letter or digit: lower-cased,
/// every other character replaced by `-`, so that `GPU_Node-1` from one client and `gpu-node-1`
/// from another name the same node. An empty result is `unknown-node`.
pub fn normalize_node(raw: &str) -> String {
    let cleaned: String = raw
        .trim()
        .to_ascii_lowercase()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect();
    let cleaned = cleaned.trim_start_matches(['.', '-']);
    if cleaned.is_empty() {
        "unknown-node".to_owned()
    } else {
        cleaned.to_owned()
    }
}

/// Who sent a sample. Either part may be unknown.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Identity {
    pub node: Option<String>,
    pub rank: Option<u32>,
}

impl Identity {
    /// Fills whatever `self` lacks from `other` (headers first, then the key's owner).
    pub fn or(self, other: Identity) -> Identity {
        Identity {
            node: self.node.or(other.node),
            rank: self.rank.or(other.rank),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.node.is_none() && self.rank.is_none()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PatternError {
    #[error("owner pattern {pattern:?} is not a valid regular expression: {message}")]
    Syntax { pattern: String, message: String },
    #[error("owner pattern {0:?} must have a named group `node` or `rank`")]
    NoGroups(String),
}

/// Parses the owner segment(s) of a key into an identity: `(?P<node>..)` and `(?P<rank>\d+)`
/// named groups of a regular expression matched against the whole owner (segments joined by `/`).
#[derive(Clone, Debug)]
pub struct OwnerPattern {
    regex: Regex,
}

impl OwnerPattern {
    /// `rank-<r>`, `rank_<r>`, `rank<r>` (rank only) and `<node>/rank-<r>` (both).
    pub const DEFAULT: &'static str = r"^(?:(?P<node>[A-Za-z0-9][A-Za-z0-9._-]*)/rank-(?P<rank>\d+)|rank[-_]?(?P<rank_only>\d+))$";

    pub fn new(pattern: &str) -> Result<Self, PatternError> {
        let regex = Regex::new(pattern).map_err(|e| PatternError::Syntax {
            pattern: pattern.to_owned(),
            message: e.to_string(),
        })?;
        let has = |name: &str| {
            regex
                .capture_names()
                .flatten()
                .any(|n| n == name || n.starts_with(&format!("{name}_")))
        };
        if !has("node") && !has("rank") {
            return Err(PatternError::NoGroups(pattern.to_owned()));
        }
        Ok(Self { regex })
    }

    /// The identity an owner string names, or an empty one.
    pub fn parse(&self, owner: &str) -> Identity {
        let Some(caps) = self.regex.captures(owner) else {
            return Identity::default();
        };
        // Several alternatives may each name a group; any group whose name starts with
        // `node`/`rank` counts, the first that matched wins.
        let mut identity = Identity::default();
        for name in self.regex.capture_names().flatten() {
            let Some(m) = caps.name(name) else { continue };
            if name == "node" || name.starts_with("node_") {
                identity
                    .node
                    .get_or_insert_with(|| normalize_node(m.as_str()));
            } else if name == "rank" || name.starts_with("rank_") {
                if let Ok(rank) = m.as_str().parse() {
                    identity.rank.get_or_insert(rank);
                }
            }
        }
        identity
    }
}

impl Default for OwnerPattern {
    fn default() -> Self {
        Self::new(Self::DEFAULT).expect("the default owner pattern compiles")
    }
}

/// A `system/` key split into its parts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SystemKey<'a> {
    /// Everything between `system/` and the name; `""` when there is none.
    pub owner: &'a str,
    pub name: &'a str,
}

impl<'a> SystemKey<'a> {
    pub fn parse(key: &'a str) -> Option<Self> {
        let rest = key.strip_prefix(SYSTEM_PREFIX)?;
        Some(match rest.rsplit_once('/') {
            Some((owner, name)) => SystemKey { owner, name },
            None => SystemKey {
                owner: "",
                name: rest,
            },
        })
    }
}

/// What the contract says about one metric key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyOutcome {
    /// Not under `system/`, or a name the table does not know: left alone.
    Untouched,
    /// Already in its scoped form.
    Unchanged { scope: Scope, family: &'static str },
    /// Renamed.
    Rewritten {
        key: String,
        scope: Scope,
        family: &'static str,
    },
    /// The scoped key would break MLflow's key rules; the original is kept.
    Invalid {
        rejected: String,
        scope: Scope,
        family: &'static str,
    },
}

impl KeyOutcome {
    pub fn scope(&self) -> Option<Scope> {
        match self {
            KeyOutcome::Untouched => None,
            KeyOutcome::Unchanged { scope, .. }
            | KeyOutcome::Rewritten { scope, .. }
            | KeyOutcome::Invalid { scope, .. } => Some(*scope),
        }
    }
}

/// The result of resolving one key: the contract's outcome and the identity the key carried
/// merged under the request's.
#[derive(Clone, Debug)]
pub struct ScopedKey {
    pub outcome: KeyOutcome,
    pub identity: Identity,
    /// The metric's bare name (`gpu_0_idle_seconds`) when the key is a valid `system/` key, so
    /// that nobody parses the key again for it.
    pub name: Option<String>,
}

/// Applies the contract to one key. `request` is the identity from request headers; the key's
/// own owner fills in what they lack.
pub fn scoped_key(key: &str, request: &Identity, pattern: &OwnerPattern) -> ScopedKey {
    // A key MLflow refuses stays as sent, so the client gets MLflow's own 400: renaming it
    // into a valid one would store what MLflow would never have accepted.
    // (Only keys under `system/` are the contract's: any other is left alone, valid or not.)
    let Some(parts) = SystemKey::parse(key).filter(|_| is_valid_mlflow_key(key)) else {
        return ScopedKey {
            outcome: KeyOutcome::Untouched,
            identity: request.clone(),
            name: None,
        };
    };
    let identity = request.clone().or(pattern.parse(parts.owner));
    let Some(rule) = rule_for(parts.name) else {
        return ScopedKey {
            outcome: KeyOutcome::Untouched,
            identity,
            name: Some(parts.name.to_owned()),
        };
    };
    let name = rule.scoped.unwrap_or(parts.name);
    let owner = rule
        .scope
        .owner(&identity)
        .unwrap_or_else(|| parts.owner.to_owned());
    let new_key = if owner.is_empty() {
        format!("{SYSTEM_PREFIX}{name}")
    } else {
        format!("{SYSTEM_PREFIX}{owner}/{name}")
    };
    let (scope, family) = (rule.scope, rule.family);
    let outcome = if new_key == key {
        KeyOutcome::Unchanged { scope, family }
    } else if !is_valid_mlflow_key(&new_key) {
        KeyOutcome::Invalid {
            rejected: new_key,
            scope,
            family,
        }
    } else {
        KeyOutcome::Rewritten {
            key: new_key,
            scope,
            family,
        }
    };
    ScopedKey {
        outcome,
        identity,
        name: Some(parts.name.to_owned()),
    }
}

/// The key the collector emits for a bare metric name, for the identity it runs as.
pub fn collector_key(name: &str, identity: &Identity) -> String {
    let base = format!("{SYSTEM_PREFIX}{name}");
    match scoped_key(&base, identity, &OwnerPattern::default()).outcome {
        KeyOutcome::Rewritten { key, .. } => key,
        _ => base,
    }
}

/// MLflow's key rules: at most 250 characters of `[/\w.\- :]`, no empty, `.` or `..` segment,
/// no leading or trailing `/`.
pub fn is_valid_mlflow_key(key: &str) -> bool {
    let characters_allowed = if key.is_ascii() {
        // The usual key, one byte a character: the same rule without decoding.
        key.len() <= 250
            && key.bytes().all(|b| {
                b.is_ascii_alphanumeric() || matches!(b, b'_' | b'/' | b'.' | b'-' | b' ' | b':')
            })
    } else {
        key.chars().count() <= 250
            && key
                .chars()
                .all(|c| c.is_alphanumeric() || matches!(c, '_' | '/' | '.' | '-' | ' ' | ':'))
    };
    characters_allowed
        && !key.starts_with('/')
        && !key.ends_with('/')
        && key
            .split('/')
            .all(|segment| !segment.is_empty() && segment != "." && segment != "..")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(node: Option<&str>, rank: Option<u32>) -> Identity {
        Identity {
            node: node.map(str::to_owned),
            rank,
        }
    }

    fn rewrite(key: &str, request: &Identity) -> String {
        match scoped_key(key, request, &OwnerPattern::default()).outcome {
            KeyOutcome::Rewritten { key, .. } => key,
            _ => key.to_owned(),
        }
    }

    #[test]
    fn the_contracts_examples_hold() {
        let by_header = id(Some("gpu-node-1"), Some(3));
        assert_eq!(
            rewrite(
                "system/gpu-node-1/rank-3/cpu_utilization_percentage",
                &Identity::default()
            ),
            "system/gpu-node-1/node_cpu_utilization_percentage"
        );
        assert_eq!(
            rewrite("system/cpu_utilization_percentage", &by_header),
            "system/gpu-node-1/node_cpu_utilization_percentage"
        );
        assert_eq!(
            rewrite(
                "system/rank-3/disk_available_megabytes",
                &Identity::default()
            ),
            "system/rank-3/rootfs_available_megabytes"
        );
        assert_eq!(
            rewrite("system/gpu_0_utilization_percentage", &id(None, Some(3))),
            "system/rank-3/gpu_0_utilization_percentage"
        );
        assert_eq!(
            rewrite("system/system_memory_usage_megabytes", &Identity::default()),
            "system/node_memory_usage_megabytes"
        );
        for untouched in [
            "loss",
            "val/acc",
            "system/custom_thing",
            "system/rank-3/custom_thing",
            "systems/cpu_utilization_percentage",
        ] {
            assert_eq!(rewrite(untouched, &by_header), untouched);
        }
    }

    #[test]
    fn keys_mlflow_refuses_are_left_for_mlflow_to_refuse() {
        let long_owner = format!(
            "system/{}/rank-1/cpu_utilization_percentage",
            "n".repeat(300)
        );
        for key in [
            "system//cpu_utilization_percentage",
            "system/../cpu_utilization_percentage",
            "system/rank-1/cpu_utilization_percentage\0",
            "system/rank-1/cpu_utilization_percentage/",
            long_owner.as_str(),
        ] {
            let key = key.replace("\\0", "\0");
            let scoped = scoped_key(&key, &Identity::default(), &OwnerPattern::default());
            assert_eq!(scoped.outcome, KeyOutcome::Untouched, "{key:?}");
        }
    }

    #[test]
    fn node_names_in_any_spelling_name_the_contracts_node() {
        let scoped = scoped_key(
            "system/GPU_Node-1/rank-3/cpu_utilization_percentage",
            &Identity::default(),
            &OwnerPattern::default(),
        );
        assert_eq!(
            scoped.identity,
            Identity {
                node: Some("gpu-node-1".into()),
                rank: Some(3)
            }
        );
        assert!(
            matches!(&scoped.outcome, KeyOutcome::Rewritten { key, .. } if key == "system/gpu-node-1/node_cpu_utilization_percentage"),
            "{:?}",
            scoped.outcome
        );
        assert_eq!(normalize_node("  .Node_A.example "), "node-a.example");
        assert_eq!(normalize_node("___"), "unknown-node");
    }

    #[test]
    fn every_mlflow_name_gets_its_scope() {
        let node = id(Some("n1"), Some(7));
        for (name, expected) in [
            (
                "system_memory_usage_percentage",
                "system/n1/node_memory_usage_percentage",
            ),
            ("disk_usage_megabytes", "system/n1/rootfs_usage_megabytes"),
            ("disk_usage_percentage", "system/n1/rootfs_usage_percentage"),
            (
                "network_receive_megabytes",
                "system/rank-7/network_receive_megabytes",
            ),
            (
                "network_transmit_megabytes",
                "system/rank-7/network_transmit_megabytes",
            ),
            (
                "gpu_12_power_usage_watts",
                "system/rank-7/gpu_12_power_usage_watts",
            ),
            (
                "container_oom_kill_count",
                "system/rank-7/container_oom_kill_count",
            ),
            (
                "volume_data_usage_percentage",
                "system/rank-7/volume_data_usage_percentage",
            ),
        ] {
            assert_eq!(
                rewrite(&format!("system/{name}"), &node),
                expected,
                "{name}"
            );
        }
        for suffix in GPU_SUFFIXES {
            assert_eq!(
                rewrite(&format!("system/gpu_3_{suffix}"), &node),
                format!("system/rank-7/gpu_3_{suffix}"),
                "{suffix}"
            );
            assert_eq!(
                rule_for(&format!("gpu_3_{suffix}")).map(|r| r.scope),
                Some(Scope::Device)
            );
        }
        assert!(rule_for("gpu__x").is_none());
        assert!(rule_for("gpu_a_utilization").is_none());
        assert!(rule_for("volume__usage_megabytes").is_none());
    }

    #[test]
    fn volume_names_come_from_the_table() {
        assert_eq!(
            volume_metric_name("data", "usage_percentage").as_deref(),
            Some("volume_data_usage_percentage")
        );
        assert_eq!(
            collector_key(
                &volume_metric_name("ckpt", "available_megabytes").unwrap(),
                &id(Some("n1"), Some(2))
            ),
            "system/rank-2/volume_ckpt_available_megabytes"
        );
        assert_eq!(volume_metric_name("", "usage_percentage"), None);
        assert_eq!(volume_metric_name("data", "inodes"), None);
    }

    #[test]
    fn data_path_names_come_from_the_table_under_the_ranks_owner() {
        assert_eq!(
            data_metric_name("val", "files").as_deref(),
            Some("data_val_files")
        );
        assert_eq!(
            collector_key(
                &data_metric_name("train-2", "files").unwrap(),
                &id(Some("n1"), Some(4))
            ),
            "system/rank-4/data_train-2_files"
        );
        assert_eq!(
            rewrite("system/data_val_files", &id(Some("n1"), Some(2))),
            "system/rank-2/data_val_files"
        );
        assert_eq!(data_metric_name("", "files"), None);
        assert_eq!(data_metric_name("val", "bytes"), None);
        assert!(rule_for("data_files").is_none());
    }

    #[test]
    fn the_default_owner_pattern_reads_every_documented_form() {
        let p = OwnerPattern::default();
        assert_eq!(p.parse("rank-3"), id(None, Some(3)));
        assert_eq!(p.parse("rank_4"), id(None, Some(4)));
        assert_eq!(p.parse("rank5"), id(None, Some(5)));
        assert_eq!(
            p.parse("gpu-node-1/rank-6"),
            id(Some("gpu-node-1"), Some(6))
        );
        assert_eq!(p.parse("worker-a"), Identity::default());
        assert_eq!(p.parse(""), Identity::default());
    }

    #[test]
    fn headers_win_over_the_key_and_the_key_fills_the_gaps() {
        let from_header = id(Some("node-h"), None);
        let s = scoped_key(
            "system/node-k/rank-2/network_receive_megabytes",
            &from_header,
            &OwnerPattern::default(),
        );
        assert_eq!(s.identity, id(Some("node-h"), Some(2)));
        assert_eq!(
            s.outcome,
            KeyOutcome::Rewritten {
                key: "system/rank-2/network_receive_megabytes".into(),
                scope: Scope::Pod,
                family: "network"
            }
        );
    }

    #[test]
    fn a_scoped_key_that_breaks_mlflow_rules_is_reported_not_produced() {
        let bad_node = id(Some("bad node?"), Some(1));
        let s = scoped_key(
            "system/cpu_utilization_percentage",
            &bad_node,
            &OwnerPattern::default(),
        );
        assert!(
            matches!(s.outcome, KeyOutcome::Invalid { .. }),
            "{:?}",
            s.outcome
        );
        let long = id(Some(&"n".repeat(240)), None);
        assert!(matches!(
            scoped_key(
                "system/cpu_utilization_percentage",
                &long,
                &OwnerPattern::default()
            )
            .outcome,
            KeyOutcome::Invalid { .. }
        ));
    }

    #[test]
    fn custom_patterns_are_checked_and_used() {
        assert!(OwnerPattern::new("(").is_err());
        assert!(OwnerPattern::new("^worker$").is_err());
        let p = OwnerPattern::new(r"^(?P<node>[^/]+)/worker-(?P<rank>\d+)$").unwrap();
        assert_eq!(p.parse("host-a/worker-9"), id(Some("host-a"), Some(9)));
    }

    #[test]
    fn mlflow_key_rules() {
        assert!(is_valid_mlflow_key(
            "system/n1/node_cpu_utilization_percentage"
        ));
        assert!(is_valid_mlflow_key("a b:c-d.e"));
        for bad in [
            "/a",
            "a/",
            "a//b",
            "a/./b",
            "a/../b",
            "a?b",
            &"x".repeat(251),
            &"é".repeat(251),
            "a\u{a0}b",
            "a\tb",
        ] {
            assert!(!is_valid_mlflow_key(bad), "{bad}");
        }
        // MLflow counts characters, not bytes, and takes any alphanumeric one.
        assert!(is_valid_mlflow_key(&"x".repeat(250)));
        assert!(is_valid_mlflow_key(&"é".repeat(250)));
        assert!(is_valid_mlflow_key("système/nœud-1/利用率"));
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        /// MLflow's key rule as it reads, character by character: what the ASCII shortcut of
        /// `is_valid_mlflow_key` must agree with.
        fn valid_by_characters(key: &str) -> bool {
            key.chars().count() <= 250
                && key
                    .chars()
                    .all(|c| c.is_alphanumeric() || "_/.- :".contains(c))
                && !key.starts_with('/')
                && !key.ends_with('/')
                && key
                    .split('/')
                    .all(|segment| !segment.is_empty() && segment != "." && segment != "..")
        }

        proptest! {
            #[test]
            fn the_key_rule_reads_ascii_keys_as_it_reads_any(
                key in prop_oneof![
                    "[a-z0-9_/. :?\t-]{0,12}",
                    "[a-zé/.]{0,12}",
                    "[a-z]{245,255}",
                    "[a-zé]{240,255}",
                ],
            ) {
                prop_assert_eq!(is_valid_mlflow_key(&key), valid_by_characters(&key), "{:?}", key);
            }
        }

        fn any_identity() -> impl Strategy<Value = Identity> {
            (
                proptest::option::of("[a-z0-9][a-z0-9.-]{0,20}"),
                proptest::option::of(0u32..4096),
            )
                .prop_map(|(node, rank)| Identity { node, rank })
        }

        fn any_key() -> impl Strategy<Value = String> {
            let names = RULES.iter().filter_map(|r| match r.matches {
                NameMatch::Exact(n) => Some(n.to_owned()),
                _ => None,
            });
            let name = prop_oneof![
                proptest::sample::select(names.collect::<Vec<_>>()),
                "gpu_[0-9]{1,2}_[a-z_]{1,20}",
                "[a-z_]{1,30}",
            ];
            let owner = prop_oneof![
                Just(String::new()),
                "rank[-_]?[0-9]{1,3}",
                "[a-z0-9-]{1,10}/rank-[0-9]{1,3}",
                "[a-z]{1,8}"
            ];
            (
                prop_oneof![Just("system/"), Just(""), Just("train/")],
                owner,
                name,
            )
                .prop_map(|(prefix, owner, name)| {
                    if owner.is_empty() {
                        format!("{prefix}{name}")
                    } else {
                        format!("{prefix}{owner}/{name}")
                    }
                })
        }

        proptest! {
            #[test]
            fn rewriting_is_idempotent(key in any_key(), identity in any_identity()) {
                let pattern = OwnerPattern::default();
                if let KeyOutcome::Rewritten { key: once, .. } = scoped_key(&key, &identity, &pattern).outcome {
                    let twice = scoped_key(&once, &identity, &pattern).outcome;
                    prop_assert!(matches!(twice, KeyOutcome::Unchanged { .. }), "{key} -> {once} -> {twice:?}");
                }
            }

            #[test]
            fn only_system_keys_change_and_the_result_is_a_valid_key(key in any_key(), identity in any_identity()) {
                let outcome = scoped_key(&key, &identity, &OwnerPattern::default()).outcome;
                if !key.starts_with(SYSTEM_PREFIX) {
                    prop_assert_eq!(outcome, KeyOutcome::Untouched);
                } else if let KeyOutcome::Rewritten { key: new, .. } = outcome {
                    prop_assert!(new.starts_with(SYSTEM_PREFIX));
                    prop_assert!(is_valid_mlflow_key(&new));
                }
            }
        }
    }
}
