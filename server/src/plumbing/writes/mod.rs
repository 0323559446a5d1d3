//! MLflow's write bodies read the way MLflow's parser reads them: which requests MLflow stores
//! exactly as written, and so may share a batch.
//!
//! MLflow reads a request with protobuf's `ParseDict`, and when that fails part way it keeps the
//! partly filled message and carries on (3.17.2 `_get_request_message`): a `log-batch` element
//! whose value is `"abc"`, whose step is `1.5` or whose timestamp is `"soon"` is stored as zeros,
//! every later element of the batch is dropped, and the answer is 200. Sent alone that hurts only
//! its sender; merged, it would silently cost every request queued behind it its samples. So a
//! request joins a merged batch only when every one of its elements is one MLflow's parser takes
//! exactly as written:
//!
//! - a metric is an object of known fields only: `key` (string), `value` (a finite JSON number, or
//!   exactly `"NaN"`, `"Infinity"`, `"-Infinity"`), `timestamp` and `step` (JSON integers within
//!   int64), and the optional strings `model_id`, `dataset_name`, `dataset_digest`, `run_id`;
//! - a param or tag is an object of exactly `key` and `value`, both strings;
//! - the envelope holds only the fields its endpoint defines, each once, in the types above.
//!
//! Anything else (quoted integers, `1.0` as a step, booleans, nulls, camelCase spellings, fields
//! this module does not know) is sent to MLflow alone, as the client sent it, and gets MLflow's own
//! answer. Being stricter than MLflow costs only a merge; being looser would cost samples.

use std::borrow::Cow;
use std::collections::HashSet;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;

/// MLflow's limits on one `log-batch` (`mlflow/utils/validation.py`).
pub(crate) const MAX_BATCH_METRICS: usize = 1000;
pub(crate) const MAX_BATCH_PARAMS: usize = 100;
pub(crate) const MAX_BATCH_TAGS: usize = 100;
pub(crate) const MAX_BATCH_ITEMS: usize = 1000;

/// What a write weighs in samples (metrics, params and tags), set on its response by the route
/// that read its body, for the client's share of samples (the fair share); a write without it
/// weighs one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WriteWeight(pub usize);

/// Whether MLflow would take `id` as a run id (`_validate_run_id`: `^[a-zA-Z0-9][\w\-]{0,255}$`,
/// where Python's `\w` is any Unicode letter, digit or `_`). No run MLflow has can have another
/// id, so nothing the proxy keeps (leases, counters, heartbeats, queues) is made for one: the
/// request goes to MLflow as it is and gets MLflow's refusal.
pub(crate) fn is_valid_run_id(id: &str) -> bool {
    let mut chars = id.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && id.chars().count() <= 256
        && chars.all(|c| c.is_alphanumeric() || c == '_' || c == '-')
}

/// The run a write names, as MLflow picks it, when MLflow would take it as a run id; `None` for a
/// body that is not such an object.
///
/// MLflow reads the body with Python's `json` (a key sent twice keeps its last value, at the
/// place of its first) and protobuf's `ParseDict`, which takes both spellings of a field, the
/// proto name and the JSON name (`run_id`/`runId`, `run_uuid`/`runUuid`), the later one in the
/// object winning, clears a field on `null`, skips keys it does not know and stops at the first
/// value of the wrong type, keeping what it read before. The handlers act on `run_id`, else
/// `run_uuid`. Every spelling is read here the same way, so the proxy never keeps state for one
/// run while MLflow acts on another.
pub(crate) fn run_of(body: &[u8]) -> Option<String> {
    let (mut run_id, mut run_uuid): (Option<String>, Option<String>) = (None, None);
    for (spelling, value) in run_spellings(body)? {
        let field = if spelling < 2 {
            &mut run_id
        } else {
            &mut run_uuid
        };
        match serde_json::from_str::<Option<String>>(value.get()) {
            Ok(read) => *field = read,
            // Not a string: ParseDict stops here.
            Err(_) => break,
        }
    }
    let run = run_id.filter(|id| !id.is_empty()).or(run_uuid)?;
    is_valid_run_id(&run).then_some(run)
}

/// How a write body may spell its run: `run_id`'s two names, then `run_uuid`'s.
const RUN_SPELLINGS: [&str; 4] = ["run_id", "runId", "run_uuid", "runUuid"];

/// The run spellings a JSON object carries (their index in [`RUN_SPELLINGS`]), as Python's
/// `json.loads` keeps them: each once, in the order it first appeared, with the value it was
/// given last; every other value is skipped unread, so a body of many keys costs one pass.
/// `None` for anything but an object.
fn run_spellings(body: &[u8]) -> Option<Vec<(usize, Box<RawValue>)>> {
    struct Spellings;
    impl<'de> serde::de::Visitor<'de> for Spellings {
        type Value = Vec<(usize, Box<RawValue>)>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> Result<Self::Value, A::Error> {
            // (where it first appeared, its last value) per spelling.
            let mut seen: [Option<(usize, Box<RawValue>)>; 4] = Default::default();
            let mut position = 0;
            while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                position += 1;
                match RUN_SPELLINGS.iter().position(|s| *s == key) {
                    Some(i) => {
                        let value = map.next_value::<Box<RawValue>>()?;
                        match &mut seen[i] {
                            Some((_, last)) => *last = value,
                            None => seen[i] = Some((position, value)),
                        }
                    }
                    None => {
                        map.next_value::<serde::de::IgnoredAny>()?;
                    }
                }
            }
            let mut found: Vec<(usize, usize, Box<RawValue>)> = seen
                .into_iter()
                .enumerate()
                .filter_map(|(i, s)| s.map(|(at, value)| (at, i, value)))
                .collect();
            found.sort_by_key(|(at, ..)| *at);
            Ok(found.into_iter().map(|(_, i, value)| (i, value)).collect())
        }
    }
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let spellings = serde::Deserializer::deserialize_map(&mut deserializer, Spellings).ok()?;
    deserializer.end().ok()?;
    Some(spellings)
}

/// A request body as the JSON text MLflow's server reads from it, when that differs from the
/// bytes: Python's `json.loads` takes bytes in UTF-8 with a byte-order mark and in UTF-16 or
/// UTF-32 (told by their byte-order marks or by where the zero bytes of the first characters
/// fall), and MLflow decodes a body that is a JSON string a second time (older clients
/// double-encoded their JSON). `None`: the body is read as it is. Every route that reads a body
/// reads what MLflow will act on, so no encoding lets a write past scoping, dedup or caps.
pub(crate) fn as_mlflow_reads(body: &[u8]) -> Option<Bytes> {
    let text = python_json_text(body);
    let json = text.as_deref().map_or(body, str::as_bytes);
    // A JSON string whose text is JSON: what MLflow acts on. Only a body that begins with a
    // quote is decoded, so an ordinary body costs a look at its first bytes.
    let quoted = json.iter().find(|b| !b" \t\n\r".contains(b)) == Some(&b'"');
    let inner = quoted
        .then(|| serde_json::from_slice::<String>(json).ok())
        .flatten()
        .filter(|inner| serde_json::from_str::<serde::de::IgnoredAny>(inner).is_ok());
    match (inner, text) {
        (Some(inner), _) => Some(Bytes::from(inner)),
        (None, text) => text.map(Bytes::from),
    }
}

/// The text of `body` when Python's `json.loads` would decode it otherwise than as plain UTF-8
/// (`json.detect_encoding`): a UTF-8 byte-order mark, or UTF-16/UTF-32 in either byte order.
fn python_json_text(body: &[u8]) -> Option<String> {
    if let Some(rest) = body.strip_prefix(b"\xef\xbb\xbf") {
        return std::str::from_utf8(rest).ok().map(str::to_owned);
    }
    let utf16 = |big: bool, skip: usize| -> Option<String> {
        let body = body.get(skip..).filter(|b| b.len() % 2 == 0)?;
        let units: Vec<u16> = body
            .chunks_exact(2)
            .map(|u| [u[0], u[1]])
            .map(|u| {
                if big {
                    u16::from_be_bytes(u)
                } else {
                    u16::from_le_bytes(u)
                }
            })
            .collect();
        String::from_utf16(&units).ok()
    };
    let utf32 = |big: bool, skip: usize| -> Option<String> {
        let body = body.get(skip..).filter(|b| b.len() % 4 == 0)?;
        body.chunks_exact(4)
            .map(|u| [u[0], u[1], u[2], u[3]])
            .map(|u| {
                if big {
                    u32::from_be_bytes(u)
                } else {
                    u32::from_le_bytes(u)
                }
            })
            .map(char::from_u32)
            .collect()
    };
    match body {
        [0xff, 0xfe, 0, 0, ..] => utf32(false, 4),
        [0, 0, 0xfe, 0xff, ..] => utf32(true, 4),
        [0xff, 0xfe, ..] => utf16(false, 2),
        [0xfe, 0xff, ..] => utf16(true, 2),
        [0, 0, 0, _, ..] => utf32(true, 0),
        [0, _, ..] => utf16(true, 0),
        [_, 0, 0, 0, ..] => utf32(false, 0),
        [_, 0, ..] => utf16(false, 0),
        _ => None,
    }
}

/// The endpoints whose writes the coalescer takes, by the path suffix MLflow serves them at.
const LOG_BATCH: &str = "/runs/log-batch";
const LOG_METRIC: &str = "/runs/log-metric";
const LOG_PARAM: &str = "/runs/log-parameter";
const SET_TAG: &str = "/runs/set-tag";

/// A param or tag: its decoded key and value (what MLflow compares) and its JSON as sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pair {
    pub(crate) key: Box<str>,
    pub(crate) value: Box<str>,
    pub(crate) raw: Bytes,
}

#[cfg(test)]
impl Pair {
    /// A pair as a client writes it: `{"key": ..., "value": ...}`.
    pub(crate) fn of(key: &str, value: &str) -> Pair {
        Pair {
            key: key.into(),
            value: value.into(),
            raw: Bytes::from(serde_json::json!({"key": key, "value": value}).to_string()),
        }
    }
}

/// The writes of one request, each element as the JSON a batch carries.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Writes {
    pub(crate) metrics: Vec<Bytes>,
    pub(crate) params: Vec<Pair>,
    pub(crate) tags: Vec<Pair>,
}

impl Writes {
    pub(crate) fn items(&self) -> usize {
        self.metrics.len() + self.params.len() + self.tags.len()
    }

    /// Bytes the elements take in a batch body (with their separators).
    pub(crate) fn bytes(&self) -> usize {
        let pairs = |p: &[Pair]| p.iter().map(|p| p.raw.len() + 1).sum::<usize>();
        self.metrics.iter().map(|m| m.len() + 1).sum::<usize>()
            + pairs(&self.params)
            + pairs(&self.tags)
    }

    /// Whether the order of this request against others of the run is visible in MLflow:
    /// a tag's last writer wins, a param's first writer does.
    pub(crate) fn is_ordered(&self) -> bool {
        !self.params.is_empty() || !self.tags.is_empty()
    }
}

/// A request the coalescer can merge: where its batch goes, the run, and its writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Mergeable {
    pub(crate) batch_path: String,
    pub(crate) run_id: String,
    pub(crate) writes: Writes,
}

/// Why a request goes to MLflow alone; the label of `mlscope_coalesce_skipped_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Alone {
    /// Not a write shape the coalescer knows: not JSON, unknown or repeated fields, another
    /// spelling of the run, no run id or one MLflow would refuse, nothing to write.
    Shape,
    /// An element MLflow's parser would not take exactly as written.
    Element,
    /// Over one of MLflow's batch limits on its own.
    Limits,
    /// One param key twice in the request, which MLflow refuses in a batch.
    RepeatedParam,
}

impl Alone {
    pub(crate) fn reason(self) -> &'static str {
        match self {
            Alone::Shape => "shape",
            Alone::Element => "element",
            Alone::Limits => "limits",
            Alone::RepeatedParam => "repeated_param",
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchEnvelope<'a> {
    #[serde(borrow)]
    run_id: Cow<'a, str>,
    #[serde(default, borrow)]
    metrics: Option<Vec<&'a RawValue>>,
    #[serde(default, borrow)]
    params: Option<Vec<&'a RawValue>>,
    #[serde(default, borrow)]
    tags: Option<Vec<&'a RawValue>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MetricElement<'a> {
    #[serde(borrow)]
    key: &'a RawValue,
    #[serde(borrow)]
    value: &'a RawValue,
    #[serde(borrow)]
    timestamp: &'a RawValue,
    #[serde(default, borrow)]
    step: Option<&'a RawValue>,
    #[serde(default, borrow)]
    model_id: Option<&'a RawValue>,
    #[serde(default, borrow)]
    dataset_name: Option<&'a RawValue>,
    #[serde(default, borrow)]
    dataset_digest: Option<&'a RawValue>,
    #[serde(default, borrow)]
    run_id: Option<&'a RawValue>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PairElement<'a> {
    #[serde(borrow)]
    key: &'a RawValue,
    #[serde(borrow)]
    value: &'a RawValue,
}

/// `log-metric`, `log-param` and `set-tag`: the run (once or in both spellings, equal) and one
/// element's fields at the top level.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SingleEnvelope<'a> {
    #[serde(borrow)]
    run_id: Cow<'a, str>,
    #[serde(default, borrow)]
    run_uuid: Option<Cow<'a, str>>,
    #[serde(borrow)]
    key: &'a RawValue,
    #[serde(borrow)]
    value: &'a RawValue,
    #[serde(default, borrow)]
    timestamp: Option<&'a RawValue>,
    #[serde(default, borrow)]
    step: Option<&'a RawValue>,
    #[serde(default, borrow)]
    model_id: Option<&'a RawValue>,
    #[serde(default, borrow)]
    dataset_name: Option<&'a RawValue>,
    #[serde(default, borrow)]
    dataset_digest: Option<&'a RawValue>,
}

/// A JSON string's decoded text; `None` for anything else (null included). `text` is one JSON
/// value's text as a parser validated it (a `RawValue`'s, or the rewriter's one-pass read's), so
/// where the string holds no escape the text between its quotes is the string itself (control
/// characters were refused).
pub(crate) fn string(text: &str) -> Option<Cow<'_, str>> {
    if let Some(inner) = unescaped(text) {
        return Some(Cow::Borrowed(inner));
    }
    text.starts_with('"')
        .then(|| serde_json::from_str::<String>(text).ok().map(Cow::Owned))
        .flatten()
}

/// A JSON string's text where it holds no escape (the text between its quotes is then the
/// string itself, as [`string`] reads it); `None` for any other value or a string with escapes.
pub(crate) fn unescaped(text: &str) -> Option<&str> {
    text.strip_prefix('"')?
        .strip_suffix('"')
        .filter(|inner| !inner.contains('\\'))
}

/// A double as protobuf's JSON parser takes it: a finite JSON number or one of its three names.
fn is_double(text: &str) -> bool {
    matches!(text, "\"NaN\"" | "\"Infinity\"" | "\"-Infinity\"") || is_finite_number(text)
}

/// A JSON number literal that is a finite double (not `1e999`).
fn is_finite_number(text: &str) -> bool {
    if !text.starts_with(|c: char| c == '-' || c.is_ascii_digit()) {
        return false;
    }
    // `text` is a JSON number (its parser read it as one). Without an exponent and with fewer
    // digits than the largest double's 309 it is finite, with no need to convert it.
    if text.len() <= 308 && !text.bytes().any(|b| b == b'e' || b == b'E') {
        return true;
    }
    text.parse::<f64>().is_ok_and(f64::is_finite)
}

/// A JSON integer literal within int64 (no fraction, no exponent, not quoted).
fn is_int64(text: &str) -> bool {
    int64(text).is_some()
}

/// The value of a JSON integer literal within int64 (no fraction, no exponent, not quoted).
pub(crate) fn int64(text: &str) -> Option<i64> {
    text.starts_with(|c: char| c == '-' || c.is_ascii_digit())
        .then(|| text.parse().ok())
        .flatten()
}

/// Whether every optional field present (`model_id`, `dataset_name`, ...) is a string.
fn optional_strings(fields: &[Option<&str>]) -> bool {
    fields.iter().flatten().all(|raw| string(raw).is_some())
}

/// Whether a metric's fields are ones MLflow's parser takes exactly as written in a `log-batch`
/// element: the rule every merged element passes. Each field is its JSON text, as [`string`]
/// takes it.
fn metric_parses_as_written(
    key: Option<&str>,
    value: Option<&str>,
    timestamp: Option<&str>,
    step: Option<&str>,
    optional: &[Option<&str>],
) -> bool {
    key.is_some_and(|k| string(k).is_some())
        && decoded_metric_parses_as_written(
            value,
            timestamp.and_then(int64),
            step.is_none_or(is_int64),
            optional,
        )
}

/// [`metric_parses_as_written`] for a metric whose key was read as a string, with its timestamp
/// as an int64 literal read (`None`: absent or not one) and whether its step is absent or an
/// int64 literal: the rewriter's single read of a body decodes those once (`Metric::read`).
pub(crate) fn decoded_metric_parses_as_written(
    value: Option<&str>,
    timestamp: Option<i64>,
    step_absent_or_int64: bool,
    optional: &[Option<&str>],
) -> bool {
    value.is_some_and(is_double)
        && timestamp.is_some()
        && step_absent_or_int64
        && optional_strings(optional)
}

fn metric_element(raw: &RawValue) -> Result<(), Alone> {
    let m: MetricElement = serde_json::from_str(raw.get()).map_err(|_| Alone::Element)?;
    metric_parses_as_written(
        Some(m.key.get()),
        Some(m.value.get()),
        Some(m.timestamp.get()),
        m.step.map(RawValue::get),
        &[m.model_id, m.dataset_name, m.dataset_digest, m.run_id].map(|f| f.map(RawValue::get)),
    )
    .then_some(())
    .ok_or(Alone::Element)
}

/// A param or tag element MLflow's parser takes as written (exactly `key` and `value`, both
/// strings), with `raw` its JSON as the batch carries it.
pub(crate) fn pair(element: &RawValue, raw: Bytes) -> Result<Pair, Alone> {
    let p: PairElement = serde_json::from_str(element.get()).map_err(|_| Alone::Element)?;
    let (Some(key), Some(value)) = (string(p.key.get()), string(p.value.get())) else {
        return Err(Alone::Element);
    };
    Ok(Pair {
        key: key.into(),
        value: value.into(),
        raw,
    })
}

/// The params or tags array of a `log-batch` (absent or `null`: none), each element as
/// [`pair`] reads it, with its JSON copied. `array` is the field's JSON text, as [`string`] takes it.
pub(crate) fn pairs(array: Option<&str>) -> Result<Vec<Pair>, Alone> {
    let Some(array) = array.filter(|a| *a != "null") else {
        return Ok(Vec::new());
    };
    let elements: Vec<&RawValue> = serde_json::from_str(array).map_err(|_| Alone::Shape)?;
    elements
        .into_iter()
        .map(|e| pair(e, Bytes::copy_from_slice(e.get().as_bytes())))
        .collect()
}

/// MLflow's limits on one batch and its rule of one value per param key.
pub(crate) fn check_batch(writes: &Writes) -> Result<(), Alone> {
    if writes.metrics.len() > MAX_BATCH_METRICS
        || writes.params.len() > MAX_BATCH_PARAMS
        || writes.tags.len() > MAX_BATCH_TAGS
        || writes.items() > MAX_BATCH_ITEMS
    {
        return Err(Alone::Limits);
    }
    let mut keys = HashSet::new();
    if !writes.params.iter().all(|p| keys.insert(&p.key)) {
        return Err(Alone::RepeatedParam);
    }
    if writes.items() == 0 {
        return Err(Alone::Shape);
    }
    Ok(())
}

/// What the rewriter, having read a body once, tells the coalescer about it as sent: its run
/// and writes, or why it goes to MLflow alone. Absent when the rewriter could not tell; the
/// coalescer then reads the body itself.
#[derive(Debug, Clone)]
pub struct Prepared(pub(crate) Result<Mergeable, Alone>);

/// Reads a write request; `Err` says why it goes to MLflow alone.
pub(crate) fn parse(path: &str, body: &Bytes) -> Result<Mergeable, Alone> {
    let text = std::str::from_utf8(body).map_err(|_| Alone::Shape)?;
    if let Some(prefix) = path.strip_suffix(LOG_BATCH) {
        return parse_batch(prefix, body, text);
    }
    let (prefix, kind) = [LOG_METRIC, LOG_PARAM, SET_TAG]
        .into_iter()
        .find_map(|suffix| path.strip_suffix(suffix).map(|prefix| (prefix, suffix)))
        .ok_or(Alone::Shape)?;
    let single: SingleEnvelope = serde_json::from_str(text).map_err(|_| Alone::Shape)?;
    // MLflow acts on `run_id or run_uuid`; merging needs both to name the same run.
    if !is_valid_run_id(&single.run_id)
        || single
            .run_uuid
            .as_ref()
            .is_some_and(|u| *u != single.run_id)
    {
        return Err(Alone::Shape);
    }
    let mut writes = Writes::default();
    if kind == LOG_METRIC {
        writes.metrics.push(metric_of(&single)?);
    } else {
        if single.timestamp.is_some()
            || single.step.is_some()
            || single.model_id.is_some()
            || single.dataset_name.is_some()
            || single.dataset_digest.is_some()
        {
            return Err(Alone::Shape);
        }
        let (Some(key), Some(value)) = (string(single.key.get()), string(single.value.get()))
        else {
            return Err(Alone::Element);
        };
        let mut raw = serde_json::json!({ "key": key, "value": value }).to_string();
        raw.shrink_to_fit();
        let pair = Pair {
            key: key.into(),
            value: value.into(),
            raw: Bytes::from(raw),
        };
        if kind == LOG_PARAM {
            writes.params.push(pair);
        } else {
            writes.tags.push(pair);
        }
    }
    Ok(Mergeable {
        batch_path: format!("{prefix}{LOG_BATCH}"),
        run_id: single.run_id.into_owned(),
        writes,
    })
}

/// `log-metric` as the batch element MLflow builds from it: the same fields, with the request's
/// run id on the element as `_log_metric` puts it on the `Metric` (it reaches logged-model
/// metrics). Only a finite JSON number is taken as the value: `log-metric` checks its value
/// itself, and the element must mean the same in a batch.
fn metric_of(single: &SingleEnvelope) -> Result<Bytes, Alone> {
    let key = string(single.key.get()).ok_or(Alone::Element)?;
    log_metric_element(
        &key,
        single.value.get(),
        single.timestamp.map(RawValue::get),
        single.step.map(RawValue::get),
        [single.model_id, single.dataset_name, single.dataset_digest].map(|f| f.map(RawValue::get)),
        &single.run_id,
    )
}

/// The batch element of a `log-metric` with these fields (`step` as the text to write), or why it
/// goes alone. Each field is its JSON text, as [`string`] takes it.
pub(crate) fn log_metric_element(
    key: &str,
    value: &str,
    timestamp: Option<&str>,
    step: Option<&str>,
    optional: [Option<&str>; 3],
    run_id: &str,
) -> Result<Bytes, Alone> {
    let timestamp = timestamp.ok_or(Alone::Element)?;
    if !is_finite_number(value)
        || !is_int64(timestamp)
        || !step.is_none_or(|s| {
            s.starts_with(|c: char| c == '-' || c.is_ascii_digit()) && s.parse::<i64>().is_ok()
        })
        || !optional_strings(&optional)
    {
        return Err(Alone::Element);
    }
    let mut out = String::with_capacity(96 + key.len() + run_id.len());
    out.push_str("{\"key\":");
    out.push_str(&serde_json::to_string(key).expect("a string serializes"));
    out.push_str(",\"value\":");
    out.push_str(value);
    out.push_str(",\"timestamp\":");
    out.push_str(timestamp);
    if let Some(step) = step {
        out.push_str(",\"step\":");
        out.push_str(step);
    }
    for (name, raw) in ["model_id", "dataset_name", "dataset_digest"]
        .into_iter()
        .zip(optional)
    {
        if let Some(raw) = raw {
            out.push_str(",\"");
            out.push_str(name);
            out.push_str("\":");
            out.push_str(raw);
        }
    }
    out.push_str(",\"run_id\":");
    out.push_str(&serde_json::to_string(run_id).expect("a string serializes"));
    out.push('}');
    Ok(Bytes::from(out))
}

fn parse_batch(prefix: &str, body: &Bytes, text: &str) -> Result<Mergeable, Alone> {
    let envelope: BatchEnvelope = serde_json::from_str(text).map_err(|_| Alone::Shape)?;
    let metrics = envelope.metrics.unwrap_or_default();
    let params = envelope.params.unwrap_or_default();
    let tags = envelope.tags.unwrap_or_default();
    if !is_valid_run_id(&envelope.run_id) || metrics.len() + params.len() + tags.len() == 0 {
        return Err(Alone::Shape);
    }
    if metrics.len() > MAX_BATCH_METRICS
        || params.len() > MAX_BATCH_PARAMS
        || tags.len() > MAX_BATCH_TAGS
        || metrics.len() + params.len() + tags.len() > MAX_BATCH_ITEMS
    {
        return Err(Alone::Limits);
    }
    let mut writes = Writes::default();
    for raw in metrics {
        metric_element(raw)?;
        writes.metrics.push(body.slice_ref(raw.get().as_bytes()));
    }
    for raw in params {
        writes
            .params
            .push(pair(raw, body.slice_ref(raw.get().as_bytes()))?);
    }
    for raw in tags {
        writes
            .tags
            .push(pair(raw, body.slice_ref(raw.get().as_bytes()))?);
    }
    check_batch(&writes)?;
    Ok(Mergeable {
        batch_path: format!("{prefix}{LOG_BATCH}"),
        run_id: envelope.run_id.into_owned(),
        writes,
    })
}

/// The body as the JSON MLflow reads from it (see [`as_mlflow_reads`]), with its length in the
/// head.
pub(crate) fn normalized(
    body: bytes::Bytes,
    mut parts: http::request::Parts,
) -> (bytes::Bytes, http::request::Parts) {
    match as_mlflow_reads(&body) {
        Some(read) => {
            parts.headers.insert(
                http::header::CONTENT_LENGTH,
                http::HeaderValue::from(read.len()),
            );
            (read, parts)
        }
        None => (body, parts),
    }
}

#[cfg(test)]
mod tests;
