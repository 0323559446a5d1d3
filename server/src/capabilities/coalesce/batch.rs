//! One merged batch: which queued requests it takes, and its body.
//!
//! A batch takes requests from the front of a run's queue, in arrival order, while they share
//! the first one's path and credential and the batch stays what MLflow would store exactly as
//! the requests one by one:
//!
//! - within MLflow's limits (1,000 metrics, 100 params, 100 tags, 1,000 items, the body size);
//! - a param already in the batch with the same value is sent once (MLflow accepts re-logging a
//!   value, and refuses one key twice in a batch); with another value the batch ends before that
//!   request, which then goes in the next batch and gets MLflow's own refusal there;
//! - a tag already in the batch with the same value is sent once; with another value the batch
//!   ends before it, so the later value is written later (last writer wins in arrival order);
//! - a metric repeated byte for byte is sent once, as MLflow stores it once.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};

use bytes::{BufMut, Bytes, BytesMut};

use crate::plumbing::writes::{
    Pair, Writes, MAX_BATCH_ITEMS, MAX_BATCH_METRICS, MAX_BATCH_PARAMS, MAX_BATCH_TAGS,
};

/// MLflow refuses `log-batch` bodies over 1,000,000 characters; merged bodies stay below it with
/// room for the envelope.
pub const MAX_BATCH_BYTES: usize = 1_000_000 - 1024;

/// What a batch holds so far, to decide whether the next request fits.
#[derive(Default)]
pub(crate) struct Builder<'a> {
    members: usize,
    metrics: usize,
    bytes: usize,
    params: HashMap<&'a str, &'a str>,
    tags: HashMap<&'a str, &'a str>,
}

impl<'a> Builder<'a> {
    /// Adds `writes` when they fit; the first request always does (it was checked against
    /// MLflow's limits on its own).
    pub(crate) fn add(&mut self, writes: &'a Writes) -> bool {
        let first = self.members == 0;
        let new_params = match new_pairs(&self.params, &writes.params, first) {
            Some(n) => n,
            None => return false,
        };
        let new_tags = match new_pairs(&self.tags, &writes.tags, first) {
            Some(n) => n,
            None => return false,
        };
        let metrics = self.metrics + writes.metrics.len();
        let params = self.params.len() + new_params;
        let tags = self.tags.len() + new_tags;
        let bytes = self.bytes + writes.bytes();
        let fits = metrics <= MAX_BATCH_METRICS
            && params <= MAX_BATCH_PARAMS
            && tags <= MAX_BATCH_TAGS
            && metrics + params + tags <= MAX_BATCH_ITEMS
            && bytes <= MAX_BATCH_BYTES;
        if self.members > 0 && !fits {
            return false;
        }
        for p in &writes.params {
            self.params.entry(&p.key).or_insert(&p.value);
        }
        for t in &writes.tags {
            self.tags.insert(&t.key, &t.value);
        }
        self.members += 1;
        self.metrics = metrics;
        self.bytes = bytes;
        true
    }

    pub(crate) fn members(&self) -> usize {
        self.members
    }
}

/// How many of `pairs` the batch does not hold yet; `None` when one names a key the batch holds
/// with another value, or, within `pairs`, one key twice with different values unless the request
/// is the batch's first (its elements then keep their own order, as MLflow applies them).
fn new_pairs(held: &HashMap<&str, &str>, pairs: &[Pair], first: bool) -> Option<usize> {
    let mut seen: HashMap<&str, &str> = HashMap::new();
    for pair in pairs {
        if let Some(value) = held.get(&*pair.key) {
            if **value != *pair.value {
                return None;
            }
            continue;
        }
        match seen.entry(&pair.key) {
            Entry::Vacant(slot) => {
                slot.insert(&pair.value);
            }
            Entry::Occupied(slot) if *slot.get() == &*pair.value => {}
            Entry::Occupied(_) if first => {}
            Entry::Occupied(_) => return None,
        }
    }
    Some(seen.len())
}

/// `{"run_id": ..., "metrics": [...], "params": [...], "tags": [...]}` with the members' elements in
/// arrival order, each repeated element sent once, and without the params whose keys are `held`
/// (MLflow holds them with the value written).
pub(crate) fn merged_body<'a>(
    run_id: &str,
    members: impl Iterator<Item = &'a Writes> + Clone,
    held: &HashSet<Box<str>>,
) -> Bytes {
    let size: usize = members.clone().map(Writes::bytes).sum();
    let mut out = BytesMut::with_capacity(size + run_id.len() + 64);
    out.put_slice(b"{\"run_id\":");
    out.put_slice(
        serde_json::to_string(run_id)
            .expect("a string serializes")
            .as_bytes(),
    );
    out.put_slice(b",\"metrics\":[");
    let mut seen: HashSet<&[u8]> = HashSet::new();
    let mut first = true;
    for element in members.clone().flat_map(|m| &m.metrics) {
        if seen.insert(element) {
            if !first {
                out.put_u8(b',');
            }
            first = false;
            out.put_slice(element);
        }
    }
    out.put_u8(b']');
    for (name, pairs) in [
        (
            "params",
            members
                .clone()
                .flat_map(|m| &m.params)
                .filter(|p| !held.contains(&p.key))
                .collect::<Vec<_>>(),
        ),
        (
            "tags",
            members.clone().flat_map(|m| &m.tags).collect::<Vec<_>>(),
        ),
    ] {
        if pairs.is_empty() {
            continue;
        }
        out.put_slice(b",\"");
        out.put_slice(name.as_bytes());
        out.put_slice(b"\":[");
        let mut seen: HashSet<(&str, &str)> = HashSet::new();
        let mut first = true;
        for pair in pairs {
            if seen.insert((&pair.key, &pair.value)) {
                if !first {
                    out.put_u8(b',');
                }
                first = false;
                out.put_slice(&pair.raw);
            }
        }
        out.put_u8(b']');
    }
    out.put_u8(b'}');
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn writes(metrics: &[&str], params: &[(&str, &str)], tags: &[(&str, &str)]) -> Writes {
        Writes {
            metrics: metrics.iter().map(|m| Bytes::from(m.to_string())).collect(),
            params: params.iter().map(|(k, v)| Pair::of(k, v)).collect(),
            tags: tags.iter().map(|(k, v)| Pair::of(k, v)).collect(),
        }
    }

    fn take(queue: &[Writes]) -> usize {
        let mut builder = Builder::default();
        queue.iter().take_while(|w| builder.add(w)).count()
    }

    #[test]
    fn identical_params_and_tags_merge_once_and_a_different_value_starts_the_next_batch() {
        let queue = [
            writes(&[r#"{"k":1}"#], &[("lr", "0.1")], &[("t", "a")]),
            writes(&[r#"{"k":2}"#], &[("lr", "0.1")], &[("t", "a")]),
            writes(&[], &[("lr", "0.2")], &[]),
        ];
        assert_eq!(take(&queue), 2);
        let queue = [
            writes(&[], &[], &[("t", "a")]),
            writes(&[], &[], &[("t", "b")]),
        ];
        assert_eq!(take(&queue), 1);
        let body = merged_body("r", queue[..1].iter().chain(&queue[..1]), &HashSet::new());
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            json["tags"],
            serde_json::json!([{"key": "t", "value": "a"}])
        );
        assert_eq!(json["metrics"], serde_json::json!([]));
        assert!(json.get("params").is_none());
    }

    #[test]
    fn batches_stay_within_mlflows_limits() {
        let many = |n: usize, prefix: &str| -> Vec<(String, String)> {
            (0..n)
                .map(|i| (format!("{prefix}{i}"), "v".into()))
                .collect()
        };
        let params = many(60, "p");
        let params: Vec<(&str, &str)> = params
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let other = many(60, "q");
        let other: Vec<(&str, &str)> = other
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        // 60 + 60 distinct params pass 100; 60 + the same 60 do not.
        assert_eq!(
            take(&[writes(&[], &params, &[]), writes(&[], &other, &[])]),
            1
        );
        assert_eq!(
            take(&[writes(&[], &params, &[]), writes(&[], &params, &[])]),
            2
        );
        let metrics: Vec<String> = (0..600).map(|i| format!(r#"{{"key":"k{i}"}}"#)).collect();
        let metrics: Vec<&str> = metrics.iter().map(String::as_str).collect();
        assert_eq!(
            take(&[
                writes(&metrics, &[], &[]),
                writes(&metrics, &[], &[]),
                writes(&["x"], &[], &[])
            ]),
            1
        );
        // 600 metrics and 60 params, then 300 metrics: 960 items, then 1,000 with 40 tags more.
        let tags = many(41, "t");
        let tags: Vec<(&str, &str)> = tags.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert_eq!(
            take(&[
                writes(&metrics, &params, &[]),
                writes(&metrics[..300], &[], &[]),
                writes(&[], &[], &tags),
            ]),
            2
        );
    }

    #[test]
    fn a_merged_body_is_one_valid_batch_without_repeated_elements() {
        let queue = [
            writes(
                &[r#"{"key":"a","value":1,"timestamp":1,"step":0}"#],
                &[("p", "1")],
                &[],
            ),
            writes(
                &[
                    r#"{"key":"a","value":1,"timestamp":1,"step":0}"#,
                    r#"{"key":"b","value":2,"timestamp":1,"step":0}"#,
                ],
                &[("p", "1")],
                &[("t", "x")],
            ),
        ];
        let body = merged_body("run \"1\"", queue.iter(), &HashSet::new());
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["run_id"], "run \"1\"");
        let keys: Vec<&str> = json["metrics"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["key"].as_str().unwrap())
            .collect();
        assert_eq!(keys, ["a", "b"]);
        assert_eq!(json["params"].as_array().unwrap().len(), 1);
        assert_eq!(json["tags"].as_array().unwrap().len(), 1);
    }
}
