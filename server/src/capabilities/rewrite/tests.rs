use super::*;
use crate::capabilities::dedup::ManualClock;
use crate::plumbing::store::Store;
use http_body_util::BodyExt;
use proptest::prelude::*;
use serde_json::{json, Value};

fn request(path: &str, headers: &[(&str, &str)], body: &str) -> Request {
    let mut builder = http::Request::post(path).header("content-type", "application/json");
    for (k, v) in headers {
        builder = builder.header(*k, *v);
    }
    builder.body(Body::from(body.to_owned())).unwrap()
}

async fn body_json(request: Request) -> (String, Value) {
    let path = request.uri().path().to_owned();
    let bytes = request.into_body().collect().await.unwrap().to_bytes();
    (path, serde_json::from_slice(&bytes).unwrap())
}

fn rewriter_without_dedup() -> MetricsRewriter {
    MetricsRewriter::new(
        ScopeConfig {
            dedup: false,
            ..Default::default()
        },
        None,
        Metrics::new(),
    )
}

async fn rewriter_with_dedup(dir: &tempfile::TempDir) -> MetricsRewriter {
    let store = Store::open(&format!("sqlite://{}/s.db", dir.path().display()))
        .await
        .unwrap();
    let dedup = Deduplicator::new(
        store,
        Arc::new(ManualClock::new(1_800_000_000_000)),
        DedupConfig::default(),
    );
    MetricsRewriter::new(ScopeConfig::default(), Some(dedup), Metrics::new())
}

#[tokio::test]
async fn a_standby_ranks_node_samples_are_dropped_and_everything_else_forwarded() {
    let dir = tempfile::tempdir().unwrap();
    let rewriter = rewriter_with_dedup(&dir).await;
    let batch = |rank: u32| {
        json!({"run_id": "r", "metrics": [
                {"key": format!("system/n1/rank-{rank}/cpu_utilization_percentage"), "value": 50.0, "timestamp": 1, "step": 0},
                {"key": format!("system/n1/rank-{rank}/network_receive_megabytes"), "value": 1.0, "timestamp": 1, "step": 0},
                {"key": "loss", "value": 0.5, "timestamp": 1, "step": 0}],
             "params": [{"key": "lr", "value": "0.1"}]})
            .to_string()
    };
    let (_, reporter) = body_json(
        rewriter
            .prepare(
                request("/api/2.0/mlflow/runs/log-batch", &[], &batch(0)),
                Endpoint::LogBatch,
            )
            .await
            .unwrap(),
    )
    .await;
    let keys: Vec<_> = reporter["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["key"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        keys,
        [
            "system/n1/node_cpu_utilization_percentage",
            "system/rank-0/network_receive_megabytes",
            "loss"
        ]
    );

    let (_, standby) = body_json(
        rewriter
            .prepare(
                request("/api/2.0/mlflow/runs/log-batch", &[], &batch(1)),
                Endpoint::LogBatch,
            )
            .await
            .unwrap(),
    )
    .await;
    let keys: Vec<_> = standby["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["key"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(keys, ["system/rank-1/network_receive_megabytes", "loss"]);
    assert_eq!(standby["params"], json!([{"key": "lr", "value": "0.1"}]));

    let identities = rewriter.stats.identities("r");
    assert_eq!(
        identities
            .iter()
            .map(|i| (i.rank, i.node_samples_kept, i.node_samples_dropped))
            .collect::<Vec<_>>(),
        [(Some(0), 1, 0), (Some(1), 0, 1)]
    );
}

#[tokio::test]
async fn a_log_metric_from_a_standby_rank_becomes_an_empty_batch() {
    let dir = tempfile::tempdir().unwrap();
    let rewriter = rewriter_with_dedup(&dir).await;
    let headers = |rank: &'static str| [("x-mlscope-node", "n1"), ("x-mlscope-rank", rank)];
    let body = r#"{"run_id":"r","run_uuid":"r","key":"system/disk_usage_percentage","value":3,"timestamp":1,"step":4}"#;
    let (path, first) = body_json(
        rewriter
            .prepare(
                request("/ajax-api/2.0/mlflow/runs/log-metric", &headers("0"), body),
                Endpoint::LogMetric,
            )
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(path, "/ajax-api/2.0/mlflow/runs/log-metric");
    assert_eq!(first["key"], "system/n1/rootfs_usage_percentage");
    let (path, second) = body_json(
        rewriter
            .prepare(
                request("/ajax-api/2.0/mlflow/runs/log-metric", &headers("1"), body),
                Endpoint::LogMetric,
            )
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(path, "/ajax-api/2.0/mlflow/runs/log-batch");
    assert_eq!(second, json!({"run_id": "r", "metrics": []}));
}

#[tokio::test]
async fn conflicts_and_oversized_bodies_are_answered_by_the_proxy() {
    let rewriter = rewriter_without_dedup();
    let conflict = rewriter
        .prepare(
            request(
                "/api/2.0/mlflow/runs/log-metric",
                &[],
                r#"{"run_id":"a","run_uuid":"b","key":"k","value":1,"timestamp":1}"#,
            ),
            Endpoint::LogMetric,
        )
        .await
        .unwrap_err();
    assert_eq!(conflict.status(), 400);
    let small = MetricsRewriter::new(
        ScopeConfig {
            dedup: false,
            max_inspect_bytes: 1024,
            ..Default::default()
        },
        None,
        Metrics::new(),
    );
    let big = format!(
        r#"{{"run_id":"a","metrics":[],"pad":"{}"}}"#,
        "x".repeat(2000)
    );
    assert_eq!(
        small
            .prepare(
                request("/api/2.0/mlflow/runs/log-batch", &[], &big),
                Endpoint::LogBatch
            )
            .await
            .unwrap_err()
            .status(),
        413
    );
    // Malformed JSON goes to MLflow untouched, for MLflow's own error.
    let passed = rewriter
        .prepare(
            request("/api/2.0/mlflow/runs/log-batch", &[], "{oops"),
            Endpoint::LogBatch,
        )
        .await
        .unwrap();
    assert_eq!(
        &passed.into_body().collect().await.unwrap().to_bytes()[..],
        b"{oops"
    );
}

#[tokio::test]
async fn during_the_migration_period_the_original_key_is_written_too() {
    let body = r#"{"run_id":"r","metrics":[{"key":"system/cpu_utilization_percentage","value":1,"timestamp":1,"step":0}]}"#;
    let keys = |config: ScopeConfig| async move {
        let rewriter = MetricsRewriter::new(config, None, Metrics::new());
        let (_, json) = body_json(
            rewriter
                .prepare(
                    request(
                        "/api/2.0/mlflow/runs/log-batch",
                        &[("x-mlscope-node", "n")],
                        body,
                    ),
                    Endpoint::LogBatch,
                )
                .await
                .unwrap(),
        )
        .await;
        json["metrics"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["key"].as_str().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    let hour = std::time::Duration::from_secs(3600);
    let during = ScopeConfig {
        dedup: false,
        keep_original_until: Some(SystemTime::now() + hour),
        ..Default::default()
    };
    assert_eq!(
        keys(during).await,
        [
            "system/n/node_cpu_utilization_percentage",
            "system/cpu_utilization_percentage"
        ]
    );
    let after = ScopeConfig {
        dedup: false,
        keep_original_until: Some(SystemTime::now() - hour),
        ..Default::default()
    };
    assert_eq!(
        keys(after).await,
        ["system/n/node_cpu_utilization_percentage"]
    );
    let off = ScopeConfig {
        dedup: false,
        rewrite: false,
        ..Default::default()
    };
    assert_eq!(keys(off).await, ["system/cpu_utilization_percentage"]);
}

fn metric_strategy() -> impl Strategy<Value = Value> {
    let key = prop_oneof![
        Just("system/cpu_utilization_percentage".to_owned()),
        Just("system/rank-2/system_memory_usage_megabytes".to_owned()),
        Just("system/node-a/rank-7/disk_available_megabytes".to_owned()),
        "system/gpu_[0-7]_utilization_percentage",
        "system/rank_[0-9]/network_transmit_megabytes",
        "[a-z]{1,8}(/[a-z]{1,8})?",
        "system/[a-z_]{1,12}",
    ];
    let value = prop_oneof![
        any::<f64>()
            .prop_filter("finite", |v| v.is_finite())
            .prop_map(|v| json!(v)),
        Just(json!("NaN")),
        Just(json!("Infinity")),
        Just(json!("-Infinity")),
    ];
    (key, value, any::<i64>(), any::<i64>(), any::<bool>()).prop_map(
        |(key, value, timestamp, step, extra)| {
            let mut m = json!({"key": key, "value": value, "timestamp": timestamp, "step": step});
            if extra {
                m["dataset_digest"] = json!({"nested": [1, "two", null]});
            }
            m
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn only_mapped_system_keys_change_in_a_rewritten_batch(
        metrics in proptest::collection::vec(metric_strategy(), 0..40),
        params in proptest::collection::vec(("[a-z]{1,5}", "[ -~]{0,10}"), 0..5),
        rank_header in proptest::option::of(0u32..16),
    ) {
        let body = json!({
            "run_id": "run-1",
            "metrics": metrics,
            "params": params.iter().map(|(k, v)| json!({"key": k, "value": v})).collect::<Vec<_>>(),
            "tags": [{"key": "t", "value": "v"}],
            "future_field": {"x": 9007199254740993u64},
        }).to_string();
        let rewriter = rewriter_without_dedup();
        let rank = rank_header.map(|r| r.to_string());
        let headers: Vec<(&str, &str)> = rank.iter().map(|r| ("x-mlscope-rank", r.as_str())).collect();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let out = runtime.block_on(async {
            let req = rewriter.prepare(request("/api/2.0/mlflow/runs/log-batch", &headers, &body), Endpoint::LogBatch).await.unwrap();
            req.into_body().collect().await.unwrap().to_bytes()
        });
        let before: Value = serde_json::from_str(&body).unwrap();
        let mut after: Value = serde_json::from_slice(&out).unwrap();
        let identity = identity_from_headers(&{
            let mut h = http::HeaderMap::new();
            for (k, v) in &headers { h.insert(*k, v.parse().unwrap()); }
            h
        });
        // Map the original keys the way the contract says, then the bodies must be equal.
        let mut expected = before.clone();
        for m in expected["metrics"].as_array_mut().unwrap() {
            let key = m["key"].as_str().unwrap().to_owned();
            if let KeyOutcome::Rewritten { key: new, .. } = scoped_key(&key, &identity, &OwnerPattern::default()).outcome {
                m["key"] = json!(new);
            }
        }
        prop_assert_eq!(&expected, &after);
        // int64 beyond 2^53 survives as written.
        prop_assert!(std::str::from_utf8(&out).unwrap().contains("9007199254740993"));
        after["metrics"] = before["metrics"].clone();
        prop_assert_eq!(after, before);
    }
}

/// A metric of the run's own (no key under `system/`), its step and timestamp as clients write
/// them: numbers, numeric strings, or missing.
fn own_metric_strategy() -> impl Strategy<Value = Value> {
    let int = || {
        prop_oneof![
            (-5i64..100).prop_map(|v| Some(json!(v))),
            (-5i64..100).prop_map(|v| Some(json!(v.to_string()))),
            Just(None),
        ]
    };
    ("[a-z]{1,6}(/[a-z]{1,6})?|systems/x|sys", int(), int()).prop_map(|(key, step, timestamp)| {
        let mut m = json!({"key": key, "value": 1.5});
        if let Some(step) = step {
            m["step"] = step;
        }
        if let Some(timestamp) = timestamp {
            m["timestamp"] = timestamp;
        }
        m
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    /// A body of the run's own metrics skips the contract's per-key work; what it says of the
    /// run (its highest step, at that sample's time) is what the general reading says.
    #[test]
    fn a_body_without_system_keys_beats_as_the_general_reading_does(
        metrics in proptest::collection::vec(own_metric_strategy(), 0..30),
        run_id in prop_oneof![Just("0123456789abcdef0123456789abcdef"), Just("not a run id!")],
    ) {
        let text = json!({"run_id": run_id, "metrics": metrics}).to_string();
        let body = MetricsBody::parse(text.as_bytes(), Endpoint::LogBatch).unwrap();
        let identity = Identity::default();
        let plans: Vec<KeyPlan> = body
            .metrics
            .iter()
            .map(|m| KeyPlan::new(scoped_key(&m.key, &identity, &OwnerPattern::default()), false))
            .collect();
        let metric_plans: Vec<usize> = (0..plans.len()).collect();
        let general = beat_of(&body, &plans, &metric_plans);
        prop_assert_eq!(own_steps(&body), general.clone());
        prop_assert_eq!(general.is_some(), run_id != "not a run id!");
    }
}

/// Two replicas sharing one store and one clock, failing over after 4 s of silence.
async fn two_replicas(dir: &tempfile::TempDir) -> (MetricsRewriter, MetricsRewriter, ManualClock) {
    let url = format!("sqlite://{}/s.db", dir.path().display());
    let clock = ManualClock::new(1_800_000_000_000);
    let config = DedupConfig {
        update_interval: Duration::from_secs(1),
        failover_timeout: Duration::from_secs(4),
    };
    let mut replicas = Vec::new();
    for _ in 0..2 {
        let dedup = Deduplicator::new(
            Store::open(&url).await.unwrap(),
            Arc::new(clock.clone()),
            config,
        );
        replicas.push(MetricsRewriter::new(
            ScopeConfig::default(),
            Some(dedup),
            Metrics::new(),
        ));
    }
    let b = replicas.pop().unwrap();
    (replicas.pop().unwrap(), b, clock)
}

/// The node samples `rank` sends in one batch, as (step, timestamp) pairs; what goes on to MLflow
/// as (step, timestamp) pairs of the node series.
async fn send_node_samples(
    via: &MetricsRewriter,
    rank: u32,
    samples: &[(i64, i64)],
) -> Vec<(i64, i64)> {
    let metrics: Vec<Value> = samples
        .iter()
        .map(|(step, at)| {
            json!({"key": format!("system/n1/rank-{rank}/cpu_utilization_percentage"),
                   "value": 50.0, "timestamp": at, "step": step})
        })
        .collect();
    let body = json!({"run_id": "r", "metrics": metrics}).to_string();
    let (_, sent) = body_json(
        via.prepare(
            request("/api/2.0/mlflow/runs/log-batch", &[], &body),
            Endpoint::LogBatch,
        )
        .await
        .unwrap(),
    )
    .await;
    sent["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            assert_eq!(m["key"], "system/n1/node_cpu_utilization_percentage");
            (
                m["step"].as_i64().unwrap(),
                m["timestamp"].as_i64().unwrap(),
            )
        })
        .collect()
}

#[tokio::test]
async fn a_reporter_that_pauses_past_the_failover_never_interleaves_with_its_successor() {
    // The handover seen once under load: rank 0 reported steps 0, 1, 2; it stalled; rank 1,
    // standing by on the same node, took over with a batch that held samples it had measured
    // while rank 0 still reported. Kept with their shifted steps, they gave the node series the
    // steps 0, 3, 1, 4, 2, 5 in time order.
    let dir = tempfile::tempdir().unwrap();
    let (a, b, clock) = two_replicas(&dir).await;
    let t0 = 1_800_000_000_000;
    let mut series = Vec::new();
    for (step, at) in [(0, t0), (1, t0 + 2_000), (2, t0 + 4_000)] {
        series.extend(send_node_samples(&a, 0, &[(step, at)]).await);
        // Rank 1 stands by meanwhile, through the other replica.
        let standby = send_node_samples(&b, 1, &[(step + 10, at + 1_000)]).await;
        assert_eq!(standby, [], "rank 1 stands by while rank 0 reports");
        clock.advance(Duration::from_secs(2));
    }
    // Rank 0 stalls past the failover timeout; rank 1's next batch holds what it measured since.
    clock.advance(Duration::from_secs(5));
    series.extend(
        send_node_samples(
            &b,
            1,
            &[(13, t0 + 3_500), (14, t0 + 4_500), (15, t0 + 9_000)],
        )
        .await,
    );
    // Rank 0 comes back through the other replica: the seat is rank 1's now.
    clock.advance(Duration::from_secs(1));
    let late = send_node_samples(&a, 0, &[(3, t0 + 6_000), (4, t0 + 10_000)]).await;
    assert_eq!(late, [], "the deposed reporter's samples are dropped");
    series.extend(send_node_samples(&a, 1, &[(16, t0 + 11_000)]).await);

    series.sort_by_key(|&(_, at)| at);
    let steps: Vec<i64> = series.iter().map(|&(step, _)| step).collect();
    assert!(
        steps.windows(2).all(|w| w[0] < w[1]),
        "the node series' steps in time order: {series:?}"
    );
    // Rank 1's samples from before rank 0's last one (t0 + 4 s) are not stored; its later ones
    // are, continuing after step 2.
    assert_eq!(
        series.iter().map(|&(_, at)| at - t0).collect::<Vec<_>>(),
        [0, 2_000, 4_000, 4_500, 9_000, 11_000]
    );
    assert!(steps[3] > 2, "{steps:?}");
    let identities = b.stats.identities("r");
    let rank1 = identities.iter().find(|i| i.rank == Some(1)).unwrap();
    assert_eq!(
        (rank1.node_samples_kept, rank1.node_samples_dropped),
        (2, 4),
        "rank 1 through replica b: three standby samples and one covered one dropped"
    );
}
