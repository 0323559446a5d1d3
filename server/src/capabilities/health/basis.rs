//! What a run's GPU idleness was judged on. Each rank's collector says it in the rank tag
//! `mlscope/rank-<r>/gpu_idle_basis`: `sm_active` where GPM measures SM activity (a GPU at 100 %
//! utilisation running one thread is idle), `utilization` where it does not, `mixed` when the
//! rank's GPUs differ. The run tag [`BASIS_TAG`] sums the ranks up beside `mlscope.gpus_idle` and
//! the bill, so whoever reads "idle" knows which measure said it.

use super::store::RankRow;

/// The run tag: `sm_active`, `utilization`, or `mixed (sm_active: ranks 0-3; utilization: rank
/// 4)` when the ranks differ.
pub const BASIS_TAG: &str = "mlscope.gpu_idle_basis";

/// The values a rank's tag may hold, in the order the run tag lists them.
const BASES: [&str; 3] = ["sm_active", "utilization", "mixed"];

/// A rank's basis as its collector's tag says it; `None` for anything but [`BASES`].
pub fn parse(value: &str) -> Option<&'static str> {
    BASES.into_iter().find(|b| *b == value)
}

/// The basis of a rank that holds GPUs: what its collector said, else `utilization` (a
/// collector from before GPM judged by utilisation; MLflow's own monitor sends no idle clock, so
/// nothing of it is judged idle). `None` for a rank without GPUs.
pub fn of_rank(rank: &RankRow) -> Option<&str> {
    (rank.gpus > 0).then(|| rank.gpu_idle_basis.as_deref().unwrap_or("utilization"))
}

/// The run's [`BASIS_TAG`] value over its ranks that hold GPUs; `None` when none does.
pub fn of_run(ranks: &[RankRow]) -> Option<String> {
    let mut by_basis: Vec<(&str, Vec<i64>, Vec<String>)> =
        BASES.iter().map(|b| (*b, Vec::new(), Vec::new())).collect();
    for rank in ranks {
        let Some(basis) = of_rank(rank) else {
            continue;
        };
        let Some((_, numbers, unnamed)) = by_basis.iter_mut().find(|(b, _, _)| *b == basis) else {
            continue;
        };
        if rank.rank >= 0 {
            numbers.push(rank.rank);
        } else if rank.node.is_empty() {
            unnamed.push("monitor".to_owned());
        } else {
            unnamed.push(rank.node.clone());
        }
    }
    let used: Vec<_> = by_basis
        .into_iter()
        .filter(|(_, numbers, unnamed)| !numbers.is_empty() || !unnamed.is_empty())
        .collect();
    match used.as_slice() {
        [] => None,
        [(basis, _, _)] => Some((*basis).to_owned()),
        _ => {
            let parts: Vec<String> = used
                .into_iter()
                .map(|(basis, mut numbers, mut unnamed)| {
                    numbers.sort_unstable();
                    numbers.dedup();
                    unnamed.sort();
                    unnamed.dedup();
                    let mut names = Vec::new();
                    if !numbers.is_empty() {
                        let word = if numbers.len() == 1 { "rank" } else { "ranks" };
                        names.push(format!("{word} {}", ranges(&numbers)));
                    }
                    names.extend(unnamed);
                    format!("{basis}: {}", names.join(", "))
                })
                .collect();
            Some(format!("mixed ({})", parts.join("; ")))
        }
    }
}

/// Sorted, distinct numbers as `0-3,7,9-10`.
fn ranges(numbers: &[i64]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < numbers.len() {
        let start = numbers[i];
        let mut end = start;
        while i + 1 < numbers.len() && numbers[i + 1] == end + 1 {
            i += 1;
            end = numbers[i];
        }
        out.push(if end > start {
            format!("{start}-{end}")
        } else {
            start.to_string()
        });
        i += 1;
    }
    out.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(rank: i64, gpus: i64, basis: Option<&str>) -> RankRow {
        RankRow {
            run_id: "r".into(),
            node: "n".into(),
            rank,
            gpus,
            gpu_idle_basis: basis.map(str::to_owned),
            ..RankRow::default()
        }
    }

    #[test]
    fn one_basis_for_every_rank_is_the_run_tag_itself() {
        let sm = [rank(0, 8, Some("sm_active")), rank(1, 8, Some("sm_active"))];
        assert_eq!(of_run(&sm).as_deref(), Some("sm_active"));
        // Without GPM (or a collector from before it): utilization, as the bill always judged.
        let old = [rank(0, 8, None), rank(1, 8, Some("utilization"))];
        assert_eq!(of_run(&old).as_deref(), Some("utilization"));
        // Ranks without GPUs say nothing; a run without GPUs gets no tag.
        let cpu = [rank(0, 0, None), rank(1, 0, Some("sm_active"))];
        assert_eq!(of_run(&cpu), None);
        assert_eq!(of_rank(&cpu[1]), None);
    }

    #[test]
    fn ranks_that_differ_are_named_by_basis() {
        let ranks = [
            rank(0, 8, Some("sm_active")),
            rank(1, 8, Some("sm_active")),
            rank(2, 8, None),
            rank(3, 8, Some("sm_active")),
            rank(5, 8, Some("mixed")),
            rank(4, 0, Some("utilization")),
            RankRow {
                node: "node-b".into(),
                ..rank(-1, 2, None)
            },
        ];
        assert_eq!(
            of_run(&ranks).as_deref(),
            Some("mixed (sm_active: ranks 0-1,3; utilization: rank 2, node-b; mixed: rank 5)")
        );
    }

    #[test]
    fn only_the_known_words_are_taken_from_a_rank() {
        assert_eq!(parse("sm_active"), Some("sm_active"));
        assert_eq!(parse("mixed"), Some("mixed"));
        assert_eq!(parse("SM_ACTIVE"), None);
        assert_eq!(parse("idle, trust me"), None);
        assert_eq!(ranges(&[0, 1, 2, 3, 7, 9, 10]), "0-3,7,9-10");
    }
}
