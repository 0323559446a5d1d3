//! Write coalescing against real MLflow: what merged batches store is what the requests store
//! one by one, a refused request fails only its sender (with MLflow's own answer), and a client
//! that goes away takes nothing of the others with it.

use std::collections::BTreeMap;

use futures_util::future::join_all;
use mlscope_tests::{eventually, spawn_proxy, ProxyProcess, TestStack};
use serde_json::{json, Value};

use crate::mlflow::{create_run, http, response_json, scrape};
use crate::relay::{Relay, Rules};

/// Every point of every series of a run: key -> sorted `(step, timestamp, value)`.
pub(crate) async fn histories(
    mlflow: &str,
    run_id: &str,
) -> BTreeMap<String, Vec<(i64, i64, String)>> {
    let run = response_json(
        http()
            .get(format!("{mlflow}/api/2.0/mlflow/runs/get"))
            .query(&[("run_id", run_id)]),
    )
    .await;
    let keys: Vec<String> = run["run"]["data"]["metrics"]
        .as_array()
        .map(|m| {
            m.iter()
                .map(|m| m["key"].as_str().unwrap().to_owned())
                .collect()
        })
        .unwrap_or_default();
    let mut out = BTreeMap::new();
    for key in keys {
        let page = response_json(
            http()
                .get(format!("{mlflow}/api/2.0/mlflow/metrics/get-history"))
                .query(&[
                    ("run_id", run_id),
                    ("metric_key", &key),
                    ("max_results", "25000"),
                ]),
        )
        .await;
        let mut points: Vec<(i64, i64, String)> = page["metrics"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                (
                    p["step"].as_i64().unwrap_or(0),
                    p["timestamp"].as_i64().unwrap(),
                    p["value"].to_string(),
                )
            })
            .collect();
        points.sort();
        out.insert(key, points);
    }
    out
}

/// What client `c` sends in its request `r`: a log-batch of training and system metrics, or (every
/// third request) a single log-metric.
fn request_of(run_id: &str, c: i64, r: i64) -> (&'static str, Value) {
    let ts = 1_700_000_000_000 + c * 1000 + r;
    if r % 3 == 2 {
        let body = json!({"run_id": run_id, "key": format!("rank{c}/lr"), "value": 0.001 * (r as f64), "timestamp": ts, "step": r});
        return ("runs/log-metric", body);
    }
    let metrics = vec![
        json!({"key": "loss", "value": 1.0 / ((c * 100 + r + 1) as f64), "timestamp": ts, "step": r}),
        json!({"key": format!("rank{c}/accuracy"), "value": 0.5, "timestamp": ts, "step": r}),
        json!({"key": format!("system/node-{}/rank-{c}/gpu_0_utilization_percentage", c % 2), "value": 42, "timestamp": ts, "step": r}),
    ];
    (
        "runs/log-batch",
        json!({"run_id": run_id, "metrics": metrics}),
    )
}

/// 8 clients, 9 requests each, all at once per round (MLflow's SQLAlchemy pool on SQLite times
/// out past about 15 concurrent writers, with or without the proxy).
async fn send_fleet(proxy: &str, run_id: &str) {
    for r in 0..9 {
        let sends = (0..8).map(|c| {
            let (path, body) = request_of(run_id, c, r);
            async move {
                let response = http()
                    .post(format!("{proxy}/api/2.0/mlflow/{path}"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                let status = response.status();
                let text = response.text().await.unwrap();
                assert_eq!(
                    (status.as_u16(), text.as_str()),
                    (200, "{}"),
                    "client {c} request {r}"
                );
            }
        });
        join_all(sends).await;
    }
}

pub(crate) fn coalescing_proxy(stack: &TestStack, window: &str) -> ProxyProcess {
    spawn_proxy(
        &stack.mlflow.url,
        &[
            "--coalesce-window",
            window,
            "--coalesce-in-flight-per-run",
            "1",
        ],
        stack.dir.path(),
    )
    .expect("starting a coalescing proxy")
}

/// A full batch (1000 metrics), which an idle run sends at once and MLflow takes a few hundred
/// milliseconds to store: the requests sent just after it gather behind it into one batch.
async fn open_with_a_full_batch(proxy: &str, run_id: &str) -> (u16, String) {
    let metrics: Vec<Value> = (0..1000)
        .map(|i| json!({"key": format!("opener/{}", i % 50), "value": i, "timestamp": 1 + i, "step": i}))
        .collect();
    let response = http()
        .post(format!("{proxy}/api/2.0/mlflow/runs/log-batch"))
        .json(&json!({"run_id": run_id, "metrics": metrics}))
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

/// Waits until the opener is at MLflow: the proxy's coalescer holds a queue for its run (the
/// proxy's only run).
pub(crate) async fn after_the_opener(proxy: &ProxyProcess) {
    until_the_coalescer_holds(proxy, "mlscope_coalesce_runs ", 1.0, "the opener's run").await;
}

/// Waits until `n` requests wait in the proxy's coalescer queues.
async fn until_queued(proxy: &ProxyProcess, n: f64, what: &str) {
    until_the_coalescer_holds(proxy, "mlscope_coalesce_queued_requests ", n, what).await;
}

/// Waits until the coalescer gauge `series` of the proxy's `/metrics` is at least `n`.
async fn until_the_coalescer_holds(proxy: &ProxyProcess, series: &str, n: f64, what: &str) {
    eventually(
        std::time::Duration::from_secs(30),
        format_args!("the coalescer holds {what} ({series}>= {n})"),
        async || match counter(&scrape(&proxy.admin_url).await, series) {
            held if held >= n => Ok(()),
            held => Err(format!("{series}{held}")),
        },
    )
    .await;
}

/// A coalescing proxy (`window`, one batch of a run at MLflow at a time, `extra` arguments)
/// whose way to MLflow passes a relay that holds the opener ([`open_with_a_full_batch`]) until
/// [`Relay::release`]: what is sent behind it queues however fast or slow the machine is.
async fn behind_a_held_opener(
    stack: &TestStack,
    window: &str,
    extra: &[&str],
) -> (Relay, ProxyProcess) {
    let relay = Relay::start(
        &stack.mlflow.url,
        Rules::holding(|_, path, body| {
            path.ends_with("/runs/log-batch") && body.windows(8).any(|w| w == b"\"opener/")
        }),
    )
    .await;
    let mut args = vec![
        "--coalesce-window",
        window,
        "--coalesce-in-flight-per-run",
        "1",
    ];
    args.extend_from_slice(extra);
    let proxy =
        spawn_proxy(&relay.url, &args, stack.dir.path()).expect("starting a coalescing proxy");
    (relay, proxy)
}

/// Sends `request` (a log-batch) on a task of its own: its status and body, once answered.
fn spawn_send(request: reqwest::RequestBuilder) -> tokio::task::JoinHandle<(u16, String)> {
    tokio::spawn(async move {
        let response = request.send().await.unwrap();
        (response.status().as_u16(), response.text().await.unwrap())
    })
}

/// The answers of requests sent with [`spawn_send`], in their order.
async fn answers_of(sent: Vec<tokio::task::JoinHandle<(u16, String)>>) -> Vec<(u16, String)> {
    join_all(sent)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect()
}

pub(crate) fn counter(metrics: &str, line_start: &str) -> f64 {
    metrics
        .lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn merged_and_unmerged_writes_store_identical_histories() {
    let stack = TestStack::shared();
    let merging = coalescing_proxy(stack, "50ms");
    let single = coalescing_proxy(stack, "0s");
    let merged_run = create_run(&stack.mlflow.url, "coalesce-merged").await;
    let single_run = create_run(&stack.mlflow.url, "coalesce-single").await;
    send_fleet(&merging.url, &merged_run).await;
    send_fleet(&single.url, &single_run).await;

    let merged = histories(&stack.mlflow.url, &merged_run).await;
    let alone = histories(&stack.mlflow.url, &single_run).await;
    assert_eq!(merged.len(), 8 * 3 + 1, "{:?}", merged.keys());
    assert_eq!(merged, alone);
    // Every sample once: 8 clients x 6 batches x 3 metrics + 8 x 3 log-metrics.
    let samples: usize = merged.values().map(Vec::len).sum();
    assert_eq!(samples, 8 * 6 * 3 + 8 * 3);

    // It did merge: batches of several requests went out, none had to be split.
    let metrics = scrape(&merging.admin_url).await;
    assert!(
        counter(
            &metrics,
            "mlscope_coalesce_batches_total{outcome=\"merged\"}"
        ) >= 1.0,
        "{metrics}"
    );
    assert_eq!(
        counter(
            &metrics,
            "mlscope_coalesce_batches_total{outcome=\"split\"}"
        ),
        0.0
    );
    let off = scrape(&single.admin_url).await;
    assert!(!off.contains("outcome=\"merged\""), "{off}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_invalid_metric_fails_only_its_sender_with_mlflows_own_answer() {
    let stack = TestStack::shared();
    let (relay, proxy) = behind_a_held_opener(stack, "20ms", &[]).await;
    let run_id = create_run(&stack.mlflow.url, "coalesce-invalid").await;
    // Parsed by MLflow as written, so it may join a batch, and refused by its validation.
    let bad = json!({"run_id": run_id, "metrics": [
        {"key": "loss", "value": 1.0, "timestamp": 5, "step": 1},
        {"key": "loss!", "value": 2.0, "timestamp": 5, "step": 2},
    ]});
    let direct = http()
        .post(format!(
            "{}/api/2.0/mlflow/runs/log-batch",
            stack.mlflow.url
        ))
        .json(&bad)
        .send()
        .await
        .unwrap();
    let direct = (direct.status().as_u16(), direct.text().await.unwrap());
    assert_eq!(direct.0, 400, "{}", direct.1);

    let (proxy, relay) = (&proxy, &relay);
    let url = format!("{}/api/2.0/mlflow/runs/log-batch", proxy.url);
    let send = |body: Value| spawn_send(http().post(&url).json(&body));
    // Eight good requests and the bad one queue behind the held opener, so that they leave in
    // one batch once it is answered.
    let (opened, (answers, bad_answer)) = tokio::join!(
        open_with_a_full_batch(&proxy.url, &run_id),
        async {
            relay.until_held(1).await;
            let good: Vec<_> = (0..8)
                .map(|c| send(json!({"run_id": run_id, "metrics": [{"key": format!("client{c}"), "value": c, "timestamp": 10 + c, "step": 0}]})))
                .collect();
            let bad = send(bad.clone());
            until_queued(proxy, 9.0, "the nine requests in its queue").await;
            relay.release();
            (answers_of(good).await, bad.await.unwrap())
        }
    );
    assert_eq!(opened, (200, "{}".to_owned()));
    for (c, answer) in answers.iter().enumerate() {
        assert_eq!(answer, &(200, "{}".to_owned()), "client {c}");
    }
    assert_eq!(bad_answer, direct);
    let stored = histories(&stack.mlflow.url, &run_id).await;
    for c in 0..8 {
        assert_eq!(stored[&format!("client{c}")].len(), 1, "{stored:?}");
    }
    assert!(!stored.contains_key("loss"), "{stored:?}");
    let metrics = scrape(&proxy.admin_url).await;
    assert!(
        counter(
            &metrics,
            "mlscope_coalesce_batches_total{outcome=\"split\"}"
        ) >= 1.0,
        "the invalid request was never in a merged batch: {metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_goes_away_loses_nothing_of_the_others() {
    let stack = TestStack::shared();
    let (relay, proxy) = behind_a_held_opener(stack, "20ms", &[]).await;
    let run_id = create_run(&stack.mlflow.url, "coalesce-disconnect").await;
    let url = format!("{}/api/2.0/mlflow/runs/log-batch", proxy.url);
    let body = |c: i64| json!({"run_id": run_id, "metrics": [{"key": format!("client{c}"), "value": c, "timestamp": 10 + c, "step": 0}]});
    // The leaver's request gathers behind the held opener with the others, and its connection
    // closes before their batch leaves.
    let (proxy, relay) = (&proxy, &relay);
    let (opened, (left, answers)) =
        tokio::join!(open_with_a_full_batch(&proxy.url, &run_id), async {
            relay.until_held(1).await;
            let stayers: Vec<_> = (0..6)
                .map(|c| spawn_send(http().post(url.clone()).json(&body(c))))
                .collect();
            until_queued(proxy, 6.0, "the six stayers in its queue").await;
            let left = http()
                .post(url.clone())
                .json(&body(99))
                .timeout(std::time::Duration::from_millis(60))
                .send()
                .await;
            relay.release();
            (left, answers_of(stayers).await)
        });
    assert_eq!(opened, (200, "{}".to_owned()));
    assert!(
        left.is_err(),
        "the leaver was answered within 60 ms: {left:?}"
    );
    for (c, answer) in answers.iter().enumerate() {
        assert_eq!(answer, &(200, "{}".to_owned()), "client {c}");
    }
    let stored = histories(&stack.mlflow.url, &run_id).await;
    for c in 0..6 {
        assert_eq!(stored[&format!("client{c}")].len(), 1, "{stored:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_queue_answers_429_with_retry_after_and_keeps_what_it_queued() {
    let stack = TestStack::shared();
    // The opener is held until the test has seen the queue fill, so that what is queued behind
    // it is still waiting when the next request comes.
    let (relay, proxy) =
        behind_a_held_opener(stack, "20ms", &["--coalesce-max-pending-per-run", "1000"]).await;
    let run_id = create_run(&stack.mlflow.url, "coalesce-full").await;
    let batch = |name: &str| {
        let metrics: Vec<Value> = (0..600)
            .map(|i| json!({"key": format!("{name}/{}", i % 10), "value": i, "timestamp": 1 + i, "step": i}))
            .collect();
        json!({"run_id": run_id, "metrics": metrics})
    };
    let proxy = &proxy;
    let relay = &relay;
    let send = |body: Value| {
        let url = format!("{}/api/2.0/mlflow/runs/log-batch", proxy.url);
        async move { http().post(url).json(&body).send().await.unwrap() }
    };
    // Behind the opener, the first 600 metrics fit the run's queue of 1000; the next 600 do not.
    let (opened, (first, second)) =
        tokio::join!(open_with_a_full_batch(&proxy.url, &run_id), async {
            relay.until_held(1).await;
            let first = tokio::spawn(send(batch("queued")));
            until_queued(proxy, 1.0, "a request in its queue").await;
            let second = send(batch("refused")).await;
            relay.release();
            (first.await.unwrap(), second)
        });
    assert_eq!(opened, (200, "{}".to_owned()));
    assert_eq!(first.status(), 200);
    assert_eq!(second.status(), 429);
    assert_eq!(second.headers()["retry-after"], "1");
    let error: Value = second.json().await.unwrap();
    assert_eq!(error["error_code"], "REQUEST_LIMIT_EXCEEDED");
    let stored = histories(&stack.mlflow.url, &run_id).await;
    assert_eq!(stored["queued/0"].len(), 60);
    assert!(!stored.contains_key("refused/0"), "{:?}", stored.keys());
    let metrics = scrape(&proxy.admin_url).await;
    assert_eq!(
        counter(
            &metrics,
            "mlscope_coalesce_rejected_total{reason=\"pending_per_run\"}"
        ),
        1.0,
        "{metrics}"
    );
}
