"""One training rank as the platform runs it: MLflow's own system-metrics monitor plus a training
metric, logging into an existing run through MLFLOW_TRACKING_URI.

Usage: rank_monitor.py RUN_ID NODE RANK SECONDS

The monitor's node id is `<node>/rank-<rank>`, exactly what a platform sets through
MLFLOW_SYSTEM_METRICS_NODE_ID. The run is left RUNNING (other ranks still log into it).
Prints one JSON line: the number of training steps logged.
"""

import json
import os
import sys
import time

from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
from mlflow.tracking import MlflowClient


def main():
    run_id, node, rank, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    interval = float(os.environ.get("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1"))
    client = MlflowClient()
    monitor = SystemMetricsMonitor(run_id, sampling_interval=interval, node_id=f"{node}/rank-{rank}")
    monitor.start()
    steps = 0
    deadline = time.time() + seconds
    while time.time() < deadline:
        client.log_metric(run_id, f"train/loss_rank{rank}", 1.0 / (steps + 1), step=steps)
        steps += 1
        time.sleep(0.5)
    monitor.finish()
    print(json.dumps({"rank": rank, "train_steps": steps}), flush=True)


if __name__ == "__main__":
    main()
