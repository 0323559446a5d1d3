#!/usr/bin/env python3
"""How long each side of a proxy's trip to its upstream waits to be woken, from the scheduler.

Reads `perf script -F comm,tid,cpu,time,event,trace` output of a machine-wide record
(`perf record -a -e sched:sched_switch,sched:sched_wakeup,syscalls:sys_enter_writev,
syscalls:sys_exit_epoll_wait`) and, for each target thread (a proxy's serving thread or nginx's
worker) prints, p50 / p90 / p99 in µs:

- to the upstream's wake-up: from the target's `writev` of a request (one element) to the
  upstream's worker being woken;
- back to the target's wake-up: from the upstream's `writev` of its answer to the target being
  woken;
- woken to running: from any wake-up of the target or the upstream to it being switched in;

and how many wake-ups towards the upstream took over 100 µs, by who completed them (the idle task
on another CPU completes a wake-up the kernel queued to that CPU).

Usage: perf script -i sched.data -F comm,tid,cpu,time,event,trace \\
           | load-tests/perf/wakeups.py UPSTREAM_TID NAME=TID...
"""
import collections
import importlib
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
quantiles = importlib.import_module("syscall-legs").quantiles

LINE = re.compile(r"\s*(.+?)\s+(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+(\S+):\s*(.*)")


def main():
    upstream = sys.argv[1]
    names = dict(reversed(arg.split("=", 1)) for arg in sys.argv[2:])
    events = []
    for line in sys.stdin:
        m = LINE.match(line)
        if m:
            comm, tid, cpu, t, event, rest = m.groups()
            events.append((float(t) * 1e6, int(cpu), comm, tid, event, rest))
    events.sort()
    to_upstream, back = collections.defaultdict(list), collections.defaultdict(list)
    slow_by = collections.defaultdict(collections.Counter)
    to_running = collections.defaultdict(list)
    woken_at = {}
    sent = answered = None  # (target, time, cpu) of the request on its way; the answer's time
    for t, cpu, comm, tid, event, rest in events:
        if event == "syscalls:sys_enter_writev" and tid in names and re.search(r"vlen: 0x0*1\b", rest):
            sent, answered = (names[tid], t, cpu), None
        elif event == "syscalls:sys_enter_writev" and tid == upstream and sent:
            answered = t
        elif event == "sched:sched_wakeup":
            woken = re.search(r"pid=(\d+)", rest).group(1)
            if woken in names or woken == upstream:
                woken_at[woken] = t
            if sent and woken == upstream and answered is None:
                waited = t - sent[1]
                to_upstream[sent[0]].append(waited)
                where = "same CPU" if cpu == sent[2] else "another CPU"
                slow_by[sent[0]][f"{'over' if waited > 100 else 'within'} 100 µs, by {comm.split('/')[0]} on {where}"] += 1
            elif sent and answered is not None and woken in names and names[woken] == sent[0]:
                back[sent[0]].append(t - answered)
                sent = answered = None
        elif event == "sched:sched_switch":
            pid = re.search(r"next_pid=(\d+)", rest).group(1)
            if pid in woken_at:
                to_running[names.get(pid, "upstream")].append(t - woken_at.pop(pid))
    for name in dict.fromkeys(names.values()):
        print(name)
        print("  to the upstream's wake-up:  ", quantiles(to_upstream[name]))
        print("  back to the target's wake-up:", quantiles(back[name]))
        print("  woken to running:           ", quantiles(to_running[name]))
        for who, count in sorted(slow_by[name].items()):
            print(f"  {who}: {count}")
    print("upstream woken to running:    ", quantiles(to_running["upstream"]))


if __name__ == "__main__":
    main()
