//! How many batches of one run go to MLflow at once: learned from MLflow's answers.
//!
//! MLflow's useful concurrency is its workers' (four by default, more behind a Service) and its
//! database's, and the proxy cannot see either. It watches what a batch costs instead: the time
//! MLflow took per unit of work, a unit being one element of the batch and a request costing
//! [`REQUEST_UNITS`] of them (MLflow spends most of a small batch on the request itself). The
//! cheapest cost seen recently is what a batch costs when MLflow has a worker free for it.
//! While batches cost little more than that, more of them may overlap (one more per `limit`
//! answers, as TCP grows its window); once they cost several times it, batches are waiting for
//! MLflow's workers rather than being served, and the limit shrinks by a quarter. A deadlock or
//! an error answer halves it. The limit stays between 1 and the configured most.

use std::time::Duration;

use tokio::time::Instant;

/// What one request costs MLflow, in elements (about 14 ms a request against 0.35 ms a sample).
const REQUEST_UNITS: f64 = 40.0;
/// A batch within this multiple of the cheapest recent cost was served without waiting.
const SERVED: f64 = 2.0;
/// A batch beyond this multiple waited for MLflow: fewer should overlap.
const QUEUED: f64 = 4.0;
/// The cheapest cost is the least of this window and the one before it, so that it follows
/// MLflow as its database grows and never forgets it all at once.
const WINDOW: Duration = Duration::from_secs(10);

#[derive(Debug)]
pub(super) struct Concurrency {
    limit: f64,
    most: f64,
    /// One batch at a time for good: MLflow deadlocks on overlapping writes to one run.
    pinned: bool,
    cheapest: Option<f64>,
    cheapest_before: Option<f64>,
    window_start: Option<Instant>,
}

impl Concurrency {
    /// Starts at `start` (at most `most`) batches of a run at once.
    pub(super) fn new(start: usize, most: usize) -> Self {
        Self {
            limit: start.clamp(1, most.max(1)) as f64,
            most: most.max(1) as f64,
            pinned: false,
            cheapest: None,
            cheapest_before: None,
            window_start: None,
        }
    }

    /// Batches of one run that may be at MLflow at once now.
    pub(super) fn limit(&self) -> usize {
        if self.pinned {
            1
        } else {
            self.limit.floor() as usize
        }
    }

    /// One batch at a time from now on; `false` when it already was.
    pub(super) fn pin_to_one(&mut self) -> bool {
        !std::mem::replace(&mut self.pinned, true)
    }

    /// A batch of `items` elements that MLflow stored in `took`.
    pub(super) fn stored(&mut self, items: usize, took: Duration, now: Instant) {
        let cost = took.as_secs_f64() / (items as f64 + REQUEST_UNITS);
        let start = *self.window_start.get_or_insert(now);
        if now.saturating_duration_since(start) >= WINDOW {
            self.cheapest_before = self.cheapest.take();
            self.window_start = Some(now);
        }
        self.cheapest = Some(self.cheapest.map_or(cost, |c| c.min(cost)));
        let floor = match (self.cheapest, self.cheapest_before) {
            (Some(a), Some(b)) => a.min(b),
            (Some(a), None) | (None, Some(a)) => a,
            (None, None) => return,
        };
        if cost <= floor * SERVED {
            self.limit = (self.limit + 1.0 / self.limit).min(self.most);
        } else if cost > floor * QUEUED {
            self.limit = (self.limit * 0.75).max(1.0);
        }
    }

    /// MLflow refused a batch or could not take it (a deadlock, an error, no answer).
    pub(super) fn failed(&mut self) {
        self.limit = (self.limit / 2.0).max(1.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_grows_while_batches_cost_what_they_cost_alone_and_shrinks_when_they_queue() {
        let now = Instant::now();
        let mut c = Concurrency::new(2, 8);
        let ms = Duration::from_millis;
        // 100-element batches served in 35 ms: one more at once per `limit` answers.
        for _ in 0..40 {
            c.stored(100, ms(35), now);
        }
        assert_eq!(c.limit(), 8, "grows to the most, never past it");
        // The same batches now take 6x as long: they wait for MLflow's workers.
        for _ in 0..3 {
            c.stored(100, ms(210), now);
        }
        assert!(c.limit() < 8 && c.limit() >= 3, "{c:?}");
        // A bigger batch costing the same per element is no sign of queueing.
        let before = c.limit;
        c.stored(1000, ms(35 * 1040 / 140), now);
        assert!(c.limit >= before);
        c.failed();
        assert!(c.limit() >= 1);
        assert!(c.pin_to_one());
        assert!(!c.pin_to_one());
        for _ in 0..40 {
            c.stored(100, ms(35), now);
        }
        assert_eq!(
            c.limit(),
            1,
            "a deadlocking MLflow gets one batch of a run at a time"
        );
    }

    #[test]
    fn the_cheapest_cost_follows_mlflow_across_windows() {
        let start = Instant::now();
        let mut c = Concurrency::new(4, 8);
        let ms = Duration::from_millis;
        c.stored(100, ms(10), start);
        // Two windows later MLflow is slower for good (a bigger database): the old cheapest
        // cost is forgotten and the limit stops shrinking.
        c.stored(100, ms(60), start + WINDOW);
        c.stored(100, ms(60), start + WINDOW * 2);
        let settled = c.limit;
        c.stored(100, ms(60), start + WINDOW * 2);
        assert!(c.limit >= settled);
    }
}
