//! The object store in its own terms. Every call the gateway and `relocate` make on an
//! S3-compatible store goes through [`Bucket`]: it holds the SDK's clients (built in
//! [`super::s3`]), applies what the provider's [`Quirks`] say about batch deletes and lingering
//! directories, and turns the SDK's errors into [`StoreError`]. Callers see only the small types
//! below: object metadata, listed objects, pages, parts.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_s3::config::http::HttpResponse;
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::presigning::PresigningConfig;
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart, Delete, ObjectIdentifier};
use aws_sdk_s3::Client;
use axum::body::Body;
use bytes::Bytes;
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC};

use super::quirks::Quirks;
use super::s3::{Destination, S3Config};

// === what the store answers ===

/// What HeadObject (or GetObject) tells of an object.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ObjectMeta {
    /// `Content-Length`; `None` when the store sent none.
    pub size: Option<u64>,
    pub etag: Option<String>,
    /// `Last-Modified`, in seconds since the epoch.
    pub last_modified: Option<i64>,
    pub headers: ContentHeaders,
}

/// The headers an object is stored with. A multipart upload starts without them, so a copy in
/// parts carries the source's over.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContentHeaders {
    pub content_type: Option<String>,
    pub content_encoding: Option<String>,
    pub content_disposition: Option<String>,
    pub content_language: Option<String>,
    pub cache_control: Option<String>,
    /// User metadata (`x-amz-meta-*`).
    pub metadata: Option<HashMap<String, String>>,
}

impl ContentHeaders {
    /// Only a `Content-Type`: what the gateway stores an artifact with.
    pub fn of_type(content_type: &str) -> Self {
        Self {
            content_type: Some(content_type.to_owned()),
            ..Self::default()
        }
    }
}

/// An object being read: its metadata, the range the store answered, and its bytes as they
/// arrive (nothing is buffered whole).
pub struct Object {
    pub meta: ObjectMeta,
    /// `Content-Range`, when the store answered a range.
    pub content_range: Option<String>,
    pub body: Body,
}

/// An object as a listing shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredObject {
    pub key: String,
    pub size: u64,
    pub etag: Option<String>,
}

/// One page of a listing.
#[derive(Debug, Clone, Default)]
pub struct Page {
    pub objects: Vec<StoredObject>,
    /// The "directories" a delimited listing folds keys into, each ending in the delimiter.
    pub common_prefixes: Vec<String>,
    /// The continuation token of the next page; `None` on the last one.
    pub next: Option<String>,
}

/// A stored part of a multipart upload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    pub number: i32,
    pub etag: Option<String>,
}

/// Why a URL could not be presigned.
#[derive(Debug, Clone)]
pub enum PresignError {
    /// The validity asked for is one the SDK refuses.
    Expiry(String),
    /// The URL could not be signed.
    Signing(String),
}

/// A failed store operation, reduced to what a client and a log line need.
#[derive(Debug, Clone)]
pub struct StoreError {
    /// The store's HTTP status when it answered; `None` when it could not be reached.
    pub status: Option<u16>,
    /// The store's error code (`NoSuchKey`, `SlowDown`, ...), when it sent one.
    pub code: Option<String>,
    pub message: String,
}

// === impl Bucket ===

/// One bucket of the store, with the clients that reach it. Cheap to clone (the clients are
/// shared).
#[derive(Clone, Debug)]
pub struct Bucket {
    /// One client per connection pool (see [`super::s3::clients`]): [`Bucket::client`] picks
    /// this thread's.
    clients: Arc<[Client]>,
    /// Signs presigned URLs (the same as `client` unless a presign endpoint is configured).
    presigner: Client,
    destination: Destination,
    quirks: &'static Quirks,
    /// For messages: where the store is.
    endpoint: String,
}

/// Most keys one DeleteObjects request takes.
const MAX_BATCH_DELETE: usize = 1000;

impl Bucket {
    /// The destination's bucket, reached as `settings` say, with `pools` connection pools: one
    /// for each serving thread and one for every other thread (the forwarder's count), or one.
    pub async fn connect(settings: &S3Config, destination: Destination, pools: usize) -> Bucket {
        let (clients, presigner) = super::s3::clients(settings, pools).await;
        Bucket {
            clients,
            presigner,
            destination,
            quirks: settings.quirks,
            endpoint: settings
                .endpoint_url
                .clone()
                .unwrap_or_else(|| "AWS S3".to_owned()),
        }
    }

    /// Another bucket of the same store, with the same clients, addressed from its root
    /// (`relocate` copies between buckets).
    pub fn other(&self, bucket: &str) -> Bucket {
        Bucket {
            destination: Destination {
                bucket: bucket.to_owned(),
                prefix: String::new(),
            },
            ..self.clone()
        }
    }

    /// This thread's client: a connection it opens is driven by this thread's runtime, so a
    /// serving thread never waits on another that is busy.
    fn client(&self) -> &Client {
        &self.clients[crate::plumbing::proxy::this_threads_pool(self.clients.len())]
    }

    pub fn name(&self) -> &str {
        &self.destination.bucket
    }

    /// Where artifacts live in this bucket.
    pub fn destination(&self) -> &Destination {
        &self.destination
    }

    pub fn quirks(&self) -> &'static Quirks {
        self.quirks
    }

    /// For messages: where the store is (its endpoint URL, or AWS S3).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Whether the bucket answers (HeadBucket).
    pub async fn check(&self) -> Result<(), StoreError> {
        self.client()
            .head_bucket()
            .bucket(self.name())
            .send()
            .await
            .map_err(StoreError::from_sdk)?;
        Ok(())
    }

    /// HeadObject.
    pub async fn head(&self, key: &str) -> Result<ObjectMeta, StoreError> {
        let out = self
            .client()
            .head_object()
            .bucket(self.name())
            .key(key)
            .send()
            .await
            .map_err(StoreError::from_sdk)?;
        Ok(ObjectMeta {
            size: out.content_length().map(|n| n.max(0) as u64),
            etag: out.e_tag().map(str::to_owned),
            last_modified: out.last_modified().map(|t| t.secs()),
            headers: ContentHeaders {
                content_type: out.content_type().map(str::to_owned),
                content_encoding: out.content_encoding().map(str::to_owned),
                content_disposition: out.content_disposition().map(str::to_owned),
                content_language: out.content_language().map(str::to_owned),
                cache_control: out.cache_control().map(str::to_owned),
                metadata: out.metadata().cloned(),
            },
        })
    }

    /// GetObject, of the `Range` header's bytes when one is given.
    pub async fn get(&self, key: &str, range: Option<&str>) -> Result<Object, StoreError> {
        let mut get = self.client().get_object().bucket(self.name()).key(key);
        if let Some(range) = range {
            get = get.range(range);
        }
        let out = get.send().await.map_err(StoreError::from_sdk)?;
        let meta = ObjectMeta {
            size: out.content_length().map(|n| n.max(0) as u64),
            etag: out.e_tag().map(str::to_owned),
            last_modified: out.last_modified().map(|t| t.secs()),
            headers: ContentHeaders {
                content_type: out.content_type().map(str::to_owned),
                content_encoding: out.content_encoding().map(str::to_owned),
                content_disposition: out.content_disposition().map(str::to_owned),
                content_language: out.content_language().map(str::to_owned),
                cache_control: out.cache_control().map(str::to_owned),
                metadata: out.metadata().cloned(),
            },
        };
        let content_range = out.content_range().map(str::to_owned);
        let mut stream = out.body;
        let body = futures_util::stream::poll_fn(move |cx| {
            // ByteStream yields the store's chunks as they arrive.
            std::pin::Pin::new(&mut stream).poll_next(cx)
        });
        Ok(Object {
            meta,
            content_range,
            body: Body::from_stream(body),
        })
    }

    /// PutObject of `bytes`, with their exact length.
    pub async fn put(&self, key: &str, content_type: &str, bytes: Bytes) -> Result<(), StoreError> {
        let len = bytes.len() as i64;
        self.client()
            .put_object()
            .bucket(self.name())
            .key(key)
            .content_type(content_type)
            .content_length(len)
            .body(ByteStream::from(bytes))
            .send()
            .await
            .map_err(StoreError::from_sdk)?;
        Ok(())
    }

    /// CreateMultipartUpload: the upload id, `None` when the store sent none.
    pub async fn start_multipart(
        &self,
        key: &str,
        headers: &ContentHeaders,
    ) -> Result<Option<String>, StoreError> {
        let created = self
            .client()
            .create_multipart_upload()
            .bucket(self.name())
            .key(key)
            .set_content_type(headers.content_type.clone())
            .set_content_encoding(headers.content_encoding.clone())
            .set_content_disposition(headers.content_disposition.clone())
            .set_content_language(headers.content_language.clone())
            .set_cache_control(headers.cache_control.clone())
            .set_metadata(headers.metadata.clone())
            .send()
            .await
            .map_err(StoreError::from_sdk)?;
        Ok(created.upload_id().map(str::to_owned))
    }

    /// UploadPart of `bytes`, with their exact length.
    pub async fn put_part(
        &self,
        key: &str,
        upload_id: &str,
        number: i32,
        bytes: Bytes,
    ) -> Result<Part, StoreError> {
        let len = bytes.len() as i64;
        let out = self
            .client()
            .upload_part()
            .bucket(self.name())
            .key(key)
            .upload_id(upload_id)
            .part_number(number)
            .content_length(len)
            .body(ByteStream::from(bytes))
            .send()
            .await
            .map_err(StoreError::from_sdk)?;
        Ok(Part {
            number,
            etag: out.e_tag().map(str::to_owned),
        })
    }

    /// CompleteMultipartUpload of `parts`, sent in ascending part order as S3 requires.
    pub async fn finish_multipart(
        &self,
        key: &str,
        upload_id: &str,
        mut parts: Vec<Part>,
    ) -> Result<(), StoreError> {
        parts.sort_by_key(|p| p.number);
        let parts: Vec<CompletedPart> = parts
            .into_iter()
            .map(|p| {
                CompletedPart::builder()
                    .part_number(p.number)
                    .set_e_tag(p.etag)
                    .build()
            })
            .collect();
        self.client()
            .complete_multipart_upload()
            .bucket(self.name())
            .key(key)
            .upload_id(upload_id)
            .multipart_upload(
                CompletedMultipartUpload::builder()
                    .set_parts(Some(parts))
                    .build(),
            )
            .send()
            .await
            .map_err(StoreError::from_sdk)?;
        Ok(())
    }

    /// AbortMultipartUpload.
    pub async fn abort_multipart(&self, key: &str, upload_id: &str) -> Result<(), StoreError> {
        self.client()
            .abort_multipart_upload()
            .bucket(self.name())
            .key(key)
            .upload_id(upload_id)
            .send()
            .await
            .map_err(StoreError::from_sdk)?;
        Ok(())
    }

    /// CopyObject of `from`'s `from_key` to `key` here, server-side. Tags are never read or
    /// written (several stores reject GetObjectTagging).
    pub async fn copy(&self, key: &str, from: &Bucket, from_key: &str) -> Result<(), StoreError> {
        self.client()
            .copy_object()
            .bucket(self.name())
            .key(key)
            .copy_source(copy_source(from.name(), from_key))
            .send()
            .await
            .map_err(StoreError::from_sdk)?;
        Ok(())
    }

    /// UploadPartCopy of the inclusive byte range `first..=last` of `from`'s `from_key`.
    #[allow(clippy::too_many_arguments)]
    pub async fn copy_part(
        &self,
        key: &str,
        upload_id: &str,
        number: i32,
        from: &Bucket,
        from_key: &str,
        (first, last): (u64, u64),
    ) -> Result<Part, StoreError> {
        let out = self
            .client()
            .upload_part_copy()
            .bucket(self.name())
            .key(key)
            .upload_id(upload_id)
            .part_number(number)
            .copy_source(copy_source(from.name(), from_key))
            .copy_source_range(format!("bytes={first}-{last}"))
            .send()
            .await
            .map_err(StoreError::from_sdk)?;
        Ok(Part {
            number,
            etag: out
                .copy_part_result()
                .and_then(|r| r.e_tag())
                .map(str::to_owned),
        })
    }

    /// DeleteObject.
    pub async fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.client()
            .delete_object()
            .bucket(self.name())
            .key(key)
            .send()
            .await
            .map_err(StoreError::from_sdk)?;
        Ok(())
    }

    /// Deletes `keys`: with DeleteObjects, 1,000 at a time, where the store takes it
    /// ([`Quirks::batch_delete`]), else one by one. Fails on the first key the store could not
    /// delete.
    pub async fn delete_many(&self, keys: &[String]) -> Result<(), StoreError> {
        if !self.quirks.batch_delete {
            for key in keys {
                self.delete(key).await?;
            }
            return Ok(());
        }
        for chunk in keys.chunks(MAX_BATCH_DELETE) {
            let objects: Vec<ObjectIdentifier> = chunk
                .iter()
                .filter_map(|k| ObjectIdentifier::builder().key(k).build().ok())
                .collect();
            let delete = Delete::builder()
                .set_objects(Some(objects))
                .quiet(true)
                .build()
                .map_err(|e| StoreError {
                    status: None,
                    code: None,
                    message: e.to_string(),
                })?;
            let out = self
                .client()
                .delete_objects()
                .bucket(self.name())
                .delete(delete)
                .send()
                .await
                .map_err(StoreError::from_sdk)?;
            if let Some(failed) = out.errors().first() {
                return Err(StoreError {
                    status: None,
                    code: failed.code().map(str::to_owned),
                    message: format!(
                        "{} could not be deleted: {}",
                        failed.key().unwrap_or("?"),
                        failed.message().unwrap_or("")
                    ),
                });
            }
        }
        Ok(())
    }

    /// Deletes `key` and everything under `key/` (never a sibling that merely shares the
    /// prefix); returns how many keys were deleted. Where emptied directories linger
    /// ([`Quirks::empty_dirs_linger`]), their `dir/` entries are deleted too, deepest first,
    /// down to the destination.
    pub async fn delete_tree(&self, key: &str) -> Result<usize, StoreError> {
        let mut keys: Vec<String> = self
            .list_all(&format!("{key}/"))
            .await?
            .into_iter()
            .map(|o| o.key)
            .collect();
        keys.push(key.to_owned());
        let count = keys.len();
        self.delete_many(&keys).await?;
        if self.quirks.empty_dirs_linger {
            // Deleting a `dir/` entry that still holds objects is a no-op on such stores, so every
            // directory of the deleted tree and every ancestor below the destination can be tried.
            let floor = self.destination.dir_prefix("");
            for dir in emptied_dirs(&keys, key, &floor) {
                if let Err(e) = self.delete(&dir).await {
                    tracing::debug!(dir, error = %e, "removing an emptied directory entry failed");
                }
            }
        }
        Ok(count)
    }

    /// Whether any object lies under `prefix` (one ListObjectsV2 of at most one key).
    pub async fn has_objects_under(&self, prefix: &str) -> Result<bool, StoreError> {
        let page = self
            .client()
            .list_objects_v2()
            .bucket(self.name())
            .prefix(prefix)
            .max_keys(1)
            .send()
            .await
            .map_err(StoreError::from_sdk)?;
        Ok(page.key_count().unwrap_or(0) > 0)
    }

    /// One page of ListObjectsV2 under `prefix` (the whole bucket when empty), folded at
    /// `delimiter` when one is given, from the continuation token `after`.
    pub async fn list_page(
        &self,
        prefix: &str,
        delimiter: Option<&str>,
        after: Option<&str>,
    ) -> Result<Page, StoreError> {
        let mut request = self.client().list_objects_v2().bucket(self.name());
        if let Some(delimiter) = delimiter {
            request = request.delimiter(delimiter);
        }
        if !prefix.is_empty() {
            request = request.prefix(prefix);
        }
        if let Some(token) = after {
            request = request.continuation_token(token);
        }
        let page = request.send().await.map_err(StoreError::from_sdk)?;
        Ok(Page {
            objects: page.contents().iter().filter_map(stored_object).collect(),
            common_prefixes: page
                .common_prefixes()
                .iter()
                .filter_map(|c| c.prefix().map(str::to_owned))
                .collect(),
            next: match page.next_continuation_token() {
                Some(next) if page.is_truncated() == Some(true) => Some(next.to_owned()),
                _ => None,
            },
        })
    }

    /// Every object under `prefix` (no delimiter), following pagination.
    pub async fn list_all(&self, prefix: &str) -> Result<Vec<StoredObject>, StoreError> {
        let mut objects = Vec::new();
        let mut pages = self
            .client()
            .list_objects_v2()
            .bucket(self.name())
            .prefix(prefix)
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            let page = page.map_err(StoreError::from_sdk)?;
            objects.extend(page.contents().iter().filter_map(stored_object));
        }
        Ok(objects)
    }

    /// A URL that downloads `key` without credentials for `expiry`, answered with this
    /// `Content-Disposition`.
    pub async fn presign_get(
        &self,
        key: &str,
        content_disposition: String,
        expiry: Duration,
    ) -> Result<String, PresignError> {
        let presigning = PresigningConfig::expires_in(expiry)
            .map_err(|e| PresignError::Expiry(e.to_string()))?;
        let presigned = self
            .presigner
            .get_object()
            .bucket(self.name())
            .key(key)
            .response_content_disposition(content_disposition)
            .presigned(presigning)
            .await
            .map_err(|e| PresignError::Signing(e.to_string()))?;
        Ok(presigned.uri().to_owned())
    }

    /// A URL that uploads part `number` of a multipart upload without credentials for `expiry`.
    /// Presigned without checksum parameters: a checksum baked into the URL would be the empty
    /// body's, and the store would reject the real part.
    pub async fn presign_part(
        &self,
        key: &str,
        upload_id: &str,
        number: i32,
        expiry: Duration,
    ) -> Result<String, PresignError> {
        let presigning = PresigningConfig::expires_in(expiry)
            .map_err(|e| PresignError::Expiry(e.to_string()))?;
        let presigned = self
            .presigner
            .upload_part()
            .bucket(self.name())
            .key(key)
            .upload_id(upload_id)
            .part_number(number)
            .presigned(presigning)
            .await
            .map_err(|e| PresignError::Signing(e.to_string()))?;
        Ok(presigned.uri().to_owned())
    }
}

fn stored_object(o: &aws_sdk_s3::types::Object) -> Option<StoredObject> {
    Some(StoredObject {
        key: o.key()?.to_owned(),
        size: o.size().unwrap_or(0).max(0) as u64,
        etag: o.e_tag().map(str::to_owned),
    })
}

/// Characters left as they are in `x-amz-copy-source` (`/` separates bucket and key segments).
const COPY_SOURCE_SAFE: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'/')
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// `x-amz-copy-source`: `<bucket>/<key>` with the key percent-encoded.
fn copy_source(bucket: &str, key: &str) -> String {
    format!(
        "{bucket}/{}",
        percent_encoding::utf8_percent_encode(key, COPY_SOURCE_SAFE)
    )
}

/// The `dir/` entries a delete of `deleted` (and its tree `keys`) may have emptied, deepest
/// first: directories inside the tree, the tree itself, and its ancestors down to `floor`.
fn emptied_dirs(keys: &[String], deleted: &str, floor: &str) -> Vec<String> {
    let mut dirs = std::collections::BTreeSet::new();
    for k in keys.iter().map(String::as_str).chain([deleted]) {
        let mut end = k.len();
        while let Some(slash) = k[..end].rfind('/') {
            let dir = &k[..=slash];
            if dir.len() <= floor.len() {
                break;
            }
            dirs.insert(dir.to_owned());
            end = slash;
        }
    }
    dirs.insert(format!("{deleted}/"));
    let mut dirs: Vec<String> = dirs.into_iter().collect();
    dirs.sort_by_key(|d| std::cmp::Reverse(d.matches('/').count()));
    dirs
}

// === impl StoreError ===

impl StoreError {
    fn from_sdk<E>(error: SdkError<E, HttpResponse>) -> Self
    where
        E: ProvideErrorMetadata + std::error::Error + 'static,
    {
        match &error {
            SdkError::ServiceError(service) => {
                let inner = service.err();
                StoreError {
                    status: Some(service.raw().status().as_u16()),
                    code: inner.code().map(str::to_owned),
                    message: inner
                        .message()
                        .map(str::to_owned)
                        .unwrap_or_else(|| inner.to_string()),
                }
            }
            SdkError::ResponseError(response) => StoreError {
                status: Some(response.raw().status().as_u16()),
                code: None,
                message: root_message(&error),
            },
            _ => StoreError {
                status: None,
                code: None,
                message: root_message(&error),
            },
        }
    }

    /// The store could not be reached, or asked to slow down: worth a retry.
    pub fn is_transient(&self) -> bool {
        self.status.is_none_or(|s| s == 503 || s == 500)
            || matches!(
                self.code.as_deref(),
                Some("SlowDown" | "ServiceUnavailable" | "RequestTimeout" | "InternalError")
            )
    }

    pub fn is_not_found(&self) -> bool {
        self.status == Some(404)
            || matches!(
                self.code.as_deref(),
                Some("NoSuchKey" | "NotFound" | "NoSuchUpload")
            )
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.code, self.status) {
            (Some(code), Some(status)) => write!(f, "{code} (HTTP {status}): {}", self.message),
            (Some(code), None) => write!(f, "{code}: {}", self.message),
            (None, Some(status)) => write!(f, "HTTP {status}: {}", self.message),
            (None, None) => write!(f, "{}", self.message),
        }
    }
}

impl std::error::Error for StoreError {}

fn root_message(error: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![error.to_string()];
    let mut current = error.source();
    while let Some(e) = current {
        let text = e.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        current = e.source();
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deletes_try_the_emptied_directories_deepest_first_and_stop_at_the_destination() {
        let keys = vec![
            "art/1/r/artifacts/ckpt/a.pt".to_owned(),
            "art/1/r/artifacts/ckpt/sub/b.pt".to_owned(),
        ];
        assert_eq!(
            emptied_dirs(&keys, "art/1/r/artifacts/ckpt", "art/"),
            [
                "art/1/r/artifacts/ckpt/sub/",
                "art/1/r/artifacts/ckpt/",
                "art/1/r/artifacts/",
                "art/1/r/",
                "art/1/"
            ]
        );
    }

    #[test]
    fn copy_sources_encode_the_key_but_not_its_slashes() {
        assert_eq!(
            copy_source("mlflow", "my exp/epoch 1+ä.pt"),
            "mlflow/my%20exp/epoch%201%2B%C3%A4.pt"
        );
        assert_eq!(copy_source("b", "a-b_c.d~e/f"), "b/a-b_c.d~e/f");
    }
}
