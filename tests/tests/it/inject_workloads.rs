//! The injection webhook on the pods the training operators create: an indexed Kubernetes Job
//! running torchrun, a KubeRay worker, a Kubeflow PyTorchJob worker and a JobSet pod, each as the
//! API server sends it in its AdmissionReview (the controller's labels, annotations, owner and
//! variables in place). Each review goes through the webhook's own answer (`patch::review`, what
//! `mlscope-proxy inject` serves); the patched pod validates strictly against the Kubernetes
//! 1.29 to 1.33 schemas (`kubernetes-validate`), carries the collector with the pod's node, rank
//! and run, and a second pass changes nothing. Opted-out and unannotated copies pass untouched.

use std::process::Command;

use mlscope_proxy::shell::inject::patch::{self, InjectConfig};
use serde_json::{json, Value};

const RUN_ID: &str = "5e0b1c6f2a8d4e3fa9b7c0d1e2f3a4b5";
const TRACKING_URI: &str = "http://mlscope-proxy.mlflow.svc:5001";
/// The Kubernetes versions whose schemas the patched pods are validated against.
const VERSIONS: [&str; 5] = ["1.29.0", "1.30.0", "1.31.0", "1.32.0", "1.33.0"];

fn config() -> InjectConfig {
    InjectConfig {
        image: "registry.example/mlscope-collector:0.1.0".into(),
        collector_args: vec!["--interval".into(), "10".into()],
    }
}

fn mlflow_env() -> Vec<Value> {
    vec![
        json!({"name": "MLFLOW_TRACKING_URI", "value": TRACKING_URI}),
        json!({"name": "MLFLOW_RUN_ID", "value": RUN_ID}),
    ]
}

fn owner(api_version: &str, kind: &str, name: &str) -> Value {
    json!([{
        "apiVersion": api_version, "kind": kind, "name": name,
        "uid": "9f1c2d3e-4b5a-6978-8a9b-0c1d2e3f4a5b", "controller": true, "blockOwnerDeletion": true,
    }])
}

/// Rank 2 of an indexed Job of 4 pods, each running torchrun with 8 processes: the Job controller
/// puts the index in a label, an annotation and `JOB_COMPLETION_INDEX`.
fn torchrun_job_pod() -> Value {
    let mut env = vec![
        json!({"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.labels['batch.kubernetes.io/job-completion-index']"}}}),
    ];
    env.extend(mlflow_env());
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": "llm-pretrain-2-x7k2p", "generateName": "llm-pretrain-2-", "namespace": "training",
            "labels": {"batch.kubernetes.io/job-name": "llm-pretrain", "job-name": "llm-pretrain",
                       "batch.kubernetes.io/job-completion-index": "2",
                       "batch.kubernetes.io/controller-uid": "9f1c2d3e-4b5a-6978-8a9b-0c1d2e3f4a5b"},
            "annotations": {"mlscope.io/inject": "true", "batch.kubernetes.io/job-completion-index": "2"},
            "ownerReferences": owner("batch/v1", "Job", "llm-pretrain"),
        },
        "spec": {
            "restartPolicy": "Never", "hostname": "llm-pretrain-2", "subdomain": "llm-pretrain",
            "containers": [{
                "name": "trainer", "image": "registry.example/llm:2024.11",
                "command": ["torchrun"],
                "args": ["--nnodes=4", "--nproc-per-node=8", "--node-rank=$(JOB_COMPLETION_INDEX)",
                         "--master-addr=llm-pretrain-0.llm-pretrain", "--master-port=29500", "train.py"],
                "env": env,
                "resources": {"limits": {"nvidia.com/gpu": "8", "memory": "900Gi"},
                              "requests": {"cpu": "90", "memory": "900Gi"}},
                "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
                "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
                "imagePullPolicy": "IfNotPresent",
            }],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
            "dnsPolicy": "ClusterFirst", "schedulerName": "default-scheduler",
            "terminationGracePeriodSeconds": 30,
        },
    })
}

/// A worker of a KubeRay RayCluster: `ray start --block` under bash, the cluster's labels; the
/// run comes from a ConfigMap (`envFrom`), and Ray has no rank variable.
fn kuberay_worker_pod() -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": "raycluster-train-gpu-group-worker-8q2lz", "namespace": "ray",
            "labels": {"ray.io/cluster": "raycluster-train", "ray.io/group": "gpu-group",
                       "ray.io/node-type": "worker", "ray.io/is-ray-node": "yes",
                       "app.kubernetes.io/created-by": "kuberay-operator"},
            "annotations": {"mlscope.io/inject": "true", "ray.io/ft-enabled": "false"},
            "ownerReferences": owner("ray.io/v1", "RayCluster", "raycluster-train"),
        },
        "spec": {
            "restartPolicy": "Always",
            "initContainers": [{
                "name": "wait-gcs-ready", "image": "rayproject/ray:2.40.0-gpu",
                "command": ["/bin/bash", "-lc", "--"],
                "args": ["until ray health-check --address raycluster-train-head-svc.ray.svc.cluster.local:6379; do sleep 5; done"],
                "resources": {"limits": {"cpu": "200m", "memory": "256Mi"}},
            }],
            "containers": [{
                "name": "ray-worker", "image": "rayproject/ray:2.40.0-gpu",
                "command": ["/bin/bash", "-lc", "--"],
                "args": ["ulimit -n 65536; ray start --address=raycluster-train-head-svc.ray.svc.cluster.local:6379 --block --num-gpus=4"],
                "env": [{"name": "RAY_CLUSTER_NAME", "value": "raycluster-train"},
                        {"name": "RAY_IP", "value": "raycluster-train-head-svc"}],
                "envFrom": [{"configMapRef": {"name": "mlflow-run"}}],
                "ports": [{"containerPort": 8080, "name": "metrics", "protocol": "TCP"}],
                "resources": {"limits": {"nvidia.com/gpu": "4", "cpu": "32", "memory": "256Gi"}},
                "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", "ray stop"]}}},
            }],
        },
    })
}

/// Worker 3 of a Kubeflow PyTorchJob: the training operator sets `MASTER_ADDR`, `WORLD_SIZE` and
/// `RANK`.
fn pytorchjob_worker_pod() -> Value {
    let mut env = vec![
        json!({"name": "MASTER_ADDR", "value": "bert-finetune-master-0"}),
        json!({"name": "MASTER_PORT", "value": "23456"}),
        json!({"name": "WORLD_SIZE", "value": "4"}),
        json!({"name": "RANK", "value": "3"}),
        json!({"name": "PYTHONUNBUFFERED", "value": "1"}),
    ];
    env.extend(mlflow_env());
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": "bert-finetune-worker-2", "namespace": "kubeflow",
            "labels": {"training.kubeflow.org/job-name": "bert-finetune",
                       "training.kubeflow.org/operator-name": "pytorchjob-controller",
                       "training.kubeflow.org/replica-type": "worker",
                       "training.kubeflow.org/replica-index": "2"},
            "annotations": {"mlscope.io/inject": "true", "sidecar.istio.io/inject": "false"},
            "ownerReferences": owner("kubeflow.org/v1", "PyTorchJob", "bert-finetune"),
        },
        "spec": {
            "restartPolicy": "OnFailure",
            "containers": [{
                "name": "pytorch", "image": "registry.example/bert:1.4",
                "command": ["python", "/workspace/train.py", "--epochs", "3"],
                "env": env,
                "ports": [{"containerPort": 23456, "name": "pytorchjob-port", "protocol": "TCP"}],
                "resources": {"limits": {"nvidia.com/gpu": "1", "memory": "64Gi"}},
            }],
        },
    })
}

/// A pod of a JobSet's replicated Job: the image's own entrypoint (no `command`), the JobSet's
/// labels, the Job's completion index.
fn jobset_pod() -> Value {
    let mut env = vec![
        json!({"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.labels['batch.kubernetes.io/job-completion-index']"}}}),
    ];
    env.extend(mlflow_env());
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": "pretrain-workers-0-1-m4x9d", "namespace": "training",
            "labels": {"jobset.sigs.k8s.io/jobset-name": "pretrain",
                       "jobset.sigs.k8s.io/replicatedjob-name": "workers",
                       "jobset.sigs.k8s.io/job-index": "0",
                       "batch.kubernetes.io/job-completion-index": "1",
                       "batch.kubernetes.io/job-name": "pretrain-workers-0"},
            "annotations": {"mlscope.io/inject": "true", "batch.kubernetes.io/job-completion-index": "1",
                            "jobset.sigs.k8s.io/jobset-name": "pretrain"},
            "ownerReferences": owner("batch/v1", "Job", "pretrain-workers-0"),
        },
        "spec": {
            "restartPolicy": "Never", "subdomain": "pretrain", "hostname": "pretrain-workers-0-1",
            "containers": [{
                "name": "main", "image": "registry.example/pretrain:7",
                "env": env,
                "resources": {"limits": {"nvidia.com/gpu": "8"}},
            }],
        },
    })
}

fn admission_review(pod: &Value) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "c0ffee00-1234-4abc-9def-00000000beef",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "namespace": pod["metadata"]["namespace"],
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:job-controller"},
            "object": pod,
            "dryRun": false,
        },
    })
}

/// The webhook's answer to `pod`, and the pod as the API server stores it after the patch.
fn admit(pod: &Value) -> (Value, Value) {
    let (answer, _) = patch::review(&admission_review(pod), &config()).expect("an answer");
    let response = answer["response"].clone();
    assert_eq!(response["uid"], "c0ffee00-1234-4abc-9def-00000000beef");
    assert_eq!(response["allowed"], true, "{response}");
    let patched = match response["patch"].as_str() {
        Some(encoded) => {
            use base64::Engine as _;
            assert_eq!(response["patchType"], "JSONPatch");
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(encoded)
                .unwrap();
            let ops: Vec<Value> = serde_json::from_slice(&bytes).unwrap();
            patch::apply(pod.clone(), &ops).expect("the patch applies")
        }
        None => pod.clone(),
    };
    (response, patched)
}

fn env_of(container: &Value) -> Vec<(String, Value)> {
    container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            let value = e
                .get("value")
                .cloned()
                .unwrap_or_else(|| e["valueFrom"].clone());
            (e["name"].as_str().unwrap().to_owned(), value)
        })
        .collect()
}

fn has_env(container: &Value, name: &str) -> Option<Value> {
    env_of(container)
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v)
}

/// Strict validation of `pods` against every version in `VERSIONS`, with the schemas the
/// `kubernetes-validate` package ships: `Err` lists what failed.
fn validate_strictly(pods: &[(&str, Value)]) -> Result<(), String> {
    let dir = tempfile::tempdir().unwrap();
    let mut files = Vec::new();
    for (name, pod) in pods {
        let path = dir.path().join(format!("{name}.json"));
        std::fs::write(&path, serde_json::to_vec(pod).unwrap()).unwrap();
        files.push(path.display().to_string());
    }
    let script = "import json, sys, kubernetes_validate\n\
        failed = []\n\
        for version in sys.argv[1].split(','):\n\
        \x20   for path in sys.argv[2:]:\n\
        \x20       try:\n\
        \x20           kubernetes_validate.validate(json.load(open(path)), version, strict=True)\n\
        \x20       except Exception as e:\n\
        \x20           failed.append(f'{path} on {version}: {e}')\n\
        print('\\n'.join(failed)); sys.exit(1 if failed else 0)\n";
    let output = Command::new(mlscope_tests::venv().join("bin/python"))
        .args(["-c", script, &VERSIONS.join(",")])
        .args(&files)
        .output()
        .expect("running the venv's python");
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}

#[test]
fn the_pods_of_four_training_operators_get_the_collector_validate_on_1_29_to_1_33_and_stay_put() {
    let field = |path: &str| json!({"fieldRef": {"fieldPath": path}});
    let mut patched_pods = Vec::new();
    for (name, pod, rank_variable) in [
        (
            "job-torchrun",
            torchrun_job_pod(),
            Some("JOB_COMPLETION_INDEX"),
        ),
        ("kuberay-worker", kuberay_worker_pod(), None),
        ("pytorchjob-worker", pytorchjob_worker_pod(), Some("RANK")),
        ("jobset", jobset_pod(), Some("JOB_COMPLETION_INDEX")),
    ] {
        let (response, patched) = admit(&pod);
        assert!(response["patch"].is_string(), "{name}: {response}");
        assert!(response.get("warnings").is_none(), "{name}: {response}");
        let wrapped = pod["spec"]["containers"][0]["command"].is_array();
        // Where the collector runs, and what it reads its run, node and rank from.
        let collector = if wrapped {
            let trainer = &patched["spec"]["containers"][0];
            let command: Vec<&str> = trainer["command"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c.as_str().unwrap())
                .collect();
            let original: Vec<&str> = pod["spec"]["containers"][0]["command"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c.as_str().unwrap())
                .collect();
            // The training command runs under the collector, its arguments untouched.
            assert_eq!(command[0], "/mlscope/bin/mlscope-collector", "{name}");
            let dash = command.iter().position(|c| *c == "--").unwrap();
            assert_eq!(&command[dash + 1..], &original[..], "{name}");
            assert_eq!(
                trainer["args"], pod["spec"]["containers"][0]["args"],
                "{name}"
            );
            let install = patched["spec"]["initContainers"]
                .as_array()
                .unwrap()
                .last()
                .unwrap();
            assert_eq!(install["args"], json!(["--install-to", "/mlscope/bin"]));
            trainer.clone()
        } else {
            let sidecar = patched["spec"]["initContainers"]
                .as_array()
                .unwrap()
                .last()
                .unwrap()
                .clone();
            assert_eq!(
                sidecar["restartPolicy"], "Always",
                "{name}: a native sidecar"
            );
            sidecar
        };
        assert_eq!(
            has_env(&collector, "NODE_NAME"),
            Some(field("spec.nodeName")),
            "{name}"
        );
        assert_eq!(
            has_env(&collector, "POD_NAME"),
            Some(field("metadata.name")),
            "{name}"
        );
        match rank_variable {
            Some(variable) => assert_eq!(
                has_env(&collector, variable),
                has_env(&pod["spec"]["containers"][0], variable),
                "{name}: the rank as the workload sets it"
            ),
            None => assert!(
                mlscope_scopes::RANK_VARIABLES
                    .iter()
                    .all(|v| has_env(&collector, v).is_none()),
                "{name}: no rank invented"
            ),
        }
        if collector["envFrom"].is_array() {
            assert_eq!(
                collector["envFrom"], pod["spec"]["containers"][0]["envFrom"],
                "{name}"
            );
        } else {
            assert_eq!(
                has_env(&collector, "MLFLOW_RUN_ID"),
                Some(json!(RUN_ID)),
                "{name}"
            );
            assert_eq!(
                has_env(&collector, "MLFLOW_TRACKING_URI"),
                Some(json!(TRACKING_URI)),
                "{name}"
            );
        }
        // The controller's own parts are left as they were.
        assert_eq!(patched["metadata"], pod["metadata"], "{name}");
        assert_eq!(
            patched["spec"]["restartPolicy"], pod["spec"]["restartPolicy"],
            "{name}"
        );

        // A second pass (reinvocation, or the pod sent again) changes nothing.
        let (again, unchanged) = admit(&patched);
        assert!(again.get("patch").is_none(), "{name}: {again}");
        assert_eq!(unchanged, patched, "{name}");

        // Opted out, or not asking: untouched, and no warning.
        for annotation in [Some("false"), None] {
            let mut other = pod.clone();
            match annotation {
                Some(value) => other["metadata"]["annotations"]["mlscope.io/inject"] = json!(value),
                None => {
                    other["metadata"]["annotations"]
                        .as_object_mut()
                        .unwrap()
                        .remove("mlscope.io/inject");
                }
            }
            let (answer, same) = admit(&other);
            assert!(
                answer.get("patch").is_none(),
                "{name} {annotation:?}: {answer}"
            );
            assert!(
                answer.get("warnings").is_none(),
                "{name} {annotation:?}: {answer}"
            );
            assert_eq!(same, other);
        }
        patched_pods.push((name, patched));
    }
    // Each patched pod, and each as it came, validates strictly on every version.
    let originals: Vec<(&str, Value)> = [
        ("job-torchrun-original", torchrun_job_pod()),
        ("kuberay-worker-original", kuberay_worker_pod()),
        ("pytorchjob-worker-original", pytorchjob_worker_pod()),
        ("jobset-original", jobset_pod()),
    ]
    .into_iter()
    .collect();
    validate_strictly(&originals).expect("the fixtures themselves are valid pods");
    if let Err(failed) = validate_strictly(&patched_pods) {
        panic!("patched pods failed strict validation:\n{failed}");
    }
}

#[test]
fn a_malformed_review_gets_an_answer_not_a_crash() {
    for review in [
        json!({}),
        json!({"request": {}}),
        json!({"request": {"uid": 7}}),
        json!("not an object"),
    ] {
        assert!(patch::review(&review, &config()).is_err(), "{review}");
    }
    // A review of something else than a Pod CREATE is allowed unchanged.
    let mut update = admission_review(&jobset_pod());
    update["request"]["operation"] = json!("UPDATE");
    let (answer, injected) = patch::review(&update, &config()).unwrap();
    assert_eq!(answer["response"]["allowed"], true);
    assert!(answer["response"].get("patch").is_none() && injected.is_none());
}
