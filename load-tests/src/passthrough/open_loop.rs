//! Open-loop load: requests leave at fixed intervals whether or not earlier ones have finished.
//!
//! A closed loop (send, wait, send) slows down together with the server and so hides exactly the
//! stalls a benchmark is looking for ("coordinated omission"). Here request `i` is *scheduled* for
//! `start + i / rate` and its latency is measured from when the generator let it go to the end of
//! the response body, plus whatever part of the time since its schedule the target kept the
//! generator waiting for one of the bounded in-flight slots ([`Holds`]): that wait counts against
//! the target that caused it.
//!
//! The generator's own lateness counts against no target. Tokio's timer fires on whole
//! milliseconds, so each send leaves a millisecond or so after its schedule, by an amount that
//! depends on where a slice's start fell between two ticks and stays the same for the whole slice
//! (periods are whole milliseconds); counted in, it shifted each slice's latencies by a different
//! fraction of a millisecond. And when the generator's thread wakes late past the next send's
//! schedule too, that send goes at once: tokio rounds a deadline up to a whole millisecond and
//! parks a full one for a deadline that has passed but not its millisecond, so sleeping for it and
//! counting from the schedule put about 1.1 ms of the generator's wait into one request of each
//! such pair, for every target alike (before 2ed90c4). On the generator's single thread, its
//! handling of the answers counts as its own lateness too: a target that keeps it busier is not
//! charged for that.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use hdrhistogram::Histogram;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// Highest latency the histograms can hold: anything slower is recorded as this.
const MAX_TRACKABLE_MICROS: u64 = 3_600_000_000;
/// Lead time before the first scheduled send, so setting up the slice does not count.
const START_LEAD: Duration = Duration::from_millis(5);

/// Why a request did not count as a success.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RequestError {
    /// The target answered with this non-2xx status.
    Status(u16),
    /// Connecting, sending or reading failed.
    Transport,
    /// No complete response within the request timeout.
    Timeout,
}

/// A finished request: its place in the slice's schedule, when its latency started
/// ([`Holds::release`]), when its answer ended, and how it went.
type Outcome = (u64, Instant, Instant, Result<(), RequestError>);

/// One fixed-rate slice of load.
#[derive(Debug, Clone)]
pub(crate) struct OpenLoop {
    pub(crate) rate: u32,
    pub(crate) duration: Duration,
    pub(crate) max_in_flight: usize,
    pub(crate) request_timeout: Duration,
}

/// Latencies of successful requests and counts of failed ones, accumulated over slices.
#[derive(Debug, Clone)]
pub(crate) struct Measurements {
    /// Microseconds from the send's release by the timer to the end of the response body.
    pub(crate) latency_micros: Histogram<u64>,
    pub(crate) errors: ErrorCounts,
    /// Requests the schedule asked for (successes + errors, including dropped ones).
    pub(crate) scheduled: u64,
    /// Every successful request's latency with its place (which slice, which send of it), where
    /// kept ([`Measurements::keeping_samples`]).
    pub(crate) samples: Option<Vec<Sample>>,
    /// Slices run into these measurements so far.
    pub(crate) slices: u32,
}

/// One successful request: the slice it was sent in (counted from 0 per endpoint, rate and
/// target), its place in that slice's schedule, its latency, and when its latency started on the
/// system's monotonic clock (see [`monotonic_micros`]): its release by the generator, less any
/// time since its schedule that the target held the generator up (see [`Holds`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sample {
    pub(crate) slice: u32,
    pub(crate) sequence: u32,
    pub(crate) micros: u64,
    pub(crate) released_us: u64,
}

/// `at` on the system's monotonic clock (`CLOCK_MONOTONIC`) in microseconds: the clock a
/// machine-wide record of the scheduler is stamped with by `perf record -k mono`, so a slow
/// request can be looked up in it (`load-tests/perf/stalls.py --samples`). 0 where the clock
/// cannot be read.
pub(crate) fn monotonic_micros(at: Instant) -> u64 {
    static ANCHOR: std::sync::OnceLock<Option<(std::time::Instant, Duration)>> =
        std::sync::OnceLock::new();
    let anchor = ANCHOR.get_or_init(|| {
        let now = std::time::Instant::now();
        let clock = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).ok()?;
        Some((now, Duration::from(clock)))
    });
    let Some((anchor, clock)) = *anchor else {
        return 0;
    };
    let at = at.into_std();
    let at = match at.checked_duration_since(anchor) {
        Some(after) => clock + after,
        None => clock.saturating_sub(anchor.duration_since(at)),
    };
    u64::try_from(at.as_micros()).unwrap_or(u64::MAX)
}

/// Failed requests by cause.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ErrorCounts {
    pub(crate) by_status: BTreeMap<u16, u64>,
    pub(crate) transport: u64,
    pub(crate) timeout: u64,
    /// Scheduled requests never sent: all in-flight slots stayed busy past the slice's deadline.
    pub(crate) dropped: u64,
}

// === impl OpenLoop ===

impl OpenLoop {
    /// Number of requests this slice schedules: `rate × duration`, rounded, at least one.
    pub(crate) fn request_count(&self) -> u64 {
        ((self.duration.as_secs_f64() * f64::from(self.rate)).round() as u64).max(1)
    }

    /// Runs the slice: calls `request(sequence)` for each scheduled send and records the outcome
    /// into `into`. Returns when every sent request has finished or timed out, so consecutive
    /// slices against different targets never overlap.
    ///
    /// Bounded in count (`request_count`) and time: sends stop at `duration + request_timeout`
    /// after the start, and each request is cut off after `request_timeout`.
    pub(crate) async fn run<F, Fut>(&self, mut request: F, into: &mut Measurements)
    where
        F: FnMut(u64) -> Fut,
        Fut: Future<Output = Result<(), RequestError>> + Send + 'static,
    {
        let count = self.request_count();
        let period = Duration::from_secs_f64(1.0 / f64::from(self.rate));
        let start = Instant::now() + START_LEAD;
        let send_deadline = start + self.duration + self.request_timeout;
        let slots = Arc::new(Semaphore::new(self.max_in_flight));
        let mut in_flight = JoinSet::new();
        into.scheduled += count;
        let slice = into.slices;
        into.slices += 1;
        // Room for the whole slice before it starts: no copying while requests are timed.
        if let Some(samples) = &mut into.samples {
            samples.reserve(usize::try_from(count).unwrap_or(0));
        }

        let mut holds = Holds::default();
        for sequence in 0..count {
            // Computed from `start`, not from the previous send: timer lateness never accumulates.
            let scheduled = start + period.mul_f64(sequence as f64);
            // A send already late does not wait for the timer: tokio rounds a deadline up to a
            // whole millisecond and parks a full one for a deadline that has passed but not its
            // millisecond (about 1.1 ms measured).
            if Instant::now() < scheduled {
                tokio::time::sleep_until(scheduled).await;
            }
            let released = holds.release(scheduled, Instant::now());
            let waits = slots.available_permits() == 0;
            let waited_from = Instant::now();
            let slot =
                match tokio::time::timeout_at(send_deadline, slots.clone().acquire_owned()).await {
                    Ok(Ok(slot)) => slot,
                    _ => {
                        into.errors.dropped += count - sequence;
                        break;
                    }
                };
            if waits {
                holds.waited(waited_from, Instant::now());
            }
            let response = request(sequence);
            let timeout = self.request_timeout;
            in_flight.spawn(async move {
                let outcome = match tokio::time::timeout(timeout, response).await {
                    Ok(outcome) => outcome,
                    Err(_) => Err(RequestError::Timeout),
                };
                drop(slot);
                (sequence, released, Instant::now(), outcome)
            });
            while let Some(done) = in_flight.try_join_next() {
                into.record(slice, done);
            }
        }
        while let Some(done) = in_flight.join_next().await {
            into.record(slice, done);
        }
    }
}

/// The stretches in which the target kept the generator waiting for a slot, and where each
/// send's latency starts: when the generator let it go, less the time since its schedule that the
/// generator spent held by the target. So a wait for a slot counts against the target that caused
/// it, for every send whose schedule passed during it, and any other lateness is the generator's
/// own (its timer firing on whole milliseconds, its thread descheduled, its handling of other
/// answers) and counts against no target.
#[derive(Debug, Default)]
struct Holds {
    /// Waits not yet entirely before the latest send's schedule, oldest first.
    waits: std::collections::VecDeque<(Instant, Instant)>,
}

impl Holds {
    /// The generator waited for a slot from `from` to `until`.
    fn waited(&mut self, from: Instant, until: Instant) {
        self.waits.push_back((from, until));
    }

    /// Where the latency of a send scheduled for `scheduled` and let go at `ready` starts.
    fn release(&mut self, scheduled: Instant, ready: Instant) -> Instant {
        // Schedules only grow: a wait over before this one is over before every later one.
        while self
            .waits
            .front()
            .is_some_and(|&(_, until)| until <= scheduled)
        {
            self.waits.pop_front();
        }
        let held: Duration = self
            .waits
            .iter()
            .map(|&(from, until)| {
                until
                    .min(ready)
                    .saturating_duration_since(from.max(scheduled))
            })
            .sum();
        ready - held
    }
}

// === impl Measurements ===

impl Measurements {
    pub(crate) fn new() -> Measurements {
        Measurements {
            latency_micros: Histogram::new_with_bounds(1, MAX_TRACKABLE_MICROS, 3)
                .expect("valid histogram bounds"),
            errors: ErrorCounts::default(),
            scheduled: 0,
            samples: None,
            slices: 0,
        }
    }

    /// As [`Measurements::new`], keeping every successful request as a [`Sample`] too.
    pub(crate) fn keeping_samples() -> Measurements {
        Measurements {
            samples: Some(Vec::new()),
            ..Measurements::new()
        }
    }

    /// Successful requests, i.e. the samples behind the percentiles.
    pub(crate) fn successes(&self) -> u64 {
        self.latency_micros.len()
    }

    /// Latency at `quantile` (0.0..=1.0) in microseconds; `None` without successes.
    pub(crate) fn quantile_micros(&self, quantile: f64) -> Option<u64> {
        (!self.latency_micros.is_empty()).then(|| self.latency_micros.value_at_quantile(quantile))
    }

    fn record(&mut self, slice: u32, done: Result<Outcome, tokio::task::JoinError>) {
        match done {
            Ok((sequence, released, finished, Ok(()))) => {
                let micros = finished.saturating_duration_since(released).as_micros();
                let micros = u64::try_from(micros).unwrap_or(u64::MAX).max(1);
                self.latency_micros.saturating_record(micros);
                if let Some(samples) = &mut self.samples {
                    samples.push(Sample {
                        slice,
                        sequence: u32::try_from(sequence).unwrap_or(u32::MAX),
                        micros,
                        released_us: monotonic_micros(released),
                    });
                }
            }
            Ok((.., Err(RequestError::Status(status)))) => {
                *self.errors.by_status.entry(status).or_default() += 1
            }
            Ok((.., Err(RequestError::Transport))) => self.errors.transport += 1,
            Ok((.., Err(RequestError::Timeout))) => self.errors.timeout += 1,
            // A panicking request task is a bug in this tool, but it must not stop the run.
            Err(_) => self.errors.transport += 1,
        }
    }
}

// === impl ErrorCounts ===

impl ErrorCounts {
    pub(crate) fn total(&self) -> u64 {
        self.by_status.values().sum::<u64>() + self.transport + self.timeout + self.dropped
    }

    /// `"503×4, timeout×1"`; empty when there were no errors.
    pub(crate) fn describe(&self) -> String {
        let mut parts: Vec<String> = self
            .by_status
            .iter()
            .map(|(status, n)| format!("HTTP {status}×{n}"))
            .collect();
        for (name, n) in [
            ("transport", self.transport),
            ("timeout", self.timeout),
            ("dropped", self.dropped),
        ] {
            if n > 0 {
                parts.push(format!("{name}×{n}"));
            }
        }
        parts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(rate: u32, millis: u64, max_in_flight: usize) -> OpenLoop {
        OpenLoop {
            rate,
            duration: Duration::from_millis(millis),
            max_in_flight,
            request_timeout: Duration::from_secs(10),
        }
    }

    #[test]
    fn a_release_is_stamped_on_the_monotonic_clock() {
        let clock = || {
            let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).unwrap();
            u64::try_from(Duration::from(now).as_micros()).unwrap()
        };
        let earlier = Instant::now();
        let before = clock();
        let stamped = monotonic_micros(Instant::now());
        let after = clock();
        // Read within a microsecond of each other; a millisecond is what a record is matched by.
        assert!(
            before <= stamped + 1_000 && stamped <= after + 1_000,
            "{before} {stamped} {after}"
        );
        assert!(monotonic_micros(earlier) <= stamped);
    }

    #[tokio::test(start_paused = true)]
    async fn a_slice_sends_rate_times_duration_requests() {
        let mut measured = Measurements::new();
        slice(50, 2_000, 8)
            .run(|_| async { Ok(()) }, &mut measured)
            .await;
        assert_eq!(measured.scheduled, 100);
        assert_eq!(measured.successes(), 100);
        assert_eq!(measured.errors.total(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn each_sample_keeps_its_slice_and_its_place_in_it() {
        let mut measured = Measurements::keeping_samples();
        // The second request of each slice fails: it has no sample, and the others keep theirs.
        let request = |sequence| async move {
            tokio::time::sleep(Duration::from_millis(3 * (sequence + 1))).await;
            match sequence {
                1 => Err(RequestError::Status(503)),
                _ => Ok(()),
            }
        };
        slice(10, 300, 8).run(request, &mut measured).await;
        slice(10, 200, 8).run(request, &mut measured).await;
        let mut places: Vec<(u32, u32, u64)> = measured
            .samples
            .as_deref()
            .unwrap_or_default()
            .iter()
            .map(|s| (s.slice, s.sequence, s.micros / 1_000))
            .collect();
        places.sort();
        assert_eq!(places, [(0, 0, 3), (0, 2, 9), (1, 0, 3)]);
        assert_eq!(measured.slices, 2);
        assert_eq!(measured.successes(), 3);
        // Not kept unless asked for.
        let mut plain = Measurements::new();
        slice(10, 200, 8).run(request, &mut plain).await;
        assert_eq!(plain.successes(), 1);
        assert!(plain.samples.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn time_waiting_for_a_slot_counts_against_the_target() {
        // 10 requests/s for 1 s, each taking 200 ms, one slot: request i is scheduled at i·100 ms
        // but can only start at i·200 ms, so it completes (i+1)·200 ms after the start.
        let mut measured = Measurements::new();
        let service = || async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            Ok(())
        };
        slice(10, 1_000, 1).run(|_| service(), &mut measured).await;
        assert_eq!(measured.successes(), 10);
        let max_ms = measured.latency_micros.max() / 1_000;
        assert!(
            (1_095..=1_110).contains(&max_ms),
            "the last request waited 900 ms for its slot: {max_ms} ms"
        );
        let min_ms = measured.latency_micros.min() / 1_000;
        assert!(
            (195..=210).contains(&min_ms),
            "the first request only took its service time: {min_ms} ms"
        );
    }

    #[test]
    fn only_the_time_the_target_held_a_send_counts_before_its_release() {
        let t = Instant::now();
        let ms = Duration::from_millis;
        let mut holds = Holds::default();
        // The generator itself late (its timer, its thread): from when it let the send go.
        assert_eq!(holds.release(t, t + ms(2)), t + ms(2));
        // Held for a slot from 1 ms before this send's schedule to 3 ms after it, then let go
        // 1 ms later still by the generator's own doing: the 3 ms count, the last one does not.
        holds.waited(t + ms(9), t + ms(13));
        assert_eq!(holds.release(t + ms(10), t + ms(14)), t + ms(11));
        // The next send, due during the same wait and then held again for 2 ms: both parts count.
        holds.waited(t + ms(14), t + ms(16));
        assert_eq!(holds.release(t + ms(12), t + ms(17)), t + ms(14));
        // Due after every wait ended: its lateness is the generator's own.
        assert_eq!(holds.release(t + ms(16), t + ms(18)), t + ms(18));
        assert!(holds.waits.is_empty(), "waits over are forgotten");
        // On time: from its release.
        assert_eq!(holds.release(t + ms(20), t + ms(20)), t + ms(20));
    }

    #[tokio::test(start_paused = true)]
    async fn sends_stop_at_the_deadline_and_the_rest_count_as_dropped() {
        let mut measured = Measurements::new();
        let mut loop_ = slice(10, 1_000, 1);
        loop_.request_timeout = Duration::from_millis(500);
        // Every request hangs until the timeout: one slot frees every 500 ms, while the deadline is
        // 1.5 s after the start, so only a few requests are ever sent.
        loop_.run(|_| std::future::pending(), &mut measured).await;
        assert_eq!(measured.scheduled, 10);
        assert_eq!(measured.successes(), 0);
        assert!(measured.errors.timeout >= 2, "{:?}", measured.errors);
        assert!(measured.errors.dropped >= 5, "{:?}", measured.errors);
        assert_eq!(measured.errors.timeout + measured.errors.dropped, 10);
    }

    #[tokio::test(start_paused = true)]
    async fn errors_are_counted_by_cause() {
        let mut measured = Measurements::new();
        slice(4, 1_000, 4)
            .run(
                |i| async move {
                    match i {
                        0 => Err(RequestError::Status(503)),
                        1 => Err(RequestError::Transport),
                        _ => Ok(()),
                    }
                },
                &mut measured,
            )
            .await;
        assert_eq!(measured.successes(), 2);
        assert_eq!(measured.errors.total(), 2);
        assert_eq!(measured.errors.describe(), "HTTP 503×1, transport×1");
    }
}
