"""Many ranks of one training job writing into one run with the MLflow client's own calls.

Each of THREADS threads stands for a rank and, for STEPS steps, calls `MlflowClient.log_metric`
(the shape every `mlflow.log_metric` sends: run_id and run_uuid together); each also logs its own
param, re-logs a param every rank shares with the same value, sets a tag, and logs an asynchronous
batch mixing metrics, params and tags (the shape of MLflow's asynchronous logger). Timestamps are
fixed, so two runs of this script write the same data. Reads RUN_ID, THREADS, STEPS and
MLFLOW_TRACKING_URI; with SEQUENTIAL=1 the ranks run one after another (the reference run
straight to MLflow: concurrent inserts of one param race inside MLflow and one of them gets a 400
IntegrityError). Exits non-zero when any call fails.
"""

import os
import sys
import threading

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient

BASE_MS = 1_700_000_000_000


def rank(client, run_id, r, steps, errors):
    try:
        for s in range(steps):
            client.log_metric(run_id, f"rank{r}/loss", 1.0 / (s + 1 + r), timestamp=BASE_MS + s, step=s)
        client.log_param(run_id, f"rank{r}.seed", str(r))
        client.log_param(run_id, "global_lr", "0.001")
        client.set_tag(run_id, f"rank{r}.state", "training")
        pending = client.log_batch(
            run_id,
            metrics=[Metric(f"rank{r}/epoch_acc", 0.5 + r / 100, BASE_MS + steps, steps)],
            params=[Param("optimizer", "adamw")],
            tags=[RunTag(f"rank{r}.state", "done")],
            synchronous=False,
        )
        pending.wait()
    except Exception as e:  # reported by the parent
        errors.append(f"rank {r}: {e}")


def main():
    run_id = os.environ["RUN_ID"]
    threads = int(os.environ.get("THREADS", "8"))
    steps = int(os.environ.get("STEPS", "20"))
    client = MlflowClient()
    errors = []
    if os.environ.get("SEQUENTIAL") == "1":
        for r in range(threads):
            rank(client, run_id, r, steps, errors)
    else:
        workers = [
            threading.Thread(target=rank, args=(client, run_id, r, steps, errors))
            for r in range(threads)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    if errors:
        print("\n".join(errors), file=sys.stderr)
        sys.exit(1)
    print(f"{threads} ranks x {steps} steps logged")


if __name__ == "__main__":
    main()
