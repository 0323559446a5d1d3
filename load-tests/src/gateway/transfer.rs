//! Uploads from memory and downloads into memory with the bench's HTTP client, for MLflow's
//! artifact proxy and the gateway (and the plain, unsigned requests straight to the store that
//! boto3 does not need to make).
//!
//! Neither side touches a disk or hashes while the clock runs: an upload hands out slices of the
//! object the bench already holds, a download is copied into a buffer allocated (and faulted in)
//! once before the first round, and the hash is computed after the clock stops. The client's own
//! work is then about one memory copy per direction, as it is for boto3 reading and writing a
//! file in /dev/shm.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _};
use bytes::Bytes;
use futures_util::StreamExt as _;
use reqwest::header::{CONTENT_LENGTH, CONTENT_TYPE};
use sha2::{Digest as _, Sha256};
use tokio::time::Instant;

use crate::progress;

/// A finished download.
pub(crate) struct Received {
    /// From sending the request to the first byte of the body.
    pub(crate) first_byte: Duration,
    /// From sending the request to the last byte of the body.
    pub(crate) elapsed: Duration,
    /// What came, hashed after the clock stopped.
    pub(crate) content: Content,
}

/// The length and SHA-256 of an object as it was sent or received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Content {
    pub(crate) bytes: u64,
    pub(crate) sha256: [u8; 32],
}

impl Content {
    pub(crate) fn of(data: &[u8]) -> Content {
        Content {
            bytes: data.len() as u64,
            sha256: Sha256::digest(data).into(),
        }
    }
}

/// Where a download's bytes go: a buffer of the expected length. Bytes beyond it are counted but
/// not kept, so a body of the wrong length shows as a different length.
struct Sink<'a> {
    buffer: &'a mut [u8],
    received: u64,
}

impl Sink<'_> {
    fn write(&mut self, chunk: &[u8]) {
        let start = usize::try_from(self.received).unwrap_or(usize::MAX);
        if start < self.buffer.len() {
            let kept = chunk.len().min(self.buffer.len() - start);
            self.buffer[start..start + kept].copy_from_slice(&chunk[..kept]);
        }
        self.received += chunk.len() as u64;
    }

    fn content(&self) -> Content {
        let kept = usize::try_from(self.received)
            .unwrap_or(usize::MAX)
            .min(self.buffer.len());
        Content {
            bytes: self.received,
            sha256: Sha256::digest(&self.buffer[..kept]).into(),
        }
    }
}

/// PUTs `object` to `url` with its exact length, in slices of `chunk_size`; returns the time from
/// sending the request to the end of the answer.
pub(crate) async fn put(
    client: &reqwest::Client,
    url: &str,
    object: &Bytes,
    chunk_size: usize,
    what: &str,
) -> anyhow::Result<Duration> {
    let size = object.len() as u64;
    let bar = progress::bytes_bar(size, format!("PUT {what}"));
    let handed_out = Arc::new(AtomicU64::new(0));
    let counter = handed_out.clone();
    let progress = bar.clone();
    let body = futures_util::stream::iter(slices(object.clone(), chunk_size).map(move |slice| {
        counter.fetch_add(slice.len() as u64, Ordering::Relaxed);
        progress.inc(slice.len() as u64);
        Ok::<_, std::io::Error>(slice)
    }));

    let started = Instant::now();
    let response = client
        .put(url)
        .header(CONTENT_LENGTH, size)
        .header(CONTENT_TYPE, "application/octet-stream")
        .body(reqwest::Body::wrap_stream(body))
        .send()
        .await
        .with_context(|| format!("PUT {url} ({what})"))?;
    let status = response.status();
    let answer = response.text().await.unwrap_or_default();
    let elapsed = started.elapsed();
    bar.finish_and_clear();
    if !status.is_success() {
        bail!("PUT {url} ({what}) answered {status}: {answer}");
    }
    let sent = handed_out.load(Ordering::Relaxed);
    if sent != size {
        bail!("PUT {url} ({what}) was answered after {sent} of {size} bytes");
    }
    Ok(elapsed)
}

/// GETs `url` into `buffer`, which should be as long as the object.
pub(crate) async fn get(
    client: &reqwest::Client,
    url: &str,
    buffer: &mut [u8],
    what: &str,
) -> anyhow::Result<Received> {
    let bar = progress::bytes_bar(buffer.len() as u64, format!("GET {what}"));
    let mut sink = Sink {
        buffer,
        received: 0,
    };
    let started = Instant::now();
    let response = get_ok(client, url, what).await?;
    let mut first_byte = None;
    let mut body = response.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.with_context(|| format!("reading the body of GET {url} ({what})"))?;
        if chunk.is_empty() {
            continue;
        }
        first_byte.get_or_insert_with(|| started.elapsed());
        sink.write(&chunk);
        bar.inc(chunk.len() as u64);
    }
    let elapsed = started.elapsed();
    bar.finish_and_clear();
    Ok(Received {
        first_byte: first_byte.unwrap_or(elapsed),
        elapsed,
        content: sink.content(),
    })
}

/// Sends a GET of `url`; an answer other than 2xx is an error carrying its body.
async fn get_ok(
    client: &reqwest::Client,
    url: &str,
    what: &str,
) -> anyhow::Result<reqwest::Response> {
    let response = client
        .get(url)
        .send()
        .await
        .with_context(|| format!("GET {url} ({what})"))?;
    let status = response.status();
    if !status.is_success() {
        let answer = response.text().await.unwrap_or_default();
        bail!("GET {url} ({what}) answered {status}: {answer}");
    }
    Ok(response)
}

/// The time from sending a GET of `url` to the first byte of its body; the rest is not read (the
/// connection is dropped).
pub(crate) async fn first_byte(
    client: &reqwest::Client,
    url: &str,
    what: &str,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let response = get_ok(client, url, what).await?;
    let mut body = response.bytes_stream();
    while let Some(chunk) = body.next().await {
        if !chunk
            .with_context(|| format!("reading GET {url} ({what})"))?
            .is_empty()
        {
            return Ok(started.elapsed());
        }
    }
    bail!("GET {url} ({what}) answered with an empty body")
}

/// DELETE without a signature (the store has no identities); a missing object is fine.
pub(crate) async fn delete(client: &reqwest::Client, url: &str) -> anyhow::Result<()> {
    let response = client
        .delete(url)
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .with_context(|| format!("DELETE {url}"))?;
    let status = response.status();
    if !status.is_success() && status != reqwest::StatusCode::NOT_FOUND {
        bail!("DELETE {url} answered {status}");
    }
    Ok(())
}

/// `object` cut into slices of `chunk_size` (the last one shorter); the slices share its memory.
fn slices(object: Bytes, chunk_size: usize) -> impl Iterator<Item = Bytes> + Send + 'static {
    assert!(chunk_size > 0, "slices must not be empty");
    let len = object.len();
    (0..len.div_ceil(chunk_size)).map(move |i| {
        let start = i * chunk_size;
        object.slice(start..len.min(start + chunk_size))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_download_is_hashed_as_it_came_and_extra_bytes_change_its_length() {
        let object = Bytes::from_static(b"the quick brown fox jumps over the lazy dog");
        let mut buffer = vec![0xA5; object.len()];
        let mut sink = Sink {
            buffer: &mut buffer,
            received: 0,
        };
        for chunk in slices(object.clone(), 5) {
            sink.write(&chunk);
        }
        assert_eq!(sink.content(), Content::of(&object));
        sink.write(b"!");
        assert_eq!(sink.content().bytes, object.len() as u64 + 1);
        assert_ne!(sink.content(), Content::of(&object));
    }

    #[test]
    fn a_short_download_hashes_only_what_came() {
        let mut buffer = vec![0xA5; 10];
        let mut sink = Sink {
            buffer: &mut buffer,
            received: 0,
        };
        sink.write(b"abc");
        assert_eq!(sink.content(), Content::of(b"abc"));
    }

    #[test]
    fn slices_cover_the_object_once_and_share_its_memory() {
        let object = Bytes::from((0..10_000u32).map(|i| i as u8).collect::<Vec<_>>());
        let parts: Vec<Bytes> = slices(object.clone(), 4_096).collect();
        assert_eq!(
            parts.iter().map(Bytes::len).collect::<Vec<_>>(),
            vec![4_096, 4_096, 1_808]
        );
        assert_eq!(parts.concat(), object.to_vec());
        assert_eq!(parts[1].as_ptr(), object[4_096..].as_ptr());
        assert_eq!(slices(Bytes::new(), 4_096).count(), 0);
    }
}
