//! One GPU's idle clock, as the bill reads it: the collector's `gpu_<i>_idle_seconds` over a
//! window of its samples, merged across replicas and flushes in any order.

use crate::capabilities::health::store::GpuIdleRow;

/// One GPU's idle clock over a window of its samples: the clock at the first and the last sample
/// and the idle seconds between them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IdleWindow {
    pub first_ms: i64,
    pub first_idle: f64,
    pub last_ms: i64,
    pub last_idle: f64,
    pub idle_s: f64,
}

/// Idle seconds between two readings of one idle clock: its rise, or its new value when it fell
/// (a new idle stretch began after the first reading), never more than the time between them.
pub fn idle_increase(from_ms: i64, from_idle: f64, to_ms: i64, to_idle: f64) -> f64 {
    let gap = (to_ms.saturating_sub(from_ms)).max(0) as f64 / 1e3;
    let rise = if to_idle >= from_idle {
        to_idle - from_idle
    } else {
        to_idle
    };
    rise.clamp(0.0, gap)
}

impl IdleWindow {
    /// One reading: no idle time billed yet (what came before it is outside the span).
    pub fn new(at_ms: i64, idle: f64) -> Self {
        IdleWindow {
            first_ms: at_ms,
            first_idle: idle,
            last_ms: at_ms,
            last_idle: idle,
            idle_s: 0.0,
        }
    }

    /// Joins a window of the same GPU: one after this one or before it is bridged by the clock's
    /// increase across the gap; one that overlaps (samples split between replicas and flushed out
    /// of order) adds nothing, the bridge over it already counted that stretch. The store's merge
    /// (`Store::record_gpu_idle`) is the same rule in SQL.
    pub fn merge(&mut self, other: &IdleWindow) {
        if other.first_ms >= self.last_ms {
            self.idle_s += idle_increase(
                self.last_ms,
                self.last_idle,
                other.first_ms,
                other.first_idle,
            ) + other.idle_s;
            self.last_ms = other.last_ms;
            self.last_idle = other.last_idle;
        } else if other.last_ms <= self.first_ms {
            self.idle_s += other.idle_s
                + idle_increase(
                    other.last_ms,
                    other.last_idle,
                    self.first_ms,
                    self.first_idle,
                );
            self.first_ms = other.first_ms;
            self.first_idle = other.first_idle;
        }
    }

    /// Adds one reading.
    pub fn push(&mut self, at_ms: i64, idle: f64) {
        self.merge(&IdleWindow::new(at_ms, idle));
    }

    /// Idle seconds within `[from, to]`: the window's, less the idle time its clock places
    /// outside (the stretch the last reading reports, `last_idle` seconds up to `last_ms`,
    /// where it lies after `to` or before `from`), capped to the part of the window inside.
    /// An idle stretch outside that had ended before the last reading is not seen by the clock
    /// at the window's ends, and stays counted within that cap.
    pub(super) fn idle_within(&self, from: i64, to: i64) -> f64 {
        let seconds = |a: i64, b: i64| b.saturating_sub(a).max(0) as f64 / 1e3;
        let overlap = seconds(self.first_ms.max(from), self.last_ms.min(to));
        // Where the last reading's stretch began, within the window (ms, saturating).
        let stretch_ms = (self.last_idle * 1e3).min(i64::MAX as f64) as i64;
        let stretch_start = self.last_ms.saturating_sub(stretch_ms).max(self.first_ms);
        let after = seconds(to.max(stretch_start), self.last_ms);
        let before = seconds(stretch_start.max(self.first_ms), from.min(self.last_ms));
        (self.idle_s - after - before).clamp(0.0, overlap)
    }
}

impl GpuIdleRow {
    pub fn window(&self) -> IdleWindow {
        IdleWindow {
            first_ms: self.first_ms,
            first_idle: self.first_idle,
            last_ms: self.last_ms,
            last_idle: self.last_idle,
            idle_s: self.idle_s,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: i64 = 60_000;

    #[test]
    fn windows_from_two_replicas_merge_in_either_order_and_overlaps_add_nothing() {
        let whole: Vec<(i64, f64)> = (0..=6).map(|i| (i * MIN, (i * 60) as f64)).collect();
        let mut a = IdleWindow::new(whole[0].0, whole[0].1);
        for &(t, c) in &whole[1..3] {
            a.push(t, c);
        }
        let mut b = IdleWindow::new(whole[3].0, whole[3].1);
        for &(t, c) in &whole[4..] {
            b.push(t, c);
        }
        let (mut ab, mut ba) = (a, b);
        ab.merge(&b);
        ba.merge(&a);
        assert_eq!(ab, ba);
        assert_eq!(ab.idle_s, 360.0);
        // A late, overlapping window (one sample between the ends): nothing changes.
        let before = ab;
        ab.merge(&IdleWindow::new(150_000, 150.0));
        assert_eq!(ab, before);
    }

    #[test]
    fn a_clock_that_falls_starts_a_new_stretch_and_a_step_never_exceeds_its_gap() {
        // Idle 0..30 min (clock 1800 at 30), busy (0) at 40, idle again from 45 (clock 900 at
        // 60: the collector restarted, or the GPU worked between): 1800 + 0 + 900.
        let mut w = IdleWindow::new(0, 0.0);
        w.push(30 * MIN, 1800.0);
        w.push(40 * MIN, 0.0);
        w.push(60 * MIN, 900.0);
        assert_eq!(w.idle_s, 2700.0);
        // A clock that jumps by more than the time between the samples (a restarted collector's
        // clock from another source, a forged value): capped to the gap.
        let mut w = IdleWindow::new(0, 0.0);
        w.push(10 * MIN, 100_000.0);
        assert_eq!(w.idle_s, 600.0);
        // A clock that fell to a value larger than the gap: also capped.
        let mut w = IdleWindow::new(0, 5_000.0);
        w.push(MIN, 4_000.0);
        assert_eq!(w.idle_s, 60.0);
        assert_eq!(
            idle_increase(10, 5.0, 5, 9.0),
            0.0,
            "time going backwards bills nothing"
        );
    }
}
