//! Exponential backoff with jitter for retries while MLflow is unreachable.

use std::time::Duration;

/// Doubles from `initial` up to `max`; each delay is drawn from its upper half ("equal
/// jitter"), so collectors that lost MLflow together do not come back in lockstep.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    attempt: u32,
    rng: u64,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration, seed: u64) -> Self {
        Backoff {
            initial,
            max: max.max(initial),
            attempt: 0,
            rng: seed | 1,
        }
    }

    /// A seed that differs between processes and runs.
    pub fn seed() -> u64 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        nanos ^ (u64::from(std::process::id()) << 32)
    }

    /// The ceiling for the next delay, before jitter.
    pub fn ceiling(&self) -> Duration {
        let factor = 1u32 << self.attempt.min(20);
        self.initial.saturating_mul(factor).min(self.max)
    }

    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self.ceiling();
        self.attempt = self.attempt.saturating_add(1);
        let half = ceiling / 2;
        let jitter = half.mul_f64(self.unit());
        half + jitter
    }

    /// After a success the next outage starts from `initial` again.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    /// xorshift64*: a uniform number in [0, 1).
    fn unit(&mut self) -> f64 {
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_double_up_to_the_cap_and_stay_in_the_upper_half() {
        let mut backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30), 42);
        let mut ceilings = Vec::new();
        for _ in 0..10 {
            let ceiling = backoff.ceiling();
            let delay = backoff.next_delay();
            assert!(
                delay >= ceiling / 2 && delay <= ceiling,
                "{delay:?} outside [{:?}, {ceiling:?}]",
                ceiling / 2
            );
            ceilings.push(ceiling.as_millis());
        }
        assert_eq!(
            ceilings,
            [500, 1000, 2000, 4000, 8000, 16000, 30000, 30000, 30000, 30000]
        );
        backoff.reset();
        assert_eq!(backoff.ceiling(), Duration::from_millis(500));
    }

    #[test]
    fn jitter_spreads_delays() {
        let mut a = Backoff::new(Duration::from_secs(8), Duration::from_secs(8), 1);
        let delays: std::collections::BTreeSet<_> = (0..20).map(|_| a.next_delay()).collect();
        assert!(delays.len() > 10, "{delays:?}");
    }
}
