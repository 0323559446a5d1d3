//! The fair share's metrics: what was admitted and refused (and why), per team named in the
//! configuration, and the learned limit on writes at MLflow at once. Registered into the proxy's
//! registry when the share is built, on or off.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use crate::plumbing::telemetry::Metrics;

/// `reason` is `none` for admitted writes, else one of the fair share's fixed set of reasons.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShareLabels {
    outcome: &'static str,
    reason: &'static str,
}

/// `team` is a name from the configuration file: the label set is bounded by it.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TeamLabels {
    team: String,
    outcome: &'static str,
}

/// The fair share's handles on its families; cheap to clone.
#[derive(Clone)]
pub(crate) struct FairShareMetrics {
    writes: Family<ShareLabels, Counter>,
    team_writes: Family<TeamLabels, Counter>,
    write_limit: Gauge,
    writes_at_mlflow: Gauge,
}

impl FairShareMetrics {
    /// The fair share's families, registered into `registry`.
    pub(crate) fn new(registry: &Metrics) -> Self {
        let fair_share = FairShareMetrics {
            writes: Family::default(),
            team_writes: Family::default(),
            write_limit: Gauge::default(),
            writes_at_mlflow: Gauge::default(),
        };
        registry.register(
            "fair_share_writes",
            "Writes to MLflow admitted, held back to wait for their turn (waited; then admitted or refused) or refused (429) by the per-client share, by outcome and reason (client_rate, client_samples, team_rate, team_samples, saturation)",
            fair_share.writes.clone(),
        );
        registry.register(
            "fair_share_team_writes",
            "Writes of the members of each team of the configuration, admitted or refused",
            fair_share.team_writes.clone(),
        );
        registry.register(
            "fair_share_write_limit",
            "Writes allowed at MLflow at once before the heaviest client is refused, learned from MLflow's latency",
            fair_share.write_limit.clone(),
        );
        registry.register(
            "fair_share_writes_at_mlflow",
            "Writes admitted by the share and not yet answered",
            fair_share.writes_at_mlflow.clone(),
        );
        fair_share
    }

    /// A write admitted (`reason` `none`) or refused by the share; `team` when its client is a
    /// member of one.
    pub(crate) fn write(&self, outcome: &'static str, reason: &'static str, team: Option<&str>) {
        self.writes
            .get_or_create(&ShareLabels { outcome, reason })
            .inc();
        if let Some(team) = team {
            self.team_writes
                .get_or_create(&TeamLabels {
                    team: team.to_owned(),
                    outcome,
                })
                .inc();
        }
    }

    /// The learned write limit and the writes at MLflow now.
    pub(crate) fn load(&self, limit: usize, at_mlflow: usize) {
        self.write_limit.set(limit as i64);
        self.writes_at_mlflow.set(at_mlflow as i64);
    }
}
