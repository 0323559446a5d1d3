//! `mlscope-proxy inject`, the admission webhook that puts mlscope-collector into training pods,
//! called over HTTPS as the API server calls it, then its patch carried out as the kubelet would:
//! the install init container, then the training container under the collector, against the
//! real stack. (No Kubernetes runs here: the AdmissionReview is the one the API server sends for
//! a Pod CREATE, and the kubelet's part is reproduced by running the two containers' commands with
//! the patched environment, the downward API's values filled in.)

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use mlscope_tests::{collector_binary, eventually, free_port, proxy_binary, Process, TestStack};
use serde_json::{json, Value};

use crate::collector::wait_exit;
use crate::mlflow::{create_run, run_tags};

/// Where the patch mounts the collector in the training container.
const BIN_DIR: &str = "/mlscope/bin";

/// A self-signed certificate for 127.0.0.1: (certificate, key).
fn certificate(dir: &Path) -> (String, String) {
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    let made = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
        ])
        .args([
            "-days",
            "1",
            "-subj",
            "/CN=mlscope-inject",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .unwrap();
    assert!(made.status.success(), "openssl: {made:?}");
    (cert.display().to_string(), key.display().to_string())
}

/// `curl` over HTTPS trusting `ca`: the status and the body.
fn https(ca: &str, url: &str, body: Option<&Value>) -> Result<(u16, String), String> {
    let mut curl = Command::new("curl");
    curl.args([
        "-sS",
        "--max-time",
        "10",
        "--cacert",
        ca,
        "-w",
        "\n%{http_code}",
    ]);
    if let Some(body) = body {
        curl.args(["-H", "content-type: application/json", "--data-binary"])
            .arg(body.to_string());
    }
    let out = curl.arg(url).output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, status) = text.rsplit_once('\n').ok_or("no status")?;
    Ok((
        status.trim().parse().map_err(|_| text.clone())?,
        body.to_owned(),
    ))
}

/// A container's environment as the kubelet gives it: values, and the downward API's fields.
fn environment(container: &Value, pod: &Value, node: &str) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    for variable in container["env"].as_array().into_iter().flatten() {
        let name = variable["name"].as_str().unwrap().to_owned();
        let value = match (
            &variable["value"],
            &variable["valueFrom"]["fieldRef"]["fieldPath"],
        ) {
            (Value::String(v), _) => v.clone(),
            (_, Value::String(field)) if field == "spec.nodeName" => node.to_owned(),
            (_, Value::String(field)) if field == "metadata.name" => {
                pod["metadata"]["name"].as_str().unwrap().to_owned()
            }
            other => panic!("{name}: {other:?}"),
        };
        env.insert(name, value);
    }
    env
}

/// A container's command line with the collector volume at `bin` (the kubelet mounts it at
/// `BIN_DIR`), the image's entrypoint being the collector for the collector image.
fn command_line(container: &Value, bin: &Path, entrypoint: Option<&Path>) -> Command {
    let words: Vec<String> = container["command"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(container["args"].as_array().into_iter().flatten())
        .map(|w| {
            w.as_str()
                .unwrap()
                .replace(BIN_DIR, &bin.display().to_string())
        })
        .collect();
    let (program, rest) = match entrypoint {
        Some(entrypoint) if container["command"].is_null() => {
            (entrypoint.display().to_string(), &words[..])
        }
        _ => (words[0].clone(), &words[1..]),
    };
    let mut command = Command::new(program);
    command.args(rest).env_clear().env("PATH", "/usr/bin:/bin");
    command
}

#[tokio::test(flavor = "multi_thread")]
async fn an_annotated_pod_gets_the_collector_and_its_rank_ends_on_the_run() {
    let stack = TestStack::shared();
    let mlflow = stack.mlflow.url.as_str();
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = certificate(dir.path());
    let port = free_port();
    let mut webhook = Command::new(proxy_binary());
    webhook
        .args(["inject", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--tls-cert", &cert, "--tls-key", &key])
        .args([
            "--collector-image",
            "registry.example/mlscope-collector:0.1.0",
        ])
        .args(["--collector-arg=--interval", "--collector-arg=1"]);
    let _webhook = Process::spawn(
        "mlscope-proxy inject",
        &webhook,
        &dir.path().join("inject.log"),
    )
    .unwrap();
    let base = format!("https://127.0.0.1:{port}");
    eventually(
        Duration::from_secs(60),
        "the webhook answers /healthz over TLS",
        async || match https(&cert, &format!("{base}/healthz"), None)? {
            (200, _) => Ok(()),
            other => Err(format!("{other:?}")),
        },
    )
    .await;

    // The pod the Job controller creates for rank 4 of an indexed Job, as the API server sends
    // it: the run was created first and handed over in MLFLOW_RUN_ID.
    let run_id = create_run(mlflow, "inject").await;
    let pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "train-llm-4-abcde",
            "namespace": "training",
            "annotations": {
                "mlscope.io/inject": "true",
                "batch.kubernetes.io/job-completion-index": "4",
            },
        },
        "spec": {
            "restartPolicy": "Never",
            "containers": [{
                "name": "train",
                "image": "registry.example/train:1",
                "command": ["sh", "-c"],
                "args": ["sleep 1; exit 3"],
                "env": [
                    {"name": "MLFLOW_TRACKING_URI", "value": stack.proxy_url()},
                    {"name": "MLFLOW_RUN_ID", "value": run_id},
                    {"name": "RANK", "value": "4"},
                ],
            }],
        },
    });
    let review = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "3a5c2c3e-4b8e-4a34-9d53-0c1a3a1e7b11",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "training",
            "operation": "CREATE",
            "object": pod,
        },
    });
    let (status, answer) = https(&cert, &format!("{base}/mutate"), Some(&review)).unwrap();
    assert_eq!(status, 200, "{answer}");
    let answer: Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(answer["kind"], "AdmissionReview");
    assert_eq!(answer["response"]["uid"], review["request"]["uid"]);
    assert_eq!(answer["response"]["allowed"], true);
    assert_eq!(answer["response"]["patchType"], "JSONPatch");
    let patch = {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD
            .decode(answer["response"]["patch"].as_str().unwrap())
            .unwrap()
    };
    let patched = mlscope_proxy::shell::inject::patch::apply(
        pod.clone(),
        &serde_json::from_slice::<Vec<Value>>(&patch).unwrap(),
    )
    .unwrap();

    // The kubelet: the install init container (the collector image's entrypoint is the
    // collector), then the training container with the volume mounted.
    let bin = dir.path().join("mlscope-bin");
    std::fs::create_dir(&bin).unwrap();
    let install = &patched["spec"]["initContainers"][0];
    assert_eq!(install["image"], "registry.example/mlscope-collector:0.1.0");
    let installed = command_line(install, &bin, Some(&collector_binary()))
        .output()
        .unwrap();
    assert!(installed.status.success(), "{installed:?}");
    let train = &patched["spec"]["containers"][0];
    let mut training = command_line(train, &bin, None);
    training.envs(environment(train, &patched, "node-k"));
    let rank = Process::spawn(
        "the injected training container",
        &training,
        &dir.path().join("train.log"),
    )
    .unwrap();
    assert_eq!(
        wait_exit(rank).await,
        Some(3),
        "the command's exit code is the container's"
    );
    let tags = run_tags(mlflow, &run_id).await;
    for (key, value) in [
        ("mlscope/rank-4/outcome", "exited"),
        ("mlscope/rank-4/exit_code", "3"),
        ("mlscope/rank-4/node", "node-k"),
    ] {
        assert_eq!(
            tags.get(key).map(String::as_str),
            Some(value),
            "{key} in {tags:?}"
        );
    }

    // A pod that did not ask is allowed as it is; a malformed review is a 400, not a crash.
    let mut plain = review.clone();
    plain["request"]["object"]["metadata"]["annotations"] = json!({});
    let (status, answer) = https(&cert, &format!("{base}/mutate"), Some(&plain)).unwrap();
    assert_eq!(status, 200);
    let answer: Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(answer["response"]["allowed"], true);
    assert!(answer["response"].get("patch").is_none(), "{answer}");
    let (status, _) = https(
        &cert,
        &format!("{base}/mutate"),
        Some(&json!({"kind": "x"})),
    )
    .unwrap();
    assert_eq!(status, 400);
}
