//! Test data and the store's own view of it: deterministic bytes, their SHA-256, and what the
//! bucket holds, read straight from SeaweedFS (it answers unsigned requests) rather than through
//! the code under test.

use mlscope_tests::S3Store;
use sha2::{Digest, Sha256};

use crate::mlflow::http;

/// Deterministic, position-dependent bytes (xorshift) that differ from those of another `seed`
/// and do not compress: a part written at the wrong offset changes them.
pub(crate) fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// Lowercase hex SHA-256 of `bytes`, compared instead of the bytes so that a failure prints two
/// hashes rather than megabytes.
pub(crate) fn sha256(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}

/// `(key, size)` of every object under `prefix`, listed by SeaweedFS itself (unsigned
/// ListObjectsV2, no delimiter). One page: more than 1000 keys fail the test.
pub(crate) async fn store_objects(s3: &S3Store, prefix: &str) -> Vec<(String, u64)> {
    let xml = store_get(
        s3,
        &[("list-type", "2"), ("prefix", prefix), ("max-keys", "1000")],
    )
    .await;
    assert!(
        !xml.contains("<IsTruncated>true</IsTruncated>"),
        "more than 1000 keys under {prefix}"
    );
    xml.split("<Contents>")
        .skip(1)
        .map(|block| {
            let field = |tag: &str| {
                xml_values(block, tag)
                    .into_iter()
                    .next()
                    .unwrap_or_default()
            };
            (field("Key"), field("Size").parse().unwrap_or(u64::MAX))
        })
        .collect()
}

/// Keys of every object under `prefix`, listed by SeaweedFS itself.
pub(crate) async fn store_keys(s3: &S3Store, prefix: &str) -> Vec<String> {
    store_objects(s3, prefix)
        .await
        .into_iter()
        .map(|(key, _)| key)
        .collect()
}

/// Ids of the multipart uploads the store still holds under `prefix`.
pub(crate) async fn pending_uploads(s3: &S3Store, prefix: &str) -> Vec<String> {
    let xml = store_get(s3, &[("uploads", ""), ("prefix", prefix)]).await;
    xml_values(&xml, "UploadId")
}

/// An unsigned GET of the bucket itself with `query`; returns the XML.
async fn store_get(s3: &S3Store, query: &[(&str, &str)]) -> String {
    let response = http()
        .get(format!("{}/{}", s3.url, s3.bucket))
        .query(query)
        .send()
        .await
        .unwrap();
    let status = response.status();
    let xml = response.text().await.unwrap();
    assert!(
        status.is_success(),
        "GET {}/{}?{query:?}: {status} {xml}",
        s3.url,
        s3.bucket
    );
    xml
}

/// The text of every `<tag>…</tag>` in `xml`, in order.
fn xml_values(xml: &str, tag: &str) -> Vec<String> {
    let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
    xml.split(&open)
        .skip(1)
        .filter_map(|rest| rest.split_once(&close).map(|(v, _)| v.to_owned()))
        .collect()
}
