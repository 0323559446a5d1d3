//! What a run's ranks used, kept bounded for its report: per (run, node, rank) and series, a
//! time series in buckets (count, sum, peak with its time, low) and, for the memory working set,
//! a histogram whose buckets are 2 % wide (a quantile read from it is within 1 % of the samples').
//!
//! Buckets start at `BASE_WIDTH_MS` wide, aligned to multiples of their width since the epoch, so
//! two replicas put a sample in the same bucket and a narrow bucket lies inside one wide one. A run
//! keeps at most `POINTS` buckets per series: the sweep merges a series that has more into buckets
//! twice, four times... as wide ([`width_for`]), however long the run lasts. The histogram has at
//! most one row per 2 % step of the values seen (about 500 from 1 MB to 16 TB).

use std::collections::BTreeMap;

/// The narrowest bucket: a second.
pub const BASE_WIDTH_MS: i64 = 1_000;
/// Buckets per series a run keeps (and a chart shows) at most.
pub const POINTS: i64 = 240;
/// Ratio of one histogram bucket's upper bound to its lower bound.
const GAMMA: f64 = 1.02;
/// Values below this (in the series' unit) share the lowest histogram bucket, values above the
/// highest: a histogram has at most about 1,400 buckets whatever a sender sends.
const HISTOGRAM_FLOOR: f64 = 0.01;
const HISTOGRAM_CEILING: f64 = 1e10;
/// Buckets one replica gathers for one (run, node, rank, series) between flushes at most; beyond,
/// they are merged into buckets twice as wide (samples stamped far apart cannot grow memory).
pub const MAX_GATHERED_BUCKETS: usize = 1_024;

/// A series the report keeps, by the scoped metric it is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Series {
    /// `container_memory_working_set_megabytes` (MB).
    Memory,
    /// `container_cpu_utilization_percentage` (% of the container's CPU limit).
    Cpu,
    /// `container_cpu_throttled_percentage` (% of CFS periods throttled).
    Throttled,
    /// `gpu_<i>_sm_active_percentage`, every GPU of the rank together.
    GpuSm,
    /// `gpu_<i>_utilization_percentage`, every GPU of the rank together.
    GpuUtil,
    /// `container_oom_kill_count`.
    OomKills,
    /// The run's own step (its metrics outside `system/`), kept under node `""`, rank -1.
    Step,
}

impl Series {
    pub const ALL: [Series; 7] = [
        Series::Memory,
        Series::Cpu,
        Series::Throttled,
        Series::GpuSm,
        Series::GpuUtil,
        Series::OomKills,
        Series::Step,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Series::Memory => "memory",
            Series::Cpu => "cpu",
            Series::Throttled => "throttled",
            Series::GpuSm => "gpu_sm",
            Series::GpuUtil => "gpu_util",
            Series::OomKills => "oom_kills",
            Series::Step => "step",
        }
    }

    pub fn parse(name: &str) -> Option<Series> {
        Series::ALL.into_iter().find(|s| s.name() == name)
    }

    /// The series a scoped system metric (its name without scope) feeds.
    pub fn of_metric(name: &str) -> Option<Series> {
        match name {
            "container_memory_working_set_megabytes" => Some(Series::Memory),
            "container_cpu_utilization_percentage" => Some(Series::Cpu),
            "container_cpu_throttled_percentage" => Some(Series::Throttled),
            "container_oom_kill_count" => Some(Series::OomKills),
            _ => {
                let rest = name.strip_prefix("gpu_")?;
                let (index, suffix) = rest.split_once('_')?;
                index.parse::<u32>().ok()?;
                match suffix {
                    "sm_active_percentage" => Some(Series::GpuSm),
                    "utilization_percentage" => Some(Series::GpuUtil),
                    _ => None,
                }
            }
        }
    }

    /// Whether the series keeps a histogram (its quantiles are reported).
    pub fn has_histogram(self) -> bool {
        self == Series::Memory
    }
}

/// One bucket of a series.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bucket {
    pub n: i64,
    pub total: f64,
    pub peak: f64,
    /// When the peak was measured (the sender's clock, unix ms).
    pub peak_ms: i64,
    pub low: f64,
}

impl Bucket {
    pub fn of(value: f64, at_ms: i64) -> Bucket {
        Bucket {
            n: 1,
            total: value,
            peak: value,
            peak_ms: at_ms,
            low: value,
        }
    }

    /// Adds `other`; of two equal peaks the earlier is kept.
    pub fn merge(&mut self, other: &Bucket) {
        self.n += other.n;
        self.total += other.total;
        if other.peak > self.peak || (other.peak == self.peak && other.peak_ms < self.peak_ms) {
            self.peak = other.peak;
            self.peak_ms = other.peak_ms;
        }
        self.low = self.low.min(other.low);
    }

    pub fn mean(&self) -> f64 {
        if self.n > 0 {
            self.total / self.n as f64
        } else {
            0.0
        }
    }
}

/// Where a sample at `at_ms` goes in a series of buckets `width_ms` wide.
pub fn bucket_start(at_ms: i64, width_ms: i64) -> i64 {
    at_ms.div_euclid(width_ms) * width_ms
}

/// The narrowest width (`BASE_WIDTH_MS` times a power of two) that covers `[first_ms, end_ms)` in
/// at most `POINTS` aligned buckets.
pub fn width_for(first_ms: i64, end_ms: i64) -> i64 {
    let mut width = BASE_WIDTH_MS;
    while width < i64::MAX / 4
        && bucket_start(end_ms.saturating_sub(1), width) - bucket_start(first_ms, width)
            >= POINTS * width
    {
        width *= 2;
    }
    width
}

/// The buckets of `rows` (`(start, width, bucket)`, of any widths) merged into buckets `width`
/// wide, by start.
pub fn rebucket(
    rows: impl IntoIterator<Item = (i64, i64, Bucket)>,
    width: i64,
) -> BTreeMap<i64, Bucket> {
    let mut merged: BTreeMap<i64, Bucket> = BTreeMap::new();
    for (start, _, bucket) in rows {
        merged
            .entry(bucket_start(start, width))
            .and_modify(|b| b.merge(&bucket))
            .or_insert(bucket);
    }
    merged
}

/// The histogram bucket of `value`: bucket `i` holds `(GAMMA^(i-1), GAMMA^i]`.
pub fn histogram_bucket(value: f64) -> i32 {
    let value = value.clamp(HISTOGRAM_FLOOR, HISTOGRAM_CEILING);
    (value.ln() / GAMMA.ln()).ceil() as i32
}

/// What bucket `i` stands for: the value within 1 % of every value in it.
pub fn histogram_value(bucket: i32) -> f64 {
    2.0 * GAMMA.powi(bucket) / (GAMMA + 1.0)
}

/// The `q` quantile (0..=1) of a histogram (`(bucket, count)` in any order), as the nearest rank.
pub fn quantile(histogram: &[(i32, i64)], q: f64) -> Option<f64> {
    let mut sorted: Vec<(i32, i64)> = histogram.iter().copied().filter(|&(_, n)| n > 0).collect();
    sorted.sort_unstable();
    let total: i64 = sorted.iter().map(|&(_, n)| n).sum();
    if total == 0 {
        return None;
    }
    let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as i64).max(1);
    let mut seen = 0;
    for (bucket, n) in sorted {
        seen += n;
        if seen >= rank {
            return Some(histogram_value(bucket));
        }
    }
    None
}

/// A run's series by (node, rank, series): their bucket width and buckets by start.
pub type RunSeries = BTreeMap<(String, i64, Series), (i64, BTreeMap<i64, Bucket>)>;

/// What one replica gathered for one (run, node, rank, series) since its last flush.
#[derive(Debug, Clone, PartialEq)]
pub struct Gathered {
    /// The buckets' width: `BASE_WIDTH_MS`, or wider once `MAX_GATHERED_BUCKETS` were reached.
    pub width_ms: i64,
    /// By bucket start.
    pub buckets: BTreeMap<i64, Bucket>,
    /// By histogram bucket (series with one).
    pub histogram: BTreeMap<i32, i64>,
}

impl Default for Gathered {
    fn default() -> Self {
        Gathered {
            width_ms: BASE_WIDTH_MS,
            buckets: BTreeMap::new(),
            histogram: BTreeMap::new(),
        }
    }
}

impl Gathered {
    pub fn add(&mut self, series: Series, at_ms: i64, value: f64) {
        let bucket = Bucket::of(value, at_ms);
        self.buckets
            .entry(bucket_start(at_ms, self.width_ms))
            .and_modify(|b| b.merge(&bucket))
            .or_insert(bucket);
        if series.has_histogram() {
            *self.histogram.entry(histogram_bucket(value)).or_default() += 1;
        }
        self.bound();
    }

    /// Adds what `other` gathered (a failed flush's, kept for the next).
    pub fn merge(&mut self, other: Gathered) {
        let width = self.width_ms.max(other.width_ms);
        let mine = std::mem::take(&mut self.buckets);
        self.buckets = rebucket(
            mine.into_iter().map(|(s, b)| (s, self.width_ms, b)).chain(
                other
                    .buckets
                    .into_iter()
                    .map(|(s, b)| (s, other.width_ms, b)),
            ),
            width,
        );
        self.width_ms = width;
        for (bucket, n) in other.histogram {
            *self.histogram.entry(bucket).or_default() += n;
        }
        self.bound();
    }

    /// Widens the buckets until at most `MAX_GATHERED_BUCKETS` remain.
    fn bound(&mut self) {
        while self.buckets.len() > MAX_GATHERED_BUCKETS && self.width_ms < i64::MAX / 4 {
            self.width_ms *= 2;
            let narrow = std::mem::take(&mut self.buckets);
            self.buckets = rebucket(narrow.into_iter().map(|(s, b)| (s, 0, b)), self.width_ms);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_metrics_feed_their_series_and_nothing_else_does() {
        assert_eq!(
            Series::of_metric("container_memory_working_set_megabytes"),
            Some(Series::Memory)
        );
        assert_eq!(
            Series::of_metric("gpu_3_sm_active_percentage"),
            Some(Series::GpuSm)
        );
        assert_eq!(
            Series::of_metric("gpu_0_utilization_percentage"),
            Some(Series::GpuUtil)
        );
        assert_eq!(Series::of_metric("gpu_x_utilization_percentage"), None);
        assert_eq!(Series::of_metric("gpu_0_memory_usage_megabytes"), None);
        assert_eq!(Series::of_metric("cpu_utilization_percentage"), None);
        for series in Series::ALL {
            assert_eq!(Series::parse(series.name()), Some(series));
        }
    }

    #[test]
    fn a_quantile_of_the_histogram_is_within_one_percent_of_the_samples() {
        // 1..=10000 MB: the nearest-rank p95 is 9500, the median 5000, the peak 10000.
        let mut gathered = Gathered::default();
        for v in 1..=10_000i32 {
            gathered.add(Series::Memory, i64::from(v), f64::from(v));
        }
        let histogram: Vec<(i32, i64)> = gathered.histogram.into_iter().collect();
        for (q, exact) in [(0.95, 9_500.0), (0.5, 5_000.0), (1.0, 10_000.0)] {
            let got = quantile(&histogram, q).unwrap();
            assert!((got - exact).abs() / exact <= 0.01, "{q}: {got} vs {exact}");
        }
        assert_eq!(quantile(&[], 0.95), None);
        // Whatever a sender sends, the histogram and the buckets gathered between flushes stay
        // bounded, and every sample is still counted.
        let mut wild = Gathered::default();
        for i in 0..100_000i64 {
            wild.add(
                Series::Memory,
                i * 86_400_000,
                10f64.powi((i % 600) as i32 - 300),
            );
        }
        assert!(wild.histogram.len() < 1_500, "{}", wild.histogram.len());
        assert!(
            wild.buckets.len() <= MAX_GATHERED_BUCKETS,
            "{}",
            wild.buckets.len()
        );
        assert_eq!(wild.buckets.values().map(|b| b.n).sum::<i64>(), 100_000);
        // Rows: one per 2 % step, about 470 for four orders of magnitude.
        assert!(histogram.len() < 480, "{}", histogram.len());
    }

    #[test]
    fn buckets_widen_to_keep_a_fixed_number_and_merge_without_losing_the_peak() {
        assert_eq!(width_for(0, 240_000), BASE_WIDTH_MS);
        assert_eq!(width_for(0, 240_001), 2 * BASE_WIDTH_MS);
        // Ten days at one sample every ten seconds: 240 buckets at most.
        let (first, end) = (1_700_000_000_000, 1_700_000_000_000 + 10 * 86_400_000);
        let width = width_for(first, end);
        let rows = (first..end).step_by(10_000).map(|at| {
            (
                bucket_start(at, BASE_WIDTH_MS),
                BASE_WIDTH_MS,
                Bucket::of(1.0, at),
            )
        });
        let mut merged = rebucket(rows, width);
        assert!(merged.len() as i64 <= POINTS, "{}", merged.len());
        assert_eq!(merged.values().map(|b| b.n).sum::<i64>(), 86_400);
        // A peak keeps its moment through merges.
        let at = first + 123_456_789;
        let peak = Bucket::of(9.0, at);
        merged
            .entry(bucket_start(at, width))
            .and_modify(|b| b.merge(&peak));
        let top = merged
            .values()
            .max_by(|a, b| a.peak.total_cmp(&b.peak))
            .unwrap();
        assert_eq!((top.peak, top.peak_ms), (9.0, at));
        assert_eq!(bucket_start(-1, 1_000), -1_000);
    }
}
