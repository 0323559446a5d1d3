//! The proxy's receive clock, injectable so failover is tested by moving time, not by sleeping.

use std::time::SystemTime;

pub trait Clock: Send + Sync {
    /// Milliseconds since the Unix epoch. Replicas sharing a store compare these, so their wall
    /// clocks must agree to well within the failover timeout (NTP does).
    fn now_ms(&self) -> i64;
}

#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        crate::plumbing::store::unix_millis(SystemTime::now())
    }
}

#[cfg(test)]
pub(crate) use manual::ManualClock;

#[cfg(test)]
mod manual {
    use std::sync::atomic::{AtomicI64, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use super::Clock;

    /// A clock that moves only when told to (tests).
    #[derive(Debug, Clone)]
    pub(crate) struct ManualClock(Arc<AtomicI64>);

    impl ManualClock {
        pub(crate) fn new(start_ms: i64) -> Self {
            Self(Arc::new(AtomicI64::new(start_ms)))
        }

        pub(crate) fn advance(&self, by: Duration) {
            self.0.fetch_add(by.as_millis() as i64, Ordering::SeqCst);
        }
    }

    impl Clock for ManualClock {
        fn now_ms(&self) -> i64 {
            self.0.load(Ordering::SeqCst)
        }
    }
}
