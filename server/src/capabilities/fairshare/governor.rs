//! Saturation control: how many writes MLflow takes at once before the light writes beside them
//! suffer, learned from those light writes' latency, and who gives way when that many are at
//! MLflow.
//!
//! - **A write is at MLflow** from the moment its whole body has been handed on (what the client
//!   still uploads is not MLflow's work) until MLflow's answer; its **latency** is that span, so a
//!   client trickling its body is never taken for MLflow being slow. A write of more than
//!   `HEAVY_BYTES` is **heavy**; one answered with at most `LIGHT_SAMPLES` samples is **light**
//!   (what a calm client or a training step sends).
//! - **The limit aims at a latency budget for light writes**, on their mean and on their tail.
//!   Their latencies answered with no heavy write at MLflow are their own: the **baseline** is the
//!   mean and the 90th percentile of the last `QUIET_KEPT` of them (before there are
//!   `QUIET_ENOUGH`, the fastest window of the last five minutes, and twice that). In windows
//!   (`WINDOW`) with heavy writes at MLflow: light writes answered on average more than `OVERRUN`
//!   times the baseline mean halve the limit; more than `BUDGET` times it, or one of them slower
//!   than `TAIL_BUDGET` times the baseline's 90th percentile, lower it by a fifth (each with
//!   `SLACK` more); within `GROW_BELOW` times the mean and `TAIL_GROW_BELOW` times the 90th
//!   percentile, with the heavy writes using the limit, it grows by `GROW_STEP`, up to the
//!   ceiling. Without light writes there is nobody to protect and no evidence: the limit holds.
//!   It starts at `INITIAL_LIMIT` and never goes below one. MLflow takes whole writes: as many
//!   are let through at once as the limit holds whole (what [`Governor::limit`] reports).
//! - **The limit rises only where MLflow does more with it.** A write at MLflow beyond what its
//!   workers and cores can work on at once adds latency, not throughput: on a small machine the
//!   light writes pay for it before their budget notices. So the governor keeps, for each whole
//!   limit it ran at with the heavy writes using it, their **yield** (bytes of heavy writes MLflow
//!   answered per second, an average over the windows at that limit). Growth to a limit whose
//!   recent yield (`YIELD_FRESH`) shows that its last write added less than `MARGINAL` of what a
//!   write there adds on average stops below it, and a limit found so steps down one (at least
//!   `YIELD_WINDOWS` windows at each). A limit cut for the light writes' sake is measured on the
//!   way down, so the limit does not climb back where it did not pay; once the yield above is
//!   stale it is tried again (a second or so every `YIELD_FRESH`), so the governor finds out
//!   when MLflow's capacity grew.
//! - **Writers** are the clients with a write MLflow answered in the last `ACTIVE_FOR`;
//!   readers are not counted (the proxy never refuses a read, and a reader does not make a
//!   writer's share smaller). A writer's **load** is the larger of its writes at MLflow now and
//!   their average over about a second; its **weight** is the bytes it had MLflow take (recent
//!   answers, decaying over about two seconds, plus the writes at MLflow now).
//! - **A writer's share** is what the others leave of the limit, and never less than an equal
//!   split: the larger of the limit less the other writers' load and the limit divided among the
//!   writers. A flood beside ten calm clients writing one sample at a time gets nearly the whole
//!   limit, not an eleventh of it.
//! - **A write is refused** only while the writes at MLflow are at the limit, another writer is
//!   active, one more write would take the writer's writes at MLflow past its share, and its
//!   weight is more than `HEAVY` times the average of the *other* writers. So the only writer is
//!   never refused, nor writers writing alike, nor anyone while MLflow has room; a slow answer
//!   makes a client's load high, never its weight, so a calm client kept waiting by a flood does
//!   not become the one refused.
//! - Writers are remembered in a map bounded by `MAX_CLIENTS` that forgets the least recently
//!   active first (an evicted writer's writes at MLflow still count in the total); a new client is
//!   always judged, however many there are.

use std::collections::VecDeque;
use std::hash::Hash;
use std::time::{Duration, Instant};

use crate::plumbing::aged::AgedMap;

/// How long one latency window lasts.
const WINDOW: Duration = Duration::from_millis(500);
/// How far back the fallback baseline (the fastest window) looks.
const BASELINE_SPAN: Duration = Duration::from_secs(300);
/// Windows with fewer light answers than this say nothing (one answer is no evidence).
const MIN_ANSWERS: u32 = 3;
/// Quiet light latencies (no heavy write at MLflow) kept for the baseline, and how many make one.
const QUIET_KEPT: usize = 256;
const QUIET_ENOUGH: usize = 20;
/// A window's light writes slower on average than this many times the baseline mean, or one of
/// them slower than `TAIL_BUDGET` times its 90th percentile (each `SLACK` more), with heavy writes
/// at MLflow, lower the limit by a fifth; slower on average than `OVERRUN` times, they halve it.
const BUDGET: f64 = 1.25;
const TAIL_BUDGET: f64 = 1.5;
const OVERRUN: f64 = 3.0;
const SLACK: Duration = Duration::from_millis(5);
/// Light writes within these (and `SLACK`) let the limit grow.
const GROW_BELOW: f64 = 1.1;
const TAIL_GROW_BELOW: f64 = 1.25;
/// What a window within budget adds to the limit.
const GROW_STEP: f64 = 0.5;
/// A write of more bytes than this is heavy: its presence at MLflow is what the light writes are
/// protected from (a chunked body, of no declared length, counts as 1 KiB: light).
const HEAVY_BYTES: u64 = 4096;
/// A write of at most this many samples is light: its latency is the limit's signal.
const LIGHT_SAMPLES: usize = 10;
/// One more write at MLflow must add at least this much of what a write there adds on average
/// (its yield over the limit's), or the limit does not rise to it.
const MARGINAL: f64 = 0.5;
/// A limit's yield older than this is stale: that limit may be tried again.
const YIELD_FRESH: Duration = Duration::from_secs(30);
/// Windows at a limit before its yield counts.
const YIELD_WINDOWS: u32 = 4;
/// Weight of a new window in a limit's yield.
const YIELD_NEW: f64 = 0.3;
/// The limit never goes below one write at once.
const MIN_LIMIT: f64 = 1.0;
/// Where the limit starts.
const INITIAL_LIMIT: f64 = 4.0;
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
    /// The writes at MLflow are at the limit, another client writes, and one more write would
    /// take this one past its share while it weighs more than twice the others.
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
    /// Of those, the heavy ones.
    heavy_at_mlflow: usize,
    clients: AgedMap<K, ClientLoad>,
    window: Window,
    /// The last count of writers, their total weight and their total load, with more than
    /// `EXACT_UP_TO` clients.
    census: Option<(Instant, Census)>,
    /// The last light latencies (seconds) answered with no heavy write at MLflow, oldest first.
    quiet: VecDeque<f64>,
    /// (window end, mean light latency in seconds) of every window of the last `BASELINE_SPAN`
    /// with evidence, oldest first: the fallback baseline before any quiet window.
    means: VecDeque<(Instant, f64)>,
    /// The heavy writes' yield at each whole limit (index), once measured; as long as the highest
    /// limit measured.
    yields: Vec<Option<Yield>>,
}

/// What MLflow answered of heavy writes per second at one limit, with them using it.
#[derive(Debug, Clone, Copy)]
struct Yield {
    bytes_per_second: f64,
    windows: u32,
    at: Instant,
}

/// The writers other than one client: how many, their total weight, their total load.
#[derive(Debug, Clone, Copy, Default)]
struct Census {
    writers: usize,
    weight: f64,
    load: f64,
}

impl Census {
    fn add(&mut self, c: &ClientLoad, now: Instant) {
        self.writers += 1;
        self.weight += c.weight_at(now);
        self.load += c.load_at(now);
    }
}

#[derive(Debug)]
struct Window {
    started: Instant,
    answered: u32,
    latency_sum: f64,
    latency_max: f64,
    heavy_peak: usize,
    /// Bytes of heavy writes MLflow answered in the window.
    heavy_bytes: f64,
}

impl Window {
    fn new(now: Instant, heavy_at_mlflow: usize) -> Window {
        Window {
            started: now,
            answered: 0,
            latency_sum: 0.0,
            latency_max: 0.0,
            heavy_peak: heavy_at_mlflow,
            heavy_bytes: 0.0,
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
            heavy_at_mlflow: 0,
            clients: AgedMap::new(MAX_CLIENTS),
            window: Window::new(now, 0),
            census: None,
            quiet: VecDeque::with_capacity(QUIET_KEPT),
            means: VecDeque::new(),
            yields: Vec::new(),
        }
    }

    pub(crate) fn limit(&self) -> usize {
        self.limit as usize
    }

    pub(crate) fn at_mlflow(&self) -> usize {
        self.at_mlflow
    }

    /// The writers other than `client`.
    fn others(&mut self, client: &K, now: Instant) -> Census {
        if self.clients.len() <= EXACT_UP_TO {
            let mut others = Census::default();
            for (k, c) in self.clients.iter() {
                if k != client && c.writing(now) {
                    others.add(c, now);
                }
            }
            return others;
        }
        let stale = self
            .census
            .is_none_or(|(at, _)| now.saturating_duration_since(at) >= CENSUS_EVERY);
        if stale {
            let mut all = Census::default();
            for c in self.clients.values().filter(|c| c.writing(now)) {
                all.add(c, now);
            }
            self.census = Some((now, all));
        }
        let all = self.census.map_or_else(Census::default, |(_, c)| c);
        // The census counted this client too, when it was writing.
        match self.clients.peek_mut(client).filter(|c| c.writing(now)) {
            Some(own) => Census {
                writers: all.writers.saturating_sub(1),
                weight: (all.weight - own.weight_at(now)).max(0.0),
                load: (all.load - own.load_at(now)).max(0.0),
            },
            None => all,
        }
    }

    /// Whether a write of `client` may go to MLflow now; it counts once [`Governor::forwarded`].
    pub(crate) fn admit(&mut self, client: &K, now: Instant) -> Verdict {
        // The limit is learned in fractions; MLflow takes whole writes, as many as the limit
        // holds (what `limit()` reports).
        if self.at_mlflow < self.limit() {
            return Verdict::Admitted;
        }
        let others = self.others(client, now);
        if others.writers == 0 {
            return Verdict::Admitted;
        }
        let Some(own) = self.clients.peek_mut(client) else {
            return Verdict::Admitted;
        };
        let writers = others.writers + 1;
        let (holds, weight) = (own.holds, own.weight_at(now));
        let average = others.weight / others.writers as f64;
        let share = (self.limit - others.load).max(self.limit / writers as f64);
        // One more write would take it past its share.
        if (holds + 1) as f64 > share && weight > HEAVY * average {
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
        if bytes > HEAVY_BYTES {
            self.heavy_at_mlflow += 1;
            self.window.heavy_peak = self.window.heavy_peak.max(self.heavy_at_mlflow);
        }
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
        if bytes > HEAVY_BYTES {
            self.heavy_at_mlflow = self.heavy_at_mlflow.saturating_sub(1);
        }
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
        if bytes > HEAVY_BYTES && latency.is_some() {
            self.window.heavy_bytes += bytes as f64;
        }
        if let Some(latency) = latency.filter(|_| samples <= LIGHT_SAMPLES) {
            let latency = latency.as_secs_f64();
            self.window.answered += 1;
            self.window.latency_sum += latency;
            self.window.latency_max = self.window.latency_max.max(latency);
            if self.heavy_at_mlflow == 0 && self.window.heavy_peak == 0 {
                if self.quiet.len() == QUIET_KEPT {
                    self.quiet.pop_front();
                }
                self.quiet.push_back(latency);
            }
        }
    }

    /// The light writes' own latency, mean and 90th percentile: of the last quiet ones, else the
    /// fastest window of the last `BASELINE_SPAN` (and twice that).
    fn baseline(&self) -> Option<(f64, f64)> {
        if self.quiet.len() < QUIET_ENOUGH {
            let fastest = self.means.iter().map(|(_, m)| *m).reduce(f64::min)?;
            return Some((fastest, 2.0 * fastest));
        }
        let mut quiet: Vec<f64> = self.quiet.iter().copied().collect();
        quiet.sort_by(f64::total_cmp);
        let mean = quiet.iter().sum::<f64>() / quiet.len() as f64;
        Some((mean, quiet[quiet.len() * 9 / 10]))
    }

    fn close_window(&mut self, now: Instant) {
        let window = std::mem::replace(&mut self.window, Window::new(now, self.heavy_at_mlflow));
        if window.answered < MIN_ANSWERS {
            // No evidence: nobody light to protect, or too few answers to tell.
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
        if window.heavy_peak == 0 {
            return;
        }
        let Some((base, tail)) = self.baseline() else {
            return;
        };
        let slack = SLACK.as_secs_f64();
        let in_use = window.heavy_peak as f64 >= (self.limit * 0.75).min(self.limit - 0.5);
        let level = self.limit();
        if in_use {
            let seconds = now.saturating_duration_since(window.started).as_secs_f64();
            self.measured(level, window.heavy_bytes / seconds.max(1e-3), now);
        }
        let grown = (self.limit + GROW_STEP).min(self.max_limit);
        if mean > OVERRUN * base + slack {
            self.limit = (self.limit / 2.0).max(MIN_LIMIT);
        } else if mean > BUDGET * base + slack || window.latency_max > TAIL_BUDGET * tail + slack {
            self.limit = (self.limit * 0.8).max(MIN_LIMIT);
        } else if level > 1 && self.pays(level, now) == Some(false) {
            self.limit = (level - 1) as f64;
        } else if mean <= GROW_BELOW * base + slack
            && window.latency_max <= TAIL_GROW_BELOW * tail + slack
            && in_use
            && self.may_rise_to(grown as usize, level, now)
        {
            self.limit = grown;
        }
    }

    /// Adds a window's yield at limit `level`.
    fn measured(&mut self, level: usize, bytes_per_second: f64, now: Instant) {
        if self.yields.len() <= level {
            self.yields.resize(level + 1, None);
        }
        let slot = &mut self.yields[level];
        *slot = Some(match *slot {
            Some(y) if now.saturating_duration_since(y.at) < YIELD_FRESH => Yield {
                bytes_per_second: y.bytes_per_second * (1.0 - YIELD_NEW)
                    + bytes_per_second * YIELD_NEW,
                windows: y.windows + 1,
                at: now,
            },
            _ => Yield {
                bytes_per_second,
                windows: 1,
                at: now,
            },
        });
    }

    /// Whether the limit may grow from whole limit `level` into `next`: within it; else once the
    /// yield at `level` is known, to a limit whose yield is not (to find out) or is known to pay.
    fn may_rise_to(&self, next: usize, level: usize, now: Instant) -> bool {
        next == level
            || (self.yield_at(level, now).is_some()
                && (self.yield_at(next, now).is_none() || self.pays(next, now) == Some(true)))
    }

    /// The yield at limit `level` (bytes per second), when measured over `YIELD_WINDOWS` windows
    /// and lately.
    fn yield_at(&self, level: usize, now: Instant) -> Option<f64> {
        self.yields
            .get(level)
            .copied()
            .flatten()
            .filter(|y| {
                y.windows >= YIELD_WINDOWS && now.saturating_duration_since(y.at) < YIELD_FRESH
            })
            .map(|y| y.bytes_per_second)
    }

    /// Whether the last write of limit `level` (over `level - 1`) added at least `MARGINAL` of
    /// what a write adds on average there, by the yields of both; `None` when either is not known.
    fn pays(&self, level: usize, now: Instant) -> Option<bool> {
        let above = self.yield_at(level, now)?;
        let below = self.yield_at(level.checked_sub(1)?, now)?;
        Some(above - below >= MARGINAL * above / level as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Runs `windows` windows in which `heavy` heavy writes are at MLflow throughout and `light`
    /// light writes are each answered after `latency`.
    fn load(
        g: &mut Governor<&'static str>,
        now: &mut Instant,
        windows: u32,
        heavy: usize,
        light: usize,
        latency: Duration,
    ) {
        for _ in 0..windows {
            window(g, now, (heavy, 8000), light, latency);
        }
    }

    /// One window: `heavy.0` heavy writes of `heavy.1` bytes at MLflow throughout, `light` light
    /// writes each answered after `latency`.
    fn window(
        g: &mut Governor<&'static str>,
        now: &mut Instant,
        (heavy, bytes): (usize, u64),
        light: usize,
        latency: Duration,
    ) {
        for _ in 0..heavy {
            g.forwarded(&"flood", bytes, *now);
        }
        for _ in 0..light {
            g.forwarded(&"calm", 150, *now);
            g.answered(&"calm", &"calm", 150, Some(latency), 1, *now + latency);
        }
        // The heavy writes are answered at the window's end (theirs is no light latency).
        for _ in 0..heavy {
            g.answered(
                &"flood",
                &"flood",
                bytes,
                Some(WINDOW),
                100,
                *now + WINDOW - MS,
            );
        }
        *now += WINDOW;
        // Only the window closes (an abandoned write).
        g.forwarded(&"calm", 0, *now);
        g.answered(&"calm", &"calm", 0, None, 1, *now);
    }

    #[test]
    fn the_limit_aims_at_the_light_writes_latency_budget() {
        let mut now = Instant::now();
        let mut g = Governor::new(64, now);
        assert_eq!(g.limit(), 4);
        // Light writes alone: their own latency (20 ms) is the baseline; nothing heavy, no change.
        load(&mut g, &mut now, 10, 0, 5, 20 * MS);
        assert_eq!(g.limit(), 4);
        // Heavy writes using the limit, light ones answered within 1.1× their own: it grows by
        // half a write per window, to its ceiling.
        // (Each limit is measured for `YIELD_WINDOWS` windows before the next is tried.)
        for _ in 0..300 {
            let limit = g.limit();
            load(&mut g, &mut now, 1, limit, 5, 22 * MS);
        }
        assert_eq!(g.limit(), 64);
        // Within budget (1.25× and 5 ms) but above 1.1×: it holds.
        load(&mut g, &mut now, 10, 64, 5, 29 * MS);
        assert_eq!(g.limit(), 64);
        // Over budget: a fifth less per window.
        load(&mut g, &mut now, 1, 64, 5, 40 * MS);
        assert_eq!(g.limit(), 51);
        // Over three times their own: halved per window, down to one, never below.
        load(&mut g, &mut now, 10, 51, 5, 200 * MS);
        assert_eq!(g.limit(), 1);
        // Heavy writes not using the limit do not make it grow.
        let mut g = Governor::new(64, now);
        load(&mut g, &mut now, 10, 0, 5, 20 * MS);
        load(&mut g, &mut now, 20, 1, 5, 20 * MS);
        assert_eq!(g.limit(), 4);
        // No light writes: nobody to protect, no evidence; the limit holds however slow the heavy
        // writes are.
        load(&mut g, &mut now, 20, 8, 0, 20 * MS);
        assert_eq!(g.limit(), 4);
        // Light writes slow without anything heavy at MLflow are MLflow's own pace, not
        // contention: the baseline follows them.
        load(&mut g, &mut now, 60, 0, 5, 100 * MS);
        for _ in 0..2 * YIELD_WINDOWS {
            let limit = g.limit();
            load(&mut g, &mut now, 1, limit, 5, 110 * MS);
        }
        assert_eq!(g.limit(), 6);
        // Two light answers in a window are no evidence.
        load(&mut g, &mut now, 10, 6, 2, 400 * MS);
        assert_eq!(g.limit(), 6);
        // The tail counts: four light writes as fast as ever and one of them three times slower
        // than their 90th percentile (the mean within budget) lower the limit by a fifth.
        for _ in 0..6 {
            g.forwarded(&"flood", 8000, now);
        }
        for latency in [100, 100, 100, 100, 300] {
            g.forwarded(&"calm", 150, now);
            g.answered(
                &"calm",
                &"calm",
                150,
                Some(latency * MS),
                1,
                now + latency * MS,
            );
        }
        now += WINDOW;
        g.forwarded(&"calm", 0, now);
        g.answered(&"calm", &"calm", 0, None, 1, now);
        assert_eq!(g.limit(), 4);
    }

    /// As [`load`], with MLflow saturated: whatever the limit, it answers the same bytes of heavy
    /// writes per window (48 kB), in as many writes as the limit lets through.
    fn saturated(g: &mut Governor<&'static str>, now: &mut Instant, windows: u32) -> Vec<usize> {
        let mut limits = Vec::new();
        for _ in 0..windows {
            let heavy = g.limit();
            window(g, now, (heavy, 48_000 / heavy as u64), 5, 20 * MS);
            limits.push(g.limit());
        }
        limits
    }

    #[test]
    fn the_limit_does_not_rise_where_mlflow_does_no_more_with_it() {
        let mut now = Instant::now();
        let mut g = Governor::new(64, now);
        load(&mut g, &mut now, 10, 0, 5, 20 * MS);
        // The light writes within budget would let it grow; one write more (5) is tried, yields
        // nothing more, and the limit goes back to 4 and stays there.
        let limits = saturated(&mut g, &mut now, 20);
        assert_eq!(limits.iter().max(), Some(&5), "{limits:?}");
        assert_eq!(limits[limits.len() - 10..], [4; 10], "{limits:?}");
        // A cut for the light writes' sake (one window over budget) is measured on the way down,
        // and the limit does not climb back to where it did not pay.
        load(&mut g, &mut now, 1, 4, 5, 40 * MS);
        assert_eq!(g.limit(), 3);
        let limits = saturated(&mut g, &mut now, 10);
        assert_eq!(limits, [3; 10]);
        // Once what it knows of 4 is stale (30 s), 4 is tried again, and left again.
        let limits = saturated(&mut g, &mut now, 70);
        assert!(limits.contains(&4), "{limits:?}");
        assert_eq!(limits[limits.len() - 5..], [3; 5], "{limits:?}");
    }

    #[test]
    fn a_flood_beside_calm_writers_gets_what_they_leave_not_an_equal_split() {
        let start = Instant::now();
        let mut g = Governor::new(64, start);
        g.limit = 8.0;
        // Ten calm writers, each with one light write answered, two of them at MLflow now.
        let calm = ["c0", "c1", "c2", "c3", "c4", "c5", "c6", "c7", "c8", "c9"];
        for c in calm {
            g.forwarded(&c, 150, start);
            g.answered(&c, &c, 150, Some(20 * MS), 1, start);
        }
        let now = start + 100 * MS;
        g.forwarded(&"c0", 150, now);
        g.forwarded(&"c1", 150, now);
        // The flood has written before, so it is a writer, and writes until it is held back.
        g.forwarded(&"flood", 8000, start);
        g.answered(
            &"flood",
            &"flood",
            8000,
            Some(50 * MS),
            100,
            start + 50 * MS,
        );
        let mut admitted = 0;
        while g.admit(&"flood", now) == Verdict::Admitted {
            g.forwarded(&"flood", 8000, now);
            admitted += 1;
            assert!(admitted < 64, "never held back");
        }
        // Beside the calm writers' two it holds what is left of the eight, not 8 / 11.
        assert_eq!(admitted, 6);
        // The calm writers are never held back meanwhile.
        for c in calm {
            assert_eq!(g.admit(&c, now), Verdict::Admitted);
        }
        // Once they are answered, their share is the flood's.
        g.answered(&"c0", &"c0", 150, Some(20 * MS), 1, now);
        g.answered(&"c1", &"c1", 150, Some(20 * MS), 1, now);
        assert_eq!(g.admit(&"flood", now), Verdict::Admitted);
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
        // Light writes alone never shrink the limit.
        assert_eq!(g.limit(), INITIAL_LIMIT as usize);
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
