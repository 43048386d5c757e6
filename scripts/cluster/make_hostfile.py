#!/usr/bin/env python3
"""Write a Horovod hostfile (`<host> slots=<n>` per line) from a list of boards.

Horovod's hostfile reader accepts nothing else (no comments, no blank lines),
so this is where the friendly list becomes the strict file. The same file
serves `horovodrun --hostfile`, scripts/discover_hosts.sh (elastic jobs) and
the other scripts/cluster tools.

    make_hostfile.py pi{01..35}.local --slots 1 -o hostfile
    make_hostfile.py --from boards.txt -o hostfile     # one board per line: `host`, `host:slots` or `host slots=N`; # comments

Default 1 slot per board: one rank per Pi 4 uses all four cores (the trainer
gives each rank the board's cores) and keeps a single copy of the model in 4 GB.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from nodes import ClusterError, main_guard  # noqa: E402

HOST = re.compile(r"^[\w.-]+$")  # what horovodrun's -H parser accepts in a host name
ENTRY = re.compile(r"^(?P<host>[^\s:]+)(?::(?P<colon>\d+)|\s+slots=(?P<slots>\d+))?$")


def parse_entries(lines: list[str], default_slots: int, origin: str) -> list[tuple[str, int]]:
    entries: list[tuple[str, int]] = []
    seen: set[str] = set()
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = ENTRY.match(line)
        if not match or not HOST.match(match["host"]):
            raise ClusterError(f"{origin}:{number}: {raw.strip()!r} is not `host`, `host:slots` or `host slots=N`")
        host, slots = match["host"], int(match["colon"] or match["slots"] or default_slots)
        if slots < 1:
            raise ClusterError(f"{origin}:{number}: {host} needs at least 1 slot")
        if host in seen:
            raise ClusterError(
                f"{origin}:{number}: {host} is listed twice (horovodrun would start two sets of ranks there)"
            )
        seen.add(host)
        entries.append((host, slots))
    if not entries:
        raise ClusterError(f"{origin}: no hosts")
    return entries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hosts", nargs="*", help="Boards, each `host` or `host:slots`.")
    parser.add_argument("--from", dest="from_file", type=Path, help="A file listing boards, one per line.")
    parser.add_argument(
        "--slots", type=int, default=1, help="Slots (ranks) for boards given without a count (default 1)."
    )
    parser.add_argument("-o", "--output", type=Path, default=None, help="Hostfile to write (default: stdout).")
    args = parser.parse_args(argv)
    if args.slots < 1:
        raise ClusterError("--slots must be at least 1")

    lines, origin = list(args.hosts), "command line"
    if args.from_file:
        if not args.from_file.is_file():
            raise ClusterError(f"{args.from_file}: no such file")
        lines, origin = args.from_file.read_text().splitlines() + lines, str(args.from_file)
    entries = parse_entries(lines, args.slots, origin)
    text = "".join(f"{host} slots={slots}\n" for host, slots in entries)
    if args.output:
        args.output.write_text(text)
        total = sum(slots for _, slots in entries)
        print(
            f"{args.output}: {len(entries)} hosts, {total} slots -> horovodrun -np {total} --hostfile {args.output} ...",
            file=sys.stderr,
        )
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    main_guard(main)
