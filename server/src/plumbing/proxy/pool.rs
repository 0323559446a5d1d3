//! Keep-alive connections to MLflow, one pool per serving thread (see [`super::use_pool`]).
//!
//! A request takes the most recently used idle connection that is ready, or opens one; its
//! connection comes back to the pool when the answer's body has been read to its end, from the
//! request's own task. hyper_util's pooled client did the same through a pool keyed by host, a
//! checkout future, and a task spawned for every answer with a body to put the connection back
//! once it was ready again; a pool per thread for one upstream needs none of it.
//!
//! A request that a reused connection could not send (MLflow closed it as the request went out,
//! before any of it was written) is sent again on a fresh connection: it cannot have been
//! applied. Idle connections are dropped after [`IDLE_TIMEOUT`], before MLflow's server closes
//! them.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

use super::UpstreamBody;

/// How long an idle connection to MLflow is kept: below uvicorn's 5 s keep-alive timeout, since
/// reusing one the server is closing fails a request that may already be on its way.
pub(super) const IDLE_TIMEOUT: Duration = Duration::from_secs(4);

/// Why a request got no answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SendError {
    #[error("{0}")]
    Connect(std::io::Error),
    #[error("connecting timed out after {0:?}")]
    ConnectTimeout(Duration),
    /// Sent (or partly sent), and no whole answer came; or the request's own body failed.
    #[error(transparent)]
    Exchange(#[from] hyper::Error),
}

/// One upstream's idle connections, used by one thread (and locked only by it).
pub(super) struct Pool {
    idle: Mutex<Vec<Idle>>,
    max_idle: usize,
    host: String,
    port: u16,
    /// The `Host` header of a request that carries none (the client's was kept, and it sent
    /// none): the upstream's host, and its port where it is not 80.
    host_header: http::HeaderValue,
    connect_timeout: Duration,
}

struct Idle {
    sender: SendRequest<UpstreamBody>,
    since: Instant,
}

impl Pool {
    pub(super) fn new(
        authority: &http::uri::Authority,
        max_idle: usize,
        connect_timeout: Duration,
    ) -> Self {
        // An IPv6 literal is written in brackets in a URL, not in an address.
        let host = authority.host();
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        Self {
            idle: Mutex::new(Vec::new()),
            max_idle,
            host: host.to_owned(),
            port: authority.port_u16().unwrap_or(80),
            host_header: super::headers::upstream_host(authority),
            connect_timeout,
        }
    }

    /// Sends `request` (its URI in origin form) on an idle connection or a new one, and returns
    /// the answer, whose body gives the connection back when it has been read to its end.
    pub(super) async fn send(
        self: &Arc<Self>,
        mut request: http::Request<UpstreamBody>,
    ) -> Result<http::Response<PooledBody>, SendError> {
        request
            .headers_mut()
            .entry(http::header::HOST)
            .or_insert_with(|| self.host_header.clone());
        loop {
            let (mut sender, reused) = match self.take_idle() {
                Some(sender) => (sender, true),
                None => (self.connect().await?, false),
            };
            match sender.try_send_request(request).await {
                Ok(response) => {
                    let (parts, body) = response.into_parts();
                    let mut body = PooledBody {
                        inner: body,
                        back: Some((sender, self.clone())),
                    };
                    if body.inner.is_end_stream() {
                        body.give_back();
                    }
                    return Ok(http::Response::from_parts(parts, body));
                }
                Err(mut error) => match error.take_message() {
                    // Never written: MLflow closed the idle connection as it went out.
                    Some(unsent) if reused => request = unsent,
                    _ => return Err(error.into_error().into()),
                },
            }
        }
    }

    /// The most recently used idle connection that is ready for a request; closed and expired
    /// ones are dropped on the way.
    fn take_idle(&self) -> Option<SendRequest<UpstreamBody>> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.retain(|i| !i.sender.is_closed() && i.since.elapsed() < IDLE_TIMEOUT);
        let ready = idle.iter().rposition(|i| i.sender.is_ready())?;
        Some(idle.remove(ready).sender)
    }

    fn give_back(&self, sender: SendRequest<UpstreamBody>) {
        if sender.is_closed() {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < self.max_idle {
            idle.push(Idle {
                sender,
                since: Instant::now(),
            });
        }
    }

    /// A new connection, its task spawned on this thread's runtime.
    async fn connect(&self) -> Result<SendRequest<UpstreamBody>, SendError> {
        let stream = tokio::time::timeout(
            self.connect_timeout,
            tokio::net::TcpStream::connect((self.host.as_str(), self.port)),
        )
        .await
        .map_err(|_| SendError::ConnectTimeout(self.connect_timeout))?
        .map_err(SendError::Connect)?;
        // Small requests must not wait for Nagle's algorithm and MLflow's delayed ACK.
        let _ = stream.set_nodelay(true);
        let keepalive = socket2::TcpKeepalive::new().with_time(Duration::from_secs(60));
        let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive);
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(SendError::Exchange)?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "a connection to MLflow ended with an error");
            }
        });
        Ok(sender)
    }
}

/// An answer's body from MLflow: gives its connection back to the pool once read to its end.
/// Dropped before its end, it closes the connection (the rest of the answer is never read).
pub(crate) struct PooledBody {
    inner: Incoming,
    back: Option<(SendRequest<UpstreamBody>, Arc<Pool>)>,
}

impl PooledBody {
    fn give_back(&mut self) {
        if let Some((sender, pool)) = self.back.take() {
            pool.give_back(sender);
        }
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let frame = ready!(Pin::new(&mut self.inner).poll_frame(cx));
        match &frame {
            None => self.give_back(),
            Some(Ok(_)) if self.inner.is_end_stream() => self.give_back(),
            Some(Err(_)) => self.back = None,
            Some(Ok(_)) => {}
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::plumbing::proxy::{Direction, StreamingBody};

    /// A stand-in MLflow that answers every request `ok` and closes each connection after
    /// `close_after` answers, without saying so (as a server whose keep-alive timeout passed).
    /// Returns its address and how many connections it accepted.
    async fn stand_in(close_after: usize) -> (SocketAddr, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counted = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let (mut read, mut answered) = (Vec::new(), 0);
                    let mut buf = [0u8; 4096];
                    while answered < close_after {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => read.extend_from_slice(&buf[..n]),
                        }
                        while let Some(end) = read.windows(4).position(|w| w == b"\r\n\r\n") {
                            read.drain(..end + 4);
                            let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                            stream.write_all(answer).await.unwrap();
                            answered += 1;
                        }
                    }
                });
            }
        });
        (addr, accepted)
    }

    fn get() -> http::Request<UpstreamBody> {
        let body = StreamingBody::new(
            axum::body::Body::empty(),
            Duration::from_secs(5),
            Direction::Request,
        );
        let mut request = http::Request::new(body);
        *request.uri_mut() = http::Uri::from_static("/api/2.0/mlflow/runs/get");
        request
    }

    async fn answered(pool: &Arc<Pool>) -> Bytes {
        let response = pool.send(get()).await.expect("answered");
        assert_eq!(response.status(), http::StatusCode::OK);
        response.into_body().collect().await.unwrap().to_bytes()
    }

    #[tokio::test]
    async fn a_connection_is_reused_and_one_mlflow_closed_is_replaced() {
        let (addr, accepted) = stand_in(3).await;
        let authority = http::uri::Authority::try_from(addr.to_string()).unwrap();
        let pool = Arc::new(Pool::new(&authority, 4, Duration::from_secs(5)));
        for _ in 0..3 {
            assert_eq!(&answered(&pool).await[..], b"ok");
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "one connection for three"
        );
        // The stand-in closed it after its third answer: once the connection's task has seen
        // that, the next request goes on a new connection and is answered.
        loop {
            let closed = pool
                .idle
                .lock()
                .unwrap()
                .iter()
                .all(|i| i.sender.is_closed());
            if closed {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        for _ in 0..2 {
            assert_eq!(&answered(&pool).await[..], b"ok");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        assert_eq!(
            pool.idle.lock().unwrap().len(),
            1,
            "the closed one was dropped"
        );
    }

    #[test]
    fn the_default_host_header_is_the_upstreams_host_and_port_without_user_information() {
        let authority = http::uri::Authority::try_from("user:secret@[::1]:5000").unwrap();
        let pool = Pool::new(&authority, 1, Duration::from_secs(1));
        assert_eq!(pool.host_header, "[::1]:5000");
        assert_eq!(pool.host, "::1");
    }

    #[tokio::test]
    async fn an_answer_read_only_in_part_does_not_give_its_connection_back() {
        let (addr, accepted) = stand_in(usize::MAX).await;
        let authority = http::uri::Authority::try_from(addr.to_string()).unwrap();
        let pool = Arc::new(Pool::new(&authority, 4, Duration::from_secs(5)));
        let response = pool.send(get()).await.unwrap();
        drop(response);
        assert!(pool.idle.lock().unwrap().is_empty());
        assert_eq!(&answered(&pool).await[..], b"ok");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        assert_eq!(pool.idle.lock().unwrap().len(), 1);
    }
}
