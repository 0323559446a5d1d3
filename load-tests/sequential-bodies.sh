#!/usr/bin/env bash
# Resident memory after many large metric bodies, one after the other: mlscope-proxy in front of
# a trivial upstream that answers every POST with `{}` (so only the proxy's own memory moves),
# sent N sequential 10 MB runs/log-batch bodies, once with glibc's defaults and once with a fixed
# mmap threshold (GLIBC_TUNABLES=glibc.malloc.mmap_threshold=131072), which makes large buffers
# go back to the system when freed. Prints RSS before, after and the peak (VmHWM) for each.
#
# Usage: load-tests/sequential-bodies.sh [N]     (default 40)
# Needs the release proxy (cargo build --release --workspace --bins).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
count=${1:-40}
proxy=${CARGO_TARGET_DIR:-$root/target}/release/mlscope-proxy
[ -x "$proxy" ] || { echo "sequential-bodies: $proxy is missing; run cargo build --release --workspace --bins" >&2; exit 1; }
work=$(mktemp -d /tmp/mlscope-bodies-XXXXXX)
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; rm -rf "$work"; }
trap cleanup EXIT
port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

upstream=$(port)
python3 - "$upstream" <<'PY' &
import http.server, socketserver, sys
class Answer(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        left = int(self.headers.get("Content-Length", 0))
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 20))
            if not chunk:
                break
            left -= len(chunk)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")
    do_GET = do_POST
    def log_message(self, *args):
        pass
class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
Server(("127.0.0.1", int(sys.argv[1])), Answer).serve_forever()
PY
pids+=($!)
sleep 1

echo "| glibc malloc | RSS before | RSS after $count sequential 10 MB bodies | peak |"
echo "|---|---:|---:|---:|"
for mode in default "mmap_threshold=131072"; do
    listen=$(port); admin=$(port)
    env_tunable=()
    [ "$mode" = default ] || env_tunable=(GLIBC_TUNABLES="glibc.malloc.$mode")
    env "${env_tunable[@]}" "$proxy" --listen "127.0.0.1:$listen" --admin-listen "127.0.0.1:$admin" \
        --upstream "http://127.0.0.1:$upstream" --database-url "sqlite://$work/state-$listen.db" --log-level warn \
        >"$work/proxy-$listen.log" 2>&1 &
    pid=$!; pids+=($pid)
    for _ in $(seq 50); do curl -fs "http://127.0.0.1:$admin/healthz" >/dev/null && break; sleep 0.1; done
    before=$(awk '/VmRSS/ {print $2}' "/proc/$pid/status")
    python3 - "http://127.0.0.1:$listen" "$count" <<'PY'
import json, sys, urllib.request
url, count = sys.argv[1], int(sys.argv[2])
metric = {"key": "bench/" + "k" * 200, "value": 1.0, "timestamp": 1, "step": 1}
params = [{"key": f"p{i}", "value": "v" * 5000} for i in range(2000)]
body = json.dumps({"run_id": "r", "metrics": [metric] * 1000, "params": params}).encode()
for _ in range(count):
    request = urllib.request.Request(url + "/api/2.0/mlflow/runs/log-batch", data=body, headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request).read()
PY
    after=$(awk '/VmRSS/ {print $2}' "/proc/$pid/status")
    peak=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status")
    printf '| %s | %.1f MiB | %.1f MiB | %.1f MiB |\n' "$mode" "$(echo "$before/1024" | bc -l)" "$(echo "$after/1024" | bc -l)" "$(echo "$peak/1024" | bc -l)"
    kill "$pid"
done
