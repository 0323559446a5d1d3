#!/usr/bin/env python3
"""mlscope-proxy's added latency against nginx's over several runs of the pass-through bench.

One run of `mlscope-bench passthrough` on two shared cores moves a p99 by a millisecond from run
to run (BENCHMARKS.md), so "never above nginx's" can only be read over several. Reads the reports
of N runs of the same command (each the bench's whole output, as `... > run-N.txt`) and prints,
per endpoint and rate, each run's added p50 and p99 of nginx and of the proxy, in how many runs
the proxy's was not above nginx's, and in how many its added p99 was within the limit.

Usage: load-tests/perf/versus-nginx.py [--limit-ms 0.5] RUN.txt...
       load-tests/perf/versus-nginx.py --samples [--first N] [--rounds R] RUN.csv...

With `--samples`, reads instead the CSV files the bench wrote with `--samples-out` (every
successful request's latency and its place), pools each target's requests over the runs, and
prints per endpoint and rate:

- each target's pooled p50 and p99, and the added p99 (the target's less direct's);
- the proxy's p99 less nginx's, with a 95 % interval from a bootstrap that resamples whole slices
  (R rounds, default 2000): requests of one slice share its conditions, so they are not resampled
  one by one. An interval that excludes 0 says which of the two is above, beyond these runs' noise;
- the same pooled p99 without the first N requests of each slice (default 3), and the median of
  the slices' first requests: each slice starts after the target sat idle while the others took
  their turns, so these say how much of a p99 is the first requests after idling.

`--samples` needs numpy (the project's virtual environment has it: `.venv/bin/python`).
"""
import argparse
import csv
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


def read_samples(paths):
    """{(endpoint, rate): {target: [(run, slice, sequence, micros), ...]}} over every file."""
    rows = {}
    for run, path in enumerate(paths):
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            wanted = {"endpoint", "rate", "target", "slice", "sequence", "micros"}
            if not wanted <= set(reader.fieldnames or ()):
                sys.exit(f"versus-nginx.py: {path} is not a samples file of mlscope-bench passthrough --samples-out")
            for r in reader:
                key = (r["endpoint"], int(r["rate"]))
                rows.setdefault(key, {}).setdefault(r["target"], []).append(
                    (run, int(r["slice"]), int(r["sequence"]), int(r["micros"])))
    if not rows:
        sys.exit("versus-nginx.py: no samples in " + ", ".join(paths))
    return rows


def pooled(args):
    try:
        import numpy as np
    except ImportError:
        sys.exit("versus-nginx.py: --samples needs numpy; run it with the project's .venv/bin/python")
    rng = np.random.default_rng(1)
    data = read_samples(args.runs)
    print(f"{len(args.runs)} runs pooled; intervals: 95 %, {args.rounds} bootstrap rounds over whole slices; "
          f"'without the first {args.first}': each slice's first {args.first} requests left out.\n")
    print("| endpoint | rate req/s | target | requests | p50 ms | p99 ms | added p99 ms | p99 without the first "
          f"{args.first} ms | slices' first request, median ms | share of the requests above p99 that are among "
          f"the first {args.first} |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    verdicts = []
    for key in sorted(data):
        targets = data[key]
        arrays = {t: np.array(v, dtype=np.int64) for t, v in targets.items()}
        direct_p99 = np.percentile(arrays["direct"][:, 3], 99) if "direct" in arrays else None
        for target in sorted(arrays, key=lambda t: (t != "direct", t != "nginx", t)):
            a = arrays[target]
            lat = a[:, 3] / 1000.0
            p50, p99 = np.percentile(lat, 50), np.percentile(lat, 99)
            steady = lat[a[:, 2] >= args.first]
            first = lat[a[:, 2] == 0]
            tail = a[:, 3] / 1000.0 > p99
            early_share = (a[tail, 2] < args.first).mean() if tail.any() else 0.0
            add = "—" if direct_p99 is None or target == "direct" else f"{p99 - direct_p99 / 1000.0:+.2f}"
            print(f"| {key[0]} | {key[1]} | {target} | {len(a)} | {p50:.2f} | {p99:.2f} | {add} | "
                  f"{np.percentile(steady, 99):.2f} | {np.median(first):.2f} | {early_share:.0%} |")
        if "nginx" in arrays and "mlscope-proxy" in arrays:
            verdicts.append((key, difference(np, rng, arrays["nginx"], arrays["mlscope-proxy"], args)))
    print("\n| endpoint | rate req/s | proxy's p99 less nginx's, ms (95 % interval) | the same without each "
          f"slice's first {args.first} |")
    print("|---|---:|---|---|")
    for key, ((d, lo, hi), (sd, slo, shi)) in verdicts:
        print(f"| {key[0]} | {key[1]} | {d:+.3f} ({lo:+.3f} to {hi:+.3f}) | {sd:+.3f} ({slo:+.3f} to {shi:+.3f}) |")


def difference(np, rng, nginx, proxy, args):
    """p99(proxy) - p99(nginx) in ms, with a bootstrap interval over whole slices; for all the
    requests, and for all but each slice's first `args.first`."""
    def blocks(a, keep):
        a = a[keep(a)]
        ids = a[:, 0] * 1_000_000 + a[:, 1]
        order = np.argsort(ids, kind="stable")
        a, ids = a[order], ids[order]
        cuts = np.flatnonzero(np.diff(ids)) + 1
        return np.split(a[:, 3] / 1000.0, cuts)

    out = []
    for keep in (lambda a: np.ones(len(a), bool), lambda a: a[:, 2] >= args.first):
        bn, bp = blocks(nginx, keep), blocks(proxy, keep)
        point = np.percentile(np.concatenate(bp), 99) - np.percentile(np.concatenate(bn), 99)
        diffs = np.empty(args.rounds)
        for i in range(args.rounds):
            pn = np.concatenate([bn[j] for j in rng.integers(0, len(bn), len(bn))])
            pp = np.concatenate([bp[j] for j in rng.integers(0, len(bp), len(bp))])
            diffs[i] = np.percentile(pp, 99) - np.percentile(pn, 99)
        lo, hi = np.percentile(diffs, [2.5, 97.5])
        out.append((point, lo, hi))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit-ms", type=float, default=0.5, help="added p99 limit (ms)")
    parser.add_argument("--samples", action="store_true", help="the runs are --samples-out CSV files")
    parser.add_argument("--first", type=int, default=3, help="with --samples: requests per slice counted as after idling")
    parser.add_argument("--rounds", type=int, default=2000, help="with --samples: bootstrap rounds")
    parser.add_argument("runs", nargs="+")
    args = parser.parse_args()
    if args.samples:
        return pooled(args)
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
