#!/usr/bin/env bash
# Collector benchmark: mlscope-collector and MLflow's own Python system-metrics monitor measure
# the same machine side by side, both at a 1 s interval, both posting through the same local
# stack (mlscope-stack: SeaweedFS, MLflow, mlscope-proxy). Reports peak RSS (VmHWM) and CPU time
# per sample (all threads, from /proc/<pid>/task/*/schedstat, and utime+stime from
# /proc/<pid>/stat) over the measured window, with the ratios, as markdown on stdout.
#
# Usage: load-tests/collector-bench.sh [SAMPLES]     (default 120 samples = 2 minutes)
# Needs scripts/setup (the venv with MLflow) and builds the release binaries it runs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
samples=${1:-120}
warmup=5
target=${CARGO_TARGET_DIR:-$root/target}/release
venv=${MLSCOPE_VENV:-$root/.venv}
python="$venv/bin/python"

cargo build --release -q -p mlscope-proxy -p mlscope-collector -p mlscope-tests --bins >&2
work=$(mktemp -d /tmp/mlscope-collector-bench-XXXXXX)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT

free_port() { "$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# --- the stack -------------------------------------------------------------------------------
"$target/mlscope-stack" --no-demo --proxy-port "$(free_port)" --admin-port "$(free_port)" \
    --mlflow-port "$(free_port)" --s3-port "$(free_port)" >"$work/stack.out" 2>"$work/stack.err" &
pids+=($!)
for _ in $(seq 1 180); do grep -qs "press Ctrl-C" "$work/stack.out" && break; sleep 1; done
grep -q "press Ctrl-C" "$work/stack.out" || { cat "$work/stack.err" >&2; echo "the stack did not start" >&2; exit 1; }
proxy=$(sed -n 's/^export MLFLOW_TRACKING_URI=//p' "$work/stack.out")
experiment=$(curl -sf -X POST "$proxy/api/2.0/mlflow/experiments/create" -H 'Content-Type: application/json' \
    -d "{\"name\": \"collector-bench-$$-$RANDOM\"}" | "$python" -c 'import json,sys; print(json.load(sys.stdin)["experiment_id"])')
run_id=$(curl -sf -X POST "$proxy/api/2.0/mlflow/runs/create" -H 'Content-Type: application/json' \
    -d "{\"experiment_id\": \"$experiment\", \"start_time\": $(date +%s000)}" | "$python" -c 'import json,sys; print(json.load(sys.stdin)["run"]["info"]["run_id"])')
echo "stack at $proxy, run $run_id; measuring $samples samples after a ${warmup}s warm-up" >&2

# --- the two monitors ------------------------------------------------------------------------
MLFLOW_TRACKING_URI=$proxy MLFLOW_RUN_ID=$run_id NODE_NAME=bench-node RANK=0 \
    "$target/mlscope-collector" --interval 1 2>"$work/collector.log" &
collector=$!
pids+=($collector)
# MLflow's monitor as a training process runs it: a thread inside a Python process that imported
# MLflow. The RSS after the imports is recorded, so the monitor's own share can be told apart.
MLFLOW_TRACKING_URI=$proxy "$python" - "$run_id" "$work/python-rss-after-import" >"$work/monitor.out" 2>"$work/monitor.log" <<'EOF' &
import sys, time
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
with open("/proc/self/status") as status:
    rss = next(line for line in status if line.startswith("VmRSS:")).split()[1]
open(sys.argv[2], "w").write(rss)
monitor = SystemMetricsMonitor(sys.argv[1], sampling_interval=1, node_id="bench-node/rank-1")
monitor.start()
time.sleep(24 * 3600)
EOF
monitor=$!
pids+=($monitor)

# CPU time of all threads in ns (schedstat) and utime+stime in clock ticks.
cpu_ns() { cat /proc/"$1"/task/*/schedstat | awk '{ sum += $1 } END { printf "%d\n", sum }'; }
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$1/stat"; }
hwm_kib() { awk '/^VmHWM:/ { print $2 }' "/proc/$1/status"; }

sleep "$warmup"
start_ms=$(date +%s%3N)
c0=$(cpu_ns "$collector"); ct0=$(cpu_ticks "$collector")
m0=$(cpu_ns "$monitor"); mt0=$(cpu_ticks "$monitor")
sleep "$samples"
c1=$(cpu_ns "$collector"); ct1=$(cpu_ticks "$collector")
m1=$(cpu_ns "$monitor"); mt1=$(cpu_ticks "$monitor")
end_ms=$(date +%s%3N)
collector_hwm=$(hwm_kib "$collector")
monitor_hwm=$(hwm_kib "$monitor")
monitor_import_rss=$(cat "$work/python-rss-after-import")
sleep 3  # let the last batches of the window land

# Samples each one stored inside the window, counted in MLflow.
count() {
    curl -sf -G "$proxy/api/2.0/mlflow/metrics/get-history" --data-urlencode "run_id=$run_id" \
        --data-urlencode "metric_key=$1" --data-urlencode "max_results=25000" |
        "$python" -c "import json,sys; print(sum($start_ms <= p['timestamp'] <= $end_ms for p in json.load(sys.stdin).get('metrics', [])))"
}
collector_samples=$(count system/rank-0/network_receive_megabytes)
monitor_samples=$(count system/rank-1/network_receive_megabytes)
ticks_per_s=$(getconf CLK_TCK)

"$python" - <<EOF
c_ns, m_ns = $c1 - $c0, $m1 - $m0
c_ticks, m_ticks = $ct1 - $ct0, $mt1 - $mt0
cs, ms = max($collector_samples, 1), max($monitor_samples, 1)
tick_ms = 1000 / $ticks_per_s
c_hwm, m_hwm, m_import = $collector_hwm / 1024, $monitor_hwm / 1024, $monitor_import_rss / 1024
c_per, m_per = c_ns / cs / 1e6, m_ns / ms / 1e6
print(f"Window: {($end_ms - $start_ms) / 1000:.1f} s at a 1 s interval, both through mlscope-proxy into MLflow 3.17.2.")
print()
print("| | mlscope-collector | MLflow's monitor (Python) | ratio (MLflow / collector) |")
print("|---|---:|---:|---:|")
print(f"| samples stored in the window | {$collector_samples} | {$monitor_samples} | |")
print(f"| peak RSS (VmHWM) | {c_hwm:.1f} MiB | {m_hwm:.1f} MiB | {m_hwm / c_hwm:.0f}x |")
print(f"| RSS of the Python process after importing MLflow, before the monitor starts | | {m_import:.1f} MiB | |")
print(f"| monitor's own share of peak RSS (peak - after import) | {c_hwm:.1f} MiB | {m_hwm - m_import:.1f} MiB | {(m_hwm - m_import) / c_hwm:.1f}x |")
print(f"| CPU time per sample, all threads (schedstat) | {c_per:.3f} ms | {m_per:.3f} ms | {m_per / c_per:.0f}x |")
print(f"| CPU time per sample, utime+stime ({tick_ms:.0f} ms ticks) | {c_ticks * tick_ms / cs:.2f} ms | {m_ticks * tick_ms / ms:.2f} ms | |")
print(f"| CPU share of one core | {c_ns / ($end_ms - $start_ms) / 1e4:.3f} % | {m_ns / ($end_ms - $start_ms) / 1e4:.3f} % | |")
EOF
