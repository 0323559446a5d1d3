"""MLflow's own system-metrics monitor for the local stack's demo run, posting straight to MLflow
(not through mlscope), so the run shows MLflow's names beside the collector's scoped series.

Usage: demo_monitor.py RUN_ID SECONDS   (MLFLOW_TRACKING_URI names MLflow itself)

Stops after SECONDS, or earlier when the run is no longer RUNNING (the monitor's own rule).
"""

import sys
import time

from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor


def main():
    run_id, seconds = sys.argv[1], float(sys.argv[2])
    monitor = SystemMetricsMonitor(run_id)
    monitor.start()
    deadline = time.time() + seconds
    while time.time() < deadline and monitor._process is not None and monitor._process.is_alive():
        time.sleep(1)
    monitor.finish()


if __name__ == "__main__":
    main()
