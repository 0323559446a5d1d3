#!/usr/bin/env python3
"""Which wake-ups the machine delays by a millisecond or more, and what else ran meanwhile.

Reads `perf script -F comm,tid,cpu,time,event,trace` output of a machine-wide scheduler record
(`perf sched record -a`, which takes `sched_waking` and `sched_switch`) and prints:

- per thread name (numbers at the end dropped: `mlscope-serve-1` and `-2` are one row), how long
  its wake-ups took from `sched_waking` to being switched in: p50, p99, the longest, and how many
  took over 0.5 and over 1 ms (a wake-up of a thread already on a CPU or preempted is not one;
  the record's first sight of a thread counts it asleep);
- every thread that ran for over --burst-ms (1 ms) at a stretch, with how many such stretches,
  the longest and the median time between their starts: what else wants a CPU now and then;
- for the wake-ups of the named threads (--watch, default: the bench, its stub, nginx and the
  proxy's serving threads) that took over 1 ms: how many overlapped such a stretch of another
  thread on any CPU, by that thread.

A wake-up's delay counts the time its CPU was taken by another thread (the run queue) as well as
the time a halted virtual CPU took to run again; the second is not the guest's to see, and shows
as a CPU that stays idle while a thread it was to run waits.

Usage: perf sched record -a -o sched.data -- sleep 15    # beside the load
       perf script -i sched.data -F comm,tid,cpu,time,event,trace | load-tests/perf/stalls.py
"""
import argparse
import bisect
import collections
import re
import statistics
import sys

LINE = re.compile(r"\s*(.+?)\s+(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:(\w+):\s*(.*)")
FIELD = re.compile(r"(\w+)=(\S+)")
WATCHED = ("bench", "stub-upstream", "nginx", "mlscope-serve")


def family(comm):
    return re.sub(r"[-/:]?\d+$", "", comm)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--burst-ms", type=float, default=1.0)
    parser.add_argument("--watch", nargs="*", default=list(WATCHED))
    args = parser.parse_args()

    waking = {}  # tid -> (time, comm)
    # Threads on a CPU or preempted (switched out runnable): a wake-up of one ends in no switch
    # of its own, so it is not a wake-up that waited.
    runnable = set()
    delays = collections.defaultdict(list)  # family -> [ms]
    slow = []  # (start, end, family) of watched wake-ups over 1 ms
    running = {}  # cpu -> (tid, comm, since)
    stretches = collections.defaultdict(list)  # (tid, comm) -> [(start, ms)]
    for line in sys.stdin:
        m = LINE.match(line)
        if not m:
            continue
        cpu, t, event, trace = m[3], float(m[4]), m[5], m[6]
        fields = dict(FIELD.findall(trace))
        if event == "sched_waking":
            if fields["pid"] not in runnable:
                waking.setdefault(fields["pid"], (t, fields["comm"]))
        elif event == "sched_switch":
            # prev_comm and next_comm may hold spaces; their pids are what is matched.
            prev_pid, next_pid = fields["prev_pid"], fields["next_pid"]
            next_comm = re.search(r"next_comm=(.*) next_pid=", trace)[1]
            if cpu in running and running[cpu][0] == prev_pid and prev_pid != "0":
                _, comm, since = running[cpu]
                stretches[(prev_pid, comm)].append((since, (t - since) * 1000))
            running[cpu] = (next_pid, next_comm, t)
            # Switched out without a switch in seen since its wake-up: the record lost an event.
            waking.pop(prev_pid, None)
            if fields["prev_state"].startswith("R"):
                runnable.add(prev_pid)
            else:
                runnable.discard(prev_pid)
            runnable.add(next_pid)
            if next_pid in waking:
                woken, comm = waking.pop(next_pid)
                ms = (t - woken) * 1000
                delays[family(comm)].append(ms)
                if ms > 1 and family(comm) in args.watch:
                    slow.append((woken, t, family(comm)))

    print("| thread | wake-ups | p50 ms | p99 ms | longest ms | over 0.5 ms | over 1 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, v in sorted(delays.items(), key=lambda kv: -len(kv[1]))[:16]:
        v.sort()
        n = len(v)
        print(f"| {name} | {n} | {v[n // 2]:.3f} | {v[int(n * 0.99)]:.3f} | {v[-1]:.2f} | "
              f"{sum(x > 0.5 for x in v)} | {sum(x > 1 for x in v)} |")

    bursts = {key: [(s, ms) for s, ms in runs if ms > args.burst_ms]
              for key, runs in stretches.items()}
    bursts = {key: runs for key, runs in bursts.items() if runs}
    print(f"\n| thread (tid) | stretches over {args.burst_ms} ms | longest ms | median between starts, s |")
    print("|---|---:|---:|---:|")
    for (tid, comm), runs in sorted(bursts.items(), key=lambda kv: -len(kv[1])):
        starts = [s for s, _ in runs]
        gaps = [b - a for a, b in zip(starts, starts[1:])]
        gap = f"{statistics.median(gaps):.2f}" if gaps else "—"
        print(f"| {comm} ({tid}) | {len(runs)} | {max(ms for _, ms in runs):.2f} | {gap} |")

    spans = sorted((s, s + ms / 1000, f"{comm} ({tid})")
                   for (tid, comm), runs in bursts.items() for s, ms in runs
                   if family(comm) not in args.watch)
    starts = [s for s, _, _ in spans]
    overlapped = collections.Counter()
    for woken, ran, _ in slow:
        hit = {who for s, e, who in spans[:bisect.bisect_right(starts, ran)] if s < ran and e > woken}
        for who in hit or {"nothing over the burst length"}:
            overlapped[who] += 1
    print(f"\nWake-ups of {', '.join(args.watch)} over 1 ms: {len(slow)}; overlapping a stretch of:")
    for who, n in overlapped.most_common():
        print(f"- {who}: {n}")


if __name__ == "__main__":
    main()
