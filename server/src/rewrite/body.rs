//! Reads a `runs/log-batch` or `runs/log-metric` body just far enough to find each metric's key,
//! step and run id, and writes it back with every other byte exactly as the client sent it:
//! values (`"NaN"`, `"Infinity"`), int64 timestamps beyond 2^53, params, tags, dataset fields and
//! unknown fields are never re-encoded.

use std::borrow::Cow;
use std::ops::Range;

use serde::Deserialize;
use serde_json::value::RawValue;

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

#[derive(Deserialize)]
struct Envelope<'a> {
    #[serde(borrow, default)]
    run_id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    run_uuid: Option<&'a RawValue>,
    #[serde(borrow, default, rename = "runId")]
    run_id_camel: Option<&'a RawValue>,
    #[serde(borrow, default)]
    metrics: Option<&'a RawValue>,
    #[serde(borrow, default)]
    params: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tags: Option<&'a RawValue>,
    // log-metric carries the metric's fields at the top level.
    #[serde(borrow, default)]
    key: Option<&'a RawValue>,
    #[serde(borrow, default)]
    value: Option<&'a RawValue>,
    #[serde(borrow, default)]
    timestamp: Option<&'a RawValue>,
    #[serde(borrow, default)]
    step: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct MetricFields<'a> {
    #[serde(borrow, default)]
    key: Option<&'a RawValue>,
    #[serde(borrow, default)]
    value: Option<&'a RawValue>,
    #[serde(borrow, default)]
    timestamp: Option<&'a RawValue>,
    #[serde(borrow, default)]
    step: Option<&'a RawValue>,
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
    // Both point into the same buffer: serde_json's RawValue borrows from the input.
    let start = part.as_ptr() as usize - text.as_ptr() as usize;
    start..start + part.len()
}

fn decode_string(raw: &RawValue, field: &str) -> Result<String, BodyError> {
    serde_json::from_str::<String>(raw.get())
        .map_err(|_| BodyError::Unreadable(format!("{field} is not a string")))
}

fn decode_step(raw: &RawValue) -> Result<(i64, bool), BodyError> {
    let text = raw.get();
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

    fn read(
        text: &'a str,
        fields: MetricFields<'a>,
        span: Range<usize>,
    ) -> Result<Option<Self>, BodyError> {
        let Some(key_raw) = fields.key else {
            return Ok(None);
        };
        let key = serde_json::from_str::<Cow<'a, str>>(key_raw.get())
            .map_err(|_| BodyError::Unreadable("metric key is not a string".into()))?;
        let (step, step_quoted, step_span) = match fields.step {
            Some(raw) => {
                let (step, quoted) = decode_step(raw)?;
                (Some(step), quoted, Some(offset_in(text, raw.get())))
            }
            None => (None, false, None),
        };
        Ok(Some(Metric {
            key,
            step,
            key_span: offset_in(text, key_raw.get()),
            step_span,
            step_quoted,
            span,
            value: fields.value.map(RawValue::get),
            timestamp: fields.timestamp.map(RawValue::get),
        }))
    }
}

impl<'a> MetricsBody<'a> {
    pub fn parse(body: &'a [u8], endpoint: Endpoint) -> Result<Self, BodyError> {
        let text =
            std::str::from_utf8(body).map_err(|_| BodyError::Unreadable("not UTF-8".into()))?;
        let envelope: Envelope<'a> = serde_json::from_str(text).map_err(|e| {
            let message = e.to_string();
            if message.starts_with("duplicate field") {
                let field = message.split('`').nth(1).unwrap_or("a field");
                BodyError::Conflict(format!(
                    "the request body names `{field}` more than once; send each field once so the proxy and MLflow act on the same value"
                ))
            } else {
                BodyError::Unreadable(message)
            }
        })?;

        let mut run_ids = Vec::new();
        for (name, raw) in [
            ("run_id", envelope.run_id),
            ("run_uuid", envelope.run_uuid),
            ("runId", envelope.run_id_camel),
        ] {
            if let Some(raw) = raw {
                run_ids.push((name, decode_string(raw, name)?, raw.get()));
            }
        }
        if let Some((first_name, first, _)) = run_ids.first() {
            if let Some((name, other, _)) = run_ids.iter().find(|(_, id, _)| id != first) {
                return Err(BodyError::Conflict(format!(
                    "the request names two different runs: {first_name}={first:?} and {name}={other:?}; send one run id (run_id) or the same value in both fields"
                )));
            }
        }
        let run_id_raw = run_ids.first().map(|(_, _, raw)| *raw);
        let run_id = run_ids.into_iter().next().map(|(_, id, _)| id);

        let count = |raw: Option<&RawValue>| -> Result<usize, BodyError> {
            match raw {
                None => Ok(0),
                Some(raw) if raw.get() == "null" => Ok(0),
                Some(raw) => serde_json::from_str::<Vec<&RawValue>>(raw.get())
                    .map(|v| v.len())
                    .map_err(|_| BodyError::Unreadable("params/tags is not an array".into())),
            }
        };
        let other_items = count(envelope.params)? + count(envelope.tags)?;

        let (metrics, metrics_span) = match endpoint {
            Endpoint::LogBatch => match envelope.metrics {
                None => (Vec::new(), None),
                Some(raw) if raw.get() == "null" => (Vec::new(), None),
                Some(raw) => {
                    let elements: Vec<&'a RawValue> =
                        serde_json::from_str(raw.get()).map_err(|_| {
                            BodyError::Unreadable("metrics is not an array of objects".into())
                        })?;
                    let mut metrics = Vec::with_capacity(elements.len());
                    for element in elements {
                        let fields: MetricFields<'a> = serde_json::from_str(element.get())
                            .map_err(|e| BodyError::Unreadable(format!("metric: {e}")))?;
                        match Metric::read(text, fields, offset_in(text, element.get()))? {
                            Some(metric) => metrics.push(metric),
                            // A metric without a key is MLflow's to reject; leave the body alone.
                            None => {
                                return Err(BodyError::Unreadable("metric without a key".into()))
                            }
                        }
                    }
                    (metrics, Some(offset_in(text, raw.get())))
                }
            },
            Endpoint::LogMetric => {
                let fields = MetricFields {
                    key: envelope.key,
                    value: envelope.value,
                    timestamp: envelope.timestamp,
                    step: envelope.step,
                };
                match Metric::read(text, fields, 0..text.len())? {
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
        })
    }

    /// Writes the body back with `edits` (one per metric) applied. Returns the endpoint the
    /// result must go to: a log-metric whose metric is dropped or duplicated becomes a
    /// log-batch, which MLflow answers the same way (`{}`).
    pub fn render(&self, edits: &[Edit<'_>]) -> (Endpoint, Vec<u8>) {
        debug_assert_eq!(edits.len(), self.metrics.len());
        match self.endpoint {
            Endpoint::LogBatch => {
                let Some(span) = &self.metrics_span else {
                    return (Endpoint::LogBatch, self.text.as_bytes().to_vec());
                };
                let mut out = String::with_capacity(self.text.len() + self.text.len() / 4);
                out.push_str(&self.text[..span.start]);
                let mut array = ArrayWriter::open(&mut out);
                for (metric, edit) in self.metrics.iter().zip(edits) {
                    let original = &self.text[metric.span.clone()];
                    match *edit {
                        Edit::Drop => {}
                        Edit::Keep => array.element().push_str(original),
                        Edit::Change {
                            key,
                            step,
                            also_original,
                        } => {
                            splice_into(
                                array.element(),
                                original,
                                metric.span.start,
                                metric,
                                key,
                                step,
                            );
                            if also_original {
                                array.element().push_str(original);
                            }
                        }
                    }
                }
                array.close();
                out.push_str(&self.text[span.end..]);
                (Endpoint::LogBatch, out.into_bytes())
            }
            Endpoint::LogMetric => {
                let metric = &self.metrics[0];
                let mut out = String::with_capacity(self.text.len() + 64);
                match edits[0] {
                    Edit::Keep => return (Endpoint::LogMetric, self.text.as_bytes().to_vec()),
                    Edit::Change {
                        key,
                        step,
                        also_original: false,
                    } => {
                        splice_into(&mut out, self.text, 0, metric, key, step);
                        return (Endpoint::LogMetric, out.into_bytes());
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
                    write_metric_object(array.element(), metric, key, step);
                    write_metric_object(array.element(), metric, None, None);
                }
                array.close();
                out.push('}');
                (Endpoint::LogBatch, out.into_bytes())
            }
        }
    }
}

/// Writes a JSON array element by element.
struct ArrayWriter<'o> {
    out: &'o mut String,
    empty: bool,
}

impl<'o> ArrayWriter<'o> {
    fn open(out: &'o mut String) -> Self {
        out.push('[');
        Self { out, empty: true }
    }

    /// The output, positioned for the next element.
    fn element(&mut self) -> &mut String {
        if !self.empty {
            self.out.push(',');
        }
        self.empty = false;
        self.out
    }

    fn close(self) {
        self.out.push(']');
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
mod tests {
    use super::*;
    use serde_json::Value;

    const BATCH: &str = r#"{"run_id":"r1","metrics":[{"key":"system/cpu_utilization_percentage","value":"NaN","timestamp":9007199254740993,"step":9007199254740995},{"key":"loss","value":1e-7,"timestamp":1,"step":0,"extra":{"x":[1,2]}}],"params":[{"key":"p","value":"v"}],"tags":[],"unknown":true}"#;

    #[test]
    fn untouched_bodies_come_back_byte_for_byte() {
        let body = MetricsBody::parse(BATCH.as_bytes(), Endpoint::LogBatch).unwrap();
        assert_eq!(body.run_id.as_deref(), Some("r1"));
        assert_eq!(body.metrics.len(), 2);
        assert_eq!(body.other_items, 1);
        let (_, out) = body.render(&[Edit::Keep, Edit::Keep]);
        assert_eq!(std::str::from_utf8(&out).unwrap(), BATCH);
    }

    #[test]
    fn keys_and_steps_change_and_nothing_else_does() {
        let body = MetricsBody::parse(BATCH.as_bytes(), Endpoint::LogBatch).unwrap();
        let edits = [
            Edit::Change {
                key: Some("system/n/node_cpu_utilization_percentage"),
                step: Some(12),
                also_original: false,
            },
            Edit::Keep,
        ];
        let (_, out) = body.render(&edits);
        let text = std::str::from_utf8(&out).unwrap();
        assert_eq!(
            text,
            BATCH
                .replace(
                    "system/cpu_utilization_percentage",
                    "system/n/node_cpu_utilization_percentage"
                )
                .replace("9007199254740995", "12")
        );
    }

    #[test]
    fn dropped_and_duplicated_metrics_keep_the_array_well_formed() {
        let body = MetricsBody::parse(BATCH.as_bytes(), Endpoint::LogBatch).unwrap();
        let (_, out) = body.render(&[Edit::Drop, Edit::Drop]);
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["metrics"], serde_json::json!([]));
        assert_eq!(v["params"][0]["key"], "p");

        let (_, out) = body.render(&[
            Edit::Change {
                key: Some("system/new"),
                step: None,
                also_original: true,
            },
            Edit::Drop,
        ]);
        let v: Value = serde_json::from_slice(&out).unwrap();
        let keys: Vec<_> = v["metrics"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["key"].as_str().unwrap())
            .collect();
        assert_eq!(keys, ["system/new", "system/cpu_utilization_percentage"]);
    }

    #[test]
    fn log_metric_is_rewritten_in_place_or_rebuilt_as_a_batch() {
        let text = r#"{"run_id":"r1","run_uuid":"r1","key":"system/rank-1/network_receive_megabytes","value":"Infinity","timestamp":5,"step":"7"}"#;
        let body = MetricsBody::parse(text.as_bytes(), Endpoint::LogMetric).unwrap();
        assert_eq!(body.metrics[0].step, Some(7));
        let (endpoint, out) = body.render(&[Edit::Change {
            key: Some("system/x"),
            step: Some(9),
            also_original: false,
        }]);
        assert_eq!(endpoint, Endpoint::LogMetric);
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            text.replace("system/rank-1/network_receive_megabytes", "system/x")
                .replace("\"7\"", "\"9\"")
        );

        let (endpoint, out) = body.render(&[Edit::Drop]);
        assert_eq!(endpoint, Endpoint::LogBatch);
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{"run_id":"r1","metrics":[]}"#
        );

        let (endpoint, out) = body.render(&[Edit::Change {
            key: Some("system/x"),
            step: None,
            also_original: true,
        }]);
        assert_eq!(endpoint, Endpoint::LogBatch);
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            v["metrics"][0],
            serde_json::json!({"key": "system/x", "value": "Infinity", "timestamp": 5, "step": 7})
        );
        assert_eq!(
            v["metrics"][1]["key"],
            "system/rank-1/network_receive_megabytes"
        );
    }

    #[test]
    fn conflicting_run_ids_and_repeated_fields_are_refused() {
        let err = MetricsBody::parse(
            br#"{"run_id":"a","run_uuid":"b","key":"k","value":1,"timestamp":1}"#,
            Endpoint::LogMetric,
        )
        .unwrap_err();
        assert!(
            matches!(&err, BodyError::Conflict(m) if m.contains("run_id=\"a\"") && m.contains("run_uuid=\"b\"")),
            "{err}"
        );
        let err = MetricsBody::parse(
            br#"{"runId":"a","run_id":"a","run_id":"b","metrics":[]}"#,
            Endpoint::LogBatch,
        )
        .unwrap_err();
        assert!(
            matches!(&err, BodyError::Conflict(m) if m.contains("`run_id` more than once")),
            "{err}"
        );
        assert!(MetricsBody::parse(
            br#"{"run_id":"a","runId":"a","metrics":[]}"#,
            Endpoint::LogBatch
        )
        .is_ok());
    }

    #[test]
    fn unreadable_bodies_are_reported_for_pass_through() {
        for bad in [
            &b"not json"[..],
            b"{\"metrics\": 5}",
            b"{\"metrics\": [{\"value\": 1}]}",
            b"\xff\xfe",
            b"{\"run_id\": 5}",
        ] {
            assert!(
                matches!(
                    MetricsBody::parse(bad, Endpoint::LogBatch),
                    Err(BodyError::Unreadable(_))
                ),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn escaped_keys_are_decoded() {
        let body = MetricsBody::parse(br#"{"metrics":[{"key":"system\/cpu_utilization_percentage","value":1,"timestamp":1,"step":1}]}"#, Endpoint::LogBatch).unwrap();
        assert_eq!(body.metrics[0].key, "system/cpu_utilization_percentage");
    }
}
