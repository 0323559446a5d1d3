//! The MLflow-facing listener's connection loop, with the limits `axum::serve` does not set: a
//! cap on open connections, a deadline for request headers (which also closes idle keep-alive
//! connections) and a cap on the size of a request head. A client that opens thousands of
//! connections and sends its headers a byte at a time holds each one for the header deadline at
//! most, and never more connections than the cap, so other clients keep being served.

use std::future::Future;
use std::sync::Arc;

use axum::extract::ConnectInfo;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tower::ServiceExt;

use crate::config::InboundLimits;
use crate::telemetry::Metrics;

/// Serves `router` on `listener` until `shutdown` resolves, then stops accepting and lets open
/// connections finish their requests (the caller bounds how long).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: InboundLimits,
    metrics: Metrics,
    shutdown: impl Future<Output = ()>,
) {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(limits.max_header_bytes.max(8192))
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX));
    let builder = Arc::new(builder);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        // Wait for a free slot before accepting: excess connections queue in the kernel's backlog
        // instead of costing memory here.
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => slot.expect("the slot semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // EMFILE and friends: back off briefly rather than spin.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Small MLflow responses must not wait for Nagle's algorithm and the client's delayed ACK.
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY not set on an accepted connection");
        }
        let service = router
            .clone()
            .map_request(move |request: http::Request<Incoming>| {
                let mut request = request.map(axum::body::Body::new);
                request.extensions_mut().insert(ConnectInfo(peer));
                request
            });
        let service = TowerToHyperService::new(service);
        let connection = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service)
            .into_owned();
        let connection = graceful.watch(connection);
        let open = metrics.open_connections.clone();
        open.inc();
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(%peer, error = %e, "client connection ended with an error");
            }
            open.dec();
            drop(slot);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}
