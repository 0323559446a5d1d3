#!/usr/bin/env python3
"""The code a callgrind run executed: distinct instructions, 64-byte cache lines and 4 KiB pages.

Usage: footprint.py CALLGRIND_DUMP   (a dump written with --dump-instr=yes; instructions.sh
with FOOTPRINT=1 writes one and calls this)

A request that finds its code out of the caches (the machine ran other programs since the last
one) pays for every line and page of code it touches, whatever it executes there; these counts
are that footprint, over all the requests of the dump together (one request touches at most
that). Addresses are per object file, so a line or page is one of the file's own.
"""
import re
import sys

COST = re.compile(r"^(0x[0-9a-fA-F]+|[+-]\d+|\*)\s")


def footprint(lines):
    executed = set()
    ob = None
    names = {}
    address = 0
    for line in lines:
        if line.startswith("cob="):
            # A called function's object: it may be named here first.
            match = re.match(r"\((\d+)\)\s*(.+)", line[4:].strip())
            if match:
                names[match.group(1)] = match.group(2)
            continue
        if line.startswith("ob="):
            # "ob=(7) /path" names an object once; "ob=(7)" refers back to it.
            spec = line[3:].strip()
            match = re.match(r"\((\d+)\)\s*(.*)", spec)
            if match:
                number, name = match.groups()
                if name:
                    names[number] = name
                ob = names.get(number, number)
            else:
                ob = spec
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
            executed.add((ob, address))
    return executed


def main():
    with open(sys.argv[1]) as dump:
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


if __name__ == "__main__":
    main()
