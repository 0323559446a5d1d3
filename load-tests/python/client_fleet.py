"""Ranks of one training job logging metrics with the MLflow client's own `log_metric`.

THREADS threads (ranks), each calling `MlflowClient().log_metric(run_id, "rank<r>/loss", ...)` back
to back for DURATION seconds into the one run RUN_ID at MLFLOW_TRACKING_URI, every call a new
step. Prints one JSON line: calls acknowledged (the call returned), calls failed (it raised, after
the client's own retries), and the keys written, for the caller to count back from MLflow.
"""

import json
import os
import sys
import threading
import time

from mlflow.tracking import MlflowClient


def rank(client, run_id, r, deadline, counts):
    ok = failed = 0
    step = 0
    while time.monotonic() < deadline:
        try:
            client.log_metric(run_id, f"rank{r}/loss", 1.0 / (step + 1), step=step)
            ok += 1
        except Exception as e:  # counted; the first few are shown
            failed += 1
            if failed <= 3:
                print(f"rank {r}: {e}", file=sys.stderr)
        step += 1
    counts[r] = (ok, failed)


def main():
    run_id = os.environ["RUN_ID"]
    threads = int(os.environ.get("THREADS", "32"))
    duration = float(os.environ.get("DURATION", "30"))
    client = MlflowClient()
    counts = {}
    start = time.monotonic()
    deadline = start + duration
    workers = [
        threading.Thread(target=rank, args=(client, run_id, r, deadline, counts))
        for r in range(threads)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.monotonic() - start
    ok = sum(c[0] for c in counts.values())
    failed = sum(c[1] for c in counts.values())
    print(json.dumps({
        "acknowledged": ok,
        "failed": failed,
        "elapsed_s": elapsed,
        "keys": [f"rank{r}/loss" for r in range(threads)],
    }))


if __name__ == "__main__":
    main()
