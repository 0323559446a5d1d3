//! Streaming uploads: a request body goes to the store as it arrives, with no temporary file.
//!
//! Bodies up to the multipart threshold are sent as one PutObject with an exact Content-Length.
//! Larger bodies, and bodies of unknown length, become multipart uploads of equal parts (the
//! last one shorter), at most `concurrency` parts in flight; memory per upload stays below
//! `threshold + part_size × concurrency` whatever the object's size. Any failure, or the client
//! going away, aborts the multipart upload, so no partial object and no dangling upload remain.

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use tokio::task::JoinSet;
use tracing::Instrument as _;

use super::objects::{Bucket, ContentHeaders, Part, StoreError};

/// S3's limits on multipart uploads.
pub const MIN_PART_SIZE: usize = 5 << 20;
pub const MAX_PART_SIZE: usize = 5 << 30;
pub const MAX_PARTS: u64 = 10_000;

#[derive(Debug, Clone, Copy)]
pub struct UploadLimits {
    pub part_size: usize,
    pub concurrency: usize,
    pub threshold: usize,
    /// Longest pause between two chunks of the client's body; a slow body that keeps moving
    /// is never cut.
    pub body_idle: std::time::Duration,
}

#[derive(Debug)]
pub enum UploadError {
    /// The client's body failed: disconnect, or a length that does not match.
    Client(String),
    /// The client's body sent nothing for this long.
    ClientIdle(std::time::Duration),
    /// The client's body came slower than [`MIN_BODY_RATE`] on average after [`RATE_GRACE`]:
    /// the bytes that came.
    ClientSlow(u64),
    /// The store refused or could not be reached.
    Store(StoreError),
    /// More than 10,000 parts would be needed.
    TooLarge { max: u64 },
}

/// The slowest average a body may arrive at once [`RATE_GRACE`] has passed, in bytes per
/// second: far below any real link, far above a client that trickles a byte now and then to
/// hold an upload slot.
pub const MIN_BODY_RATE: u64 = 16 * 1024;
/// How long a body may take before [`MIN_BODY_RATE`] applies.
pub const RATE_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// Sends `body` to `key`; returns the number of bytes stored.
pub async fn upload(
    bucket: &Bucket,
    key: &str,
    content_type: &str,
    body: Body,
    length: Option<u64>,
    limits: UploadLimits,
) -> Result<u64, UploadError> {
    let mut reader = BodyReader {
        stream: body.into_data_stream(),
        carry: None,
        total: 0,
        idle: limits.body_idle,
        started: tokio::time::Instant::now(),
    };
    // Read one byte past the threshold to tell "exactly at the threshold" from "more to come".
    let expected = length.map_or(limits.threshold, |n| {
        n.min(limits.threshold as u64) as usize
    });
    let mut head = BytesMut::with_capacity(expected + 1);
    let eof = reader.fill(&mut head, limits.threshold + 1).await?;
    if eof && head.len() <= limits.threshold {
        check_length(length, reader.total)?;
        let len = head.len() as u64;
        bucket
            .put(key, content_type, head.freeze())
            .await
            .map_err(UploadError::Store)?;
        return Ok(len);
    }
    let part_size = part_size_for(length, limits.part_size);
    if let Some(n) = length {
        if n.div_ceil(part_size as u64) > MAX_PARTS {
            return Err(UploadError::TooLarge {
                max: MAX_PARTS * MAX_PART_SIZE as u64,
            });
        }
    }
    let upload_id = bucket
        .start_multipart(key, &ContentHeaders::of_type(content_type))
        .await
        .map_err(UploadError::Store)?
        .unwrap_or_default();
    let mut guard = AbortGuard {
        bucket: bucket.clone(),
        key: key.to_owned(),
        upload_id: upload_id.clone(),
        armed: true,
    };
    let result = send_parts(
        bucket,
        key,
        &upload_id,
        head,
        &mut reader,
        part_size,
        limits.concurrency,
        length,
    )
    .await;
    match result {
        Ok(parts) => match bucket.finish_multipart(key, &upload_id, parts).await {
            Ok(()) => {
                guard.armed = false;
                Ok(reader.total)
            }
            Err(e) => {
                guard.abort_now().await;
                Err(UploadError::Store(e))
            }
        },
        Err(e) => {
            guard.abort_now().await;
            Err(e)
        }
    }
}

/// A stored part, and its buffer back when the SDK let go of it (for the next part).
type PartOutcome = Result<(Part, Option<BytesMut>), StoreError>;

#[allow(clippy::too_many_arguments)]
async fn send_parts(
    bucket: &Bucket,
    key: &str,
    upload_id: &str,
    mut pending: BytesMut,
    reader: &mut BodyReader,
    part_size: usize,
    concurrency: usize,
    length: Option<u64>,
) -> Result<Vec<Part>, UploadError> {
    let mut tasks: JoinSet<PartOutcome> = JoinSet::new();
    let mut done = Vec::new();
    // Part buffers come back from finished part uploads and are filled again: the allocator
    // never sees a stream of freed multi-MiB buffers it might keep.
    let mut pool: Vec<BytesMut> = Vec::new();
    let mut next_part: i32 = 1;
    let mut eof = false;
    loop {
        if !eof && pending.len() < part_size {
            pending.reserve(part_size - pending.len());
            eof = reader.fill(&mut pending, part_size).await?;
        }
        while pending.len() >= part_size || (eof && !pending.is_empty()) {
            if next_part as u64 > MAX_PARTS {
                return Err(UploadError::TooLarge {
                    max: MAX_PARTS * part_size as u64,
                });
            }
            while tasks.len() >= concurrency.max(1) {
                let (part, buffer) = joined(tasks.join_next().await)?;
                done.push(part);
                pool.extend(buffer);
            }
            let part = if pending.len() > part_size {
                pending.split_to(part_size).freeze()
            } else {
                let mut next = pool.pop().unwrap_or_default();
                next.clear();
                std::mem::replace(&mut pending, next).freeze()
            };
            // In the request's span: a part's log lines carry the upload's request id.
            tasks.spawn(
                upload_part(
                    bucket.clone(),
                    key.to_owned(),
                    upload_id.to_owned(),
                    next_part,
                    part,
                )
                .in_current_span(),
            );
            next_part += 1;
        }
        if eof {
            break;
        }
    }
    check_length(length, reader.total)?;
    while let Some(result) = tasks.join_next().await {
        done.push(joined(Some(result))?.0);
    }
    Ok(done)
}

fn joined(
    result: Option<Result<PartOutcome, tokio::task::JoinError>>,
) -> Result<(Part, Option<BytesMut>), UploadError> {
    match result {
        Some(Ok(Ok(part))) => Ok(part),
        Some(Ok(Err(e))) => Err(UploadError::Store(e)),
        Some(Err(e)) => Err(UploadError::Store(StoreError {
            status: None,
            code: None,
            message: format!("part upload task failed: {e}"),
        })),
        None => Err(UploadError::Store(StoreError {
            status: None,
            code: None,
            message: "no part upload in flight".into(),
        })),
    }
}

async fn upload_part(
    bucket: Bucket,
    key: String,
    upload_id: String,
    number: i32,
    data: Bytes,
) -> PartOutcome {
    let keep = data.clone();
    let part = bucket.put_part(&key, &upload_id, number, data).await?;
    Ok((part, keep.try_into_mut().ok()))
}

/// Grows the part size when the declared length would need more than 10,000 parts.
pub fn part_size_for(length: Option<u64>, configured: usize) -> usize {
    match length {
        Some(n) if n.div_ceil(configured as u64) > MAX_PARTS => {
            let needed = n.div_ceil(MAX_PARTS) as usize;
            needed.div_ceil(1 << 20) * (1 << 20)
        }
        _ => configured,
    }
    .clamp(MIN_PART_SIZE.min(configured), MAX_PART_SIZE)
}

fn check_length(declared: Option<u64>, received: u64) -> Result<(), UploadError> {
    match declared {
        Some(n) if n != received => Err(UploadError::Client(format!(
            "the request declared Content-Length {n} but carried {received} bytes"
        ))),
        _ => Ok(()),
    }
}

/// Reads a body into part buffers, splitting frames that straddle a part boundary.
struct BodyReader {
    stream: axum::body::BodyDataStream,
    carry: Option<Bytes>,
    total: u64,
    idle: std::time::Duration,
    started: tokio::time::Instant,
}

impl BodyReader {
    /// Whether the body has come at [`MIN_BODY_RATE`] on average (always, within the grace).
    fn fast_enough(&self) -> bool {
        let elapsed = self.started.elapsed();
        elapsed < RATE_GRACE || self.total >= (MIN_BODY_RATE as f64 * elapsed.as_secs_f64()) as u64
    }

    /// Appends to `buf` until it holds `target` bytes or the body ends; returns true at the end.
    async fn fill(&mut self, buf: &mut BytesMut, target: usize) -> Result<bool, UploadError> {
        while buf.len() < target {
            let mut chunk = match self.carry.take() {
                Some(chunk) => chunk,
                None => match tokio::time::timeout(self.idle, self.stream.next()).await {
                    Ok(Some(Ok(chunk))) => {
                        self.total += chunk.len() as u64;
                        if !self.fast_enough() {
                            return Err(UploadError::ClientSlow(self.total));
                        }
                        chunk
                    }
                    Ok(Some(Err(e))) => return Err(UploadError::Client(client_error(&e))),
                    Ok(None) => return Ok(true),
                    Err(_) => return Err(UploadError::ClientIdle(self.idle)),
                },
            };
            let room = target - buf.len();
            if chunk.len() > room {
                self.carry = Some(chunk.split_off(room));
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(false)
    }
}

fn client_error(error: &axum::Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(e) = source {
        let s = e.to_string();
        if !text.contains(&s) {
            text = format!("{text}: {s}");
        }
        source = e.source();
    }
    text
}

/// Aborts a multipart upload unless disarmed. Dropped without being disarmed — the request
/// future was cancelled because the client went away — it aborts in a task of its own.
struct AbortGuard {
    bucket: Bucket,
    key: String,
    upload_id: String,
    armed: bool,
}

impl AbortGuard {
    async fn abort_now(&mut self) {
        self.armed = false;
        abort(&self.bucket, &self.key, &self.upload_id).await;
    }
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if self.armed {
            let (bucket, key, upload_id) = (
                self.bucket.clone(),
                std::mem::take(&mut self.key),
                std::mem::take(&mut self.upload_id),
            );
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle
                    .spawn(async move { abort(&bucket, &key, &upload_id).await }.in_current_span());
            }
        }
    }
}

async fn abort(bucket: &Bucket, key: &str, upload_id: &str) {
    match bucket.abort_multipart(key, upload_id).await {
        Ok(()) => tracing::info!(key, upload_id, "multipart upload aborted"),
        Err(e) => {
            tracing::warn!(key, upload_id, error = %e, "aborting a multipart upload failed; the store's lifecycle rules must clean it up")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_size_grows_only_when_ten_thousand_parts_would_not_do() {
        assert_eq!(part_size_for(Some(1 << 30), 8 << 20), 8 << 20);
        assert_eq!(part_size_for(None, 8 << 20), 8 << 20);
        let big = 200u64 << 30;
        let size = part_size_for(Some(big), 8 << 20);
        assert!(big.div_ceil(size as u64) <= MAX_PARTS);
        assert_eq!(size % (1 << 20), 0);
    }

    fn reader_of(body: Body) -> BodyReader {
        BodyReader {
            stream: body.into_data_stream(),
            carry: None,
            total: 0,
            idle: std::time::Duration::from_secs(5),
            started: tokio::time::Instant::now(),
        }
    }

    #[tokio::test]
    async fn frames_are_split_at_part_boundaries_without_losing_bytes() {
        let frames: Vec<Result<Bytes, std::io::Error>> =
            (0..10u8).map(|i| Ok(Bytes::from(vec![i; 7]))).collect();
        let body = Body::from_stream(futures_util::stream::iter(frames));
        let mut reader = reader_of(body);
        let mut parts = Vec::new();
        loop {
            let mut buf = BytesMut::new();
            let eof = reader.fill(&mut buf, 16).await.unwrap();
            if !buf.is_empty() {
                parts.push(buf.freeze());
            }
            if eof {
                break;
            }
        }
        assert_eq!(
            parts.iter().map(Bytes::len).collect::<Vec<_>>(),
            vec![16, 16, 16, 16, 6]
        );
        let joined: Vec<u8> = parts.concat();
        let expected: Vec<u8> = (0..10u8).flat_map(|i| vec![i; 7]).collect();
        assert_eq!(joined, expected);
        assert_eq!(reader.total, 70);
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_slower_than_the_minimum_rate_is_cut_after_the_grace() {
        // A byte every 2 s: within the idle limit, far below the minimum rate.
        let body = Body::from_stream(futures_util::stream::unfold(0u32, |i| async move {
            tokio::time::sleep(std::time::Duration::from_secs(2)).await;
            Some((Ok::<_, std::io::Error>(Bytes::from_static(b"x")), i + 1))
        }));
        let mut reader = reader_of(body);
        let mut buf = BytesMut::new();
        match reader.fill(&mut buf, 1 << 20).await {
            Err(UploadError::ClientSlow(received)) => {
                assert_eq!(received, RATE_GRACE.as_secs() / 2)
            }
            other => panic!("{other:?}"),
        }
        assert!(
            tokio::time::Instant::now() - reader.started
                < RATE_GRACE + std::time::Duration::from_secs(3)
        );
    }
}
