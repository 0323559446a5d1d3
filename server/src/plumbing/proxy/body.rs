//! Body wrappers. [`StreamingBody`]: frames pass through one by one (bounded memory whatever the
//! size) and a body that pauses longer than the idle timeout is aborted. [`Guarded`]: a guard
//! lives as long as the body, so in-flight accounting covers the whole transfer, not only the
//! headers.

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

pub(crate) type BoxError = Box<dyn StdError + Send + Sync>;

/// Which way a body flows, for error messages and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Client to upstream.
    Request,
    /// Upstream to client.
    Response,
}

/// A body stalled for longer than the idle timeout.
#[derive(Debug, thiserror::Error)]
#[error("{direction:?} body idle for more than {after:?}")]
pub struct IdleTimeoutError {
    pub direction: Direction,
    pub after: Duration,
}

/// Something held until the body is finished or dropped (e.g. a concurrency permit).
pub type Guard = Box<dyn Send + Sync>;

pin_project_lite::pin_project! {
    pub struct StreamingBody<B> {
        #[pin]
        inner: B,
        idle: Duration,
        direction: Direction,
        // The idle timer, set when the body waits after its start or a frame. A body whose
        // frames are ready whenever they are asked for (most bodies arrive whole, with their
        // head) never sets one.
        sleep: Option<Pin<Box<Sleep>>>,
        // Whether `sleep` counts the current wait (set since the last frame).
        waiting: bool,
    }
}

pin_project_lite::pin_project! {
    /// A body that holds `guard` until it has sent its last frame or is dropped.
    pub struct Guarded<B> {
        #[pin]
        inner: B,
        guard: Option<Guard>,
    }
}

impl<B> Guarded<B> {
    pub fn new(inner: B, guard: Guard) -> Self {
        Self {
            inner,
            guard: Some(guard),
        }
    }
}

impl<B: Body> Body for Guarded<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.project();
        let frame = ready!(this.inner.poll_frame(cx));
        if frame.is_none() {
            // Release the guard as soon as the transfer is complete.
            this.guard.take();
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

impl<B> StreamingBody<B> {
    pub fn new(inner: B, idle: Duration, direction: Direction) -> Self {
        Self {
            inner,
            idle,
            direction,
            sleep: None,
            waiting: false,
        }
    }
}

impl<B> Body for StreamingBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        match this.inner.poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                *this.waiting = false;
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => {
                // The pause counts from when the body first waits for its next frame, not from
                // the last one: a reader that takes its time (a client slow to read the answer)
                // is not the body's pause.
                let sleep = match this.sleep {
                    Some(sleep) if *this.waiting => sleep,
                    Some(sleep) => {
                        sleep.as_mut().reset(Instant::now() + *this.idle);
                        sleep
                    }
                    None => this.sleep.insert(Box::pin(tokio::time::sleep(*this.idle))),
                };
                *this.waiting = true;
                ready!(sleep.as_mut().poll(cx));
                Poll::Ready(Some(Err(Box::new(IdleTimeoutError {
                    direction: *this.direction,
                    after: *this.idle,
                }))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Finds an [`IdleTimeoutError`] anywhere in an error's source chain.
pub fn find_idle_timeout<'a>(err: &'a (dyn StdError + 'static)) -> Option<&'a IdleTimeoutError> {
    let mut current: Option<&(dyn StdError + 'static)> = Some(err);
    while let Some(e) = current {
        if let Some(idle) = e.downcast_ref::<IdleTimeoutError>() {
            return Some(idle);
        }
        current = e.source();
    }
    None
}

/// The body, when it ends within `limit` bytes; otherwise `Err` with a body that yields what
/// was read and then the rest, to be forwarded as it came (a handler that reads small bodies
/// passes a long one on unread, so MLflow answers it).
pub(crate) async fn read_up_to(
    mut body: axum::body::Body,
    limit: usize,
) -> Result<Result<Bytes, axum::body::Body>, axum::Error> {
    use http_body_util::BodyExt as _;
    let mut read = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        read.extend_from_slice(&data);
        if read.len() > limit {
            let head = futures_util::stream::once(async move { Ok(read.freeze()) });
            let rest = futures_util::StreamExt::chain(head, body.into_data_stream());
            return Ok(Err(axum::body::Body::from_stream(rest)));
        }
    }
    Ok(Ok(read.freeze()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::stream;
    use http_body_util::{BodyExt, StreamBody};
    use std::convert::Infallible;

    #[tokio::test(start_paused = true)]
    async fn a_body_that_keeps_moving_is_never_cut_but_a_stalled_one_is() {
        // 10 chunks, 4 s apart: 40 s in total against a 5 s idle timeout.
        let moving = stream::unfold(0, |i| async move {
            if i == 10 {
                return None;
            }
            tokio::time::sleep(Duration::from_secs(4)).await;
            Some((
                Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"x"))),
                i + 1,
            ))
        });
        let body = StreamingBody::new(
            StreamBody::new(moving),
            Duration::from_secs(5),
            Direction::Request,
        );
        assert_eq!(body.collect().await.unwrap().to_bytes().len(), 10);

        let stalled = stream::pending::<Result<Frame<Bytes>, Infallible>>();
        let body = StreamingBody::new(
            StreamBody::new(stalled),
            Duration::from_secs(5),
            Direction::Response,
        );
        let err = body.collect().await.unwrap_err();
        let idle = find_idle_timeout(err.as_ref()).expect("idle timeout error");
        assert_eq!(idle.direction, Direction::Response);
    }

    #[tokio::test(start_paused = true)]
    async fn a_reader_that_takes_its_time_is_not_the_bodys_pause() {
        // The next chunk comes 3 s after it is asked for; the reader asks 10 s after the first.
        let chunks = stream::unfold(0, |i| async move {
            match i {
                0 => {}
                1 => tokio::time::sleep(Duration::from_secs(3)).await,
                _ => return None,
            }
            Some((
                Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"x"))),
                i + 1,
            ))
        });
        let mut body = std::pin::pin!(StreamingBody::new(
            StreamBody::new(chunks),
            Duration::from_secs(5),
            Direction::Response,
        ));
        assert!(body.frame().await.unwrap().is_ok());
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(
            body.frame().await.unwrap().is_ok(),
            "cut while the reader paused"
        );
        assert!(body.frame().await.is_none());
    }

    #[tokio::test]
    async fn the_guard_is_released_when_the_body_ends() {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(1);
        struct Signal(#[allow(dead_code)] tokio::sync::mpsc::Sender<()>);
        let body = Guarded::new(
            http_body_util::Full::new(Bytes::from_static(b"abc")),
            Box::new(Signal(tx)),
        );
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(&bytes[..], b"abc");
        assert!(rx.recv().await.is_none(), "sender dropped with the guard");
    }
}
