//! Listings as MLflow returns them, and recursive deletes. Zero-byte keys ending in `/` —
//! "folder" markers made by consoles and sync tools — are never listed as files.

use aws_sdk_s3::types::{Delete, ObjectIdentifier};
use axum::response::IntoResponse;

use super::s3::{Bucket, StoreError};

/// One entry of a directory listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The name inside the listed directory.
    pub name: String,
    pub is_dir: bool,
    pub size: Option<i64>,
}

/// A zero-byte object whose key ends in `/`: a directory marker, not a file.
pub fn is_marker(key: &str, size: i64) -> bool {
    key.ends_with('/') && size == 0
}

/// Lists the direct children of `prefix` (a key prefix ending in `/`, or empty for the bucket
/// root), following pagination through any number of objects. Sorted by name, as MLflow sorts.
pub async fn list_dir(bucket: &Bucket, prefix: &str) -> Result<Vec<Entry>, StoreError> {
    let mut entries = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let mut request = bucket.client.list_objects_v2().bucket(bucket.name()).delimiter("/");
        if !prefix.is_empty() {
            request = request.prefix(prefix);
        }
        if let Some(t) = &token {
            request = request.continuation_token(t);
        }
        let page = request.send().await.map_err(StoreError::from_sdk)?;
        for common in page.common_prefixes() {
            let Some(p) = common.prefix() else { continue };
            let name = p.strip_prefix(prefix).unwrap_or(p).trim_end_matches('/');
            if !name.is_empty() {
                entries.push(Entry { name: name.to_owned(), is_dir: true, size: None });
            }
        }
        for object in page.contents() {
            let Some(key) = object.key() else { continue };
            let size = object.size().unwrap_or(0);
            if is_marker(key, size) || key.ends_with('/') {
                continue;
            }
            let name = key.strip_prefix(prefix).unwrap_or(key);
            if !name.is_empty() && !name.contains('/') {
                entries.push(Entry { name: name.to_owned(), is_dir: false, size: Some(size) });
            }
        }
        match page.next_continuation_token() {
            Some(next) if page.is_truncated() == Some(true) => token = Some(next.to_owned()),
            _ => break,
        }
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    entries.dedup_by(|a, b| a.name == b.name && a.is_dir == b.is_dir);
    Ok(entries)
}

/// MLflow's listing JSON: `{"files": [...]}`, or `{}` for an empty directory. MLflow sends it
/// indented by two spaces, and so does the gateway (see [`pretty`]).
pub fn to_mlflow_json(entries: &[Entry]) -> serde_json::Value {
    if entries.is_empty() {
        return serde_json::json!({});
    }
    let files: Vec<serde_json::Value> = entries
        .iter()
        .map(|e| match (e.is_dir, e.size) {
            // MLflow leaves file_size out for directories and for empty files.
            (true, _) | (false, None | Some(0)) => serde_json::json!({ "path": e.name, "is_dir": e.is_dir }),
            (false, Some(size)) => serde_json::json!({ "path": e.name, "is_dir": false, "file_size": size }),
        })
        .collect();
    serde_json::json!({ "files": files })
}

/// JSON as MLflow's Flask handlers write it: indented by two spaces.
pub fn pretty(value: &serde_json::Value) -> axum::response::Response {
    let body = serde_json::to_string_pretty(value).unwrap_or_else(|_| "{}".to_owned());
    ([(http::header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// Every key under `prefix` (no delimiter), following pagination.
pub async fn keys_under(bucket: &Bucket, prefix: &str) -> Result<Vec<(String, i64)>, StoreError> {
    let mut keys = Vec::new();
    let mut pages = bucket.client.list_objects_v2().bucket(bucket.name()).prefix(prefix).into_paginator().send();
    while let Some(page) = pages.next().await {
        let page = page.map_err(StoreError::from_sdk)?;
        keys.extend(page.contents().iter().filter_map(|o| Some((o.key()?.to_owned(), o.size().unwrap_or(0)))));
    }
    Ok(keys)
}

/// Deletes `key` and everything under `key/` (never a sibling that merely shares the prefix).
pub async fn delete_tree(bucket: &Bucket, key: &str) -> Result<usize, StoreError> {
    let mut keys: Vec<String> = keys_under(bucket, &format!("{key}/")).await?.into_iter().map(|(k, _)| k).collect();
    keys.push(key.to_owned());
    let count = keys.len();
    if bucket.quirks.batch_delete {
        for chunk in keys.chunks(1000) {
            let objects: Vec<ObjectIdentifier> =
                chunk.iter().filter_map(|k| ObjectIdentifier::builder().key(k).build().ok()).collect();
            let delete = Delete::builder().set_objects(Some(objects)).quiet(true).build().map_err(|e| StoreError {
                status: None,
                code: None,
                message: e.to_string(),
            })?;
            let out = bucket.client.delete_objects().bucket(bucket.name()).delete(delete).send().await.map_err(StoreError::from_sdk)?;
            if let Some(failed) = out.errors().first() {
                return Err(StoreError {
                    status: None,
                    code: failed.code().map(str::to_owned),
                    message: format!("{} could not be deleted: {}", failed.key().unwrap_or("?"), failed.message().unwrap_or("")),
                });
            }
        }
    } else {
        for k in &keys {
            bucket.client.delete_object().bucket(bucket.name()).key(k).send().await.map_err(StoreError::from_sdk)?;
        }
    }
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listing_json_matches_mlflow_shape() {
        let entries = vec![
            Entry { name: "dir".into(), is_dir: true, size: None },
            Entry { name: "a.txt".into(), is_dir: false, size: Some(5) },
        ];
        assert_eq!(
            to_mlflow_json(&entries),
            serde_json::json!({"files": [{"path": "dir", "is_dir": true}, {"path": "a.txt", "is_dir": false, "file_size": 5}]})
        );
        assert_eq!(to_mlflow_json(&[]), serde_json::json!({}));
        assert!(is_marker("x/dir/", 0));
        assert!(!is_marker("x/dir/", 3));
        assert!(!is_marker("x/file", 0));
    }
}
