//! The HTTP client every benchmark uses.

use std::time::Duration;

use anyhow::Context as _;

/// A client with its own connection pool (one per target, so targets never share connections),
/// keep-alive (idle connections closed before any server measured would close them), no system
/// proxy (all traffic is loopback) and no retries or overall timeout: the callers bound each
/// request themselves.
pub(crate) fn client(max_idle_connections: usize) -> anyhow::Result<reqwest::Client> {
    reqwest::Client::builder()
        .no_proxy()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(max_idle_connections)
        // Below the shortest idle keep-alive timeout of the servers measured (MLflow's uvicorn
        // 5 s, mlscope-proxy 15 s, nginx 75 s): a client that keeps a connection longer than its
        // server may send on it as the server closes it, a failure of the client's own making.
        .pool_idle_timeout(Duration::from_secs(4))
        .connect_timeout(Duration::from_secs(5))
        .build()
        .context("building the HTTP client")
}
