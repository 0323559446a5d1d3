//! Authorization parity: MLflow (3.17.2, and 3.15.2 whose rules differ) with its basic-auth app,
//! and the artifact gateway in front of it serving the same bucket. Every artifact operation is sent by every kind of client
//! directly to MLflow and through the gateway; the gateway must allow and deny exactly what
//! MLflow allows and denies, with MLflow's own 401 and 403.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use mlscope_tests::{
    legacy_venv, spawn_proxy, venv, DirRemover, MlflowServer, ProxyProcess, S3Store,
    MLFLOW_ADMIN_PASSWORD,
};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

use crate::mlflow::{http, now_ms};

struct AuthStack {
    _dir: tempfile::TempDir,
    /// The stack lives in a static, never dropped: this removes its directory when the test
    /// process exits.
    _remover: DirRemover,
    _s3: S3Store,
    mlflow: MlflowServer,
    proxy: ProxyProcess,
}

/// A client: a user name and password, or nobody.
#[derive(Clone, Copy, Debug)]
struct Client {
    name: &'static str,
    password: Option<&'static str>,
}

const ADMIN: Client = Client {
    name: "admin",
    password: Some(MLFLOW_ADMIN_PASSWORD),
};
/// Users created by the test, with the grant each holds on the test experiment (or run).
const USERS: [(&str, &str); 5] = [
    ("manager", "MANAGE"),
    ("editor", "EDIT"),
    ("reader", "READ"),
    ("stranger", ""),
    ("run-editor", "run:EDIT"),
];
const PASSWORD: &str = "a-Long-enough-passw0rd";

/// The MLflow versions the gateway's authorization is verified against.
#[derive(Clone, Copy, Debug)]
enum Version {
    /// 3.17.2: artifact paths judged per tier (run, logged model, trace), HEAD refused.
    Current,
    /// 3.15.2: artifact paths judged on the experiment alone.
    Legacy,
    /// 3.17.2 with workspaces on (`--enable-workspaces`): grants per workspace.
    Workspaces,
}

fn stack(version: Version) -> &'static AuthStack {
    static CURRENT: OnceLock<Result<AuthStack, String>> = OnceLock::new();
    static LEGACY: OnceLock<Result<AuthStack, String>> = OnceLock::new();
    static WORKSPACES: OnceLock<Result<AuthStack, String>> = OnceLock::new();
    let (cell, mlflow_venv, mlflow_args) = match version {
        Version::Current => (&CURRENT, venv(), vec![]),
        Version::Legacy => (&LEGACY, legacy_venv(), vec![]),
        Version::Workspaces => (&WORKSPACES, venv(), vec!["--enable-workspaces".to_owned()]),
    };
    let stack = cell.get_or_init(|| {
        let start = || -> anyhow::Result<AuthStack> {
            let dir = tempfile::Builder::new()
                .prefix("mlscope-authz-")
                .tempdir()?;
            let remover = DirRemover::spawn(dir.path())?;
            let s3 = S3Store::start(dir.path())?;
            let mlflow = MlflowServer::start_with_basic_auth_args(
                &mlflow_venv,
                dir.path(),
                &s3,
                &mlflow_args,
            )?;
            let args = s3.gateway_args(&s3.url);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let proxy = spawn_proxy(&mlflow.url, &args, dir.path())?;
            Ok(AuthStack {
                _dir: dir,
                _remover: remover,
                _s3: s3,
                mlflow,
                proxy,
            })
        };
        start().map_err(|e| format!("{e:#}"))
    });
    match stack {
        Ok(stack) => stack,
        Err(error) => panic!("the basic-auth stack ({version:?}) did not start: {error}"),
    }
}

fn request(client: Client, method: Method, url: String) -> reqwest::RequestBuilder {
    let request = http().request(method, url);
    match client.password {
        Some(password) => request.basic_auth(client.name, Some(password)),
        None => request,
    }
}

/// An admin call to MLflow's REST API that must succeed.
async fn admin_call(base: &str, method: Method, path: &str, body: Value) -> Value {
    let response = request(ADMIN, method, format!("{base}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = response.status();
    let text = response.text().await.unwrap();
    assert!(status.is_success(), "{path}: {status} {text}");
    serde_json::from_str(&text).unwrap_or(Value::Null)
}

/// Users, an experiment with a run, the grants, and the files the operations read and delete.
/// Returns `(experiment_id, run artifact root)`.
async fn setup(mlflow: &str) -> (String, String) {
    let experiment = admin_call(
        mlflow,
        Method::POST,
        "/api/2.0/mlflow/experiments/create",
        json!({ "name": format!("authz-{}", uuid::Uuid::new_v4().simple()) }),
    )
    .await;
    let experiment = experiment["experiment_id"].as_str().unwrap().to_owned();
    let run = admin_call(
        mlflow,
        Method::POST,
        "/api/2.0/mlflow/runs/create",
        json!({ "experiment_id": experiment, "start_time": now_ms() }),
    )
    .await;
    let run_id = run["run"]["info"]["run_id"].as_str().unwrap().to_owned();
    for (user, grant) in USERS {
        let created = request(
            ADMIN,
            Method::POST,
            format!("{mlflow}/api/2.0/mlflow/users/create"),
        )
        .json(&json!({ "username": user, "password": PASSWORD }))
        .send()
        .await
        .unwrap();
        assert!(
            created.status().is_success() || created.status() == StatusCode::BAD_REQUEST,
            "creating {user}: {}",
            created.status()
        );
        // MLflow 3.17 takes run grants only as wildcards ("every run"), on top of a READ of the
        // experiment that holds the run.
        let grants: Vec<(&str, &str, &str)> = match grant.split_once(':') {
            Some((_, permission)) => vec![
                ("experiment", experiment.as_str(), "READ"),
                ("run", "*", permission),
            ],
            None if grant.is_empty() => vec![],
            None => vec![("experiment", experiment.as_str(), grant)],
        };
        for (resource_type, resource_id, permission) in grants {
            let granted = request(ADMIN, Method::POST, format!("{mlflow}/api/3.0/mlflow/users/permissions/grant"))
                .json(&json!({ "username": user, "resource_type": resource_type, "resource_id": resource_id, "permission": permission }))
                .send()
                .await
                .unwrap();
            let status = granted.status();
            let body = granted.text().await.unwrap();
            // The tests share the users; a wildcard run grant exists after the first. MLflow
            // before 3.17 has no run tier: that user keeps READ on the experiment alone.
            let no_run_tier = resource_type == "run"
                && status == StatusCode::BAD_REQUEST
                && !body.contains("RESOURCE_ALREADY_EXISTS");
            if no_run_tier {
                eprintln!("this MLflow takes no run grants ({body}); run-editor reads only");
            }
            assert!(
                status.is_success() || body.contains("RESOURCE_ALREADY_EXISTS") || no_run_tier,
                "granting {user} {permission}: {status} {body}"
            );
        }
    }
    let root = format!("{experiment}/{run_id}/artifacts");
    (experiment, root)
}

/// One artifact operation: what it sends, for a client, to a base URL.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Op {
    Get,
    Head,
    List,
    Presigned,
    Put,
    MpuCreate,
    MpuAbort,
    Delete,
}

const OPS: [Op; 8] = [
    Op::Get,
    Op::Head,
    Op::List,
    Op::Presigned,
    Op::Put,
    Op::MpuCreate,
    Op::MpuAbort,
    Op::Delete,
];

/// How a cell compares: 401 and 403 with MLflow's headers and body, or "allowed" (any other
/// status: the operation reached the handler).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Answer {
    Allowed,
    Refused {
        status: u16,
        www_authenticate: Option<String>,
        body: String,
    },
}

/// Sends `op` for `client` on the run artifact root `root`, in `workspace` (the
/// `X-MLFLOW-WORKSPACE` header; none: the default workspace).
async fn send(base: &str, root: &str, op: Op, client: Client, workspace: Option<&str>) -> Answer {
    let api = format!("{base}/api/2.0/mlflow-artifacts");
    let file = format!("{root}/shared/readme.txt");
    let builder = match op {
        Op::Get => request(client, Method::GET, format!("{api}/artifacts/{file}")),
        Op::Head => request(client, Method::HEAD, format!("{api}/artifacts/{file}")),
        Op::List => request(client, Method::GET, format!("{api}/artifacts"))
            .query(&[("path", format!("{root}/shared"))]),
        Op::Presigned => request(client, Method::GET, format!("{api}/presigned/{file}")),
        Op::Put => request(
            client,
            Method::PUT,
            format!("{api}/artifacts/{root}/uploads/{}.txt", client.name),
        )
        .body("uploaded"),
        Op::MpuCreate => request(
            client,
            Method::POST,
            format!("{api}/mpu/create/{root}/uploads"),
        )
        .json(&json!({ "path": format!("{}.bin", client.name), "num_parts": 1 })),
        Op::MpuAbort => request(
            client,
            Method::POST,
            format!("{api}/mpu/abort/{root}/uploads"),
        )
        .json(
            &json!({ "path": format!("{}.bin", client.name), "upload_id": "bm90LWFuLXVwbG9hZA" }),
        ),
        Op::Delete => request(
            client,
            Method::DELETE,
            format!("{api}/artifacts/{root}/victims/{}.txt", client.name),
        ),
    };
    let builder = match workspace {
        Some(name) => builder.header("x-mlflow-workspace", name),
        None => builder,
    };
    let response = builder.send().await.unwrap();
    let status = response.status();
    if status != StatusCode::UNAUTHORIZED && status != StatusCode::FORBIDDEN {
        return Answer::Allowed;
    }
    let www_authenticate = response
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap().to_owned());
    Answer::Refused {
        status: status.as_u16(),
        www_authenticate,
        body: response.text().await.unwrap(),
    }
}

fn clients() -> Vec<Client> {
    clients_of("manager", USERS.iter().map(|(name, _)| *name))
}

/// MLflow's admin, an anonymous client, `wrong_password_user` with a wrong password, and
/// `users` with the test's password.
fn clients_of(
    wrong_password_user: &'static str,
    users: impl Iterator<Item = &'static str>,
) -> Vec<Client> {
    let mut clients = vec![
        ADMIN,
        Client {
            name: "anonymous",
            password: None,
        },
        Client {
            name: wrong_password_user,
            password: Some("wrong-password"),
        },
    ];
    clients.extend(users.map(|name| Client {
        name,
        password: Some(PASSWORD),
    }));
    clients
}

/// Puts the files the read and delete operations name (as admin, straight into MLflow).
async fn restore_files(mlflow: &str, root: &str, workspace: Option<&str>) {
    let mut paths = vec![format!("{root}/shared/readme.txt")];
    paths.extend(
        clients()
            .iter()
            .chain(&workspace_clients())
            .map(|c| format!("{root}/victims/{}.txt", c.name)),
    );
    for path in paths {
        let mut put = request(
            ADMIN,
            Method::PUT,
            format!("{mlflow}/api/2.0/mlflow-artifacts/artifacts/{path}"),
        )
        .body("content");
        if let Some(name) = workspace {
            put = put.header("x-mlflow-workspace", name);
        }
        let response = put.send().await.unwrap();
        assert!(
            response.status().is_success(),
            "restoring {path}: {}",
            response.status()
        );
    }
}

/// Fails with every cell whose answer through the gateway differs from MLflow's, except those
/// `excused` (the cell and the gateway's answer).
fn assert_cells_agree<K: Ord + std::fmt::Debug>(
    direct: &BTreeMap<K, Answer>,
    through: &BTreeMap<K, Answer>,
    excused: impl Fn(&K, Option<&Answer>) -> bool,
) {
    let differences: Vec<String> = direct
        .iter()
        .filter(|(cell, answer)| {
            through.get(*cell) != Some(answer) && !excused(cell, through.get(*cell))
        })
        .map(|(cell, answer)| {
            format!(
                "{cell:?}: MLflow {answer:?}, gateway {:?}",
                through.get(cell)
            )
        })
        .collect();
    assert!(
        differences.is_empty(),
        "{} of {} cells differ:\n{}",
        differences.len(),
        direct.len(),
        differences.join("\n")
    );
}

/// How many cells MLflow allowed, and refused with 401 and with 403.
fn tally<K>(direct: &BTreeMap<K, Answer>) -> (usize, usize, usize) {
    let refused = |status: u16| {
        direct
            .values()
            .filter(|a| matches!(a, Answer::Refused { status: s, .. } if *s == status))
            .count()
    };
    let allowed = direct.values().filter(|a| **a == Answer::Allowed).count();
    (allowed, refused(401), refused(403))
}

#[tokio::test]
async fn every_artifact_operation_is_allowed_and_denied_through_the_gateway_as_mlflow_3_17_decides()
{
    parity_matrix(Version::Current).await;
}

#[tokio::test]
async fn every_artifact_operation_is_allowed_and_denied_through_the_gateway_as_mlflow_3_15_decides()
{
    parity_matrix(Version::Legacy).await;
}

/// Every client sends every operation directly to MLflow and through the gateway; the answers
/// must agree in every cell.
async fn parity_matrix(version: Version) {
    let s = stack(version);
    let (_, root) = setup(&s.mlflow.url).await;
    let mut direct = BTreeMap::new();
    let mut through = BTreeMap::new();
    for (side, base) in [
        (&mut direct, s.mlflow.url.as_str()),
        (&mut through, s.proxy.url.as_str()),
    ] {
        restore_files(&s.mlflow.url, &root, None).await;
        for client in clients() {
            for op in OPS {
                side.insert(
                    (
                        client.name,
                        client
                            .password
                            .is_some_and(|p| p != PASSWORD && p != MLFLOW_ADMIN_PASSWORD),
                        op,
                    ),
                    send(base, &root, op, client, None).await,
                );
            }
        }
    }
    assert_cells_agree(&direct, &through, |_, _| false);

    // The matrix is only a check if MLflow both allowed and refused, with 401 and with 403.
    let (allowed, unauthenticated, forbidden) = tally(&direct);
    assert!(
        allowed > 0 && unauthenticated > 0 && forbidden > 0,
        "allowed {allowed}, 401 {unauthenticated}, 403 {forbidden}"
    );
    eprintln!(
        "authz {version:?}: {} cells, all equal; MLflow allowed {allowed}, 401 {unauthenticated}, 403 {forbidden}",
        direct.len(),
    );
    // Reading needs READ: the stranger is refused, the reader is not; writing needs EDIT.
    assert_ne!(direct[&("stranger", false, Op::Get)], Answer::Allowed);
    assert_eq!(direct[&("reader", false, Op::Get)], Answer::Allowed);
    assert_ne!(direct[&("reader", false, Op::Put)], Answer::Allowed);
    assert_eq!(direct[&("editor", false, Op::Put)], Answer::Allowed);
    assert_ne!(direct[&("editor", false, Op::Delete)], Answer::Allowed);
    assert_eq!(direct[&("manager", false, Op::Delete)], Answer::Allowed);
}

#[tokio::test]
async fn a_refused_delete_through_the_gateway_leaves_the_object_and_an_experiment_root_is_never_deleted(
) {
    let s = stack(Version::Current);
    let (experiment, root) = setup(&s.mlflow.url).await;
    restore_files(&s.mlflow.url, &root, None).await;
    let editor = Client {
        name: "editor",
        password: Some(PASSWORD),
    };
    let manager = Client {
        name: "manager",
        password: Some(PASSWORD),
    };
    let file = format!(
        "{}/api/2.0/mlflow-artifacts/artifacts/{root}/victims/editor.txt",
        s.proxy.url
    );
    let refused = request(editor, Method::DELETE, file.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::FORBIDDEN);
    assert_eq!(
        request(ADMIN, Method::GET, file.clone())
            .send()
            .await
            .unwrap()
            .status(),
        StatusCode::OK,
        "the object is still there"
    );

    // A manager may delete one run's files, never the experiment's whole tree.
    let whole = request(
        manager,
        Method::DELETE,
        format!(
            "{}/api/2.0/mlflow-artifacts/artifacts/{experiment}",
            s.proxy.url
        ),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(whole.status(), StatusCode::FORBIDDEN);
    let body: Value = whole.json().await.unwrap();
    assert_eq!(body["error_code"], "PERMISSION_DENIED");
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("more than one run"),
        "{body}"
    );
    assert_eq!(
        request(ADMIN, Method::GET, file.clone())
            .send()
            .await
            .unwrap()
            .status(),
        StatusCode::OK,
        "nothing of the experiment was removed"
    );
    let deleted = request(manager, Method::DELETE, file.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), StatusCode::OK);
    assert_eq!(
        request(ADMIN, Method::GET, file)
            .send()
            .await
            .unwrap()
            .status(),
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn one_clients_allowed_answer_is_never_reused_for_another_client() {
    let s = stack(Version::Current);
    let (_, root) = setup(&s.mlflow.url).await;
    restore_files(&s.mlflow.url, &root, None).await;
    let url = format!(
        "{}/api/2.0/mlflow-artifacts/artifacts/{root}/shared/readme.txt",
        s.proxy.url
    );
    // Each client in turn, three times over: a cached "allowed" for the reader must never answer
    // for the others.
    let clients = [
        (
            Client {
                name: "reader",
                password: Some(PASSWORD),
            },
            StatusCode::OK,
        ),
        (
            Client {
                name: "stranger",
                password: Some(PASSWORD),
            },
            StatusCode::FORBIDDEN,
        ),
        (
            Client {
                name: "anonymous",
                password: None,
            },
            StatusCode::UNAUTHORIZED,
        ),
        (
            Client {
                name: "reader",
                password: Some("not-the-password"),
            },
            StatusCode::UNAUTHORIZED,
        ),
    ];
    for _ in 0..3 {
        for (client, expected) in clients {
            let status = request(client, Method::GET, url.clone())
                .send()
                .await
                .unwrap()
                .status();
            assert_eq!(status, expected, "{client:?}");
        }
    }
}

/// Node-wide system metrics change the proxy's own state (the node's reporter lease) before
/// MLflow sees them. A client MLflow refuses must not change it: otherwise anyone could claim a
/// node of someone else's run, and the real ranks' node samples would be dropped as a standby's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_mlflow_refuses_cannot_take_a_nodes_reporter_seat_from_the_runs_ranks() {
    let s = stack(Version::Current);
    let (_, root) = setup(&s.mlflow.url).await;
    let run_id = root.split('/').nth(1).unwrap().to_owned();
    let batch = |rank: u32, step: i64| {
        let metrics: Vec<Value> = ["cpu_utilization_percentage", "system_memory_usage_megabytes"]
            .iter()
            .map(|name| json!({"key": format!("system/node-x/rank-{rank}/{name}"), "value": f64::from(rank), "timestamp": now_ms(), "step": step}))
            .collect();
        json!({ "run_id": run_id, "metrics": metrics })
    };
    let log = |base: &str, client: Client, body: &Value| {
        request(
            client,
            Method::POST,
            format!("{base}/api/2.0/mlflow/runs/log-batch"),
        )
        .json(body)
    };
    let intruders = [
        (
            Client {
                name: "anonymous",
                password: None,
            },
            StatusCode::UNAUTHORIZED,
        ),
        (
            Client {
                name: "stranger",
                password: Some(PASSWORD),
            },
            StatusCode::FORBIDDEN,
        ),
        (
            Client {
                name: "reader",
                password: Some(PASSWORD),
            },
            StatusCode::FORBIDDEN,
        ),
        (
            Client {
                name: "editor",
                password: Some("not-the-password"),
            },
            StatusCode::UNAUTHORIZED,
        ),
    ];
    for (client, expected) in intruders {
        for step in 0..3 {
            let body = batch(7, step);
            let direct = log(&s.mlflow.url, client, &body).send().await.unwrap();
            let proxied = log(&s.proxy.url, client, &body).send().await.unwrap();
            assert_eq!(direct.status(), expected, "{client:?} directly");
            assert_eq!(proxied.status(), expected, "{client:?} through the proxy");
            assert_eq!(
                proxied.headers().get("www-authenticate"),
                direct.headers().get("www-authenticate"),
                "{client:?}"
            );
        }
    }
    // The run's own rank logs next: it is the node's first reporter, and every sample is stored.
    let editor = Client {
        name: "editor",
        password: Some(PASSWORD),
    };
    for step in 0..3 {
        let response = log(&s.proxy.url, editor, &batch(0, step))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK, "editor step {step}");
    }
    let history = request(
        ADMIN,
        Method::GET,
        format!(
            "{}/api/2.0/mlflow/metrics/get-history?run_id={run_id}&metric_key=system/node-x/node_cpu_utilization_percentage",
            s.mlflow.url
        ),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(history.status(), StatusCode::OK);
    let history: Value = history.json().await.unwrap();
    let points: Vec<(i64, f64)> = history["metrics"]
        .as_array()
        .map(|m| {
            m.iter()
                .map(|p| (p["step"].as_i64().unwrap(), p["value"].as_f64().unwrap()))
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(points, [(0, 0.0), (1, 0.0), (2, 0.0)], "{history}");
}

// === workspaces ===

/// What a user of the workspace matrix holds. Workspace-wide grants come as MLflow's seeded
/// roles of a workspace (`admin`: MANAGE, `user`: USE); experiment grants are made in the
/// experiment's workspace (the grant request names it in its header).
#[derive(Clone, Copy, Debug)]
enum WorkspaceGrant {
    Role {
        workspace: &'static str,
        role: &'static str,
    },
    Experiment(&'static str),
    Nothing,
}

/// The experiment lives in `team-a`; `team-b` is another tenant of the same MLflow.
const TEAM_A: &str = "team-a";
const TEAM_B: &str = "team-b";

const WORKSPACE_USERS: [(&str, WorkspaceGrant); 7] = [
    (
        "a-admin",
        WorkspaceGrant::Role {
            workspace: TEAM_A,
            role: "admin",
        },
    ),
    (
        "a-user",
        WorkspaceGrant::Role {
            workspace: TEAM_A,
            role: "user",
        },
    ),
    ("a-reader", WorkspaceGrant::Experiment("READ")),
    ("a-editor", WorkspaceGrant::Experiment("EDIT")),
    ("a-manager", WorkspaceGrant::Experiment("MANAGE")),
    (
        "b-admin",
        WorkspaceGrant::Role {
            workspace: TEAM_B,
            role: "admin",
        },
    ),
    ("nobody", WorkspaceGrant::Nothing),
];

fn workspace_clients() -> Vec<Client> {
    clients_of("a-admin", WORKSPACE_USERS.iter().map(|(name, _)| *name))
}

/// An admin call to MLflow in `workspace` that must succeed (or find the thing already there).
async fn admin_in(
    base: &str,
    workspace: Option<&str>,
    method: Method,
    path: &str,
    body: Value,
) -> Value {
    let mut call = request(ADMIN, method, format!("{base}{path}")).json(&body);
    if let Some(name) = workspace {
        call = call.header("x-mlflow-workspace", name);
    }
    let response = call.send().await.unwrap();
    let status = response.status();
    let text = response.text().await.unwrap();
    assert!(
        status.is_success() || text.contains("RESOURCE_ALREADY_EXISTS") || text.contains("already"),
        "{path}: {status} {text}"
    );
    serde_json::from_str(&text).unwrap_or(Value::Null)
}

/// Two workspaces, an experiment with a run in `team-a`, and the users with their grants.
/// Returns `(experiment_id, run_id)`.
async fn setup_workspaces(mlflow: &str) -> (String, String) {
    // Tests set up the same workspaces and users on one MLflow at once: two assigning the same
    // role at the same moment get a constraint error from MLflow's database, not "already
    // exists". One setup at a time.
    static SETUP: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _one_at_a_time = SETUP.lock().await;
    for workspace in [TEAM_A, TEAM_B] {
        admin_in(
            mlflow,
            None,
            Method::POST,
            "/api/3.0/mlflow/workspaces",
            json!({ "name": workspace }),
        )
        .await;
    }
    let experiment = admin_in(
        mlflow,
        Some(TEAM_A),
        Method::POST,
        "/api/2.0/mlflow/experiments/create",
        json!({ "name": format!("authz-ws-{}", uuid::Uuid::new_v4().simple()) }),
    )
    .await;
    let experiment = experiment["experiment_id"].as_str().unwrap().to_owned();
    let run = admin_in(
        mlflow,
        Some(TEAM_A),
        Method::POST,
        "/api/2.0/mlflow/runs/create",
        json!({ "experiment_id": experiment, "start_time": now_ms() }),
    )
    .await;
    let run_id = run["run"]["info"]["run_id"].as_str().unwrap().to_owned();
    let role_id = |roles: &Value, name: &str| {
        roles["roles"]
            .as_array()
            .and_then(|r| r.iter().find(|role| role["name"] == name))
            .and_then(|role| role["id"].as_i64())
            .unwrap_or_else(|| panic!("no role {name}: {roles}"))
    };
    for (user, grant) in WORKSPACE_USERS {
        admin_in(
            mlflow,
            None,
            Method::POST,
            "/api/2.0/mlflow/users/create",
            json!({ "username": user, "password": PASSWORD }),
        )
        .await;
        match grant {
            WorkspaceGrant::Role { workspace, role } => {
                let roles = admin_in(
                    mlflow,
                    None,
                    Method::GET,
                    &format!("/api/3.0/mlflow/roles/list?workspace={workspace}"),
                    Value::Null,
                )
                .await;
                let role_id = role_id(&roles, role);
                admin_in(
                    mlflow,
                    None,
                    Method::POST,
                    "/api/3.0/mlflow/roles/assign",
                    json!({ "username": user, "role_id": role_id }),
                )
                .await;
            }
            WorkspaceGrant::Experiment(permission) => {
                admin_in(
                    mlflow,
                    Some(TEAM_A),
                    Method::POST,
                    "/api/3.0/mlflow/users/permissions/grant",
                    json!({ "username": user, "resource_type": "experiment", "resource_id": experiment, "permission": permission }),
                )
                .await;
            }
            WorkspaceGrant::Nothing => {}
        }
    }
    (experiment, run_id)
}

/// Every client sends every artifact operation in a workspace of MLflow 3.17.2 (workspaces on,
/// basic-auth app), directly and through the gateway: with the path as the MLflow client sends it
/// (`workspaces/team-a/...`, from the experiment's artifact location), without the prefix, from
/// the other workspace, and from the default one. Every cell must agree, with MLflow's own
/// 401 and 403.
#[tokio::test]
async fn every_artifact_operation_in_a_workspace_is_allowed_and_denied_through_the_gateway_as_mlflow_decides(
) {
    let s = stack(Version::Workspaces);
    let (experiment, run) = setup_workspaces(&s.mlflow.url).await;
    let plain = format!("{experiment}/{run}/artifacts");
    let prefixed = format!("workspaces/{TEAM_A}/{plain}");
    // (what the scope is, the workspace header, the run root the client names)
    let scopes: [(&str, Option<&str>, &str); 4] = [
        ("team-a, client's path", Some(TEAM_A), &prefixed),
        ("team-a, unprefixed path", Some(TEAM_A), &plain),
        ("from team-b", Some(TEAM_B), &prefixed),
        ("from the default workspace", None, &plain),
    ];
    let mut direct = BTreeMap::new();
    let mut through = BTreeMap::new();
    for (side, base) in [
        (&mut direct, s.mlflow.url.as_str()),
        (&mut through, s.proxy.url.as_str()),
    ] {
        for (scope, workspace, root) in scopes {
            restore_files(&s.mlflow.url, &plain, Some(TEAM_A)).await;
            for client in workspace_clients() {
                let wrong_password = client
                    .password
                    .is_some_and(|p| p != PASSWORD && p != MLFLOW_ADMIN_PASSWORD);
                for op in OPS {
                    let answer = send(base, root, op, client, workspace).await;
                    side.insert((scope, client.name, wrong_password, op), answer);
                }
            }
        }
    }
    // The gateway's write policy (enforce, the default) is stricter than authorization: a write
    // that names a run MLflow does not have in the request's workspace is refused even for
    // MLflow's admin, whom MLflow lets write anywhere. Those cells, and only those, may differ.
    let by_write_policy = |cell: &(&str, &str, bool, Op), answer: Option<&Answer>| {
        matches!(answer, Some(Answer::Refused { status: 403, body, .. }) if body.contains("but MLflow has no such run"))
            && cell.0 == "from the default workspace"
            && cell.1 == "admin"
            && matches!(cell.3, Op::Put | Op::MpuCreate)
    };
    let policy = direct
        .iter()
        .filter(|(cell, answer)| {
            **answer == Answer::Allowed && by_write_policy(cell, through.get(*cell))
        })
        .count();
    assert_eq!(
        policy, 2,
        "the admin's PUT and multipart create from the default workspace"
    );
    assert_cells_agree(&direct, &through, by_write_policy);
    let (allowed, unauthenticated, forbidden) = tally(&direct);
    eprintln!(
        "authz workspaces: {} cells, {} equal, {policy} refused by the write policy; MLflow allowed {allowed}, 401 {}, 403 {}",
        direct.len(),
        direct.len() - policy,
        unauthenticated,
        forbidden
    );
    // What MLflow decided, so the matrix checks something: grants in team-a count there and
    // nowhere else, a workspace's USE is not a grant on someone else's experiment, and team-b's
    // admin is a stranger in team-a.
    let cell = |scope, user, op| &direct[&(scope, user, false, op)];
    let here = "team-a, client's path";
    assert_eq!(cell(here, "a-reader", Op::Get), &Answer::Allowed);
    assert_ne!(cell(here, "a-reader", Op::Put), &Answer::Allowed);
    assert_eq!(cell(here, "a-editor", Op::Put), &Answer::Allowed);
    assert_ne!(cell(here, "a-editor", Op::Delete), &Answer::Allowed);
    assert_eq!(cell(here, "a-manager", Op::Delete), &Answer::Allowed);
    assert_eq!(cell(here, "a-admin", Op::Delete), &Answer::Allowed);
    assert_ne!(cell(here, "a-user", Op::Get), &Answer::Allowed);
    assert_ne!(cell(here, "b-admin", Op::Get), &Answer::Allowed);
    assert_ne!(cell(here, "nobody", Op::Get), &Answer::Allowed);
    assert_eq!(
        cell("team-a, unprefixed path", "a-reader", Op::Get),
        &Answer::Allowed
    );
    for user in ["a-admin", "a-manager", "a-reader", "b-admin"] {
        assert_ne!(
            cell("from team-b", user, Op::Get),
            &Answer::Allowed,
            "{user}"
        );
        assert_ne!(
            cell("from the default workspace", user, Op::Get),
            &Answer::Allowed,
            "{user}"
        );
    }
    assert!(unauthenticated > 0 && forbidden > 0);

    // MLflow's admin passes every check: what it gets from another workspace is MLflow's answer
    // too (a path that names another workspace is refused, nothing of team-a is served).
    let file = format!("{prefixed}/shared/readme.txt");
    for (workspace, expected_status) in [(TEAM_B, None), (TEAM_A, Some(200))] {
        let mut statuses = Vec::new();
        for base in [&s.mlflow.url, &s.proxy.url] {
            let response = request(
                ADMIN,
                Method::GET,
                format!("{base}/api/2.0/mlflow-artifacts/artifacts/{file}"),
            )
            .header("x-mlflow-workspace", workspace)
            .send()
            .await
            .unwrap();
            statuses.push(response.status().as_u16());
        }
        assert_eq!(statuses[0], statuses[1], "{workspace}: MLflow, gateway");
        if let Some(status) = expected_status {
            assert_eq!(statuses[0], status, "{workspace}");
        } else {
            assert_ne!(statuses[0], 200, "{workspace}");
        }
    }
}

/// Sends `op` on `path` (relative to the artifact root the workspace places it under; it may be
/// empty) with `workspace` as the raw `X-MLFLOW-WORKSPACE` header; the status and body.
async fn send_raw(
    base: &str,
    path: &str,
    op: Op,
    client: Client,
    workspace: &str,
) -> (u16, String) {
    let api = format!("{base}/api/2.0/mlflow-artifacts");
    let join = |rest: &str| {
        if path.is_empty() {
            rest.to_owned()
        } else {
            format!("{path}/{rest}")
        }
    };
    let file = join("shared/readme.txt");
    let builder = match op {
        Op::Get => request(client, Method::GET, format!("{api}/artifacts/{file}")),
        Op::Head => request(client, Method::HEAD, format!("{api}/artifacts/{file}")),
        Op::List => request(client, Method::GET, format!("{api}/artifacts"))
            .query(&[("path", join("shared"))]),
        Op::Presigned => request(client, Method::GET, format!("{api}/presigned/{file}")),
        Op::Put => request(
            client,
            Method::PUT,
            format!(
                "{api}/artifacts/{}",
                join(&format!("uploads/{}.txt", client.name))
            ),
        )
        .body("planted"),
        Op::MpuCreate => request(
            client,
            Method::POST,
            format!("{api}/mpu/create/{}", join("uploads")),
        )
        .json(&json!({ "path": format!("{}.bin", client.name), "num_parts": 1 })),
        Op::MpuAbort => request(
            client,
            Method::POST,
            format!("{api}/mpu/abort/{}", join("uploads")),
        )
        .json(
            &json!({ "path": format!("{}.bin", client.name), "upload_id": "bm90LWFuLXVwbG9hZA" }),
        ),
        Op::Delete => request(
            client,
            Method::DELETE,
            format!(
                "{api}/artifacts/{}",
                join(&format!("victims/{}.txt", client.name))
            ),
        ),
    };
    let response = builder
        .header("x-mlflow-workspace", workspace)
        .send()
        .await
        .unwrap();
    (response.status().as_u16(), response.text().await.unwrap())
}

/// A workspace header MLflow refuses before it authenticates (a name with `/` that reaches into
/// another workspace's run, `default/...`, names its validator refuses) or a workspace MLflow
/// does not have: MLflow answers 400 or 404 whoever asks. Through the gateway every operation
/// gets MLflow's own answer: no file is read, listed, presigned, planted or deleted. (The escape
/// found by a hostile probe of e93dbfe: the gateway took MLflow's 400 as "allowed" and put the
/// raw header into the object key.)
#[tokio::test]
async fn a_workspace_header_mlflow_refuses_reaches_no_workspace_s_artifacts_through_the_gateway() {
    let s = stack(Version::Workspaces);
    let (experiment, run) = setup_workspaces(&s.mlflow.url).await;
    let plain = format!("{experiment}/{run}/artifacts");
    restore_files(&s.mlflow.url, &plain, Some(TEAM_A)).await;
    restore_files(&s.mlflow.url, &plain, None).await;
    // (the header, the path the client names below the root it places)
    let hostile: Vec<(String, String)> = vec![
        (format!("{TEAM_A}/{plain}"), String::new()),
        (format!("{TEAM_A}/{experiment}"), format!("{run}/artifacts")),
        (format!("default/{plain}"), String::new()),
        (format!("{TEAM_A}/.."), format!("{TEAM_A}/{plain}")),
        ("Team-A".to_owned(), plain.clone()),
        ("team_a".to_owned(), plain.clone()),
        ("workspaces".to_owned(), plain.clone()),
        ("t".to_owned(), plain.clone()),
        ("no-such-team".to_owned(), plain.clone()),
    ];
    let anonymous = Client {
        name: "anonymous",
        password: None,
    };
    let nobody = Client {
        name: "nobody",
        password: Some(PASSWORD),
    };
    let mut differences = Vec::new();
    let mut cells = 0;
    for (header, path) in &hostile {
        for client in [anonymous, nobody] {
            for op in OPS {
                let direct = send_raw(&s.mlflow.url, path, op, client, header).await;
                let through = send_raw(&s.proxy.url, path, op, client, header).await;
                cells += 1;
                assert!(
                    !(200..300).contains(&direct.0),
                    "MLflow itself allowed {op:?} for {} with header {header:?}: {direct:?}",
                    client.name
                );
                if direct.0 != through.0 {
                    differences.push(format!(
                        "{op:?} by {} with {header:?}: MLflow {direct:?}, gateway {through:?}",
                        client.name
                    ));
                }
            }
        }
    }
    assert!(
        differences.is_empty(),
        "{} of {cells} cells differ:\n{}",
        differences.len(),
        differences.join("\n")
    );
    // Nothing was deleted, nothing planted, in team-a or in the default workspace.
    for workspace in [Some(TEAM_A), None] {
        for name in ["anonymous", "nobody"] {
            let mut get = request(
                ADMIN,
                Method::GET,
                format!(
                    "{}/api/2.0/mlflow-artifacts/artifacts/{plain}/victims/{name}.txt",
                    s.mlflow.url
                ),
            );
            if let Some(w) = workspace {
                get = get.header("x-mlflow-workspace", w);
            }
            assert_eq!(
                get.send().await.unwrap().status(),
                200,
                "{workspace:?}: {name}'s victim file"
            );
        }
        let mut list = request(
            ADMIN,
            Method::GET,
            format!("{}/api/2.0/mlflow-artifacts/artifacts", s.mlflow.url),
        )
        .query(&[("path", format!("{plain}/uploads"))]);
        if let Some(w) = workspace {
            list = list.header("x-mlflow-workspace", w);
        }
        let listed: Value = list.send().await.unwrap().json().await.unwrap();
        let planted: Vec<&Value> = listed["files"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|f| {
                f["path"]
                    .as_str()
                    .is_some_and(|p| p.contains("anonymous") || p.contains("nobody"))
            })
            .collect();
        assert!(planted.is_empty(), "{workspace:?}: planted {planted:?}");
    }
}

/// Finding 3: a credential counted as MLflow's once MLflow answered anything but 401, `/health`
/// included. One `GET /health` as `admin` with a wrong password, then writes the proxy answers
/// itself (a log-batch whose `run_id` and `run_uuid` differ), spent team `vision`'s quota and
/// the real admin was refused; 24 invented credentials, each primed by `/health`, escaped their
/// address's share. Now a credential is a client of its own only once MLflow authenticated it on
/// its tracking API: both are charged to the address, and the team keeps its quota.
#[tokio::test]
async fn a_credential_primed_on_health_spends_neither_a_teams_quota_nor_escapes_its_address() {
    use base64::Engine as _;
    let stack = stack(Version::Current);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("teams.toml");
    std::fs::write(
        &config,
        "[[teams]]\nname = \"vision\"\nusers = [\"admin\"]\nwrite_rate = 0.2\n",
    )
    .unwrap();
    let proxy = spawn_proxy(
        &stack.mlflow.url,
        &[
            "--config",
            config.to_str().unwrap(),
            "--client-write-rate",
            "1",
        ],
        dir.path(),
    )
    .unwrap();
    let base = proxy.url.as_str();
    let mismatched = json!({"run_id": "0123456789abcdef0123456789abcdef", "run_uuid": "fedcba9876543210fedcba9876543210", "metrics": [{"key": "m", "value": 1, "timestamp": now_ms(), "step": 0}]});
    let write = |credential: String| {
        let body = mismatched.clone();
        async move {
            http()
                .post(format!("{base}/api/2.0/mlflow/runs/log-batch"))
                .header("authorization", credential)
                .json(&body)
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    let health = |credential: String| async move {
        let status = http()
            .get(format!("{base}/health"))
            .header("authorization", credential)
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status, StatusCode::OK);
    };
    let basic = |user_password: &str| {
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(user_password)
        )
    };
    // The admin, authenticated by MLflow on its tracking API.
    let admin = basic(&format!("admin:{MLFLOW_ADMIN_PASSWORD}"));
    let searched = http()
        .get(format!(
            "{base}/api/2.0/mlflow/experiments/search?max_results=1"
        ))
        .header("authorization", &admin)
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(searched, StatusCode::OK);
    // 24 invented credentials, each primed by /health: one address, one share (2 writes of burst).
    let mut refused = 0;
    for i in 0..24 {
        let invented = basic(&format!("invented-{i}:x"));
        health(invented.clone()).await;
        if write(invented).await == StatusCode::TOO_MANY_REQUESTS {
            refused += 1;
        }
    }
    assert!(
        refused >= 20,
        "only {refused} of 24 refused: invented credentials escaped the address's share"
    );
    // The admin's name with a wrong password, primed by /health: charged to the address too.
    let guess = basic("admin:wrong-password");
    health(guess.clone()).await;
    for _ in 0..5 {
        write(guess.clone()).await;
    }
    // The team's quota (one write of burst) is the admin's: admitted (and answered 400 by the
    // proxy for the mismatched ids), not refused.
    assert_eq!(write(admin).await, StatusCode::BAD_REQUEST);
}
