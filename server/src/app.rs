//! Wiring: shared state, the two routers, and `run`, which serves until a shutdown future
//! resolves and then drains within the configured deadline.

use std::future::{Future, IntoFuture};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use tokio::net::TcpListener;

use crate::artifacts::Gateway;
use crate::config::Config;
use crate::dedup::{Deduplicator, SystemClock};
use crate::proxy::{self, Forwarder};
use crate::rewrite::{MetricsRewriter, SharedRewriter};
use crate::store::{Replica, Store};
use crate::telemetry::Metrics;

/// Everything a handler may need; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub forwarder: Forwarder,
    pub store: Store,
    pub metrics: Metrics,
    pub replica: Arc<Replica>,
    /// System-metric scoping and node deduplication on the metrics endpoints.
    pub rewriter: SharedRewriter,
    /// The artifact gateway, when an artifacts destination is configured.
    pub artifacts: Option<Gateway>,
    /// Set on shutdown so `/readyz` turns away new traffic while requests drain.
    pub draining: Arc<AtomicBool>,
}

impl AppState {
    /// Opens and migrates the store and builds the upstream client.
    pub async fn new(config: &Config) -> anyhow::Result<Self> {
        let store = Store::open(&config.database_url)
            .await
            .context("opening the state store")?;
        let replica = Replica::new();
        store
            .heartbeat(&replica)
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
        let rewriter = Arc::new(MetricsRewriter::new(
            config.scopes.clone(),
            dedup,
            metrics.clone(),
        ));
        let forwarder = Forwarder::new(config, metrics.clone());
        let artifacts = Gateway::new(
            &config.artifacts,
            forwarder.clone(),
            store.clone(),
            metrics.clone(),
        )
        .await;
        Ok(Self {
            forwarder,
            artifacts,
            rewriter,
            store,
            metrics,
            replica: Arc::new(replica),
            draining: Arc::new(AtomicBool::new(false)),
        })
    }
}

/// The MLflow-facing router: everything not intercepted is forwarded.
pub fn app(state: AppState) -> Router {
    Router::new().fallback(proxy::forward).with_state(state)
}

/// Serves both listeners until `shutdown` resolves, then stops accepting, lets in-flight requests
/// finish for at most `config.shutdown_grace`, and returns.
pub async fn run(
    config: Config,
    listener: TcpListener,
    admin_listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let state = AppState::new(&config).await?;
    tracing::info!(
        listen = %listener.local_addr()?,
        admin = %admin_listener.local_addr()?,
        upstream = %state.forwarder.upstream().url(),
        store = state.store.backend(),
        artifacts = state.artifacts.as_ref().map(|g| g.bucket().destination.to_string()).unwrap_or_else(|| "forwarded".into()),
        replica = %state.replica.id,
        "mlscope-proxy started"
    );

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = move |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let main = crate::serve::serve(
        listener,
        app(state.clone()),
        config.inbound,
        state.metrics.clone(),
        stopped(stop_rx.clone()),
    );
    let admin = axum::serve(admin_listener, crate::admin::router(state.clone()))
        .with_graceful_shutdown(stopped(stop_rx))
        .into_future();
    let mut main = tokio::spawn(main);
    let admin = tokio::spawn(admin);
    let heartbeat = tokio::spawn(heartbeat(state.clone()));
    let auth_detector = state
        .artifacts
        .as_ref()
        .map(|g| g.authorizer().spawn_detector());

    tokio::select! {
        result = &mut main => {
            // The server ended on its own: that is an error, not a shutdown.
            result.context("server task")?;
            anyhow::bail!("the MLflow-facing listener stopped serving");
        }
        () = shutdown => {
            tracing::info!(grace = ?config.shutdown_grace, "shutdown requested; draining in-flight requests");
            state.draining.store(true, Ordering::Relaxed);
            let _ = stop_tx.send(true);
            match tokio::time::timeout(config.shutdown_grace, &mut main).await {
                Ok(result) => {
                    result.context("server task")?;
                    tracing::info!("drained");
                }
                Err(_) => {
                    tracing::warn!(in_flight = state.metrics.in_flight.get(), "shutdown grace expired; abandoning in-flight requests");
                    main.abort();
                }
            }
        }
    }
    let _ = stop_tx.send(true);
    heartbeat.abort();
    if let Some(detector) = auth_detector {
        detector.abort();
    }
    let _ = tokio::time::timeout(Duration::from_secs(1), admin).await;
    state.store.close().await;
    Ok(())
}

/// Refreshes this replica's row so the store lists live replicas.
async fn heartbeat(state: AppState) {
    let mut tick = tokio::time::interval(Duration::from_secs(15));
    loop {
        tick.tick().await;
        if let Err(e) = state.store.heartbeat(&state.replica).await {
            tracing::warn!(error = %e, "state store heartbeat failed");
        }
    }
}
