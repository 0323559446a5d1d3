#!/usr/bin/env bash
# A forwarding proxy's own time on each request's path, nginx's worker and one or more
# mlscope-proxy builds side by side in one run, from their system-call timestamps.
#
# Usage: load-tests/perf/legs.sh [RATE] [SECONDS] PROXY_BINARY...
#
# Starts nginx answering every request with a fixed run (the upstream), nginx as a reverse proxy
# to it (keep-alive, no buffering: the pass-through bench's configuration) and each proxy build
# with one serving thread and JSON log lines. A client sends `GET runs/get` on one keep-alive
# connection per target, taking the targets in turn at RATE requests/s in all (default 150),
# for SECONDS (default 20), while `perf record` takes the recvfrom, writev and epoll_wait system
# calls of nginx's worker and of each proxy's serving thread. With ENDPOINT=log-batch the requests
# are instead the pass-through bench's `POST runs/log-batch` (10 metrics of one run, each request
# its own step), the proxies' write path. Prints, per target, p50 / p90 / p99 of (see
# syscall-legs.py):
#
# - request -> upstream: from the request becoming readable to its write to the upstream;
# - answer -> client: from the upstream's answer becoming readable to the write to the client;
# - the upstream's leg split three ways, from the upstream's own system calls: until the upstream
#   is awake with the request, the upstream's own work, and until the proxy is awake with the
#   answer.
#
# With PROFILE=N each target's thread is also sampled every 40 µs of its CPU time, and the N
# symbols with the most samples in each of its two legs are printed: where the time goes (the
# sampling lengthens the legs, so compare their lengths in runs without it).
#
# Every target sees the same requests at the same rate, so a difference between them is the
# proxy's own path, not the machine's noise. Needs perf (tracepoints readable) and nginx; ports
# 18080 and 18081, 15001 onward and 19001 onward free.
set -euo pipefail
rate=${1:-150}
seconds=${2:-20}
shift 2
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/mlscope-legs.XXXXXX")
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT
# shellcheck source=fixed-upstream.sh
source "$(dirname "$0")/fixed-upstream.sh"
fixed_upstream_conf "$work" upstream
cat >"$work/nginx.conf" <<CONF
worker_processes 1;
daemon off;
pid $work/nginx.pid;
error_log $work/nginx-error.log;
events { worker_connections 64; }
http {
  access_log off;
  upstream mlflow { server 127.0.0.1:18080; keepalive 32; }
  server {
    listen 127.0.0.1:18081;
    location / {
      proxy_pass http://mlflow;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Host \$http_host;
      proxy_request_buffering off;
      proxy_buffering off;
    }
  }
}
CONF
nginx -c "$work/upstream.conf" & pids+=($!)
nginx -c "$work/nginx.conf" & pids+=($!)
ports=(18081) names=(nginx)
port=15001
for bin in "$@"; do
  MLSCOPE_SERVE_THREADS=1 MLSCOPE_LOG_FORMAT=json "$bin" --upstream http://127.0.0.1:18080 \
    --listen 127.0.0.1:$port --admin-listen 127.0.0.1:$((port + 4000)) \
    --database-url "sqlite://$work/state-$port.db" >"$work/proxy-$port.log" 2>&1 &
  pids+=($!)
  ports+=("$port") names+=("$bin")
  for _ in $(seq 1 120); do curl -sf -o /dev/null "http://127.0.0.1:$((port + 4000))/healthz" && break; sleep 0.5; done
  port=$((port + 1))
done
sleep 1
threads=()
nginx_worker=$(pgrep -P "$(cat "$work/nginx.pid")")
threads+=("-p $nginx_worker")
for pid in "${pids[@]:2}"; do
  threads+=("-t $(ps -L -o tid=,comm= -p "$pid" | awk '$2 ~ /^(mlscope-serve-|bare-serve)/ {print $1; exit}')")
done
events="-e syscalls:sys_enter_recvfrom -e syscalls:sys_exit_recvfrom -e syscalls:sys_enter_writev -e syscalls:sys_exit_writev -e syscalls:sys_enter_epoll_wait -e syscalls:sys_exit_epoll_wait"
records=()
upstream_worker=$(pgrep -P "$(cat "$work/upstream.pid")")
# shellcheck disable=SC2086
perf record -q $events -p "$upstream_worker" -o "$work/upstream.data" -- sleep $((seconds + 4)) 2>/dev/null &
records+=($!)
sampled=() fields=tid,time,event,trace legs=()
if [ -n "${PROFILE:-}" ]; then
  sampled=(-e cpu-clock/period=40000/) fields=tid,time,event,trace,ip,sym legs=(--profile "$PROFILE")
fi
for i in "${!threads[@]}"; do
  # shellcheck disable=SC2086
  perf record -q $events "${sampled[@]}" ${threads[$i]} -o "$work/target-$i.data" -- sleep $((seconds + 4)) 2>/dev/null &
  records+=($!)
done
sleep 1
ENDPOINT=${ENDPOINT:-runs-get} python3 - "$here" "$rate" "$seconds" "${ports[@]}" <<'PY'
import http.client, os, sys, time
sys.path.insert(0, sys.argv[1])
import log_batch
rate, seconds, ports = float(sys.argv[2]), float(sys.argv[3]), [int(p) for p in sys.argv[4:]]
conns = {p: http.client.HTTPConnection("127.0.0.1", p) for p in ports}
writes = os.environ["ENDPOINT"] == "log-batch"
# Connections a target closed without an answer (nginx now and then does with a POST whose body
# it streams to an upstream connection that was closing): the request is sent again once, on a new
# connection, and counted.
resent = {p: 0 for p in ports}
start = time.perf_counter()
for i in range(int(rate * seconds)):
    due = start + i / rate
    while (left := due - time.perf_counter()) > 0:
        time.sleep(left)
    port = ports[i % len(ports)]
    for attempt in (1, 2):
        c = conns[port]
        if writes:
            log_batch.send(c, i // len(ports))
        else:
            c.request("GET", "/api/2.0/mlflow/runs/get?run_id=r1")
        try:
            r = c.getresponse()
            r.read()
            break
        except http.client.RemoteDisconnected as e:
            c.close()
            if attempt == 2:
                sys.exit(f"the target on port {port} gave no answer to request {i}, twice: {e!r}")
            resent[port] += 1
    if r.status != 200:
        sys.exit(f"the target on port {port} answered request {i} with {r.status}: {r.read()[:300]!r}")
for port, n in resent.items():
    if n:
        print(f"the target on port {port} closed its connection without an answer {n} times; each request was sent again")
PY
wait "${records[@]}"
for i in "${!threads[@]}"; do
  echo "${names[$i]}"
  perf script -i "$work/target-$i.data" -F $fields 2>/dev/null >"$work/target-$i.txt"
  "$here/syscall-legs.py" "${legs[@]}" <"$work/target-$i.txt" | sed 's/^/  /'
  perf script -i "$work/upstream.data" -F tid,time,event,trace 2>/dev/null \
    | "$here/syscall-legs.py" --upstream-of "$work/target-$i.txt" | sed 's/^/  /'
done
