#!/usr/bin/env python3
"""mlscope-proxy's added latency against nginx's over several runs of the pass-through bench.

One run of `mlscope-bench passthrough` on two shared cores moves a p99 by a millisecond from run
to run (BENCHMARKS.md), so "never above nginx's" can only be read over several. Reads the reports
of N runs of the same command (each the bench's whole output, as `... > run-N.txt`) and prints,
per endpoint and rate, each run's added p50 and p99 of nginx and of the proxy, in how many runs
the proxy's was not above nginx's, and in how many its added p99 was within the limit.

Usage: load-tests/perf/versus-nginx.py [--limit-ms 0.5] RUN.txt...
"""
import argparse
import re
import sys

ROW = re.compile(r"^\|\s*(?P<endpoint>[^|]+?)\s*\|\s*(?P<rate>\d+)\s*\|\s*(?P<target>[^|]+?)\s*\|(?P<rest>.*)\|\s*$")


def added(path):
    """{(endpoint, rate): {target: (added p50, added p99)}} of one report's first table."""
    rows = {}
    with open(path) as f:
        for line in f:
            m = ROW.match(line)
            if not m:
                continue
            cells = [c.strip() for c in m["rest"].split("|")]
            # requests | errors | p50 | p99 | p99.9 | +p50 | +p99 | +p99.9
            if len(cells) != 8 or not cells[5].startswith(("+", "-")):
                continue
            key = (m["endpoint"], int(m["rate"]))
            rows.setdefault(key, {})[m["target"]] = (float(cells[5]), float(cells[6]))
    if not rows:
        sys.exit(f"versus-nginx.py: no pass-through table in {path}")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit-ms", type=float, default=0.5, help="added p99 limit (ms)")
    parser.add_argument("runs", nargs="+")
    args = parser.parse_args()
    runs = [added(path) for path in args.runs]
    keys = sorted({k for run in runs for k in run})
    print(f"| endpoint | rate req/s | runs | added p50, nginx / proxy per run (ms) | proxy not above nginx at p50 "
          f"| added p99, nginx / proxy per run (ms) | proxy not above nginx at p99 | proxy's added p99 ≤ {args.limit_ms} ms |")
    print("|---|---:|---:|---|---:|---|---:|---:|")
    for key in keys:
        pairs = [(run[key]["nginx"], run[key]["mlscope-proxy"]) for run in runs
                 if "nginx" in run.get(key, {}) and "mlscope-proxy" in run.get(key, {})]
        n = len(pairs)
        p50 = ", ".join(f"{a[0]:+.2f} / {b[0]:+.2f}" for a, b in pairs)
        p99 = ", ".join(f"{a[1]:+.2f} / {b[1]:+.2f}" for a, b in pairs)
        below50 = sum(b[0] <= a[0] for a, b in pairs)
        below99 = sum(b[1] <= a[1] for a, b in pairs)
        within = sum(b[1] <= args.limit_ms for _, b in pairs)
        print(f"| {key[0]} | {key[1]} | {n} | {p50} | {below50} of {n} | {p99} | {below99} of {n} | {within} of {n} |")


if __name__ == "__main__":
    main()
