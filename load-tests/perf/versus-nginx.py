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
- the proxy's p99 less nginx's, with a 95 % interval from a bootstrap (R rounds, default 2000)
  that draws whole rounds of the bench, a run's slice k of every target together: requests of one
  slice share its conditions, and neighbouring slices of the two targets share the machine's. An
  interval that excludes 0 says which of the two is above, beyond these runs' noise;
- the proxy's p50 less nginx's, and the share of each target's requests over --slow-ms (1 ms)
  with the proxy's less nginx's, on the same bootstrap. On a machine whose slow stretches delay
  about one request in a hundred by a millisecond or more, a p99 sits at that share's knee and
  jumps by a millisecond as the share crosses 1 %; the share itself says which target the slow
  stretches caught more often, without the jump;
- the same pooled p99 without the first N requests of each slice (default 3), and the median of
  the slices' first requests: each slice starts after its target sat idle while the others took
  their turns (one or four slices with three targets), so these say how much of a p99 is the
  first requests after idling;
- per run, every slice in the order they ran, marked where at least --slow-count requests took
  over --slow-ms (5, 1 ms): whether slow requests come in bursts that hit every target.

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
    """{(endpoint, rate): {target: [(run, slice, order, sequence, micros), ...]}} over every file.
    `order` is the slice's place in time among all targets' slices (-1 in files without it)."""
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
                    (run, int(r["slice"]), int(r.get("order") or -1), int(r["sequence"]), int(r["micros"])))
    if not rows:
        sys.exit("versus-nginx.py: no samples in " + ", ".join(paths))
    return rows


RUN, SLICE, ORDER, SEQUENCE, MICROS = range(5)


def pooled(args):
    try:
        import numpy as np
    except ImportError:
        sys.exit("versus-nginx.py: --samples needs numpy; run it with the project's .venv/bin/python")
    rng = np.random.default_rng(1)
    data = read_samples(args.runs)
    first = args.first
    print(f"{len(args.runs)} runs pooled; intervals: 95 %, {args.rounds} bootstrap rounds, each drawing whole rounds "
          f"(a run's slice k of every target together); 'without the first {first}': each slice's first {first} "
          f"requests left out.\n")
    print("| endpoint | rate req/s | target | requests | p50 ms | p99 ms | added p99 ms | p99 without the first "
          f"{first} ms | slices' first request, median ms | share of the requests above p99 that are among the "
          f"first {first} (of all requests) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    verdicts = []
    for key in sorted(data):
        arrays = {t: np.array(v, dtype=np.int64) for t, v in data[key].items()}
        direct_p99 = pct(np, arrays["direct"][:, MICROS], 99) if "direct" in arrays else None
        for target in sorted(arrays, key=lambda t: (t != "direct", t != "nginx", t)):
            a = arrays[target]
            lat = a[:, MICROS]
            p99 = pct(np, lat, 99)
            early = a[:, SEQUENCE] < first
            tail = lat > p99
            share = f"{early[tail].mean():.0%}" if tail.any() else "—"
            add = "—" if direct_p99 is None or target == "direct" else f"{(p99 - direct_p99) / 1000:+.2f}"
            print(f"| {key[0]} | {key[1]} | {target} | {len(a)} | {ms(pct(np, lat, 50))} | {ms(p99)} | {add} | "
                  f"{ms(pct(np, lat[~early], 99))} | {ms(pct(np, lat[a[:, SEQUENCE] == 0], 50))} | "
                  f"{share} ({early.mean():.1%}) |")
        if "nginx" in arrays and "mlscope-proxy" in arrays:
            nginx, proxy = arrays["nginx"], arrays["mlscope-proxy"]
            p50 = lambda lat: np.percentile(lat, 50) / 1000
            slow = lambda lat: 100 * np.mean(lat > args.slow_ms * 1000)
            shares = {t: slow(arrays[t][:, MICROS]) for t in arrays}
            verdicts.append((key, difference(np, rng, nginx, proxy, args),
                             compare(np, rng, nginx, proxy, p50, args.rounds),
                             shares, compare(np, rng, nginx, proxy, slow, args.rounds)))
    print("\n| endpoint | rate req/s | proxy's p99 less nginx's, ms (95 % interval) | the same without each "
          f"slice's first {first} | proxy's p50 less nginx's, ms | requests over {args.slow_ms:g} ms: direct / "
          f"nginx / proxy | proxy's share less nginx's, points |")
    print("|---|---:|---|---|---|---|---|")
    interval = lambda r, f: "—" if r is None else f"{r[0]:+{f}} ({r[1]:+{f}} to {r[2]:+{f}})"
    for key, p99s, p50, shares, slow in verdicts:
        cells = " | ".join(interval(r, ".3f") for r in p99s)
        share = " / ".join(f"{shares[t]:.2f} %" if t in shares else "—" for t in ("direct", "nginx", "mlscope-proxy"))
        print(f"| {key[0]} | {key[1]} | {cells} | {interval(p50, '.3f')} | {share} | {interval(slow, '.2f')} |")
    slow_slices(data, args)


def pct(np, values, q):
    """The q-th percentile, or None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


def ms(micros):
    return "—" if micros is None else f"{micros / 1000:.2f}"


def difference(np, rng, nginx, proxy, args):
    """p99(proxy) - p99(nginx) in ms with a 95 % bootstrap interval, for all the requests and for
    all but each slice's first `args.first`; None where either has no requests left."""
    p99 = lambda lat: np.percentile(lat, 99) / 1000
    return [compare(np, rng, nginx[keep(nginx)], proxy[keep(proxy)], p99, args.rounds)
            for keep in (lambda a: np.ones(len(a), bool), lambda a: a[:, SEQUENCE] >= args.first)]


def compare(np, rng, nginx, proxy, stat, rounds):
    """stat(proxy's latencies) - stat(nginx's) with a 95 % bootstrap interval, or None where either
    has no requests. Each bootstrap round draws whole rounds, (run, slice) pairs, with replacement,
    and takes both targets' slices of each drawn round: the two ran next to each other, so what a
    round's conditions did to one it did to the other's neighbouring slice too."""
    if not len(nginx) or not len(proxy):
        return None
    common = ({(r, s) for r, s in nginx[:, [RUN, SLICE]].tolist()}
              & {(r, s) for r, s in proxy[:, [RUN, SLICE]].tolist()})
    rounds_seen = sorted(common)
    by_round_n = split(np, nginx, rounds_seen)
    by_round_p = split(np, proxy, rounds_seen)
    point = stat(proxy[:, MICROS]) - stat(nginx[:, MICROS])
    diffs = np.empty(rounds)
    for i in range(rounds):
        drawn = rng.integers(0, len(rounds_seen), len(rounds_seen))
        diffs[i] = (stat(np.concatenate([by_round_p[j] for j in drawn]))
                    - stat(np.concatenate([by_round_n[j] for j in drawn])))
    lo, hi = np.percentile(diffs, [2.5, 97.5])
    return point, lo, hi


def split(np, a, rounds):
    """The latencies of `a` per (run, slice) of `rounds`, in that order (empty where it has none)."""
    index = {r: i for i, r in enumerate(rounds)}
    groups = [[] for _ in rounds]
    for run, slice_, micros in a[:, [RUN, SLICE, MICROS]].tolist():
        i = index.get((run, slice_))
        if i is not None:
            groups[i].append(micros)
    return [np.array(g, dtype=np.int64) for g in groups]


def slow_slices(data, args):
    """Per run, endpoint and rate, every slice in the order they ran, marked where at least
    `args.slow_count` of its requests took over `args.slow_ms`: where slow requests come in
    bursts that hit whichever target had its turn, the marks come in runs of neighbouring slices
    of different targets."""
    letters = {"direct": "D", "nginx": "N", "mlscope-proxy": "P"}
    tally = {}
    print(f"\nSlices in the order they ran, per run (`.`: fewer than {args.slow_count} requests over "
          f"{args.slow_ms} ms; else the target's letter: D direct, N nginx, P mlscope-proxy, X another):\n")
    print("```")
    for key in sorted(data):
        runs = sorted({s[RUN] for v in data[key].values() for s in v})
        for run in runs:
            slow, seen = {}, set()
            for target, samples in data[key].items():
                for s in samples:
                    if s[RUN] != run or s[ORDER] < 0:
                        continue
                    seen.add(s[ORDER])
                    slow.setdefault((s[ORDER], target), 0)
                    if s[MICROS] > args.slow_ms * 1000:
                        slow[(s[ORDER], target)] += 1
            if not seen:
                continue
            marks = ["."] * (max(seen) + 1)
            for (order, target), count in slow.items():
                if count >= args.slow_count:
                    marks[order] = letters.get(target, "X")
                marked = tally.setdefault(key, {}).setdefault(target, [0, 0])
                marked[0] += count >= args.slow_count
                marked[1] += 1
            print(f"{key[0]:>9} {key[1]:>4}/s run {run + 1}: {''.join(marks)}")
    print("```")
    print("\nSlices marked, per target: " + "; ".join(
        f"{key[0]} {key[1]}/s " + ", ".join(f"{t} {m} of {n}" for t, (m, n) in sorted(targets.items()))
        for key, targets in sorted(tally.items())))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit-ms", type=float, default=0.5, help="added p99 limit (ms)")
    parser.add_argument("--samples", action="store_true", help="the runs are --samples-out CSV files")
    parser.add_argument("--first", type=int, default=3, help="with --samples: requests per slice counted as after idling")
    parser.add_argument("--rounds", type=int, default=2000, help="with --samples: bootstrap rounds")
    parser.add_argument("--slow-ms", type=float, default=1.0, help="with --samples: a request this slow marks its slice")
    parser.add_argument("--slow-count", type=int, default=5, help="with --samples: requests over --slow-ms that mark a slice")
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
