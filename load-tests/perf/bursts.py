#!/usr/bin/env python3
"""Requests of the pass-through bench sent before the one before them was answered.

At a fixed rate a request normally finds the one before it answered: at 500 requests/s they are
2 ms apart and a forward takes a few tenths of a millisecond. Two requests meet when the
generator sends them together (its thread woke late past both schedules) or when the first was
slow. Reads the CSV files the bench wrote with `--samples-out` (the `released_us` column) and
prints, per endpoint, rate and target:

- how many requests were released before the previous request of their slice had its answer
  (a pair), and how many took over --slow-ms (1 ms);
- how many of the slow ones were the second of a pair: where nearly all are, a target's tail is
  made of pairs, not of lone requests;
- for the pairs, the median gap between the two releases and the median time the second
  finished after the first. A small gap with a large finish says what held the second: in files
  of a bench before 2ed90c4, about 1.1 ms in every target, direct included, was the generator's
  own timer (BENCHMARKS.md, "The generator's own millisecond"); through mlscope-proxy a second
  `log-batch` into the same run waits for the first's batch (docs/write-path.md, group commit).

Counts are of successful requests (the files hold no others), and a failed request leaves a
hole: the request after it is paired with nothing. Pool files of one bench version only: before
2ed90c4 a late send's `released_us` was its schedule, from it on when the generator let it go.

Usage: load-tests/perf/bursts.py [--slow-ms 1] RUN.csv...
"""
import argparse
import csv
import statistics
import sys


def read(paths):
    """{(endpoint, rate, target): {(run, slice): [(sequence, micros, released_us)]}}."""
    slices = {}
    for run, path in enumerate(paths):
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None:
                sys.exit(f"bursts.py: {path} is empty")
            if "released_us" not in reader.fieldnames:
                sys.exit(f"bursts.py: {path} has no released_us column (a samples file of an older bench)")
            for r in reader:
                key = (r["endpoint"], int(r["rate"]), r["target"])
                slices.setdefault(key, {}).setdefault((run, int(r["slice"])), []).append(
                    (int(r["sequence"]), int(r["micros"]), int(r["released_us"])))
    if not slices:
        sys.exit("bursts.py: no samples in " + ", ".join(paths))
    return slices


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slow-ms", type=float, default=1.0, help="a request this slow counts as slow")
    parser.add_argument("runs", nargs="+")
    args = parser.parse_args()
    slow_us = args.slow_ms * 1000
    slices = read(args.runs)
    print(f"| endpoint | rate req/s | target | requests | pairs | over {args.slow_ms:g} ms | "
          "of those, the second of a pair | pairs: release gap, median µs | "
          "pairs: second finished after the first, median µs |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for (endpoint, rate, target), by_slice in sorted(slices.items()):
        total = slow = slow_second = 0
        gaps, after = [], []
        for requests in by_slice.values():
            requests.sort()
            previous = None
            for sequence, micros, released in requests:
                total += 1
                # Only the request just before in the schedule: a failed one left a hole.
                second = (previous is not None and previous[0] == sequence - 1
                          and previous[2] + previous[1] > released)
                if second:
                    gaps.append(released - previous[2])
                    after.append(released + micros - previous[2] - previous[1])
                if micros > slow_us:
                    slow += 1
                    slow_second += second
                previous = (sequence, micros, released)
        median = lambda values: f"{statistics.median(values):.0f}" if values else "—"
        print(f"| {endpoint} | {rate} | {target} | {total} | {len(gaps)} ({100 * len(gaps) / total:.2f} %) "
              f"| {slow} ({100 * slow / total:.2f} %) | {slow_second} | {median(gaps)} | {median(after)} |")


if __name__ == "__main__":
    main()
