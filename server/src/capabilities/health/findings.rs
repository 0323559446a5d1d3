//! What a run stood on, as its collectors report it in run tags: a declared data path that
//! changed under the run (`mlscope/data/<name>/changed`, from any rank), the processes a rank
//! left running and how they were ended (`mlscope/rank-<r>/leftover_processes`,
//! `…/leftover_processes_ended`), and GPU memory still held after them
//! (`mlscope/rank-<r>/gpu_<i>_memory_left_megabytes`). The tags reach MLflow as sent; the proxy
//! keeps the newest reports of each run in the store (`run_findings`, at most
//! [`MAX_FINDINGS_PER_RUN`](super::store::MAX_FINDINGS_PER_RUN)), counts each report once in `/metrics` (`mlscope_run_findings_total`)
//! and shows them in `/runs/{id}/health`.

use serde::Serialize;

use super::judge;
use super::store::FindingRow;

/// A report's text is kept up to this many characters (the collector's are shorter).
const MAX_DETAIL_CHARS: usize = 500;

/// A data name is kept only up to this length (the collector's `--data NAME` is shorter).
const MAX_NAME_CHARS: usize = 64;

/// GPU indexes a `gpu_<i>_memory_left_megabytes` tag may name.
const MAX_GPU_INDEX: u32 = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    DataChanged,
    LeftoverProcesses,
    LeftoversEnded,
    GpuMemoryLeft,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::DataChanged => "data_changed",
            Kind::LeftoverProcesses => "leftover_processes",
            Kind::LeftoversEnded => "leftovers_ended",
            Kind::GpuMemoryLeft => "gpu_memory_left",
        }
    }

    fn parse(text: &str) -> Option<Kind> {
        [
            Kind::DataChanged,
            Kind::LeftoverProcesses,
            Kind::LeftoversEnded,
            Kind::GpuMemoryLeft,
        ]
        .into_iter()
        .find(|k| k.as_str() == text)
    }
}

/// One report read from a tag of an accepted request.
#[derive(Debug, Clone, PartialEq)]
pub struct Finding {
    pub node: String,
    pub rank: i64,
    pub kind: Kind,
    /// The data's name; the GPU's index; `""`.
    pub subject: String,
    pub detail: String,
}

impl Finding {
    pub fn row(self, run_id: &str, heard_ms: i64) -> FindingRow {
        FindingRow {
            run_id: run_id.to_owned(),
            node: self.node,
            rank: self.rank,
            kind: self.kind.as_str().to_owned(),
            subject: self.subject,
            detail: self.detail,
            heard_ms,
        }
    }
}

/// The report a tag carries, if it is one. A data change may come from any sender (it names
/// the run's data, not a rank); a rank's facts only from that rank itself (the request's
/// `X-Mlscope-Rank`), as with its other `mlscope/rank-<r>/` tags.
pub fn of_tag(
    header_node: Option<&str>,
    header_rank: Option<u32>,
    key: &str,
    value: &str,
) -> Option<Finding> {
    let node = header_node.unwrap_or_default().to_owned();
    let detail: String = value.chars().take(MAX_DETAIL_CHARS).collect();
    if let Some(rest) = key.strip_prefix("mlscope/data/") {
        let name = rest.strip_suffix("/changed")?;
        if name.is_empty() || name.contains('/') || name.chars().count() > MAX_NAME_CHARS {
            return None;
        }
        return Some(Finding {
            node,
            rank: header_rank.map_or(-1, i64::from),
            kind: Kind::DataChanged,
            subject: name.to_owned(),
            detail,
        });
    }
    let (rank, fact) = key.strip_prefix("mlscope/rank-")?.split_once('/')?;
    let rank: u32 = rank.parse().ok()?;
    if header_rank != Some(rank) {
        return None;
    }
    let (kind, subject) = match fact {
        "leftover_processes" => (Kind::LeftoverProcesses, String::new()),
        "leftover_processes_ended" => (Kind::LeftoversEnded, String::new()),
        _ => {
            let index = fact
                .strip_prefix("gpu_")?
                .strip_suffix("_memory_left_megabytes")?;
            let index: u32 = index.parse().ok().filter(|&i| i < MAX_GPU_INDEX)?;
            (Kind::GpuMemoryLeft, index.to_string())
        }
    };
    Some(Finding {
        node,
        rank: i64::from(rank),
        kind,
        subject,
        detail,
    })
}

/// The kind under which a newly stored row counts in `/metrics`: data changes, GPU memory left,
/// and leftover processes when there were any (the collector reports `0` when there were none);
/// how leftovers were ended is not counted apart.
pub fn counted_kind(row: &FindingRow) -> Option<&'static str> {
    let kind = Kind::parse(&row.kind)?;
    let counted = match kind {
        Kind::DataChanged | Kind::GpuMemoryLeft => true,
        Kind::LeftoverProcesses => leading_count(&row.detail).is_some_and(|n| n > 0),
        Kind::LeftoversEnded => false,
    };
    counted.then_some(kind.as_str())
}

fn leading_count(text: &str) -> Option<u64> {
    let digits: String = text.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// `/runs/{id}/health`'s `data_changes`: one per report, oldest first.
#[derive(Debug, Serialize, PartialEq)]
pub struct DataChange {
    pub name: String,
    /// The sender that reported it (`""`/`-1` when it named none).
    pub node: String,
    pub rank: i64,
    pub heard_at: String,
    /// The collector's line: when, the run's step, what vanished, appeared or changed.
    pub what: String,
}

/// What a rank left behind when its command exited, in `/runs/{id}/health`.
#[derive(Debug, Default, Serialize, PartialEq)]
pub struct Leftovers {
    /// The count, then the largest processes (`0` when none).
    pub processes: Option<String>,
    /// How they were ended.
    pub ended: Option<String>,
    pub gpu_memory_left: Vec<GpuMemoryLeft>,
}

#[derive(Debug, Serialize, PartialEq)]
pub struct GpuMemoryLeft {
    pub index: i64,
    pub megabytes: Option<f64>,
}

pub fn data_changes(rows: &[FindingRow]) -> Vec<DataChange> {
    rows.iter()
        .filter(|r| r.kind == Kind::DataChanged.as_str())
        .map(|r| DataChange {
            name: r.subject.clone(),
            node: r.node.clone(),
            rank: r.rank,
            heard_at: judge::timestamp(r.heard_ms),
            what: r.detail.clone(),
        })
        .collect()
}

/// The newest report of each kind (and GPU) of one rank; `None` when it reported none.
pub fn leftovers_of(rows: &[FindingRow], node: &str, rank: i64) -> Option<Leftovers> {
    let mut leftovers = Leftovers::default();
    let mut any = false;
    // Oldest first: a newer report replaces an older one.
    for row in rows.iter().filter(|r| r.node == node && r.rank == rank) {
        match Kind::parse(&row.kind) {
            Some(Kind::LeftoverProcesses) => leftovers.processes = Some(row.detail.clone()),
            Some(Kind::LeftoversEnded) => leftovers.ended = Some(row.detail.clone()),
            Some(Kind::GpuMemoryLeft) => {
                let Ok(index) = row.subject.parse::<i64>() else {
                    continue;
                };
                let megabytes = row.detail.trim().parse::<f64>().ok();
                leftovers.gpu_memory_left.retain(|g| g.index != index);
                leftovers
                    .gpu_memory_left
                    .push(GpuMemoryLeft { index, megabytes });
            }
            _ => continue,
        }
        any = true;
    }
    leftovers.gpu_memory_left.sort_by_key(|g| g.index);
    any.then_some(leftovers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_become_findings_only_from_the_rank_they_name() {
        let change = of_tag(
            Some("n1"),
            Some(2),
            "mlscope/data/val/changed",
            "3 vanished",
        )
        .unwrap();
        assert_eq!(
            (change.kind, change.subject.as_str(), change.rank),
            (Kind::DataChanged, "val", 2)
        );
        // A data change names the run's data: any sender, even one without a rank.
        assert_eq!(
            of_tag(None, None, "mlscope/data/val/changed", "x").map(|f| (f.node, f.rank)),
            Some((String::new(), -1))
        );
        for key in [
            "mlscope/data//changed",
            "mlscope/data/a/b/changed",
            "mlscope/data/val/fingerprint",
            "mlscope/rank-2/outcome",
            "mlscope/rank-2/gpu_64_memory_left_megabytes",
            "mlscope/rank-2/gpu_x_memory_left_megabytes",
        ] {
            assert_eq!(of_tag(Some("n1"), Some(2), key, "1"), None, "{key}");
        }
        let left = "mlscope/rank-2/leftover_processes";
        assert_eq!(of_tag(Some("n1"), Some(3), left, "1: 10 sleep"), None);
        assert_eq!(of_tag(Some("n1"), None, left, "1: 10 sleep"), None);
        let gpu = of_tag(
            Some("n1"),
            Some(2),
            "mlscope/rank-2/gpu_1_memory_left_megabytes",
            "812",
        )
        .unwrap();
        assert_eq!((gpu.kind, gpu.subject.as_str()), (Kind::GpuMemoryLeft, "1"));
        let long = "x".repeat(2_000);
        assert_eq!(
            of_tag(None, Some(2), left, &long).unwrap().detail.len(),
            MAX_DETAIL_CHARS
        );
    }

    #[test]
    fn a_rank_shows_its_newest_leftovers_and_counts_only_what_was_left() {
        let row = |kind: Kind, subject: &str, detail: &str, heard_ms: i64| FindingRow {
            run_id: "r".into(),
            node: "n1".into(),
            rank: 0,
            kind: kind.as_str().into(),
            subject: subject.into(),
            detail: detail.into(),
            heard_ms,
        };
        let rows = [
            row(Kind::LeftoverProcesses, "", "0", 1),
            row(
                Kind::LeftoverProcesses,
                "",
                "1: 4121 python w.py (812 MB)",
                2,
            ),
            row(Kind::LeftoversEnded, "", "1 by SIGTERM", 3),
            row(Kind::GpuMemoryLeft, "1", "900", 4),
            row(Kind::GpuMemoryLeft, "0", "812", 5),
            row(Kind::GpuMemoryLeft, "1", "120.5", 6),
            row(Kind::DataChanged, "val", "2 vanished", 7),
        ];
        let leftovers = leftovers_of(&rows, "n1", 0).unwrap();
        assert_eq!(
            leftovers.processes.as_deref(),
            Some("1: 4121 python w.py (812 MB)")
        );
        assert_eq!(leftovers.ended.as_deref(), Some("1 by SIGTERM"));
        assert_eq!(
            leftovers.gpu_memory_left,
            [
                GpuMemoryLeft {
                    index: 0,
                    megabytes: Some(812.0)
                },
                GpuMemoryLeft {
                    index: 1,
                    megabytes: Some(120.5)
                }
            ]
        );
        assert_eq!(leftovers_of(&rows, "n2", 0), None);
        let changes = data_changes(&rows);
        assert_eq!(changes.len(), 1);
        assert_eq!(
            (changes[0].name.as_str(), changes[0].what.as_str()),
            ("val", "2 vanished")
        );
        let counted: Vec<_> = rows.iter().filter_map(counted_kind).collect();
        assert_eq!(
            counted,
            [
                "leftover_processes",
                "gpu_memory_left",
                "gpu_memory_left",
                "gpu_memory_left",
                "data_changed"
            ]
        );
    }
}
