#!/usr/bin/env python3
"""The workload `scripts/pgo` runs through an instrumented mlscope-proxy to record which of its
code is hot: the requests a training job and its UI send, in the proportions a fleet sends them.

Usage: pgo_train.py PROXY_PORT ADMIN_PORT [ROUNDS]

Every round, on keep-alive connections (one per simulated client, some with credentials):
metric batches of plain metrics (most of the traffic), batches with params and tags (MLflow's k6
shape), the system metrics of MLflow's own monitor and of mlscope-collector (scoped and
deduplicated per node), single log-metric/param/tag writes, run creation and update, and the
reads of the UI (runs/get, runs/search, experiments, metric history), some of them concurrent on
one run so that the coalescer merges; every tenth round a scrape of the admin port's /metrics
and /healthz. The upstream is expected to answer everything 200 (the perf scripts' fixed
upstream), so every request takes the path of a stored write or an answered read.
"""
import http.client
import json
import sys
import threading

from log_batch import RUN_ID as RUN, metrics

API = "/api/2.0/mlflow"
MONITOR = ["cpu_utilization_percentage", "system_memory_usage_megabytes", "disk_usage_percentage",
           "network_receive_megabytes", "gpu_0_utilization_percentage", "gpu_0_memory_usage_megabytes"]


def post(conn, path, body, headers=None):
    conn.request("POST", API + path, body=json.dumps(body),
                 headers={**(headers or {}), "Content-Type": "application/json"})
    answer = conn.getresponse()
    answer.read()
    if answer.status != 200:
        raise RuntimeError(f"POST {path} answered {answer.status}")


def get(conn, path, headers=None):
    conn.request("GET", path, headers=headers or {})
    answer = conn.getresponse()
    answer.read()
    if answer.status != 200:
        raise RuntimeError(f"GET {path} answered {answer.status}")


def rank(port, number, rounds):
    """One rank of a job: its writes, as the MLflow client and its monitor send them."""
    conn = http.client.HTTPConnection("127.0.0.1", port)
    headers = {"Authorization": "Basic dHJhaW46dHJhaW4="} if number % 2 else {}
    identity = {**headers, "X-Mlscope-Node": f"node-{number // 2}", "X-Mlscope-Rank": str(number)}
    for step in range(rounds):
        post(conn, "/runs/log-batch", {"run_id": RUN, "metrics": metrics(step, 10)}, headers)
        post(conn, "/runs/log-batch", {"run_id": RUN, "metrics": metrics(step, 10),
                                       "params": [{"key": f"p{step}_{i}", "value": "1"} for i in range(3)],
                                       "tags": [{"key": f"t{i}", "value": str(step)} for i in range(5)]},
             headers)
        if step % 5 == 0:
            # MLflow's system-metrics monitor, then mlscope-collector's scoped keys.
            post(conn, "/runs/log-batch", {"run_id": RUN, "metrics": [
                {"key": f"system/{name}", "value": 1.0, "timestamp": 1_700_000_000_000 + step,
                 "step": step} for name in MONITOR]}, identity)
            post(conn, "/runs/log-batch", {"run_id": RUN, "metrics": [
                {"key": f"system/node-{number // 2}/rank-{number}/{name}", "value": 1.0,
                 "timestamp": 1_700_000_000_000 + step, "step": step} for name in MONITOR]}, headers)
        post(conn, "/runs/log-metric", {"run_id": RUN, "key": "loss", "value": 0.1,
                                        "timestamp": 1_700_000_000_000 + step, "step": step}, headers)
        if step % 10 == 0:
            post(conn, "/runs/log-parameter", {"run_id": RUN, "key": f"lr{step}", "value": "0.1"}, headers)
            post(conn, "/runs/set-tag", {"run_id": RUN, "key": "phase", "value": str(step)}, headers)


def ui(port, admin, rounds):
    """A person with the UI open, and Prometheus scraping the proxy."""
    conn = http.client.HTTPConnection("127.0.0.1", port)
    scrape = http.client.HTTPConnection("127.0.0.1", admin)
    for step in range(rounds):
        get(conn, f"{API}/runs/get?run_id={RUN}")
        post(conn, "/runs/search", {"experiment_ids": ["1"], "max_results": 25})
        get(conn, f"{API}/metrics/get-history?run_id={RUN}&metric_key=loss")
        get(conn, f"{API}/experiments/get?experiment_id=1")
        if step % 10 == 0:
            post(conn, "/experiments/create", {"name": f"train-{step}"})
            post(conn, "/runs/create", {"experiment_id": "1", "start_time": 1_700_000_000_000})
            post(conn, "/runs/update", {"run_id": RUN, "status": "RUNNING"})
            get(scrape, "/metrics")
            get(scrape, "/healthz")


def main():
    port, admin = int(sys.argv[1]), int(sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 400
    failures = []

    def client(work, *args):
        try:
            work(*args)
        except Exception as error:  # reported below, so that the profile is not taken from it
            failures.append(f"{work.__name__}: {error!r}")

    threads = [threading.Thread(target=client, args=(rank, port, n, rounds)) for n in range(4)]
    threads.append(threading.Thread(target=client, args=(ui, port, admin, rounds)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        sys.exit("pgo_train: " + "; ".join(failures))


if __name__ == "__main__":
    main()
