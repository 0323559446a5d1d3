//! The differential compatibility suite: every operation runs once straight against MLflow and
//! once through a proxy in front of the same MLflow, and both answers must be the same after
//! normalising what legitimately differs: ids, timestamps and each side's name suffix.
//!
//! Each side works on its own experiments, runs and models (names carry the side's suffix, and
//! searches filter on it), so the two sides never see each other's objects; afterwards each side
//! deletes what it created. The test suite runs it against the stack it starts
//! (`tests/it/compat.rs`); `mlscope-compat` runs the same code against any deployment.

use std::collections::BTreeSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use reqwest::header::{HeaderMap, HeaderValue, AUTHORIZATION};
use reqwest::{Client, Method, RequestBuilder};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const API: &str = "/api/2.0/mlflow";
const AJAX: &str = "/ajax-api/2.0/mlflow";
const ARTIFACTS: &str = "/api/2.0/mlflow-artifacts/artifacts";
/// A run id that exists on neither side.
const UNKNOWN_RUN: &str = "0123456789abcdef0123456789abcdef";

/// How both sides authenticate: MLflow's own client variables.
#[derive(Clone, Default)]
pub struct Credentials {
    authorization: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.authorization {
            None => "none",
            Some(h) if h.starts_with("Basic ") => "basic",
            Some(_) => "bearer",
        };
        write!(f, "Credentials({kind})")
    }
}

impl Credentials {
    /// `MLFLOW_TRACKING_USERNAME` and `MLFLOW_TRACKING_PASSWORD` (basic, preferred when both are
    /// set), else `MLFLOW_TRACKING_TOKEN` (bearer), else none: as the MLflow client reads them.
    pub fn from_env() -> Credentials {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let authorization = match (
            var("MLFLOW_TRACKING_USERNAME"),
            var("MLFLOW_TRACKING_PASSWORD"),
            var("MLFLOW_TRACKING_TOKEN"),
        ) {
            (Some(user), Some(password), _) => {
                use base64::Engine as _;
                Some(format!(
                    "Basic {}",
                    base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
                ))
            }
            (_, _, Some(token)) => Some(format!("Bearer {token}")),
            _ => None,
        };
        Credentials { authorization }
    }

    pub fn none() -> Credentials {
        Credentials::default()
    }
}

/// How one operation compared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Both sides answered the same.
    Equal,
    /// The answers differ exactly as the proxy means them to: the reason (every one is listed
    /// in docs/compatibility.md).
    Intentional(&'static str),
    /// The MLflow behind both sides does not have the operation: it was not run.
    Unsupported(String),
    /// One line per differing JSON path, or what failed on which side.
    Different(String),
}

/// What one operation did on both sides.
#[derive(Debug, Clone)]
pub struct OpResult {
    pub name: &'static str,
    pub verdict: Verdict,
}

impl OpResult {
    /// The differences, when the answers differed other than on purpose.
    pub fn difference(&self) -> Option<&str> {
        match &self.verdict {
            Verdict::Different(lines) => Some(lines),
            _ => None,
        }
    }
}

/// Every operation's result, and what cleaning up afterwards could not do.
#[derive(Debug, Clone)]
pub struct Comparison {
    pub results: Vec<OpResult>,
    pub cleanup_problems: Vec<String>,
    /// The suffix of every name each side created (`compat-<what>-<suffix>`): direct, through.
    pub suffixes: [String; 2],
    /// The MLflow version the direct side's `/version` answered, when it did.
    pub mlflow_version: Option<String>,
}

impl Comparison {
    /// The operations whose answers differed other than on purpose.
    pub fn differences(&self) -> impl Iterator<Item = &OpResult> {
        self.results.iter().filter(|r| r.difference().is_some())
    }

    /// How many operations got `verdict`'s kind.
    pub fn count(&self, kind: fn(&Verdict) -> bool) -> usize {
        self.results.iter().filter(|r| kind(&r.verdict)).count()
    }
}

/// Runs every operation on MLflow at `direct` and at `through` (the proxy, or anything in front
/// of the same MLflow), in order, then deletes what each side created. `progress` is called after
/// each operation with its result.
pub async fn compare_deployments(
    direct: &str,
    through: &str,
    credentials: &Credentials,
    mut progress: impl FnMut(&OpResult),
) -> Comparison {
    let direct = Side::new("direct", direct, credentials);
    let proxied = Side::new("proxy", through, credentials);
    let mlflow_version = direct.version().await;
    let release = mlflow_version.as_deref().and_then(Release::parse);
    let mut results = Vec::new();
    for op in operations() {
        let verdict = match (&op.since, release) {
            (Some(since), Some(release)) if release < since.release => Verdict::Unsupported(
                format!("not supported by this MLflow ({}): {}", release, since.what),
            ),
            _ => {
                let expected = direct.observe(&op).await;
                let actual = proxied.observe(&op).await;
                judge(op.name, &expected, &actual)
            }
        };
        let result = OpResult {
            name: op.name,
            verdict,
        };
        progress(&result);
        results.push(result);
    }
    let mut cleanup_problems = direct.clean_up().await;
    cleanup_problems.extend(proxied.clean_up().await);
    Comparison {
        results,
        cleanup_problems,
        suffixes: [direct.suffix.clone(), proxied.suffix.clone()],
        mlflow_version,
    }
}

/// An MLflow release, `major.minor.patch`, ordered as releases are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Release(u32, u32, u32);

impl Release {
    /// `3.17.2`, `3.18.0rc0` (pre-release parts ignored); `None` for anything else.
    fn parse(text: &str) -> Option<Release> {
        let mut parts = text.trim().split('.').map(|part| {
            let digits: String = part.chars().take_while(char::is_ascii_digit).collect();
            digits.parse::<u32>().ok()
        });
        let major = parts.next()??;
        let minor = parts.next()??;
        Some(Release(major, minor, parts.next().flatten().unwrap_or(0)))
    }
}

impl std::fmt::Display for Release {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// The first MLflow release with what an operation needs.
struct Since {
    release: Release,
    what: &'static str,
}

/// The operation's verdict: equal, different on purpose (an entry of [`INTENTIONAL`] explains
/// exactly this difference), or different.
fn judge(name: &str, direct: &Observation, proxied: &Observation) -> Verdict {
    let Some(lines) = compare(direct, proxied) else {
        return Verdict::Equal;
    };
    if let Ok(direct) = direct {
        for intentional in INTENTIONAL.iter().filter(|i| i.operation == name) {
            let corrected = Ok((intentional.correct)(direct.clone()));
            if compare(&corrected, proxied).is_none() {
                return Verdict::Intentional(intentional.reason);
            }
        }
    }
    Verdict::Different(lines)
}

/// A difference the proxy makes on purpose: in `operation`, MLflow's answer (`correct` turns
/// it into the proxy's) has a bug the proxy fixes. Any other difference in the operation still
/// counts. docs/compatibility.md lists each one.
struct Intentional {
    operation: &'static str,
    reason: &'static str,
    correct: fn(Value) -> Value,
}

const INTENTIONAL: &[Intentional] = &[Intentional {
    operation: "mlflow-artifacts delete and list",
    reason: "MLflow before 3.16 lists a zero-byte directory marker (SeaweedFS keeps one where a \
             directory's last file was deleted) as a file named after the directory; the \
             gateway lists only stored files",
    correct: drop_self_listing,
}];

/// In the `[delete, list]` observation of the emptied `data` directory, the listing without a
/// file named `data` (what MLflow before 3.16 makes of the directory's marker). An emptied
/// listing has no `files`, as MLflow answers an empty directory.
fn drop_self_listing(mut observed: Value) -> Value {
    if let Some(body) = observed.pointer_mut("/1/body") {
        if let Some(files) = body.get_mut("files").and_then(Value::as_array_mut) {
            files.retain(|f| !(f["path"] == "data" && f["is_dir"] == false));
            if files.is_empty() {
                body.as_object_mut().map(|b| b.remove("files"));
            }
        }
    }
    observed
}

/// The operation names, in the order they run.
pub fn operation_names() -> Vec<&'static str> {
    operations().iter().map(|op| op.name).collect()
}

// === operations ===

type Observation = Result<Value>;

/// One row of the table: a name and what to do on a side, returning what was observed.
struct Op {
    name: &'static str,
    /// The first MLflow release that has what the operation needs; `None`: every supported one.
    since: Option<Since>,
    run: fn(Side) -> Pin<Box<dyn Future<Output = Observation> + Send>>,
}

/// `op!("name", |side| { ...; Ok(observation) })`, or with `since (3, 0, "what"),` before the
/// closure for an operation MLflow gained in that release.
macro_rules! op {
    ($name:literal, |$side:ident| $body:block) => {
        Op {
            name: $name,
            since: None,
            run: |$side: Side| Box::pin(async move { $body }),
        }
    };
    ($name:literal, since ($major:literal, $minor:literal, $what:literal), |$side:ident| $body:block) => {
        Op {
            name: $name,
            since: Some(Since {
                release: Release($major, $minor, 0),
                what: $what,
            }),
            run: |$side: Side| Box::pin(async move { $body }),
        }
    };
}

/// MLflow's metric values as JSON strings, extreme floats written in a form a re-serialising proxy
/// would change, and int64 steps beyond 2^53 (9007199254740993 is not an f64).
const LOG_BATCH_EXTREMES: &str = r#"{"run_id": "@RUN@",
 "metrics": [
  {"key": "extreme", "value": "NaN", "timestamp": 1700000000001, "step": 9007199254740993},
  {"key": "extreme", "value": "Infinity", "timestamp": 1700000000002, "step": 9223372036854775807},
  {"key": "extreme", "value": "-Infinity", "timestamp": 1700000000003, "step": -9223372036854775808},
  {"key": "extreme", "value": 1.5e300, "timestamp": 1700000000004, "step": 4},
  {"key": "extreme", "value": -0.0, "timestamp": 1700000000005, "step": 5},
  {"key": "extreme", "value": 0.1, "timestamp": 1700000000006, "step": 6}],
 "params": [{"key": "batch_param", "value": "0.001"}],
 "tags": [{"key": "batch.tag", "value": "from log-batch"}]}"#;

/// The query the MLflow UI sends for a run page (`GetRun`), trimmed to the fields a run here has.
const GRAPHQL_GET_RUN: &str = r#"query GetRun($data: MlflowGetRunInput!) @component(name: "MLflow.ExperimentRunTracking") {
  mlflowGetRun(input: $data) {
    apiError { helpUrl code message }
    run {
      info { runName status runUuid experimentId artifactUri endTime lifecycleStage startTime userId }
      experiment { experimentId name tags { key value } artifactLocation lifecycleStage lastUpdateTime }
      modelVersions { status version name source }
      data { metrics { key value step timestamp } params { key value } tags { key value } }
      inputs { modelInputs { modelId } }
      outputs { modelOutputs { modelId step } }
    }
  }
}"#;

fn operations() -> Vec<Op> {
    vec![
        // --- server ---
        op!("GET /health", |s| {
            Ok(s.get("/health", &[]).await?.observed())
        }),
        op!("GET /version", |s| {
            Ok(s.get("/version", &[]).await?.observed())
        }),
        op!("GET /api/3.0/mlflow/server-info", |s| {
            Ok(s.get("/api/3.0/mlflow/server-info", &[]).await?.observed())
        }),
        op!("GET / (UI index)", |s| {
            let index = s.get("/", &[]).await?;
            let script = index
                .text()
                .split('"')
                .find(|part| part.starts_with("static-files/static/js/"))
                .map(str::to_owned)
                .ok_or_else(|| anyhow!("the UI index names no static-files/static/js/ script"))?;
            s.set("ui_script", script);
            Ok(index.observed_bytes())
        }),
        op!("GET /static-files/... (UI script)", |s| {
            Ok(s.get(&format!("/{}", s.var("ui_script")?), &[])
                .await?
                .observed_bytes())
        }),
        // --- experiments ---
        op!("experiments/create", |s| {
            let reply = s
                .post(
                    &format!("{API}/experiments/create"),
                    json!({"name": s.name("exp")}),
                )
                .await?;
            s.set("exp", reply.string_at("/experiment_id")?);
            Ok(reply.observed())
        }),
        op!("experiments/get", |s| {
            Ok(s.get(
                &format!("{API}/experiments/get"),
                &[("experiment_id", &s.var("exp")?)],
            )
            .await?
            .observed())
        }),
        op!("experiments/get-by-name", |s| {
            Ok(s.get(
                &format!("{API}/experiments/get-by-name"),
                &[("experiment_name", &s.name("exp"))],
            )
            .await?
            .observed())
        }),
        op!("experiments/set-experiment-tag", |s| {
            let body = json!({"experiment_id": s.var("exp")?, "key": "team", "value": "mlscope"});
            Ok(
                s.post(&format!("{API}/experiments/set-experiment-tag"), body)
                    .await?
                    .observed(),
            )
        }),
        op!("experiments/update (rename) and get", |s| {
            let exp = s.var("exp")?;
            let body = json!({"experiment_id": exp, "new_name": s.name("exp-renamed")});
            let update = s.post(&format!("{API}/experiments/update"), body).await?;
            let get = s
                .get(
                    &format!("{API}/experiments/get"),
                    &[("experiment_id", &exp)],
                )
                .await?;
            Ok(json!([update.observed(), get.observed()]))
        }),
        op!("experiments/create a second experiment", |s| {
            let reply = s
                .post(
                    &format!("{API}/experiments/create"),
                    json!({"name": s.name("exp-doomed")}),
                )
                .await?;
            s.set("exp2", reply.string_at("/experiment_id")?);
            Ok(reply.observed())
        }),
        op!("experiments/delete and get", |s| {
            let exp = s.var("exp2")?;
            let delete = s
                .post(
                    &format!("{API}/experiments/delete"),
                    json!({"experiment_id": exp}),
                )
                .await?;
            let get = s
                .get(
                    &format!("{API}/experiments/get"),
                    &[("experiment_id", &exp)],
                )
                .await?;
            Ok(json!([delete.observed(), get.observed()]))
        }),
        op!("experiments/search without deleted ones", |s| {
            Ok(s.post(
                &format!("{API}/experiments/search"),
                s.experiment_filter(10),
            )
            .await?
            .observed())
        }),
        op!("experiments/restore and get", |s| {
            let exp = s.var("exp2")?;
            let restore = s
                .post(
                    &format!("{API}/experiments/restore"),
                    json!({"experiment_id": exp}),
                )
                .await?;
            let get = s
                .get(
                    &format!("{API}/experiments/get"),
                    &[("experiment_id", &exp)],
                )
                .await?;
            Ok(json!([restore.observed(), get.observed()]))
        }),
        op!("experiments/search (GET) two pages", |s| {
            let path = format!("{API}/experiments/search");
            let filter = format!("name LIKE '%{}'", s.suffix);
            let query = [
                ("filter", filter.as_str()),
                ("max_results", "1"),
                ("order_by", "name ASC"),
            ];
            let first = s.get(&path, &query).await?;
            let token = first.string_at("/next_page_token")?;
            let second = s
                .get(
                    &path,
                    &[query.as_slice(), &[("page_token", token.as_str())]].concat(),
                )
                .await?;
            Ok(json!([first.observed(), second.observed()]))
        }),
        // --- runs ---
        op!("runs/create", |s| {
            let body = json!({
                "experiment_id": s.var("exp")?, "run_name": "main", "start_time": 1700000000000_i64,
                "tags": [{"key": "phase", "value": "compat"}],
            });
            let reply = s.post(&format!("{API}/runs/create"), body).await?;
            s.set("run", reply.string_at("/run/info/run_id")?);
            Ok(reply.observed())
        }),
        op!("runs/get", |s| { Ok(s.get_run(API).await?.observed()) }),
        op!("runs/update (rename)", |s| {
            let body = json!({"run_id": s.var("run")?, "run_name": "main-renamed"});
            Ok(s.post(&format!("{API}/runs/update"), body)
                .await?
                .observed())
        }),
        op!("runs/set-tag", |s| {
            let body =
                json!({"run_id": s.var("run")?, "key": "doomed.tag", "value": "to be deleted"});
            Ok(s.post(&format!("{API}/runs/set-tag"), body)
                .await?
                .observed())
        }),
        op!("runs/delete-tag", |s| {
            let body = json!({"run_id": s.var("run")?, "key": "doomed.tag"});
            Ok(s.post(&format!("{API}/runs/delete-tag"), body)
                .await?
                .observed())
        }),
        op!("runs/log-parameter", |s| {
            let body = json!({"run_id": s.var("run")?, "key": "learning_rate", "value": "3e-4"});
            Ok(s.post(&format!("{API}/runs/log-parameter"), body)
                .await?
                .observed())
        }),
        op!("runs/log-metric", |s| {
            let run = s.var("run")?;
            let body = json!({
                "run_id": run, "run_uuid": run, "key": "loss", "value": 0.25,
                "timestamp": 1700000000000_i64, "step": 1,
            });
            Ok(s.post(&format!("{API}/runs/log-metric"), body)
                .await?
                .observed())
        }),
        op!("runs/log-metric given only run_uuid", |s| {
            let body = json!({"run_uuid": s.var("run")?, "key": "loss", "value": 0.125, "timestamp": 1700000000001_i64, "step": 2});
            Ok(s.post(&format!("{API}/runs/log-metric"), body)
                .await?
                .observed())
        }),
        op!("runs/log-batch with NaN, ±Infinity and int64 steps", |s| {
            let body = LOG_BATCH_EXTREMES.replace("@RUN@", &s.var("run")?);
            Ok(s.post_raw(&format!("{API}/runs/log-batch"), body)
                .await?
                .observed())
        }),
        op!(
            "metrics/get-history two pages, raw numbers included",
            since(
                3,
                2,
                "paged metric history (max_results, page_token) came in MLflow 3.2"
            ),
            |s| {
                let path = format!("{API}/metrics/get-history");
                let run = s.var("run")?;
                let query = [
                    ("run_id", run.as_str()),
                    ("metric_key", "extreme"),
                    ("max_results", "4"),
                ];
                let first = s.get(&path, &query).await?;
                let token = first.string_at("/next_page_token")?;
                let second = s
                    .get(
                        &path,
                        &[query.as_slice(), &[("page_token", token.as_str())]].concat(),
                    )
                    .await?;
                Ok(json!([
                    first.observed_with_raw_numbers(),
                    second.observed_with_raw_numbers()
                ]))
            }
        ),
        op!("runs/log-batch with 1001 metrics is refused", |s| {
            let metric =
                json!({"key": "too_many", "value": 1.0, "timestamp": 1700000000000_i64, "step": 0});
            let body = json!({"run_id": s.var("run")?, "metrics": vec![metric; 1001]});
            Ok(s.post(&format!("{API}/runs/log-batch"), body)
                .await?
                .observed())
        }),
        op!("runs/log-metric with an invalid key is refused", |s| {
            let body = json!({"run_id": s.var("run")?, "key": "../escape", "value": 1.0, "timestamp": 1700000000000_i64});
            Ok(s.post(&format!("{API}/runs/log-metric"), body)
                .await?
                .observed())
        }),
        op!("runs/create three more runs", |s| {
            let mut replies = Vec::new();
            for (name, start) in [("sibling-b", 2), ("sibling-a", 3), ("sibling-c", 4)] {
                let body =
                    json!({"experiment_id": s.var("exp")?, "run_name": name, "start_time": start});
                let reply = s.post(&format!("{API}/runs/create"), body).await?;
                s.set(name, reply.string_at("/run/info/run_id")?);
                replies.push(reply.observed());
            }
            Ok(Value::Array(replies))
        }),
        op!("runs/delete and get", |s| {
            let run = s.var("sibling-c")?;
            let delete = s
                .post(&format!("{API}/runs/delete"), json!({"run_id": run}))
                .await?;
            let get = s
                .get(&format!("{API}/runs/get"), &[("run_id", &run)])
                .await?;
            Ok(json!([delete.observed(), get.observed()]))
        }),
        op!("runs/search two pages without the deleted run", |s| {
            let path = format!("{API}/runs/search");
            let search = |token: Option<String>| {
                let mut body = json!({
                    "experiment_ids": [s.var("exp")?], "max_results": 2,
                    "order_by": ["attributes.run_name ASC"],
                });
                if let Some(token) = token {
                    body["page_token"] = json!(token);
                }
                Ok::<_, anyhow::Error>(body)
            };
            let first = s.post(&path, search(None)?).await?;
            let token = first.string_at("/next_page_token")?;
            let second = s.post(&path, search(Some(token))?).await?;
            Ok(json!([first.observed(), second.observed()]))
        }),
        op!("runs/restore and get", |s| {
            let run = s.var("sibling-c")?;
            let restore = s
                .post(&format!("{API}/runs/restore"), json!({"run_id": run}))
                .await?;
            let get = s
                .get(&format!("{API}/runs/get"), &[("run_id", &run)])
                .await?;
            Ok(json!([restore.observed(), get.observed()]))
        }),
        op!("runs/search with a filter (deleted runs included)", |s| {
            let body = json!({
                "experiment_ids": [s.var("exp")?], "filter": "attributes.run_name LIKE 'sibling-%'",
                "run_view_type": "ALL", "order_by": ["attributes.run_name DESC"],
            });
            Ok(s.post(&format!("{API}/runs/search"), body)
                .await?
                .observed())
        }),
        // --- artifacts ---
        op!("mlflow-artifacts upload (PUT)", |s| {
            let path = format!("{}/notes/hello.txt", s.run_artifacts()?);
            Ok(s.put(&path, b"hello from the compat suite\n".to_vec())
                .await?
                .observed())
        }),
        op!("mlflow-artifacts upload of 2 MiB (PUT)", |s| {
            let path = format!("{}/data/blob.bin", s.run_artifacts()?);
            Ok(s.put(&path, pattern_bytes(2 << 20)).await?.observed())
        }),
        op!("mlflow-artifacts download (GET)", |s| {
            let path = format!("{}/notes/hello.txt", s.run_artifacts()?);
            Ok(s.get(&path, &[]).await?.observed_bytes())
        }),
        op!("mlflow-artifacts download of 2 MiB (GET)", |s| {
            let path = format!("{}/data/blob.bin", s.run_artifacts()?);
            Ok(s.get(&path, &[]).await?.observed_bytes())
        }),
        op!("mlflow-artifacts list (?path=)", |s| {
            let run_root = format!("{}/{}/artifacts", s.var("exp")?, s.var("run")?);
            let root = s.get(ARTIFACTS, &[("path", &run_root)]).await?;
            let notes = s
                .get(ARTIFACTS, &[("path", &format!("{run_root}/notes"))])
                .await?;
            Ok(json!([root.observed(), notes.observed()]))
        }),
        op!("artifacts/list (tracking API)", |s| {
            let run = s.var("run")?;
            let root = s
                .get(&format!("{API}/artifacts/list"), &[("run_id", &run)])
                .await?;
            let data = s
                .get(
                    &format!("{API}/artifacts/list"),
                    &[("run_id", &run), ("path", "data")],
                )
                .await?;
            Ok(json!([root.observed(), data.observed()]))
        }),
        op!("GET /get-artifact (UI download)", |s| {
            let run = s.var("run")?;
            let query = [("run_uuid", run.as_str()), ("path", "notes/hello.txt")];
            Ok(s.get("/get-artifact", &query).await?.observed_bytes())
        }),
        op!("mlflow-artifacts delete and list", |s| {
            let run_root = format!("{}/{}/artifacts", s.var("exp")?, s.var("run")?);
            let delete = s
                .request(
                    Method::DELETE,
                    &format!("{ARTIFACTS}/{run_root}/data/blob.bin"),
                )
                .await?;
            let list = s
                .get(ARTIFACTS, &[("path", &format!("{run_root}/data"))])
                .await?;
            Ok(json!([delete.observed(), list.observed()]))
        }),
        op!("mlflow-artifacts with a .. path is refused", |s| {
            // Encoded twice: the URL parser would resolve a plain `%2e%2e` segment before sending.
            let download = s
                .get(&format!("{ARTIFACTS}/%252e%252e/etc/passwd"), &[])
                .await?;
            let list = s.get(ARTIFACTS, &[("path", "../secrets")]).await?;
            let upload = s
                .put(&format!("{ARTIFACTS}/a/..%2fescape.txt"), b"nope".to_vec())
                .await?;
            Ok(json!([
                download.observed(),
                list.observed(),
                upload.observed()
            ]))
        }),
        // --- logged models ---
        op!(
            "logged-models create",
            since(3, 0, "logged models came in MLflow 3.0"),
            |s| {
                let body = json!({
                    "experiment_id": s.var("exp")?, "name": "compat-model", "source_run_id": s.var("run")?,
                    "model_type": "agent", "params": [{"key": "depth", "value": "3"}],
                    "tags": [{"key": "stage", "value": "draft"}],
                });
                let reply = s.post(&format!("{API}/logged-models"), body).await?;
                s.set("model", reply.string_at("/model/info/model_id")?);
                Ok(reply.observed())
            }
        ),
        op!(
            "logged-models finalize and get",
            since(3, 0, "logged models came in MLflow 3.0"),
            |s| {
                let model = s.var("model")?;
                let path = format!("{API}/logged-models/{model}");
                let body = json!({"model_id": model, "status": "LOGGED_MODEL_READY"});
                let finalize = s.send(Method::PATCH, &path, |r| r.json(&body)).await?;
                let get = s.get(&path, &[]).await?;
                Ok(json!([finalize.observed(), get.observed()]))
            }
        ),
        op!(
            "logged-models search",
            since(3, 0, "logged models came in MLflow 3.0"),
            |s| {
                let body = json!({"experiment_ids": [s.var("exp")?], "max_results": 10});
                Ok(s.post(&format!("{API}/logged-models/search"), body)
                    .await?
                    .observed())
            }
        ),
        // --- model registry ---
        op!("registered-models/create", |s| {
            let body = json!({"name": s.name("model"), "tags": [{"key": "owner", "value": "compat"}], "description": "compat suite"});
            Ok(s.post(&format!("{API}/registered-models/create"), body)
                .await?
                .observed())
        }),
        op!("registered-models/get", |s| {
            Ok(s.get(
                &format!("{API}/registered-models/get"),
                &[("name", &s.name("model"))],
            )
            .await?
            .observed())
        }),
        op!("model-versions/create and get", |s| {
            let body = json!({
                "name": s.name("model"), "run_id": s.var("run")?,
                "source": format!("mlflow-artifacts:/{}/{}/artifacts/model", s.var("exp")?, s.var("run")?),
            });
            let create = s
                .post(&format!("{API}/model-versions/create"), body)
                .await?;
            let get = s
                .get(
                    &format!("{API}/model-versions/get"),
                    &[("name", &s.name("model")), ("version", "1")],
                )
                .await?;
            Ok(json!([create.observed(), get.observed()]))
        }),
        op!("registered-models/rename", |s| {
            let body = json!({"name": s.name("model"), "new_name": s.name("model-renamed")});
            Ok(s.post(&format!("{API}/registered-models/rename"), body)
                .await?
                .observed())
        }),
        op!("registered-models/search", |s| {
            let filter = format!("name LIKE '%{}'", s.suffix);
            Ok(s.get(
                &format!("{API}/registered-models/search"),
                &[("filter", &filter)],
            )
            .await?
            .observed())
        }),
        op!("registered-models/delete and get", |s| {
            let name = s.name("model-renamed");
            let delete = s
                .send(
                    Method::DELETE,
                    &format!("{API}/registered-models/delete"),
                    |r| r.json(&json!({"name": name})),
                )
                .await?;
            let get = s
                .get(&format!("{API}/registered-models/get"), &[("name", &name)])
                .await?;
            Ok(json!([delete.observed(), get.observed()]))
        }),
        // --- what the UI calls ---
        op!("POST /graphql (the UI's GetRun)", |s| {
            let body = json!({"operationName": "GetRun", "query": GRAPHQL_GET_RUN, "variables": {"data": {"runId": s.var("run")?}}});
            Ok(s.post("/graphql", body).await?.observed())
        }),
        op!("ajax-api runs/get", |s| {
            Ok(s.get_run(AJAX).await?.observed())
        }),
        op!("ajax-api experiments/search", |s| {
            Ok(s.post(
                &format!("{AJAX}/experiments/search"),
                s.experiment_filter(10),
            )
            .await?
            .observed())
        }),
        op!("ajax-api metrics/get-history", |s| {
            let run = s.var("run")?;
            let query = [("run_id", run.as_str()), ("metric_key", "loss")];
            Ok(s.get(&format!("{AJAX}/metrics/get-history"), &query)
                .await?
                .observed_with_raw_numbers())
        }),
        // --- errors ---
        op!("runs/get of an unknown run", |s| {
            Ok(
                s.get(&format!("{API}/runs/get"), &[("run_id", UNKNOWN_RUN)])
                    .await?
                    .observed(),
            )
        }),
        op!("experiments/get of an unknown experiment", |s| {
            Ok(s.get(
                &format!("{API}/experiments/get"),
                &[("experiment_id", "987654321")],
            )
            .await?
            .observed())
        }),
        op!("runs/log-metric to an unknown run", |s| {
            let body = json!({"run_id": UNKNOWN_RUN, "key": "loss", "value": 1.0, "timestamp": 1700000000000_i64});
            Ok(s.post(&format!("{API}/runs/log-metric"), body)
                .await?
                .observed())
        }),
        op!("malformed JSON", |s| {
            Ok(
                s.post_raw(&format!("{API}/experiments/create"), "{not json".to_owned())
                    .await?
                    .observed(),
            )
        }),
        op!("POST without a JSON content type", |s| {
            let body = json!({"name": s.name("never")}).to_string();
            Ok(
                s.send(Method::POST, &format!("{API}/experiments/create"), |r| {
                    r.body(body)
                })
                .await?
                .observed(),
            )
        }),
        op!("unknown endpoint", |s| {
            Ok(s.get(&format!("{API}/does-not-exist"), &[])
                .await?
                .observed())
        }),
        // --- final state ---
        op!("runs/update to FINISHED and the run's final state", |s| {
            let body = json!({"run_id": s.var("run")?, "status": "FINISHED", "end_time": 1700000009999_i64});
            let update = s.post(&format!("{API}/runs/update"), body).await?;
            Ok(json!([
                update.observed(),
                s.get_run(API).await?.observed_with_raw_numbers()
            ]))
        }),
    ]
}

// === impl Side ===

/// One side of the comparison: a base URL, the side's name suffix, what its operations learned
/// (ids to use in later operations) and the ids seen so far, in order of first appearance.
#[derive(Clone)]
struct Side {
    label: &'static str,
    base: String,
    suffix: String,
    client: Client,
    vars: Arc<Mutex<Vec<(String, String)>>>,
    ids: Arc<Mutex<Vec<String>>>,
}

impl Side {
    fn new(label: &'static str, base: &str, credentials: &Credentials) -> Side {
        let mut headers = HeaderMap::new();
        if let Some(value) = credentials
            .authorization
            .as_deref()
            .and_then(|v| HeaderValue::from_str(v).ok())
        {
            let mut value = value;
            value.set_sensitive(true);
            headers.insert(AUTHORIZATION, value);
        }
        let client = Client::builder()
            .timeout(Duration::from_secs(60))
            .default_headers(headers)
            .no_proxy()
            .build()
            .expect("building the HTTP client");
        Side {
            label,
            base: base.trim_end_matches('/').to_owned(),
            suffix: uuid::Uuid::new_v4().simple().to_string()[..12].to_owned(),
            client,
            vars: Arc::default(),
            ids: Arc::default(),
        }
    }

    /// A name unique to this side.
    fn name(&self, what: &str) -> String {
        format!("compat-{what}-{}", self.suffix)
    }

    fn set(&self, key: &str, value: String) {
        let mut vars = self.vars.lock().unwrap();
        vars.retain(|(k, _)| k != key);
        vars.push((key.to_owned(), value));
    }

    fn var(&self, key: &str) -> Result<String> {
        let vars = self.vars.lock().unwrap();
        let found = vars.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone());
        found.ok_or_else(|| anyhow!("no {key:?} yet: an earlier operation that creates it failed"))
    }

    /// The artifact proxy path of the main run's artifact root.
    fn run_artifacts(&self) -> Result<String> {
        Ok(format!(
            "{ARTIFACTS}/{}/{}/artifacts",
            self.var("exp")?,
            self.var("run")?
        ))
    }

    /// An experiments/search body that finds only this side's experiments.
    fn experiment_filter(&self, max_results: u32) -> Value {
        json!({"filter": format!("name LIKE '%{}'", self.suffix), "max_results": max_results, "order_by": ["name ASC"]})
    }

    async fn get_run(&self, prefix: &str) -> Result<Reply> {
        self.get(
            &format!("{prefix}/runs/get"),
            &[("run_id", &self.var("run")?)],
        )
        .await
    }

    async fn get(&self, path: &str, query: &[(&str, &str)]) -> Result<Reply> {
        self.send(Method::GET, path, |r| r.query(query)).await
    }

    async fn post(&self, path: &str, body: Value) -> Result<Reply> {
        self.send(Method::POST, path, |r| r.json(&body)).await
    }

    /// POSTs `body` byte for byte as JSON, for bodies that serde_json could not produce.
    async fn post_raw(&self, path: &str, body: String) -> Result<Reply> {
        self.send(Method::POST, path, |r| {
            r.header("content-type", "application/json").body(body)
        })
        .await
    }

    async fn put(&self, path: &str, body: Vec<u8>) -> Result<Reply> {
        self.send(Method::PUT, path, |r| r.body(body)).await
    }

    async fn request(&self, method: Method, path: &str) -> Result<Reply> {
        self.send(method, path, |r| r).await
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        build: impl FnOnce(RequestBuilder) -> RequestBuilder,
    ) -> Result<Reply> {
        let request = build(
            self.client
                .request(method.clone(), format!("{}{path}", self.base)),
        );
        let response = request
            .send()
            .await
            .with_context(|| format!("{method} {path} on the {} side", self.label))?;
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let content_type = header("content-type");
        let disposition = header("content-disposition");
        let status = response.status().as_u16();
        let body = response
            .bytes()
            .await
            .with_context(|| format!("reading {method} {path}"))?
            .to_vec();
        Ok(Reply {
            status,
            content_type,
            disposition,
            body,
        })
    }

    /// Deletes what this side created: the artifacts of its experiments' runs (where the server
    /// serves artifacts) and its experiments (MLflow's delete, which keeps them restorable until
    /// `mlflow gc`). Returns what could not be done.
    async fn clean_up(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let mut experiments = Vec::new();
        for view_type in ["ACTIVE_ONLY", "DELETED_ONLY"] {
            let body = json!({"filter": format!("name LIKE '%{}'", self.suffix), "max_results": 100, "view_type": view_type});
            match self.post(&format!("{API}/experiments/search"), body).await {
                Ok(reply) if reply.status == 200 => {
                    for experiment in reply.json()["experiments"].as_array().into_iter().flatten() {
                        if let Some(id) = experiment["experiment_id"].as_str() {
                            experiments.push((id.to_owned(), view_type == "ACTIVE_ONLY"));
                        }
                    }
                }
                Ok(reply) => problems.push(format!(
                    "{}: experiments/search answered {}",
                    self.label, reply.status
                )),
                Err(e) => problems.push(format!("{}: {e:#}", self.label)),
            }
        }
        for (experiment, active) in experiments {
            let runs = self
                .post(
                    &format!("{API}/runs/search"),
                    json!({"experiment_ids": [experiment], "max_results": 1000, "run_view_type": "ALL"}),
                )
                .await;
            let runs = match runs {
                Ok(reply) if reply.status == 200 => reply.json()["runs"].clone(),
                _ => Value::Null,
            };
            for run in runs.as_array().into_iter().flatten() {
                if let Some(run_id) = run["info"]["run_id"].as_str() {
                    // 404 or 501 where nothing was stored or the server does not serve artifacts.
                    let _ = self
                        .request(
                            Method::DELETE,
                            &format!("{ARTIFACTS}/{experiment}/{run_id}/artifacts"),
                        )
                        .await;
                }
            }
            if active {
                match self
                    .post(
                        &format!("{API}/experiments/delete"),
                        json!({"experiment_id": experiment}),
                    )
                    .await
                {
                    Ok(reply) if reply.status == 200 => {}
                    Ok(reply) => problems.push(format!(
                        "{}: deleting experiment {experiment} answered {}",
                        self.label, reply.status
                    )),
                    Err(e) => problems.push(format!("{}: {e:#}", self.label)),
                }
            }
        }
        problems
    }

    /// What `/version` answers, trimmed; `None` when it does not answer 200.
    async fn version(&self) -> Option<String> {
        let reply = self.get("/version", &[]).await.ok()?;
        (reply.status == 200).then(|| reply.text().trim().to_owned())
    }

    /// Runs `op` and normalises what it observed.
    async fn observe(&self, op: &Op) -> Observation {
        let observed = (op.run)(self.clone()).await?;
        let mut ids = self.ids.lock().unwrap();
        collect_ids(&observed, &mut ids);
        Ok(normalise(observed, None, &self.suffix, &ids))
    }
}

// === impl Reply ===

struct Reply {
    status: u16,
    content_type: Option<String>,
    disposition: Option<String>,
    body: Vec<u8>,
}

impl Reply {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body as JSON, or as a string when it is not JSON (HTML error pages, `OK`).
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|_| Value::String(self.text()))
    }

    fn string_at(&self, pointer: &str) -> Result<String> {
        self.json()
            .pointer(pointer)
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| {
                anyhow!(
                    "no string at {pointer} in the answer ({}): {}",
                    self.status,
                    self.text()
                )
            })
    }

    /// Status, content type and JSON body.
    fn observed(&self) -> Value {
        json!({"status": self.status, "content_type": self.content_type, "body": self.json()})
    }

    /// As [`Reply::observed`], plus the text of every number after `"value":` and `"step":` as
    /// sent, which parsing would hide (`1.5e+300` and `1.5e300` parse alike; 2^53 + 1 as f64
    /// does not survive at all).
    fn observed_with_raw_numbers(&self) -> Value {
        let mut observed = self.observed();
        let text = self.text();
        let raw: Vec<String> = ["\"value\":", "\"step\":"]
            .iter()
            .flat_map(|field| {
                text.match_indices(field)
                    .map(|(at, field)| (at, at + field.len()))
            })
            .map(|(_, end)| raw_token(text[end..].trim_start()).to_owned())
            .collect();
        observed["raw_numbers"] = json!(raw);
        observed
    }

    /// Status, content headers, size and SHA-256 of the body (UI files, artifacts).
    fn observed_bytes(&self) -> Value {
        json!({
            "status": self.status,
            "content_type": self.content_type,
            "content_disposition": self.disposition,
            "size": self.body.len(),
            "sha256": hex(&Sha256::digest(&self.body)),
        })
    }
}

// === normalisation and comparison ===

/// Keys whose string values are ids: `experiment_id`, `run_uuid`, `model_id`, GraphQL's
/// `runUuid`, `experimentId`...
fn is_id_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase().replace('_', "");
    key.ends_with("id") || key.ends_with("uuid")
}

fn is_time_key(key: &str) -> bool {
    key.to_ascii_lowercase().contains("time")
}

fn collect_ids(value: &Value, ids: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, value) in map {
                if let Value::String(id) = value {
                    if is_id_key(key) && !id.is_empty() && !ids.contains(id) {
                        ids.push(id.clone());
                    }
                }
                collect_ids(value, ids);
            }
        }
        Value::Array(values) => values.iter().for_each(|value| collect_ids(value, ids)),
        _ => {}
    }
}

/// Replaces ids by `<id N>` (N in order of first appearance), the side's suffix by `<suffix>`,
/// and zeroes times.
fn normalise(value: Value, key: Option<&str>, suffix: &str, ids: &[String]) -> Value {
    let is_time = key.is_some_and(is_time_key);
    match value {
        Value::Number(_) if is_time => json!(0),
        Value::String(text) if is_time && text.parse::<i64>().is_ok() => json!("0"),
        Value::String(text) => Value::String(normalise_text(
            &text,
            key.is_some_and(is_id_key),
            suffix,
            ids,
        )),
        Value::Array(values) => values
            .into_iter()
            .map(|v| normalise(v, key, suffix, ids))
            .collect(),
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| {
                    let v = normalise(v, Some(&k), suffix, ids);
                    (k, v)
                })
                .collect(),
        ),
        other => other,
    }
}

/// Long ids (run and model ids) are replaced anywhere in a string. Short ones (experiment ids
/// such as `7`) could as well be a parameter's value, so they are replaced only in an id field
/// or as a segment of a path or URI.
fn normalise_text(text: &str, is_id_field: bool, suffix: &str, ids: &[String]) -> String {
    const LONG_ID: usize = 8;
    let placeholder = |n: usize| format!("<id {}>", n + 1);
    let short_id = |segment: &str| ids.iter().position(|id| id == segment).map(placeholder);
    if is_id_field {
        if let Some(replaced) = short_id(text) {
            return replaced;
        }
    }
    let mut text = text.replace(suffix, "<suffix>");
    for (n, id) in ids.iter().enumerate().filter(|(_, id)| id.len() >= LONG_ID) {
        text = text.replace(id.as_str(), &placeholder(n));
    }
    if !text.contains('/') {
        return text;
    }
    text.split('/')
        .map(|segment| short_id(segment).unwrap_or_else(|| segment.to_owned()))
        .collect::<Vec<_>>()
        .join("/")
}

/// `None` when both sides observed the same; else a line per differing JSON path.
fn compare(direct: &Observation, proxied: &Observation) -> Option<String> {
    match (direct, proxied) {
        (Ok(direct), Ok(proxied)) => {
            let mut lines = Vec::new();
            differences("", direct, proxied, &mut lines);
            (!lines.is_empty()).then(|| lines.join("\n"))
        }
        (direct, proxied) => {
            let describe = |side: &Observation| match side {
                Ok(value) => format!("ok: {}", brief(value)),
                Err(error) => format!("FAILED: {error:#}"),
            };
            Some(format!(
                "  direct: {}\n  proxy:  {}",
                describe(direct),
                describe(proxied)
            ))
        }
    }
}

fn differences(path: &str, direct: &Value, proxied: &Value, lines: &mut Vec<String>) {
    match (direct, proxied) {
        (Value::Object(a), Value::Object(b)) => {
            let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for key in keys {
                let path = format!("{path}/{key}");
                match (a.get(key), b.get(key)) {
                    (Some(x), Some(y)) => differences(&path, x, y, lines),
                    (x, y) => lines.push(format!(
                        "  {path}: direct {} | proxy {}",
                        present(x),
                        present(y)
                    )),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                differences(&format!("{path}/{i}"), x, y, lines);
            }
        }
        (a, b) if a != b => lines.push(format!(
            "  {}: direct {} | proxy {}",
            if path.is_empty() { "/" } else { path },
            brief(a),
            brief(b)
        )),
        _ => {}
    }
}

fn present(value: Option<&Value>) -> String {
    value.map_or_else(|| "(absent)".to_owned(), brief)
}

/// Compact JSON, cut to a readable length.
fn brief(value: &Value) -> String {
    const MAX: usize = 400;
    let text = value.to_string();
    match text.char_indices().nth(MAX) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text,
    }
}

/// The JSON token at the start of `text`: a string with its quotes, or a bare number or literal.
fn raw_token(text: &str) -> &str {
    let end = match text.strip_prefix('"') {
        Some(rest) => rest.find('"').map_or(text.len(), |at| at + 2),
        None => text.find([',', '}', ']', ' ', '\n']).unwrap_or(text.len()),
    };
    &text[..end]
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Deterministic, incompressible bytes: both sides must upload the same content.
fn pattern_bytes(len: usize) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(len + 32);
    let mut block = Sha256::digest(b"mlscope compat");
    while bytes.len() < len {
        bytes.extend_from_slice(&block);
        block = Sha256::digest(block);
    }
    bytes.truncate(len);
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    const DELETE_AND_LIST: &str = "mlflow-artifacts delete and list";

    fn delete_and_list(files: Value) -> Observation {
        let mut list = json!({"status": 200, "content_type": "application/json", "body": {}});
        if !files.is_null() {
            list["body"]["files"] = files;
        }
        Ok(json!([{"status": 200, "content_type": "application/json", "body": {}}, list]))
    }

    #[test]
    fn the_phantom_marker_entry_is_an_intended_difference_and_nothing_else_is() {
        let phantom = delete_and_list(json!([{"path": "data", "is_dir": false}]));
        let gateway = delete_and_list(Value::Null);
        assert!(matches!(
            judge(DELETE_AND_LIST, &phantom, &gateway),
            Verdict::Intentional(_)
        ));
        assert_eq!(judge(DELETE_AND_LIST, &gateway, &gateway), Verdict::Equal);
        // The same correction in another operation is a difference.
        assert!(matches!(
            judge("mlflow-artifacts list (?path=)", &phantom, &gateway),
            Verdict::Different(_)
        ));
        // A real file the gateway leaves out, or the phantom plus anything else, is a difference.
        let real =
            delete_and_list(json!([{"path": "data/other.bin", "is_dir": false, "file_size": 3}]));
        assert!(matches!(
            judge(DELETE_AND_LIST, &real, &gateway),
            Verdict::Different(_)
        ));
        let both = delete_and_list(
            json!([{"path": "data", "is_dir": false}, {"path": "data/x", "is_dir": false}]),
        );
        assert!(matches!(
            judge(DELETE_AND_LIST, &both, &gateway),
            Verdict::Different(_)
        ));
        let mut other_status = gateway.as_ref().unwrap().clone();
        other_status[0]["status"] = json!(500);
        assert!(matches!(
            judge(DELETE_AND_LIST, &phantom, &Ok(other_status)),
            Verdict::Different(_)
        ));
        // The gateway showing a phantom MLflow does not have is a difference too.
        assert!(matches!(
            judge(DELETE_AND_LIST, &gateway, &phantom),
            Verdict::Different(_)
        ));
    }

    #[test]
    fn releases_parse_and_order() {
        assert_eq!(Release::parse("2.22.5\n"), Some(Release(2, 22, 5)));
        assert_eq!(Release::parse("3.18.0rc0"), Some(Release(3, 18, 0)));
        assert!(Release(2, 22, 5) < Release(3, 0, 0));
        assert!(Release(3, 10, 1) > Release(3, 2, 0));
        assert_eq!(Release::parse("<html>"), None);
    }
}
