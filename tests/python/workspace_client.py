"""A training job's MLflow-client steps in one MLflow workspace (WORKSPACE), each reported on its
own so that a failing step does not hide the others: experiment, run, metric, a checkpoint with
log_artifact, a logged model, listing and downloading both back, the model's metrics on a
dataset (log_batch), searching logged models, loading the model.

Prints one JSON object: {step: ["ok", value] | ["error", message]}, where a value is what should
be the same whichever server answered (names, contents), plus "artifact_uri" and "model_id".
"""
import json
import os
import sys
import tempfile

import mlflow
from mlflow.entities import Metric
from mlflow.pyfunc import PythonModel
from mlflow.tracking import MlflowClient

workspace = os.environ["WORKSPACE"]
suffix = os.environ["SUFFIX"]
mlflow.set_workspace(workspace)
client = MlflowClient()
results = {}
state = {}
CHECKPOINT = bytes(range(256)) * 64


class Echo(PythonModel):
    def predict(self, context, model_input):
        return model_input


def step(name, action):
    try:
        results[name] = ["ok", action()]
    except Exception as error:  # every step is reported, whatever went wrong
        results[name] = ["error", f"{type(error).__name__}: {str(error)[:400]}"]


def experiment():
    state["experiment"] = mlflow.set_experiment(f"workspace-{workspace}-{suffix}").experiment_id
    return True


def run():
    state["run"] = mlflow.start_run(experiment_id=state["experiment"])
    mlflow.log_metric("loss", 0.25, step=1)
    return True


def checkpoint():
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "ckpt.bin")
        with open(path, "wb") as file:
            file.write(CHECKPOINT)
        mlflow.log_artifact(path, artifact_path="checkpoints")
    return True


def model():
    info = mlflow.pyfunc.log_model(name="echo", python_model=Echo(), pip_requirements=[])
    state["model"] = info
    return True


def listing():
    run_id = state["run"].info.run_id
    return sorted(f.path for f in client.list_artifacts(run_id, "checkpoints"))


def download():
    run_id = state["run"].info.run_id
    with tempfile.TemporaryDirectory() as scratch:
        local = client.download_artifacts(run_id, "checkpoints/ckpt.bin", scratch)
        with open(local, "rb") as file:
            return file.read() == CHECKPOINT


def model_files():
    return "MLmodel" in [f.path for f in client.list_logged_model_artifacts(state["model"].model_id)]


def model_metrics():
    """Metrics of the model on a dataset, logged in one batch with the Metric fields MLflow 3
    added (model_id, dataset_name, dataset_digest), read back from the logged model."""
    model_id = state["model"].model_id
    client.log_batch(
        state["run"].info.run_id,
        metrics=[
            Metric("eval_loss", 0.5 / (step + 1), 1700000000000 + step, step,
                   model_id=model_id, dataset_name="eval-set", dataset_digest="d1g3st")
            for step in range(3)
        ],
    )
    return sorted(
        (m.key, m.value, m.step, m.dataset_name, m.dataset_digest)
        for m in client.get_logged_model(model_id).metrics or []
    )


def search_models():
    found = mlflow.search_logged_models(experiment_ids=[state["experiment"]], output_format="list")
    return sorted((m.name, str(m.status)) for m in found)


def load():
    loaded = mlflow.pyfunc.load_model(state["model"].model_uri)
    return list(loaded.predict([1, 2]))


for name, action in [
    ("experiment", experiment),
    ("run", run),
    ("checkpoint", checkpoint),
    ("model", model),
    ("listing", listing),
    ("download", download),
    ("model_files", model_files),
    ("model_metrics", model_metrics),
    ("search_models", search_models),
    ("load", load),
]:
    step(name, action)
if "run" in state:
    mlflow.end_run()
    results["artifact_uri"] = state["run"].info.artifact_uri
if "model" in state:
    results["model_id"] = state["model"].model_id
print(json.dumps(results), flush=True)
sys.exit(0)
