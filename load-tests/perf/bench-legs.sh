#!/usr/bin/env bash
# The legs of each request of the pass-through bench's own traffic: the bench runs as it always
# does (its client, its stub upstream, its nginx and mlscope-proxy, its slices and rates), while
# `perf record` takes the recvfrom, writev and epoll_wait system calls of nginx's worker, of the
# proxy's threads and of the bench's own process (the stub upstream is a thread of it). Then, per
# target, p50 / p90 / p99 of (see syscall-legs.py):
#
# - request -> upstream, answer -> client, upstream: each proxy's own legs;
# - with --stub-upstream, the upstream leg split three ways: until the stub is awake with the
#   request, the stub's own work, until the proxy is awake with the answer.
#
# legs.sh measures the same legs with its own client, one target at a time on one connection;
# this one measures them under the bench's traffic (targets idle between their slices, the
# bench's HTTP client), so that what the bench's table says can be split into legs.
#
# Usage: load-tests/perf/bench-legs.sh PASSTHROUGH_ARGUMENTS...
#   e.g. MLSCOPE_PROXY_BIN=target/release/mlscope-proxy load-tests/perf/bench-legs.sh \
#          --stub-upstream --endpoints log-batch --rates 50 --duration 20s --slice 1s \
#          --mlflow-workers 1 --mlflow-no-jobs
#
# BENCH names the mlscope-bench binary (default: target/release/mlscope-bench). One endpoint and
# one rate at a time reads best: the legs are of every request the record holds, warm-up
# included. The record's tracing lengthens every system call a little, for every target alike.
# Needs perf (tracepoints readable) and nginx.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
bench=${BENCH:-${CARGO_TARGET_DIR:-$root/target}/release/mlscope-bench}
[ -x "$bench" ] || { echo "bench-legs.sh: no mlscope-bench at $bench (set BENCH)" >&2; exit 2; }
work=$(mktemp -d "${TMPDIR:-/tmp}/mlscope-bench-legs.XXXXXX")
"$bench" passthrough "$@" >"$work/bench.txt" 2>&1 &
bench_pid=$!
perf_pid=
cleanup() {
  [ -z "$perf_pid" ] || kill -INT "$perf_pid" 2>/dev/null || true
  kill "$bench_pid" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap cleanup EXIT
# The bench starts its stack (MLflow, the object store) first, then the stub, nginx and the proxy.
proxy='' nginx_worker=''
for _ in $(seq 1 600); do
  kill -0 "$bench_pid" 2>/dev/null || { cat "$work/bench.txt" >&2; exit 1; }
  proxy=$(pgrep -P "$bench_pid" -x mlscope-proxy || true)
  master=$(pgrep -P "$bench_pid" -x nginx || true)
  [ -z "$master" ] || nginx_worker=$(pgrep -P "$master" -x nginx | head -1 || true)
  # The proxy is serving once its serving threads are there.
  if [ -n "$proxy" ] && [ -n "$nginx_worker" ] &&
    ps -L -o comm= -p "$proxy" 2>/dev/null | grep -q '^mlscope-serve-'; then
    break
  fi
  sleep 0.2
done
[ -n "$proxy" ] && [ -n "$nginx_worker" ] || { echo "bench-legs.sh: the bench started no nginx or mlscope-proxy" >&2; exit 1; }
events="-e syscalls:sys_enter_recvfrom -e syscalls:sys_exit_recvfrom -e syscalls:sys_enter_writev -e syscalls:sys_exit_writev -e syscalls:sys_enter_epoll_wait -e syscalls:sys_exit_epoll_wait"
# A thread that ends while perf attaches to its process's threads stops it: tried three times.
for attempt in 1 2 3; do
  # shellcheck disable=SC2086
  perf record $events -p "$proxy,$nginx_worker,$bench_pid" -o "$work/sc.data" 2>"$work/perf.log" &
  perf_pid=$!
  sleep 1
  kill -0 "$perf_pid" 2>/dev/null && break
  perf_pid=
  if [ "$attempt" = 3 ]; then
    echo "bench-legs.sh: perf record stopped at once (proxy $proxy, nginx worker $nginx_worker, bench $bench_pid):" >&2
    cat "$work/perf.log" >&2
    exit 1
  fi
done
status=0
wait "$bench_pid" || status=$?
kill -INT "$perf_pid" 2>/dev/null || true
wait "$perf_pid" 2>/dev/null || true
perf_pid=
[ "$status" = 0 ] || { cat "$work/bench.txt" >&2; exit "$status"; }
sed -n '/^| endpoint/,/^$/p' "$work/bench.txt"
# One file per side, as syscall-legs.py reads them (tid time: event: trace).
perf script -i "$work/sc.data" -F comm,tid,time,event,trace 2>/dev/null | awk -v dir="$work" '
  { comm = $1; $1 = "" }
  comm == "nginx" { print > (dir "/nginx.txt"); next }
  comm ~ /^mlscope-serve/ { print > (dir "/mlscope-proxy.txt"); next }
  comm == "stub-upstream" { print > (dir "/stub.txt") }'
for target in nginx mlscope-proxy; do
  echo "$target"
  "$here/syscall-legs.py" <"$work/$target.txt" | sed 's/^/  /'
  if [ -s "$work/stub.txt" ]; then
    "$here/syscall-legs.py" --upstream-of "$work/$target.txt" <"$work/stub.txt" | sed 's/^/  /'
  fi
done
echo "(the record and the bench's whole report: $work)"
