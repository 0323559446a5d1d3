"""The pass-through bench's write, as the profiling scripts beside this one send it
(`instructions.sh`, `legs.sh`): `POST runs/log-batch` with `n` metrics of one run, all at
`step` (each request its own step, so MLflow would store every one)."""
import json

PATH = "/api/2.0/mlflow/runs/log-batch"
RUN_ID = "0123456789abcdef0123456789abcdef"


def metrics(step, n=10):
    """`n` metric elements, all at `step`."""
    return [{"key": f"bench/metric_{i}", "value": 0.5 + i, "timestamp": 1_700_000_000_000 + step,
             "step": step} for i in range(n)]


def send(conn, step, n=10, headers=None):
    """Sends one log-batch on `conn` (an `http.client.HTTPConnection`); the caller reads the answer."""
    body = json.dumps({"run_id": RUN_ID, "metrics": metrics(step, n)})
    conn.request("POST", PATH, body=body, headers={**(headers or {}), "Content-Type": "application/json"})
