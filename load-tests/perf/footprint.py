#!/usr/bin/env python3
"""The code a callgrind run executed: distinct instructions, 64-byte cache lines and 4 KiB pages.

Usage: footprint.py [--by-function N] CALLGRIND_DUMP   (a dump written with --dump-instr=yes;
instructions.sh with FOOTPRINT=1 writes one and calls this)

With --by-function N it also prints the N functions that hold the most of those lines, and the
lines per crate (the first part of each function's path): where the footprint lies.

A request that finds its code out of the caches (the machine ran other programs since the last
one) pays for every line and page of code it touches, whatever it executes there; these counts
are that footprint, over all the requests of the dump together (one request touches at most
that). Addresses are per object file, so a line or page is one of the file's own.
"""
import re
import sys

COST = re.compile(r"^(0x[0-9a-fA-F]+|[+-]\d+|\*)\s")


def compressed(spec, names):
    """The name a compressed spec ("(7) /path" or "(7)") stands for, recording a new one."""
    spec = spec.strip()
    match = re.match(r"\((\d+)\)\s*(.*)", spec)
    if not match:
        return spec
    number, name = match.groups()
    if name:
        names[number] = name
    return names.get(number, number)


def footprint(lines):
    """{(object, address): function} of every instruction that ran."""
    executed = {}
    objects, functions = {}, {}
    ob = fn = None
    address = 0
    for line in lines:
        # Callgrind compresses names: "fn=(12) name" names one once, "fn=(12)" refers back to it;
        # a called function ("cfn=") or its object ("cob=") may be named first.
        if line.startswith("fn="):
            fn = compressed(line[3:], functions)
            continue
        if line.startswith("cfn="):
            compressed(line[4:], functions)
            continue
        if line.startswith("cob="):
            compressed(line[4:], objects)
            continue
        if line.startswith("ob="):
            ob = compressed(line[3:], objects)
            continue
        match = COST.match(line)
        if not match:
            continue
        position = match.group(1)
        if position.startswith("0x"):
            address = int(position, 16)
        elif position != "*":
            address += int(position)
        costs = line.split()[2:]
        if costs and int(costs[0]) > 0:
            executed[(ob, address)] = fn
    return executed


def crate(function):
    """The first part of a function's path: `<serde_json::de::X as T>::f` -> `serde_json`."""
    name = function.lstrip("<&*( ")
    for prefix in ("mut ", "dyn ", "const "):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return re.split(r"::|<| ", name, maxsplit=1)[0] or function


def main():
    args = sys.argv[1:]
    top = 0
    if args[:1] == ["--by-function"]:
        top, args = int(args[1]), args[2:]
    with open(args[0]) as dump:
        executed = footprint(dump)
    lines = {(ob, a // 64) for ob, a in executed}
    pages = {(ob, a // 4096) for ob, a in executed}
    print(
        f"code executed: {len(executed)} distinct instructions, "
        f"{len(lines)} cache lines of 64 bytes ({len(lines) * 64 // 1024} KiB), "
        f"{len(pages)} pages of 4 KiB"
    )
    by_object = {}
    for ob, a in executed:
        by_object.setdefault(ob, set()).add(a // 64)
    for ob, object_lines in sorted(by_object.items(), key=lambda kv: -len(kv[1])):
        object_pages = {line * 64 // 4096 for line in object_lines}
        print(f"  {ob}: {len(object_lines)} lines, {len(object_pages)} pages")
    if not top:
        return
    # A line shared by two functions counts for each: the counts say where code lies, not a sum.
    by_function = {}
    for (ob, a), fn in executed.items():
        by_function.setdefault(fn, set()).add((ob, a // 64))
    by_crate = {}
    for fn, fn_lines in by_function.items():
        by_crate.setdefault(crate(str(fn)), set()).update(fn_lines)
    print("lines by crate:")
    for name, crate_lines in sorted(by_crate.items(), key=lambda kv: -len(kv[1])):
        print(f"  {len(crate_lines):6} {name}")
    print(f"the {top} functions with the most lines:")
    for fn, fn_lines in sorted(by_function.items(), key=lambda kv: -len(kv[1]))[:top]:
        print(f"  {len(fn_lines):6} {fn}")


if __name__ == "__main__":
    main()
