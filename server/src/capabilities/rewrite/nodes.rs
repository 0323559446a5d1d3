//! Node deduplication's part of a request's plan: its node-wide samples grouped per (node, rank),
//! one decision of [`crate::capabilities::dedup`] per group, and which samples go on under it.

use mlscope_scopes::Identity;

use super::body::{Metric, MetricsBody};
use super::{KeyPlan, MetricsRewriter};
use crate::capabilities::dedup::{Decision, Event, MAX_NODE_STEP};
use crate::plumbing::error::Error;

/// One (node, rank)'s node-wide samples in a request.
struct NodeBatch {
    node: String,
    rank: u32,
    first_step: i64,
    last_step: i64,
    /// Latest sample time (unix ms), -1 when none is readable.
    last_timestamp: i64,
    samples: u64,
    decision: Option<Decision>,
}

/// A request's node batches, and the batch of each of its metrics (`None`: not node-wide, or
/// without a node, rank, run or step).
pub(super) struct NodeBatches {
    batches: Vec<NodeBatch>,
    of_metric: Vec<Option<usize>>,
}

impl NodeBatches {
    fn gather(
        body: &MetricsBody<'_>,
        plans: &[KeyPlan],
        metric_plans: &[usize],
        run_id: Option<&str>,
    ) -> Self {
        let mut batches: Vec<NodeBatch> = Vec::new();
        let mut of_metric = Vec::with_capacity(body.metrics.len());
        for (metric, &index) in body.metrics.iter().zip(metric_plans) {
            let slot = match (&plans[index].dedup_identity, run_id, metric.step) {
                (Some((node, rank)), Some(_), Some(step)) => {
                    let slot = match batches
                        .iter()
                        .position(|b| &b.node == node && b.rank == *rank)
                    {
                        Some(i) => i,
                        None => {
                            batches.push(NodeBatch {
                                node: node.clone(),
                                rank: *rank,
                                first_step: step,
                                last_step: step,
                                last_timestamp: -1,
                                samples: 0,
                                decision: None,
                            });
                            batches.len() - 1
                        }
                    };
                    let batch = &mut batches[slot];
                    batch.first_step = batch.first_step.min(step);
                    batch.last_step = batch.last_step.max(step);
                    batch.last_timestamp = batch
                        .last_timestamp
                        .max(metric.timestamp_ms().unwrap_or(-1));
                    batch.samples += 1;
                    Some(slot)
                }
                _ => None,
            };
            of_metric.push(slot);
        }
        Self { batches, of_metric }
    }

    /// The node batch of each metric, in the body's order.
    pub(super) fn slots(&self) -> &[Option<usize>] {
        &self.of_metric
    }

    /// The decision for a metric's node batch (`None`: not deduplicated).
    pub(super) fn decision_of(&self, slot: Option<usize>) -> Option<Decision> {
        slot.and_then(|i| self.batches[i].decision)
    }
}

/// Whether a node-wide sample goes on under its batch's decision: not from a standby rank, and
/// not measured at or before the time the previous reporter covered (a sample without a readable
/// time goes on, and MLflow answers for it).
pub(super) fn keeps(decision: Option<Decision>, metric: &Metric<'_>) -> bool {
    match decision {
        Some(Decision::Standby { .. }) => false,
        Some(Decision::Report { covered_until, .. }) if covered_until >= 0 => {
            metric.timestamp_ms().is_none_or(|at| at > covered_until)
        }
        _ => true,
    }
}

impl MetricsRewriter {
    /// Groups the request's node-wide samples and decides each group once, when node
    /// deduplication is on and the client may log to the run; counts what is kept and dropped.
    pub(super) async fn decide_nodes(
        &self,
        body: &MetricsBody<'_>,
        plans: &[KeyPlan],
        metric_plans: &[usize],
        run_id: Option<&str>,
        request: &http::request::Parts,
    ) -> Result<NodeBatches, Error> {
        let mut nodes = NodeBatches::gather(body, plans, metric_plans, run_id);
        let dedup = match (&self.dedup, run_id) {
            (Some(dedup), Some(run_id)) if !nodes.batches.is_empty() => {
                let allowed = self.may_log(run_id, request).await?;
                if !allowed {
                    let samples = nodes.batches.iter().map(|b| b.samples).sum();
                    self.metrics.node_samples("refused_by_mlflow", samples);
                }
                allowed.then_some((dedup, run_id))
            }
            _ => None,
        };
        let Some((dedup, run_id)) = dedup else {
            return Ok(nodes);
        };
        for batch in &mut nodes.batches {
            let (decision, event) = dedup
                .decide(
                    run_id,
                    &batch.node,
                    i64::from(batch.rank),
                    (batch.first_step, batch.last_step),
                    batch.last_timestamp,
                )
                .await
                .map_err(|e| {
                    tracing::error!(error = %e, "lease store unavailable");
                    Error::Unavailable(
                        "mlscope-proxy could not reach its state store to deduplicate node metrics; retry shortly".into(),
                    )
                })?;
            match event {
                Event::Elected => self.metrics.election("elected"),
                Event::Failover => self.metrics.election("failover"),
                Event::None => {}
            }
            if decision == Decision::StepOutOfRange {
                self.metrics.rejected("step_out_of_range");
                return Err(Error::InvalidParameter(format!(
                    "the node-wide metrics of node {} carry steps {}..{}; node series take steps between -{max} and {max} (after any handover offset). Nothing of this request was stored.",
                    batch.node,
                    batch.first_step,
                    batch.last_step,
                    max = MAX_NODE_STEP
                )));
            }
            batch.decision = Some(decision);
        }
        // Each batch's samples as kept or dropped, a new reporter's samples from before its
        // predecessor's last one among the dropped.
        let mut kept_of = vec![0u64; nodes.batches.len()];
        for (metric, slot) in body.metrics.iter().zip(&nodes.of_metric) {
            if let Some(i) = *slot {
                if keeps(nodes.batches[i].decision, metric) {
                    kept_of[i] += 1;
                }
            }
        }
        for (batch, kept) in nodes.batches.iter().zip(kept_of) {
            let identity = Identity {
                node: Some(batch.node.clone()),
                rank: Some(batch.rank),
            };
            for (outcome, count, kept) in [
                ("kept", kept, true),
                ("dropped", batch.samples - kept, false),
            ] {
                if count > 0 {
                    self.metrics.node_samples(outcome, count);
                    self.stats.node_samples(run_id, &identity, kept, count);
                }
            }
        }
        Ok(nodes)
    }
}
