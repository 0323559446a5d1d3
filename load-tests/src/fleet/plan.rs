//! The fleet's plan: its simulated ranks and the schedule of every request they send.

use super::*;

/// One simulated rank.
#[derive(Debug, Clone)]
pub(super) struct Rank {
    pub(super) run: usize,
    pub(super) monitor: MonitoredRank,
    pub(super) trains: bool,
    pub(super) rank_zero: bool,
}

/// One scheduled request.
#[derive(Debug, Clone)]
pub(super) struct Event {
    pub(super) at: Duration,
    pub(super) rank: usize,
    pub(super) op: Op,
    /// Publish, step or checkpoint number.
    pub(super) seq: u64,
}

/// The fleet's ranks: node `n` in run `n mod runs`; training metrics from every rank or from
/// rank 0 of each run.
pub(super) fn fleet(args: &FleetArgs, ranks_per_node: u32) -> Vec<Rank> {
    let mut ranks = Vec::new();
    let mut first_of_run = vec![true; args.runs as usize];
    for node in 0..args.nodes {
        let run = (node % args.runs) as usize;
        for local in 0..ranks_per_node {
            // Global rank within the run: nodes of a run in order.
            let rank = (node / args.runs) * ranks_per_node + local;
            let rank_zero = std::mem::replace(&mut first_of_run[run], false);
            ranks.push(Rank {
                run,
                monitor: MonitoredRank::new(format!("node-{node}"), rank),
                trains: match args.training_from {
                    TrainingFrom::All => true,
                    TrainingFrom::Rank0 => rank_zero,
                },
                rank_zero,
            });
        }
    }
    ranks
}

/// Every request of the load phase, in time order. Ranks start spread evenly over one interval
/// (`steady`) or all at once (`burst`: a job's start, every rank at the same instant).
pub(super) fn schedule(args: &FleetArgs, ranks: &[Rank]) -> Vec<Event> {
    let real = |simulated: Duration| simulated.div_f64(args.time_scale);
    let interval = real(args.interval);
    let step = real(args.step_interval);
    let checkpoint = real(args.checkpoint_every);
    let mut events = Vec::new();
    for (index, rank) in ranks.iter().enumerate() {
        let offset = match args.scenario {
            Scenario::Steady | Scenario::MlflowRestart | Scenario::ReplicaKill => {
                interval.mul_f64(index as f64 / ranks.len() as f64)
            }
            Scenario::Burst => Duration::ZERO,
        };
        let mut periodic = |op: Op, period: Duration| {
            if period.is_zero() {
                return;
            }
            let mut seq = 0;
            while offset + period.mul_f64(seq as f64) < args.duration {
                events.push(Event {
                    at: offset + period.mul_f64(seq as f64),
                    rank: index,
                    op,
                    seq,
                });
                seq += 1;
            }
        };
        periodic(Op::System, interval);
        if rank.trains && args.training_metrics > 0 {
            periodic(Op::Training, step);
        }
        if rank.rank_zero {
            periodic(Op::Checkpoint, checkpoint);
            events.push(Event {
                at: offset,
                rank: index,
                op: Op::Start,
                seq: 0,
            });
        }
    }
    events.sort_by(|a, b| a.at.cmp(&b.at).then(a.op.cmp(&b.op)));
    events
}
