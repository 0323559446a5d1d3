#!/usr/bin/env python3
"""Per request, from a callgrind file of `instructions.sh`: the instructions each function ran
itself (inlined code counts in the function it was inlined into), and how often functions
matching a pattern were called, by caller.

A profile-guided build inlines most of the write path, so counts of calls (a hash, an
allocation) are read on a plain `cargo build --release`; self costs on either.

Usage: load-tests/perf/callgrind_calls.py CALLGRIND_FILE REQUESTS [PATTERN] [--top N]

  load-tests/perf/callgrind_calls.py callgrind.1234.1 2000                   # self cost, top 30
  load-tests/perf/callgrind_calls.py callgrind.1234.1 2000 'hash_one'        # keyed hashes
  load-tests/perf/callgrind_calls.py callgrind.1234.1 2000 '^(malloc|realloc|calloc)$'
"""
import argparse
import collections
import re
import sys


def read(path):
    """Self cost per function, and call counts per (caller, callee), from callgrind's format
    (names compressed as `(id) name` on first use, `(id)` after)."""
    names = {}

    def name(text):
        match = re.match(r"\((\d+)\)(?: (.*))?", text)
        if not match:
            return text
        if match.group(2):
            names[match.group(1)] = match.group(2)
        return names[match.group(1)]

    self_cost = collections.Counter()
    calls = collections.Counter()
    current = callee = None
    cost_of_call = False
    with open(path) as lines:
        for line in lines:
            line = line.rstrip("\n")
            if line.startswith("fn="):
                current = name(line[3:])
            elif line.startswith("cfn="):
                callee = name(line[4:])
            elif line.startswith("calls="):
                calls[(current, callee)] += int(line[6:].split()[0])
                # The next cost line is the call's inclusive cost, not the caller's own.
                cost_of_call = True
            elif line[:1].isdigit() or line[:1] in "+-*":
                fields = line.split()
                if len(fields) >= 2 and not cost_of_call:
                    self_cost[current] += int(fields[1])
                cost_of_call = False
    return self_cost, calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file")
    parser.add_argument("requests", type=int)
    parser.add_argument("pattern", nargs="?")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    try:
        self_cost, calls = read(args.file)
    except OSError as error:
        sys.exit(f"callgrind_calls.py: {error}")
    per = args.requests
    if args.pattern is None:
        print(f"{sum(self_cost.values()) / per:,.0f} instructions per request in all")
        for function, cost in self_cost.most_common(args.top):
            print(f"{cost / per:10,.0f}  {function[:160]}")
        return
    pattern = re.compile(args.pattern)
    by_caller = collections.Counter()
    for (caller, callee), count in calls.items():
        if callee and pattern.search(callee):
            by_caller[caller] += count
    print(f"{sum(by_caller.values()) / per:.2f} calls per request to /{args.pattern}/")
    for caller, count in by_caller.most_common(args.top):
        print(f"{count / per:8.2f}  {caller[:160]}")


if __name__ == "__main__":
    main()
