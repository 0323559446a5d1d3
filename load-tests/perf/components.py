#!/usr/bin/env python3
"""Shares of a profile's samples by the component of their innermost named frame.

Reads `perf script -F comm,tid,ip,sym` output of a `perf record --call-graph dwarf` profile of
mlscope-proxy and puts each sample in the component of the innermost frame that names one (the
request log line, hyper's server or client side, axum's middleware plumbing or router, the
forwarder, the proxy's own steps, tokio), so a sample deep in a system call counts for whoever
made it.

Usage: perf script -i perf.data -F comm,tid,ip,sym | load-tests/perf/components.py
"""
import collections
import re
import sys

# Innermost match wins; the first pattern in this list that matches a frame names it.
COMPONENTS = [
    # Writing to a file, tmpfs or pipe (the log); an eventfd wake-up is not one of these.
    ("the request's log line: its write(2)", r"ext4_file_write_iter|ext4_buffered_write_iter|shmem_file_write_iter|pipe_write"),
    ("the request's log line: formatting", r"layers::observe::\{\{closure\}\}::\{\{closure\}\}|json_lines|on_event|format_event"),
    ("the steps: observe", r"layers::observe"),
    ("the steps: concurrency limit", r"limit_concurrency|InFlight"),
    ("the steps: ambiguous requests", r"refuse_ambiguous"),
    ("the steps: security headers", r"security_headers"),
    ("the steps: fair share", r"fairshare"),
    ("the steps: 401 watch", r"watch_unauthorized"),
    ("the steps: route as MLflow", r"route_as_mlflow"),
    ("the forwarder", r"proxy::forward|Forwarder"),
    ("hyper's client side", r"hyper_util::client|hyper::client|role::Client"),
    ("axum's from_fn plumbing", r"from_fn|Next::run|BoxCloneSync|boxed_clone"),
    ("axum's router", r"Router|path_router|RouteFuture|matchit"),
    ("hyper's server side", r"role::Server|dispatch::Server|UpgradeableConnection|server::conn"),
    ("the accept loop", r"serve::accept"),
    ("tokio", r"tokio::runtime"),
]


def samples(lines):
    """Each sample as its list of frames, innermost first."""
    sample = None
    for line in lines:
        if not line.strip():
            continue
        if not line.startswith((" ", "\t")):
            if sample is not None:
                yield sample
            sample = []
        elif sample is not None:
            parts = line.strip().split(None, 1)
            sample.append(parts[-1])
    if sample is not None:
        yield sample


def main():
    patterns = [(name, re.compile(p)) for name, p in COMPONENTS]
    counts = collections.Counter()
    for frames in samples(sys.stdin):
        counts[next((name for f in frames for name, p in patterns if p.search(f)), "unattributed")] += 1
    total = sum(counts.values())
    if total == 0:
        sys.exit("components.py: no samples on stdin (perf script -F comm,tid,ip,sym of a --call-graph profile)")
    print(f"{total} samples")
    for name, n in counts.most_common():
        print(f"{100 * n / total:5.1f} %  {name}")


if __name__ == "__main__":
    main()
