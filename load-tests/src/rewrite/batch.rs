//! The log-batch body the rewrite benchmark feeds the engine: written byte for byte the way
//! MLflow's Python client writes it (`json.dumps` separators, field order of the protobuf message,
//! int64 fields as numbers, `NaN`/`Infinity` as strings), so parsing costs what it costs in
//! production.

use std::fmt::Write as _;

use bytes::Bytes;

use crate::monitor::MonitoredRank;

/// The rank whose monitor the system keys come from.
const NODE: &str = "node-a";
const RANK: u32 = 3;
/// GPUs that rank's monitor reports.
const GPUS: u32 = 1;
/// Training metrics logged next to each monitor publish.
const TRAINING_KEYS: [&str; 3] = ["train/loss", "train/learning_rate", "train/grad_norm"];
/// First training step: 2^53 + 1, which a proxy that decodes numbers as f64 would corrupt.
const LARGE_STEP: i64 = (1 << 53) + 1;
/// A fixed start time (2025-11-28), so every run parses the same bytes.
const FIRST_TIMESTAMP: u64 = 1_764_288_000_000;
/// A run id as MLflow writes them: 32 hex digits.
const RUN_ID: &str = "5f0c3e9a7b2d4c18a1e6f3b9d0c2a874";

/// One generated body and what it holds.
#[derive(Debug, Clone)]
pub(crate) struct Batch {
    pub(crate) body: Bytes,
    pub(crate) metrics: usize,
    /// Metrics under `system/`; every one of them is in the scope table and gets a new key.
    pub(crate) system_metrics: usize,
    /// Values sent as the strings `"NaN"` or `"Infinity"`.
    pub(crate) non_finite_values: usize,
}

/// A value as protobuf's JSON mapping writes a double, through Python's `json.dumps`.
enum Value {
    Number(f64),
    Text(&'static str),
}

/// A body of `metrics` metrics: repeated blocks of one monitor publish (13 system keys, their own
/// step and timestamp, as MLflow's asynchronous logging queues them) followed by three training
/// metrics at steps beyond 2^53, cut off after `metrics`.
pub(crate) fn mlflow_log_batch(metrics: usize) -> Batch {
    let rank = MonitoredRank::new(NODE, RANK);
    let mut body = String::with_capacity(metrics * 110 + 64);
    let mut written = 0;
    let mut system_metrics = 0;
    let mut non_finite_values = 0;
    let _ = write!(body, r#"{{"run_id": "{RUN_ID}", "metrics": ["#);
    let mut block: u64 = 0;
    while written < metrics {
        let timestamp = FIRST_TIMESTAMP + block * 10_000;
        for (key, value) in rank.publish(block, GPUS) {
            if written == metrics {
                break;
            }
            write_metric(
                &mut body,
                written,
                &key,
                Value::Number(value),
                timestamp,
                block as i64,
            );
            written += 1;
            system_metrics += 1;
        }
        for (i, key) in TRAINING_KEYS.iter().enumerate() {
            if written == metrics {
                break;
            }
            // A diverging step now and then: the loss turns NaN, the gradient norm infinite.
            let value = match (i, block % 5) {
                (0, 4) => Value::Text("NaN"),
                (2, 2) => Value::Text("Infinity"),
                _ => Value::Number(1.0 / (1.0 + block as f64 + i as f64)),
            };
            if matches!(value, Value::Text(_)) {
                non_finite_values += 1;
            }
            write_metric(
                &mut body,
                written,
                key,
                value,
                timestamp + 7,
                LARGE_STEP + block as i64,
            );
            written += 1;
        }
        block += 1;
    }
    body.push_str("]}");
    Batch {
        body: Bytes::from(body),
        metrics,
        system_metrics,
        non_finite_values,
    }
}

/// Appends metric number `index` (0 is the first) to the `metrics` array being written.
fn write_metric(
    body: &mut String,
    index: usize,
    key: &str,
    value: Value,
    timestamp: u64,
    step: i64,
) {
    if index > 0 {
        body.push_str(", ");
    }
    let value = match value {
        Value::Number(v) => python_float(v),
        Value::Text(text) => format!("\"{text}\""),
    };
    let _ = write!(
        body,
        r#"{{"key": "{key}", "value": {value}, "timestamp": {timestamp}, "step": {step}}}"#
    );
}

/// `repr(float)` for the values the generator makes: always a decimal point.
fn python_float(value: f64) -> String {
    if value.fract() == 0.0 && value.abs() < 1e16 {
        format!("{value:.1}")
    } else {
        format!("{value}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_holds_exactly_the_requested_metrics_and_parses() {
        for metrics in [1, 13, 16, 1000] {
            let batch = mlflow_log_batch(metrics);
            let value: serde_json::Value = serde_json::from_slice(&batch.body).expect("valid JSON");
            assert_eq!(value["metrics"].as_array().map(Vec::len), Some(metrics));
            assert_eq!(batch.metrics, metrics);
        }
    }

    #[test]
    fn a_full_body_mixes_system_keys_training_metrics_and_non_finite_values() {
        let batch = mlflow_log_batch(1000);
        let text = std::str::from_utf8(&batch.body).expect("UTF-8");
        assert!(text.starts_with(r#"{"run_id": "5f0c3e9a7b2d4c18a1e6f3b9d0c2a874", "metrics": [{"key": "system/node-a/rank-3/cpu_utilization_percentage", "value": "#));
        assert!(text.contains(r#""value": "NaN""#));
        assert!(text.contains(r#""step": 9007199254740993}"#));
        // 13 system keys and 3 training metrics per block of 16.
        assert_eq!(batch.system_metrics, 13 * 62 + 8);
        assert!(batch.non_finite_values > 0);
        assert!(batch.body.len() > 100_000, "{}", batch.body.len());
    }

    #[test]
    fn floats_are_written_like_python_writes_them() {
        assert_eq!(python_float(40.0), "40.0");
        assert_eq!(python_float(35.1), "35.1");
    }
}
