//! Saturation control: how many writes MLflow takes at once before it queues them, learned from
//! its latency, and who gives way when that many are at MLflow.
//!
//! - **A write is at MLflow** from the moment its whole body has been handed on (what the client
//!   still uploads is not MLflow's work) until MLflow's answer; its **latency** is that span, so a
//!   client trickling its body is never taken for MLflow being slow.
//! - **The limit** starts at `INITIAL_LIMIT`. Its signal is the latency of light writes (at most
//!   `LIGHT_SAMPLES` samples, what a calm client or a training step sends): a heavy batch is slow by
//!   nature, a light write is slow when MLflow queues it. The limit halves only on evidence of
//!   saturation: a window (250 ms) in which light writes answered on average more than
//!   `SATURATED` times the baseline (the fastest window of the last five minutes) *and* at least
//!   `SATURATED_EXCESS` slower, while the writes at MLflow reached the limit. Ordinary
//!   concurrency (a few writes answered a few milliseconds later) is no such evidence. A window
//!   with the limit in use and latency short of that raises it by a twentieth, up to the ceiling.
//! - **Writers** are the clients with a write MLflow answered in the last `ACTIVE_FOR`;
//!   readers are not counted (the proxy never refuses a read, and a reader does not make a
//!   writer's share smaller). A writer's **load** is the larger of its writes at MLflow now and
//!   their average over about a second; its **weight** is the bytes it had MLflow take (recent
//!   answers, decaying over about two seconds, plus the writes at MLflow now).
//! - **A write is refused** only while the writes at MLflow are at the limit (or MLflow was
//!   saturated in the last `CONGESTED_FOR`), another writer is active, the writer's load is above its share (the limit divided among the writers) and its
//!   weight is more than `HEAVY` times the average of the *other* writers. So the only writer is
//!   never refused, nor writers writing alike, nor anyone while MLflow has room and answers in time; a slow answer makes
//!   a client's load high, never its weight, so a calm client kept waiting by a flood does not
//!   become the one refused.
//! - Writers are remembered in a map bounded by `MAX_CLIENTS` that forgets the least recently
//!   active first (an evicted writer's writes at MLflow still count in the total); a new client is
//!   always judged, however many there are.

use std::collections::VecDeque;
use std::hash::Hash;
use std::time::{Duration, Instant};

use crate::plumbing::aged::AgedMap;

/// How long one latency window lasts.
const WINDOW: Duration = Duration::from_millis(250);
/// How far back the baseline looks.
const BASELINE_SPAN: Duration = Duration::from_secs(300);
/// Windows with fewer answers than this do not set the baseline (one lucky answer is no baseline).
const BASELINE_MIN_ANSWERS: u32 = 3;
/// A window mean this many times the baseline, and `SATURATED_EXCESS` above it, with the limit
/// reached, means MLflow is queueing writes.
const SATURATED: f64 = 4.0;
const SATURATED_EXCESS: Duration = Duration::from_millis(100);
/// How long MLflow counts as saturated after a window that said so: the heavy writer over its
/// share gives way meanwhile even below the limit (one heavy batch admitted whenever the limit
/// has room keeps MLflow saturated).
const CONGESTED_FOR: Duration = Duration::from_secs(5);
/// A write of at most this many samples is light: its latency is the limit's signal.
const LIGHT_SAMPLES: usize = 10;
/// The limit never goes below one write at once.
const MIN_LIMIT: f64 = 1.0;
/// Where the limit starts.
const INITIAL_LIMIT: f64 = 8.0;
/// Time constant of a client's usage.
const USAGE_TAU: f64 = 1.0;
/// Time constant of a client's weight.
const WEIGHT_TAU: f64 = 2.0;
/// A client writing more than this many times the other writers' average weight may be refused.
const HEAVY: f64 = 2.0;
/// A client with a write answered this recently is a writer.
const ACTIVE_FOR: Duration = Duration::from_secs(2);
/// Writers remembered at once; beyond, the least recently active is forgotten.
pub(crate) const MAX_CLIENTS: usize = 10_000;
/// With more clients than this, the writers are counted (and weighed) at most every
/// `CENSUS_EVERY`, not on every write: a write costs a map lookup, not a walk over the map.
const EXACT_UP_TO: usize = 64;
const CENSUS_EVERY: Duration = Duration::from_millis(20);

/// What the governor decided for one write.
#[derive(Debug, PartialEq)]
pub(crate) enum Verdict {
    Admitted,
    /// The writes at MLflow are at the limit, another client writes, and this one takes more than
    /// its share and weighs more than twice the others.
    Heaviest {
        limit: usize,
        writers: usize,
    },
}

#[derive(Debug, Clone)]
struct ClientLoad {
    /// Writes at MLflow.
    holds: usize,
    usage: f64,
    updated: Instant,
    /// The last write MLflow answered.
    wrote: Option<Instant>,
    /// Bytes of answered writes, decaying with `WEIGHT_TAU` from `updated`.
    answered_bytes: f64,
    /// Bytes of the writes at MLflow.
    held_bytes: u64,
}

impl ClientLoad {
    fn new(now: Instant) -> ClientLoad {
        ClientLoad {
            holds: 0,
            usage: 0.0,
            updated: now,
            wrote: None,
            answered_bytes: 0.0,
            held_bytes: 0,
        }
    }

    fn weight_at(&self, now: Instant) -> f64 {
        let dt = now.saturating_duration_since(self.updated).as_secs_f64();
        self.answered_bytes * (-dt / WEIGHT_TAU).exp() + self.held_bytes as f64
    }

    /// Usage brought forward to `now` (the writes held since the last update counted).
    fn usage_at(&self, now: Instant) -> f64 {
        let dt = now.saturating_duration_since(self.updated).as_secs_f64();
        let keep = (-dt / USAGE_TAU).exp();
        self.usage * keep + self.holds as f64 * (1.0 - keep)
    }

    fn load_at(&self, now: Instant) -> f64 {
        self.usage_at(now).max(self.holds as f64)
    }

    fn advance(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.updated).as_secs_f64();
        self.usage = self.usage_at(now);
        self.answered_bytes *= (-dt / WEIGHT_TAU).exp();
        self.updated = now;
    }

    /// Whether this client is a writer now: MLflow answered one of its writes lately, and it
    /// weighs something (a write the proxy answered itself, or a body still trickling in, does not
    /// make a writer).
    fn writing(&self, now: Instant) -> bool {
        self.wrote
            .is_some_and(|at| now.saturating_duration_since(at) < ACTIVE_FOR)
            && self.weight_at(now) > 0.0
    }
}

#[derive(Debug)]
pub(crate) struct Governor<K> {
    max_limit: f64,
    limit: f64,
    /// Writes at MLflow (handed on whole, not yet answered), of every client.
    at_mlflow: usize,
    clients: AgedMap<K, ClientLoad>,
    window: Window,
    /// The last count of writers and their total weight, with more than `EXACT_UP_TO` clients.
    census: Option<(Instant, usize, f64)>,
    /// (window end, window mean in seconds), oldest first.
    means: VecDeque<(Instant, f64)>,
    /// Until when the last saturated window counts.
    congested_until: Option<Instant>,
}

#[derive(Debug)]
struct Window {
    started: Instant,
    answered: u32,
    latency_sum: f64,
    peak_at_mlflow: usize,
}

impl Window {
    fn new(now: Instant, at_mlflow: usize) -> Window {
        Window {
            started: now,
            answered: 0,
            latency_sum: 0.0,
            peak_at_mlflow: at_mlflow,
        }
    }
}

impl<K: Hash + Eq + Clone> Governor<K> {
    pub(crate) fn new(max_limit: usize, now: Instant) -> Governor<K> {
        let max_limit = (max_limit as f64).max(MIN_LIMIT);
        Governor {
            max_limit,
            limit: INITIAL_LIMIT.min(max_limit),
            at_mlflow: 0,
            clients: AgedMap::new(MAX_CLIENTS),
            window: Window::new(now, 0),
            census: None,
            means: VecDeque::new(),
            congested_until: None,
        }
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit as usize
    }

    pub(crate) fn at_mlflow(&self) -> usize {
        self.at_mlflow
    }

    /// The writers other than `client` and their total weight.
    fn others(&mut self, client: &K, now: Instant) -> (usize, f64) {
        if self.clients.len() <= EXACT_UP_TO {
            let (mut n, mut weight) = (0usize, 0.0f64);
            for (k, c) in self.clients.iter() {
                if k != client && c.writing(now) {
                    n += 1;
                    weight += c.weight_at(now);
                }
            }
            return (n, weight);
        }
        let stale = self
            .census
            .is_none_or(|(at, ..)| now.saturating_duration_since(at) >= CENSUS_EVERY);
        if stale {
            let (mut n, mut weight) = (0usize, 0.0f64);
            for c in self.clients.values().filter(|c| c.writing(now)) {
                n += 1;
                weight += c.weight_at(now);
            }
            self.census = Some((now, n, weight));
        }
        let (_, n, weight) = self.census.unwrap_or((now, 0, 0.0));
        // The census counted this client too, when it was writing.
        match self.clients.peek_mut(client).filter(|c| c.writing(now)) {
            Some(own) => (n.saturating_sub(1), (weight - own.weight_at(now)).max(0.0)),
            None => (n, weight),
        }
    }

    /// Whether a write of `client` may go to MLflow now; it counts once [`Governor::forwarded`].
    pub(crate) fn admit(&mut self, client: &K, now: Instant) -> Verdict {
        let congested = self.congested_until.is_some_and(|until| now < until);
        if (self.at_mlflow as f64) < self.limit && !congested {
            return Verdict::Admitted;
        }
        let (others, others_weight) = self.others(client, now);
        if others == 0 {
            return Verdict::Admitted;
        }
        let Some(own) = self.clients.peek_mut(client) else {
            return Verdict::Admitted;
        };
        let writers = others + 1;
        let (load, weight) = (own.load_at(now), own.weight_at(now));
        let average = others_weight / others as f64;
        if load > self.limit / writers as f64 && weight > HEAVY * average {
            return Verdict::Heaviest {
                limit: self.limit as usize,
                writers,
            };
        }
        Verdict::Admitted
    }

    /// An admitted write of `client` of `bytes` was handed on whole: it is at MLflow.
    pub(crate) fn forwarded(&mut self, client: &K, bytes: u64, now: Instant) {
        let own = self
            .clients
            .get_or_insert_with(client, || ClientLoad::new(now));
        own.advance(now);
        own.holds += 1;
        own.held_bytes = own.held_bytes.saturating_add(bytes);
        self.at_mlflow += 1;
        self.window.peak_at_mlflow = self.window.peak_at_mlflow.max(self.at_mlflow);
    }

    /// A write of `client` of `bytes` carrying `samples`, at MLflow since
    /// [`Governor::forwarded`], was answered by MLflow after `latency` (`None`: abandoned, or
    /// answered by someone else); a light write's latency is the limit's signal.
    /// `credit` is the client the answer counts for from now on (itself, or the identity MLflow
    /// authenticated with this answer).
    pub(crate) fn answered(
        &mut self,
        client: &K,
        credit: &K,
        bytes: u64,
        latency: Option<Duration>,
        samples: usize,
        now: Instant,
    ) {
        self.at_mlflow = self.at_mlflow.saturating_sub(1);
        let held = match self.clients.get_mut(client).filter(|c| c.holds > 0) {
            Some(c) => {
                c.advance(now);
                c.holds -= 1;
                c.held_bytes = c.held_bytes.saturating_sub(bytes);
                true
            }
            None => false,
        };
        // Only what MLflow answered weighs (a write the proxy answered itself, or abandoned,
        // took none of MLflow's time after its end).
        if held && latency.is_some() {
            let c = self
                .clients
                .get_or_insert_with(credit, || ClientLoad::new(now));
            c.advance(now);
            c.answered_bytes += bytes as f64;
            c.wrote = Some(now);
        }
        if now.saturating_duration_since(self.window.started) >= WINDOW {
            self.close_window(now);
        }
        if let Some(latency) = latency.filter(|_| samples <= LIGHT_SAMPLES) {
            self.window.answered += 1;
            self.window.latency_sum += latency.as_secs_f64();
        }
    }

    fn close_window(&mut self, now: Instant) {
        let window = std::mem::replace(&mut self.window, Window::new(now, self.at_mlflow));
        if window.answered == 0 {
            return;
        }
        let mean = window.latency_sum / f64::from(window.answered);
        while self
            .means
            .front()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) > BASELINE_SPAN)
        {
            self.means.pop_front();
        }
        if window.answered >= BASELINE_MIN_ANSWERS || self.means.is_empty() {
            self.means.push_back((now, mean));
        }
        let baseline = self
            .means
            .iter()
            .map(|(_, m)| *m)
            .fold(f64::INFINITY, f64::min);
        let at_limit = window.peak_at_mlflow as f64 >= self.limit;
        let in_use = window.peak_at_mlflow as f64 >= (self.limit * 0.75).min(self.limit - 0.5);
        let saturated =
            mean > SATURATED * baseline && mean - baseline > SATURATED_EXCESS.as_secs_f64();
        if saturated {
            self.congested_until = Some(now + CONGESTED_FOR);
            if at_limit {
                self.limit = (self.limit / 2.0).max(MIN_LIMIT);
            }
        } else if in_use {
            self.limit = (self.limit + (self.limit * 0.05).max(0.1)).min(self.max_limit);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Runs `windows` windows in which `in_flight` writes of one client are at MLflow, each
    /// answered after `latency`.
    fn load(
        g: &mut Governor<&'static str>,
        now: &mut Instant,
        windows: u32,
        in_flight: usize,
        latency: Duration,
    ) {
        for _ in 0..windows {
            for _ in 0..in_flight {
                assert_eq!(g.admit(&"job", *now), Verdict::Admitted);
                g.forwarded(&"job", 100, *now);
            }
            for _ in 0..in_flight {
                g.answered(&"job", &"job", 100, Some(latency), 1, *now + WINDOW - MS);
            }
            *now += WINDOW;
            // Only the window closes (an abandoned write).
            g.forwarded(&"job", 0, *now);
            g.answered(&"job", &"job", 0, None, 1, *now);
        }
    }

    #[test]
    fn the_limit_grows_while_latency_holds_and_halves_only_when_mlflow_queues() {
        let mut now = Instant::now();
        let mut g = Governor::new(64, now);
        assert_eq!(g.limit(), 8);
        // Writes at the limit, answered as fast as ever: the limit grows to its ceiling.
        for _ in 0..120 {
            let limit = g.limit().max(1);
            load(&mut g, &mut now, 1, limit, 20 * MS);
        }
        assert_eq!(g.limit(), 64);
        // Ordinary concurrency: answers three times slower than the fastest (20 ms to 60 ms) at
        // the limit is no saturation; the limit holds.
        load(&mut g, &mut now, 10, 64, 60 * MS);
        assert_eq!(g.limit(), 64);
        // MLflow answers ten times slower while the limit is reached: halved per window, down to
        // one.
        load(&mut g, &mut now, 1, 64, 200 * MS);
        assert_eq!(g.limit(), 32);
        load(&mut g, &mut now, 10, 32, 200 * MS);
        assert_eq!(g.limit(), 1);
        // Slow answers with the limit not reached (mixed batch sizes, not queueing) do not shrink
        // it.
        let mut g = Governor::new(64, now);
        load(&mut g, &mut now, 1, 8, 20 * MS);
        load(&mut g, &mut now, 5, 1, 500 * MS);
        assert!(g.limit() >= 8, "{}", g.limit());
    }

    #[test]
    fn a_jobs_first_write_under_its_address_is_credited_to_its_credential_and_no_other_writer() {
        // The job's first write went out while its credential was charged to its address; MLflow
        // authenticated the credential with its answer. Then the job's ranks burst past the limit:
        // its address is no other writer beside it, so nothing is refused.
        let start = Instant::now();
        let mut g = Governor::new(4, start);
        g.forwarded(&"address", 200, start);
        g.answered(&"address", &"job", 200, Some(5 * MS), 1, start);
        for _ in 0..16 {
            assert_eq!(g.admit(&"job", start), Verdict::Admitted);
            g.forwarded(&"job", 2000, start);
        }
    }

    #[test]
    fn at_the_limit_the_heaviest_writer_over_its_share_is_refused_and_light_ones_are_not() {
        let start = Instant::now();
        let mut g = Governor::new(4, start);
        assert_eq!(g.limit(), 4);
        // Alone, a client is never refused: it competes with nobody.
        for _ in 0..10 {
            assert_eq!(g.admit(&"flood", start), Verdict::Admitted);
            g.forwarded(&"flood", 8000, start);
        }
        // A calm writer appears: the flood (10 at MLflow, its share 4 / 2) is refused, the calm
        // one is not.
        g.forwarded(&"calm", 150, start);
        g.answered(&"calm", &"calm", 150, Some(5 * MS), 1, start);
        g.forwarded(&"calm", 150, start);
        assert_eq!(
            g.admit(&"flood", start),
            Verdict::Heaviest {
                limit: 4,
                writers: 2
            }
        );
        assert_eq!(g.admit(&"calm", start), Verdict::Admitted);
        // The flood's writes are answered: with none at MLflow (below the limit) it is admitted.
        let later = start + Duration::from_millis(500);
        for _ in 0..10 {
            g.answered(&"flood", &"flood", 8000, Some(500 * MS), 100, later);
        }
        assert_eq!(g.admit(&"flood", later), Verdict::Admitted);
        // Readers are nobody to the governor: a lone writer at the limit is never refused.
        let mut g = Governor::new(2, start);
        for _ in 0..5 {
            assert_eq!(g.admit(&"job", start), Verdict::Admitted);
            g.forwarded(&"job", 8000, start);
        }
        assert_eq!(g.admit(&"job", start), Verdict::Admitted);
    }

    #[test]
    fn with_many_clients_the_census_still_finds_the_heavy_one() {
        let start = Instant::now();
        let mut g = Governor::new(8, start);
        for i in 0..200u32 {
            let calm = format!("calm-{i}");
            g.forwarded(&calm, 150, start);
            g.answered(&calm, &calm, 150, Some(5 * MS), 1, start);
        }
        for _ in 0..8 {
            g.forwarded(&"flood".to_owned(), 8000, start);
        }
        assert!(matches!(
            g.admit(&"flood".to_owned(), start),
            Verdict::Heaviest { writers: 201, .. }
        ));
        assert_eq!(g.admit(&"calm-7".to_owned(), start), Verdict::Admitted);
    }

    #[test]
    fn a_lone_training_job_beside_tricklers_and_slow_answers_is_never_refused() {
        // Finding 2: one job of 8 ranks writing light metrics, MLflow answering a few milliseconds
        // slower whenever several are at once. The old governor halved the limit to 1 and refused
        // the job while readers were about.
        let start = Instant::now();
        let mut g = Governor::new(64, start);
        for tick in 0..2000u32 {
            let now = start + 10 * MS * tick;
            let ranks = 1 + (tick as usize % 8);
            for _ in 0..ranks {
                assert_eq!(g.admit(&"job", now), Verdict::Admitted, "tick {tick}");
                g.forwarded(&"job", 150, now);
            }
            for _ in 0..ranks {
                let latency = MS * (8 + 6 * ranks as u32);
                g.answered(&"job", &"job", 150, Some(latency), 1, now + latency);
            }
        }
        assert!(g.limit() >= 8, "{}", g.limit());
    }

    #[test]
    fn ten_writers_writing_alike_are_never_refused_however_slow_mlflow_answers() {
        let start = Instant::now();
        let mut g = Governor::new(64, start);
        let clients = ["c0", "c1", "c2", "c3", "c4", "c5", "c6", "c7", "c8", "c9"];
        // Each writes one sample twice a second and waits 300 ms for each answer, with the limit
        // at its floor.
        g.limit = 1.0;
        let mut pending: VecDeque<(Instant, &str)> = VecDeque::new();
        for tick in 0..400u32 {
            let now = start + 50 * MS * tick;
            while pending.front().is_some_and(|(at, _)| *at <= now) {
                let (at, client) = pending.pop_front().unwrap();
                g.answered(&client, &client, 150, Some(300 * MS), 1, at);
            }
            let client = clients[tick as usize % clients.len()];
            assert_eq!(
                g.admit(&client, now),
                Verdict::Admitted,
                "{client} at tick {tick}"
            );
            g.forwarded(&client, 150, now);
            pending.push_back((now + 300 * MS, client));
        }
    }

    #[test]
    fn writers_beyond_the_bound_are_forgotten_oldest_first_and_new_ones_still_judged() {
        let start = Instant::now();
        let mut g = Governor::new(1, start);
        g.forwarded(&"flood".to_owned(), 8000, start);
        g.forwarded(&"flood".to_owned(), 8000, start);
        for i in 0..(2 * MAX_CLIENTS) {
            let c = format!("client-{i}");
            g.forwarded(&c, 10, start);
            g.answered(&c, &c, 10, Some(MS), 1, start);
            // The flood keeps writing: it is the most recently active, never the one forgotten.
            if i % 1000 == 0 {
                g.forwarded(&"flood".to_owned(), 8000, start);
            }
        }
        assert!(g.clients.len() <= MAX_CLIENTS);
        assert!(matches!(
            g.admit(&"flood".to_owned(), start),
            Verdict::Heaviest { .. }
        ));
    }
}
