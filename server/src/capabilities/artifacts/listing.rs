//! Listings as MLflow returns them. Zero-byte keys ending in `/` — "folder" markers made by
//! consoles and sync tools — are never listed as files.

use axum::response::IntoResponse;

use super::objects::{Bucket, StoreError};

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

/// Most entries one listing holds: a listing is built in memory (MLflow's answer is one JSON
/// document), so a directory with more is refused instead of growing the proxy without bound.
pub const MAX_LISTED_ENTRIES: usize = 1_000_000;
/// The [`StoreError`] code of a listing over [`MAX_LISTED_ENTRIES`].
pub const TOO_MANY_ENTRIES: &str = "TooManyEntries";

/// Lists the direct children of `prefix` (a key prefix ending in `/`, or empty for the bucket
/// root), following pagination through any number of objects. Sorted by name, as MLflow sorts.
pub async fn list_dir(bucket: &Bucket, prefix: &str) -> Result<Vec<Entry>, StoreError> {
    let mut entries = Vec::new();
    let mut pages = 0usize;
    let mut token: Option<String> = None;
    loop {
        let page = bucket
            .list_page(prefix, Some("/"), token.as_deref())
            .await?;
        for p in &page.common_prefixes {
            let name = p.strip_prefix(prefix).unwrap_or(p).trim_end_matches('/');
            if !name.is_empty() {
                entries.push(Entry {
                    name: name.to_owned(),
                    is_dir: true,
                    size: None,
                });
            }
        }
        for object in &page.objects {
            let key = object.key.as_str();
            // Directory markers (zero-byte `key/`), and any other `key/` object: no file name
            // in a listing can end in `/`.
            if key.ends_with('/') {
                continue;
            }
            let size = object.size as i64;
            let name = key.strip_prefix(prefix).unwrap_or(key);
            if !name.is_empty() && !name.contains('/') {
                entries.push(Entry {
                    name: name.to_owned(),
                    is_dir: false,
                    size: Some(size),
                });
            }
        }
        pages += 1;
        if entries.len() > MAX_LISTED_ENTRIES || pages > MAX_LISTED_ENTRIES / 1000 {
            return Err(StoreError {
                status: None,
                code: Some(TOO_MANY_ENTRIES.to_owned()),
                message: format!("the directory holds more than {MAX_LISTED_ENTRIES} entries; list one of its subdirectories"),
            });
        }
        match page.next {
            Some(next) => token = Some(next),
            None => break,
        }
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    entries.dedup_by(|a, b| a.name == b.name && a.is_dir == b.is_dir);
    Ok(entries)
}

/// One entry of MLflow's listing JSON, fields in MLflow's order.
#[derive(Debug, serde::Serialize)]
pub struct FileInfo<'a> {
    pub path: &'a str,
    pub is_dir: bool,
    /// MLflow leaves it out for directories and for empty files.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file_size: Option<i64>,
}

/// MLflow's listing: `{"files": [...]}`, or `{}` for an empty directory.
#[derive(Debug, serde::Serialize)]
pub struct Listing<'a> {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<FileInfo<'a>>,
}

pub fn to_mlflow_json(entries: &[Entry]) -> Listing<'_> {
    Listing {
        files: entries
            .iter()
            .map(|e| FileInfo {
                path: &e.name,
                is_dir: e.is_dir,
                file_size: e.size.filter(|s| !e.is_dir && *s > 0),
            })
            .collect(),
    }
}

/// JSON as MLflow's Flask handlers write it (Python's `json.dumps(indent=2)`): indented by two
/// spaces, non-ASCII characters escaped as `\uXXXX`.
pub fn pretty<T: serde::Serialize>(value: &T) -> axum::response::Response {
    (
        [(http::header::CONTENT_TYPE, "application/json")],
        pretty_string(value),
    )
        .into_response()
}

pub fn pretty_string<T: serde::Serialize>(value: &T) -> String {
    let text = serde_json::to_string_pretty(value).unwrap_or_else(|_| "{}".to_owned());
    if text.is_ascii() {
        return text;
    }
    // Non-ASCII characters only occur inside strings, where `\uXXXX` means the same.
    let mut out = String::with_capacity(text.len() + 16);
    let mut units = [0u16; 2];
    for c in text.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            for unit in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{unit:04x}"));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listing_json_matches_mlflow_shape() {
        let entries = vec![
            Entry {
                name: "dir".into(),
                is_dir: true,
                size: None,
            },
            Entry {
                name: "a.txt".into(),
                is_dir: false,
                size: Some(5),
            },
        ];
        assert_eq!(
            serde_json::to_string(&to_mlflow_json(&entries)).unwrap(),
            r#"{"files":[{"path":"dir","is_dir":true},{"path":"a.txt","is_dir":false,"file_size":5}]}"#
        );
        assert_eq!(pretty_string(&to_mlflow_json(&[])), "{}");
        assert_eq!(
            pretty_string(&serde_json::json!({"path": "ü😀"})),
            "{\n  \"path\": \"\\u00fc\\ud83d\\ude00\"\n}"
        );
        assert!(is_marker("x/dir/", 0));
        assert!(!is_marker("x/dir/", 3));
        assert!(!is_marker("x/file", 0));
    }
}
