//! Reads a `runs/log-batch` or `runs/log-metric` body just far enough to find each metric's key,
//! step and run id, and writes it back with every other byte exactly as the client sent it:
//! values (`"NaN"`, `"Infinity"`), int64 timestamps beyond 2^53, params, tags, dataset fields and
//! unknown fields are never re-encoded.

use std::borrow::Cow;
use std::ops::Range;

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::plumbing::writes;

mod scan;

/// The two endpoints that carry metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    LogBatch,
    LogMetric,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BodyError {
    /// Ambiguous input the proxy refuses rather than guess which spelling MLflow will act on.
    #[error("{0}")]
    Conflict(String),
    /// Not something this module can read (not UTF-8, not JSON, wrong shapes): forwarded
    /// unchanged so the client gets MLflow's own error.
    #[error("unreadable body: {0}")]
    Unreadable(String),
}

/// Fields a write body may carry at the top level: the run in its spellings, the arrays of
/// `log-batch`, and the metric fields of `log-metric`.
const ENVELOPE: [&str; 13] = [
    "run_id",
    "run_uuid",
    "runId",
    "metrics",
    "params",
    "tags",
    "key",
    "value",
    "timestamp",
    "step",
    "model_id",
    "dataset_name",
    "dataset_digest",
];
const RUN_ID: usize = 0;
const RUN_UUID: usize = 1;
const RUN_ID_CAMEL: usize = 2;
const METRICS: usize = 3;
const PARAMS: usize = 4;
const TAGS: usize = 5;
/// Where `log-metric`'s metric fields start at the top level: `key`, `value`, `timestamp`, `step`
/// in the order of [`METRIC`], then its optional `Metric` fields.
const LOG_METRIC: usize = 6;
const OPTIONAL: std::ops::Range<usize> = LOG_METRIC + 4..LOG_METRIC + 7;
/// Fields of a metric: the four the rewriter reads, then those of MLflow's `Metric` it carries.
const METRIC: [&str; 8] = [
    "key",
    "value",
    "timestamp",
    "step",
    "model_id",
    "dataset_name",
    "dataset_digest",
    "run_id",
];
const KEY: usize = 0;
const VALUE: usize = 1;
const TIMESTAMP: usize = 2;
const STEP: usize = 3;

/// A JSON object's fields named in `names`, each as its raw JSON text (a slice of the body, a
/// value its reader validated), in one pass; `unknown` tells whether the object held any other
/// field. A field named twice is an error ("duplicate field").
#[derive(Debug, Clone, Copy)]
struct Fields<'a, const N: usize> {
    raw: [Option<&'a str>; N],
    unknown: bool,
}

impl<'a, const N: usize> Fields<'a, N> {
    fn read(text: &'a str, names: &'static [&'static str; N]) -> Result<Self, serde_json::Error> {
        let mut de = serde_json::Deserializer::from_str(text);
        let fields = serde::Deserializer::deserialize_map(&mut de, FieldsVisitor { names })?;
        de.end()?;
        Ok(fields)
    }

    fn get(&self, index: usize) -> Option<&'a str> {
        self.raw[index]
    }

    fn empty() -> Self {
        Fields {
            raw: [None; N],
            unknown: false,
        }
    }

    /// Where the field `name` goes among `names`, before its value is read: `None` where it is
    /// none of them (the object then holds an unknown field), an error ("duplicate field") where
    /// it was met before.
    fn slot<E: serde::de::Error>(
        &mut self,
        names: &[&str; N],
        name: &str,
    ) -> Result<Option<&mut Option<&'a str>>, E> {
        self.place(names, name)
            .map_err(|index| E::custom(format_args!("duplicate field `{}`", names[index])))
    }

    /// As [`Fields::slot`], a field met before given as its index among `names`.
    fn place(
        &mut self,
        names: &[&str; N],
        name: &str,
    ) -> Result<Option<&mut Option<&'a str>>, usize> {
        match names.iter().position(|known| *known == name) {
            Some(index) if self.raw[index].is_some() => Err(index),
            Some(index) => Ok(Some(&mut self.raw[index])),
            None => {
                self.unknown = true;
                Ok(None)
            }
        }
    }
}

struct FieldsVisitor<const N: usize> {
    names: &'static [&'static str; N],
}

/// A map key, borrowed from the input unless it holds escapes.
struct FieldName<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for FieldName<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = FieldName<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a field name")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(FieldName(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(FieldName(Cow::Owned(v.to_owned())))
            }
        }
        d.deserialize_str(V)
    }
}

impl<'de, const N: usize> serde::de::Visitor<'de> for FieldsVisitor<N> {
    type Value = Fields<'de, N>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut fields = Fields::empty();
        while let Some(FieldName(name)) = map.next_key()? {
            match fields.slot(self.names, &name)? {
                Some(slot) => *slot = Some(map.next_value::<&RawValue>()?.get()),
                None => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        Ok(fields)
    }
}

/// A `log-batch` body read in one pass: its top-level fields (`metrics` left unset) and, where
/// it has a `metrics` array, each element's fields and place, and the array's place.
type OnePass<'a> = (Fields<'a, 13>, Option<(Vec<Placed<'a>>, Range<usize>)>);

/// One element of the `metrics` array, as the one-pass read finds it.
#[derive(Debug)]
struct Placed<'a> {
    fields: Fields<'a, 8>,
    span: Range<usize>,
}

/// One metric of a body, with where its parts sit in the body.
#[derive(Debug, Clone)]
pub struct Metric<'a> {
    pub key: Cow<'a, str>,
    pub step: Option<i64>,
    key_span: Range<usize>,
    step_span: Option<Range<usize>>,
    /// Whether the step was sent as a JSON string (protobuf's int64 mapping allows both).
    step_quoted: bool,
    /// The whole metric object (log-batch), or the whole body (log-metric).
    span: Range<usize>,
    value: Option<&'a str>,
    timestamp: Option<&'a str>,
    /// The timestamp where it is a JSON integer within int64, as clients write it: read once,
    /// for the rule below and for run health.
    timestamp_number: Option<i64>,
    /// Whether MLflow's parser takes this metric exactly as written in a batch (see
    /// [`crate::plumbing::writes`]).
    strict: bool,
}

/// A parsed metrics body.
#[derive(Debug)]
pub struct MetricsBody<'a> {
    text: &'a str,
    pub endpoint: Endpoint,
    pub run_id: Option<String>,
    /// The raw run id value, for bodies the proxy has to rebuild.
    run_id_raw: Option<&'a str>,
    pub metrics: Vec<Metric<'a>>,
    /// Where the `metrics` array sits (log-batch).
    metrics_span: Option<Range<usize>>,
    /// Params and tags in the batch: they are always forwarded.
    pub other_items: usize,
    /// The top-level fields as read, for what the coalescer needs of the body (see
    /// [`MetricsBody::writes`]).
    envelope: Fields<'a, 13>,
}

/// What happens to one metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Edit<'k> {
    Keep,
    Drop,
    /// Forward with a new key and/or step; `also_original` keeps a copy under the key the client
    /// sent (the migration period for existing dashboards).
    Change {
        key: Option<&'k str>,
        step: Option<i64>,
        also_original: bool,
    },
}

fn offset_in(text: &str, part: &str) -> Range<usize> {
    // Both point into the same buffer: a value's text is a slice of the body, as serde_json's
    // RawValue and the one-pass scanner both borrow it.
    let start = part.as_ptr() as usize - text.as_ptr() as usize;
    start..start + part.len()
}

/// A `log-batch` body as its one-pass read found it ([`MetricsBody::scan`]): what the route
/// needs to tell a batch that may go before it is read further ([`Scanned::plain`]), kept for
/// the rest of the read ([`MetricsBody::parse_scanned`]) so that the body is scanned once.
#[derive(Debug)]
pub struct Scanned<'a> {
    /// The body as text; `None` when it is not UTF-8.
    text: Option<&'a str>,
    /// `None` where the one pass gave up (the general read decides).
    pass: Option<OnePass<'a>>,
}

impl<'a> Scanned<'a> {
    /// Whether the body is a `log-batch` of the run's own metrics and nothing else: a run id in
    /// `run_id` alone (a plain string MLflow would take as one), no params or tags (absent,
    /// `null` or `[]`), no other top-level field, and metrics that MLflow's parser takes as
    /// written (each one the coalescer would merge: [`writes`]), their keys plain strings
    /// outside `system/`. The rewriter sends such a body as it came, the coalescer would
    /// merge it claiming nothing, and its writes commute with every other write of its run
    /// (MLflow keeps every sample of a metric, in whatever order they arrive): it may go to
    /// MLflow before anything more is read of it. `None` for anything else, which is read the
    /// whole way.
    pub fn plain(&self) -> Option<Plain<'a>> {
        let (envelope, metrics) = self.pass.as_ref()?;
        let (elements, _) = metrics.as_ref()?;
        let empty = |field| matches!(envelope.get(field), None | Some("null" | "[]"));
        let run_id = writes::unescaped(envelope.get(RUN_ID)?)?;
        let only_run_id = envelope
            .raw
            .iter()
            .enumerate()
            .all(|(field, raw)| raw.is_none() || matches!(field, RUN_ID | PARAMS | TAGS));
        let own_metrics = elements.len() <= writes::MAX_BATCH_METRICS
            && elements.iter().all(|Placed { fields, .. }| {
                let key = fields.get(KEY).and_then(writes::unescaped);
                !fields.unknown
                    && key.is_some_and(|key| !key.starts_with(mlscope_scopes::SYSTEM_PREFIX))
                    && writes::decoded_metric_parses_as_written(
                        fields.get(VALUE),
                        fields.get(TIMESTAMP).and_then(writes::int64),
                        fields
                            .get(STEP)
                            .is_none_or(|step| writes::int64(step).is_some()),
                        &fields.raw[4..],
                    )
            });
        (!envelope.unknown
            && only_run_id
            && empty(PARAMS)
            && empty(TAGS)
            && own_metrics
            && writes::is_valid_run_id(run_id))
        .then_some(Plain {
            run_id,
            metrics: elements.len(),
        })
    }
}

/// A `log-batch` of the run's own metrics only (see [`Scanned::plain`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plain<'a> {
    pub run_id: &'a str,
    pub metrics: usize,
}

/// A string field's value; `raw` is a JSON value its reader validated.
fn decode_string(raw: &str, field: &str) -> Result<String, BodyError> {
    writes::string(raw)
        .map(Cow::into_owned)
        .ok_or_else(|| BodyError::Unreadable(format!("{field} is not a string")))
}

fn decode_step(text: &str) -> Result<(i64, bool), BodyError> {
    if let Ok(step) = text.parse::<i64>() {
        return Ok((step, false));
    }
    serde_json::from_str::<String>(text)
        .ok()
        .and_then(|s| s.parse::<i64>().ok())
        .map(|step| (step, true))
        .ok_or_else(|| BodyError::Unreadable("step is not an int64".into()))
}

impl<'a> Metric<'a> {
    /// The value as a number, when it is one (a JSON number, or a numeric string).
    pub fn value(&self) -> Option<f64> {
        let raw = self.value?.trim();
        raw.trim_matches('"').parse().ok()
    }

    /// The timestamp in unix milliseconds, when it is an int64 (a JSON number or a numeric
    /// string, as protobuf's int64 mapping allows).
    pub fn timestamp_ms(&self) -> Option<i64> {
        // A JSON number, as clients write it, was read with the body; else a numeric string.
        self.timestamp_number
            .or_else(|| self.timestamp?.trim().trim_matches('"').parse().ok())
    }

    fn read(
        text: &'a str,
        fields: &Fields<'a, 8>,
        span: Range<usize>,
    ) -> Result<Option<Self>, BodyError> {
        let Some(key_raw) = fields.get(KEY) else {
            return Ok(None);
        };
        let key = writes::string(key_raw)
            .ok_or_else(|| BodyError::Unreadable("metric key is not a string".into()))?;
        let (step, step_quoted, step_span) = match fields.get(STEP) {
            Some(raw) => {
                let (step, quoted) = decode_step(raw)?;
                (Some(step), quoted, Some(offset_in(text, raw)))
            }
            None => (None, false, None),
        };
        let timestamp = fields.get(TIMESTAMP);
        let timestamp_number = timestamp.and_then(writes::int64);
        // The key was read as a string above, and a step read unquoted is an int64 literal.
        let strict = !fields.unknown
            && writes::decoded_metric_parses_as_written(
                fields.get(VALUE),
                timestamp_number,
                !step_quoted,
                &fields.raw[4..],
            );
        Ok(Some(Metric {
            key,
            step,
            key_span: offset_in(text, key_raw),
            step_span,
            step_quoted,
            span,
            value: fields.get(VALUE),
            timestamp,
            timestamp_number,
            strict,
        }))
    }
}

impl<'a> MetricsBody<'a> {
    /// The batch's tags, decoded, read from the field as parsed (the body is not read again);
    /// none when they are not MLflow's shape (MLflow refuses such a batch).
    pub(crate) fn tags(&self) -> Vec<writes::Pair> {
        writes::pairs(self.envelope.get(TAGS)).unwrap_or_default()
    }

    pub fn parse(body: &'a [u8], endpoint: Endpoint) -> Result<Self, BodyError> {
        Self::parse_with(body, endpoint, true)
    }

    /// A `log-batch` body's one-pass read (see [`Scanned`]), to be read on from with
    /// [`MetricsBody::parse_scanned`].
    pub fn scan(body: &'a [u8]) -> Scanned<'a> {
        let text = std::str::from_utf8(body).ok();
        Scanned {
            text,
            pass: text.and_then(scan::batch),
        }
    }

    /// As [`MetricsBody::parse`], for a `log-batch` body [`MetricsBody::scan`] read: its one
    /// pass is not made again.
    pub fn parse_scanned(scanned: Scanned<'a>) -> Result<Self, BodyError> {
        let text = scanned
            .text
            .ok_or_else(|| BodyError::Unreadable("not UTF-8".into()))?;
        Self::read_from(text, Endpoint::LogBatch, scanned.pass)
    }

    /// As [`MetricsBody::parse`]; without `one_pass`, a batch too is read the general way.
    fn parse_with(body: &'a [u8], endpoint: Endpoint, one_pass: bool) -> Result<Self, BodyError> {
        let text =
            std::str::from_utf8(body).map_err(|_| BodyError::Unreadable("not UTF-8".into()))?;
        // A batch is read in one pass where it can be; what that pass cannot tell, the general
        // read decides (with its own errors).
        let one_pass = match endpoint {
            Endpoint::LogBatch if one_pass => scan::batch(text),
            _ => None,
        };
        Self::read_from(text, endpoint, one_pass)
    }

    /// The body `text` read on from its one pass where that read it, else the general way.
    fn read_from(
        text: &'a str,
        endpoint: Endpoint,
        one_pass: Option<OnePass<'a>>,
    ) -> Result<Self, BodyError> {
        let (envelope, placed) = match one_pass {
            Some((envelope, placed)) => (envelope, Some(placed)),
            None => (Self::read_envelope(text)?, None),
        };

        // Each spelling decoded (the first error wins), then compared with the first present.
        let mut run_ids: [Option<(&str, String, &'a str)>; 3] = Default::default();
        for (slot, (name, raw)) in run_ids.iter_mut().zip([
            ("run_id", envelope.get(RUN_ID)),
            ("run_uuid", envelope.get(RUN_UUID)),
            ("runId", envelope.get(RUN_ID_CAMEL)),
        ]) {
            if let Some(raw) = raw {
                *slot = Some((name, decode_string(raw, name)?, raw));
            }
        }
        let mut present = run_ids.into_iter().flatten();
        let first = present.next();
        if let Some((first_name, first, _)) = &first {
            if let Some((name, other, _)) = present.find(|(_, id, _)| id != first) {
                return Err(BodyError::Conflict(format!(
                    "the request names two different runs: {first_name}={first:?} and {name}={other:?}; send one run id (run_id) or the same value in both fields"
                )));
            }
        }
        let (run_id, run_id_raw) = match first {
            Some((_, id, raw)) => (Some(id), Some(raw)),
            None => (None, None),
        };

        let count = |raw: Option<&str>| -> Result<usize, BodyError> {
            match raw {
                None => Ok(0),
                Some("null") => Ok(0),
                Some(raw) => serde_json::from_str::<Vec<&RawValue>>(raw)
                    .map(|v| v.len())
                    .map_err(|_| BodyError::Unreadable("params/tags is not an array".into())),
            }
        };
        let other_items = count(envelope.get(PARAMS))? + count(envelope.get(TAGS))?;

        let (metrics, metrics_span) = match endpoint {
            Endpoint::LogBatch if placed.is_some() => match placed.flatten() {
                None => (Vec::new(), None),
                Some((elements, span)) => {
                    let mut metrics = Vec::with_capacity(elements.len());
                    for Placed { fields, span } in elements {
                        match Metric::read(text, &fields, span)? {
                            Some(metric) => metrics.push(metric),
                            None => {
                                return Err(BodyError::Unreadable("metric without a key".into()))
                            }
                        }
                    }
                    (metrics, Some(span))
                }
            },
            Endpoint::LogBatch => match envelope.get(METRICS) {
                None => (Vec::new(), None),
                Some("null") => (Vec::new(), None),
                Some(raw) => {
                    let elements: Vec<&'a RawValue> = serde_json::from_str(raw).map_err(|_| {
                        BodyError::Unreadable("metrics is not an array of objects".into())
                    })?;
                    let mut metrics = Vec::with_capacity(elements.len());
                    for element in elements {
                        let fields = Fields::read(element.get(), &METRIC)
                            .map_err(|e| BodyError::Unreadable(format!("metric: {e}")))?;
                        match Metric::read(text, &fields, offset_in(text, element.get()))? {
                            Some(metric) => metrics.push(metric),
                            // A metric without a key is MLflow's to reject; leave the body alone.
                            None => {
                                return Err(BodyError::Unreadable("metric without a key".into()))
                            }
                        }
                    }
                    (metrics, Some(offset_in(text, raw)))
                }
            },
            Endpoint::LogMetric => {
                let mut fields = Fields::<8>::empty();
                fields.raw[..4].copy_from_slice(&envelope.raw[LOG_METRIC..LOG_METRIC + 4]);
                match Metric::read(text, &fields, 0..text.len())? {
                    Some(metric) => (vec![metric], None),
                    None => return Err(BodyError::Unreadable("log-metric without a key".into())),
                }
            }
        };
        Ok(Self {
            text,
            endpoint,
            run_id,
            run_id_raw,
            metrics,
            metrics_span,
            other_items,
            envelope,
        })
    }

    /// The top-level fields, read on their own (the general read): a field named twice is a
    /// conflict, any other error makes the body unreadable.
    fn read_envelope(text: &'a str) -> Result<Fields<'a, 13>, BodyError> {
        Fields::read(text, &ENVELOPE).map_err(|e| {
            let message = e.to_string();
            if message.starts_with("duplicate field") {
                let field = message.split('`').nth(1).unwrap_or("a field");
                BodyError::Conflict(format!(
                    "the request body names `{field}` more than once; send each field once so the proxy and MLflow act on the same value"
                ))
            } else {
                BodyError::Unreadable(message)
            }
        })
    }

    /// Whether the one-pass read of a `log-batch` body, where it reads one, finds what the general
    /// read does (the `metrics` field itself aside, which it leaves unset): `Err` says how they
    /// differ. For the property test in `shell::fuzz` and the cases in this module's tests.
    #[cfg(test)]
    pub(crate) fn one_pass_agrees(body: &'a [u8]) -> Result<bool, String> {
        let Ok(text) = std::str::from_utf8(body) else {
            return Ok(false);
        };
        if scan::batch(text).is_none() {
            return Ok(false);
        }
        let one = format!("{:?}", Self::parse(body, Endpoint::LogBatch));
        let general = Self::parse_with(body, Endpoint::LogBatch, false).map(|mut general| {
            general.envelope.raw[METRICS] = None;
            general
        });
        let other = format!("{general:?}");
        if one == other {
            Ok(true)
        } else {
            Err(format!("one pass: {one}\ngeneral: {other}"))
        }
    }

    /// What the coalescer needs of the body as it is sent (`sent`, to `path`, after `render_spans`
    /// or unchanged): its run and writes, each metric element a slice of `sent`, or why it goes
    /// to MLflow alone; `None` when this read cannot tell (a log-metric rebuilt as a batch), and
    /// the coalescer reads the body itself. One read of the body serves both.
    pub(crate) fn writes(
        &self,
        path: &str,
        sent: &bytes::Bytes,
        rendered: Option<(Endpoint, &ElementSpans)>,
        edit: Option<&Edit<'_>>,
    ) -> Option<Result<writes::Mergeable, writes::Alone>> {
        let endpoint = rendered.map_or(self.endpoint, |(e, _)| e);
        match (self.endpoint, endpoint) {
            (Endpoint::LogBatch, Endpoint::LogBatch) => {
                let prefix = path.strip_suffix("/runs/log-batch")?;
                Some(self.batch_writes(prefix, sent, rendered.map(|(_, s)| s)))
            }
            (Endpoint::LogMetric, Endpoint::LogMetric) => {
                let prefix = path.strip_suffix("/runs/log-metric")?;
                Some(self.log_metric_writes(prefix, edit))
            }
            _ => None,
        }
    }

    fn batch_writes(
        &self,
        prefix: &str,
        sent: &bytes::Bytes,
        spans: Option<&ElementSpans>,
    ) -> Result<writes::Mergeable, writes::Alone> {
        use writes::Alone;
        let envelope = &self.envelope;
        let others = (0..ENVELOPE.len())
            .filter(|i| ![RUN_ID, METRICS, PARAMS, TAGS].contains(i))
            .any(|i| envelope.get(i).is_some());
        if envelope.unknown || others {
            return Err(Alone::Shape);
        }
        let run_id = match envelope.get(RUN_ID).and_then(writes::string) {
            Some(id) if !id.is_empty() => id.into_owned(),
            _ => return Err(Alone::Shape),
        };
        let mut out = writes::Writes {
            params: writes::pairs(envelope.get(PARAMS))?,
            tags: writes::pairs(envelope.get(TAGS))?,
            metrics: Vec::new(),
        };
        let elements: ElementSpans = match spans {
            Some(spans) => spans.clone(),
            None => self
                .metrics
                .iter()
                .enumerate()
                .map(|(i, m)| (m.span.clone(), i))
                .collect(),
        };
        if elements.len() + out.params.len() + out.tags.len() > writes::MAX_BATCH_ITEMS
            || elements.len() > writes::MAX_BATCH_METRICS
        {
            return Err(Alone::Limits);
        }
        if elements
            .iter()
            .any(|(_, source)| !self.metrics[*source].strict)
        {
            return Err(Alone::Element);
        }
        out.metrics = elements
            .into_iter()
            .map(|(span, _)| sent.slice(span))
            .collect();
        writes::check_batch(&out)?;
        Ok(writes::Mergeable {
            batch_path: format!("{prefix}/runs/log-batch"),
            run_id,
            writes: out,
        })
    }

    fn log_metric_writes(
        &self,
        prefix: &str,
        edit: Option<&Edit<'_>>,
    ) -> Result<writes::Mergeable, writes::Alone> {
        use writes::Alone;
        let envelope = &self.envelope;
        let batch_fields = [RUN_ID_CAMEL, METRICS, PARAMS, TAGS]
            .iter()
            .any(|i| envelope.get(*i).is_some());
        if envelope.unknown || batch_fields {
            return Err(Alone::Shape);
        }
        let run_id = match envelope.get(RUN_ID).and_then(writes::string) {
            Some(id) if !id.is_empty() => id,
            _ => return Err(Alone::Shape),
        };
        let run_uuid = envelope.get(RUN_UUID).filter(|r| *r != "null");
        if run_uuid.is_some_and(|u| writes::string(u).as_deref() != Some(&*run_id)) {
            return Err(Alone::Shape);
        }
        let metric = &self.metrics[0];
        let value = envelope.get(LOG_METRIC + VALUE).ok_or(Alone::Shape)?;
        let (key, step) = match edit {
            Some(Edit::Change { key, step, .. }) => (
                key.map(Cow::Borrowed).unwrap_or_else(|| metric.key.clone()),
                step.map(|s| s.to_string()),
            ),
            _ => (metric.key.clone(), None),
        };
        if metric.step_quoted {
            return Err(Alone::Element);
        }
        let step = step.or_else(|| envelope.get(LOG_METRIC + STEP).map(str::to_owned));
        let optional =
            [OPTIONAL.start, OPTIONAL.start + 1, OPTIONAL.start + 2].map(|i| envelope.get(i));
        let element = writes::log_metric_element(
            &key,
            value,
            envelope.get(LOG_METRIC + TIMESTAMP),
            step.as_deref(),
            optional,
            &run_id,
        )?;
        Ok(writes::Mergeable {
            batch_path: format!("{prefix}/runs/log-batch"),
            run_id: run_id.into_owned(),
            writes: writes::Writes {
                metrics: vec![element],
                ..writes::Writes::default()
            },
        })
    }

    /// Writes the body back with `edits` (one per metric) applied. Returns the endpoint the
    /// result must go to: a log-metric whose metric is dropped or duplicated becomes a
    /// log-batch, which MLflow answers the same way (`{}`).
    pub fn render(&self, edits: &[Edit<'_>]) -> (Endpoint, Vec<u8>) {
        let (endpoint, out, _) = self.render_spans(edits);
        (endpoint, out)
    }

    /// As [`MetricsBody::render`], with where each metric element sits in a log-batch result and
    /// which metric of this body it came from.
    pub fn render_spans(&self, edits: &[Edit<'_>]) -> (Endpoint, Vec<u8>, ElementSpans) {
        debug_assert_eq!(edits.len(), self.metrics.len());
        match self.endpoint {
            Endpoint::LogBatch => {
                let Some(span) = &self.metrics_span else {
                    return (
                        Endpoint::LogBatch,
                        self.text.as_bytes().to_vec(),
                        Vec::new(),
                    );
                };
                let mut out = String::with_capacity(self.text.len() + self.text.len() / 4);
                out.push_str(&self.text[..span.start]);
                let mut array = ArrayWriter::open(&mut out);
                for (index, (metric, edit)) in self.metrics.iter().zip(edits).enumerate() {
                    let original = &self.text[metric.span.clone()];
                    match *edit {
                        Edit::Drop => {}
                        Edit::Keep => array.element_from(index).push_str(original),
                        Edit::Change {
                            key,
                            step,
                            also_original,
                        } => {
                            splice_into(
                                array.element_from(index),
                                original,
                                metric.span.start,
                                metric,
                                key,
                                step,
                            );
                            if also_original {
                                array.element_from(index).push_str(original);
                            }
                        }
                    }
                }
                let spans = array.close();
                out.push_str(&self.text[span.end..]);
                (Endpoint::LogBatch, out.into_bytes(), spans)
            }
            Endpoint::LogMetric => {
                let metric = &self.metrics[0];
                let mut out = String::with_capacity(self.text.len() + 64);
                match edits[0] {
                    Edit::Keep => {
                        return (
                            Endpoint::LogMetric,
                            self.text.as_bytes().to_vec(),
                            Vec::new(),
                        )
                    }
                    Edit::Change {
                        key,
                        step,
                        also_original: false,
                    } => {
                        splice_into(&mut out, self.text, 0, metric, key, step);
                        return (Endpoint::LogMetric, out.into_bytes(), Vec::new());
                    }
                    _ => {}
                }
                // Dropped or duplicated: rebuild as a one-run batch from the metric's raw parts.
                out.push('{');
                if let Some(run_id) = self.run_id_raw {
                    out.push_str("\"run_id\":");
                    out.push_str(run_id);
                    out.push(',');
                }
                out.push_str("\"metrics\":");
                let mut array = ArrayWriter::open(&mut out);
                if let Edit::Change { key, step, .. } = edits[0] {
                    write_metric_object(array.element_from(0), metric, key, step);
                    write_metric_object(array.element_from(0), metric, None, None);
                }
                let spans = array.close();
                out.push('}');
                (Endpoint::LogBatch, out.into_bytes(), spans)
            }
        }
    }
}

/// Where each metric element of a rendered log-batch sits, and the metric it came from.
pub type ElementSpans = Vec<(Range<usize>, usize)>;

/// Writes a JSON array element by element, noting where each one sits.
struct ArrayWriter<'o> {
    out: &'o mut String,
    spans: ElementSpans,
    /// The element being written: where it starts and the metric it comes from.
    open: Option<(usize, usize)>,
}

impl<'o> ArrayWriter<'o> {
    fn open(out: &'o mut String) -> Self {
        out.push('[');
        Self {
            out,
            spans: Vec::new(),
            open: None,
        }
    }

    fn end_element(&mut self) {
        if let Some((start, source)) = self.open.take() {
            self.spans.push((start..self.out.len(), source));
        }
    }

    /// The output, positioned for the next element, which comes from metric `source`.
    fn element_from(&mut self, source: usize) -> &mut String {
        let first = self.open.is_none() && self.spans.is_empty();
        self.end_element();
        if !first {
            self.out.push(',');
        }
        self.open = Some((self.out.len(), source));
        self.out
    }

    fn close(mut self) -> ElementSpans {
        self.end_element();
        self.out.push(']');
        self.spans
    }
}

/// A JSON string token for `s`; keys valid under MLflow's rules need no escaping.
fn push_json_string(out: &mut String, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push('"');
        out.push_str(s);
        out.push('"');
    } else {
        out.push_str(&serde_json::to_string(s).expect("a string serializes"));
    }
}

fn push_step(out: &mut String, step: i64, quoted: bool) {
    use std::fmt::Write;
    if quoted {
        let _ = write!(out, "\"{step}\"");
    } else {
        let _ = write!(out, "{step}");
    }
}

/// A metric object for a batch, from a log-metric body's raw parts (values stay as sent).
fn write_metric_object(
    out: &mut String,
    metric: &Metric<'_>,
    key: Option<&str>,
    step: Option<i64>,
) {
    out.push_str("{\"key\":");
    push_json_string(out, key.unwrap_or(&metric.key));
    for (name, raw) in [("value", metric.value), ("timestamp", metric.timestamp)] {
        if let Some(raw) = raw {
            out.push_str(",\"");
            out.push_str(name);
            out.push_str("\":");
            out.push_str(raw);
        }
    }
    if let Some(step) = step.or(metric.step) {
        out.push_str(",\"step\":");
        push_step(out, step, false);
    }
    out.push('}');
}

/// Appends `text` (which starts at `base` in the parsed body) with the metric's key and/or step
/// replaced.
fn splice_into(
    out: &mut String,
    text: &str,
    base: usize,
    metric: &Metric<'_>,
    key: Option<&str>,
    step: Option<i64>,
) {
    let shift = |span: &Range<usize>| span.start - base..span.end - base;
    let key_part = key.map(|key| (shift(&metric.key_span), key));
    let step_part = step
        .zip(metric.step_span.as_ref())
        .map(|(step, span)| (shift(span), step));
    // Key and step may come in either order in the object.
    let key_first = match (&key_part, &step_part) {
        (Some((k, _)), Some((s, _))) => k.start < s.start,
        _ => true,
    };
    let mut at = 0;
    let write_key = |out: &mut String, at: &mut usize| {
        if let Some((span, key)) = &key_part {
            out.push_str(&text[*at..span.start]);
            push_json_string(out, key);
            *at = span.end;
        }
    };
    let write_step = |out: &mut String, at: &mut usize| {
        if let Some((span, step)) = &step_part {
            out.push_str(&text[*at..span.start]);
            push_step(out, *step, metric.step_quoted);
            *at = span.end;
        }
    };
    if key_first {
        write_key(out, &mut at);
        write_step(out, &mut at);
    } else {
        write_step(out, &mut at);
        write_key(out, &mut at);
    }
    out.push_str(&text[at..]);
}

#[cfg(test)]
mod tests;
