//! When a GPU counts as idle, and what that was judged on.
//!
//! NVML's utilisation is the share of time at least one kernel ran: a one-thread kernel spinning
//! on one SM shows 100 %. Where the device has GPM readings (Hopper and newer), idleness is
//! judged by SM activity instead, the share of SMs that had work; elsewhere by the two NVML
//! rates, as MLflow's own monitor could.

use std::time::Instant;

use super::{Gpm, GpuReading};
use crate::sources::round1;

/// Without GPM: utilisation and memory activity at or under this count as idle, in percent: a
/// process that holds a GPU but only waits (a stalled loader, a notebook between cells) stays at
/// 0-2 %.
pub const IDLE_THRESHOLD_PERCENT: u32 = 5;

/// With GPM: SM activity under this counts as idle, in percent (`--gpu-idle-below`). 5 % is
/// about 7 of an H100's 132 SMs kept busy: a one-thread kernel (0.8 %), a process polling the
/// GPU or a notebook between cells stays far under it, while training, even data-starved or with
/// small batches, keeps well above it over a sampling interval.
pub const DEFAULT_SM_IDLE_BELOW: f64 = 5.0;

/// What a GPU's idleness was judged on (the rank tag `mlscope/rank-<r>/gpu_idle_basis`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdleBasis {
    /// GPM's SM activity under `--gpu-idle-below`.
    SmActive,
    /// NVML's utilisation and memory activity both at or under [`IDLE_THRESHOLD_PERCENT`].
    Utilization,
}

impl IdleBasis {
    pub fn as_str(self) -> &'static str {
        match self {
            IdleBasis::SmActive => "sm_active",
            IdleBasis::Utilization => "utilization",
        }
    }

    /// The basis a reading is judged on for good: `None` while GPM is supported but has no
    /// reading yet (the first sample, or a failed one), when the tick falls back to utilisation.
    pub fn of(reading: &GpuReading) -> Option<IdleBasis> {
        match reading.gpm {
            Gpm::Measured(_) => Some(IdleBasis::SmActive),
            Gpm::Unsupported => Some(IdleBasis::Utilization),
            Gpm::Pending => None,
        }
    }
}

/// A rank's basis over its GPUs: `sm_active` or `utilization` when they agree, `mixed` when
/// they do not; `None` while any GPU's is not known yet, or without GPUs.
pub fn rank_basis(bases: &[Option<IdleBasis>]) -> Option<&'static str> {
    let first = (*bases.first()?)?;
    let mut mixed = false;
    for basis in bases {
        mixed |= (*basis)? != first;
    }
    Some(if mixed { "mixed" } else { first.as_str() })
}

/// How long each GPU has been idle: since the first idle reading, 0 while busy. Idle is SM
/// activity under `sm_idle_below` where GPM measured it, else both NVML rates at or under
/// [`IDLE_THRESHOLD_PERCENT`].
#[derive(Debug)]
pub struct IdleClock {
    since: Vec<Option<Instant>>,
    sm_idle_below: f64,
}

impl Default for IdleClock {
    fn default() -> Self {
        IdleClock::new(DEFAULT_SM_IDLE_BELOW)
    }
}

impl IdleClock {
    pub fn new(sm_idle_below: f64) -> Self {
        IdleClock {
            since: Vec::new(),
            sm_idle_below,
        }
    }

    /// Seconds device `index` has been idle as of `now`; `None` when neither GPM nor both NVML
    /// rates were read (then the series is left out and the clock restarts).
    pub fn observe(&mut self, index: u32, reading: &GpuReading, now: Instant) -> Option<f64> {
        let index = index as usize;
        if self.since.len() <= index {
            self.since.resize(index + 1, None);
        }
        let idle = match (reading.gpm, reading.utilization, reading.memory_activity) {
            (Gpm::Measured(gpm), _, _) => gpm.sm_active < self.sm_idle_below,
            (_, Some(gpu), Some(memory)) => {
                gpu <= IDLE_THRESHOLD_PERCENT && memory <= IDLE_THRESHOLD_PERCENT
            }
            _ => {
                self.since[index] = None;
                return None;
            }
        };
        if !idle {
            self.since[index] = None;
            return Some(0.0);
        }
        let since = *self.since[index].get_or_insert(now);
        Some(round1(now.saturating_duration_since(since).as_secs_f64()))
    }
}

#[cfg(test)]
mod tests {
    use super::super::GpmReading;
    use super::*;

    fn at(start: Instant, seconds: u64) -> Instant {
        start + std::time::Duration::from_secs(seconds)
    }

    fn rates(gpu: u32, memory: u32) -> GpuReading {
        GpuReading {
            utilization: Some(gpu),
            memory_activity: Some(memory),
            ..Default::default()
        }
    }

    fn with_sm(gpu: u32, sm_active: f64) -> GpuReading {
        GpuReading {
            gpm: Gpm::Measured(GpmReading {
                sm_active,
                ..Default::default()
            }),
            ..rates(gpu, 0)
        }
    }

    #[test]
    fn a_gpu_counts_as_idle_from_its_first_quiet_reading_until_either_rate_rises() {
        let start = Instant::now();
        let mut clock = IdleClock::default();
        assert_eq!(clock.observe(1, &rates(97, 60), at(start, 0)), Some(0.0));
        assert_eq!(clock.observe(1, &rates(0, 0), at(start, 10)), Some(0.0));
        assert_eq!(clock.observe(1, &rates(3, 5), at(start, 70)), Some(60.0));
        // Memory traffic alone (e.g. a copy) is work.
        assert_eq!(clock.observe(1, &rates(0, 30), at(start, 80)), Some(0.0));
        assert_eq!(clock.observe(1, &rates(0, 0), at(start, 90)), Some(0.0));
        assert_eq!(clock.observe(1, &rates(0, 0), at(start, 100)), Some(10.0));
        // A failed query: no series, and idleness counts anew.
        let unknown = GpuReading::default();
        assert_eq!(clock.observe(1, &unknown, at(start, 110)), None);
        assert_eq!(clock.observe(1, &rates(0, 0), at(start, 120)), Some(0.0));
        // Device 0 has its own clock.
        assert_eq!(clock.observe(0, &rates(0, 0), at(start, 120)), Some(0.0));
    }

    #[test]
    fn a_gpu_at_full_utilization_and_one_percent_sm_activity_is_idle() {
        let start = Instant::now();
        let mut clock = IdleClock::default();
        assert_eq!(
            clock.observe(0, &with_sm(100, 1.0), at(start, 0)),
            Some(0.0)
        );
        assert_eq!(
            clock.observe(0, &with_sm(100, 0.8), at(start, 10)),
            Some(10.0)
        );
        assert_eq!(
            clock.observe(0, &with_sm(100, 1.0), at(start, 70)),
            Some(70.0)
        );
        // Real work: the SMs have it.
        assert_eq!(
            clock.observe(0, &with_sm(100, 62.5), at(start, 80)),
            Some(0.0)
        );
        // Under the threshold, not at it.
        let mut strict = IdleClock::new(5.0);
        assert_eq!(strict.observe(0, &with_sm(0, 5.0), at(start, 0)), Some(0.0));
        assert_eq!(
            strict.observe(0, &with_sm(0, 5.0), at(start, 10)),
            Some(0.0)
        );
        let mut lenient = IdleClock::new(20.0);
        assert_eq!(
            lenient.observe(0, &with_sm(100, 15.0), at(start, 0)),
            Some(0.0)
        );
        assert_eq!(
            lenient.observe(0, &with_sm(100, 15.0), at(start, 10)),
            Some(10.0)
        );
    }

    #[test]
    fn without_a_gpm_reading_the_clock_judges_by_utilization_as_before() {
        let start = Instant::now();
        for gpm in [Gpm::Unsupported, Gpm::Pending] {
            let mut clock = IdleClock::default();
            let spin = GpuReading {
                gpm,
                ..rates(100, 0)
            };
            assert_eq!(clock.observe(0, &spin, at(start, 0)), Some(0.0));
            assert_eq!(clock.observe(0, &spin, at(start, 10)), Some(0.0));
            let quiet = GpuReading { gpm, ..rates(0, 0) };
            assert_eq!(clock.observe(0, &quiet, at(start, 20)), Some(0.0));
            assert_eq!(clock.observe(0, &quiet, at(start, 30)), Some(10.0));
        }
    }

    #[test]
    fn a_ranks_basis_is_known_once_every_gpu_has_one() {
        let (sm, util) = (Some(IdleBasis::SmActive), Some(IdleBasis::Utilization));
        assert_eq!(rank_basis(&[sm, sm]), Some("sm_active"));
        assert_eq!(rank_basis(&[util]), Some("utilization"));
        assert_eq!(rank_basis(&[sm, util]), Some("mixed"));
        assert_eq!(rank_basis(&[sm, None]), None);
        assert_eq!(rank_basis(&[None, util]), None);
        assert_eq!(rank_basis(&[]), None);
        let pending = GpuReading {
            gpm: Gpm::Pending,
            ..Default::default()
        };
        assert_eq!(IdleBasis::of(&pending), None);
        assert_eq!(IdleBasis::of(&GpuReading::default()), util);
        assert_eq!(IdleBasis::of(&with_sm(1, 1.0)), sm);
    }
}
