//! The route table (which requests mlscope changes, and who answers them), its layers, and
//! `run`, which serves both listeners until a shutdown future resolves and then drains within the
//! configured deadline.

use std::convert::Infallible;
use std::future::{Future, IntoFuture};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{self, Poll};
use std::time::Duration;

use anyhow::Context;
use axum::extract::{ConnectInfo, Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use http::StatusCode;
use tokio::net::TcpListener;

use crate::capabilities::artifacts::{self, legacy_listing};
use crate::capabilities::authz::{AuthMode, Authorizer};
use crate::capabilities::fairshare::{self, FairShare};
use crate::capabilities::health;
use crate::capabilities::metric_routes::{self, MetricWrites};
use crate::capabilities::rewrite::body::Endpoint;
use crate::plumbing::layers::{self, ConcurrencyLimit};
use crate::plumbing::proxy;
use crate::shell::config::Config;
use crate::shell::serve::Serving;
use crate::shell::state::AppState;

/// MLflow's API prefixes, under each of which the proxy answers its writes.
const API_PREFIXES: [&str; 3] = ["/api/2.0/mlflow", "/ajax-api/2.0/mlflow", "/api/3.0/mlflow"];

/// The MLflow-facing service: the route table for the requests mlscope changes, each answered
/// by its capability, and forwarding to MLflow for everything else (methods a route does not
/// take included). Every request goes through the same steps ([`front`]).
pub fn app(state: AppState, max_in_flight: usize) -> Mlflow {
    let mut intercepted = Intercepted::default();
    let mut router = Router::new();
    for prefix in API_PREFIXES {
        // System-metric scoping and node deduplication: a POST is the metric lane's (see
        // `Mlflow`), any other method MLflow's.
        for (route, endpoint) in [
            ("runs/log-batch", Endpoint::LogBatch),
            ("runs/log-metric", Endpoint::LogMetric),
        ] {
            intercepted
                .paths
                .insert(format!("{prefix}/{route}"), Some(endpoint));
        }
        let routes = [
            // Write coalescing: params and tags join their run's queue (and are signs of life).
            ("runs/log-parameter", post(metric_routes::log_pair)),
            ("runs/set-tag", post(metric_routes::log_pair)),
            // Run health: a run its client ended is billed.
            ("runs/update", post(health::update_run)),
        ];
        for (route, handler) in routes {
            let path = format!("{prefix}/{route}");
            router = router.route(&path, handler);
            intercepted.paths.insert(path, None);
        }
    }
    match &state.artifacts {
        // The artifact API, answered from the store.
        Some(gateway) => {
            router = router.merge(artifacts::router(gateway.clone()));
            intercepted.prefixes.extend(artifacts::PREFIXES);
        }
        // Listings of MLflow servers before 3.16, with directory markers removed.
        None => {
            for path in legacy_listing::PATHS {
                router = router.route(path, get(legacy_listing::forward_filtered));
                intercepted.paths.insert(path.to_owned(), None);
            }
        }
    }
    router = router
        .fallback(proxy::forward)
        .method_not_allowed_fallback(proxy::forward);
    let front = Arc::new(FrontSteps {
        metrics: state.metrics.clone(),
        limit: ConcurrencyLimit::new(max_in_flight, state.metrics.clone()),
        fair_share: state.fair_share.clone(),
        auth: state.authorizer.as_ref().map(|authz| authz.mode().clone()),
    });
    let forwarder = state.forwarder.clone();
    let metric_writes = MetricWrites {
        rewriter: state.rewriter.clone(),
        coalescer: state.coalescer.clone(),
        health: state.health.clone(),
    };
    let router = router
        .layer(middleware::from_fn_with_state(front.clone(), front_steps))
        .with_state(state);
    Mlflow {
        router,
        lane: Arc::new(Lane {
            intercepted,
            front,
            forwarder,
            metric_writes,
        }),
    }
}

/// The paths the forwarding lane does not answer: the metric writes' (the metric lane's) and
/// those the route table answers itself (exactly, or everything under a prefix). Every other
/// path would only reach the route table's fallback, forwarding.
#[derive(Default)]
struct Intercepted {
    /// Each path with, for a metric write, the endpoint the metric lane answers a POST to it as.
    paths: std::collections::HashMap<String, Option<Endpoint>>,
    prefixes: Vec<&'static str>,
}

/// Who answers a request: the forwarding lane, the metric lane or the route table.
enum Answerer {
    Forward,
    Metrics(Endpoint),
    Table,
}

impl Intercepted {
    fn answerer(&self, method: &http::Method, path: &str) -> Answerer {
        match self.paths.get(path) {
            Some(Some(endpoint)) if method == http::Method::POST => Answerer::Metrics(*endpoint),
            // Not a write: MLflow answers it.
            Some(Some(_)) => Answerer::Forward,
            Some(None) => Answerer::Table,
            None if self.prefixes.iter().any(|p| path.starts_with(p)) => Answerer::Table,
            None => Answerer::Forward,
        }
    }
}

/// The MLflow-facing service. A request whose path no capability answers is forwarded straight
/// through the same steps, without the route table: it would only reach the table's fallback,
/// and routing it (two routers, the layer's clone of the boxed route beneath it, the handler's
/// extractors) was a tenth of a forwarded request's CPU. A metric write (`POST` to `log-batch`
/// or `log-metric`) goes likewise straight to its handler, with the same steps: the write path
/// is the one whose time matters most. Every other request goes through the route table.
#[derive(Clone)]
pub struct Mlflow {
    router: Router,
    lane: Arc<Lane>,
}

/// What the forwarding and metric lanes need: which paths are not the forwarding lane's, the
/// steps, the forwarder and the metric routes' parts.
struct Lane {
    intercepted: Intercepted,
    front: Arc<FrontSteps>,
    forwarder: proxy::Forwarder,
    metric_writes: MetricWrites,
}

impl tower::Service<Request> for Mlflow {
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut task::Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request) -> Self::Future {
        // Routing happens on the path MLflow's server routes on (decoded once), so no spelling
        // of a path escapes the route that handles it.
        let request = layers::route_as_mlflow(request);
        let peer = request
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|ConnectInfo(peer)| *peer);
        let Some(peer) = peer else {
            return Box::pin(tower::Service::call(&mut self.router, request));
        };
        match (self.lane.intercepted).answerer(request.method(), request.uri().path()) {
            Answerer::Forward => {
                let lane = self.lane.clone();
                Box::pin(async move {
                    let forwarder = &lane.forwarder;
                    let forward = |request| forwarder.forward(request, peer);
                    Ok(front(&lane.front, request, forward).await)
                })
            }
            Answerer::Metrics(endpoint) => {
                let lane = self.lane.clone();
                Box::pin(async move {
                    let writes = &lane.metric_writes;
                    // Boxed where it starts: the write's future is large, and held inline by
                    // the steps' futures it would be copied at every step.
                    let write = |request| Box::pin(writes.write(request, endpoint, peer));
                    Ok(front(&lane.front, request, write).await)
                })
            }
            Answerer::Table => Box::pin(tower::Service::call(&mut self.router, request)),
        }
    }
}

/// What the steps every route goes through hold, shared by every request.
struct FrontSteps {
    metrics: crate::plumbing::telemetry::Metrics,
    limit: ConcurrencyLimit,
    fair_share: Option<Arc<FairShare>>,
    /// Present where the authorizer runs.
    auth: Option<AuthMode>,
}

/// The steps of [`front`] as the route table's one layer.
async fn front_steps(
    State(steps): State<Arc<FrontSteps>>,
    request: Request,
    next: Next,
) -> Response {
    front(&steps, request, |request| next.run(request)).await
}

/// The steps every request goes through, composed (see `plumbing::layers` for why not as layers
/// of their own), outermost first: request id, span, log line and metrics; the concurrency limit
/// (with a quarter kept for reads); refusal of ambiguous requests; MLflow's browser-protection
/// headers; each client's share of MLflow's writes (a read only teaches it which credentials
/// MLflow authenticated); and, where the authorizer runs, a 401 from MLflow on anything forwarded
/// telling it that MLflow authenticates. `routed` answers the request once the steps let it through.
async fn front<F, R>(steps: &FrontSteps, request: Request, routed: F) -> Response
where
    F: FnOnce(Request) -> R,
    R: Future<Output = Response>,
{
    let routed = move |request: Request| async move {
        let response = routed(request).await;
        if let Some(auth) = &steps.auth {
            watch_unauthorized(auth, &response);
        }
        response
    };
    layers::observe(&steps.metrics, request, |request| {
        layers::limit_concurrency(&steps.limit, request, |request| {
            layers::refuse_ambiguous(request, |request| {
                layers::security_headers(request, |request| async move {
                    match &steps.fair_share {
                        Some(share) => fairshare::admit(share, request, routed).await,
                        None => routed(request).await,
                    }
                })
            })
        })
    })
    .await
}

/// A 401 from MLflow on any forwarded request means it authenticates: from then on the
/// authorizer asks it about every gateway request and node-metric write, without waiting for its
/// next detection.
fn watch_unauthorized(mode: &AuthMode, response: &Response) {
    if response.status() == StatusCode::UNAUTHORIZED {
        mode.saw_unauthorized();
    }
}

/// Serves both listeners until `shutdown` resolves, then stops accepting, lets in-flight requests
/// finish for at most `config.serve.shutdown_grace`, and returns.
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
        artifacts = state.artifacts.as_ref().map(|g| g.bucket().destination().to_string()).unwrap_or_else(|| "forwarded".into()),
        replica = %state.replica.id,
        "mlscope-proxy started"
    );

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = move |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let mut serving = Serving::start(
        listener,
        app(state.clone(), config.serve.max_in_flight),
        config.serve.inbound,
        state.metrics.clone(),
        config.serve.threads,
    )
    .context("starting the serving threads")?;
    let admin = axum::serve(admin_listener, crate::shell::admin::router(state.clone()))
        .with_graceful_shutdown(stopped(stop_rx))
        .into_future();
    let admin = tokio::spawn(admin);
    let replica_row = tokio::spawn(refresh_replica(state.clone()));
    let sweeper = tokio::spawn(sweep(state.clone(), config.store.state_retention));
    let auth_detector = state.authorizer.as_ref().map(Authorizer::spawn_detector);
    let upstream_check = state
        .upstream_version
        .spawn_learner(state.forwarder.clone());
    let coalescer_adapts = state.coalescer.adapt_to(state.upstream_version.clone());
    let health = config.health.enabled.then(|| state.health.spawn());

    tokio::select! {
        () = serving.stopped() => {
            // A serving thread ended on its own: that is an error, not a shutdown.
            anyhow::bail!("the MLflow-facing listener stopped serving");
        }
        () = shutdown => {
            tracing::info!(grace = ?config.serve.shutdown_grace, "shutdown requested; draining in-flight requests");
            state.draining.store(true, Ordering::Relaxed);
            let _ = stop_tx.send(true);
            match tokio::time::timeout(config.serve.shutdown_grace, serving.drain()).await {
                Ok(0) => tracing::info!("drained"),
                Ok(panicked) => tracing::error!(
                    panicked,
                    "drained, but serving threads panicked on the way; their open connections were cut"
                ),
                Err(_) => {
                    tracing::warn!(in_flight = state.metrics.in_flight.get(), "shutdown grace expired; abandoning in-flight requests");
                }
            }
        }
    }
    let _ = stop_tx.send(true);
    replica_row.abort();
    sweeper.abort();
    if let Some(health) = health {
        health.abort();
        // What was heard since the last flush goes to the store before the process ends.
        state.health.flush().await;
    }
    if let Some(detector) = auth_detector {
        detector.abort();
    }
    upstream_check.abort();
    coalescer_adapts.abort();
    let _ = tokio::time::timeout(Duration::from_secs(1), admin).await;
    state.store.close().await;
    // Only now do the serving threads' runtimes end, with whatever a request left on them.
    drop(serving);
    Ok(())
}

/// Refreshes this replica's row so the store lists live replicas.
async fn refresh_replica(state: AppState) {
    let mut tick = tokio::time::interval(Duration::from_secs(15));
    loop {
        tick.tick().await;
        let written = state.store.refresh_replica(&state.replica).await;
        state.metrics.store_reachable(written.is_ok());
        if let Err(e) = written {
            tracing::warn!(error = %e, "refreshing this replica's row in the state store failed");
        }
    }
}

/// Deletes state rows nobody touched for `retention`, at startup and then hourly. Idempotent, so
/// every replica runs it without coordination.
async fn sweep(state: AppState, retention: Duration) {
    let mut tick = tokio::time::interval(Duration::from_secs(3600));
    loop {
        tick.tick().await;
        let now = std::time::SystemTime::now();
        let swept = async {
            let store = state.store.sweep(retention, now).await?;
            let health = state.health.sweep_expired(retention, now).await?;
            Ok::<_, crate::plumbing::store::StoreError>((store, health))
        };
        match swept.await {
            Ok((store, health))
                if store != crate::plumbing::store::Swept::default()
                    || health != crate::capabilities::health::store::HealthSwept::default() =>
            {
                tracing::info!(
                    leases = store.leases,
                    upload_failures = store.upload_failures,
                    replicas = store.replicas,
                    run_ranks = health.run_ranks,
                    verdicts = health.verdicts,
                    usage = health.usage,
                    "expired state swept"
                );
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "state retention sweep failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::sync::{Arc, Mutex};

    use axum::body::{to_bytes, Body};
    use axum::extract::ConnectInfo;
    use tower::ServiceExt as _;

    use super::*;

    /// What reached the stand-in MLflow: method, path, body.
    type Seen = Arc<Mutex<Vec<(String, String, String)>>>;

    /// A stand-in MLflow on loopback that answers `{}` to everything and records what it got
    /// (the proxy forwards over a socket; the route table itself is driven without one).
    async fn stand_in_mlflow() -> (String, Seen) {
        let seen: Seen = Arc::default();
        let record = seen.clone();
        let stub = Router::new().fallback(move |request: Request| {
            let record = record.clone();
            async move {
                let method = request.method().to_string();
                let path = request.uri().path().to_owned();
                let body = to_bytes(request.into_body(), 1 << 20)
                    .await
                    .unwrap_or_default();
                record.lock().unwrap().push((
                    method,
                    path,
                    String::from_utf8_lossy(&body).into_owned(),
                ));
                ([(http::header::CONTENT_TYPE, "application/json")], "{}")
            }
        });
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(axum::serve(listener, stub).into_future());
        (url, seen)
    }

    fn post(path: &str, body: &str, rank: Option<&str>) -> Request {
        let mut request = Request::post(path)
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(http::header::CONTENT_LENGTH, body.len());
        if let Some(rank) = rank {
            request = request
                .header("x-mlscope-node", "node-a")
                .header("x-mlscope-rank", rank);
        }
        let mut request = request.body(Body::from(body.to_owned())).unwrap();
        let peer: SocketAddr = "127.0.0.1:40000".parse().unwrap();
        request.extensions_mut().insert(ConnectInfo(peer));
        request
    }

    #[tokio::test]
    async fn the_route_table_sends_metric_writes_through_the_contract_and_the_rest_to_mlflow_unchanged(
    ) {
        let (mlflow, seen) = stand_in_mlflow().await;
        let dir = tempfile::tempdir().unwrap();
        let database = format!("sqlite://{}/state.db", dir.path().display());
        let config = Config::from_args([
            "mlscope-proxy",
            "--upstream",
            mlflow.as_str(),
            "--database-url",
            database.as_str(),
        ])
        .unwrap();
        let state = AppState::new(&config).await.unwrap();
        let store = state.store.clone();
        let app = app(state, 64);
        let batch = r#"{"run_id":"r1","metrics":[{"key":"system/cpu_utilization_percentage","value":1,"timestamp":1,"step":0}]}"#;
        for prefix in ["/api/2.0/mlflow", "/ajax-api/2.0/mlflow"] {
            let path = format!("{prefix}/runs/log-batch");
            let response = app
                .clone()
                .oneshot(post(&path, batch, Some("3")))
                .await
                .unwrap();
            assert_eq!(response.status(), StatusCode::OK, "{path}");
        }
        // Not a metric route: forwarded as sent, the `system/` key too.
        let other = r#"{"name":"system/cpu_utilization_percentage"}"#;
        let response = app
            .clone()
            .oneshot(post("/api/2.0/mlflow/experiments/create", other, Some("3")))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        // A path spelled with an encoded slash routes as MLflow routes it: a metric write.
        let response = app
            .clone()
            .oneshot(post("/api/2.0/mlflow/runs%2Flog-batch", batch, Some("3")))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        // Another method on a metric route is not a write of the lane's: MLflow answers it.
        let mut get = post("/api/2.0/mlflow/runs/log-batch", "", None);
        *get.method_mut() = http::Method::GET;
        let response = app.clone().oneshot(get).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);

        let seen = seen.lock().unwrap().clone();
        // (Besides the writes, the node lease asks MLflow once whether the run takes writes: an
        // empty log-batch of the run.)
        let writes: Vec<&(String, String, String)> = seen
            .iter()
            .filter(|(_, p, b)| p.ends_with("log-batch") && b.contains("metrics"))
            .collect();
        assert_eq!(writes.len(), 3, "{seen:?}");
        for (_, path, body) in &writes {
            assert!(
                body.contains("system/node-a/node_cpu_utilization_percentage"),
                "{path}: {body}"
            );
        }
        let created = seen
            .iter()
            .find(|(_, p, _)| p == "/api/2.0/mlflow/experiments/create")
            .unwrap();
        assert_eq!((created.0.as_str(), created.2.as_str()), ("POST", other));
        assert!(
            seen.iter()
                .any(|(m, p, _)| m == "GET" && p == "/api/2.0/mlflow/runs/log-batch"),
            "{seen:?}"
        );
        // Closed before its directory is removed, so that no connection opens one again.
        store.close().await;
    }
}
