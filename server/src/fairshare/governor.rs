//! Saturation control: each active client's fair share of the writes MLflow takes at once, and a
//! limit on them learned from MLflow's latency while the proxy runs.
//!
//! - **The limit** (how many writes MLflow takes at once before it queues them) starts at
//!   `INITIAL_LIMIT`. Its signal is the latency of light writes (at most `LIGHT_SAMPLES` samples,
//!   what a calm client or a training loop's step sends): a heavy batch is slow by nature, a light
//!   write is slow when MLflow queues it. A window (250 ms) whose light writes answered slower on
//!   average than `TOLERANCE` times the baseline (the fastest window of the last five minutes)
//!   while the limit was in use, or a client was refused for it, halves the limit; such a window
//!   within tolerance raises it by a twentieth (at least a tenth of a write), up to the ceiling.
//! - **A client's load** is the larger of the writes it has at MLflow now and its usage: those
//!   writes averaged over time (an exponential average over about a second), i.e. the share of
//!   MLflow's time it takes. Its **weight** is what it writes: the bytes of its recent answered
//!   writes (decaying over about two seconds) plus those of its writes at MLflow (their declared
//!   length), so a burst of heavy batches weighs from its first write on.
//! - **A write is refused** when another client is active (a write or a read in the last 2 s), the
//!   writer's load is above its fair share (the limit divided by the active clients) and its
//!   weight is more than twice the average active client's: the heaviest clients give way, and
//!   only while they take more than their share. A client alone is never refused, nor one writing
//!   no more than twice the average (ten calm clients writing alike never are), nor one within its
//!   share. A slow answer makes a client's load high, never its weight: a calm client kept waiting
//!   by a flood does not become the one refused.

use std::collections::HashMap;
use std::collections::VecDeque;
use std::hash::Hash;
use std::time::{Duration, Instant};

/// How long one latency window lasts.
const WINDOW: Duration = Duration::from_millis(250);
/// How far back the baseline looks.
const BASELINE_SPAN: Duration = Duration::from_secs(300);
/// Windows with fewer answers than this do not set the baseline (one lucky answer is no baseline).
const BASELINE_MIN_ANSWERS: u32 = 3;
/// A window mean this many times the baseline means MLflow is queueing writes.
const TOLERANCE: f64 = 1.5;
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
/// A client writing more than this many times the average active client's weight may be refused.
const HEAVY: f64 = 2.0;
/// A client seen this recently (a write or a read) is active.
const ACTIVE_FOR: Duration = Duration::from_secs(2);
/// Clients remembered at once, so the map stays bounded.
const MAX_CLIENTS: usize = 10_000;
/// With more clients than this, the active clients are counted (and weighed) at most every
/// `CENSUS_EVERY`, not on every write: a write costs a map lookup, not a walk over the map.
const EXACT_UP_TO: usize = 64;
const CENSUS_EVERY: Duration = Duration::from_millis(20);

/// What the governor decided for one write.
#[derive(Debug, PartialEq)]
pub(crate) enum Verdict {
    Admitted,
    /// Another client is active, this one takes more than `share` writes at once on average and
    /// no one takes more.
    Heaviest {
        limit: usize,
        active: usize,
    },
}

#[derive(Debug, Clone)]
struct ClientLoad {
    holds: usize,
    usage: f64,
    updated: Instant,
    seen: Instant,
    /// Bytes of answered writes, decaying with `WEIGHT_TAU` from `updated`.
    answered_bytes: f64,
    /// Bytes of the writes at MLflow.
    held_bytes: u64,
}

impl ClientLoad {
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

    fn active(&self, now: Instant) -> bool {
        self.holds > 0 || now.saturating_duration_since(self.seen) < ACTIVE_FOR
    }
}

#[derive(Debug)]
pub(crate) struct Governor<K> {
    max_limit: f64,
    limit: f64,
    in_flight: usize,
    clients: HashMap<K, ClientLoad>,
    window: Window,
    /// The last count of active clients and their total weight, with more than `EXACT_UP_TO`.
    census: Option<(Instant, usize, usize, f64)>,
    /// (window end, window mean in seconds), oldest first.
    means: VecDeque<(Instant, f64)>,
}

#[derive(Debug)]
struct Window {
    started: Instant,
    answered: u32,
    latency_sum: f64,
    peak_in_flight: usize,
    refused: bool,
}

impl Window {
    fn new(now: Instant, in_flight: usize) -> Window {
        Window {
            started: now,
            answered: 0,
            latency_sum: 0.0,
            peak_in_flight: in_flight,
            refused: false,
        }
    }
}

impl<K: Hash + Eq + Clone> Governor<K> {
    pub(crate) fn new(max_limit: usize, now: Instant) -> Governor<K> {
        let max_limit = (max_limit as f64).max(MIN_LIMIT);
        Governor {
            max_limit,
            limit: INITIAL_LIMIT.min(max_limit),
            in_flight: 0,
            clients: HashMap::new(),
            window: Window::new(now, 0),
            census: None,
            means: VecDeque::new(),
        }
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit as usize
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// The entry of `client`, made (and the map pruned when full) on first sight.
    fn entry(&mut self, client: &K, now: Instant) -> Option<&mut ClientLoad> {
        if !self.clients.contains_key(client) {
            if self.clients.len() >= MAX_CLIENTS {
                self.clients
                    .retain(|_, c| c.active(now) || c.usage_at(now) > 0.01);
                if self.clients.len() >= MAX_CLIENTS {
                    return None;
                }
            }
            self.clients.insert(
                client.clone(),
                ClientLoad {
                    holds: 0,
                    usage: 0.0,
                    updated: now,
                    seen: now,
                    answered_bytes: 0.0,
                    held_bytes: 0,
                },
            );
        }
        self.clients.get_mut(client)
    }

    /// A request of `client` that is not a write (a UI read): it makes the client active.
    pub(crate) fn saw(&mut self, client: &K, now: Instant) {
        if let Some(c) = self.entry(client, now) {
            c.seen = now;
        }
    }

    /// Admits a write of `client` of `bytes` (it then counts until [`Governor::answered`]) or
    /// refuses it.
    pub(crate) fn admit(&mut self, client: &K, bytes: u64, now: Instant) -> Verdict {
        let exact = self.clients.len() <= EXACT_UP_TO;
        // Active clients share the limit; the average weight is over those that write (readers
        // weigh nothing and would make every writer look heavy), at least three.
        let (mut active, mut writers, mut total_weight) = (1usize, 1usize, 0.0f64);
        if exact {
            for (k, c) in &self.clients {
                if k != client && c.active(now) {
                    active += 1;
                    let w = c.weight_at(now);
                    writers += usize::from(w > 0.0);
                    total_weight += w;
                }
            }
        } else {
            let stale = self
                .census
                .is_none_or(|(at, ..)| now.saturating_duration_since(at) >= CENSUS_EVERY);
            if stale {
                let (mut n, mut writing, mut w) = (0usize, 0usize, 0.0f64);
                for c in self.clients.values().filter(|c| c.active(now)) {
                    n += 1;
                    let weight = c.weight_at(now);
                    writing += usize::from(weight > 0.0);
                    w += weight;
                }
                self.census = Some((now, n, writing, w));
            }
            if let Some((_, n, writing, w)) = self.census {
                // The census counted this client too (when it was active).
                active = n.max(1);
                writers = writing.max(1);
                total_weight = w;
            }
        }
        let limit = self.limit;
        let Some(own) = self.entry(client, now) else {
            // Too many clients to tell apart: admitted, as before the governor.
            return Verdict::Admitted;
        };
        own.seen = now;
        let (load, weight) = (own.load_at(now), own.weight_at(now));
        let everyone = if exact {
            total_weight + weight
        } else {
            total_weight.max(weight)
        };
        let average = everyone / writers.max(3) as f64;
        if active > 1 && load > limit / active as f64 && weight > HEAVY * average {
            self.window.refused = true;
            return Verdict::Heaviest {
                limit: limit as usize,
                active,
            };
        }
        own.advance(now);
        own.holds += 1;
        own.held_bytes = own.held_bytes.saturating_add(bytes);
        self.in_flight += 1;
        self.window.peak_in_flight = self.window.peak_in_flight.max(self.in_flight);
        Verdict::Admitted
    }

    /// An admitted write of `client` of `bytes` carrying `samples` was answered after `latency`
    /// (or abandoned: `None`); a light write's latency is the limit's signal.
    pub(crate) fn answered(
        &mut self,
        client: &K,
        bytes: u64,
        latency: Option<Duration>,
        samples: usize,
        now: Instant,
    ) {
        if let Some(c) = self.clients.get_mut(client).filter(|c| c.holds > 0) {
            c.advance(now);
            c.holds -= 1;
            c.held_bytes = c.held_bytes.saturating_sub(bytes);
            c.answered_bytes += bytes as f64;
            self.in_flight -= 1;
        }
        let light = samples <= LIGHT_SAMPLES;
        if now.saturating_duration_since(self.window.started) >= WINDOW {
            self.close_window(now);
        }
        if let Some(latency) = latency.filter(|_| light) {
            self.window.answered += 1;
            self.window.latency_sum += latency.as_secs_f64();
        }
    }

    fn close_window(&mut self, now: Instant) {
        let window = std::mem::replace(&mut self.window, Window::new(now, self.in_flight));
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
        let in_use = window.peak_in_flight as f64 >= (self.limit * 0.75).min(self.limit - 0.5);
        if mean > TOLERANCE * baseline {
            if in_use || window.refused {
                self.limit = (self.limit / 2.0).max(MIN_LIMIT);
            }
        } else if in_use || window.refused {
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
                let _ = g.admit(&"job", 100, *now);
            }
            for _ in 0..in_flight {
                g.answered(&"job", 100, Some(latency), 1, *now + WINDOW - MS);
            }
            *now += WINDOW;
            // Nothing held by this client: only the window closes.
            g.answered(&"nobody", 0, None, 1, *now);
        }
    }

    #[test]
    fn the_limit_grows_while_latency_holds_and_halves_when_mlflow_queues() {
        let mut now = Instant::now();
        let mut g = Governor::new(64, now);
        assert_eq!(g.limit(), 8);
        // Writes at the limit, answered as fast as ever: the limit grows to its ceiling.
        for _ in 0..120 {
            let limit = g.limit().max(1);
            load(&mut g, &mut now, 1, limit, 20 * MS);
        }
        assert_eq!(g.limit(), 64);
        // MLflow answers 3x slower while the limit is in use: halved per window, down to one.
        load(&mut g, &mut now, 1, 64, 60 * MS);
        assert_eq!(g.limit(), 32);
        load(&mut g, &mut now, 10, 32, 60 * MS);
        assert_eq!(g.limit(), 1);
        // Slow answers with little in use (mixed batch sizes, not queueing) do not shrink it.
        let mut g = Governor::new(64, now);
        load(&mut g, &mut now, 1, 8, 20 * MS);
        load(&mut g, &mut now, 5, 1, 100 * MS);
        assert!(g.limit() >= 8, "{}", g.limit());
    }

    #[test]
    fn the_heaviest_client_over_its_share_is_refused_and_light_ones_are_not() {
        let start = Instant::now();
        let mut g = Governor::new(4, start);
        assert_eq!(g.limit(), 4);
        // Alone, a client is never refused: it competes with nobody.
        for _ in 0..10 {
            assert_eq!(g.admit(&"flood", 8000, start), Verdict::Admitted);
        }
        // Two calm clients appear: the flood (10 at MLflow, its share 4 / 3) is refused, they are not.
        g.saw(&"calm-a", start);
        g.saw(&"calm-b", start);
        assert_eq!(
            g.admit(&"flood", 8000, start),
            Verdict::Heaviest {
                limit: 4,
                active: 3
            }
        );
        assert_eq!(g.admit(&"calm-a", 150, start), Verdict::Admitted);
        // The flood's writes are answered: with none at MLflow its usage still says it took
        // MLflow's time, and it stays refused until that fades below its share.
        let later = start + Duration::from_millis(500);
        for _ in 0..10 {
            g.answered(&"flood", 8000, Some(500 * MS), 100, later);
        }
        g.answered(&"calm-a", 150, Some(10 * MS), 1, later);
        assert!(matches!(
            g.admit(&"flood", 8000, later),
            Verdict::Heaviest { .. }
        ));
        let faded = later + Duration::from_secs(2);
        g.saw(&"calm-a", faded);
        g.saw(&"calm-b", faded);
        assert_eq!(g.admit(&"flood", 8000, faded), Verdict::Admitted);

        // A reader makes a client active too.
        let mut g = Governor::new(2, start);
        for _ in 0..3 {
            assert_eq!(g.admit(&"flood", 8000, start), Verdict::Admitted);
        }
        g.saw(&"ui", start);
        g.saw(&"ui-2", start);
        assert!(matches!(
            g.admit(&"flood", 8000, start),
            Verdict::Heaviest { .. }
        ));
        assert_eq!(
            g.admit(&"flood", 8000, start + ACTIVE_FOR),
            Verdict::Admitted,
            "the readers are no longer active"
        );
    }

    #[test]
    fn with_many_clients_the_census_still_finds_the_heavy_one() {
        let start = Instant::now();
        let mut g = Governor::new(8, start);
        for i in 0..200u32 {
            g.saw(&format!("reader-{i}"), start);
        }
        assert_eq!(g.admit(&"flood".to_owned(), 8000, start), Verdict::Admitted);
        let later = start + CENSUS_EVERY;
        assert!(matches!(
            g.admit(&"flood".to_owned(), 8000, later),
            Verdict::Heaviest { active: 201, .. }
        ));
        assert_eq!(
            g.admit(&"reader-7".to_owned(), 150, later),
            Verdict::Admitted
        );
    }

    #[test]
    fn ten_clients_writing_alike_are_never_refused_however_slow_mlflow_answers_or_many_read() {
        let start = Instant::now();
        let mut g = Governor::new(64, start);
        let clients = ["c0", "c1", "c2", "c3", "c4", "c5", "c6", "c7", "c8", "c9"];
        // Each writes one sample twice a second and waits 300 ms for each answer, with the limit
        // at its floor.
        g.limit = 1.0;
        let mut pending: VecDeque<(Instant, &str)> = VecDeque::new();
        let readers: Vec<String> = (0..100).map(|i| format!("reader-{i}")).collect();
        for tick in 0..400u32 {
            let now = start + 50 * MS * tick;
            // A hundred people browsing the UI make the share smaller, not the writers heavier.
            for reader in &readers {
                g.saw(&reader.as_str(), now);
            }
            while pending.front().is_some_and(|(at, _)| *at <= now) {
                let (at, client) = pending.pop_front().unwrap();
                g.answered(&client, 150, Some(300 * MS), 1, at);
            }
            let client = clients[tick as usize % clients.len()];
            assert_eq!(
                g.admit(&client, 150, now),
                Verdict::Admitted,
                "{client} at tick {tick}"
            );
            pending.push_back((now + 300 * MS, client));
        }
    }
}
