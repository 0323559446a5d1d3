use super::*;
use http::StatusCode;

#[test]
fn mlflow_before_3_16_gets_one_batch_per_run() {
    for (version, deadlocks) in [
        ("3.15.2", true),
        ("2.22.5", true),
        ("3.16.0", false),
        ("3.17.2", false),
        ("4.0.0", false),
    ] {
        assert_eq!(
            deadlocks_on_overlapping_writes(MlflowVersion::parse(version).unwrap()),
            deadlocks,
            "{version}"
        );
    }
    assert!(names_a_deadlock(
            br#"{"error_code":"TEMPORARILY_UNAVAILABLE","message":"(psycopg.errors.DeadlockDetected) deadlock detected"}"#
        ));
    assert!(!names_a_deadlock(
        br#"{"error_code":"INVALID_PARAMETER_VALUE"}"#
    ));
}

#[test]
fn ranks_of_one_client_merge_and_other_credentials_do_not() {
    let headers = |pairs: &[(&'static str, &'static str)]| {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, HeaderValue::from_static(value));
        }
        map
    };
    let rank = |r: &'static str| {
        merge_fingerprint(&headers(&[
            ("authorization", "Basic dTpw"),
            ("x-mlscope-node", "n1"),
            ("x-mlscope-rank", r),
        ]))
    };
    assert_eq!(rank("0"), rank("1"));
    assert_ne!(
        rank("0"),
        merge_fingerprint(&headers(&[("authorization", "Basic b3RoZXI6cA==")]))
    );
    assert_ne!(
        merge_fingerprint(&headers(&[("cookie", "session=a")])),
        merge_fingerprint(&headers(&[("cookie", "session=b")]))
    );
    assert_ne!(
        merge_fingerprint(&headers(&[("x-mlflow-workspace", "team-a")])),
        merge_fingerprint(&headers(&[("x-mlflow-workspace", "team-b")]))
    );
}

/// A stand-in MLflow: records each request (alone or a merged batch) with its body, and
/// answers only as its gate lets it, so a test decides when a batch is done.
struct StandIn {
    log: Mutex<Vec<(&'static str, String)>>,
    gate: Semaphore,
    batch_status: StatusCode,
}

impl StandIn {
    fn new(batch_status: StatusCode) -> Arc<StandIn> {
        Arc::new(StandIn {
            log: Mutex::default(),
            gate: Semaphore::new(0),
            batch_status,
        })
    }

    async fn answer(&self, how: &'static str, request: Request, status: StatusCode) -> Response {
        let body = axum::body::to_bytes(request.into_body(), usize::MAX)
            .await
            .unwrap();
        let body = String::from_utf8_lossy(&body).into_owned();
        self.log.lock().unwrap().push((how, body));
        self.gate.acquire().await.unwrap().forget();
        let mut response = Response::new(Body::from(if status.is_success() {
            "{}"
        } else {
            r#"{"error_code":"INVALID_PARAMETER_VALUE","message":"no"}"#
        }));
        *response.status_mut() = status;
        response
    }

    fn log(&self) -> Vec<(&'static str, String)> {
        self.log.lock().unwrap().clone()
    }

    /// Waits (on the paused clock, which moves on while everything waits) until `n`
    /// requests have arrived.
    async fn received(&self, n: usize) {
        while self.log.lock().unwrap().len() < n {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

impl Sender for StandIn {
    fn forward(&self, request: Request, _peer: SocketAddr) -> BoxFuture<'_, Response> {
        Box::pin(self.answer("alone", request, StatusCode::OK))
    }

    fn send(
        &self,
        request: Request,
        _peer: SocketAddr,
        _id: HeaderValue,
    ) -> BoxFuture<'_, Result<Response, ProxyError>> {
        Box::pin(async move { Ok(self.answer("batch", request, self.batch_status).await) })
    }
}

fn coalescer(stand_in: &Arc<StandIn>, in_flight_per_run: usize) -> Coalescer {
    let config = CoalesceConfig {
        window: Duration::from_millis(20),
        in_flight_per_run,
        ..CoalesceConfig::default()
    };
    Coalescer::with_sender(config, stand_in.clone(), Metrics::new())
}

/// The head of a log-batch request with `body`, and the client's address.
fn log_batch_head(body: &str) -> (http::request::Parts, SocketAddr) {
    let (parts, _) = Request::post("/api/2.0/mlflow/runs/log-batch")
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, body.len())
        .body(Body::empty())
        .unwrap()
        .into_parts();
    (parts, "127.0.0.1:40000".parse().unwrap())
}

/// Submits a log-batch body as the metric routes hand it on; the client's status.
fn submit(coalescer: &Coalescer, body: String) -> tokio::task::JoinHandle<StatusCode> {
    let coalescer = coalescer.clone();
    tokio::spawn(async move {
        let (parts, peer) = log_batch_head(&body);
        coalescer
            .submit_read(parts, Bytes::from(body), None, peer)
            .await
            .status()
    })
}

fn metric(step: i64) -> String {
    format!(
        r#"{{"run_id":"r","metrics":[{{"key":"loss","value":1,"timestamp":1,"step":{step}}}]}}"#
    )
}

fn steps(body: &str) -> Vec<i64> {
    let value: serde_json::Value = serde_json::from_str(body).unwrap();
    value["metrics"]
        .as_array()
        .map(|m| m.iter().map(|m| m["step"].as_i64().unwrap()).collect())
        .unwrap_or_default()
}

#[tokio::test(start_paused = true)]
async fn writes_that_wait_for_the_runs_batch_at_mlflow_go_next_as_one_batch_in_arrival_order() {
    let stand_in = StandIn::new(StatusCode::OK);
    let coalescer = coalescer(&stand_in, 1);
    let first = submit(&coalescer, metric(0));
    stand_in.received(1).await;
    let rest: Vec<_> = (1..=3)
        .map(|step| submit(&coalescer, metric(step)))
        .collect();
    // Long past the window, nothing more goes while the run's batch is at MLflow.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(stand_in.log().len(), 1);
    stand_in.gate.add_permits(2);
    assert_eq!(first.await.unwrap(), StatusCode::OK);
    for write in rest {
        assert_eq!(write.await.unwrap(), StatusCode::OK);
    }
    let log = stand_in.log();
    assert_eq!(log.len(), 2, "{log:?}");
    assert_eq!((log[0].0, steps(&log[0].1)), ("alone", vec![0]));
    assert_eq!((log[1].0, steps(&log[1].1)), ("batch", vec![1, 2, 3]));
}

/// A log-batch body of run `r` with these params and tags.
fn pairs(params: &[(&str, &str)], tags: &[(&str, &str)]) -> String {
    let list = |pairs: &[(&str, &str)]| -> Vec<serde_json::Value> {
        pairs
            .iter()
            .map(|(k, v)| serde_json::json!({"key": k, "value": v}))
            .collect()
    };
    serde_json::json!({"run_id": "r", "params": list(params), "tags": list(tags)}).to_string()
}

#[tokio::test(start_paused = true)]
async fn metrics_pass_a_runs_params_but_the_same_key_waits_until_mlflow_holds_it() {
    let stand_in = StandIn::new(StatusCode::OK);
    let coalescer = coalescer(&stand_in, 2);
    let params = submit(&coalescer, pairs(&[("lr", "0.1")], &[("phase", "train")]));
    stand_in.received(1).await;
    // Metrics commute with params and tags: they go while the params are at MLflow.
    let metrics = submit(&coalescer, metric(7));
    stand_in.received(2).await;
    // The same param, new to MLflow, must not race its insert; nor a tag's other value.
    let same = submit(&coalescer, pairs(&[("lr", "0.1")], &[]));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(stand_in.log().len(), 2, "a write raced the run's new param");
    stand_in.gate.add_permits(2);
    assert_eq!(params.await.unwrap(), StatusCode::OK);
    assert_eq!(metrics.await.unwrap(), StatusCode::OK);
    stand_in.received(3).await;
    // Now MLflow holds lr=0.1 and phase=train: writes of those values overlap with each other
    // (the one still at MLflow writes lr=0.1 too), a tag's other value waits for both.
    let again = submit(&coalescer, pairs(&[("lr", "0.1")], &[("phase", "train")]));
    stand_in.received(4).await;
    stand_in.gate.add_permits(1);
    assert_eq!(same.await.unwrap(), StatusCode::OK);
    // One batch is at MLflow, below the limit: only its tag's old value holds the new one.
    let changed = submit(&coalescer, pairs(&[], &[("phase", "eval")]));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        stand_in.log().len(),
        4,
        "a tag's new value passed its old one"
    );
    stand_in.gate.add_permits(2);
    for write in [again, changed] {
        assert_eq!(write.await.unwrap(), StatusCode::OK);
    }
    let log = stand_in.log();
    assert_eq!(steps(&log[1].1), [7]);
    assert!(log[4].1.contains("eval"), "{log:?}");
}

#[tokio::test(start_paused = true)]
async fn a_write_that_goes_alone_keeps_its_place_in_its_runs_order() {
    let stand_in = StandIn::new(StatusCode::OK);
    let coalescer = coalescer(&stand_in, 8);
    let first = submit(&coalescer, metric(0));
    stand_in.received(1).await;
    // A value MLflow's parser does not take as written: this request cannot share a batch.
    let malformed =
        r#"{"run_id":"r","metrics":[{"key":"loss","value":"abc","timestamp":1,"step":1}]}"#;
    let alone = submit(&coalescer, malformed.to_owned());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        stand_in.log().len(),
        1,
        "the lone write passed the run's batch"
    );
    stand_in.gate.add_permits(1);
    assert_eq!(first.await.unwrap(), StatusCode::OK);
    stand_in.received(2).await;
    let after = submit(&coalescer, metric(2));
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(stand_in.log().len(), 2, "a later write passed the lone one");
    stand_in.gate.add_permits(2);
    assert_eq!(alone.await.unwrap(), StatusCode::OK);
    assert_eq!(after.await.unwrap(), StatusCode::OK);
    let log = stand_in.log();
    assert_eq!(log[1].1, malformed, "sent as it came");
    assert_eq!(steps(&log[2].1), [2]);
}

#[tokio::test(start_paused = true)]
async fn a_param_mlflow_holds_with_the_value_written_does_not_go_again() {
    let stand_in = StandIn::new(StatusCode::OK);
    let coalescer = coalescer(&stand_in, 8);
    let with_metric = |step: i64, params: &str| {
        format!(
            r#"{{"run_id":"r","metrics":[{{"key":"loss","value":1,"timestamp":1,"step":{step}}}],"params":[{params}]}}"#
        )
    };
    let lr = r#"{"key":"lr","value":"0.1"}"#;
    let seed = r#"{"key":"seed","value":"7"}"#;
    stand_in.gate.add_permits(3);
    let first = submit(&coalescer, with_metric(0, lr));
    assert_eq!(first.await.unwrap(), StatusCode::OK);
    // MLflow holds lr=0.1 now: it is left out, the new seed goes.
    let again = submit(&coalescer, with_metric(1, &format!("{lr},{seed}")));
    assert_eq!(again.await.unwrap(), StatusCode::OK);
    // Nothing but held params: the request goes as it came, for MLflow's own answer.
    let only = submit(&coalescer, pairs(&[("lr", "0.1")], &[]));
    assert_eq!(only.await.unwrap(), StatusCode::OK);
    let log = stand_in.log();
    let params = |body: &str| -> Vec<String> {
        let value: serde_json::Value = serde_json::from_str(body).unwrap();
        value["params"]
            .as_array()
            .map(|p| {
                p.iter()
                    .map(|p| p["key"].as_str().unwrap().to_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(params(&log[0].1), ["lr"]);
    assert_eq!(
        (log[1].0, params(&log[1].1), steps(&log[1].1)),
        ("batch", vec!["seed".to_owned()], vec![1])
    );
    assert_eq!(
        (log[2].0, params(&log[2].1)),
        ("alone", vec!["lr".to_owned()])
    );
}

#[tokio::test(start_paused = true)]
async fn a_batch_mlflow_refuses_is_split_and_each_write_gets_its_own_answer_in_order() {
    let stand_in = StandIn::new(StatusCode::BAD_REQUEST);
    let coalescer = coalescer(&stand_in, 1);
    let first = submit(&coalescer, metric(0));
    stand_in.received(1).await;
    let rest: Vec<_> = (1..=2)
        .map(|step| submit(&coalescer, metric(step)))
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    stand_in.gate.add_permits(4);
    assert_eq!(first.await.unwrap(), StatusCode::OK);
    for write in rest {
        // Alone, each write is what MLflow stores: its own answer, not the batch's 400.
        assert_eq!(write.await.unwrap(), StatusCode::OK);
    }
    let log: Vec<(&str, Vec<i64>)> = stand_in
        .log()
        .into_iter()
        .map(|(how, body)| (how, steps(&body)))
        .collect();
    assert_eq!(
        log,
        [
            ("alone", vec![0]),
            ("batch", vec![1, 2]),
            ("alone", vec![1]),
            ("alone", vec![2])
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_lone_write_whose_client_goes_away_at_mlflow_gives_its_runs_place_back() {
    let stand_in = StandIn::new(StatusCode::OK);
    let coalescer = coalescer(&stand_in, 1);
    // An idle run's write goes at once, alone, on its client's own task; the client goes away
    // while MLflow holds it.
    let gone = submit(&coalescer, metric(0));
    stand_in.received(1).await;
    gone.abort();
    assert!(gone.await.unwrap_err().is_cancelled());
    // The run's one place at MLflow is free again: the next write goes at once, not after a
    // batch nobody waits for.
    let next = submit(&coalescer, metric(1));
    // On the paused clock: an hour passes at once when nothing else can happen.
    tokio::time::timeout(Duration::from_secs(3600), stand_in.received(2))
        .await
        .expect("the next write waited for the abandoned one");
    stand_in.gate.add_permits(1);
    assert_eq!(next.await.unwrap(), StatusCode::OK);
    let log = stand_in.log();
    assert_eq!((log[1].0, steps(&log[1].1)), ("alone", vec![1]));
    assert!(coalescer.inner.runs.lock().unwrap().is_empty());
}

/// Sends a log-batch body through [`Coalescer::at_once`]: `None` when the coalescer gave it back
/// (its run is busy), else the client's status once answered.
fn at_once(coalescer: &Coalescer, body: String) -> Option<tokio::task::JoinHandle<StatusCode>> {
    let (parts, peer) = log_batch_head(&body);
    let sent = coalescer
        .at_once("r", parts, Bytes::from(body), 1, peer)
        .ok()?;
    Some(tokio::spawn(async move { sent.await.status() }))
}

#[tokio::test(start_paused = true)]
async fn a_runs_own_metrics_go_at_once_only_to_an_idle_run_and_the_runs_next_writes_queue_behind() {
    let stand_in = StandIn::new(StatusCode::OK);
    let coalescer = coalescer(&stand_in, 2);
    let first = at_once(&coalescer, metric(0)).expect("an idle run takes it at once");
    stand_in.received(1).await;
    // The run has a batch at MLflow now: a second is given back, to be read and queued.
    assert!(at_once(&coalescer, metric(1)).is_none());
    // Queued, it overlaps the first (metrics commute) once its window is over.
    let queued = submit(&coalescer, metric(1));
    stand_in.received(2).await;
    // The run stays busy while anything of it is at MLflow or queued.
    let params = submit(&coalescer, pairs(&[("lr", "0.1")], &[]));
    assert!(at_once(&coalescer, metric(2)).is_none());
    stand_in.gate.add_permits(3);
    for write in [first, queued, params] {
        assert_eq!(write.await.unwrap(), StatusCode::OK);
    }
    // Once nothing of the run is left (the batch tasks and the window's timer done), the next
    // goes at once again, as it came.
    while !coalescer.inner.runs.lock().unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let last = at_once(&coalescer, metric(3)).expect("the run is idle again");
    stand_in.gate.add_permits(1);
    assert_eq!(last.await.unwrap(), StatusCode::OK);
    let log = stand_in.log();
    assert_eq!(log.len(), 4, "{log:?}");
    assert_eq!(log[0], ("alone", metric(0)));
    assert_eq!((log[1].0, steps(&log[1].1)), ("alone", vec![1]));
    assert!(log[2].1.contains("lr"), "{log:?}");
    assert_eq!(log[3], ("alone", metric(3)));
    assert!(coalescer.inner.runs.lock().unwrap().is_empty());
}
