//! The load: what every request task shares, and how one scheduled request is sent (with its
//! retries) and entered in the ledger once acknowledged.

use super::*;

/// What every request task shares.
pub(super) struct Shared {
    pub(super) client: reqwest::Client,
    pub(super) base: String,
    pub(super) experiment: String,
    pub(super) run_ids: Vec<String>,
    pub(super) ranks: Vec<Rank>,
    pub(super) args: RequestSettings,
    pub(super) mapping: KeyMapping,
    pub(super) ledger: Arc<Mutex<Ledger>>,
    pub(super) first_timestamp: i64,
}

pub(super) struct RequestSettings {
    /// System metrics as mlscope-collector sends them, not MLflow's monitor.
    pub(super) collector: bool,
    pub(super) gpus: u32,
    pub(super) training_metrics: u32,
    pub(super) training_per_rank: bool,
    pub(super) checkpoint_bytes: u64,
    pub(super) retries: u32,
    pub(super) request_timeout: Duration,
}

/// A request's final result (a failure described by its answer) and how many tries it took.
pub(super) struct Sent {
    pub(super) result: Result<(), String>,
    pub(super) attempts: u32,
}

impl Shared {
    pub(super) async fn send(&self, event: &Event) -> Sent {
        let rank = &self.ranks[event.rank];
        let run_id = &self.run_ids[rank.run];
        // Each publish and step has its own timestamp, as a monitor's sample time.
        let timestamp = self.first_timestamp + event.seq as i64 * 1000 + event.rank as i64;
        let (method, path, body, samples): (_, String, Vec<u8>, Vec<(String, f64)>) = match event.op
        {
            Op::System => {
                let samples = if self.args.collector {
                    rank.monitor.collector_publish(event.seq, self.args.gpus)
                } else {
                    rank.monitor.publish(event.seq, self.args.gpus)
                };
                let body = batch_body(run_id, &samples, timestamp, event.seq, &[], &[]);
                (
                    reqwest::Method::POST,
                    "/api/2.0/mlflow/runs/log-batch".into(),
                    body,
                    samples,
                )
            }
            Op::Training => {
                // From every rank, each logs its own series; from rank 0, the run's.
                let prefix = if self.args.training_per_rank {
                    format!("rank-{}/", rank.monitor.rank)
                } else {
                    String::new()
                };
                let samples: Vec<(String, f64)> = (0..self.args.training_metrics)
                    .map(|i| {
                        (
                            format!("train/{prefix}metric_{i}"),
                            1.0 / (event.seq as f64 + f64::from(i) + 1.0),
                        )
                    })
                    .collect();
                let body = batch_body(run_id, &samples, timestamp, event.seq, &[], &[]);
                (
                    reqwest::Method::POST,
                    "/api/2.0/mlflow/runs/log-batch".into(),
                    body,
                    samples,
                )
            }
            Op::Start => {
                let params: Vec<(String, String)> = (0..10)
                    .map(|i| (format!("param_{i}"), format!("value-{i}")))
                    .collect();
                let tags = vec![
                    (
                        "mlflow.source.name".to_owned(),
                        "mlscope-bench fleet".to_owned(),
                    ),
                    ("fleet.nodes".to_owned(), self.ranks.len().to_string()),
                ];
                let body = batch_body(run_id, &[], timestamp, 0, &params, &tags);
                (
                    reqwest::Method::POST,
                    "/api/2.0/mlflow/runs/log-batch".into(),
                    body,
                    Vec::new(),
                )
            }
            Op::Checkpoint => {
                let path = format!(
                        "/api/2.0/mlflow-artifacts/artifacts/{}/{run_id}/artifacts/checkpoints/step-{}.bin",
                        self.experiment, event.seq
                    );
                let body = vec![0x5a; self.args.checkpoint_bytes as usize];
                (reqwest::Method::PUT, path, body, Vec::new())
            }
        };
        if !samples.is_empty() {
            self.ledger.lock().expect("ledger lock").sent += samples.len() as u64;
        }
        let body = bytes::Bytes::from(body);
        let mut attempts = 0;
        let result = loop {
            attempts += 1;
            let mut request = self
                .client
                .request(method.clone(), format!("{}{path}", self.base));
            if event.op == Op::System && self.args.collector {
                // The collector's identity headers, which the proxy deduplicates by.
                request = request
                    .header("X-Mlscope-Node", &rank.monitor.node)
                    .header("X-Mlscope-Rank", rank.monitor.rank.to_string());
            }
            let request = request
                .header(
                    reqwest::header::CONTENT_TYPE,
                    if event.op == Op::Checkpoint {
                        "application/octet-stream"
                    } else {
                        "application/json"
                    },
                )
                .body(body.clone())
                .timeout(self.args.request_timeout)
                .send()
                .await;
            let retryable = match request {
                Ok(response) if response.status().is_success() => {
                    let _ = response.bytes().await;
                    break Ok(());
                }
                Ok(response) => {
                    let status = response.status().as_u16();
                    let text = response.text().await.unwrap_or_default();
                    let shown: String = text.chars().take(120).collect();
                    let failure = format!("HTTP {status}: {shown}");
                    // The MLflow client's retry statuses.
                    if matches!(status, 429 | 500 | 502 | 503 | 504) {
                        failure
                    } else {
                        break Err(failure);
                    }
                }
                Err(e) if e.is_timeout() => "timeout".to_owned(),
                Err(e) => format!("transport: {e}"),
            };
            if attempts > self.args.retries {
                break Err(retryable);
            }
            // The MLflow client's backoff: factor 2 from 1 s, here from 0.5 s and capped at 8 s.
            let backoff = Duration::from_millis(500 * (1 << (attempts - 1).min(4)));
            tokio::time::sleep(backoff).await;
        };
        if result.is_ok() && event.op == Op::Checkpoint {
            self.ledger
                .lock()
                .expect("ledger lock")
                .objects
                .push(path.clone());
        }
        if result.is_ok() && !samples.is_empty() {
            let mut ledger = self.ledger.lock().expect("ledger lock");
            ledger.acknowledged += samples.len() as u64;
            let run = &mut ledger.runs[rank.run];
            for (key, _) in &samples {
                let (stored, by_step_only) = self.mapping.stored(key);
                let expected = run.entry(stored).or_default();
                expected.by_step_only = by_step_only;
                expected.samples.insert((event.seq as i64, timestamp));
            }
        }
        Sent { result, attempts }
    }
}

/// A `log-batch` body: every sample at `timestamp` and `step`, plus params and tags.
pub(super) fn batch_body(
    run_id: &str,
    samples: &[(String, f64)],
    timestamp: i64,
    step: u64,
    params: &[(String, String)],
    tags: &[(String, String)],
) -> Vec<u8> {
    let metrics: Vec<Value> = samples
        .iter()
        .map(|(key, value)| json!({"key": key, "value": value, "timestamp": timestamp, "step": step}))
        .collect();
    let params: Vec<Value> = params
        .iter()
        .map(|(key, value)| json!({"key": key, "value": value}))
        .collect();
    let tags: Vec<Value> = tags
        .iter()
        .map(|(key, value)| json!({"key": key, "value": value}))
        .collect();
    serde_json::to_vec(
        &json!({"run_id": run_id, "metrics": metrics, "params": params, "tags": tags}),
    )
    .expect("a JSON value serializes")
}
