//! `fair-share`: one client flooding MLflow with writes (many concurrent writers, each into its
//! own run, a tag and 100 metrics per batch, no pause) while well-behaved clients write a few
//! times a second and a UI reader searches runs, straight to MLflow and through mlscope-proxy
//! (its defaults unless `--client-write-rate` is given). Reported per target: the calm clients'
//! and the reader's success and p99 latency under the flood against their p99 alone, what the
//! flood got, and whether every acknowledged sample is stored (counted back from MLflow).
//!
//! Every client has its own credential (`Authorization: Basic`, which an MLflow without
//! authentication ignores) and its own `X-Forwarded-For` address (the proxy trusts loopback
//! here); straight to MLflow the flood is not told apart at all.

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde_json::{json, Value};

use crate::cli::FairShareArgs;
use crate::markdown::{command_block, Align, Table};
use crate::stack::{BenchStack, Target, TargetKind};
use crate::Report;

const FLOOD_CLIENT: Client<'static> = Client {
    address: "203.0.113.9",
    user: "flood",
};
const READER: Client<'static> = Client {
    address: "198.51.100.200",
    user: "ui-reader",
};

/// Who sends a request: its `X-Forwarded-For` address and its Basic credential's user.
#[derive(Clone, Copy)]
struct Client<'a> {
    address: &'a str,
    user: &'a str,
}
/// Metrics per flood batch, as the workload.
const FLOOD_METRICS: usize = 100;
/// How long the calm clients and the reader write before their p99 alone is measured.
const WARM_UP: Duration = Duration::from_secs(3);
/// Longest a single request may take before it counts as failed.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// What the calm clients saw in one phase.
#[derive(Default)]
struct Calm {
    sent: u64,
    ok: u64,
    latency: Option<Histogram<u64>>,
}

impl Calm {
    /// Adds what another window of the same phase saw.
    fn merge(&mut self, other: Calm) {
        self.sent += other.sent;
        self.ok += other.ok;
        match (&mut self.latency, other.latency) {
            (Some(mine), Some(theirs)) => {
                let _ = mine.add(&theirs);
            }
            (mine @ None, theirs) => *mine = theirs,
            (Some(_), None) => {}
        }
    }

    fn p99_ms(&self) -> f64 {
        self.latency
            .as_ref()
            .map_or(0.0, |h| h.value_at_quantile(0.99) as f64 / 1e3)
    }
}

/// What the flood got in one phase.
#[derive(Default, Clone)]
struct Flood {
    ok: u64,
    refused: u64,
    failed: u64,
    seconds: f64,
    /// Every answer other than 200: (writer, batch, what came back), so that a batch stored
    /// although it was not acknowledged can be traced to the answer its writer got.
    not_ok: Vec<(usize, i64, String)>,
}

impl Flood {
    /// Adds what another window of the same phase got.
    fn merge(&mut self, other: Flood) {
        self.ok += other.ok;
        self.refused += other.refused;
        self.failed += other.failed;
        self.seconds += other.seconds;
        self.not_ok.extend(other.not_ok);
    }

    /// Samples acknowledged per second.
    fn samples_per_second(&self) -> f64 {
        (self.ok * FLOOD_METRICS as u64) as f64 / self.seconds.max(0.001)
    }
}

struct Outcome {
    target: Target,
    alone: Calm,
    loaded: Calm,
    reads_alone: Calm,
    reads_loaded: Calm,
    /// The flood with nobody else writing, for `--alone`.
    flood_alone: Flood,
    /// The flood beside the calm clients and the reader, for `--duration`.
    flood: Flood,
    acknowledged: u64,
    stored: u64,
    /// Flood batches MLflow holds more than once, each with the answers its writer got for it
    /// before the 200 (the writer sends a batch again, with new timestamps, after any other).
    twice: Vec<(usize, i64, Vec<String>)>,
    /// The proxy's learned write limit, sampled every half second under the flood.
    limits: Vec<f64>,
}

pub(crate) async fn run(
    args: &FairShareArgs,
    stack: &BenchStack,
    command_line: &str,
) -> anyhow::Result<Report> {
    let mut outcomes = Vec::new();
    let kinds: &[TargetKind] = if args.proxy_only {
        &[TargetKind::Proxy]
    } else {
        &[TargetKind::Direct, TargetKind::Proxy]
    };
    for &kind in kinds {
        let target = stack
            .target(kind)
            .ok_or_else(|| anyhow::anyhow!("no {kind} target"))?;
        eprintln!("fair-share: {} alone, then under the flood", kind.label());
        outcomes.push(one_target(args, stack, target).await?);
    }
    let mut table = Table::new(&[
        ("target", Align::Left),
        ("calm writes ok (under flood)", Align::Right),
        ("calm p99 alone → under flood", Align::Right),
        ("ratio", Align::Right),
        ("UI reads ok (under flood)", Align::Right),
        ("UI read p99 alone → under flood", Align::Right),
        ("flood samples/s alone", Align::Right),
        ("flood samples/s beside the calm (of alone)", Align::Right),
        (
            "flood batches beside the calm: ok / 429 / failed",
            Align::Right,
        ),
        (
            "samples stored ≥ acknowledged (flood batches stored twice)",
            Align::Right,
        ),
        ("learned limit: min / median / max", Align::Right),
    ]);
    let mut problems = Vec::new();
    let mut twice = Vec::new();
    for o in &outcomes {
        let ratio = |alone: &Calm, loaded: &Calm| loaded.p99_ms() / alone.p99_ms().max(0.001);
        let ok = |c: &Calm| {
            format!(
                "{} / {} ({:.1} %)",
                c.ok,
                c.sent,
                100.0 * c.ok as f64 / c.sent.max(1) as f64
            )
        };
        table.row(vec![
            o.target.kind.label().to_owned(),
            ok(&o.loaded),
            format!("{:.1} → {:.1} ms", o.alone.p99_ms(), o.loaded.p99_ms()),
            format!("{:.2}×", ratio(&o.alone, &o.loaded)),
            ok(&o.reads_loaded),
            format!(
                "{:.1} → {:.1} ms ({:.2}×)",
                o.reads_alone.p99_ms(),
                o.reads_loaded.p99_ms(),
                ratio(&o.reads_alone, &o.reads_loaded)
            ),
            format!("{:.0}", o.flood_alone.samples_per_second()),
            format!(
                "{:.0} ({:.0} %)",
                o.flood.samples_per_second(),
                100.0 * o.flood.samples_per_second()
                    / o.flood_alone.samples_per_second().max(0.001)
            ),
            format!("{} / {} / {}", o.flood.ok, o.flood.refused, o.flood.failed),
            format!("{} ≥ {} ({})", o.stored, o.acknowledged, o.twice.len()),
            if o.limits.is_empty() {
                "–".to_owned()
            } else {
                let mut l = o.limits.clone();
                l.sort_by(f64::total_cmp);
                format!("{} / {} / {}", l[0], l[l.len() / 2], l[l.len() - 1])
            },
        ]);
        for (writer, batch, answers) in &o.twice {
            let said = if answers.is_empty() {
                "no answer other than 200 recorded".to_owned()
            } else {
                answers.join(" | ")
            };
            twice.push(format!(
                "- {}: flood writer {writer}, batch {batch}, answered before its 200: {said}",
                o.target.kind.label()
            ));
            // Refused means not stored: a 4xx tells the client to send it again.
            if answers.iter().any(|a| a.starts_with('4')) {
                problems.push(format!(
                    "{}: flood writer {writer}'s batch {batch} was refused ({said}) and stored",
                    o.target.kind.label()
                ));
            }
        }
        // Writes that timed out may have been stored too: stored can exceed acknowledged.
        if o.stored < o.acknowledged {
            problems.push(format!(
                "{}: {} samples acknowledged, {} stored",
                o.target.kind.label(),
                o.acknowledged,
                o.stored
            ));
        }
    }
    let settings = match args.client_write_rate {
        Some(rate) => format!("with `--client-write-rate {rate}`"),
        None => "with its defaults".to_owned(),
    };
    let version = match outcomes.first() {
        Some(o) => crate::mlflow::version(&o.target).await,
        None => None,
    };
    let markdown = format!(
        "## One client flooding writes, ten calm ones (fair-share)\n\nMLflow {} on {}.\n\n{} flood writers of one client (each into its own run, a tag and {FLOOD_METRICS} metrics per log-batch, no pause; first alone for `--alone`, then, once the calm clients write, beside them) and {} calm clients writing a one-metric log-batch {} times a second each, with a UI reader searching the runs as often, for {:?}; the calm clients' and the reader's p99 alone was measured first, for {:?}, after {WARM_UP:?} of warming up{}. Through mlscope-proxy {settings}; every client has its own credential and `X-Forwarded-For` address (trusted from loopback). \"Stored\": samples counted back from MLflow, at least those of every write answered 200 (a write that timed out may be stored too). \"failed\": no answer within 30 s.\n\n{}\n{}{}",
        version.as_deref().unwrap_or("(version not reported)"),
        args.stack.backend_label(),
        args.flood_writers,
        args.calm_clients,
        args.calm_rate,
        args.duration,
        args.alone,
        if args.alternate > 1 {
            format!(
                "; the calm clients alone and under the flood alternated {n} times, each window 1/{n} of its phase, the p99 read over all windows of a phase",
                n = args.alternate
            )
        } else {
            String::new()
        },
        table.render(),
        if twice.is_empty() {
            String::new()
        } else {
            format!(
                "Flood batches MLflow holds twice (a writer sends a batch again, with new timestamps, after any answer but 200):\n\n{}\n\n",
                twice.join("\n")
            )
        },
        command_block(command_line)
    );
    Ok(Report { markdown, problems })
}

async fn one_target(
    args: &FairShareArgs,
    stack: &BenchStack,
    target: Target,
) -> anyhow::Result<Outcome> {
    let mlflow = stack.upstream_url();
    let client = crate::http::client(args.flood_writers + args.calm_clients + 4)?;
    let experiment = create(&client, mlflow, "experiments/create", json!({"name": format!("fair-share-{}-{}", target.kind.slug(), uuid::Uuid::new_v4().simple())}))
        .await?["experiment_id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let new_run = |client: reqwest::Client, experiment: String| async move {
        create(
            &client,
            mlflow,
            "runs/create",
            json!({"experiment_id": experiment, "start_time": now_ms()}),
        )
        .await
        .map(|run| {
            run["run"]["info"]["run_id"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
    };
    let mut calm_runs = Vec::new();
    for _ in 0..args.calm_clients {
        calm_runs.push(new_run(client.clone(), experiment.clone()).await?);
    }
    let mut flood_runs = Vec::new();
    for _ in 0..args.flood_writers {
        flood_runs.push(new_run(client.clone(), experiment.clone()).await?);
    }
    let url = format!("{}/api/2.0/mlflow/runs/log-batch", target.base_url);
    let search = format!("{}/ajax-api/2.0/mlflow/runs/search", target.base_url);
    let search_body = json!({"experiment_ids": [experiment], "max_results": 25});

    // The flood alone first: what MLflow (or the proxy) gives it when nobody else writes. It
    // ends with its last answer, so nothing of it is at MLflow when the calm clients start.
    let (flood_alone, next_batches) = flood_phase(
        &client,
        &url,
        &flood_runs,
        vec![0; flood_runs.len()],
        args.alone,
    )
    .await;

    // The calm clients warm up (connections, MLflow's first lookups of each run; not counted),
    // run alone, then under the flood, which starts while they write (as a flood does that meets
    // clients already at work); steps continue across the phases. With `--alternate N` the two
    // phases alternate N times, each a Nth of `--alone` and `--duration`: the p99 alone and
    // under the flood are then read from the same stretch of the machine's time.
    let steps_in = |d: Duration| (d.as_secs_f64() * args.calm_rate as f64).ceil() as i64 + 1;
    let (warm, _) = tokio::join!(
        calm_phase(&client, &url, &calm_runs, args, WARM_UP, 0),
        read_phase(&client, &search, &search_body, args, WARM_UP)
    );
    let rounds = args.alternate;
    let (alone_each, flood_each) = (args.alone / rounds, args.duration / rounds);
    let mut step = steps_in(WARM_UP);
    let mut next_batches = next_batches;
    let (mut alone, mut reads_alone) = (Calm::default(), Calm::default());
    let (mut loaded, mut reads_loaded) = (Calm::default(), Calm::default());
    let mut flood = Flood::default();
    let mut limits = Vec::new();
    let admin = stack
        .admin_url(target.kind)
        .filter(|_| target.kind == TargetKind::Proxy);
    for _ in 0..rounds {
        let (calm, reads) = tokio::join!(
            calm_phase(&client, &url, &calm_runs, args, alone_each, step),
            read_phase(&client, &search, &search_body, args, alone_each)
        );
        alone.merge(calm);
        reads_alone.merge(reads);
        step += steps_in(alone_each);

        let stop = Instant::now() + flood_each;
        let flooding = flood_phase(&client, &url, &flood_runs, next_batches, flood_each);
        let calm = calm_phase(&client, &url, &calm_runs, args, flood_each, step);
        let reads = read_phase(&client, &search, &search_body, args, flood_each);
        let sampled = async {
            let mut limits = Vec::new();
            if let Some(admin) = &admin {
                while Instant::now() < stop {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    if let Some(text) = crate::prometheus::scrape(&client, admin).await {
                        limits.push(crate::prometheus::sum(
                            &text,
                            "mlscope_fair_share_write_limit ",
                        ));
                    }
                }
            }
            limits
        };
        // The flood's phase ends with its writers' last answers: nothing of it is at MLflow
        // when the next window alone starts.
        let ((got, next), calm, reads, sampled) = tokio::join!(flooding, calm, reads, sampled);
        next_batches = next;
        flood.merge(got);
        loaded.merge(calm);
        reads_loaded.merge(reads);
        limits.extend(sampled);
        step += steps_in(flood_each);
    }

    // Acknowledged means stored: count back every run's samples.
    let acknowledged =
        (flood_alone.ok + flood.ok) * FLOOD_METRICS as u64 + warm.ok + alone.ok + loaded.ok;
    let mut stored = 0u64;
    let mut twice = Vec::new();
    let not_ok: Vec<_> = flood_alone.not_ok.iter().chain(&flood.not_ok).collect();
    for (writer, run) in flood_runs.iter().enumerate() {
        let steps = stored_steps(&client, mlflow, run, "flood").await?;
        stored += steps.len() as u64;
        for batch in batches_stored_twice(&steps) {
            let answers = not_ok
                .iter()
                .filter(|(w, b, _)| (*w, *b) == (writer, batch))
                .map(|(_, _, what)| what.clone())
                .collect();
            twice.push((writer, batch, answers));
        }
    }
    for run in &calm_runs {
        stored += stored_steps(&client, mlflow, run, "calm").await?.len() as u64;
    }
    Ok(Outcome {
        target,
        alone,
        loaded,
        reads_alone,
        reads_loaded,
        flood_alone,
        flood,
        acknowledged,
        stored,
        twice,
        limits,
    })
}

/// The flood batches some step of which MLflow holds more than once.
fn batches_stored_twice(steps: &[i64]) -> Vec<i64> {
    let mut seen = std::collections::HashSet::new();
    let mut twice: Vec<i64> = steps
        .iter()
        .filter(|step| !seen.insert(**step))
        .map(|step| step / FLOOD_METRICS as i64)
        .collect();
    twice.sort_unstable();
    twice.dedup();
    twice
}

/// The flood's writers, each into its own run from batch `next_batches[i]`, back to back for
/// `duration`; what they got, and each run's next batch.
async fn flood_phase(
    client: &reqwest::Client,
    url: &str,
    runs: &[String],
    next_batches: Vec<i64>,
    duration: Duration,
) -> (Flood, Vec<i64>) {
    let started = Instant::now();
    let stop = started + duration;
    let writers = runs.iter().zip(next_batches).enumerate().map(|(writer, (run, first))| {
        let (client, url, run) = (client.clone(), url.to_owned(), run.clone());
        async move {
            let mut flood = Flood::default();
            let mut batch = first;
            while Instant::now() < stop {
                let metrics: Vec<Value> = (0..FLOOD_METRICS as i64)
                    .map(|j| json!({"key": "flood", "value": j as f64, "timestamp": now_ms(), "step": batch * FLOOD_METRICS as i64 + j}))
                    .collect();
                let body = json!({"run_id": run, "metrics": metrics, "tags": [{"key": "batch", "value": batch.to_string()}]});
                let answer = send_read(&client, &url, FLOOD_CLIENT, &body).await;
                match answer.as_ref().map(|(status, _)| *status) {
                    Some(200) => {
                        flood.ok += 1;
                        batch += 1;
                        continue;
                    }
                    // Straight back, as a hostile client would: no backoff.
                    Some(429) => flood.refused += 1,
                    _ => flood.failed += 1,
                }
                let what = answer.map_or_else(
                    || "no answer".to_owned(),
                    |(status, body)| format!("{status} {}", body.chars().take(120).collect::<String>()),
                );
                flood.not_ok.push((writer, batch, what));
            }
            (flood, batch)
        }
    });
    let results = futures_util::future::join_all(writers).await;
    let mut total = Flood {
        seconds: started.elapsed().as_secs_f64(),
        ..Flood::default()
    };
    let mut next = Vec::with_capacity(results.len());
    for (flood, batch) in results {
        total.ok += flood.ok;
        total.refused += flood.refused;
        total.failed += flood.failed;
        total.not_ok.extend(flood.not_ok);
        next.push(batch);
    }
    (total, next)
}

/// The calm clients, each writing one metric `calm_rate` times a second for `duration`, from
/// step `first_step`.
async fn calm_phase(
    client: &reqwest::Client,
    url: &str,
    runs: &[String],
    args: &FairShareArgs,
    duration: Duration,
    first_step: i64,
) -> Calm {
    let interval = Duration::from_secs_f64(1.0 / args.calm_rate as f64);
    let results = futures_util::future::join_all(runs.iter().enumerate().map(|(i, run)| {
        let address = format!("198.51.100.{}", i + 1);
        let user = format!("calm-{}", i + 1);
        async move {
            let me = Client {
                address: &address,
                user: &user,
            };
            let mut latencies = Vec::new();
            let mut sent = 0u64;
            let end = Instant::now() + duration;
            let mut step = first_step;
            let mut next = Instant::now();
            while next < end {
                tokio::time::sleep_until(next.into()).await;
                next += interval;
                let body = json!({"run_id": run, "metrics": [{"key": "calm", "value": 1.0, "timestamp": now_ms(), "step": step}]});
                step += 1;
                sent += 1;
                let started = Instant::now();
                if send(client, url, me, &body).await == Some(200) {
                    latencies.push(started.elapsed());
                }
            }
            (sent, latencies)
        }
    }))
    .await;
    let mut calm = Calm::default();
    let mut histogram = Histogram::<u64>::new(3).expect("a histogram");
    for (sent, latencies) in results {
        calm.sent += sent;
        calm.ok += latencies.len() as u64;
        for latency in latencies {
            let _ = histogram.record(latency.as_micros() as u64);
        }
    }
    calm.latency = Some(histogram);
    calm
}

/// A UI reader searching the runs `calm_rate` times a second for `duration`.
async fn read_phase(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    args: &FairShareArgs,
    duration: Duration,
) -> Calm {
    let interval = Duration::from_secs_f64(1.0 / args.calm_rate as f64);
    let mut reads = Calm::default();
    let mut histogram = Histogram::<u64>::new(3).expect("a histogram");
    let end = Instant::now() + duration;
    let mut next = Instant::now();
    while next < end {
        tokio::time::sleep_until(next.into()).await;
        next += interval;
        reads.sent += 1;
        let started = Instant::now();
        if send(client, url, READER, body).await == Some(200) {
            reads.ok += 1;
            let _ = histogram.record(started.elapsed().as_micros() as u64);
        }
    }
    reads.latency = Some(histogram);
    reads
}

/// POSTs `body` as `who`; the status, `None` when no answer came.
async fn send(client: &reqwest::Client, url: &str, who: Client<'_>, body: &Value) -> Option<u16> {
    send_read(client, url, who, body)
        .await
        .map(|(status, _)| status)
}

/// As [`send`], with the answer's body.
async fn send_read(
    client: &reqwest::Client,
    url: &str,
    who: Client<'_>,
    body: &Value,
) -> Option<(u16, String)> {
    let response = client
        .post(url)
        .header("x-forwarded-for", who.address)
        .basic_auth(who.user, Some("bench"))
        .json(body)
        .timeout(REQUEST_TIMEOUT)
        .send()
        .await
        .ok()?;
    let status = response.status().as_u16();
    let body = response.text().await.unwrap_or_default();
    Some((status, body))
}

async fn create(
    client: &reqwest::Client,
    mlflow: &str,
    path: &str,
    body: Value,
) -> anyhow::Result<Value> {
    let response = client
        .post(format!("{mlflow}/api/2.0/mlflow/{path}"))
        .json(&body)
        .send()
        .await?;
    anyhow::ensure!(
        response.status().is_success(),
        "{path}: {}",
        response.status()
    );
    Ok(response.json().await?)
}

/// The steps of every sample of `key` MLflow stores for `run`, every page.
async fn stored_steps(
    client: &reqwest::Client,
    mlflow: &str,
    run: &str,
    key: &str,
) -> anyhow::Result<Vec<i64>> {
    let mut steps = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let mut query = vec![
            ("run_id", run.to_owned()),
            ("metric_key", key.to_owned()),
            ("max_results", "25000".to_owned()),
        ];
        if let Some(token) = &token {
            query.push(("page_token", token.clone()));
        }
        let page: Value = client
            .get(format!("{mlflow}/api/2.0/mlflow/metrics/get-history"))
            .query(&query)
            .send()
            .await?
            .json()
            .await?;
        steps.extend(
            page["metrics"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|m| m["step"].as_i64().unwrap_or(-1)),
        );
        match page["next_page_token"].as_str() {
            Some(next) if !next.is_empty() => token = Some(next.to_owned()),
            _ => return Ok(steps),
        }
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
