"""Training-like traffic through mlscope while the test kills and restarts MLflow, SeaweedFS and
PostgreSQL behind it. The MLflow client keeps its own retry settings (MLflow's defaults), so a
request that meets an outage is retried until the dependency is back.

Prints the run as JSON on the first line, then `step <n>` after each step, then `done`.
"""

import json
import os
import time

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

steps = int(os.environ["FAULT_STEPS"])
every = int(os.environ["FAULT_ARTIFACT_EVERY"])
pause = float(os.environ.get("FAULT_PAUSE", "0.3"))

client = MlflowClient()
experiment_id = client.create_experiment(f"faults-{time.time_ns()}")
run_id = client.create_run(experiment_id).info.run_id
print(json.dumps({"run_id": run_id, "experiment_id": experiment_id}), flush=True)

# Checkpoints are written in the test's own directory (FAULT_SCRATCH), which the test removes even
# when this client is killed; a directory of our own would outlive it.
scratch = os.environ["FAULT_SCRATCH"]
for step in range(steps):
    now = int(time.time() * 1000)
    client.log_batch(
        run_id,
        metrics=[
            Metric("loss", 1.0 / (step + 1), now, step),
            # A node-wide sample: the proxy decides it with the lease in PostgreSQL.
            Metric("system/node-f/rank-0/cpu_utilization_percentage", 40.0 + step % 7, now, step),
        ],
    )
    if step % every == 0:
        path = os.path.join(scratch, f"ckpt-{step}.bin")
        with open(path, "wb") as file:
            file.write(bytes([step % 251]) * (1024 * (step + 1)))
        client.log_artifact(run_id, path, "checkpoints")
    print(f"step {step}", flush=True)
    time.sleep(pause)
print("done", flush=True)
