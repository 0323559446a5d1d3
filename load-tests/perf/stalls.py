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

With `--samples RUN.csv` (the bench's `--samples-out`, whose `released_us` is on the monotonic
clock; record with `perf sched record -k mono` to stamp the events on the same clock), also: per
target, its requests sent while the record ran, over --slow-ms (1 ms) and the rest, and how many
of each overlapped any thread's stretch over --burst-ms (perf's own left out), how many of the
others a watched thread's wake-up over 0.5 ms, and how many slow ones neither. The rest's shares
are what chance alone gives: a cause is one the slow requests meet far more often.

Usage: perf sched record -k mono -a -o sched.data -- sleep 15    # beside the load
       perf script -i sched.data -F comm,tid,cpu,time,event,trace \
           | load-tests/perf/stalls.py [--samples RUN.csv]
"""
import argparse
import bisect
import collections
import csv
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
    parser.add_argument("--samples", help="the bench's --samples-out CSV of the same run")
    parser.add_argument("--slow-ms", type=float, default=1.0)
    args = parser.parse_args()

    waking = {}  # tid -> (time, comm)
    # Threads on a CPU or preempted (switched out runnable): a wake-up of one ends in no switch
    # of its own, so it is not a wake-up that waited.
    runnable = set()
    delays = collections.defaultdict(list)  # family -> [ms]
    running = {}  # cpu -> (tid, comm, since)
    stretches = collections.defaultdict(list)  # (tid, comm) -> [(start, ms)]
    delayed = []  # (woken, ran) of watched wake-ups over 0.5 ms
    first = last = None  # what the record covers
    for line in sys.stdin:
        m = LINE.match(line)
        if not m:
            continue
        cpu, t, event, trace = m[3], float(m[4]), m[5], m[6]
        first, last = first if first is not None else t, t
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
                if ms > 0.5 and family(comm) in args.watch:
                    delayed.append((woken, t))

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

    def long_stretches(keep):
        return Intervals((s, s + ms / 1000, f"{comm} ({tid})")
                         for (tid, comm), runs in bursts.items() for s, ms in runs if keep(comm))

    others = long_stretches(lambda comm: family(comm) not in args.watch)
    slow = [(woken, ran) for woken, ran in delayed if ran - woken > 0.001]
    overlapped = collections.Counter()
    for woken, ran in slow:
        for who in {i[2] for i in others.over(woken, ran)} or {"nothing over the burst length"}:
            overlapped[who] += 1
    print(f"\nWake-ups of {', '.join(args.watch)} over 1 ms: {len(slow)}; overlapping a stretch of:")
    for who, n in overlapped.most_common():
        print(f"- {who}: {n}")

    if args.samples and first is not None:
        # Every thread's long stretches here, the watched ones' too; `perf`'s own are the record's.
        everyone = long_stretches(lambda comm: not comm.startswith("perf"))
        requests(args, (first, last), everyone, Intervals(delayed))


class Intervals:
    """(start, end, ...) tuples, sorted by start, searched for those overlapping a span."""

    def __init__(self, intervals):
        self.intervals = sorted(intervals)
        self.starts = [i[0] for i in self.intervals]

    def over(self, begin, end):
        """The intervals overlapping [begin, end]."""
        return [i for i in self.intervals[:bisect.bisect_right(self.starts, end)]
                if i[0] < end and i[1] > begin]


def requests(args, span, bursts, delayed):
    """Each target's requests sent while the record ran, slow and not, by what overlapped them:
    the share of the fast ones overlapping anything is what chance alone gives."""
    rows = collections.defaultdict(collections.Counter)
    with open(args.samples, newline="") as f:
        reader = csv.DictReader(f)
        if "released_us" not in (reader.fieldnames or ()):
            sys.exit(f"{args.samples} has no released_us column: written by a bench before it "
                     "stamped each request's send time; run the bench again")
        for r in reader:
            released = int(r["released_us"]) / 1e6
            micros = int(r["micros"])
            if not span[0] <= released <= span[1]:
                continue
            speed = "slow" if micros > args.slow_ms * 1000 else "fast"
            c = rows[(r["endpoint"], r["rate"], r["target"])]
            c[speed] += 1
            end = released + micros / 1e6
            if bursts.over(released, end):
                c[speed + " burst"] += 1
            elif delayed.over(released, end):
                c[speed + " delayed"] += 1
    if not rows:
        sys.exit(f"no request of {args.samples} was sent while the record ran: record with "
                 "`perf sched record -k mono` while the bench runs")

    def share(c, speed, what):
        return f"{c[speed + ' ' + what]} ({100 * c[speed + ' ' + what] / max(c[speed], 1):.1f} %)"

    print(f"\n| endpoint | rate | target | requests over {args.slow_ms} ms / the rest | "
          f"overlapping a thread's stretch over {args.burst_ms} ms, slow / the rest | "
          "of the others, a watched wake-up over 0.5 ms, slow / the rest | slow with neither |")
    print("|---|---:|---|---|---|---|---:|")
    for (endpoint, rate, target), c in sorted(rows.items()):
        neither = c["slow"] - c["slow burst"] - c["slow delayed"]
        print(f"| {endpoint} | {rate} | {target} | {c['slow']} / {c['fast']} | "
              f"{share(c, 'slow', 'burst')} / {share(c, 'fast', 'burst')} | "
              f"{share(c, 'slow', 'delayed')} / {share(c, 'fast', 'delayed')} | {neither} |")


if __name__ == "__main__":
    main()
