#!/usr/bin/env python3
"""A forwarding proxy's own time on each request's path, from its system-call timestamps.

Reads `perf script -F tid,time,event,trace` output of a `perf record` of the syscalls
`recvfrom`, `writev` and `epoll_wait` (enter and exit) of one proxy thread (mlscope-proxy's
serving thread, or nginx's worker) and prints, per request, p50 / p90 / p99 of:

- request -> upstream: from `epoll_wait` returning with the request to the `writev` that sends it
  upstream (the `writev` that follows a read from a client connection, see `upstream_writes`);
- answer -> client: from `epoll_wait` returning with the upstream's answer to the `writev` that
  sends it to the client (head and body: two elements);
- upstream: from the request's `writev` to the answer becoming readable;
- busy after the send: from the request's `writev` returning to the thread's next blocking
  `epoll_wait` (one with a timeout other than 0): wall time, including any time the thread is
  switched out, while the upstream could already be answering.

Usage: perf script -i sc.data -F tid,time,event,trace | load-tests/perf/syscall-legs.py

With `--profile N` the record also holds `cpu-clock` samples of the thread (`perf record -e
cpu-clock/period=NS/`, as legs.sh's PROFILE=N takes them; `perf script -F
tid,time,event,trace,ip,sym`): each sample is put in the leg
it fell in, and the N symbols with the most samples in each leg (and in the time busy after the
send) are printed with their share of it: where each leg's time goes, not only how long it is
(the sampling itself lengthens the legs).

With `--upstream-of PROXY.txt`, standard input is the upstream's worker instead (its own
recording, same clock) and PROXY.txt the proxy's `perf script` output: the upstream leg of each of
the proxy's requests is split into until the upstream is awake with it (the proxy's `writev` to
the upstream's `epoll_wait` returning), the upstream's own work (to its `writev`), and until the
proxy is awake with the answer (to the proxy's `epoll_wait` returning).
"""
import bisect
import re
import sys

LINE = re.compile(r"\s*(\d+)\s+([\d.]+):\s+syscalls:(\w+):\s*(.*)")
# A sample: `tid time: [period] cpu-clock[/terms/]: ip symbol[+offset]`.
SAMPLE = re.compile(r"\s*(\d+)\s+([\d.]+):\s+(?:\d+\s+)?cpu-clock\S*:\s+[0-9a-f]+\s+(.*)")


def quantiles(values):
    values = sorted(values)
    if not values:
        return "none"
    n = len(values)
    return f"n={n} p50={values[n // 2]:.0f} p90={values[int(n * .9)]:.0f} p99={values[int(n * .99)]:.0f} µs"


def read(lines, samples=None):
    """Events of each thread, in order: (µs, event, arguments); `cpu-clock` samples go to
    `samples` (a dict of thread to [(µs, symbol)]) when given."""
    by_thread = {}
    for line in lines:
        m = LINE.match(line)
        if m:
            tid, t, event, rest = m.groups()
            by_thread.setdefault(tid, []).append((float(t) * 1e6, event, rest))
        elif samples is not None and (m := SAMPLE.match(line)):
            tid, t, symbol = m.groups()
            symbol = re.sub(r"\+0x[0-9a-f]+$", "", symbol.split(" (")[0].strip()) or "?"
            samples.setdefault(tid, []).append((float(t) * 1e6, symbol))
    return by_thread


def profile(windows, samples, top):
    """The `top` symbols of the samples that fell in each leg's windows ((start, end) µs)."""
    for leg, spans in windows.items():
        spans.sort()
        starts = [a for a, _ in spans]
        counts, total = {}, 0
        for t, symbol in samples:
            i = bisect.bisect_right(starts, t) - 1
            if i >= 0 and t <= spans[i][1]:
                counts[symbol] = counts.get(symbol, 0) + 1
                total += 1
        print(f"{leg} profile: {total} samples in {len(spans)} legs")
        for symbol, n in sorted(counts.items(), key=lambda kv: -kv[1])[:top]:
            print(f"  {100 * n / max(total, 1):5.1f} %  {symbol[:120]}")


FD = re.compile(r"fd: 0x([0-9a-f]+)")
# An `epoll_wait` that only looks (timeout 0), as tokio's does while it still has work.
NO_WAIT = re.compile(r"timeout: 0x0+\b")


def upstream_writes(events):
    """The times of one thread's `writev` calls that send a request upstream.

    A connection's side tells: the thread waits for a client's request at the client's pace, and
    for an answer only as long as the upstream takes, so each connection's median wait in
    `epoll_wait` before its data is read sets it apart, and a `writev` after a read from a client
    connection sends the request on (head and body, or the head alone). Where the record shows one
    connection only, a one-element `writev` (a request head without a body) is taken instead."""
    waits, blocked, entered, read_fd, after = {}, None, None, {}, None
    for t, event, rest in events:
        if event == "sys_enter_epoll_wait":
            entered = t
        elif event == "sys_exit_epoll_wait" and entered is not None:
            blocked, after = t - entered, True
        elif event == "sys_enter_recvfrom" and after:
            fd = FD.search(rest).group(1)
            waits.setdefault(fd, []).append(blocked)
            after = False
        elif event == "sys_enter_writev":
            read_fd[t] = fd if after is False else None
    medians = sorted((sorted(w)[len(w) // 2], fd) for fd, w in waits.items())
    if len(medians) < 2:
        return {
            t
            for t, event, rest in events
            if event == "sys_enter_writev" and re.search(r"vlen: 0x0*1\b", rest)
        }
    # The two sides are apart by the largest ratio between neighbouring medians (a connection
    # opened again adds one more of its side).
    gaps = [(b[0] / max(a[0], 1.0), i) for i, (a, b) in enumerate(zip(medians, medians[1:]))]
    cut = max(gaps)[1] + 1
    clients = {fd for _, fd in medians[cut:]}
    return {t for t, fd in read_fd.items() if fd in clients}


def upstream_split(proxy_path):
    """The upstream leg of each request of the proxy in PROXY.txt, split three ways."""
    with open(proxy_path) as f:
        threads = list(read(f).values())
    proxy = [e for events in threads for e in events]
    requests = set().union(*(upstream_writes(events) for events in threads))
    upstream = sorted(e for events in read(sys.stdin).values() for e in events)
    # The proxy's request writes and each wake-up after one.
    sends, wakes = [], []
    for t, event, rest in proxy:
        if event == "sys_enter_writev" and t in requests:
            sends.append(t)
        elif event == "sys_exit_epoll_wait" and sends and (not wakes or wakes[-1][0] != sends[-1]):
            wakes.append((sends[-1], t))
    woken = dict(wakes)
    up_wakes = [t for t, event, _ in upstream if event == "sys_exit_epoll_wait"]
    up_writes = [t for t, event, _ in upstream if event == "sys_enter_writev"]
    to_up, own, back = [], [], []
    for sent in sends:
        i = bisect.bisect_left(up_wakes, sent)
        if i == len(up_wakes) or sent not in woken:
            continue
        j = bisect.bisect_left(up_writes, up_wakes[i])
        if j == len(up_writes) or up_writes[j] > woken[sent]:
            continue
        to_up.append(up_wakes[i] - sent)
        own.append(up_writes[j] - up_wakes[i])
        back.append(woken[sent] - up_writes[j])
    print("upstream awake:     ", quantiles(to_up))
    print("upstream's own:     ", quantiles(own))
    print("proxy awake again:  ", quantiles(back))


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--upstream-of":
        return upstream_split(sys.argv[2])
    top = int(sys.argv[2]) if len(sys.argv) == 3 and sys.argv[1] == "--profile" else 0
    samples = {} if top else None
    by_thread = read(sys.stdin, samples)
    inbound, outbound, upstream, busy = [], [], [], []
    windows = {"request -> upstream": [], "answer -> client": [], "busy after the send": []}
    for events in by_thread.values():
        ready = readable_at = sent_upstream = sending = returned = None
        requests = upstream_writes(events)
        for t, event, rest in events:
            if event == "sys_exit_writev" and sending:
                returned, sending = t, False
            elif sending and event.startswith("sys_enter_"):
                # The send's own exit was not recorded (perf lost it): no figure for it.
                sending = False
            elif event == "sys_enter_epoll_wait" and returned is not None and not NO_WAIT.search(rest):
                busy.append(t - returned)
                windows["busy after the send"].append((returned, t))
                returned = None
            if event == "sys_exit_epoll_wait":
                ready = t
            elif event == "sys_enter_recvfrom":
                readable_at = ready
            elif event == "sys_enter_writev" and readable_at is not None:
                if t in requests:
                    inbound.append(t - readable_at)
                    windows["request -> upstream"].append((readable_at, t))
                    sent_upstream, sending, returned = t, True, None
                else:
                    outbound.append(t - readable_at)
                    windows["answer -> client"].append((readable_at, t))
                    if sent_upstream is not None:
                        upstream.append(readable_at - sent_upstream)
                readable_at = None
    if not inbound:
        sys.exit("syscall-legs.py: no request found (perf script -F tid,time,event,trace of the recvfrom/writev/epoll_wait syscalls)")
    print("request -> upstream:", quantiles(inbound))
    print("answer -> client:   ", quantiles(outbound))
    print("upstream:           ", quantiles(upstream))
    print("busy after the send:", quantiles(busy))
    if top:
        profile(windows, [s for thread in samples.values() for s in thread], top)


if __name__ == "__main__":
    main()
