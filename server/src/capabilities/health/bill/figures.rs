//! The GPU bill of a run: GPUs held × the time they were held, and how much of it they sat idle.
//! Pure: the store keeps the inputs (each rank's first and last sample, each GPU's idle window),
//! this computes the figures for the tags, the health view and the fleet counters.
//!
//! The definition (docs/run-health.md, "The GPU bill"):
//! - a rank is billed from its first to its last system sample, by the samples' own timestamps
//!   (the sender's clock, the one its idle clock runs on), clipped to the run's start and end
//!   where they are known; gaps between samples count as held (the GPUs stayed allocated), time
//!   after the last sample does not (a lost rank is billed to its last heartbeat);
//! - held GPU time = the GPUs the rank reports (highest `gpu_<i>_` index + 1, or its `gpu_count`
//!   tag, whichever is larger) × that span;
//! - idle GPU time, per GPU, = the increase of its idle clock (`gpu_<i>_idle_seconds`) over the
//!   span: from sample to sample the clock's rise, or, where it fell (the GPU worked, or the
//!   collector restarted), its new value; each step capped to the time between the two samples,
//!   and the GPU's total capped to the billed span. Idle time before the first sample is not
//!   billed, nor the stretch the last reading places after the clipped end or before the
//!   clipped start. A GPU without an idle clock (MLflow's own monitor) counts as busy.

use crate::capabilities::health::store::{GpuIdleRow, RankRow};

/// The run's start and end as MLflow has them, when known: the bill stays inside.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Clip {
    pub start_ms: Option<i64>,
    pub end_ms: Option<i64>,
}

impl Clip {
    /// The clip of a run that started at `start_ms` and ended at `end_ms` (both the client's
    /// word, through MLflow), as far as they can be true at `now_ms`: a time at or before the
    /// epoch is no time, an end is never later than now, and an end before the start is ignored
    /// (the ranks' samples bound the bill instead).
    pub fn new(start_ms: Option<i64>, end_ms: Option<i64>, now_ms: i64) -> Self {
        let start_ms = start_ms.filter(|&ms| ms > 0);
        let end_ms = end_ms
            .filter(|&ms| ms > 0)
            .map(|ms| ms.min(now_ms))
            .filter(|&ms| start_ms.is_none_or(|start| ms >= start));
        Clip { start_ms, end_ms }
    }
}

/// What one (node, rank) cost.
#[derive(Debug, Clone, PartialEq)]
pub struct RankBill {
    pub node: String,
    pub rank: i64,
    pub gpus: i64,
    /// The rank's GPU model (its `gpu_model` tag), `unknown` without one.
    pub model: String,
    /// Billed seconds: first to last sample, clipped.
    pub span_s: f64,
    pub gpu_seconds: f64,
    pub idle_seconds: f64,
    /// Idle seconds per GPU index, for GPUs with an idle clock.
    pub gpu_idle: Vec<(i64, f64)>,
}

/// What a run cost: the sum over its ranks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunBill {
    pub gpu_seconds: f64,
    pub idle_seconds: f64,
    pub ranks: Vec<RankBill>,
}

impl RunBill {
    pub fn gpu_hours(&self) -> f64 {
        self.gpu_seconds / 3600.0
    }

    pub fn idle_hours(&self) -> f64 {
        self.idle_seconds / 3600.0
    }

    /// Idle share of the held GPU time; 0 when nothing was held.
    pub fn idle_fraction(&self) -> f64 {
        if self.gpu_seconds > 0.0 {
            (self.idle_seconds / self.gpu_seconds).clamp(0.0, 1.0)
        } else {
            0.0
        }
    }

    /// Busy and idle GPU seconds per GPU model, for the fleet counters.
    pub fn by_model(&self) -> Vec<(String, f64, f64)> {
        let mut models: Vec<(String, f64, f64)> = Vec::new();
        for rank in &self.ranks {
            let busy = (rank.gpu_seconds - rank.idle_seconds).max(0.0);
            match models.iter_mut().find(|(m, _, _)| *m == rank.model) {
                Some(entry) => {
                    entry.1 += busy;
                    entry.2 += rank.idle_seconds;
                }
                None => models.push((rank.model.clone(), busy, rank.idle_seconds)),
            }
        }
        models
    }

    /// Per rank number (rows of one rank on several nodes summed): (rank, GPU seconds, idle
    /// seconds), ranks named by the sender only.
    pub fn per_rank(&self) -> Vec<(i64, f64, f64)> {
        let mut out: Vec<(i64, f64, f64)> = Vec::new();
        for r in self.ranks.iter().filter(|r| r.rank >= 0) {
            match out.iter_mut().find(|(rank, _, _)| *rank == r.rank) {
                Some(entry) => {
                    entry.1 += r.gpu_seconds;
                    entry.2 += r.idle_seconds;
                }
                None => out.push((r.rank, r.gpu_seconds, r.idle_seconds)),
            }
        }
        out.sort_by_key(|(rank, _, _)| *rank);
        out
    }
}

/// How long before the proxy first heard a rank its samples may begin to be billed: a collector
/// buffers up to an hour of samples by default (`--buffer`) while MLflow cannot be reached, and
/// sends them late; a sample older than this is not billed, whatever time it names.
pub(crate) const MAX_BACKFILL_MS: i64 = 6 * 3600 * 1000;
/// How far a sender's clock may run ahead of the proxy's: later samples are billed only to here.
pub(crate) const MAX_CLOCK_AHEAD_MS: i64 = 5 * 60 * 1000;

/// The bill of a run from its rank rows and its GPUs' idle windows, inside `clip`.
pub fn bill(ranks: &[RankRow], idle: &[GpuIdleRow], clip: Clip) -> RunBill {
    let mut run = RunBill::default();
    for r in ranks {
        let (Some(first), Some(last)) = (r.bill_first_ms, r.bill_last_ms) else {
            continue;
        };
        // The samples' times are the sender's word: the span stays within what the proxy itself
        // saw of the rank, from [`MAX_BACKFILL`] before it first heard it (a collector's buffer
        // sent late) to [`MAX_CLOCK_AHEAD`] after it last heard it.
        let first = first.max(r.first_heard_ms.saturating_sub(MAX_BACKFILL_MS));
        let last = last.min(r.last_heard_ms.saturating_add(MAX_CLOCK_AHEAD_MS));
        let from = clip.start_ms.map_or(first, |s| first.max(s));
        let to = clip.end_ms.map_or(last, |e| last.min(e));
        let span_s = to.saturating_sub(from).max(0) as f64 / 1e3;
        let gpus = r.gpus.max(0);
        let mut gpu_idle: Vec<(i64, f64)> = idle
            .iter()
            .filter(|g| g.node == r.node && g.rank == r.rank && g.gpu >= 0 && g.gpu < gpus)
            .map(|g| (g.gpu, g.window().idle_within(from, to).min(span_s)))
            .collect();
        gpu_idle.sort_by_key(|(gpu, _)| *gpu);
        gpu_idle.dedup_by_key(|(gpu, _)| *gpu);
        let idle_seconds: f64 = gpu_idle.iter().map(|(_, s)| s).sum();
        let gpu_seconds = gpus as f64 * span_s;
        run.gpu_seconds += gpu_seconds;
        run.idle_seconds += idle_seconds;
        run.ranks.push(RankBill {
            node: r.node.clone(),
            rank: r.rank,
            gpus,
            model: r.gpu_model.clone().unwrap_or_else(|| "unknown".to_owned()),
            span_s,
            gpu_seconds,
            idle_seconds,
            gpu_idle,
        });
    }
    run
}

/// Hours as a tag shows them.
pub fn hours(value: f64) -> String {
    format!("{value:.4}")
}

#[cfg(test)]
mod tests {
    use super::super::IdleWindow;
    use super::*;

    const MIN: i64 = 60_000;

    fn rank(rank: i64, gpus: i64, first: i64, last: i64) -> RankRow {
        RankRow {
            run_id: "r".into(),
            node: "n".into(),
            rank,
            gpus,
            bill_first_ms: Some(first),
            bill_last_ms: Some(last),
            // Heard as it sampled.
            first_heard_ms: first,
            last_heard_ms: last,
            gpu_model: Some("H200".into()),
            ..RankRow::default()
        }
    }

    #[test]
    fn sample_times_the_proxy_did_not_see_are_not_billed() {
        // A forged run: started at 1 ms after the epoch, one sample there, one now, 64 GPUs;
        // the proxy heard the rank for a minute. Billed: at most the backfill before it first
        // heard the rank (not 56 years of 64 GPUs).
        let now = 1_800_000_000_000;
        let mut forged = rank(0, 64, 1, now);
        forged.first_heard_ms = now - MIN;
        forged.last_heard_ms = now;
        let bill = bill(&[forged], &[], Clip::new(Some(1), None, now));
        assert_eq!(
            bill.gpu_seconds,
            64.0 * ((MAX_BACKFILL_MS + MIN) / 1000) as f64
        );
        // Samples from a sender's clock far ahead: billed to a little after the last heartbeat.
        let mut ahead = rank(0, 1, now - 10 * MIN, now + 1000 * 24 * 60 * MIN);
        ahead.first_heard_ms = now - 10 * MIN;
        ahead.last_heard_ms = now;
        let bill = super::bill(&[ahead], &[], Clip::default());
        assert_eq!(
            bill.gpu_seconds,
            ((10 * MIN + MAX_CLOCK_AHEAD_MS) / 1000) as f64
        );
    }

    fn idle_row(rank: i64, gpu: i64, samples: &[(i64, f64)]) -> GpuIdleRow {
        let mut window = IdleWindow::new(samples[0].0, samples[0].1);
        for &(at, idle) in &samples[1..] {
            window.push(at, idle);
        }
        GpuIdleRow {
            run_id: "r".into(),
            node: "n".into(),
            rank,
            gpu,
            first_ms: window.first_ms,
            first_idle: window.first_idle,
            last_ms: window.last_ms,
            last_idle: window.last_idle,
            idle_s: window.idle_s,
        }
    }

    #[test]
    fn held_time_is_gpus_times_first_to_last_sample_and_gaps_count_as_held() {
        // Samples at 0 and 120 min only (a two-hour gap in between): two hours held.
        let bill = bill(&[rank(0, 2, 0, 120 * MIN)], &[], Clip::default());
        assert_eq!(bill.gpu_seconds, 2.0 * 7200.0);
        assert_eq!(bill.idle_seconds, 0.0);
        assert_eq!(bill.gpu_hours(), 4.0);
        assert_eq!(bill.idle_fraction(), 0.0);
    }

    #[test]
    fn idle_is_the_clocks_increase_over_the_span_not_what_it_read_at_the_start() {
        // Idle for an hour already at the first sample, then idle throughout two hours.
        let samples: Vec<(i64, f64)> = (0..=12)
            .map(|i| (i * 10 * MIN, 3600.0 + (i * 600) as f64))
            .collect();
        let busy: Vec<(i64, f64)> = (0..=12).map(|i| (i * 10 * MIN, 0.0)).collect();
        let bill = bill(
            &[rank(0, 2, 0, 120 * MIN)],
            &[idle_row(0, 0, &busy), idle_row(0, 1, &samples)],
            Clip::default(),
        );
        assert_eq!(bill.idle_seconds, 7200.0);
        assert_eq!(bill.idle_fraction(), 0.5);
        assert_eq!(bill.ranks[0].gpu_idle, [(0, 0.0), (1, 7200.0)]);
    }

    #[test]
    fn an_idle_clock_larger_than_the_span_is_capped_to_the_span_and_to_the_clip() {
        // One sample only: no span, nothing billed, whatever the clock says.
        let b = bill(
            &[rank(0, 1, 0, 0)],
            &[idle_row(0, 0, &[(0, 99_999.0)])],
            Clip::default(),
        );
        assert_eq!((b.gpu_seconds, b.idle_seconds), (0.0, 0.0));
        // Idle throughout 60 min, the run ended (by its client) at 30 min: half of both.
        let samples: Vec<(i64, f64)> = (0..=6).map(|i| (i * 10 * MIN, (i * 600) as f64)).collect();
        let b = bill(
            &[rank(0, 1, 0, 60 * MIN)],
            &[idle_row(0, 0, &samples)],
            Clip {
                start_ms: Some(-MIN),
                end_ms: Some(30 * MIN),
            },
        );
        assert_eq!((b.gpu_seconds, b.idle_seconds), (1800.0, 1800.0));
        assert_eq!(b.idle_fraction(), 1.0);
        // Samples stamped long before the run started (a wrong clock): billed from the start.
        let b = bill(
            &[rank(0, 1, -600 * MIN, 60 * MIN)],
            &[],
            Clip {
                start_ms: Some(0),
                end_ms: None,
            },
        );
        assert_eq!(b.gpu_seconds, 3600.0);
    }

    #[test]
    fn an_end_at_or_before_the_epoch_before_the_start_or_in_the_future_never_inflates_the_bill() {
        let now = 1_000 * MIN;
        let ranks = [rank(0, 2, now - 60 * MIN, now)];
        let idle = [idle_row(0, 1, &[(now - 60 * MIN, 0.0), (now, 3600.0)])];
        let truth = (2.0 * 3600.0, 3600.0);
        for end in [i64::MIN, -1, 0, now - 120 * MIN, now + 1, i64::MAX] {
            let clip = Clip::new(Some(now - 60 * MIN), Some(end), now);
            let b = bill(&ranks, &idle, clip);
            assert_eq!(
                (b.gpu_seconds, b.idle_seconds),
                truth,
                "end {end}: {clip:?}"
            );
        }
        assert_eq!(
            Clip::new(Some(-5), Some(i64::MIN), now),
            Clip::default(),
            "no start, no end"
        );
        assert_eq!(Clip::new(None, Some(i64::MAX), now).end_ms, Some(now));
        // Unsanitised extremes: the arithmetic saturates, nothing wraps.
        let b = bill(
            &[rank(0, 1, i64::MIN, i64::MAX)],
            &[idle_row(0, 0, &[(i64::MIN, 0.0), (i64::MAX, f64::MAX)])],
            Clip {
                start_ms: Some(i64::MIN),
                end_ms: Some(i64::MAX),
            },
        );
        assert!(b.gpu_seconds.is_finite() && b.gpu_seconds > 0.0, "{b:?}");
        assert!(b.idle_seconds <= b.gpu_seconds, "{b:?}");
        let b = bill(
            &[rank(0, 1, 0, 60 * MIN)],
            &[],
            Clip {
                start_ms: Some(i64::MAX),
                end_ms: Some(i64::MIN),
            },
        );
        assert_eq!(b.gpu_seconds, 0.0);
    }

    #[test]
    fn idle_after_the_end_or_before_the_start_is_not_billed() {
        // Busy until the end at 60 min, then idle for 30 s of samples (every 10 s) while the
        // collector runs on until the bill is due: no idle time billed.
        let end = 60 * MIN;
        let mut samples: Vec<(i64, f64)> = (0..=6).map(|i| (i * 10 * MIN, 0.0)).collect();
        samples.extend((1..=3).map(|i| (end + i * 10_000, (i * 10) as f64)));
        let b = bill(
            &[rank(0, 1, 0, end + 30_000)],
            &[idle_row(0, 0, &samples)],
            Clip {
                start_ms: Some(0),
                end_ms: Some(end),
            },
        );
        assert_eq!((b.gpu_seconds, b.idle_seconds), (3600.0, 0.0));
        // Idle from 30 s before a later start_time and on until 60 min: only what follows the
        // start is billed, the whole span.
        let samples: Vec<(i64, f64)> = (0..=13)
            .map(|i| (-30_000 + i * 5 * MIN, 30.0 + (i * 300) as f64))
            .collect();
        let b = bill(
            &[rank(0, 1, -30_000, 65 * MIN - 30_000)],
            &[idle_row(0, 0, &samples)],
            Clip {
                start_ms: Some(0),
                end_ms: Some(end),
            },
        );
        assert_eq!((b.gpu_seconds, b.idle_seconds), (3600.0, 3600.0));
        // Idle for the last 10 minutes before the end and 5 after: 10 minutes.
        let samples = [
            (0, 0.0),
            (50 * MIN, 0.0),
            (60 * MIN, 600.0),
            (65 * MIN, 900.0),
        ];
        let b = bill(
            &[rank(0, 1, 0, 65 * MIN)],
            &[idle_row(0, 0, &samples)],
            Clip {
                start_ms: None,
                end_ms: Some(end),
            },
        );
        assert_eq!(b.idle_seconds, 600.0);
    }

    #[test]
    fn ranks_sum_per_model_and_per_rank_and_gpus_beyond_the_allocation_are_ignored() {
        let mut other = rank(1, 1, 0, 60 * MIN);
        other.gpu_model = None;
        let b = bill(
            &[rank(0, 2, 0, 60 * MIN), other],
            // GPU 5 of rank 0 is beyond its 2 GPUs: not billed.
            &[
                idle_row(0, 5, &[(0, 0.0), (60 * MIN, 3600.0)]),
                idle_row(1, 0, &[(0, 0.0), (60 * MIN, 3600.0)]),
            ],
            Clip::default(),
        );
        assert_eq!((b.gpu_seconds, b.idle_seconds), (3.0 * 3600.0, 3600.0));
        let mut models = b.by_model();
        models.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(
            models,
            [
                ("H200".to_owned(), 7200.0, 0.0),
                ("unknown".to_owned(), 0.0, 3600.0)
            ]
        );
        assert_eq!(b.per_rank(), [(0, 7200.0, 0.0), (1, 3600.0, 3600.0)]);
        assert_eq!(hours(b.idle_hours()), "1.0000");
    }
}
