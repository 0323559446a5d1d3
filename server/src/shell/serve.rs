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
    /// Threads serving the MLflow-facing listener, each accepting and serving its connections
    /// to the end (see [`Serving`]).
    pub threads: usize,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 5001)).into(),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 9464)).into(),
            inbound: InboundLimits::default(),
            max_in_flight: 1024,
            shutdown_grace: Duration::from_secs(30),
            threads: default_threads(),
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
        if !(1..=MAX_SERVE_THREADS).contains(&self.threads) {
            return Err(format!(
                "serve-threads must be between 1 and {MAX_SERVE_THREADS}, not {}",
                self.threads
            ));
        }
        self.inbound.validate()
    }
}

/// Most serving threads: far more than any machine's cores, few enough that a typo cannot start
/// a hundred thousand threads.
const MAX_SERVE_THREADS: usize = 1024;

/// One serving thread per core this process may use (its cgroup's CPU quota and affinity
/// included), within the limit the setting takes.
fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(MAX_SERVE_THREADS)
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
    /// Threads serving the MLflow-facing listener; each accepts connections and serves them to
    /// the end on a runtime and MLflow connection pool of its own [default: one per CPU core
    /// this process may use].
    #[arg(long, env = "MLSCOPE_SERVE_THREADS", value_name = "N")]
    pub serve_threads: Option<usize>,
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
            threads: self.serve_threads.unwrap_or(d.threads),
        }
    }
}

/// How far the serving threads are: serving, draining their connections, or free to end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    Serve,
    Drain,
    Release,
}

/// The MLflow-facing listener served by threads of its own, each with a single-threaded runtime
/// that accepts connections and serves them to the end, as an event-loop server's workers do.
///
/// A connection's request, its trip to MLflow (on the thread's own connection pool, see
/// [`crate::plumbing::proxy::use_pool`]) and its answer all run on the thread that accepted it:
/// no other thread is woken and no task moves between cores on the way. On a work-stealing
/// runtime a request that reads a body woke a parked worker every time (hyper wakes the
/// connection's own task as its body is taken, and tokio hands a task that wakes itself to the
/// other workers), which cost tenths of a millisecond at low request rates. Shared state (the
/// coalescer, the fair share, the state store) is reached from every thread alike; background
/// work stays on the main runtime.
///
/// The threads' runtimes outlive the drain, and end only when this is dropped: what a request
/// spawned on one (a merged batch's timer, an S3 connection of its pool) is driven there. The
/// state store's connections are not: they belong to the main runtime (`Store::at_home`).
pub(crate) struct Serving {
    phase: tokio::sync::watch::Sender<Phase>,
    ended: tokio::sync::mpsc::Receiver<Ended>,
    threads: usize,
    drained: usize,
    /// Threads that ended by panicking: their connections were cut, not drained.
    panicked: usize,
}

/// How a serving thread ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    /// Its loop returned (drained, or failed with its error logged).
    Returned,
    /// It panicked, and its open connections went with it.
    Panicked,
}

/// Tells [`Serving`] that its thread stopped serving, and how (see [`Ended`]).
struct EndedGuard(tokio::sync::mpsc::Sender<Ended>);

impl Drop for EndedGuard {
    fn drop(&mut self) {
        let ended = if std::thread::panicking() {
            Ended::Panicked
        } else {
            Ended::Returned
        };
        // The channel holds one message per thread: this never finds it full.
        let _ = self.0.try_send(ended);
    }
}

impl Serving {
    /// Starts `threads` serving threads on `listener` (at least one).
    pub(crate) fn start<S: HttpService>(
        listener: TcpListener,
        router: S,
        limits: InboundLimits,
        metrics: Metrics,
        threads: usize,
    ) -> std::io::Result<Serving> {
        let threads = threads.max(1);
        let listener = listener.into_std()?;
        let (phase, _) = tokio::sync::watch::channel(Phase::Serve);
        let (ended_tx, ended) = tokio::sync::mpsc::channel(threads);
        // The cap on connections holds for the listener, not per thread.
        let slots = Arc::new(Semaphore::new(limits.max_connections));
        for index in 1..=threads {
            let served = Served {
                index,
                listener: listener.try_clone()?,
                router: router.clone(),
                limits,
                metrics: metrics.clone(),
                slots: slots.clone(),
            };
            let (phase, ended) = (phase.subscribe(), EndedGuard(ended_tx.clone()));
            std::thread::Builder::new()
                .name(format!("mlscope-serve-{index}"))
                .spawn(move || serving_thread(served, phase, ended))?;
        }
        Ok(Serving {
            phase,
            ended,
            threads,
            drained: 0,
            panicked: 0,
        })
    }

    /// Resolves when a serving thread stops without having been asked to: serving has failed.
    pub(crate) async fn stopped(&mut self) {
        if let Some(ended) = self.ended.recv().await {
            self.count(ended);
        }
    }

    /// Stops accepting and resolves once every thread's open connections have finished their
    /// requests (the caller bounds how long), with how many threads panicked instead (their
    /// connections were cut).
    pub(crate) async fn drain(&mut self) -> usize {
        let _ = self.phase.send(Phase::Drain);
        while self.drained < self.threads {
            match self.ended.recv().await {
                Some(ended) => self.count(ended),
                None => break,
            }
        }
        self.panicked
    }

    fn count(&mut self, ended: Ended) {
        self.drained += 1;
        if ended == Ended::Panicked {
            self.panicked += 1;
        }
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        let _ = self.phase.send(Phase::Release);
    }
}

/// What one serving thread serves: its number (and connection pool), its clone of the listener,
/// the routes, what a client connection may hold, the metrics, and the connection slots every
/// thread shares.
struct Served<S> {
    index: usize,
    listener: std::net::TcpListener,
    router: S,
    limits: InboundLimits,
    metrics: Metrics,
    slots: Arc<Semaphore>,
}

/// One serving thread: its runtime serves until the drain, reports that it has ended, and stays
/// up (driving what was opened on it) until released.
fn serving_thread<S: HttpService>(
    served: Served<S>,
    mut phase: tokio::sync::watch::Receiver<Phase>,
    ended: EndedGuard,
) {
    let index = served.index;
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            tracing::error!(error = %e, thread = index, "a serving thread could not start its runtime");
            return;
        }
    };
    crate::plumbing::proxy::use_pool(index);
    runtime.block_on(async move {
        tokio::spawn(timer_tick());
        let mut release = phase.clone();
        let released = async move {
            let _ = release.wait_for(|p| *p == Phase::Release).await;
        };
        tokio::pin!(released);
        let drain = async move {
            let _ = phase.wait_for(|p| *p >= Phase::Drain).await;
        };
        tokio::select! {
            () = accept(served, drain) => {
                drop(ended);
                released.await;
            }
            () = &mut released => {}
        }
    });
}

/// How often a serving thread's timer tick fires: shorter than the timers every request sets
/// (the header-read timeout, 15 s by default; the upstream's response timeout, 120 s).
const TIMER_TICK: Duration = Duration::from_secs(1);

/// Keeps a timer due within [`TIMER_TICK`] on the serving thread's runtime, so that the timers a
/// request sets do not wake the thread's own driver.
///
/// Tokio's timer, when a timer is set that falls due before the driver's next planned wake-up,
/// wakes the driver (an `eventfd` write), even on its own thread while it runs: the thread's next
/// park returns at once and parks again. Every request sets such timers (hyper's header-read
/// timer for the connection's next request, the upstream's response timeout), and between
/// requests at low rates the driver plans no wake-up at all, so each request cost one more
/// system-call round and context switch after its answer. With a timer always due within a
/// second, the longer timers fall after the planned wake-up and wake nothing; the tick itself
/// costs one wake-up a second.
async fn timer_tick() {
    let mut tick = tokio::time::interval(TIMER_TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
    }
}

/// What the serving threads serve: the MLflow-facing service (`shell::app::app`), or any router.
pub(crate) trait HttpService:
    tower::Service<
        axum::extract::Request,
        Response = axum::response::Response,
        Error = std::convert::Infallible,
        Future: Send + 'static,
    > + Clone
    + Send
    + 'static
{
}

impl<S> HttpService for S where
    S: tower::Service<
            axum::extract::Request,
            Response = axum::response::Response,
            Error = std::convert::Infallible,
            Future: Send + 'static,
        > + Clone
        + Send
        + 'static
{
}

/// One serving thread's loop: accepts connections on `listener` and serves `router` on them
/// until `drain` resolves, then stops accepting and lets open connections finish their requests.
async fn accept<S: HttpService>(served: Served<S>, drain: impl Future<Output = ()>) {
    let Served {
        index,
        listener,
        router,
        limits,
        metrics,
        slots,
    } = served;
    let listener = match TcpListener::from_std(listener) {
        Ok(listener) => listener,
        Err(e) => {
            tracing::error!(error = %e, thread = index, "a serving thread could not watch the listener");
            return;
        }
    };
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
    let graceful = GracefulShutdown::new();
    tokio::pin!(drain);
    loop {
        // Wait for a free slot before accepting: excess connections queue in the kernel's backlog
        // instead of costing memory here.
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => slot.expect("the slot semaphore is never closed"),
            () = &mut drain => break,
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
            () = &mut drain => break,
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

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use axum::routing::get;
    use axum::Router;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A thread that panics holding its guard is reported as panicked, not as drained, and the
    /// drain says how many did.
    #[tokio::test]
    async fn a_serving_thread_that_panics_is_not_counted_as_drained() {
        let (phase, _) = tokio::sync::watch::channel(Phase::Serve);
        let (tx, ended) = tokio::sync::mpsc::channel(2);
        let mut serving = Serving {
            phase,
            ended,
            threads: 2,
            drained: 0,
            panicked: 0,
        };
        let returned = EndedGuard(tx.clone());
        std::thread::spawn(move || drop(returned)).join().unwrap();
        let panicking = EndedGuard(tx);
        let outcome = std::thread::spawn(move || {
            let _guard = panicking;
            panic!("a serving thread's loop panicked");
        })
        .join();
        assert!(outcome.is_err());
        assert_eq!(serving.drain().await, 1);
        assert_eq!(serving.drained, 2);
    }

    /// Sends `GET path` on a connection of its own and returns the answer's body.
    async fn get_body(addr: SocketAddr, path: &str) -> String {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        answer
            .split("\r\n\r\n")
            .nth(1)
            .unwrap_or_default()
            .to_owned()
    }

    fn thread_name() -> String {
        std::thread::current().name().unwrap_or_default().to_owned()
    }

    #[tokio::test]
    async fn a_thread_held_up_leaves_the_others_serving_and_a_drain_lets_requests_finish() {
        // `/hold` blocks its whole thread until released, so that other connections can only be
        // served by another thread. `/slow` waits without blocking, until released.
        let (entered_tx, mut entered) = tokio::sync::mpsc::unbounded_channel::<()>();
        let (hold_tx, hold_rx) = std::sync::mpsc::channel::<()>();
        let hold_rx = Arc::new(Mutex::new(hold_rx));
        let slow = Arc::new(tokio::sync::Notify::new());
        let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let router = Router::new()
            .route("/where", get(|| async { thread_name() }))
            .route(
                "/hold",
                get({
                    let entered_tx = entered_tx.clone();
                    move || async move {
                        let _ = entered_tx.send(());
                        let _ = hold_rx.lock().unwrap().recv();
                        thread_name()
                    }
                }),
            )
            .route(
                "/slow",
                get({
                    let (slow, finished) = (slow.clone(), finished.clone());
                    move || async move {
                        let _ = entered_tx.send(());
                        slow.notified().await;
                        finished.store(true, std::sync::atomic::Ordering::SeqCst);
                        "finished"
                    }
                }),
            );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut serving = Serving::start(
            listener,
            router,
            InboundLimits::default(),
            Metrics::new(),
            2,
        )
        .unwrap();

        let held = tokio::spawn(get_body(addr, "/hold"));
        entered.recv().await.unwrap();
        let mut others = std::collections::BTreeSet::new();
        for _ in 0..5 {
            others.insert(get_body(addr, "/where").await);
        }
        hold_tx.send(()).unwrap();
        let held_by = held.await.unwrap();
        assert!(held_by.starts_with("mlscope-serve-"), "{held_by}");
        assert!(
            others.len() == 1 && !others.contains(&held_by),
            "served while {held_by} was held: {others:?}"
        );

        // A request in flight when the drain starts is answered before the drain ends, and the
        // listener closes.
        let in_flight = tokio::spawn(get_body(addr, "/slow"));
        entered.recv().await.unwrap();
        let release = async {
            while tokio::net::TcpStream::connect(addr).await.is_ok() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            slow.notify_one();
        };
        let drained = async {
            serving.drain().await;
            assert!(
                finished.load(std::sync::atomic::Ordering::SeqCst),
                "the drain ended with a request in flight"
            );
        };
        tokio::join!(drained, release);
        assert_eq!(in_flight.await.unwrap(), "finished");
    }

    /// The shipped gateway closes its idle connections to the replicas before a replica with the
    /// default limits would: the other way round, a request can leave on a connection as the
    /// replica closes it, and the gateway answers a POST with 502 (it does not send it again).
    #[test]
    fn the_shipped_gateway_closes_idle_connections_before_the_proxy_does() {
        let conf = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/nginx/mlscope-gateway.conf");
        let conf = std::fs::read_to_string(&conf).unwrap();
        let upstream = &conf[conf.find("upstream mlscope {").expect("the upstream block")..];
        let upstream = &upstream[..upstream.find('}').expect("its end")];
        let value = upstream
            .lines()
            .find_map(|line| line.trim().strip_prefix("keepalive_timeout"))
            .map(|value| value.trim().trim_end_matches(';').trim())
            .expect("a keepalive_timeout in the upstream block (nginx's 60 s default is too long)");
        // nginx's time: `10s`, `1m`, `500ms`, or a bare number of seconds.
        let gateway = humantime::parse_duration(value)
            .or_else(|_| value.parse().map(Duration::from_secs))
            .unwrap_or_else(|_| panic!("keepalive_timeout {value} is not a time"));
        let proxy = InboundLimits::default().header_read_timeout;
        assert!(
            gateway < proxy,
            "the gateway keeps idle connections {gateway:?}, the proxy {proxy:?}"
        );
    }
}
