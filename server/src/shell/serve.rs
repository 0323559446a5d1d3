//! The MLflow-facing listener's connection loop, with the limits `axum::serve` does not set: a
//! cap on open connections, a deadline for request headers (which also closes idle keep-alive
//! connections) and a cap on the size of a request head. A client that opens thousands of
//! connections and sends its headers a byte at a time holds each one for the header deadline at
//! most, and never more connections than the cap, so other clients keep being served.
//!
//! Here too are the listeners' settings: where they bind, those limits, the cap on requests in
//! flight and the shutdown grace.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

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

use crate::plumbing::listen::ListenAddr;
use crate::plumbing::settings::{parse_duration, parse_size};
use crate::plumbing::telemetry::Metrics;

/// Where the listeners bind and what the MLflow-facing one admits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServeConfig {
    /// Where the MLflow-facing listener binds; a host name is resolved when serving starts.
    pub listen: ListenAddr,
    /// Where the admin listener (`/healthz`, `/readyz`, `/metrics`) binds.
    pub admin_listen: ListenAddr,
    /// Limits on inbound connections, against slow or hostile clients.
    pub inbound: InboundLimits,
    /// Requests handled at once; one more is answered 429 (not forwarded) at once instead of queueing.
    pub max_in_flight: usize,
    /// How long in-flight requests may run on after SIGTERM/SIGINT.
    pub shutdown_grace: Duration,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 5001)).into(),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 9464)).into(),
            inbound: InboundLimits::default(),
            max_in_flight: 1024,
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

impl ServeConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.listen == self.admin_listen && self.listen.port() != 0 {
            return Err(format!(
                "listen and admin-listen are both {}; give the admin listener its own port",
                self.listen
            ));
        }
        if self.max_in_flight == 0 {
            return Err("max-in-flight must be at least 1".into());
        }
        self.inbound.validate()
    }
}

/// What one client connection may hold. None of it limits a transfer that keeps moving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InboundLimits {
    /// Client connections open at once; further ones wait in the listen backlog.
    pub max_connections: usize,
    /// Time a client has to send a request's headers, counted from when the connection starts
    /// waiting for them (also between keep-alive requests: the idle timeout).
    pub header_read_timeout: Duration,
    /// Largest request head (request line and headers) in bytes.
    pub max_header_bytes: usize,
}

impl Default for InboundLimits {
    fn default() -> Self {
        Self {
            max_connections: 4096,
            header_read_timeout: Duration::from_secs(15),
            max_header_bytes: 64 << 10,
        }
    }
}

impl InboundLimits {
    pub fn validate(&self) -> Result<(), String> {
        if self.max_connections == 0 {
            return Err("max-connections must be at least 1".into());
        }
        if self.header_read_timeout.is_zero() {
            return Err("header-read-timeout must be longer than 0".into());
        }
        if !(8 << 10..=16 << 20).contains(&self.max_header_bytes) {
            return Err(format!(
                "max-header-bytes must be between 8KiB and 16MiB, not {} bytes",
                self.max_header_bytes
            ));
        }
        Ok(())
    }
}

/// Serving's settings as given (see [`crate::plumbing::settings`]); `None`: not given here.
#[derive(Debug, Clone, Default, clap::Args, serde::Deserialize)]
pub(crate) struct ServeOptions {
    /// Address the MLflow-facing listener binds: an IP address or a host name with a port, e.g.
    /// 0.0.0.0:5001, [::1]:5001 or localhost:5001. A name is resolved at startup and only the
    /// first of its addresses that this host has is bound (::1 is skipped where IPv6 is off);
    /// give [::]:5001 to take IPv4 and IPv6 clients alike [default: 127.0.0.1:5001].
    #[arg(long, env = "MLSCOPE_LISTEN", value_name = "HOST:PORT")]
    #[serde(default, deserialize_with = "listen_in_file")]
    pub listen: Option<ListenAddr>,
    /// Address of the admin listener serving /healthz, /readyz and /metrics, written and
    /// resolved as --listen [default: 127.0.0.1:9464].
    #[arg(long, env = "MLSCOPE_ADMIN_LISTEN", value_name = "HOST:PORT")]
    #[serde(default, deserialize_with = "admin_listen_in_file")]
    pub admin_listen: Option<ListenAddr>,
    /// Concurrent requests before new ones get 429, not forwarded [default: 1024].
    #[arg(long, env = "MLSCOPE_MAX_IN_FLIGHT", value_name = "N")]
    pub max_in_flight: Option<usize>,
    /// Client connections open at once; more wait in the listen backlog [default: 4096].
    #[arg(long, env = "MLSCOPE_MAX_CONNECTIONS", value_name = "N")]
    pub max_connections: Option<usize>,
    /// Time a client has to send a request's headers; also how long an idle keep-alive
    /// connection stays open [default: 15s].
    #[arg(long, env = "MLSCOPE_HEADER_READ_TIMEOUT", value_parser = parse_duration, value_name = "DURATION")]
    #[serde(default, with = "humantime_serde")]
    pub header_read_timeout: Option<Duration>,
    /// Largest request head (request line and headers), e.g. 64KiB [default: 64KiB].
    #[arg(long, env = "MLSCOPE_MAX_HEADER_BYTES", value_parser = parse_size, value_name = "SIZE")]
    #[serde(default, deserialize_with = "crate::plumbing::settings::size")]
    pub max_header_bytes: Option<usize>,
    /// Deadline for in-flight requests after SIGTERM/SIGINT [default: 30s].
    #[arg(long, env = "MLSCOPE_SHUTDOWN_GRACE", value_parser = parse_duration, value_name = "DURATION")]
    #[serde(default, with = "humantime_serde")]
    pub shutdown_grace: Option<Duration>,
}

fn listen_in_file<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<ListenAddr>, D::Error> {
    ListenAddr::from_file("listen", d)
}

fn admin_listen_in_file<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<ListenAddr>, D::Error> {
    ListenAddr::from_file("admin_listen", d)
}

impl ServeOptions {
    /// The given values over the defaults.
    pub(crate) fn resolve(self) -> ServeConfig {
        let d = ServeConfig::default();
        ServeConfig {
            listen: self.listen.unwrap_or(d.listen),
            admin_listen: self.admin_listen.unwrap_or(d.admin_listen),
            inbound: InboundLimits {
                max_connections: self.max_connections.unwrap_or(d.inbound.max_connections),
                header_read_timeout: self
                    .header_read_timeout
                    .unwrap_or(d.inbound.header_read_timeout),
                max_header_bytes: self.max_header_bytes.unwrap_or(d.inbound.max_header_bytes),
            },
            max_in_flight: self.max_in_flight.unwrap_or(d.max_in_flight),
            shutdown_grace: self.shutdown_grace.unwrap_or(d.shutdown_grace),
        }
    }
}

/// Serves `router` on `listener` until `shutdown` resolves, then stops accepting and lets open
/// connections finish their requests (the caller bounds how long).
pub(crate) async fn serve(
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
