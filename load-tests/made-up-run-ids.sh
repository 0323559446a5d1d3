#!/usr/bin/env bash
# The made-up run id probe (RELIABILITY.md, "Hostile clients"): starts a local stack
# (mlscope-stack, no demo), sends four log-batch requests with a 100,000-character run id and
# 1,000 node-wide keys each, and prints the proxy's resident memory and state store size before
# and after.
#
#   load-tests/made-up-run-ids.sh [LABEL] [BASE_PORT]     (after cargo build --workspace --bins)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
label=${1:-probe}; base=${2:-26000}
B=${CARGO_TARGET_DIR:-$root/target}/debug
export MLSCOPE_VENV=${MLSCOPE_VENV:-$root/.venv}
d=$(mktemp -d)/stack; trap 'rm -rf "$(dirname "$d")"' EXIT
$B/mlscope-stack --no-demo --data-dir $d --proxy-port $base --mlflow-port $((base+1)) --s3-port $((base+2)) --admin-port $((base+3)) > $d.out 2>$d.err &
spid=$!
for i in $(seq 90); do grep -q '^press' $d.out 2>/dev/null && break; sleep 1; done
ppid=$(pgrep -f "mlscope-proxy.*127.0.0.1:$base" | head -1)
rss() { awk '/VmRSS/ {print int($2/1024)}' /proc/$ppid/status; }
size() { du -sm $d/mlscope-proxy.db* | awk '{s+=$1} END {print s}'; }
echo "$label before: rss $(rss) MB, store $(size) MB"
$MLSCOPE_VENV/bin/python - $base <<'PY'
import json, sys, time, urllib.request
base = sys.argv[1]
body = json.dumps({"run_id": "x" * 100_000, "metrics": [
    {"key": f"system/n{j}/rank-0/cpu_utilization_percentage", "value": 1.0, "timestamp": int(time.time()*1000), "step": 0}
    for j in range(1000)]}).encode()
for i in range(4):
    req = urllib.request.Request(f"http://127.0.0.1:{base}/api/2.0/mlflow/runs/log-batch", data=body, headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=120)
        print("status 200")
    except urllib.error.HTTPError as e:
        print("status", e.code, e.read()[:120])
PY
sleep 4
echo "$label after 4 requests: rss $(rss) MB, store $(size) MB"
kill -INT $spid; wait $spid || true
