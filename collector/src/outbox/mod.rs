//! Between sampling and the network: a bounded in-memory queue the sampling thread pushes to
//! without ever waiting on MLflow, and a sender thread that posts in order, retrying with
//! backoff while MLflow (or the proxy) is unreachable.

mod auth;
mod backoff;
mod mlflow;
mod runs;
mod sender;

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub use auth::Auth;
pub use backoff::Backoff;
pub use mlflow::{log_batch_body, log_inputs_body, HttpConfig, MlflowTransport};
pub use runs::{RunClient, RunInfo, RunLookup};
pub use sender::{spawn_sender, SendError, SenderStats, Transport};

use crate::sample::Sample;

/// What goes to MLflow, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Payload {
    Sample(Sample),
    /// Run tags (wrapper mode: how the rank ended).
    Tags(Vec<(String, String)>),
    /// A dataset input of the run (`runs/log-inputs`): a watched data path's fingerprint.
    Dataset(DatasetInput),
}

/// One dataset of MLflow's `runs/log-inputs`, with the `mlflow.data.context` input tag.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DatasetInput {
    pub name: String,
    /// At most 36 characters (MLflow's limit).
    pub digest: String,
    pub source_type: String,
    pub source: String,
    pub profile: Option<String>,
    pub context: String,
}

/// The queue. Holds at most `capacity` payloads, the one being sent included; when full, the
/// oldest sample is dropped and counted. Tags, datasets and a stopping agent's last payloads
/// are never dropped, so the bound is `capacity` plus those few.
#[derive(Debug)]
pub struct Outbox {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Debug)]
struct State {
    items: VecDeque<Payload>,
    in_flight: bool,
    capacity: usize,
    dropped: u64,
    /// Set by `close`: the sender stops at this instant, sent or not.
    deadline: Option<Instant>,
}

impl Outbox {
    pub fn new(capacity: usize) -> Self {
        Outbox {
            state: Mutex::new(State {
                items: VecDeque::new(),
                in_flight: false,
                capacity: capacity.max(2),
                dropped: 0,
                deadline: None,
            }),
            changed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a payload; never waits for the network. When the buffer is full, the oldest
    /// queued *sample* makes room: tags (the rank's placement) are few, sent once, and not
    /// measured again, so they are never dropped; a newer sample replaces an older one.
    pub fn push(&self, payload: Payload) {
        let mut state = self.lock();
        while state.items.len() + usize::from(state.in_flight) >= state.capacity {
            let Some(oldest) = state
                .items
                .iter()
                .position(|p| matches!(p, Payload::Sample(_)))
            else {
                break;
            };
            state.items.remove(oldest);
            state.dropped += 1;
            if state.dropped == 1 || state.dropped.is_power_of_two() {
                // Full means MLflow has not taken samples as fast as they were taken: it is
                // down, refusing with retryable answers, or slower than the interval.
                tracing::warn!(
                    capacity = state.capacity,
                    dropped = state.dropped,
                    "buffer full: MLflow has not accepted samples as fast as they are taken (unreachable, answering 429/5xx, or slow); dropping the oldest sample"
                );
            }
        }
        state.items.push_back(payload);
        drop(state);
        self.changed.notify_all();
    }

    /// Queues one of the last payloads of a stopping agent (its final sample, its outcome tags)
    /// without dropping anything to make room: what a rank says last matters most, and a stopping
    /// agent sends only a few such payloads, so the buffer exceeds its capacity by at most those.
    pub fn push_final(&self, payload: Payload) {
        self.lock().items.push_back(payload);
        self.changed.notify_all();
    }

    /// No more payloads will come; the sender sends what is queued until `deadline`.
    pub fn close(&self, deadline: Instant) {
        self.lock().deadline = Some(deadline);
        self.changed.notify_all();
    }

    /// Payloads dropped because the buffer was full.
    pub fn dropped(&self) -> u64 {
        self.lock().dropped
    }

    /// Payloads queued or being sent.
    pub fn pending(&self) -> usize {
        let state = self.lock();
        state.items.len() + usize::from(state.in_flight)
    }

    /// The next payload, waiting for one; `None` once closed and empty, or past the deadline.
    fn take(&self) -> Option<Payload> {
        let mut state = self.lock();
        loop {
            if state.deadline.is_some_and(|d| Instant::now() >= d) {
                return None;
            }
            if let Some(payload) = state.items.pop_front() {
                state.in_flight = true;
                return Some(payload);
            }
            match state.deadline {
                Some(_) => return None,
                None => state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner()),
            }
        }
    }

    /// The payload taken last was sent (or given up).
    fn done(&self) {
        self.lock().in_flight = false;
    }

    /// Waits `delay` before a retry, cut short by the close deadline; `false` when that passed.
    fn pause(&self, delay: Duration) -> bool {
        let until = Instant::now() + delay;
        let mut state = self.lock();
        loop {
            let now = Instant::now();
            let end = state.deadline.map_or(until, |d| d.min(until));
            if now >= end {
                return state.deadline.is_none_or(|d| now < d);
            }
            state = self
                .changed
                .wait_timeout(state, end - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn sample(step: i64) -> Payload {
        Payload::Sample(Sample {
            timestamp_ms: step,
            step,
            metrics: vec![(Arc::from("k"), 1.0)],
        })
    }

    fn step(payload: &Payload) -> i64 {
        match payload {
            Payload::Sample(s) => s.step,
            Payload::Tags(_) | Payload::Dataset(_) => -1,
        }
    }

    #[test]
    fn a_stopping_agents_last_payloads_are_never_dropped() {
        let outbox = Outbox::new(2);
        outbox.push(sample(0));
        outbox.push(sample(1));
        outbox.push_final(sample(2));
        outbox.push_final(Payload::Tags(vec![("outcome".into(), "exited".into())]));
        assert_eq!(outbox.dropped(), 0);
        assert_eq!(outbox.pending(), 4);
    }

    #[test]
    fn a_full_buffer_drops_the_oldest_and_counts_them() {
        let outbox = Outbox::new(3);
        for s in 0..5 {
            outbox.push(sample(s));
        }
        assert_eq!(outbox.dropped(), 2);
        outbox.close(Instant::now() + Duration::from_secs(1));
        let left: Vec<i64> = std::iter::from_fn(|| outbox.take().inspect(|_| outbox.done()))
            .map(|p| step(&p))
            .collect();
        assert_eq!(left, [2, 3, 4]);
    }

    #[test]
    fn tags_are_never_dropped_to_make_room_for_samples() {
        let placement = Payload::Tags(vec![("node".into(), "n1".into())]);
        let outbox = Outbox::new(2);
        outbox.push(placement.clone());
        for s in 0..4 {
            outbox.push(sample(s));
        }
        outbox.close(Instant::now() + Duration::from_secs(1));
        let left: Vec<Payload> =
            std::iter::from_fn(|| outbox.take().inspect(|_| outbox.done())).collect();
        assert_eq!(left, [placement, sample(3)]);
        assert_eq!(outbox.dropped(), 3);
    }

    #[test]
    fn the_payload_being_sent_counts_against_the_bound() {
        let outbox = Outbox::new(2);
        outbox.push(sample(0));
        let in_flight = outbox.take().unwrap();
        outbox.push(sample(1));
        outbox.push(sample(2));
        assert_eq!(
            (step(&in_flight), outbox.pending(), outbox.dropped()),
            (0, 2, 1)
        );
    }

    #[test]
    fn pause_ends_at_the_close_deadline() {
        let outbox = Outbox::new(2);
        outbox.close(Instant::now() + Duration::from_millis(50));
        let started = Instant::now();
        assert!(!outbox.pause(Duration::from_secs(30)));
        assert!(started.elapsed() < Duration::from_secs(10));
        assert!(outbox.take().is_none());
    }
}
