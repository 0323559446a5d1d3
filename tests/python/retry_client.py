"""Writes through a relay that loses some acknowledgements, retrying as an MLflow client does.

RETRY_POLICY picks the retry rules:
- `3.17`: MLflow's own client as installed (MLflow 3.17): every method is retried on 408, 429,
  500, 502, 503, 504 and on a connection lost while reading the answer.
- `3.18`: the rules MLflow 3.18's client applies (mlflow/utils/rest_utils.py in MLflow's source;
  its `mlflow-skinny` is not installable here yet), reproduced on `requests`: the writes it deems
  safe to repeat (LogBatch, LogMetric, LogParam, SetTag, ...) are retried on those statuses and on
  a lost answer; a create only on 408, 429 and connection errors (nothing was sent). Exponential
  backoff with factor MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR, Retry-After honoured.

RETRY_MODE:
- `create`: creates one run in RETRY_EXPERIMENT_ID; prints `created <run_id>` or `refused <status>
  <message>`.
- `batches`: RETRY_THREADS threads each log RETRY_BATCHES batches of RETRY_METRICS samples to
  RETRY_RUN_ID (metric `m<thread>`, one step per sample); prints `logged <n>` and `failed <n>`.
"""

import json
import os
import threading
import time

import requests

policy = os.environ["RETRY_POLICY"]
mode = os.environ["RETRY_MODE"]
uri = os.environ["MLFLOW_TRACKING_URI"].rstrip("/")
max_retries = int(os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "7"))
backoff = float(os.environ.get("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "2"))

SAFE_TO_REPEAT = {
    "runs/log-batch",
    "runs/log-metric",
    "runs/log-parameter",
    "runs/set-tag",
    "runs/delete-tag",
}
TRANSIENT = {408, 429, 500, 502, 503, 504}


class Refused(Exception):
    def __init__(self, status, body):
        super().__init__(f"{status} {body}")
        self.status = status
        self.body = body


def post_318(operation, body):
    """One call under MLflow 3.18's retry rules."""
    repeatable = operation in SAFE_TO_REPEAT
    for attempt in range(max_retries + 1):
        last = attempt == max_retries
        try:
            response = requests.post(f"{uri}/api/2.0/mlflow/{operation}", json=body, timeout=120)
        except requests.exceptions.ConnectionError as error:
            # A refused connection sent nothing; a lost answer may have been applied.
            sent = "NewConnectionError" not in str(error) and "Connection refused" not in str(error)
            if last or (sent and not repeatable):
                raise
            time.sleep(backoff * (2**attempt))
            continue
        retryable = response.status_code in TRANSIENT if repeatable else response.status_code in {408, 429}
        if response.ok:
            return response.json()
        if last or not retryable:
            raise Refused(response.status_code, response.text)
        wait = response.headers.get("Retry-After")
        time.sleep(float(wait) if wait and wait.isdigit() else backoff * (2**attempt))
    raise AssertionError("unreachable")


def create():
    experiment_id = os.environ["RETRY_EXPERIMENT_ID"]
    try:
        if policy == "3.17":
            from mlflow.tracking import MlflowClient

            run_id = MlflowClient().create_run(experiment_id).info.run_id
        else:
            body = {"experiment_id": experiment_id, "start_time": int(time.time() * 1000)}
            run_id = post_318("runs/create", body)["run"]["info"]["run_id"]
        print(f"created {run_id}", flush=True)
    except Exception as error:  # the test reads what the client saw
        if isinstance(error, Refused):
            status = error.status
        else:
            status = getattr(error, "get_http_status_code", lambda: None)()
        print(f"refused {status} {json.dumps(str(error))}", flush=True)


def batches():
    run_id = os.environ["RETRY_RUN_ID"]
    threads = int(os.environ["RETRY_THREADS"])
    count = int(os.environ["RETRY_BATCHES"])
    per_batch = int(os.environ["RETRY_METRICS"])
    logged = [0] * threads
    failed = [0] * threads
    if policy == "3.17":
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        client = MlflowClient()

    def work(t):
        for b in range(count):
            samples = [
                (f"m{t}", float(t * 1_000_000 + b * per_batch + i), 1_700_000_000_000 + b, b * per_batch + i)
                for i in range(per_batch)
            ]
            try:
                if policy == "3.17":
                    client.log_batch(run_id, metrics=[Metric(k, v, ts, s) for k, v, ts, s in samples])
                else:
                    body = {
                        "run_id": run_id,
                        "metrics": [
                            {"key": k, "value": v, "timestamp": ts, "step": s} for k, v, ts, s in samples
                        ],
                    }
                    post_318("runs/log-batch", body)
                logged[t] += 1
            except Exception as error:
                print(f"error {type(error).__name__}: {error}", flush=True)
                failed[t] += 1

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print(f"logged {sum(logged)}", flush=True)
    print(f"failed {sum(failed)}", flush=True)


{"create": create, "batches": batches}[mode]()
