//! The write path against the real MLflow, differentially: the same requests go through a
//! coalescing proxy into one run and, each alone, straight to MLflow into a twin run. Every request
//! must get the status MLflow gives it alone, and both runs must hold the same data: every
//! acknowledged sample stored exactly once, nothing invented. Malformed neighbours (elements
//! MLflow's parser stores as zeros while answering 200), refused requests, changed params, the
//! real client's shapes and concurrent clients included.

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::future::join_all;
use mlscope_tests::{legacy_venv, repo_root, PostgresDatabase, StackOptions, TestStack};

use serde_json::{json, Value};

use crate::coalesce::{after_the_opener, coalescing_proxy, counter, histories};
use crate::mlflow::{create_run, get_run, history, http, run_tags, scrape};
use crate::python_client::{finish, python};

/// A request: the path under `/api/2.0/mlflow/` and its body, with `RUN` where the run id goes.
type Write = (&'static str, Value);

fn for_run(body: &Value, run_id: &str) -> Value {
    let text = body
        .to_string()
        .replace("\"RUN\"", &format!("\"{run_id}\""));
    serde_json::from_str(&text).unwrap()
}

async fn send(base: &str, (path, body): &Write, run_id: &str) -> (u16, Value) {
    let response = http()
        .post(format!("{base}/api/2.0/mlflow/{path}"))
        .json(&for_run(body, run_id))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

/// The status and error code MLflow answers (messages name the run, which differs).
fn answer((status, body): &(u16, Value)) -> (u16, Value) {
    (*status, body["error_code"].clone())
}

/// Params and the tags a client wrote (not MLflow's own `mlflow.*`).
async fn params_and_tags(mlflow: &str, run_id: &str) -> (Value, BTreeMap<String, String>) {
    let run = get_run(mlflow, run_id).await;
    let mut params: Vec<Value> = run["run"]["data"]["params"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    params.sort_by_key(|p| p["key"].as_str().unwrap_or_default().to_owned());
    let tags = run_tags(mlflow, run_id)
        .await
        .into_iter()
        .filter(|(k, _)| !k.starts_with("mlflow."))
        .collect();
    (Value::Array(params), tags)
}

/// Both runs hold the same metrics, params and tags.
async fn assert_same_data(mlflow: &str, through: &str, direct: &str) {
    let merged = histories(mlflow, through).await;
    let alone = histories(mlflow, direct).await;
    assert_eq!(merged, alone, "metric histories differ");
    assert_eq!(
        params_and_tags(mlflow, through).await,
        params_and_tags(mlflow, direct).await,
        "params or tags differ"
    );
}

fn filler(prefix: &str) -> Write {
    let metrics: Vec<Value> = (0..1000)
        .map(|i| json!({"key": format!("{prefix}/{}", i % 50), "value": i, "timestamp": 1 + i, "step": i}))
        .collect();
    (
        "runs/log-batch",
        json!({"run_id": "RUN", "metrics": metrics}),
    )
}

/// The reported repro: two full fillers keep the run busy, then a request whose value MLflow
/// cannot parse, then three one-metric victims, all through the proxy into one run. Before the
/// fix all six were answered 200 and none of the victims was stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_malformed_neighbour_costs_no_other_request_its_samples() {
    let stack = TestStack::shared();
    let proxy = coalescing_proxy(stack, "20ms");
    let mlflow = &stack.mlflow.url;
    let through = create_run(mlflow, "write-repro-proxy").await;
    let direct = create_run(mlflow, "write-repro-direct").await;
    let attacker: Write = (
        "runs/log-batch",
        json!({"run_id": "RUN", "metrics": [{"key": "attacker", "value": "abc", "timestamp": 5, "step": 0}]}),
    );
    let victims: Vec<Write> = (0..3)
        .map(|v| {
            (
                "runs/log-batch",
                json!({"run_id": "RUN", "metrics": [{"key": format!("victim{v}"), "value": v, "timestamp": 7, "step": 0}]}),
            )
        })
        .collect();
    let fillers = [filler("filler-a"), filler("filler-b")];

    let (filled, attacked, hit) = tokio::join!(
        join_all(fillers.iter().map(|w| send(&proxy.url, w, &through))),
        async {
            after_the_opener(&proxy).await;
            send(&proxy.url, &attacker, &through).await
        },
        join_all(victims.iter().map(|w| async {
            after_the_opener(&proxy).await;
            tokio::time::sleep(Duration::from_millis(5)).await;
            send(&proxy.url, w, &through).await
        }))
    );
    let mut alone = Vec::new();
    for w in fillers.iter().chain([&attacker]).chain(&victims) {
        alone.push(answer(&send(mlflow, w, &direct).await));
    }
    let mut got: Vec<(u16, Value)> = filled.iter().map(answer).collect();
    got.push(answer(&attacked));
    got.extend(hit.iter().map(answer));
    assert_eq!(got, alone, "statuses through the proxy and alone");
    let stored = histories(mlflow, &through).await;
    for v in 0..3 {
        assert_eq!(
            stored[&format!("victim{v}")].len(),
            1,
            "{:?}",
            stored.keys()
        );
    }
    assert_same_data(mlflow, &through, &direct).await;
    let metrics = scrape(&proxy.admin_url).await;
    assert!(
        counter(
            &metrics,
            "mlscope_coalesce_skipped_total{reason=\"element\"}"
        ) >= 1.0,
        "the attacker was not sent alone: {metrics}"
    );
}

/// A small deterministic generator, so a failure names a seed that reproduces it.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Request `r` of client `c`: mostly valid writes in every shape the MLflow client sends, about
/// 6 % elements MLflow's parser stores as zeros, and requests MLflow refuses (a bad key, a
/// param changed after it was logged).
fn mixed_request(rng: &mut Rng, c: u64, r: u64) -> Write {
    let ts = 1_700_000_000_000 + (c * 1000 + r) as i64;
    let step = r as i64;
    let good = |k: &str, v: Value| json!({"key": k, "value": v, "timestamp": ts, "step": step});
    let own = format!("c{c}/loss");
    match rng.below(100) {
        0..=1 => (
            "runs/log-batch",
            json!({"run_id": "RUN", "metrics": [good(&own, json!(1.5)), good(&format!("bad/value/c{c}"), json!("abc")), good("after/abc", json!(2))]}),
        ),
        2..=3 => (
            "runs/log-batch",
            json!({"run_id": "RUN", "metrics": [good(&own, json!(1.5)), {"key": format!("bad/step/c{c}"), "value": 1, "timestamp": ts, "step": 1.5}]}),
        ),
        4..=5 => (
            "runs/log-batch",
            json!({"run_id": "RUN", "metrics": [{"key": format!("bad/timestamp/c{c}"), "value": 1, "timestamp": "soon", "step": step}, good(&own, json!(3))]}),
        ),
        6..=8 => (
            "runs/log-batch",
            json!({"run_id": "RUN", "metrics": [good(&own, json!(1)), good("bad key!", json!(1))]}),
        ),
        9..=38 => (
            "runs/log-metric",
            json!({"run_uuid": "RUN", "run_id": "RUN", "key": format!("c{c}/lr"), "value": 0.001 * r as f64, "timestamp": ts, "step": step}),
        ),
        39..=50 => (
            "runs/log-batch",
            json!({"run_id": "RUN",
                "metrics": [good(&own, json!(0.25)), good("shared/throughput", json!(c as f64 + 0.5))],
                "params": [{"key": format!("c{c}.r{r}"), "value": "x"}, {"key": "lr", "value": "0.001"}],
                "tags": [{"key": format!("c{c}.state"), "value": format!("r{r}")}]}),
        ),
        51..=55 => (
            "runs/log-parameter",
            // The first of these per client is stored; later ones change it and are refused.
            json!({"run_id": "RUN", "run_uuid": "RUN", "key": format!("c{c}.fixed"), "value": format!("{r}")}),
        ),
        56..=62 => (
            "runs/set-tag",
            json!({"run_id": "RUN", "run_uuid": "RUN", "key": format!("c{c}.note"), "value": format!("r{r}")}),
        ),
        _ => {
            let n = 1 + rng.below(5);
            let metrics: Vec<Value> = (0..n)
                .map(|i| match i {
                    0 => good(&own, json!("NaN")),
                    _ => good(&format!("c{c}/m{i}"), json!(i as f64 / 3.0)),
                })
                .collect();
            (
                "runs/log-batch",
                json!({"run_id": "RUN", "metrics": metrics}),
            )
        }
    }
}

/// 50 concurrent clients, 30 requests each, through the proxy; then each request alone, in each
/// client's order, straight to MLflow.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_clients_with_malformed_and_refused_neighbours_get_what_mlflow_gives_each_alone()
{
    const CLIENTS: u64 = 50;
    const REQUESTS: u64 = 30;
    let seed = 0x5eed_2026_u64;
    let stack = TestStack::shared();
    let proxy = coalescing_proxy(stack, "20ms");
    let mlflow = &stack.mlflow.url;
    let through = create_run(mlflow, "write-mix-proxy").await;
    let direct = create_run(mlflow, "write-mix-direct").await;
    let mut rng = Rng(seed);
    let plan: Vec<Vec<Write>> = (0..CLIENTS)
        .map(|c| {
            (0..REQUESTS)
                .map(|r| mixed_request(&mut rng, c, r))
                .collect()
        })
        .collect();

    let answers = join_all(plan.iter().map(|requests| {
        let (proxy, through) = (&proxy.url, &through);
        async move {
            let mut answers = Vec::new();
            for w in requests {
                answers.push(answer(&send(proxy, w, through).await));
            }
            answers
        }
    }))
    .await;
    let mut differences = Vec::new();
    let (mut acknowledged, mut malformed) = (0, 0);
    for r in 0..REQUESTS as usize {
        for c in 0..CLIENTS as usize {
            let w = &plan[c][r];
            let alone = answer(&send(mlflow, w, &direct).await);
            if alone != answers[c][r] {
                differences.push(format!(
                    "client {c} request {r} {}: proxy {:?}, alone {alone:?}",
                    w.1, answers[c][r]
                ));
            }
            acknowledged += usize::from(alone.0 == 200);
            malformed += usize::from(w.1.to_string().contains("bad/"));
        }
    }
    assert!(differences.is_empty(), "seed {seed:#x}: {differences:#?}");
    assert_same_data(mlflow, &through, &direct).await;
    let samples: usize = histories(mlflow, &through)
        .await
        .values()
        .map(Vec::len)
        .sum();
    eprintln!(
        "write mix: {} requests from {CLIENTS} clients, {malformed} with an element MLflow stores as zeros, {} refused by MLflow alone, {acknowledged} acknowledged; 0 differences in status; {samples} samples, params and tags equal to the requests sent alone",
        CLIENTS * REQUESTS,
        (CLIENTS * REQUESTS) as usize - acknowledged,
    );
    // The mix did what it is for: malformed neighbours, refusals, and merging.
    assert!(
        malformed >= 50 && acknowledged >= 1000,
        "{malformed} malformed, {acknowledged} acknowledged"
    );
    let metrics = scrape(&proxy.admin_url).await;
    for line in [
        "mlscope_coalesce_batches_total{outcome=\"merged\"}",
        "mlscope_coalesce_batches_total{outcome=\"split\"}",
        "mlscope_coalesce_skipped_total{reason=\"element\"}",
    ] {
        assert!(counter(&metrics, line) >= 1.0, "{line} is 0: {metrics}");
    }
}

/// A param changed inside a merged batch: the changer gets MLflow's own refusal, every other
/// request of the batch is stored; and two requests that set one param differently never share a
/// batch, so the later one is refused exactly as it would be alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_changed_param_in_a_merged_batch_fails_only_its_sender() {
    let stack = TestStack::shared();
    let proxy = coalescing_proxy(stack, "20ms");
    let mlflow = &stack.mlflow.url;
    let through = create_run(mlflow, "write-param-proxy").await;
    let direct = create_run(mlflow, "write-param-direct").await;
    let first: Write = (
        "runs/log-parameter",
        json!({"run_id": "RUN", "key": "lr", "value": "0.1"}),
    );
    for run in [&through, &direct] {
        assert_eq!(send(mlflow, &first, run).await.0, 200);
    }
    let mut queued: Vec<Write> = (0..4)
        .map(|i| {
            (
                "runs/log-batch",
                json!({"run_id": "RUN", "metrics": [{"key": format!("m{i}"), "value": i, "timestamp": 3, "step": 0}],
                       "params": [{"key": format!("p{i}"), "value": "v"}]}),
            )
        })
        .collect();
    // Changes a param the run already holds: only MLflow knows, so it shares the batch.
    queued.insert(
        2,
        (
            "runs/log-batch",
            json!({"run_id": "RUN", "metrics": [{"key": "changer", "value": 1, "timestamp": 3}], "params": [{"key": "lr", "value": "0.2"}]}),
        ),
    );
    // Two values of one new param: the second cannot share the first's batch.
    queued.push((
        "runs/log-parameter",
        json!({"run_id": "RUN", "key": "batch_size", "value": "32"}),
    ));
    queued.push((
        "runs/log-parameter",
        json!({"run_id": "RUN", "key": "batch_size", "value": "64"}),
    ));

    let opener = filler("opener");
    let (opened, got) = tokio::join!(send(&proxy.url, &opener, &through), async {
        after_the_opener(&proxy).await;
        // Arrival order matters here: one after the other, all queued behind the opener.
        let mut answers = Vec::new();
        for w in &queued {
            let (url, run, w) = (proxy.url.clone(), through.clone(), w.clone());
            answers.push(tokio::spawn(async move { send(&url, &w, &run).await }));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        join_all(answers).await
    });
    assert_eq!(opened.0, 200);
    let mut answers = vec![answer(&opened)];
    answers.extend(got.into_iter().map(|a| answer(&a.unwrap())));
    // The two values of `batch_size` race: 5 ms apart, a loaded machine may deliver the second
    // first. Whichever the proxy took first, the reference straight to MLflow sends first.
    let (first, second) = (queued.len() - 2, queued.len() - 1);
    if answers[second + 1].0 == 200 && answers[first + 1].0 != 200 {
        queued.swap(first, second);
        answers.swap(first + 1, second + 1);
    }
    let mut alone = vec![answer(&send(mlflow, &opener, &direct).await)];
    for w in &queued {
        alone.push(answer(&send(mlflow, w, &direct).await));
    }
    assert_eq!(answers, alone);
    assert_eq!(alone[3], (400, json!("INVALID_PARAMETER_VALUE")));
    assert_eq!(alone[7], (400, json!("INVALID_PARAMETER_VALUE")));
    assert_same_data(mlflow, &through, &direct).await;
    let metrics = scrape(&proxy.admin_url).await;
    assert!(
        counter(
            &metrics,
            "mlscope_coalesce_batches_total{outcome=\"split\"}"
        ) >= 1.0,
        "the changed param never shared a batch: {metrics}"
    );
}

/// The MLflow client's own calls from 8 rank threads into one run: `log_metric` (run_id and
/// run_uuid together), `log_param`, `set_tag` and asynchronous `log_batch`. Through the proxy
/// they merge, and the run holds exactly what the same calls store straight into MLflow.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_mlflow_clients_writes_from_many_ranks_merge_and_store_what_they_store_directly() {
    let stack = TestStack::shared();
    let proxy = coalescing_proxy(stack, "20ms");
    let mlflow = &stack.mlflow.url;
    let through = create_run(mlflow, "write-client-proxy").await;
    let direct = create_run(mlflow, "write-client-direct").await;
    let script = repo_root().join("tests/python/client_ranks.py");
    // The reference straight to MLflow runs the ranks one after another: concurrently, MLflow
    // itself races on inserting one param and answers one of them 400 (IntegrityError).
    for (uri, run, sequential) in [
        (proxy.url.as_str(), &through, "0"),
        (mlflow.as_str(), &direct, "1"),
    ] {
        // The suite shares one SQLite MLflow among its tests: under their load MLflow answers
        // "database is locked" for a while, which the client retries; give it the retries a
        // loaded server needs (what is compared is the data, not the time).
        let envs = [
            ("RUN_ID", run.as_str()),
            ("THREADS", "8"),
            ("STEPS", "20"),
            ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "10"),
            ("SEQUENTIAL", sequential),
        ];
        let child = python(uri, &envs)
            .arg(&script)
            .spawn()
            .expect("starting python");
        let (ok, stdout, stderr) = finish(child, Duration::from_secs(600)).await;
        assert!(ok, "{uri}: {stdout}\n{stderr}");
    }
    assert_same_data(mlflow, &through, &direct).await;
    let stored = histories(mlflow, &through).await;
    assert_eq!(stored["rank7/loss"].len(), 20, "{:?}", stored.keys());
    let metrics = scrape(&proxy.admin_url).await;
    assert!(
        counter(
            &metrics,
            "mlscope_coalesce_batches_total{outcome=\"merged\"}"
        ) >= 1.0,
        "the client's writes were never merged: {metrics}"
    );
    assert_eq!(
        counter(&metrics, "mlscope_coalesce_skipped_total{reason=\"shape\"}"),
        0.0,
        "a client shape was sent alone: {metrics}"
    );
}

/// MLflow before 3.16 deadlocks on PostgreSQL when writes to one run overlap (error 40P01,
/// answered 503). The proxy learns it from MLflow's version and sends one batch of a run at a
/// time, so 12 concurrent writers of 1000-metric batches into one run of MLflow 3.15.2 on
/// PostgreSQL get 200 for every request and every sample is stored once. The same load straight to MLflow is sent too and its
/// failures printed, as the reference.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writers_into_one_run_never_deadlock_mlflow_3_15_on_postgresql() {
    const CLIENTS: usize = 12;
    const REQUESTS: usize = 4;
    const KEYS: usize = 1000;
    let admin = std::env::var("MLSCOPE_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let database = PostgresDatabase::create(&admin, "mlscope_deadlock")
        .expect("PostgreSQL at 127.0.0.1:5432 (scripts/test starts it)");
    let backend = database
        .url
        .replacen("postgres://", "postgresql+psycopg://", 1);
    let stack = tokio::task::spawn_blocking(move || {
        TestStack::start_with_mlflow_from(
            StackOptions {
                proxy: true,
                proxy_args: Vec::new(),
                mlflow_backend: Some(backend),
                ..StackOptions::default()
            },
            &legacy_venv(),
        )
    })
    .await
    .unwrap()
    .expect("MLflow 3.15.2 on PostgreSQL behind the proxy");
    let mlflow = &stack.mlflow.url;
    // Every writer updates the same latest-metric rows, half of them in the opposite key order:
    // MLflow locks those rows 500 keys at a time in the order the client sent them (#24923).
    let request = |c: usize, r: usize| -> Write {
        let ts = 1_700_000_000_000 + (c * 100 + r) as i64;
        let mut keys: Vec<usize> = (0..KEYS).collect();
        if c % 2 == 1 {
            keys.reverse();
        }
        let metrics: Vec<Value> = keys
            .iter()
            .map(|k| json!({"key": format!("layer{k}/grad_norm"), "value": (c * 100 + r) as f64, "timestamp": ts, "step": r}))
            .collect();
        (
            "runs/log-batch",
            json!({"run_id": "RUN", "metrics": metrics}),
        )
    };
    let load = |base: String, run: String| async move {
        let answers = join_all((0..CLIENTS).map(|c| {
            let (base, run) = (base.clone(), run.clone());
            async move {
                let mut answers = Vec::new();
                for r in 0..REQUESTS {
                    answers.push(send(&base, &request(c, r), &run).await.0);
                }
                answers
            }
        }))
        .await;
        answers.into_iter().flatten().collect::<Vec<u16>>()
    };
    let direct = create_run(mlflow, "deadlock-direct").await;
    let through = create_run(mlflow, "deadlock-proxy").await;
    // The rows exist before the writers meet (MLflow locks only existing ones).
    for run in [&direct, &through] {
        assert_eq!(send(mlflow, &request(0, 99), run).await.0, 200);
    }
    let direct_answers = load(mlflow.clone(), direct.clone()).await;
    let proxy_answers = load(stack.proxy_url().to_owned(), through.clone()).await;
    let failed = |answers: &[u16]| answers.iter().filter(|s| **s != 200).count();
    eprintln!(
        "MLflow 3.15.2 on PostgreSQL, {CLIENTS} writers x {REQUESTS} log-batch into one run: direct {} of {} failed, through mlscope-proxy {} of {} failed",
        failed(&direct_answers),
        direct_answers.len(),
        failed(&proxy_answers),
        proxy_answers.len()
    );
    // The load reproduces the deadlock straight to MLflow (33 of 48 failed when measured), so
    // the proxy's zero is not the load's.
    assert!(
        failed(&direct_answers) > 0,
        "the load no longer deadlocks MLflow 3.15.2 directly"
    );
    assert_eq!(failed(&proxy_answers), 0, "{proxy_answers:?}");
    let mut samples = 0;
    for k in 0..KEYS {
        samples += history(mlflow, &through, &format!("layer{k}/grad_norm"))
            .await
            .len();
    }
    assert_eq!(samples, (CLIENTS * REQUESTS + 1) * KEYS);
    // The proxy learned from MLflow's version to send one batch of a run at a time.
    let admin = &stack.proxy.as_ref().expect("a proxy").admin_url;
    let metrics = scrape(admin).await;
    assert_eq!(
        counter(&metrics, "mlscope_coalesce_in_flight_per_run "),
        1.0,
        "{metrics}"
    );
}
