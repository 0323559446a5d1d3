//! Verification: the ledger of acknowledged samples, how each target stores a key, and the
//! count back from MLflow of stored, missing and duplicated samples.

use super::*;

/// Where acknowledged samples must end up: per run, per stored key, the `(step, timestamp)` of
/// each sample; node-wide series under deduplication are compared by step only (one rank of the
/// node reports each step, whichever it is).
#[derive(Default)]
pub(super) struct Ledger {
    pub(super) runs: Vec<HashMap<String, Expected>>,
    pub(super) sent: u64,
    pub(super) acknowledged: u64,
    /// Artifact paths (under the artifact API) of acknowledged checkpoint uploads.
    pub(super) objects: Vec<String>,
}

#[derive(Default)]
pub(super) struct Expected {
    pub(super) by_step_only: bool,
    pub(super) samples: BTreeSet<(i64, i64)>,
}

/// How a target stores what it is sent: MLflow's keys as sent, or the scope contract's.
#[derive(Clone)]
pub(super) struct KeyMapping {
    pub(super) scoped: bool,
    pub(super) deduplicated: bool,
    pub(super) pattern: Arc<OwnerPattern>,
}

impl KeyMapping {
    pub(super) fn of(kind: TargetKind) -> KeyMapping {
        let scoped = !matches!(
            kind,
            TargetKind::Direct | TargetKind::Nginx | TargetKind::ProxyScopingOff
        );
        let deduplicated = matches!(kind, TargetKind::Proxy | TargetKind::ProxyReplicas);
        KeyMapping {
            scoped,
            deduplicated,
            pattern: Arc::new(OwnerPattern::default()),
        }
    }

    /// The key MLflow stores `key` under, and whether it is a deduplicated node-wide series.
    pub(super) fn stored(&self, key: &str) -> (String, bool) {
        let node_wide = self.deduplicated && SeriesKind::of_key(key) == SeriesKind::NodeWide;
        if !self.scoped {
            return (key.to_owned(), false);
        }
        let scoped = scoped_key(
            key,
            &Identity {
                node: None,
                rank: None,
            },
            &self.pattern,
        );
        match scoped.outcome {
            KeyOutcome::Rewritten { key, .. } => (key, node_wide),
            _ => (key.to_owned(), node_wide),
        }
    }
}

/// Reads every expected series back from MLflow (directly) and counts stored, missing and
/// duplicated samples.
pub(super) async fn count(
    client: &reqwest::Client,
    direct: &Target,
    run_ids: &[String],
    ledger: Ledger,
    checkpoint_bytes: u64,
) -> anyhow::Result<Counts> {
    let mut counts = Counts {
        sent: ledger.sent,
        acknowledged: ledger.acknowledged,
        objects_acknowledged: ledger.objects.len() as u64,
        ..Counts::default()
    };
    // Every acknowledged checkpoint, read back from MLflow itself, whole.
    for path in &ledger.objects {
        let url = format!("{}{path}", direct.base_url);
        let read = client
            .get(&url)
            .timeout(Duration::from_secs(120))
            .send()
            .await;
        if let Ok(response) = read {
            if response.status().is_success() {
                let length = response.bytes().await.map_or(0, |b| b.len() as u64);
                if length == checkpoint_bytes {
                    counts.objects_stored += 1;
                }
            }
        }
    }
    let slots = Arc::new(Semaphore::new(VERIFY_CONCURRENCY));
    let mut reads = JoinSet::new();
    for (run_id, expected) in run_ids.iter().zip(ledger.runs) {
        for (key, expected) in expected {
            let client = client.clone();
            let base = direct.base_url.clone();
            let run_id = run_id.clone();
            let slots = slots.clone();
            reads.spawn(async move {
                let _slot = slots.acquire_owned().await;
                // MLflow may still be working through requests whose clients gave up: a read
                // that times out is tried again, with pauses, before the count fails.
                let mut stored = history(&client, &base, &run_id, &key).await;
                for pause in [5, 10, 20, 40] {
                    if stored.is_ok() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_secs(pause)).await;
                    stored = history(&client, &base, &run_id, &key).await;
                }
                (key, expected, stored)
            });
        }
    }
    while let Some(read) = reads.join_next().await {
        let (key, expected, stored) = read.context("a history read panicked")?;
        let stored = stored.with_context(|| format!("reading the history of {key}"))?;
        counts.stored += stored.len() as u64;
        if expected.by_step_only {
            let steps: BTreeSet<i64> = stored.iter().map(|(step, _)| *step).collect();
            counts.duplicated += (stored.len() - steps.len()) as u64;
            let wanted: BTreeSet<i64> = expected.samples.iter().map(|(step, _)| *step).collect();
            counts.missing += wanted.difference(&steps).count() as u64;
        } else {
            let unique: BTreeSet<(i64, i64)> = stored.iter().copied().collect();
            counts.duplicated += (stored.len() - unique.len()) as u64;
            counts.missing += expected.samples.difference(&unique).count() as u64;
        }
    }
    Ok(counts)
}

/// `(step, timestamp)` of every stored point of a series.
pub(super) async fn history(
    client: &reqwest::Client,
    base: &str,
    run_id: &str,
    key: &str,
) -> anyhow::Result<Vec<(i64, i64)>> {
    let mut points = Vec::new();
    let mut token: Option<String> = None;
    for _ in 0..MAX_HISTORY_PAGES {
        let mut query = vec![
            ("run_id", run_id),
            ("metric_key", key),
            ("max_results", "25000"),
        ];
        if let Some(token) = &token {
            query.push(("page_token", token.as_str()));
        }
        let page = mlflow::get_json(
            client,
            &format!("{base}/api/2.0/mlflow/metrics/get-history"),
            &query,
        )
        .await?;
        if let Some(metrics) = page.get("metrics").and_then(Value::as_array) {
            points.extend(metrics.iter().map(|m| {
                (
                    m.get("step").and_then(Value::as_i64).unwrap_or(0),
                    m.get("timestamp").and_then(Value::as_i64).unwrap_or(0),
                )
            }));
        }
        match page.get("next_page_token").and_then(Value::as_str) {
            Some(next) if !next.is_empty() => token = Some(next.to_owned()),
            _ => break,
        }
    }
    Ok(points)
}
