#!/usr/bin/env bash
# What a normal training job sends per client (docs/security.md, "A fair share of MLflow per client";
# BENCHMARKS.md): starts a local stack (mlscope-stack, no demo), runs one job of RANKS rank threads
# with the MLflow client's own log_batch through the proxy, all under one credential (one client
# for the share): every STEP_S seconds each rank logs 4 training metrics, every 10 s a publish of
# 20 system metrics (MLflow's monitor's shape). Prints the job's writes and samples per second
# (mean, and the busiest second as the client sent them) and what the proxy refused.
#
#   load-tests/normal-job.sh [RANKS] [STEP_S] [SECONDS] [BASE_PORT]   (after cargo build --workspace --bins)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
ranks=${1:-16}; step_s=${2:-0.1}; seconds=${3:-60}; base=${4:-26100}
B=${CARGO_TARGET_DIR:-$root/target}/debug
export MLSCOPE_VENV=${MLSCOPE_VENV:-$root/.venv}
d=$(mktemp -d)/stack; trap 'rm -rf "$(dirname "$d")"' EXIT
$B/mlscope-stack --no-demo --data-dir $d --proxy-port $base --mlflow-port $((base+1)) --s3-port $((base+2)) --admin-port $((base+3)) > $d.out 2>$d.err &
spid=$!
for i in $(seq 120); do grep -q '^press' $d.out 2>/dev/null && break; sleep 1; done
RANKS=$ranks STEP_S=$step_s SECONDS_=$seconds BASE=$base $MLSCOPE_VENV/bin/python - <<'PY'
import collections, os, threading, time, urllib.request
import mlflow
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

base, ranks, step_s, seconds = os.environ["BASE"], int(os.environ["RANKS"]), float(os.environ["STEP_S"]), float(os.environ["SECONDS_"])
os.environ["MLFLOW_TRACKING_URI"] = f"http://127.0.0.1:{base}"
os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] = "job", "secret"
client = MlflowClient()
experiment = client.create_experiment(f"normal-job-{time.time_ns()}")
run_id = client.create_run(experiment).info.run_id
per_second = collections.Counter()   # (second, "writes"|"samples") -> count
lock = threading.Lock()
failed = [0]
SYSTEM = [f"system/rank-{{r}}/{k}" for k in (
    "cpu_utilization_percentage", "system_memory_usage_megabytes", "system_memory_usage_percentage",
    "disk_usage_megabytes", "disk_usage_percentage", "disk_available_megabytes",
    "network_receive_megabytes", "network_transmit_megabytes")] + [
    f"system/rank-{{r}}/gpu_0_{k}" for k in (
    "utilization_percentage", "memory_usage_megabytes", "memory_usage_percentage",
    "power_usage_watts", "power_usage_percentage")] + [f"system/rank-{{r}}/extra_{i}" for i in range(7)]

def rank(r, start):
    step, next_system = 0, start
    while (now := time.monotonic()) < start + seconds:
        ts = int(time.time() * 1000)
        metrics = [Metric(k, 1.0 / (step + 1), ts, step) for k in (f"rank{r}/loss", f"rank{r}/lr", f"rank{r}/grad_norm", f"rank{r}/tokens_per_s")]
        if now >= next_system:
            metrics += [Metric(k.format(r=r), 1.0, ts, step) for k in SYSTEM]
            next_system += 10
        try:
            client.log_batch(run_id, metrics=metrics)
            with lock:
                second = int(now - start)
                per_second[(second, "writes")] += 1
                per_second[(second, "samples")] += len(metrics)
        except Exception:
            failed[0] += 1
        step += 1
        time.sleep(max(0.0, start + step * step_s - time.monotonic()))

start = time.monotonic()
threads = [threading.Thread(target=rank, args=(r, start)) for r in range(ranks)]
for t in threads: t.start()
for t in threads: t.join()
full = range(1, int(seconds) - 1)   # whole seconds, the first and last left out
writes = [per_second[(s, "writes")] for s in full]
samples = [per_second[(s, "samples")] for s in full]
text = urllib.request.urlopen(f"http://127.0.0.1:{int(base)+3}/metrics").read().decode()
refused = sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith("mlscope_fair_share_writes_total") and 'outcome="refused"' in l)
print(f"{ranks} ranks, a step every {step_s} s, {seconds:.0f} s: writes/s mean {sum(writes)/len(writes):.0f}, busiest second {max(writes)}; "
      f"samples/s mean {sum(samples)/len(samples):.0f}, busiest second {max(samples)}; calls failed {failed[0]}; refused by the share {refused:.0f}")
PY
kill -INT $spid; wait $spid || true
