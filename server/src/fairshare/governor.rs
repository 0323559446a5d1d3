//! Saturation control: how many writes may be at MLflow at once, learned from MLflow's latency
//! while the proxy runs, and who is refused first when they are all taken.
//!
//! The limit starts low and grows by one each window (250 ms) in which writes answered no slower
//! than `TOLERANCE` times the baseline (the fastest window mean of the last five minutes); a
//! window that was slower while the limit was in use halves it. While the limit is reached, a
//! write of the client holding the most writes at MLflow (ties included) is refused when another
//! client is active, so the heaviest client gives way first. A client with nothing at MLflow is
//! always admitted: a client that waits for each answer (MLflow's own, synchronous client) is
//! never refused by saturation, and neither is a client alone, whose load competes with nobody.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::time::{Duration, Instant};

/// How long one latency window lasts.
const WINDOW: Duration = Duration::from_millis(250);
/// How far back the baseline looks.
const BASELINE_SPAN: Duration = Duration::from_secs(300);
/// A window mean this many times the baseline means MLflow is queueing writes.
const TOLERANCE: f64 = 2.0;
/// The limit never goes below this many writes at once.
pub(crate) const MIN_LIMIT: usize = 2;
/// Where the limit starts.
const INITIAL_LIMIT: usize = 8;
/// A client seen this recently (a write or a read) is active.
const ACTIVE_FOR: Duration = Duration::from_secs(2);
/// Clients remembered as active at once, so the map stays bounded.
const MAX_ACTIVE: usize = 10_000;

/// What the governor decided for one write.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    Admitted,
    /// The limit is reached and this client holds the most writes at MLflow.
    Heaviest {
        limit: usize,
    },
}

#[derive(Debug)]
pub(crate) struct Governor<K> {
    max_limit: usize,
    limit: f64,
    in_flight: usize,
    /// Writes at MLflow per client; only clients with at least one.
    holding: HashMap<K, usize>,
    /// When each recently active client was last seen.
    seen: HashMap<K, Instant>,
    window: Window,
    /// (window end, window mean in seconds), oldest first.
    means: VecDeque<(Instant, f64)>,
}

#[derive(Debug)]
struct Window {
    started: Instant,
    answered: u32,
    latency_sum: f64,
    peak_in_flight: usize,
}

impl Window {
    fn new(now: Instant) -> Window {
        Window {
            started: now,
            answered: 0,
            latency_sum: 0.0,
            peak_in_flight: 0,
        }
    }
}

impl<K: Hash + Eq + Clone> Governor<K> {
    pub(crate) fn new(max_limit: usize, now: Instant) -> Governor<K> {
        Governor {
            max_limit: max_limit.max(MIN_LIMIT),
            limit: INITIAL_LIMIT.clamp(MIN_LIMIT, max_limit.max(MIN_LIMIT)) as f64,
            in_flight: 0,
            holding: HashMap::new(),
            seen: HashMap::new(),
            window: Window::new(now),
            means: VecDeque::new(),
        }
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit as usize
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// A request of `client` that is not a write (a UI read): it makes the client active.
    pub(crate) fn saw(&mut self, client: &K, now: Instant) {
        self.mark(client, now);
    }

    fn mark(&mut self, client: &K, now: Instant) {
        if let Some(at) = self.seen.get_mut(client) {
            *at = now;
            return;
        }
        if self.seen.len() >= MAX_ACTIVE {
            self.seen
                .retain(|_, at| now.saturating_duration_since(*at) < ACTIVE_FOR);
            if self.seen.len() >= MAX_ACTIVE {
                return;
            }
        }
        self.seen.insert(client.clone(), now);
    }

    /// Whether a client other than `client` is active.
    fn others_active(&self, client: &K, now: Instant) -> bool {
        self.holding.keys().any(|k| k != client)
            || self
                .seen
                .iter()
                .any(|(k, at)| k != client && now.saturating_duration_since(*at) < ACTIVE_FOR)
    }

    /// Admits a write of `client` (it then counts until [`Governor::answered`]) or refuses it.
    pub(crate) fn admit(&mut self, client: &K, now: Instant) -> Verdict {
        let holds = self.holding.get(client).copied().unwrap_or(0);
        if self.in_flight >= self.limit() && holds > 0 && self.others_active(client, now) {
            let heaviest_other = self
                .holding
                .iter()
                .filter(|(k, _)| *k != client)
                .map(|(_, n)| *n)
                .max()
                .unwrap_or(0);
            if holds >= heaviest_other {
                self.mark(client, now);
                return Verdict::Heaviest {
                    limit: self.limit(),
                };
            }
        }
        self.mark(client, now);
        *self.holding.entry(client.clone()).or_insert(0) += 1;
        self.in_flight += 1;
        self.window.peak_in_flight = self.window.peak_in_flight.max(self.in_flight);
        Verdict::Admitted
    }

    /// An admitted write of `client` was answered after `latency` (or abandoned: `None`).
    pub(crate) fn answered(&mut self, client: &K, latency: Option<Duration>, now: Instant) {
        if let Some(holds) = self.holding.get_mut(client) {
            *holds -= 1;
            if *holds == 0 {
                self.holding.remove(client);
            }
            self.in_flight -= 1;
        }
        if now.saturating_duration_since(self.window.started) >= WINDOW {
            self.close_window(now);
        }
        if let Some(latency) = latency {
            self.window.answered += 1;
            self.window.latency_sum += latency.as_secs_f64();
        }
    }

    fn close_window(&mut self, now: Instant) {
        let window = std::mem::replace(&mut self.window, Window::new(now));
        self.window.peak_in_flight = self.in_flight;
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
        self.means.push_back((now, mean));
        let baseline = self
            .means
            .iter()
            .map(|(_, m)| *m)
            .fold(f64::INFINITY, f64::min);
        let in_use = window.peak_in_flight as f64 >= self.limit / 2.0;
        if mean > TOLERANCE * baseline && in_use {
            self.limit = (self.limit / 2.0).max(MIN_LIMIT as f64);
        } else if mean <= TOLERANCE * baseline && window.peak_in_flight as f64 >= self.limit * 0.75
        {
            self.limit = (self.limit + 1.0).min(self.max_limit as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Runs `windows` windows in which `in_flight` writes are at MLflow, each answered after
    /// `latency`.
    fn load(
        g: &mut Governor<&'static str>,
        now: &mut Instant,
        windows: u32,
        in_flight: usize,
        latency: Duration,
    ) {
        for _ in 0..windows {
            for _ in 0..in_flight {
                let _ = g.admit(&"job", *now);
            }
            for _ in 0..in_flight {
                g.answered(&"job", Some(latency), *now + WINDOW - MS);
            }
            *now += WINDOW;
            // Nothing held by this client: only the window closes.
            g.answered(&"nobody", None, *now);
        }
    }

    #[test]
    fn the_limit_grows_while_latency_holds_and_halves_when_mlflow_queues() {
        let mut now = Instant::now();
        let mut g = Governor::new(64, now);
        assert_eq!(g.limit(), INITIAL_LIMIT);
        // Writes at the limit, answered as fast as ever: the limit grows to its ceiling.
        for _ in 0..80 {
            let limit = g.limit();
            load(&mut g, &mut now, 1, limit, 20 * MS);
        }
        assert_eq!(g.limit(), 64);
        // MLflow answers 3x slower while the limit is in use: halved per window, down to the floor.
        let limit = g.limit();
        load(&mut g, &mut now, 1, limit, 60 * MS);
        assert_eq!(g.limit(), 32);
        load(&mut g, &mut now, 10, 32, 60 * MS);
        assert_eq!(g.limit(), MIN_LIMIT);
        // Slow answers with little in use (mixed batch sizes, not queueing) do not shrink it.
        let mut g = Governor::new(64, now);
        load(&mut g, &mut now, 1, 8, 20 * MS);
        load(&mut g, &mut now, 5, 1, 100 * MS);
        assert!(g.limit() >= INITIAL_LIMIT, "{}", g.limit());
    }

    #[test]
    fn at_the_limit_the_heaviest_client_is_refused_and_the_others_admitted() {
        let now = Instant::now();
        let mut g = Governor::new(4, now);
        let limit = g.limit();
        assert_eq!(limit, 4);
        // Alone, a client is never refused: it competes with nobody.
        for _ in 0..10 {
            assert_eq!(g.admit(&"flood", now), Verdict::Admitted);
        }
        // A calm client arrives with nothing at MLflow: admitted, over the limit.
        assert_eq!(g.admit(&"calm", now), Verdict::Admitted);
        // Now the flood is refused, and the calm client's next write while it holds one too
        // only once it would be the heaviest.
        assert_eq!(g.admit(&"flood", now), Verdict::Heaviest { limit: 4 });
        assert_eq!(g.admit(&"calm", now), Verdict::Admitted);
        for _ in 0..10 {
            g.answered(&"flood", Some(10 * MS), now);
        }
        // The flood holds nothing now: admitted again; the calm client, holding two against one,
        // is the heaviest while the limit is reached.
        assert_eq!(g.admit(&"flood", now), Verdict::Admitted);
        g.answered(&"calm", Some(10 * MS), now);
        assert_eq!(g.in_flight(), 2);
        assert_eq!(g.admit(&"flood", now), Verdict::Admitted);
        assert_eq!(g.admit(&"other", now), Verdict::Admitted);
        assert_eq!(g.admit(&"flood", now), Verdict::Heaviest { limit: 4 });
        // A reader makes a client active too.
        let mut g = Governor::new(2, now);
        for _ in 0..2 {
            g.admit(&"flood", now);
        }
        assert_eq!(g.admit(&"flood", now), Verdict::Admitted);
        g.saw(&"ui", now);
        assert_eq!(g.admit(&"flood", now), Verdict::Heaviest { limit: 2 });
        assert_eq!(
            g.admit(&"flood", now + ACTIVE_FOR),
            Verdict::Admitted,
            "the reader is no longer active"
        );
    }
}
