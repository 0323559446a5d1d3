//! The sender thread: posts payloads in order; retries what MLflow could not take yet (no
//! connection, 5xx, 408, 429) with backoff, logs what it refuses for good (other 4xx) once and
//! moves on. Nothing here can stop the sampling or the training process.

use std::collections::HashSet;
use std::sync::Arc;
use std::thread::{self, JoinHandle};

use super::{Backoff, Outbox, Payload};

/// Why a payload was not stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SendError {
    /// Worth retrying: no connection, a timeout, 5xx, 408 or 429.
    Unavailable(String),
    /// MLflow refused the payload itself (4xx): retrying cannot help.
    Rejected { status: u16, message: String },
}

/// Delivers one payload.
pub trait Transport: Send {
    fn send(&mut self, payload: &Payload) -> Result<(), SendError>;
}

/// What the sender did, for the log line at exit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SenderStats {
    pub sent: u64,
    pub rejected: u64,
    /// Still queued (or being retried) when the close deadline passed.
    pub unsent: u64,
    /// Dropped because the buffer was full.
    pub dropped: u64,
}

/// At most this many distinct refusals are logged at warn level; the rest at debug.
const DISTINCT_REFUSALS_LOGGED: usize = 32;

pub fn spawn_sender<T: Transport + 'static>(
    outbox: Arc<Outbox>,
    transport: T,
    backoff: Backoff,
) -> JoinHandle<SenderStats> {
    thread::Builder::new()
        .name("mlscope-sender".into())
        .spawn(move || run(&outbox, transport, backoff))
        .expect("spawning the sender thread")
}

fn run<T: Transport>(outbox: &Outbox, mut transport: T, mut backoff: Backoff) -> SenderStats {
    let mut stats = SenderStats::default();
    let mut refusals: HashSet<(u16, String)> = HashSet::new();
    let mut outage: Option<u64> = None;
    'payloads: while let Some(payload) = outbox.take() {
        loop {
            match transport.send(&payload) {
                Ok(()) => {
                    stats.sent += 1;
                    if let Some(failures) = outage.take() {
                        tracing::info!(
                            failed_attempts = failures,
                            queued = outbox.pending().saturating_sub(1),
                            "MLflow is reachable again; sending the buffered samples in order"
                        );
                    }
                    backoff.reset();
                    break;
                }
                Err(SendError::Rejected { status, message }) => {
                    stats.rejected += 1;
                    let first = refusals.len() < DISTINCT_REFUSALS_LOGGED
                        && refusals.insert((status, message.clone()));
                    if first {
                        tracing::warn!(status, message = %message, "MLflow refused a batch; it is skipped (this message is logged once)");
                    } else {
                        tracing::debug!(status, message = %message, "MLflow refused a batch");
                    }
                    break;
                }
                Err(SendError::Unavailable(reason)) => {
                    let failures = outage.get_or_insert(0);
                    *failures += 1;
                    if *failures == 1 {
                        tracing::warn!(reason = %reason, "MLflow is unreachable; sampling goes on and samples are buffered");
                    } else {
                        tracing::debug!(reason = %reason, attempt = *failures, "MLflow still unreachable");
                    }
                    if !outbox.pause(backoff.next_delay()) {
                        // Still in flight: counted as pending below.
                        break 'payloads;
                    }
                }
            }
        }
        outbox.done();
    }
    stats.unsent = outbox.pending() as u64;
    stats.dropped = outbox.dropped();
    stats
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::Sample;
    use std::collections::VecDeque;
    use std::sync::Mutex;
    use std::time::{Duration, Instant};

    /// Answers from a script, then succeeds; records the steps it was asked to send.
    struct Scripted {
        answers: VecDeque<Result<(), SendError>>,
        attempts: Arc<Mutex<Vec<i64>>>,
    }

    impl Transport for Scripted {
        fn send(&mut self, payload: &Payload) -> Result<(), SendError> {
            let Payload::Sample(sample) = payload else {
                return Ok(());
            };
            self.attempts.lock().unwrap().push(sample.step);
            self.answers.pop_front().unwrap_or(Ok(()))
        }
    }

    fn sample(step: i64) -> Payload {
        Payload::Sample(Sample {
            timestamp_ms: step,
            step,
            metrics: vec![(Arc::from("system/rank-0/x"), 1.0)],
        })
    }

    fn fast_backoff() -> Backoff {
        Backoff::new(Duration::from_millis(1), Duration::from_millis(4), 7)
    }

    fn send_all(
        steps: i64,
        answers: Vec<Result<(), SendError>>,
        capacity: usize,
    ) -> (SenderStats, Vec<i64>) {
        let outbox = Arc::new(Outbox::new(capacity));
        for s in 0..steps {
            outbox.push(sample(s));
        }
        let attempts = Arc::new(Mutex::new(Vec::new()));
        let handle = spawn_sender(
            outbox.clone(),
            Scripted {
                answers: answers.into(),
                attempts: attempts.clone(),
            },
            fast_backoff(),
        );
        outbox.close(Instant::now() + Duration::from_secs(30));
        let stats = handle.join().unwrap();
        let attempts = attempts.lock().unwrap().clone();
        (stats, attempts)
    }

    #[test]
    fn unavailable_batches_are_retried_in_order_until_they_go_through() {
        let down = || Err(SendError::Unavailable("connection refused".into()));
        let (stats, attempts) = send_all(3, vec![Ok(()), down(), down(), down(), Ok(())], 10);
        assert_eq!(attempts, [0, 1, 1, 1, 1, 2]);
        assert_eq!(
            stats,
            SenderStats {
                sent: 3,
                rejected: 0,
                unsent: 0,
                dropped: 0
            }
        );
    }

    #[test]
    fn refused_batches_are_skipped_not_retried() {
        let refused = || {
            Err(SendError::Rejected {
                status: 400,
                message: "INVALID_PARAMETER_VALUE: bad".into(),
            })
        };
        let (stats, attempts) = send_all(3, vec![refused(), refused()], 10);
        assert_eq!(attempts, [0, 1, 2]);
        assert_eq!(
            stats,
            SenderStats {
                sent: 1,
                rejected: 2,
                unsent: 0,
                dropped: 0
            }
        );
    }

    #[test]
    fn closing_while_mlflow_is_down_gives_up_at_the_deadline_and_counts_what_is_left() {
        let outbox = Arc::new(Outbox::new(10));
        for s in 0..4 {
            outbox.push(sample(s));
        }
        let attempts = Arc::new(Mutex::new(Vec::new()));
        let never = (0..100_000)
            .map(|_| Err(SendError::Unavailable("down".into())))
            .collect();
        let handle = spawn_sender(
            outbox.clone(),
            Scripted {
                answers: never,
                attempts,
            },
            fast_backoff(),
        );
        let started = Instant::now();
        outbox.close(Instant::now() + Duration::from_millis(200));
        let stats = handle.join().unwrap();
        assert!(started.elapsed() < Duration::from_secs(10));
        assert_eq!(
            stats,
            SenderStats {
                sent: 0,
                rejected: 0,
                unsent: 4,
                dropped: 0
            }
        );
    }
}
