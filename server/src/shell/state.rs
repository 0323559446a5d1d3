//! The state every handler and layer shares, built once at startup. Handlers take only the
//! part they need (`State<Forwarder>`, `State<SharedRewriter>`, ...), through `FromRef`.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use anyhow::Context;
use axum::extract::FromRef;

use crate::capabilities::artifacts::{Gateway, GatewayMetrics};
use crate::capabilities::authz::Authorizer;
use crate::capabilities::coalesce::Coalescer;
use crate::capabilities::dedup::{Deduplicator, SystemClock};
use crate::capabilities::health::Health;
use crate::capabilities::rewrite::{MetricsRewriter, SharedRewriter};
use crate::plumbing::mlflow_version::LearnedVersion;
use crate::plumbing::proxy::Forwarder;
use crate::plumbing::store::{Replica, Store};
use crate::plumbing::telemetry::Metrics;
use crate::shell::config::Config;

/// Everything a handler may need; cheap to clone (one shared allocation: the route table clones
/// it for every request).
#[derive(Clone)]
pub struct AppState(Arc<Components>);

impl std::ops::Deref for AppState {
    type Target = Components;

    fn deref(&self) -> &Components {
        &self.0
    }
}

/// The components behind [`AppState`].
pub struct Components {
    pub forwarder: Forwarder,
    pub store: Store,
    pub metrics: Metrics,
    pub replica: Arc<Replica>,
    /// System-metric scoping and node deduplication on the metrics endpoints.
    pub rewriter: SharedRewriter,
    /// Merges concurrent metric writes per run (forwards them one by one when off).
    pub coalescer: Coalescer,
    /// The artifact gateway, when an artifacts destination is configured.
    pub artifacts: Option<Gateway>,
    /// Asks MLflow whether a client may do what the proxy does for it itself (serve artifacts,
    /// change deduplication state); `None` when the proxy does neither.
    pub authorizer: Option<Authorizer>,
    /// Heartbeats, the stale-run sweep and the run health view (records nothing when off).
    pub health: Health,
    /// Each client's share of the writes (token buckets); `None`: off.
    pub fair_share: Option<Arc<crate::capabilities::fairshare::FairShare>>,
    /// The upstream MLflow's version, once it has answered `/version`.
    pub upstream_version: LearnedVersion,
    /// Set on shutdown so `/readyz` turns away new traffic while requests drain.
    pub draining: Arc<AtomicBool>,
}

impl AppState {
    /// Opens and migrates the store and builds the upstream client.
    pub async fn new(config: &Config) -> anyhow::Result<Self> {
        let store = Store::open(&config.store.database_url)
            .await
            .context("opening the state store")?;
        let replica = Replica::new();
        store
            .refresh_replica(&replica)
            .await
            .context("registering this replica in the state store")?;
        let metrics = Metrics::new();
        let dedup = config.scopes.dedup.then(|| {
            Deduplicator::new(
                store.clone(),
                Arc::new(SystemClock),
                config.scopes.dedup_config,
            )
        });
        let forwarder =
            Forwarder::with_pools(&config.forwarder, metrics.clone(), config.serve.threads + 1);
        let authorizer = (dedup.is_some() || config.artifacts.destination.is_some())
            .then(|| Authorizer::new(forwarder.clone(), config.artifacts.authz_cache_ttl));
        let mut rewriter = MetricsRewriter::new(config.scopes.clone(), dedup, metrics.clone())
            .with_trusted_proxies(config.trusted_proxies.clone());
        if let Some(authz) = &authorizer {
            rewriter = rewriter.with_authorizer(authz.clone());
        }
        if config.health.enabled {
            rewriter = rewriter.with_beats();
        }
        let coalescer = Coalescer::new(config.coalesce, forwarder.clone(), metrics.clone());
        let health = Health::new(
            config.health.clone(),
            store.clone(),
            forwarder.clone(),
            coalescer.clone(),
            metrics.clone(),
            replica.id.clone(),
        );
        let rewriter = Arc::new(rewriter);
        let upstream_version = LearnedVersion::default();
        // The gateway's families are in `/metrics` whether or not it is on.
        let gateway_metrics = GatewayMetrics::new(&metrics);
        let artifacts = match &authorizer {
            Some(authz) => {
                Gateway::new(
                    &config.artifacts,
                    forwarder.clone(),
                    store.clone(),
                    authz.clone(),
                    coalescer.clone(),
                    gateway_metrics,
                    upstream_version.clone(),
                    config.trusted_proxies.clone(),
                )
                .await
            }
            None => None,
        };
        if let Some(gateway) = &artifacts {
            health.write_reports_through(crate::capabilities::artifacts::router(gateway.clone()));
        }
        let fair_share = crate::capabilities::fairshare::FairShare::new(
            &config.fair_share,
            config.trusted_proxies.clone(),
            metrics.clone(),
        );
        Ok(Self(Arc::new(Components {
            forwarder,
            artifacts,
            authorizer,
            rewriter,
            coalescer,
            store,
            metrics,
            replica: Arc::new(replica),
            health,
            fair_share,
            upstream_version,
            draining: Arc::new(AtomicBool::new(false)),
        })))
    }
}

impl FromRef<AppState> for Forwarder {
    fn from_ref(state: &AppState) -> Self {
        state.forwarder.clone()
    }
}

impl FromRef<AppState> for SharedRewriter {
    fn from_ref(state: &AppState) -> Self {
        state.rewriter.clone()
    }
}

impl FromRef<AppState> for Coalescer {
    fn from_ref(state: &AppState) -> Self {
        state.coalescer.clone()
    }
}

impl FromRef<AppState> for Health {
    fn from_ref(state: &AppState) -> Self {
        state.health.clone()
    }
}

impl FromRef<AppState> for Metrics {
    fn from_ref(state: &AppState) -> Self {
        state.metrics.clone()
    }
}
