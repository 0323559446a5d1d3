#!/usr/bin/env bash
# Instructions a forwarded request costs the proxy, counted by valgrind's callgrind: a count that
# does not move with the machine's noise, for A/B comparisons of the request path.
#
# Usage: load-tests/perf/instructions.sh PROXY_BINARY [REQUESTS] [PATH]
#
# Starts nginx answering every request with a fixed run (the upstream), the proxy under callgrind
# with one serving thread and JSON log lines, sends 300 `GET PATH` on one keep-alive connection to
# warm it, zeroes the counts, sends REQUESTS more (default 2000), and prints the instructions per
# request of every thread of the proxy together. With PATH `log-batch` each request is instead the
# pass-through bench's `POST runs/log-batch`: METRICS (default 10) metrics of one run, each
# request with its own step. With AUTHORIZATION set, every request carries it
# as its Authorization header (e.g. AUTHORIZATION='Basic dTpw'). With FOOTPRINT=1 it also prints
# the code the requests ran: distinct instructions, 64-byte cache lines and 4 KiB pages (see
# footprint.py), thread by thread, and with BY_FUNCTION=N as well the N functions and the crates
# that hold the most of those lines. Needs valgrind and nginx; ports
# 18080, 15001 and 19464 free. Callgrind's dump is kept under the work directory for callgrind_annotate.
set -euo pipefail
bin=$(realpath "$1")
requests=${2:-2000}
path=${3:-/api/2.0/mlflow/runs/get?run_id=r1}
work=$(mktemp -d "${TMPDIR:-/tmp}/mlscope-instructions.XXXXXX")
# shellcheck source=fixed-upstream.sh
source "$(dirname "$0")/fixed-upstream.sh"
fixed_upstream_conf "$work" nginx
nginx -c "$work/nginx.conf" &
nginx_pid=$!
dump_instr=()
[ "${FOOTPRINT:-}" = 1 ] && dump_instr=(--dump-instr=yes --separate-threads=yes)
MLSCOPE_SERVE_THREADS=1 MLSCOPE_LOG_FORMAT=json valgrind --tool=callgrind "${dump_instr[@]}" \
  --callgrind-out-file="$work/callgrind.%p" "$bin" --upstream http://127.0.0.1:18080 \
  --listen 127.0.0.1:15001 --admin-listen 127.0.0.1:19464 \
  --database-url "sqlite://$work/state.db" >"$work/proxy.log" 2>&1 &
proxy_pid=$!
trap 'kill $proxy_pid $nginx_pid 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do
  curl -sf -o /dev/null http://127.0.0.1:19464/healthz && break
  sleep 1
done
AUTHORIZATION=${AUTHORIZATION:-} METRICS=${METRICS:-10} python3 - "$(dirname "$0")" "$proxy_pid" "$requests" "$path" <<'PY'
import http.client, itertools, os, subprocess, sys
sys.path.insert(0, sys.argv[1])
import log_batch
pid, n, path = sys.argv[2], int(sys.argv[3]), sys.argv[4]
c = http.client.HTTPConnection("127.0.0.1", 15001)
steps = itertools.count()
def get():
    auth = os.environ.get("AUTHORIZATION")
    headers = {"Authorization": auth} if auth else {}
    if path == "log-batch":
        log_batch.send(c, next(steps), int(os.environ["METRICS"]), headers)
    else:
        c.request("GET", path, headers=headers)
    r = c.getresponse()
    r.read()
    assert r.status == 200, r.status
for _ in range(300):
    get()
subprocess.run(["callgrind_control", "-z", pid], check=True, capture_output=True)
for _ in range(n):
    get()
subprocess.run(["callgrind_control", "-d", pid], check=True, capture_output=True)
PY
dump=$(ls "$work"/callgrind.*.1*)
total=$(cat $dump | awk '/^summary:/ {n += $2} END {print n}')
echo "$(basename "$bin") $requests requests: $((total / requests)) instructions per request ($dump)"
if [ "${FOOTPRINT:-}" = 1 ]; then
  # One dump per thread: the serving thread's is the one with most of the instructions.
  for d in $dump; do
    echo "thread $(awk '/^thread:/ {print $2}' "$d"): $(awk '/^summary:/ {print $2}' "$d") instructions"
    "$(dirname "$0")/footprint.py" ${BY_FUNCTION:+--by-function "$BY_FUNCTION"} "$d" | sed 's/^/  /'
  done
fi
