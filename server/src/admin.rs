//! The admin listener: liveness, readiness and Prometheus metrics, apart from the MLflow-facing
//! port so that probes and scrapes never compete with (or get mistaken for) MLflow traffic.

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;

use crate::app::AppState;

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// The process is alive and serving.
async fn healthz() -> Json<serde_json::Value> {
    Json(json!({ "status": "ok" }))
}

/// Ready to take traffic: not draining, the upstream answers `/health`, and the store takes a
/// write. Each check reports its own error so an operator sees which part is down.
async fn readyz(State(state): State<AppState>) -> Response {
    let draining = state.draining.load(Ordering::Relaxed);
    let (upstream, store) = tokio::join!(check_upstream(&state), state.store.heartbeat(&state.replica));
    let upstream_json = match &upstream {
        Ok(()) => json!({ "ok": true, "url": state.forwarder.upstream().url() }),
        Err(e) => json!({ "ok": false, "url": state.forwarder.upstream().url(), "error": e }),
    };
    let store_json = match &store {
        Ok(()) => json!({ "ok": true, "backend": state.store.backend() }),
        Err(e) => json!({ "ok": false, "backend": state.store.backend(), "error": e.to_string() }),
    };
    let ready = !draining && upstream.is_ok() && store.is_ok();
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let body = json!({
        "status": if ready { "ready" } else if draining { "draining" } else { "not_ready" },
        "upstream": upstream_json,
        "store": store_json,
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

async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
        state.metrics.render(),
    )
        .into_response()
}
