//! An HTTP/1.1 relay in front of a server, for what a real network does to a request on its way:
//! it can lose an answer (the request reached the server, the acknowledgement never came back) or
//! hold a request before it reaches the server until the test lets it through.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use mlscope_tests::wait::eventually;
use tokio::sync::watch;

/// Which answers a [`Relay`] loses: `(method, path, how many such requests came before)`.
pub(crate) type Loses = dyn Fn(&http::Method, &str, usize) -> bool + Send + Sync;

/// Which requests a [`Relay`] holds until [`Relay::release`]: `(method, path, body)`.
pub(crate) type Holds = dyn Fn(&http::Method, &str, &[u8]) -> bool + Send + Sync;

/// What a [`Relay`] does besides passing requests and answers on.
#[derive(Clone)]
pub(crate) struct Rules {
    pub(crate) loses: Arc<Loses>,
    pub(crate) holds: Arc<Holds>,
}

impl Rules {
    /// Loses the answers `loses` picks (it sends the request on, waits for the whole answer and
    /// closes the connection instead of passing it back, as a network or a load balancer does
    /// when an acknowledgement is lost on its way back).
    pub(crate) fn losing(
        loses: impl Fn(&http::Method, &str, usize) -> bool + Send + Sync + 'static,
    ) -> Self {
        Rules {
            loses: Arc::new(loses),
            holds: Arc::new(|_: &http::Method, _: &str, _: &[u8]| false),
        }
    }

    /// Holds the requests `holds` picks before they reach the server, until [`Relay::release`].
    pub(crate) fn holding(
        holds: impl Fn(&http::Method, &str, &[u8]) -> bool + Send + Sync + 'static,
    ) -> Self {
        Rules {
            loses: Arc::new(|_: &http::Method, _: &str, _: usize| false),
            holds: Arc::new(holds),
        }
    }
}

pub(crate) struct Relay {
    pub(crate) url: String,
    lost: Arc<AtomicUsize>,
    held: Arc<AtomicUsize>,
    gate: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    pub(crate) async fn start(target: &str, rules: Rules) -> Relay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let lost = Arc::new(AtomicUsize::new(0));
        let held = Arc::new(AtomicUsize::new(0));
        let (gate, opened) = watch::channel(false);
        let shared = Shared {
            client: Client::builder(TokioExecutor::new()).build_http(),
            target: target.to_owned(),
            rules,
            lost: lost.clone(),
            held: held.clone(),
            opened,
            seen: Arc::default(),
        };
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let shared = shared.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |request| shared.clone().relay(request));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Relay {
            url,
            lost,
            held,
            gate,
            task,
        }
    }

    /// How many answers it lost.
    pub(crate) fn lost(&self) -> usize {
        self.lost.load(Ordering::SeqCst)
    }

    /// Waits until `n` requests are held (and so have not reached the server).
    pub(crate) async fn until_held(&self, n: usize) {
        let held = self.held.clone();
        eventually(
            Duration::from_secs(30),
            format_args!("the relay holds {n} request(s)"),
            async || match held.load(Ordering::SeqCst) {
                h if h >= n => Ok(()),
                h => Err(format!("{h} held")),
            },
        )
        .await;
    }

    /// Lets every held request through, and every later one at once.
    pub(crate) fn release(&self) {
        self.gate.send_replace(true);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[derive(Clone)]
struct Shared {
    client: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    target: String,
    rules: Rules,
    lost: Arc<AtomicUsize>,
    held: Arc<AtomicUsize>,
    opened: watch::Receiver<bool>,
    seen: Arc<std::sync::Mutex<BTreeMap<String, usize>>>,
}

impl Shared {
    async fn relay(
        mut self,
        request: http::Request<hyper::body::Incoming>,
    ) -> Result<http::Response<Full<Bytes>>, std::io::Error> {
        let (mut parts, body) = request.into_parts();
        let path = parts.uri.path().to_owned();
        let before = {
            let mut seen = self.seen.lock().unwrap();
            let n = seen.entry(path.clone()).or_default();
            *n += 1;
            *n - 1
        };
        let body = body.collect().await.map_err(io_error)?.to_bytes();
        if (self.rules.holds)(&parts.method, &path, &body) {
            self.held.fetch_add(1, Ordering::SeqCst);
            self.opened.wait_for(|open| *open).await.map_err(io_error)?;
        }
        let pq = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
        parts.uri = format!("{}{pq}", self.target).parse().unwrap();
        let answer = self
            .client
            .request(http::Request::from_parts(parts.clone(), Full::new(body)))
            .await
            .map_err(io_error)?;
        let (head, body) = answer.into_parts();
        let body = body.collect().await.map_err(io_error)?.to_bytes();
        if (self.rules.loses)(&parts.method, &path, before) {
            self.lost.fetch_add(1, Ordering::SeqCst);
            return Err(io_error("acknowledgement lost on purpose"));
        }
        Ok(http::Response::from_parts(head, Full::new(body)))
    }
}

fn io_error(error: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(error.to_string())
}
