#!/usr/bin/env python3
"""CPU time and run-queue wait of the proxies under a bench, per process, from the kernel's
schedstat (no performance counters needed, so it works in guests that expose none).

    load-tests/perf/schedstat.py sample [--every 20] OUT &   # while the bench runs; kill it after
    load-tests/perf/schedstat.py sum OUT...                   # per process, first to last reading

`sample` reads /proc/<pid>/task/<tid>/schedstat and the context-switch counts of every thread of
mlscope-proxy, nginx's workers and mlscope-bench every --every seconds. `sum` adds up, per
process kind and file, each thread's CPU time, time runnable but waiting for a CPU, and
involuntary switches between its first and last reading: the proxy's serving threads
(`mlscope-serve-*`), its other threads, nginx's workers, the bench's stub upstream and the rest
of the bench. Divide by the requests each target served for a figure per request. A thread seen
in one reading only counts nothing, and with --every 20 the first reading may come after the
targets' warm-up began: the edges are approximate and alike for every target.
"""
import argparse
import collections
import os
import sys
import time

WANTED = ("mlscope-proxy", "nginx", "mlscope-bench")


def processes():
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if comm == "nginx" and b"worker process" not in cmdline:
            continue
        program = os.path.basename(cmdline.split(b"\0")[0].decode(errors="replace"))
        if comm in WANTED or program in WANTED:
            yield pid, comm


def sample(args):
    with open(args.out, "a") as out:
        while True:
            now = time.time()
            for pid, comm in processes():
                try:
                    tids = os.listdir(f"/proc/{pid}/task")
                except OSError:
                    continue
                for tid in tids:
                    base = f"/proc/{pid}/task/{tid}"
                    try:
                        with open(f"{base}/schedstat") as f:
                            run, wait, slices = f.read().split()[:3]
                        with open(f"{base}/comm") as f:
                            name = f.read().strip().replace(" ", "_")
                        switches = {}
                        with open(f"{base}/status") as f:
                            for line in f:
                                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                                    key, value = line.split(":")
                                    switches[key] = int(value)
                    except OSError:
                        continue
                    out.write(f"{now:.3f} {pid} {comm} {tid} {name} {run} {wait} {slices} "
                              f"{switches.get('voluntary_ctxt_switches', 0)} "
                              f"{switches.get('nonvoluntary_ctxt_switches', 0)}\n")
            out.flush()
            time.sleep(args.every)


def kind(comm, thread):
    if comm == "mlscope-proxy":
        return "proxy serving threads" if thread.startswith("mlscope-serve") else "proxy, other threads"
    if comm == "mlscope-bench":
        return "bench's stub upstream" if thread == "stub-upstream" else "bench"
    return "nginx workers" if comm == "nginx" else comm


def summed(args):
    for path in args.files:
        first, last = {}, {}
        with open(path) as f:
            for line in f:
                fields = line.split()
                if len(fields) != 10:
                    continue
                key = (fields[2], fields[1], fields[3], fields[4])
                first.setdefault(key, list(map(int, fields[5:])))
                last[key] = list(map(int, fields[5:]))
        totals = collections.defaultdict(lambda: [0, 0, 0])
        for key, start in first.items():
            end = last[key]
            total = totals[kind(key[0], key[3])]
            total[0] += end[0] - start[0]
            total[1] += end[1] - start[1]
            total[2] += end[4] - start[4]
        print(f"{path}:")
        for name, (run, wait, involuntary) in sorted(totals.items()):
            print(f"  {name:24} CPU {run / 1e6:9.0f} ms   waiting for a CPU {wait / 1e6:8.0f} ms   "
                  f"involuntary switches {involuntary}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sample", help="read every thread's schedstat every --every seconds into OUT")
    s.add_argument("--every", type=float, default=20.0)
    s.add_argument("out")
    t = sub.add_parser("sum", help="per process kind, first to last reading")
    t.add_argument("files", nargs="+")
    args = parser.parse_args()
    try:
        sample(args) if args.command == "sample" else summed(args)
    except KeyboardInterrupt:
        pass
    except OSError as e:
        sys.exit(f"schedstat.py: {e}")


if __name__ == "__main__":
    main()
