//! A token bucket that may go into debt: a write is admitted while the bucket is not in debt and
//! charged what it turned out to weigh once it was answered (a log-batch's samples are known only
//! after its body was read), so one heavy write is let through and the next ones wait until the
//! bucket has paid for it.

use std::time::{Duration, Instant};

/// `rate` tokens a second, at most `burst` saved up.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Rate {
    pub(crate) per_second: f64,
    pub(crate) burst: f64,
}

impl Rate {
    /// `per_second` with bursts of `burst_seconds` worth (at least `min_burst`); `None` for 0.
    pub(crate) fn new(per_second: f64, burst_seconds: f64, min_burst: f64) -> Option<Rate> {
        (per_second > 0.0).then(|| Rate {
            per_second,
            burst: (per_second * burst_seconds).max(min_burst),
        })
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Bucket {
    tokens: f64,
    updated: Instant,
}

impl Bucket {
    pub(crate) fn full(rate: Rate, now: Instant) -> Bucket {
        Bucket {
            tokens: rate.burst,
            updated: now,
        }
    }

    fn refill(&mut self, rate: Rate, now: Instant) {
        let elapsed = now.saturating_duration_since(self.updated).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate.per_second).min(rate.burst);
        self.updated = now;
    }

    /// `Ok` when a write may go now (the bucket holds at least `need`, or is full); else how
    /// long until it will.
    pub(crate) fn check(&mut self, rate: Rate, need: f64, now: Instant) -> Result<(), Duration> {
        self.refill(rate, now);
        let need = need.min(rate.burst);
        if self.tokens >= need {
            Ok(())
        } else {
            Err(Duration::from_secs_f64(
                (need - self.tokens) / rate.per_second,
            ))
        }
    }

    /// Takes `amount`, into debt if need be.
    pub(crate) fn charge(&mut self, rate: Rate, amount: f64, now: Instant) {
        self.refill(rate, now);
        self.tokens -= amount;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heavy_write_is_let_through_and_paid_for_by_the_next_ones() {
        let rate = Rate::new(100.0, 2.0, 1.0).unwrap();
        let start = Instant::now();
        let mut bucket = Bucket::full(rate, start);
        assert!(bucket.check(rate, 1.0, start).is_ok());
        // A batch of 1,000 samples against a bucket of 200: admitted, then 800 in debt.
        bucket.charge(rate, 1000.0, start);
        let wait = bucket.check(rate, 1.0, start).unwrap_err();
        assert!((8.0..8.02).contains(&wait.as_secs_f64()), "{wait:?}");
        assert!(bucket
            .check(rate, 1.0, start + Duration::from_millis(8010))
            .is_ok());
        assert!(Rate::new(0.0, 2.0, 1.0).is_none());
    }
}
