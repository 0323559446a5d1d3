//! The dedup-rows report: rows per target and kind of series, the ratio without ÷ with
//! deduplication, and what the contract says the counts must be.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::{ProxyCounters, Stored};
use crate::markdown::{command_block, Align, Table};
use crate::monitor::{SeriesKind, NODE_WIDE_NAMES, POD_NAMES};
use crate::stack::TargetKind;

pub(crate) struct RunFacts {
    pub(crate) command_line: String,
    pub(crate) mlflow_version: Option<String>,
    pub(crate) ranks_per_node: u32,
    pub(crate) nodes: u32,
    pub(crate) publishes: u64,
    pub(crate) keys_per_publish: usize,
}

/// The kinds of series the report counts, in row order.
const KINDS: [SeriesKind; 2] = [SeriesKind::NodeWide, SeriesKind::Pod];

// === impl RunFacts ===

impl RunFacts {
    fn ranks(&self) -> u64 {
        u64::from(self.ranks_per_node) * u64::from(self.nodes)
    }

    /// Names per publish of a kind of series.
    fn names(kind: SeriesKind) -> u64 {
        match kind {
            SeriesKind::NodeWide => NODE_WIDE_NAMES.len() as u64,
            SeriesKind::Pod => POD_NAMES.len() as u64,
            SeriesKind::Other => 0,
        }
    }

    /// Rows MLflow must hold for `kind` after logging through `target`, by the scope contract:
    /// with deduplication one rank per node reports node-wide values; nothing else is dropped.
    pub(crate) fn expected_rows(&self, target: TargetKind, kind: SeriesKind) -> u64 {
        let senders = match (target, kind) {
            (TargetKind::Proxy, SeriesKind::NodeWide) => u64::from(self.nodes),
            (_, SeriesKind::Other) => 0,
            _ => self.ranks(),
        };
        senders * Self::names(kind) * self.publishes
    }

    /// Distinct keys MLflow must hold for `kind`: a rewriting proxy names node-wide series by
    /// node, MLflow itself keeps one per rank.
    pub(crate) fn expected_series(&self, target: TargetKind, kind: SeriesKind) -> u64 {
        let owners = match (target, kind) {
            (TargetKind::Proxy | TargetKind::ProxyDedupOff, SeriesKind::NodeWide) => {
                u64::from(self.nodes)
            }
            (_, SeriesKind::Other) => 0,
            _ => self.ranks(),
        };
        owners * Self::names(kind)
    }
}

/// Every count that differs from what the contract says, as a problem.
pub(crate) fn unexpected(facts: &RunFacts, results: &[(TargetKind, Stored)]) -> Vec<String> {
    let mut problems = Vec::new();
    for (target, stored) in results {
        for kind in KINDS.into_iter().chain([SeriesKind::Other]) {
            let rows = stored.rows.get(&kind).copied().unwrap_or(0);
            let expected = facts.expected_rows(*target, kind);
            if rows != expected {
                problems.push(format!(
                    "via {target}: MLflow holds {rows} {} rows, expected {expected}",
                    kind.label()
                ));
            }
            let series = stored.series.get(&kind).copied().unwrap_or(0);
            let expected = facts.expected_series(*target, kind);
            if series != expected {
                problems.push(format!(
                    "via {target}: MLflow holds {series} {} series, expected {expected}",
                    kind.label()
                ));
            }
        }
    }
    problems
}

pub(crate) fn render(
    facts: &RunFacts,
    results: &[(TargetKind, Stored)],
    counters: &BTreeMap<TargetKind, ProxyCounters>,
) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "### Stored rows with and without node-series deduplication\n"
    );
    out.push_str(&command_block(&facts.command_line));
    let _ = writeln!(
        out,
        "\n{} nodes × {} ranks = {} simulated MLflow system-metrics monitors \
         (`MLFLOW_SYSTEM_METRICS_NODE_ID=<node>/rank-<r>`), {} publishes each: one log-batch of \
         the monitor's {} CPU, memory, disk and network keys under `system/<node>/rank-<r>/`, the \
         rank's own step counter from 0, one timestamp per publish ({} s apart). Each target logs \
         into a run of its own; targets take turns publish by publish, and the ranks of a publish \
         are sent together, at most {} in flight (below MLflow's 15 pooled database connections). \
         Rows counted afterwards straight from MLflow: the lengths of \
         `metrics/get-history` for every key `runs/get` lists. MLflow {}.\n",
        facts.nodes,
        facts.ranks_per_node,
        facts.ranks(),
        facts.publishes,
        facts.keys_per_publish,
        crate::monitor::SAMPLING_INTERVAL_MILLIS / 1_000,
        super::MAX_IN_FLIGHT,
        facts
            .mlflow_version
            .as_deref()
            .unwrap_or("(version unknown)"),
    );

    let mut table = Table::new(&[
        ("target", Align::Left),
        ("requests", Align::Right),
        ("failed", Align::Right),
        ("node-wide series", Align::Right),
        ("node-wide rows", Align::Right),
        ("pod series", Align::Right),
        ("pod rows", Align::Right),
        ("other rows", Align::Right),
    ]);
    for (target, stored) in results {
        let get = |map: &BTreeMap<SeriesKind, u64>, kind| map.get(&kind).copied().unwrap_or(0);
        table.row(vec![
            target.to_string(),
            stored.requests.to_string(),
            stored.failed.to_string(),
            get(&stored.series, SeriesKind::NodeWide).to_string(),
            get(&stored.rows, SeriesKind::NodeWide).to_string(),
            get(&stored.series, SeriesKind::Pod).to_string(),
            get(&stored.rows, SeriesKind::Pod).to_string(),
            get(&stored.rows, SeriesKind::Other).to_string(),
        ]);
    }
    out.push_str(&table.render());
    let _ = writeln!(
        out,
        "\n`{}`: rewriting and deduplication on (the defaults). `{}`: `--dedup false`, keys \
         still rewritten, so the ranks of a node write into one node-named series. `{}`: no \
         proxy, one series per rank and name.\n",
        TargetKind::Proxy,
        TargetKind::ProxyDedupOff,
        TargetKind::Direct,
    );

    let rows = |target: TargetKind, kind: SeriesKind| {
        results
            .iter()
            .find(|(t, _)| *t == target)
            .and_then(|(_, stored)| stored.rows.get(&kind).copied())
    };
    let mut ratios = Table::new(&[
        ("series", Align::Left),
        ("rows, direct", Align::Right),
        ("rows, dedup off", Align::Right),
        ("rows, dedup on", Align::Right),
        ("dedup off ÷ on", Align::Right),
        ("expected", Align::Right),
    ]);
    for kind in KINDS {
        let on = rows(TargetKind::Proxy, kind);
        let off = rows(TargetKind::ProxyDedupOff, kind);
        let expected = facts.expected_rows(TargetKind::ProxyDedupOff, kind) as f64
            / facts.expected_rows(TargetKind::Proxy, kind).max(1) as f64;
        let show = |n: Option<u64>| n.map_or_else(|| "n/a".into(), |n| n.to_string());
        ratios.row(vec![
            kind.label().to_string(),
            show(rows(TargetKind::Direct, kind)),
            show(off),
            show(on),
            match (off, on) {
                (Some(off), Some(on)) if on > 0 => format!("{:.2}×", off as f64 / on as f64),
                _ => "n/a".into(),
            },
            format!("{expected:.2}×"),
        ]);
    }
    out.push_str(&ratios.render());
    let _ = writeln!(
        out,
        "\nExpected: node-wide rows shrink by the ranks per node ({}), pod (network) rows not at \
         all: each rank's network namespace is its own.",
        facts.ranks_per_node
    );
    for (target, found) in counters {
        let _ = writeln!(
            out,
            "`{target}` counted (its `/metrics`): {} node-wide samples kept, {} dropped, {} \
             reporter elections.",
            found.kept, found.dropped, found.elections
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> RunFacts {
        RunFacts {
            command_line: "mlscope-bench dedup-rows --publishes 10".into(),
            mlflow_version: Some("3.17.2".into()),
            ranks_per_node: 8,
            nodes: 2,
            publishes: 10,
            keys_per_publish: 8,
        }
    }

    fn stored(node_rows: u64, node_series: u64, pod_rows: u64) -> Stored {
        Stored {
            requests: 160,
            failed: 0,
            rows: BTreeMap::from([
                (SeriesKind::NodeWide, node_rows),
                (SeriesKind::Pod, pod_rows),
            ]),
            series: BTreeMap::from([(SeriesKind::NodeWide, node_series), (SeriesKind::Pod, 32)]),
        }
    }

    #[test]
    fn the_contract_expects_one_node_series_reporter_per_node_with_dedup() {
        let facts = facts();
        assert_eq!(
            facts.expected_rows(TargetKind::Proxy, SeriesKind::NodeWide),
            2 * 6 * 10
        );
        assert_eq!(
            facts.expected_rows(TargetKind::ProxyDedupOff, SeriesKind::NodeWide),
            16 * 6 * 10
        );
        assert_eq!(
            facts.expected_rows(TargetKind::Proxy, SeriesKind::Pod),
            16 * 2 * 10
        );
        assert_eq!(
            facts.expected_series(TargetKind::Direct, SeriesKind::NodeWide),
            16 * 6
        );
        assert_eq!(
            facts.expected_series(TargetKind::ProxyDedupOff, SeriesKind::NodeWide),
            2 * 6
        );
    }

    #[test]
    fn the_report_shows_rows_per_target_and_the_ratio() {
        let results = vec![
            (TargetKind::Direct, stored(960, 96, 320)),
            (TargetKind::ProxyDedupOff, stored(960, 12, 320)),
            (TargetKind::Proxy, stored(120, 12, 320)),
        ];
        let facts = facts();
        assert_eq!(unexpected(&facts, &results), Vec::<String>::new());
        let report = render(&facts, &results, &BTreeMap::new());
        assert!(
            report.contains("| mlscope-proxy | 160 | 0 | 12 | 120 | 32 | 320 | 0 |"),
            "{report}"
        );
        assert!(
            report.contains("| node-wide (cpu, memory, disk) | 960 | 960 | 120 | 8.00× | 8.00× |"),
            "{report}"
        );
        assert!(
            report.contains("| pod (network) | 320 | 320 | 320 | 1.00× | 1.00× |"),
            "{report}"
        );
    }

    #[test]
    fn a_count_off_the_contract_is_a_problem() {
        let results = vec![(TargetKind::Proxy, stored(130, 12, 320))];
        let problems = unexpected(&facts(), &results);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("130 node-wide"), "{problems:?}");
    }
}
