//! Whether a run is dead, from its ranks' heartbeats and the ends the collector's wrapper
//! reported. Pure: the sweep feeds it store rows and the time.

use std::time::{Duration, UNIX_EPOCH};

use super::store::{RankRow, SUPERSEDE_AFTER_MS};

/// Shortest silence that counts as "gone" for the ranks beside one that failed.
const MIN_SHORT_SILENCE_MS: i64 = 3_000;
/// The sampling interval assumed for a rank whose interval is not known yet: MLflow's default.
const DEFAULT_INTERVAL_MS: i64 = 10_000;

/// How a run ended, as far as mlscope can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Every rank went silent without a word: the pod or node vanished.
    Lost,
    /// A rank was killed by the kernel's OOM killer.
    OomKilled,
    /// A rank was killed by a signal.
    Killed,
    /// A rank's command could not be started.
    NotStarted,
    /// A rank exited with a non-zero status.
    Failed,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Lost => "lost",
            Outcome::OomKilled => "oom_killed",
            Outcome::Killed => "killed",
            Outcome::NotStarted => "not_started",
            Outcome::Failed => "failed",
        }
    }
}

/// The sweep's finding about one run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Judgement {
    pub outcome: Outcome,
    /// One sentence for people: which rank, where, when.
    pub detail: String,
    /// When the run stopped: its last heartbeat or rank end.
    pub end_time_ms: i64,
    /// Nodes with ranks that went silent (no reported end).
    pub silent_nodes: Vec<String>,
}

/// What the ranks of a run say. `None`: alive, or ended in a way that is the client's to
/// record (every rank exited 0). A write MLflow accepted for the run within `stale_after` is a
/// sign of life as good as a heartbeat: a run still being written to is neither lost nor, after
/// a rank's reported end, failed.
pub fn judge(ranks: &[RankRow], now_ms: i64, stale_after: Duration) -> Option<Judgement> {
    if ranks.is_empty() {
        return None;
    }
    let stale_ms = stale_after.as_millis().min(i64::MAX as u128) as i64;
    let silent_for = |r: &RankRow| now_ms - r.last_heard_ms;
    let short_silence = |r: &RankRow| {
        (3 * r.interval_ms.unwrap_or(DEFAULT_INTERVAL_MS))
            .clamp(MIN_SHORT_SILENCE_MS, stale_ms.max(MIN_SHORT_SILENCE_MS))
    };
    let abnormal = |r: &RankRow| match r.outcome.as_deref() {
        Some("exited") => r.exit_code.unwrap_or(0) != 0,
        Some(_) => true,
        None => false,
    };
    let ended = |r: &RankRow| r.outcome.is_some();
    let last_write = ranks.iter().filter_map(|r| r.last_write_ms).max();
    let written_to_since =
        |since: i64| last_write.is_some_and(|w| w > since && now_ms - w < stale_ms);

    let failed: Vec<&RankRow> = ranks.iter().filter(|r| abnormal(r)).collect();
    let outcome = if !failed.is_empty() {
        let others_gone = ranks
            .iter()
            .all(|r| ended(r) || silent_for(r) >= short_silence(r));
        // Writes go on after the failure (beyond the failed rank's own last ones): alive.
        let failed_at = failed.iter().filter_map(|r| r.ended_ms).max().unwrap_or(0);
        if !others_gone || written_to_since(failed_at + SUPERSEDE_AFTER_MS) {
            return None;
        }
        let has = |name: &str| failed.iter().any(|r| r.outcome.as_deref() == Some(name));
        if has("oom_killed") {
            Outcome::OomKilled
        } else if has("killed") {
            Outcome::Killed
        } else if has("not_started") {
            Outcome::NotStarted
        } else {
            Outcome::Failed
        }
    } else {
        let silent_long = |r: &RankRow| !ended(r) && silent_for(r) >= stale_ms;
        let all_done = ranks.iter().all(|r| ended(r) || silent_long(r));
        if !all_done || !ranks.iter().any(silent_long) || written_to_since(i64::MIN) {
            return None;
        }
        Outcome::Lost
    };

    let end_time_ms = ranks
        .iter()
        .map(|r| r.ended_ms.unwrap_or(0).max(r.last_heard_ms))
        .chain(last_write)
        .max()
        .unwrap_or(now_ms);
    let mut silent_nodes: Vec<String> = ranks
        .iter()
        .filter(|r| !ended(r))
        .map(|r| r.node.clone())
        .filter(|n| !n.is_empty())
        .collect();
    silent_nodes.sort();
    silent_nodes.dedup();
    let detail = describe(outcome, ranks, &failed);
    Some(Judgement {
        outcome,
        detail,
        end_time_ms,
        silent_nodes,
    })
}

/// `rank 3 on node-b`, `the monitor on node-b`, `the run's monitor`.
pub fn rank_label(node: &str, rank: i64) -> String {
    match (node.is_empty(), rank < 0) {
        (false, false) => format!("rank {rank} on {node}"),
        (true, false) => format!("rank {rank}"),
        (false, true) => format!("the monitor on {node}"),
        (true, true) => "the run's monitor".to_owned(),
    }
}

/// RFC 3339 UTC, to the second.
pub fn timestamp(ms: i64) -> String {
    let at = UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_seconds(at).to_string()
}

fn describe(outcome: Outcome, ranks: &[RankRow], failed: &[&RankRow]) -> String {
    match outcome {
        Outcome::Lost => {
            let last = ranks.iter().map(|r| r.last_heard_ms).max().unwrap_or(0);
            let silent = ranks.iter().filter(|r| r.outcome.is_none()).count();
            format!(
                "{silent} of {} rank(s) went silent without reporting an end (pod or node lost); last heartbeat {}",
                ranks.len(),
                timestamp(last)
            )
        }
        _ => {
            let first = failed
                .iter()
                .min_by_key(|r| r.ended_ms.unwrap_or(r.last_heard_ms))
                .expect("a failed rank");
            let how = match first.outcome.as_deref() {
                Some("oom_killed") => "was OOM-killed".to_owned(),
                Some("killed") => "was killed by a signal".to_owned(),
                Some("not_started") => "could not start its command".to_owned(),
                _ => "exited with an error".to_owned(),
            };
            let code = first
                .exit_code
                .map(|c| format!(" (exit {c})"))
                .unwrap_or_default();
            let mut text = format!(
                "{} {how}{code} at {}",
                rank_label(&first.node, first.rank),
                timestamp(first.ended_ms.unwrap_or(first.last_heard_ms))
            );
            if failed.len() > 1 {
                text.push_str(&format!("; {} rank(s) failed in all", failed.len()));
            }
            text
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: i64 = 60_000;

    fn rank(rank: i64, last: i64) -> RankRow {
        RankRow {
            run_id: "r".into(),
            node: format!("node-{}", rank / 2),
            rank,
            first_heard_ms: 0,
            last_heard_ms: last,
            interval_ms: Some(1_000),
            outcome: None,
            exit_code: None,
            ended_ms: None,
            pod: None,
            memory_limit_mb: None,
            cpu_limit_cores: None,
            gpu_model: None,
            gpu_idle_basis: None,
            gpus: 0,
            gpu_idle: None,
            gpu_idle_ms: None,
            workspace: None,
            last_write_ms: None,
            last_sample_ms: None,
            bill_first_ms: None,
            bill_last_ms: None,
        }
    }

    fn written(mut rows: Vec<RankRow>, at: i64) -> Vec<RankRow> {
        for row in &mut rows {
            row.last_write_ms = Some(at);
        }
        rows
    }

    #[test]
    fn a_run_still_written_to_is_neither_lost_nor_failed() {
        let now = 100 * MIN;
        // One system sample long ago, the loss logged every 2 s since: alive.
        let monitor = rank(0, now - 10 * MIN);
        assert!(judge(std::slice::from_ref(&monitor), now, STALE).is_some());
        assert_eq!(
            judge(&written(vec![monitor.clone()], now - 2_000), now, STALE),
            None
        );
        // Writes that stopped longer ago than --run-stale-after do not keep it alive.
        let j = judge(&written(vec![monitor], now - 6 * MIN), now, STALE).unwrap();
        assert_eq!(j.outcome, Outcome::Lost);
        // A rank killed, others silent: failed, unless writes go on after the kill.
        let killed = ended(rank(1, now - 60_000), "killed", -9, now - 60_000);
        let quiet = rank(0, now - 60_000);
        let rows = vec![quiet, killed];
        assert_eq!(judge(&rows, now, STALE).unwrap().outcome, Outcome::Killed);
        // The killed rank's own last writes (just after its end) are not life.
        assert_eq!(
            judge(&written(rows.clone(), now - 58_000), now, STALE)
                .unwrap()
                .outcome,
            Outcome::Killed
        );
        assert_eq!(judge(&written(rows, now - 5_000), now, STALE), None);
    }

    fn ended(mut row: RankRow, outcome: &str, code: i64, at: i64) -> RankRow {
        row.outcome = Some(outcome.into());
        row.exit_code = Some(code);
        row.ended_ms = Some(at);
        row
    }

    const STALE: Duration = Duration::from_secs(300);

    #[test]
    fn a_run_still_heard_from_is_alive() {
        let now = 10 * MIN;
        assert_eq!(
            judge(&[rank(0, now - 2_000), rank(1, now - 8 * MIN)], now, STALE),
            None
        );
        assert_eq!(judge(&[], now, STALE), None);
    }

    #[test]
    fn every_rank_silent_past_the_timeout_is_lost_with_the_last_heartbeat_as_end() {
        let now = 20 * MIN;
        let j = judge(&[rank(0, 10 * MIN), rank(2, 11 * MIN)], now, STALE).unwrap();
        assert_eq!(j.outcome, Outcome::Lost);
        assert_eq!(j.end_time_ms, 11 * MIN);
        assert_eq!(j.silent_nodes, ["node-0", "node-1"]);
        assert!(
            j.detail.contains("2 of 2 rank(s) went silent"),
            "{}",
            j.detail
        );
        // One rank finished cleanly, the other vanished: still lost.
        let j = judge(
            &[
                ended(rank(0, 10 * MIN), "exited", 0, 10 * MIN),
                rank(1, 11 * MIN),
            ],
            now,
            STALE,
        )
        .unwrap();
        assert_eq!((j.outcome, j.silent_nodes.len()), (Outcome::Lost, 1));
    }

    #[test]
    fn ranks_that_all_exited_zero_leave_the_run_to_its_client() {
        let now = 20 * MIN;
        let ranks = [
            ended(rank(0, MIN), "exited", 0, MIN),
            ended(rank(1, MIN), "exited", 0, MIN),
        ];
        assert_eq!(judge(&ranks, now, STALE), None);
    }

    #[test]
    fn a_killed_rank_fails_the_run_once_the_others_ended_or_went_quiet_without_the_timeout() {
        let now = 10 * MIN;
        let killed = ended(rank(1, now - 5_000), "killed", 137, now - 4_000);
        // The other rank still sends: wait.
        assert_eq!(
            judge(&[rank(0, now - 500), killed.clone()], now, STALE),
            None
        );
        // It went quiet for three of its intervals: judged now, long before the stale timeout.
        let j = judge(&[rank(0, now - 3_500), killed.clone()], now, STALE).unwrap();
        assert_eq!(j.outcome, Outcome::Killed);
        assert_eq!(j.end_time_ms, now - 3_500);
        assert!(
            j.detail
                .starts_with("rank 1 on node-0 was killed by a signal (exit 137)"),
            "{}",
            j.detail
        );
        // Exited normally beside it: judged at once.
        let j = judge(&[ended(rank(0, now), "exited", 0, now), killed], now, STALE).unwrap();
        assert_eq!(j.outcome, Outcome::Killed);
    }

    #[test]
    fn an_oom_kill_names_the_outcome_over_other_failures() {
        let now = 10 * MIN;
        let ranks = [
            ended(rank(0, now), "killed", 143, now),
            ended(rank(1, now), "oom_killed", 137, now),
            ended(rank(2, now), "exited", 3, now),
        ];
        let j = judge(&ranks, now, STALE).unwrap();
        assert_eq!(j.outcome, Outcome::OomKilled);
        assert!(j.detail.contains("3 rank(s) failed"), "{}", j.detail);
        let failed = judge(&[ended(rank(0, now), "exited", 2, now)], now, STALE).unwrap();
        assert_eq!(failed.outcome, Outcome::Failed);
    }

    #[test]
    fn labels_name_what_is_known() {
        assert_eq!(rank_label("n", 3), "rank 3 on n");
        assert_eq!(rank_label("", -1), "the run's monitor");
        assert_eq!(timestamp(0), "1970-01-01T00:00:00Z");
    }
}
