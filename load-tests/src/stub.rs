//! A constant-latency stand-in for MLflow, for measuring what the proxies themselves add.
//!
//! MLflow's own latency on two shared cores jitters by tens to hundreds of milliseconds (SQLite
//! writes), which hides differences of a millisecond between proxies. This stub answers the four
//! calls the pass-through benchmark makes with fixed MLflow-shaped JSON, at once, after reading
//! the whole request body; it reproduces nothing else of MLflow.

use std::net::SocketAddr;

use anyhow::Context as _;
use axum::body::Bytes;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

/// The stub, serving on its own thread until the process exits.
pub(crate) struct StubUpstream {
    pub(crate) url: String,
}

fn run_json() -> Value {
    json!({"run": {
        "info": {"run_id": "0123456789abcdef0123456789abcdef", "experiment_id": "1", "status": "RUNNING",
                 "start_time": 1_700_000_000_000i64, "artifact_uri": "mlflow-artifacts:/1/0123456789abcdef0123456789abcdef/artifacts",
                 "lifecycle_stage": "active"},
        "data": {"metrics": [{"key": "loss", "value": 0.25, "timestamp": 1_700_000_000_000i64, "step": 3}],
                 "params": [], "tags": [{"key": "mlflow.runName", "value": "bench"}]}
    }})
}

fn router() -> Router {
    Router::new()
        .route("/health", get(|| async { "OK" }))
        .route(
            "/api/2.0/mlflow/experiments/create",
            post(|_: Bytes| async { Json(json!({"experiment_id": "1"})) }),
        )
        .route(
            "/api/2.0/mlflow/runs/create",
            post(|_: Bytes| async { Json(run_json()) }),
        )
        .route(
            "/api/2.0/mlflow/runs/get",
            get(|| async { Json(run_json()) }),
        )
        .route(
            "/api/2.0/mlflow/runs/log-batch",
            post(|_: Bytes| async { Json(json!({})) }),
        )
}

impl StubUpstream {
    /// Starts the stub on a free loopback port, on a thread and runtime of its own so it never
    /// waits for the load generator's.
    pub(crate) fn start() -> anyhow::Result<StubUpstream> {
        let listener =
            std::net::TcpListener::bind("127.0.0.1:0").context("binding the stub upstream")?;
        listener.set_nonblocking(true)?;
        let addr: SocketAddr = listener.local_addr()?;
        std::thread::Builder::new()
            .name("stub-upstream".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("stub runtime");
                runtime.block_on(async move {
                    let listener =
                        tokio::net::TcpListener::from_std(listener).expect("stub listener");
                    let _ = axum::serve(listener, router()).await;
                });
            })
            .context("starting the stub upstream thread")?;
        Ok(StubUpstream {
            url: format!("http://{addr}"),
        })
    }
}
