#!/usr/bin/env python3
"""A forwarding proxy's own time on each request's path, from its system-call timestamps.

Reads `perf script -F tid,time,event,trace` output of a `perf record` of the syscalls
`recvfrom`, `writev` and `epoll_wait` (enter and exit) of one proxy thread (mlscope-proxy's
serving thread, or nginx's worker) and prints, per request, p50 / p90 / p99 of:

- request -> upstream: from `epoll_wait` returning with the request to the `writev` that sends it
  upstream (a one-element `writev`: the request head);
- answer -> client: from `epoll_wait` returning with the upstream's answer to the `writev` that
  sends it to the client (head and body: two elements);
- upstream: from the request's `writev` to the answer becoming readable.

Usage: perf script -i sc.data -F tid,time,event,trace | load-tests/perf/syscall-legs.py
"""
import re
import sys

LINE = re.compile(r"\s*(\d+)\s+([\d.]+):\s+syscalls:(\w+):\s*(.*)")


def quantiles(values):
    values = sorted(values)
    if not values:
        return "none"
    n = len(values)
    return f"n={n} p50={values[n // 2]:.0f} p90={values[int(n * .9)]:.0f} p99={values[int(n * .99)]:.0f} µs"


def main():
    by_thread = {}
    for line in sys.stdin:
        m = LINE.match(line)
        if m:
            tid, t, event, rest = m.groups()
            by_thread.setdefault(tid, []).append((float(t) * 1e6, event, rest))
    inbound, outbound, upstream = [], [], []
    for events in by_thread.values():
        ready = readable_at = sent_upstream = None
        for t, event, rest in events:
            if event == "sys_exit_epoll_wait":
                ready = t
            elif event == "sys_enter_recvfrom":
                readable_at = ready
            elif event == "sys_enter_writev" and readable_at is not None:
                vlen = int(re.search(r"vlen: 0x([0-9a-f]+)", rest).group(1), 16)
                if vlen == 1:
                    inbound.append(t - readable_at)
                    sent_upstream = t
                else:
                    outbound.append(t - readable_at)
                    if sent_upstream is not None:
                        upstream.append(readable_at - sent_upstream)
                readable_at = None
    if not inbound:
        sys.exit("syscall-legs.py: no request found (perf script -F tid,time,event,trace of the recvfrom/writev/epoll_wait syscalls)")
    print("request -> upstream:", quantiles(inbound))
    print("answer -> client:   ", quantiles(outbound))
    print("upstream:           ", quantiles(upstream))


if __name__ == "__main__":
    main()
