//! Deduplication of node-wide samples: one reporting rank per (run, node), elected in the store,
//! in the manner of Cortex/Mimir HA-pair deduplication.
//!
//! The store is consulted on election, on renewal (at most once per `update_interval` per
//! lease) and when a cached lease looks expired; every other sample is decided from memory.

mod clock;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::plumbing::store::{NodeLease, Store, StoreError};
#[cfg(test)]
pub(crate) use clock::ManualClock;
pub(crate) use clock::{Clock, SystemClock};

/// Node deduplication is on unless turned off (`--dedup false`).
pub(crate) const ENABLED_BY_DEFAULT: bool = true;

#[derive(Debug, Clone, Copy)]
pub struct DedupConfig {
    /// How often the reporter's lease is renewed in the store when nothing else changed (a
    /// batch that raises the last step is written at once, so a handover never reuses a step).
    pub update_interval: Duration,
    /// Silence after which another rank may take over (proxy receive clock).
    pub failover_timeout: Duration,
}

impl Default for DedupConfig {
    fn default() -> Self {
        // MLflow samples every 10 s: renew on every sample, fail over after three missed ones.
        Self {
            update_interval: Duration::from_secs(5),
            failover_timeout: Duration::from_secs(30),
        }
    }
}

impl DedupConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.update_interval.is_zero() || self.update_interval >= self.failover_timeout {
            return Err(format!(
                "dedup-update-interval ({:?}) must be above 0 and below dedup-failover-timeout ({:?})",
                self.update_interval, self.failover_timeout
            ));
        }
        Ok(())
    }
}

/// Deduplication's settings as given (see [`crate::plumbing::settings`]); `None`: not given here.
#[derive(Debug, Clone, Default, clap::Args, serde::Deserialize)]
pub struct DedupOptions {
    /// Keep node-wide samples (node_*, rootfs_*) from one rank per (run, node) [default: true].
    #[arg(long, env = "MLSCOPE_DEDUP", value_name = "BOOL", action = clap::ArgAction::Set)]
    pub dedup: Option<bool>,
    /// How often a reporter's lease is renewed in the store (a higher last step is written at once, whatever the interval) [default: 5s].
    #[arg(long, env = "MLSCOPE_DEDUP_UPDATE_INTERVAL", value_parser = crate::plumbing::settings::parse_duration, value_name = "DURATION")]
    #[serde(default, with = "humantime_serde")]
    pub dedup_update_interval: Option<Duration>,
    /// Silence after which another rank takes over a node's series [default: 30s].
    #[arg(long, env = "MLSCOPE_DEDUP_FAILOVER_TIMEOUT", value_parser = crate::plumbing::settings::parse_duration, value_name = "DURATION")]
    #[serde(default, with = "humantime_serde")]
    pub dedup_failover_timeout: Option<Duration>,
}

impl DedupOptions {
    /// Whether deduplication is on ([`ENABLED_BY_DEFAULT`] unless given), and its lease timings
    /// over the defaults.
    pub fn resolve(self) -> (bool, DedupConfig) {
        let d = DedupConfig::default();
        let config = DedupConfig {
            update_interval: self.dedup_update_interval.unwrap_or(d.update_interval),
            failover_timeout: self.dedup_failover_timeout.unwrap_or(d.failover_timeout),
        };
        (self.dedup.unwrap_or(ENABLED_BY_DEFAULT), config)
    }
}

/// What to do with a rank's node-wide samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Keep them, adding `step_offset` to their steps, except those measured at or before
    /// `covered_until` (unix ms; -1: none): the reporter before this one covered that time, and
    /// keeping them would put the series' later steps at earlier times.
    Report {
        step_offset: i64,
        covered_until: i64,
    },
    /// Drop them: `reporter` holds the seat.
    Standby { reporter: i64 },
    /// Refuse them: a step (or the step after the handover offset) lies outside
    /// ±[`MAX_NODE_STEP`], where the arithmetic of offsets could overflow.
    StepOutOfRange,
}

/// Largest node-series step, before and after the handover offset, in either direction. Far
/// above any real step counter (2^61); it keeps `last_step + 1 - first_step` and `step + offset`
/// inside an i64 in Rust and in SQL, whatever steps a client sends.
pub(crate) const MAX_NODE_STEP: i64 = 1 << 61;

/// What happened in one decision, for the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    None,
    /// First reporter of a (run, node).
    Elected,
    /// A new reporter replaced a silent one.
    Failover,
}

#[derive(Debug)]
struct CachedLease {
    lease: Option<NodeLease>,
    /// When this replica last wrote the lease to the store.
    written_at: i64,
}

type LeaseKey = (String, String);

pub struct Deduplicator {
    store: Store,
    clock: Arc<dyn Clock>,
    config: DedupConfig,
    /// Per-(run, node) state behind its own async lock, so decisions for one node are serialized
    /// while different nodes proceed in parallel.
    cache: Mutex<HashMap<LeaseKey, Arc<tokio::sync::Mutex<CachedLease>>>>,
}

/// Cached leases kept in memory before idle ones are forgotten (the store keeps them).
const CACHE_LIMIT: usize = 100_000;

impl Deduplicator {
    pub fn new(store: Store, clock: Arc<dyn Clock>, config: DedupConfig) -> Self {
        Self {
            store,
            clock,
            config,
            cache: Mutex::new(HashMap::new()),
        }
    }

    pub fn config(&self) -> DedupConfig {
        self.config
    }

    fn entry(&self, run_id: &str, node: &str) -> Arc<tokio::sync::Mutex<CachedLease>> {
        let mut cache = self.cache.lock().expect("lease cache lock");
        if cache.len() >= CACHE_LIMIT {
            // Finished runs never send again; forgetting them only costs a store read.
            cache.retain(|_, entry| Arc::strong_count(entry) > 1);
        }
        cache
            .entry((run_id.to_owned(), node.to_owned()))
            .or_insert_with(|| {
                Arc::new(tokio::sync::Mutex::new(CachedLease {
                    lease: None,
                    written_at: i64::MIN,
                }))
            })
            .clone()
    }

    /// Decides for a batch of node-wide samples from `rank` on `node`, whose steps span
    /// `first_step..=last_step` and whose latest sample was measured at `last_timestamp` (unix
    /// ms; -1 when unknown). A reporter's lease records the batch's last step (after offset) and
    /// time before the samples are forwarded.
    pub async fn decide(
        &self,
        run_id: &str,
        node: &str,
        rank: i64,
        (first_step, last_step): (i64, i64),
        last_timestamp: i64,
    ) -> Result<(Decision, Event), StoreError> {
        if first_step < -MAX_NODE_STEP || last_step > MAX_NODE_STEP {
            return Ok((Decision::StepOutOfRange, Event::None));
        }
        let entry = self.entry(run_id, node);
        let mut cached = entry.lock().await;
        let now = self.clock.now_ms();
        let failover = self.config.failover_timeout.as_millis() as i64;
        let update = self.config.update_interval.as_millis() as i64;

        // A lease that looks expired here may have been renewed through another replica.
        let stale = cached
            .lease
            .as_ref()
            .is_none_or(|lease| now - lease.renewed_at > failover);
        if stale {
            cached.lease = self.store.lease(run_id, node).await?;
            cached.written_at = cached.lease.as_ref().map_or(i64::MIN, |l| l.renewed_at);
        }

        for _attempt in 0..2 {
            match cached.lease.clone() {
                Some(mut lease) if lease.reporter_rank == rank => {
                    if last_step + lease.step_offset > MAX_NODE_STEP {
                        return Ok((Decision::StepOutOfRange, Event::None));
                    }
                    // A higher step is written at once, whatever the update interval: a handover
                    // must continue after the last step stored, however quickly it was sent.
                    let advanced = last_step + lease.step_offset > lease.last_step
                        || last_timestamp > lease.last_timestamp;
                    lease.last_step = lease.last_step.max(last_step + lease.step_offset);
                    lease.last_timestamp = lease.last_timestamp.max(last_timestamp);
                    if advanced
                        || now - cached.written_at >= update
                        || now - lease.renewed_at > failover
                    {
                        if !self.store.renew(&lease, now).await? {
                            // Deposed while silent: learn who holds the seat now and decide again.
                            cached.lease = self.store.lease(run_id, node).await?;
                            continue;
                        }
                        cached.written_at = now;
                    }
                    lease.renewed_at = now;
                    let decision = Decision::Report {
                        step_offset: lease.step_offset,
                        covered_until: lease.covered_until,
                    };
                    cached.lease = Some(lease);
                    return Ok((decision, Event::None));
                }
                Some(lease) if now - lease.renewed_at <= failover => {
                    return Ok((
                        Decision::Standby {
                            reporter: lease.reporter_rank,
                        },
                        Event::None,
                    ));
                }
                previous => {
                    let expired_before = now - failover;
                    match self
                        .store
                        .elect(run_id, node, rank, now, expired_before, first_step)
                        .await?
                    {
                        Some(mut lease) => {
                            let event = if previous.is_some() || lease.epoch > 1 {
                                Event::Failover
                            } else {
                                Event::Elected
                            };
                            let step_offset = lease.step_offset;
                            if last_step + step_offset > MAX_NODE_STEP {
                                // The seat is taken; this batch is refused and the next decides again.
                                cached.lease = Some(lease);
                                cached.written_at = now;
                                return Ok((Decision::StepOutOfRange, event));
                            }
                            lease.last_step = lease.last_step.max(last_step + step_offset);
                            lease.last_timestamp = lease.last_timestamp.max(last_timestamp);
                            // Record the first batch's steps at once: a handover right after
                            // must continue after them.
                            self.store.renew(&lease, now).await?;
                            cached.written_at = now;
                            let decision = Decision::Report {
                                step_offset,
                                covered_until: lease.covered_until,
                            };
                            cached.lease = Some(lease);
                            return Ok((decision, event));
                        }
                        None => {
                            // Another replica elected someone in the meantime.
                            cached.lease = self.store.lease(run_id, node).await?;
                            cached.written_at =
                                cached.lease.as_ref().map_or(i64::MIN, |l| l.renewed_at);
                        }
                    }
                }
            }
        }
        // Two rounds without a stable answer: keep the samples out rather than risk a second
        // reporter; the next sample decides again.
        let reporter = cached.lease.as_ref().map_or(-1, |l| l.reporter_rank);
        Ok((Decision::Standby { reporter }, Event::None))
    }

    /// The stored leases of a run, for the admin view.
    pub async fn leases_of_run(&self, run_id: &str) -> Result<Vec<NodeLease>, StoreError> {
        self.store.leases_of_run(run_id).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn setup(config: DedupConfig) -> (Deduplicator, ManualClock, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&format!("sqlite://{}/s.db", dir.path().display()))
            .await
            .unwrap();
        let clock = ManualClock::new(1_800_000_000_000);
        (
            Deduplicator::new(store, Arc::new(clock.clone()), config),
            clock,
            dir,
        )
    }

    /// A report decision for a series no earlier reporter covered in time.
    fn report(step_offset: i64) -> Decision {
        Decision::Report {
            step_offset,
            covered_until: -1,
        }
    }

    const CONFIG: DedupConfig = DedupConfig {
        update_interval: Duration::from_secs(5),
        failover_timeout: Duration::from_secs(30),
    };

    #[tokio::test]
    async fn the_first_rank_reports_and_the_others_stand_by() {
        let (dedup, clock, _dir) = setup(CONFIG).await;
        assert_eq!(
            dedup.decide("run", "n1", 0, (0, 0), -1).await.unwrap(),
            (report(0), Event::Elected)
        );
        for rank in 1..4 {
            assert_eq!(
                dedup.decide("run", "n1", rank, (0, 0), -1).await.unwrap().0,
                Decision::Standby { reporter: 0 }
            );
        }
        // Another node of the same run elects its own reporter.
        assert_eq!(
            dedup.decide("run", "n2", 5, (0, 0), -1).await.unwrap().0,
            report(0)
        );
        clock.advance(Duration::from_secs(10));
        assert_eq!(
            dedup.decide("run", "n1", 0, (1, 1), -1).await.unwrap().0,
            report(0)
        );
        assert_eq!(
            dedup.decide("run", "n1", 2, (1, 1), -1).await.unwrap().0,
            Decision::Standby { reporter: 0 }
        );
    }

    #[tokio::test]
    async fn a_silent_reporter_is_replaced_after_the_failover_timeout_and_steps_continue() {
        let (dedup, clock, _dir) = setup(CONFIG).await;
        for step in 0..=20 {
            assert_eq!(
                dedup
                    .decide("run", "n1", 0, (step, step), -1)
                    .await
                    .unwrap()
                    .0,
                report(0)
            );
            assert!(matches!(
                dedup
                    .decide("run", "n1", 1, (step + 3, step + 3), -1)
                    .await
                    .unwrap()
                    .0,
                Decision::Standby { .. }
            ));
            clock.advance(Duration::from_secs(10));
        }
        // Rank 0 goes silent. Until the timeout has passed rank 1 stays standby...
        clock.advance(Duration::from_secs(10));
        assert!(matches!(
            dedup.decide("run", "n1", 1, (25, 25), -1).await.unwrap().0,
            Decision::Standby { reporter: 0 }
        ));
        clock.advance(Duration::from_secs(11));
        // ...then takes over, its step 26 continuing after rank 0's last step 20.
        let (decision, event) = dedup.decide("run", "n1", 1, (26, 26), -1).await.unwrap();
        assert_eq!(event, Event::Failover);
        let Decision::Report { step_offset, .. } = decision else {
            panic!("{decision:?}")
        };
        assert!(26 + step_offset > 20, "offset {step_offset}");
        // The old reporter, back from the dead, is refused.
        clock.advance(Duration::from_secs(1));
        assert_eq!(
            dedup.decide("run", "n1", 0, (21, 21), -1).await.unwrap().0,
            Decision::Standby { reporter: 1 }
        );
    }

    #[tokio::test]
    async fn a_taker_with_a_lower_step_counter_is_shifted_past_the_old_series() {
        let (dedup, clock, _dir) = setup(CONFIG).await;
        dedup.decide("run", "n1", 3, (100, 100), -1).await.unwrap();
        clock.advance(Duration::from_secs(31));
        let (decision, _) = dedup.decide("run", "n1", 4, (2, 2), -1).await.unwrap();
        assert_eq!(decision, report(99));
    }

    #[tokio::test]
    async fn extreme_steps_are_refused_and_never_block_the_node() {
        let (dedup, clock, _dir) = setup(CONFIG).await;
        assert_eq!(
            dedup.decide("run", "n1", 0, (5, 5), -1).await.unwrap().0,
            report(0)
        );
        clock.advance(Duration::from_secs(31));
        // A handover whose first step is i64::MIN would need an offset beyond i64.
        assert_eq!(
            dedup
                .decide("run", "n1", 1, (i64::MIN, i64::MIN), -1)
                .await
                .unwrap()
                .0,
            Decision::StepOutOfRange
        );
        assert_eq!(
            dedup
                .decide("run", "n1", 1, (i64::MAX - 1, i64::MAX), -1)
                .await
                .unwrap()
                .0,
            Decision::StepOutOfRange
        );
        // The lease still reads back and the series continues after step 5, for any rank.
        let (decision, _) = dedup.decide("run", "n1", 1, (0, 0), -1).await.unwrap();
        assert_eq!(decision, report(6));
        assert_eq!(
            dedup
                .decide("run", "n1", 1, (MAX_NODE_STEP - 6, MAX_NODE_STEP - 6), -1)
                .await
                .unwrap()
                .0,
            report(6)
        );
        assert_eq!(
            dedup
                .decide("run", "n1", 1, (MAX_NODE_STEP - 5, MAX_NODE_STEP - 5), -1)
                .await
                .unwrap()
                .0,
            Decision::StepOutOfRange
        );
        let lease = dedup.leases_of_run("run").await.unwrap().remove(0);
        assert_eq!(lease.last_step, MAX_NODE_STEP);
    }

    #[tokio::test]
    async fn a_handover_continues_after_steps_sent_faster_than_the_update_interval() {
        let (dedup, clock, _dir) = setup(CONFIG).await;
        for step in 0..5 {
            assert!(matches!(
                dedup
                    .decide("run", "n1", 0, (step, step), -1)
                    .await
                    .unwrap()
                    .0,
                Decision::Report { .. }
            ));
            clock.advance(Duration::from_millis(50));
        }
        clock.advance(Duration::from_secs(31));
        // A fresh replica (nothing cached) sees what the store holds.
        let other = Deduplicator::new(dedup.store.clone(), dedup.clock.clone(), CONFIG);
        let (decision, _) = other.decide("run", "n1", 1, (1, 1), -1).await.unwrap();
        assert_eq!(
            decision,
            report(4),
            "step 1 must be stored as 5, after the last step 4"
        );
    }

    #[tokio::test]
    async fn two_replicas_sharing_a_store_never_elect_two_reporters() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/s.db", dir.path().display());
        let clock = ManualClock::new(1_800_000_000_000);
        let a = Deduplicator::new(
            Store::open(&url).await.unwrap(),
            Arc::new(clock.clone()),
            CONFIG,
        );
        let b = Deduplicator::new(
            Store::open(&url).await.unwrap(),
            Arc::new(clock.clone()),
            CONFIG,
        );
        // Ranks 0 and 1 race on two replicas.
        let (ra, rb) = tokio::join!(
            a.decide("run", "n", 0, (0, 0), -1),
            b.decide("run", "n", 1, (0, 0), -1)
        );
        let reporters: Vec<_> = [ra.unwrap().0, rb.unwrap().0]
            .into_iter()
            .filter(|d| matches!(d, Decision::Report { .. }))
            .collect();
        assert_eq!(reporters.len(), 1);
        // Rank 0 sends alternately through both replicas; rank 1 never gets the seat.
        let reporter = if matches!(
            a.decide("run", "n", 0, (1, 1), -1).await.unwrap().0,
            Decision::Report { .. }
        ) {
            0
        } else {
            1
        };
        for step in 2..40 {
            clock.advance(Duration::from_secs(10));
            let via = if step % 2 == 0 { &a } else { &b };
            assert!(
                matches!(
                    via.decide("run", "n", reporter, (step, step), -1)
                        .await
                        .unwrap()
                        .0,
                    Decision::Report { .. }
                ),
                "step {step}"
            );
            let other = if step % 2 == 0 { &b } else { &a };
            assert!(
                matches!(
                    other
                        .decide("run", "n", 1 - reporter, (step, step), -1)
                        .await
                        .unwrap()
                        .0,
                    Decision::Standby { .. }
                ),
                "step {step}"
            );
        }
    }
}
