//! The admin listener: liveness, readiness and Prometheus metrics, apart from the MLflow-facing
//! port so that probes and scrapes never compete with (or get mistaken for) MLflow traffic.

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;

use crate::capabilities::rewrite::stats::{ReporterView, RunView};
use crate::plumbing::error::Error;
use crate::shell::state::AppState;

pub(crate) fn router(state: AppState) -> Router {
    Router::new()
        .route("/", get(index))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/runs/{run_id}/scopes", get(run_scopes))
        .route("/runs/{run_id}/health", get(run_health))
        .route("/runs/{run_id}/report", get(run_report))
        .with_state(state)
}

/// What the admin port serves, for a person who opens it in a browser.
async fn index() -> Response {
    const PAGE: &str = concat!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>mlscope-proxy admin</title></head><body>",
        "<h1>mlscope-proxy: admin port</h1><p>Probes, metrics and per-run views; MLflow clients use the proxy's other port.</p><ul>",
        "<li><a href=\"/healthz\">/healthz</a>: the process is alive</li>",
        "<li><a href=\"/readyz\">/readyz</a>: ready for traffic (MLflow, the state store and the artifact store each checked)</li>",
        "<li><a href=\"/metrics\">/metrics</a>: Prometheus metrics</li>",
        "<li>/runs/<i>RUN_ID</i>/report: a run's report, what it used and wasted, with advice (a page; JSON with <code>Accept: application/json</code>)</li>",
        "<li>/runs/<i>RUN_ID</i>/health: a run's health, ranks, nodes and GPU bill</li>",
        "<li>/runs/<i>RUN_ID</i>/scopes: a run's scoped writers and each node's reporter</li>",
        "</ul></body></html>\n"
    );
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], PAGE).into_response()
}

/// The process is alive and serving.
async fn healthz() -> Json<serde_json::Value> {
    Json(json!({ "status": "ok" }))
}

/// Ready to take traffic: not draining, the upstream answers `/health`, the store takes a
/// write, and the artifact store (when the gateway serves artifacts) answers for the bucket. Each check reports its own error so an operator sees which part is down.
async fn readyz(State(state): State<AppState>) -> Response {
    let draining = state.draining.load(Ordering::Relaxed);
    let artifacts = async {
        match &state.artifacts {
            Some(gateway) => Some(gateway.check_store(Duration::from_secs(2)).await),
            None => None,
        }
    };
    let (upstream, store, artifacts) = tokio::join!(
        check_upstream(&state),
        state.store.refresh_replica(&state.replica),
        artifacts
    );
    let upstream_json = match &upstream {
        Ok(()) => json!({ "ok": true, "url": state.forwarder.upstream().url() }),
        Err(e) => json!({ "ok": false, "url": state.forwarder.upstream().url(), "error": e }),
    };
    state.metrics.store_reachable(store.is_ok());
    let store_json = match &store {
        Ok(()) => json!({ "ok": true, "backend": state.store.backend() }),
        Err(e) => json!({ "ok": false, "backend": state.store.backend(), "error": e.to_string() }),
    };
    let artifacts_json = match (&artifacts, &state.artifacts) {
        (Some(Ok(())), Some(g)) => {
            json!({ "ok": true, "destination": g.bucket().destination().to_string() })
        }
        (Some(Err(e)), Some(g)) => {
            json!({ "ok": false, "destination": g.bucket().destination().to_string(), "error": e })
        }
        _ => json!({ "ok": true, "destination": null }),
    };
    let ready =
        !draining && upstream.is_ok() && store.is_ok() && !matches!(artifacts, Some(Err(_)));
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({
        "status": if ready { "ready" } else if draining { "draining" } else { "not_ready" },
        "upstream": upstream_json,
        "store": store_json,
        "artifact_store": artifacts_json,
    });
    (status, Json(body)).into_response()
}

async fn check_upstream(state: &AppState) -> Result<(), String> {
    let probe = state.forwarder.probe("/health");
    match tokio::time::timeout(Duration::from_secs(2), probe).await {
        Ok(Ok(status)) if status.is_success() => Ok(()),
        Ok(Ok(status)) => Err(format!("GET /health answered {status}")),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("GET /health took longer than 2s".to_owned()),
    }
}

/// For one run: the identities seen by this replica, the current reporter of each node (from
/// the shared store) and the dedup settings.
async fn run_scopes(State(state): State<AppState>, Path(run_id): Path<String>) -> Response {
    let rewriter = &state.rewriter;
    let leases = match rewriter.deduplicator() {
        Some(dedup) => match dedup.leases_of_run(&run_id).await {
            Ok(leases) => leases,
            Err(e) => return Error::Unavailable(format!("state store: {e}")).into_response(),
        },
        None => Vec::new(),
    };
    let now = crate::plumbing::store::unix_millis(std::time::SystemTime::now());
    let dedup = rewriter.config().dedup_config;
    Json(RunView {
        identities: rewriter.stats.identities(&run_id),
        reporters: leases
            .into_iter()
            .map(|l| ReporterView {
                node: l.node,
                rank: l.reporter_rank,
                epoch: l.epoch,
                renewed_at_ms: l.renewed_at,
                silent_for_ms: now - l.renewed_at,
                step_offset: l.step_offset,
                last_step: l.last_step,
            })
            .collect(),
        run_id,
        update_interval_ms: dedup.update_interval.as_millis() as u64,
        failover_timeout_ms: dedup.failover_timeout.as_millis() as u64,
    })
    .into_response()
}

async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

/// Heartbeats, placement, GPU idleness and the sweep's verdict for one run.
/// The most ranks one `/runs/{id}/health` answer lists.
const HEALTH_PAGE: usize = 500;

async fn run_health(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    Query(query): Query<std::collections::HashMap<String, String>>,
) -> Response {
    // `?max_results=` ranks per page (default and most: HEALTH_PAGE), from `?page_token=`.
    let number = |name: &str, default: usize| {
        match query.get(name) {
        None => Ok(default),
        Some(text) => text.parse::<usize>().map_err(|_| {
            Error::InvalidParameter(format!("{name} must be a whole number (page_token: the next_page_token of an earlier answer)"))
        }),
    }
    };
    let (offset, limit) = match (number("page_token", 0), number("max_results", HEALTH_PAGE)) {
        (Ok(offset), Ok(limit)) => (offset, limit.clamp(1, HEALTH_PAGE)),
        (Err(error), _) | (_, Err(error)) => return error.into_response(),
    };
    if !state.health.config().enabled {
        return Error::NotFound("run health is off on this proxy (--run-health false)".into())
            .into_response();
    }
    let now = crate::plumbing::store::unix_millis(std::time::SystemTime::now());
    match state.health.view(&run_id, now, offset, limit).await {
        Ok(Some(view)) => Json(view).into_response(),
        Ok(None) => Error::NotFound(format!(
            "no heartbeat of run {run_id} is known: no system metrics of it passed through this proxy's replicas (or they are older than --state-retention)"
        ))
        .into_response(),
        Err(error) => {
            Error::Unavailable(format!("the state store could not be read: {error}")).into_response()
        }
    }
}

/// The run's report: the page its ended run gets as `mlscope/report.html`, live; JSON when the
/// client asks for it (`Accept: application/json`).
async fn run_report(
    State(state): State<AppState>,
    Path(run_id): Path<String>,
    headers: axum::http::HeaderMap,
) -> Response {
    if !state.health.config().enabled {
        return Error::NotFound("run health is off on this proxy (--run-health false)".into())
            .into_response();
    }
    let now = crate::plumbing::store::unix_millis(std::time::SystemTime::now());
    let json = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|accept| accept.contains("application/json") && !accept.contains("text/html"));
    match state.health.report(&run_id, now).await {
        Ok(Some(report)) if json => Json(report).into_response(),
        Ok(Some(report)) => (
            [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
            crate::capabilities::health::report_page(&report),
        )
            .into_response(),
        Ok(None) => Error::NotFound(format!(
            "no heartbeat of run {run_id} is known: no system metrics of it passed through this proxy's replicas (or they are older than --state-retention)"
        ))
        .into_response(),
        Err(error) => {
            Error::Unavailable(format!("the state store could not be read: {error}")).into_response()
        }
    }
}
