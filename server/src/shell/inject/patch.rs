//! What the injection webhook does to one pod: from the pod Kubernetes is about to create, the
//! JSON Patch that puts mlscope-collector into it, or why it leaves the pod alone. Pure: no I/O,
//! so every case is a unit test.
//!
//! A pod asks with the annotation (or label) `mlscope.io/inject`, in a namespace the webhook is
//! called for (labelled `mlscope.io/injection: enabled` in the shipped manifest):
//!
//! - `"wrapper"` (or `"true"` when the measured container names its `command`): an init container
//!   copies the collector binary into an `emptyDir`, and the measured container's command runs
//!   under it (`/mlscope/bin/mlscope-collector -- <command>`; `args` are kept). The collector then
//!   measures the training container's own cgroup and records how the rank ended.
//! - `"sidecar"` (or `"true"` when the container has no `command`: the image's entrypoint is not
//!   known here): a native sidecar (an init container with `restartPolicy: Always`, Kubernetes
//!   1.29+) that samples the node and its own container until the pod ends.
//!
//! The measured container is `mlscope.io/container`, else the first. The collector gets the
//! measured container's MLflow variables (`MLFLOW_*`), its rank variables and its `envFrom`, plus
//! the node and pod names from the downward API. A pod already injected is left as it is
//! (reinvocation adds nothing twice), as is a pod whose sidecar would not know its run.

use serde_json::{json, Map, Value};

/// The annotation a pod asks for the collector with.
pub const INJECT: &str = "mlscope.io/inject";
/// The annotation naming the container to measure.
pub const CONTAINER: &str = "mlscope.io/container";
/// Where the wrapper finds the collector binary in the measured container.
pub const BIN_DIR: &str = "/mlscope/bin";
const SIDECAR_NAME: &str = "mlscope-collector";
const INSTALL_NAME: &str = "mlscope-collector-install";
const VOLUME_NAME: &str = "mlscope-bin";

/// Variables copied from the measured container to a sidecar: MLflow's and the launchers' rank.
const COPIED_PREFIXES: [&str; 2] = ["MLFLOW_", "MLSCOPE_"];

/// How the webhook injects.
#[derive(Debug, Clone)]
pub struct InjectConfig {
    /// The collector's image, e.g. `registry.example.internal/mlscope/mlscope-collector:0.1.0`.
    pub image: String,
    /// Extra arguments of the collector (e.g. `--interval 10`), before `--` in wrapper mode.
    pub collector_args: Vec<String>,
}

/// What the webhook decided for one pod.
#[derive(Debug, PartialEq)]
pub enum Decision {
    /// JSON Patch operations (RFC 6902) that inject the collector, and how.
    Inject { patch: Vec<Value>, mode: Mode },
    /// The pod is left as it is; `warning` says why when the pod asked for the collector.
    Leave { warning: Option<String> },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Wrapper,
    Sidecar,
}

impl Mode {
    pub fn label(self) -> &'static str {
        match self {
            Mode::Wrapper => "wrapper",
            Mode::Sidecar => "sidecar",
        }
    }
}

/// Decides for `pod` (the AdmissionReview's `request.object`).
pub fn decide(pod: &Value, config: &InjectConfig) -> Decision {
    let annotations = &pod["metadata"]["annotations"];
    // The annotation, else a label of the same name (its values are valid label values).
    let asked = annotations[INJECT]
        .as_str()
        .or(pod["metadata"]["labels"][INJECT].as_str())
        .map(str::trim);
    let leave = |why: String| Decision::Leave {
        warning: Some(format!(
            "mlscope: {why}; the pod is created without mlscope-collector"
        )),
    };
    let requested = match asked {
        None | Some("false") | Some("") => return Decision::Leave { warning: None },
        Some("true") => None,
        Some("wrapper") => Some(Mode::Wrapper),
        Some("sidecar") => Some(Mode::Sidecar),
        Some(other) => {
            return leave(format!(
                "{INJECT}: {other:?} is not one of \"true\", \"wrapper\", \"sidecar\", \"false\""
            ))
        }
    };
    let containers = pod["spec"]["containers"].as_array();
    let Some(containers) = containers.filter(|c| !c.is_empty()) else {
        return leave("the pod has no containers".to_owned());
    };
    let index = match annotations[CONTAINER].as_str() {
        Some(name) => match containers.iter().position(|c| c["name"] == name) {
            Some(i) => i,
            None => return leave(format!("{CONTAINER}: no container is named {name:?}")),
        },
        None => 0,
    };
    let container = &containers[index];
    if already_injected(pod, container) {
        return Decision::Leave { warning: None };
    }
    let has_command = container["command"]
        .as_array()
        .is_some_and(|c| !c.is_empty());
    let mode = match requested {
        Some(Mode::Wrapper) if !has_command => {
            return leave(format!(
                "wrapper mode needs the command of container {:?} in the pod spec (its image's entrypoint is not known to the webhook); set `command`, or ask for \"sidecar\"",
                container["name"].as_str().unwrap_or_default()
            ))
        }
        Some(mode) => mode,
        None if has_command => Mode::Wrapper,
        None => Mode::Sidecar,
    };
    let names_run = env_names(container).any(|n| n == "MLFLOW_RUN_ID")
        && env_names(container).any(|n| n == "MLFLOW_TRACKING_URI");
    let has_env_from = container["envFrom"]
        .as_array()
        .is_some_and(|e| !e.is_empty());
    if mode == Mode::Sidecar && !names_run && !has_env_from {
        // A sidecar without its run would exit at once and be restarted for the pod's life.
        return leave(format!(
            "container {:?} sets neither MLFLOW_TRACKING_URI and MLFLOW_RUN_ID nor envFrom, so the sidecar would not know the run",
            container["name"].as_str().unwrap_or_default()
        ));
    }
    let patch = match mode {
        Mode::Wrapper => wrapper_patch(pod, container, index, config),
        Mode::Sidecar => vec![append(
            pod,
            "initContainers",
            sidecar_container(container, config),
        )],
    };
    Decision::Inject { patch, mode }
}

/// Whether the collector is in the pod already (a reinvocation, or a hand-written spec).
fn already_injected(pod: &Value, container: &Value) -> bool {
    let init = pod["spec"]["initContainers"].as_array();
    let named = |name: &str| init.is_some_and(|i| i.iter().any(|c| c["name"] == name));
    let wrapped = container["command"][0]
        .as_str()
        .is_some_and(|c| c.ends_with("/mlscope-collector"));
    named(SIDECAR_NAME) || named(INSTALL_NAME) || wrapped
}

fn env_names(container: &Value) -> impl Iterator<Item = &str> {
    container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["name"].as_str())
}

/// An `add` of `value` at the end of the pod spec's list `field`, or of the list itself.
fn append(pod: &Value, field: &str, value: Value) -> Value {
    if pod["spec"][field].is_array() {
        json!({"op": "add", "path": format!("/spec/{field}/-"), "value": value})
    } else {
        json!({"op": "add", "path": format!("/spec/{field}"), "value": [value]})
    }
}

/// The downward-API variables the collector names its node and pod by, unless `container`
/// sets them.
fn placement_env(container: &Value) -> Vec<Value> {
    let field = |name: &str, path: &str| json!({"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}});
    [
        ("NODE_NAME", "spec.nodeName"),
        ("POD_NAME", "metadata.name"),
    ]
    .into_iter()
    .filter(|(name, _)| !env_names(container).any(|n| n == *name))
    .map(|(name, path)| field(name, path))
    .collect()
}

fn restricted() -> Value {
    json!({
        "runAsNonRoot": true,
        "runAsUser": 65532,
        "allowPrivilegeEscalation": false,
        "readOnlyRootFilesystem": true,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    })
}

fn sidecar_container(measured: &Value, config: &InjectConfig) -> Value {
    let rank_names = mlscope_scopes::RANK_VARIABLES;
    let mut env: Vec<Value> = measured["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| {
            e["name"].as_str().is_some_and(|n| {
                COPIED_PREFIXES.iter().any(|p| n.starts_with(p)) || rank_names.contains(&n)
            })
        })
        .cloned()
        .collect();
    env.extend(placement_env(measured));
    let mut sidecar = Map::new();
    sidecar.insert("name".into(), json!(SIDECAR_NAME));
    sidecar.insert("image".into(), json!(config.image));
    sidecar.insert("restartPolicy".into(), json!("Always"));
    sidecar.insert("args".into(), json!(config.collector_args));
    sidecar.insert("env".into(), Value::Array(env));
    if let Some(from) = measured["envFrom"].as_array().filter(|f| !f.is_empty()) {
        sidecar.insert("envFrom".into(), Value::Array(from.clone()));
    }
    sidecar.insert(
        "resources".into(),
        json!({"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}}),
    );
    sidecar.insert("securityContext".into(), restricted());
    Value::Object(sidecar)
}

fn wrapper_patch(pod: &Value, measured: &Value, index: usize, config: &InjectConfig) -> Vec<Value> {
    let mut patch = Vec::new();
    patch.push(append(
        pod,
        "volumes",
        json!({"name": VOLUME_NAME, "emptyDir": {"sizeLimit": "64Mi"}}),
    ));
    patch.push(append(
        pod,
        "initContainers",
        json!({
            "name": INSTALL_NAME,
            "image": config.image,
            "args": ["--install-to", BIN_DIR],
            "volumeMounts": [{"name": VOLUME_NAME, "mountPath": BIN_DIR}],
            "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
            "securityContext": restricted(),
        }),
    ));
    let base = format!("/spec/containers/{index}");
    let mount = json!({"name": VOLUME_NAME, "mountPath": BIN_DIR, "readOnly": true});
    patch.push(match measured["volumeMounts"].as_array() {
        Some(_) => json!({"op": "add", "path": format!("{base}/volumeMounts/-"), "value": mount}),
        None => json!({"op": "add", "path": format!("{base}/volumeMounts"), "value": [mount]}),
    });
    let mut command = vec![json!(format!("{BIN_DIR}/mlscope-collector"))];
    command.extend(config.collector_args.iter().map(|a| json!(a)));
    command.push(json!("--"));
    command.extend(
        measured["command"]
            .as_array()
            .into_iter()
            .flatten()
            .cloned(),
    );
    patch.push(json!({"op": "replace", "path": format!("{base}/command"), "value": command}));
    let placement = placement_env(measured);
    if !placement.is_empty() {
        if measured["env"].is_array() {
            for variable in placement {
                patch
                    .push(json!({"op": "add", "path": format!("{base}/env/-"), "value": variable}));
            }
        } else {
            patch.push(json!({"op": "add", "path": format!("{base}/env"), "value": placement}));
        }
    }
    patch
}

/// Applies the `add` and `replace` operations of a JSON Patch (RFC 6902) to `doc`, as the API
/// server will: the webhook checks its own patch with it before answering (a patch the API server
/// cannot apply would fail the pod's creation), and the tests read the patched pod through it.
/// Paths are taken as written (the webhook writes no `~` escapes).
pub fn apply(mut doc: Value, patch: &[Value]) -> Result<Value, String> {
    for op in patch {
        let path = op["path"].as_str().ok_or("an operation without a path")?;
        let (parent, last) = path
            .rsplit_once('/')
            .ok_or_else(|| format!("path {path:?}"))?;
        let target = doc
            .pointer_mut(parent)
            .ok_or_else(|| format!("{path}: {parent:?} does not exist"))?;
        let value = op["value"].clone();
        match (op["op"].as_str().unwrap_or_default(), target) {
            ("add", Value::Array(list)) if last == "-" => list.push(value),
            ("add", Value::Object(object)) => {
                object.insert(last.to_owned(), value);
            }
            ("replace", Value::Object(object)) if object.contains_key(last) => {
                object.insert(last.to_owned(), value);
            }
            (op, _) => return Err(format!("{op} at {path} does not apply")),
        }
    }
    Ok(doc)
}

/// The AdmissionReview answer to `review` (admission.k8s.io/v1): always allowed (a webhook that
/// cannot inject must never keep a training pod from starting), with the patch when injecting and
/// a warning when a pod that asked is left alone. `Err` when the review is not one.
pub fn review(review: &Value, config: &InjectConfig) -> Result<(Value, Option<Mode>), String> {
    let request = &review["request"];
    let uid = request["uid"]
        .as_str()
        .ok_or("not an AdmissionReview: request.uid is missing")?;
    let mut response = json!({"uid": uid, "allowed": true});
    let kind = request["kind"]["kind"].as_str().unwrap_or_default();
    let mut injected = None;
    if kind == "Pod" && request["operation"] == "CREATE" {
        match decide(&request["object"], config) {
            Decision::Inject { patch, mode } => match apply(request["object"].clone(), &patch) {
                Ok(_) => {
                    use base64::Engine as _;
                    let patch = serde_json::to_vec(&patch).map_err(|e| e.to_string())?;
                    response["patchType"] = json!("JSONPatch");
                    response["patch"] =
                        json!(base64::engine::general_purpose::STANDARD.encode(patch));
                    injected = Some(mode);
                }
                // Never a patch that would fail the pod's creation: left alone, and said why.
                Err(why) => {
                    response["warnings"] = json!([format!(
                        "mlscope: the {} patch does not apply to this pod ({why}); the pod is created without mlscope-collector",
                        mode.label()
                    )]);
                }
            },
            Decision::Leave {
                warning: Some(warning),
            } => response["warnings"] = json!([warning]),
            Decision::Leave { warning: None } => {}
        }
    }
    let api_version = review["apiVersion"]
        .as_str()
        .unwrap_or("admission.k8s.io/v1");
    Ok((
        json!({"apiVersion": api_version, "kind": "AdmissionReview", "response": response}),
        injected,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> InjectConfig {
        InjectConfig {
            image: "registry.example/mlscope-collector:0.1.0".into(),
            collector_args: vec!["--interval".into(), "10".into()],
        }
    }

    fn pod(annotation: &str, container: Value) -> Value {
        json!({
            "metadata": {"name": "train-0", "annotations": {INJECT: annotation}},
            "spec": {"containers": [container]},
        })
    }

    fn train_with_command() -> Value {
        json!({
            "name": "train",
            "image": "registry.example/train:1",
            "command": ["python", "train.py"],
            "args": ["--epochs", "3"],
            "env": [
                {"name": "MLFLOW_TRACKING_URI", "value": "http://mlscope:5001"},
                {"name": "MLFLOW_RUN_ID", "value": "abc"},
                {"name": "RANK", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
                {"name": "HF_HOME", "value": "/cache"},
            ],
        })
    }

    #[test]
    fn a_container_with_a_command_runs_under_the_collector_installed_by_an_init_container() {
        let pod = pod("true", train_with_command());
        let Decision::Inject { patch, mode } = decide(&pod, &config()) else {
            panic!("not injected")
        };
        assert_eq!(mode, Mode::Wrapper);
        let injected = apply(pod, &patch).unwrap();
        let train = &injected["spec"]["containers"][0];
        assert_eq!(
            train["command"],
            json!([
                "/mlscope/bin/mlscope-collector",
                "--interval",
                "10",
                "--",
                "python",
                "train.py"
            ])
        );
        assert_eq!(train["args"], json!(["--epochs", "3"]), "args are kept");
        assert_eq!(train["volumeMounts"][0]["mountPath"], BIN_DIR);
        let names: Vec<&str> = env_names(train).collect();
        assert!(
            names.contains(&"NODE_NAME") && names.contains(&"POD_NAME"),
            "{names:?}"
        );
        let install = &injected["spec"]["initContainers"][0];
        assert_eq!(install["name"], INSTALL_NAME);
        assert_eq!(install["args"], json!(["--install-to", BIN_DIR]));
        assert_eq!(injected["spec"]["volumes"][0]["name"], VOLUME_NAME);
        // Reinvocation: nothing twice.
        assert_eq!(
            decide(&injected, &config()),
            Decision::Leave { warning: None }
        );
    }

    #[test]
    fn a_container_without_a_command_gets_a_native_sidecar_with_its_mlflow_and_rank_variables() {
        let mut train = train_with_command();
        train.as_object_mut().unwrap().remove("command");
        train["envFrom"] = json!([{"secretRef": {"name": "mlflow-credentials"}}]);
        let mut pod = pod("true", train);
        pod["spec"]["initContainers"] = json!([{"name": "fetch-data", "image": "busybox"}]);
        let Decision::Inject { patch, mode } = decide(&pod, &config()) else {
            panic!("not injected")
        };
        assert_eq!(mode, Mode::Sidecar);
        let injected = apply(pod, &patch).unwrap();
        let init = injected["spec"]["initContainers"].as_array().unwrap();
        assert_eq!(
            init[0]["name"], "fetch-data",
            "the pod's own init containers go first"
        );
        let sidecar = &init[1];
        assert_eq!(sidecar["restartPolicy"], "Always");
        assert_eq!(sidecar["args"], json!(["--interval", "10"]));
        let names: Vec<&str> = env_names(sidecar).collect();
        assert_eq!(
            names,
            [
                "MLFLOW_TRACKING_URI",
                "MLFLOW_RUN_ID",
                "RANK",
                "NODE_NAME",
                "POD_NAME"
            ]
        );
        assert_eq!(
            sidecar["envFrom"][0]["secretRef"]["name"],
            "mlflow-credentials"
        );
        assert!(injected["spec"]["containers"][0].get("command").is_none());
        assert_eq!(
            decide(&injected, &config()),
            Decision::Leave { warning: None }
        );
    }

    #[test]
    fn pods_that_do_not_ask_or_cannot_be_injected_are_left_alone_with_a_reason() {
        assert_eq!(
            decide(
                &json!({"metadata": {}, "spec": {"containers": [train_with_command()]}}),
                &config()
            ),
            Decision::Leave { warning: None }
        );
        assert_eq!(
            decide(&pod("false", train_with_command()), &config()),
            Decision::Leave { warning: None }
        );
        let warning = |pod: &Value| match decide(pod, &config()) {
            Decision::Leave { warning: Some(w) } => w,
            other => panic!("{other:?}"),
        };
        assert!(warning(&pod("yes", train_with_command())).contains("is not one of"));
        let mut bare = train_with_command();
        bare.as_object_mut().unwrap().remove("command");
        assert!(warning(&pod("wrapper", bare.clone())).contains("needs the command"));
        bare.as_object_mut().unwrap().remove("env");
        assert!(warning(&pod("sidecar", bare)).contains("would not know the run"));
        let mut named = pod("true", train_with_command());
        named["metadata"]["annotations"][CONTAINER] = json!("trainer");
        assert!(warning(&named).contains("no container is named \"trainer\""));
    }

    #[test]
    fn the_answer_is_an_allowed_admission_review_with_the_patch_in_base64() {
        use base64::Engine as _;
        let request = json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "operation": "CREATE",
                "object": pod("wrapper", train_with_command()),
            },
        });
        let (answer, mode) = review(&request, &config()).unwrap();
        assert_eq!(mode, Some(Mode::Wrapper));
        assert_eq!(
            answer["response"]["uid"],
            "705ab4f5-6393-11e8-b7cc-42010a800002"
        );
        assert_eq!(answer["response"]["allowed"], true);
        assert_eq!(answer["response"]["patchType"], "JSONPatch");
        let patch = base64::engine::general_purpose::STANDARD
            .decode(answer["response"]["patch"].as_str().unwrap())
            .unwrap();
        let patch: Vec<Value> = serde_json::from_slice(&patch).unwrap();
        assert_eq!(patch.len(), 6, "{patch:?}");
        assert!(review(&json!({"request": {}}), &config()).is_err());
    }
}
