//! Reading a metrics body for inspection, under budgets charged by what has arrived.
//!
//! Every inspected body is held in memory until it is forwarded, so all of them together share
//! one budget (`--max-inspect-total`). A body is charged for the bytes it has sent so far, not
//! for what its `Content-Length` declares: a client that declares 16 MiB and trickles one byte
//! every few seconds holds a few bytes, not 16 MiB of everyone's budget. The last quarter of the
//! budget is kept for clients that hold less than a quarter of it (at least one whole body): a
//! client (its address, see `crate::plumbing::client`) beyond that gets no more of the last quarter,
//! however many connections it opens; and a
//! body must arrive whole within `--inspect-body-deadline`: slow bodies cannot keep what they
//! hold for long either.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Why a body could not be read.
#[derive(Debug, PartialEq, Eq)]
pub enum IntakeError {
    /// Larger than the per-body limit.
    TooLarge,
    /// All bodies together hold the whole budget: retry later (503).
    Budget,
    /// This client's bodies hold its share of the budget (429).
    ClientShare { held: usize, share: usize },
    /// The body did not arrive whole within the deadline (408).
    TooSlow { deadline: Duration, received: usize },
    /// The client's connection failed mid-body.
    Unreadable(String),
}

/// The budget all inspected bodies share, in KiB, and what each client holds of it.
pub struct Intake {
    budget: Arc<Semaphore>,
    total_kib: usize,
    /// The KiB one client's bodies may hold together.
    share_kib: usize,
    held: Mutex<HashMap<IpAddr, usize>>,
}

impl Intake {
    /// A budget of `total_bytes`, of which one client may hold a quarter, or `body_bytes` (one
    /// whole body) where that is more.
    pub fn new(total_bytes: usize, body_bytes: usize) -> Self {
        let total_kib = (total_bytes >> 10).max(1);
        let share_kib = (total_kib / 4)
            .max(body_bytes.div_ceil(1024))
            .min(total_kib);
        Self {
            budget: Arc::new(Semaphore::new(total_kib)),
            total_kib,
            share_kib,
            held: Mutex::new(HashMap::new()),
        }
    }

    /// Reads `body` (at most `limit` bytes, within `deadline`) for `client`, charging the budget
    /// as bytes arrive. The returned charge bounds the bytes while they are read and inspected;
    /// the rewriter drops it when inspection ends, and what it hands on is bounded from there by
    /// the coalescer's queue (`--coalesce-max-pending`) or, forwarded alone, by the in-flight cap
    /// (`--max-in-flight`).
    pub async fn read(
        self: &Arc<Self>,
        body: Body,
        client: IpAddr,
        limit: usize,
        deadline: Duration,
    ) -> Result<(Bytes, Charge), IntakeError> {
        let mut charge = Charge {
            intake: self.clone(),
            client,
            kib: 0,
            permit: None,
        };
        let mut buffer = BytesMut::new();
        let read = async {
            let mut body = body;
            while let Some(frame) = body.frame().await {
                let frame = frame.map_err(|e| IntakeError::Unreadable(e.to_string()))?;
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                if buffer.len() + data.len() > limit {
                    return Err(IntakeError::TooLarge);
                }
                charge.grow_to(buffer.len() + data.len())?;
                // Copied, a body of one frame too: a frame is a slice of hyper's read buffer,
                // and keeping it would keep that whole buffer (up to hundreds of KiB) alive
                // while the budget counts only the body.
                buffer.extend_from_slice(&data);
            }
            Ok(())
        };
        match tokio::time::timeout(deadline, read).await {
            Ok(Ok(())) => Ok((buffer.freeze(), charge)),
            Ok(Err(error)) => Err(error),
            Err(_) => Err(IntakeError::TooSlow {
                deadline,
                received: buffer.len(),
            }),
        }
    }
}

/// What one body holds of the budget; given back when dropped.
pub struct Charge {
    intake: Arc<Intake>,
    client: IpAddr,
    kib: usize,
    permit: Option<OwnedSemaphorePermit>,
}

impl Charge {
    /// Charges for `bytes` held in all (whole KiB, rounded up).
    fn grow_to(&mut self, bytes: usize) -> Result<(), IntakeError> {
        let wanted = bytes.div_ceil(1024).max(1);
        if wanted <= self.kib {
            return Ok(());
        }
        let more = wanted - self.kib;
        {
            let intake = &self.intake;
            let share = intake.share_kib;
            // The last quarter of the budget is kept for clients below their share.
            let free_after = intake.budget.available_permits().saturating_sub(more);
            let pressed = free_after < intake.total_kib / 4;
            let mut held = intake.held.lock().expect("intake lock");
            let client = held.entry(self.client).or_insert(0);
            if pressed && *client + more > share {
                return Err(IntakeError::ClientShare {
                    held: *client << 10,
                    share: share << 10,
                });
            }
            *client += more;
        }
        let permit = match self
            .intake
            .budget
            .clone()
            .try_acquire_many_owned(more as u32)
        {
            Ok(permit) => permit,
            Err(_) => {
                self.release_share(more);
                return Err(IntakeError::Budget);
            }
        };
        match &mut self.permit {
            Some(held) => held.merge(permit),
            None => self.permit = Some(permit),
        }
        self.kib = wanted;
        Ok(())
    }

    fn release_share(&self, kib: usize) {
        let mut held = self.intake.held.lock().expect("intake lock");
        if let Some(client) = held.get_mut(&self.client) {
            *client = client.saturating_sub(kib);
            if *client == 0 {
                held.remove(&self.client);
            }
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.release_share(self.kib);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::stream;

    const ONE: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1));
    const TWO: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2));

    fn trickle(chunks: usize, pause: Duration) -> Body {
        Body::from_stream(stream::unfold(0, move |i| async move {
            if i == chunks {
                return None;
            }
            tokio::time::sleep(pause).await;
            Some((Ok::<_, std::io::Error>(Bytes::from_static(b"x")), i + 1))
        }))
    }

    #[tokio::test(start_paused = true)]
    async fn slow_bodies_hold_what_they_sent_and_no_longer_than_the_deadline() {
        let intake = Arc::new(Intake::new(64 << 10, 1 << 10));
        // Sixteen trickling bodies hold one KiB each, and the rest is free for others.
        let slow: Vec<_> = (0..16)
            .map(|_| {
                let intake = intake.clone();
                tokio::spawn(async move {
                    intake
                        .read(
                            trickle(100, Duration::from_secs(5)),
                            ONE,
                            16 << 20,
                            Duration::from_secs(28),
                        )
                        .await
                        .map(|_| ())
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(6)).await;
        assert_eq!(intake.budget.available_permits(), 64 - 16);
        let (bytes, _charge) = intake
            .read(
                Body::from(vec![b'y'; 16 << 10]),
                TWO,
                16 << 20,
                Duration::from_secs(30),
            )
            .await
            .unwrap();
        assert_eq!(bytes.len(), 16 << 10);
        for body in slow {
            assert_eq!(
                body.await.unwrap(),
                Err(IntakeError::TooSlow {
                    deadline: Duration::from_secs(28),
                    received: 5
                })
            );
        }
        // Everything the slow bodies held is given back.
        assert_eq!(intake.budget.available_permits(), 64 - 16);
        assert!(intake.held.lock().unwrap().get(&ONE).is_none());
    }

    #[tokio::test]
    async fn one_client_holds_at_most_a_quarter_and_the_budget_is_charged_by_arrival() {
        let intake = Arc::new(Intake::new(64 << 10, 1 << 10));
        let read = |client, size: usize| {
            let intake = intake.clone();
            async move {
                intake
                    .read(
                        Body::from(vec![b'z'; size]),
                        client,
                        1 << 20,
                        Duration::from_secs(5),
                    )
                    .await
            }
        };
        // Above the last quarter a client may hold more than its quarter.
        let (_, first) = read(ONE, 20 << 10).await.unwrap();
        let (_, second) = read(ONE, 20 << 10).await.unwrap();
        let (_, _other) = read(TWO, 8 << 10).await.unwrap();
        // The last quarter is for others: a client beyond its quarter gets none of it.
        assert!(matches!(
            read(ONE, 7 << 10).await,
            Err(IntakeError::ClientShare { .. })
        ));
        let (_, _other_again) = read(TWO, 8 << 10).await.unwrap();
        // Giving bodies back frees the share.
        drop((first, second));
        let (_, _again) = read(ONE, 16 << 10).await.unwrap();
        assert!(matches!(
            read(TWO, 2 << 20).await,
            Err(IntakeError::TooLarge)
        ));
    }

    #[tokio::test]
    async fn a_body_in_frames_reads_back_whole_and_in_order() {
        let intake = Arc::new(Intake::new(64 << 10, 1 << 10));
        let frames = ["{\"run_id\":", "\"r1\",", "\"metrics\":[]}"];
        let body = Body::from_stream(stream::iter(
            frames.map(|f| Ok::<_, std::io::Error>(Bytes::from_static(f.as_bytes()))),
        ));
        let (bytes, _charge) = intake
            .read(body, ONE, 1 << 20, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(bytes, frames.concat().as_bytes());

        let one = Bytes::from_static(b"{\"run_id\":\"r1\"}");
        let (bytes, _charge) = intake
            .read(
                Body::from(one.clone()),
                TWO,
                1 << 20,
                Duration::from_secs(5),
            )
            .await
            .unwrap();
        assert_eq!(bytes, one);
    }
}
