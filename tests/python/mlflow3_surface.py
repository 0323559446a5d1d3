"""MLflow 3's client surface in one run, read back from the server: metrics logged with model_id and
a dataset, MLflow's asynchronous logging (MLFLOW_ENABLE_ASYNC_LOGGING=true is set by the caller),
a logged model, and traces from @mlflow.trace. Prints one JSON object of what was stored, with the
ids that differ between two servers replaced by what they refer to.
"""
import json
import os

import mlflow
import pandas as pd
from mlflow.entities import Metric, Param, RunTag
from mlflow.pyfunc import PythonModel
from mlflow.tracking import MlflowClient

suffix = os.environ["SUFFIX"]
client = MlflowClient()
experiment_id = mlflow.set_experiment(f"mlflow3-surface-{suffix}").experiment_id


class Echo(PythonModel):
    def predict(self, context, model_input):
        return model_input


@mlflow.trace(name="forward")
def forward(x, y):
    return inner(x) + y


@mlflow.trace
def inner(x):
    return x * 2


dataset = mlflow.data.from_pandas(pd.DataFrame({"x": [1.0, 2.0, 3.0]}), name="train-set")
with mlflow.start_run() as run:
    run_id = run.info.run_id
    model = mlflow.pyfunc.log_model(name="echo", python_model=Echo(), pip_requirements=[])
    for step in range(5):
        mlflow.log_metric("eval_loss", 1.0 / (step + 1), step=step, model_id=model.model_id, dataset=dataset)
    # Asynchronous logging: many small writes the client batches itself.
    for step in range(200):
        mlflow.log_metric("train_loss", step * 0.5, step=step, synchronous=False)
    client.log_batch(
        run_id,
        metrics=[Metric("batch_metric", 7.0, 1700000000000, 3)],
        params=[Param("lr", "0.01")],
        tags=[RunTag("phase", "async")],
        synchronous=False,
    )
    mlflow.log_param("layers", "4", synchronous=False)
    for i in range(3):
        forward(i, 10)
    mlflow.flush_async_logging()
mlflow.flush_trace_async_logging()


def history(key):
    return [
        {
            "value": m.value,
            "step": m.step,
            "model": "the logged model" if m.model_id == model.model_id else m.model_id,
            "dataset_name": m.dataset_name,
            "dataset_digest": m.dataset_digest == dataset.digest if m.dataset_digest else None,
        }
        for m in sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
    ]


stored = client.get_run(run_id)
traces = mlflow.search_traces(experiment_ids=[experiment_id], return_type="list")
result = {
    "eval_loss": history("eval_loss"),
    "train_loss_count": len(client.get_metric_history(run_id, "train_loss")),
    "train_loss_values": sorted(m.value for m in client.get_metric_history(run_id, "train_loss")),
    "batch_metric": history("batch_metric"),
    "params": stored.data.params,
    "tags": {k: v for k, v in stored.data.tags.items() if not k.startswith("mlflow.")},
    # MLflow keeps model_id and the dataset on the logged model's metrics, not in the run's history.
    "logged_model_metrics": sorted(
        (m.key, m.value, m.step, m.dataset_name, m.dataset_digest == dataset.digest if m.dataset_digest else None)
        for m in client.get_logged_model(model.model_id).metrics or []
    ),
    "traces": sorted(
        (
            [
                sorted(span.name for span in trace.data.spans),
                [span.inputs for span in sorted(trace.data.spans, key=lambda s: s.name)],
                [span.outputs for span in sorted(trace.data.spans, key=lambda s: s.name)],
                str(trace.info.state),
            ]
            for trace in traces
        ),
        key=lambda t: json.dumps(t, sort_keys=True, default=str),
    ),
}
print(json.dumps(result, sort_keys=True, default=str), flush=True)
