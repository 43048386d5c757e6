#!/usr/bin/env bash
# Which files pip would install for the edge set (`covidxray[edge]`) on Linux x86-64 and aarch64 boards, for
# each Python given, without installing anything: the evidence that every package of it, dependencies
# included, comes as a prebuilt wheel (no compiler on a Pi). Run it after changing a range in pyproject.toml.
#
#   scripts/edge_wheels.sh PYTHON...     e.g. scripts/edge_wheels.sh python3.11 python3.12 python3.13
#
# Each PYTHON resolves with its own pip, so environment markers (python_version) are its own; --platform then
# admits only manylinux wheels a glibc 2.36 system takes (bookworm's; trixie has 2.41). Prints one line per
# Python, architecture and package: the wheel's file name. Exits 1 when a package has no such wheel.
set -euo pipefail
[ $# -ge 1 ] || { sed -n '6p' "$0" | sed 's/^# *//'; exit 2; }
PROJECT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

status=0
for python in "$@"; do
    version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    for arch in x86_64 aarch64; do
        platforms=(--platform "manylinux2014_$arch")
        for glibc in $(seq 17 36); do platforms+=(--platform "manylinux_2_${glibc}_$arch"); done
        report=$WORK/$version-$arch.json
        if ! "$python" -m pip install -q --dry-run --ignore-installed --only-binary=:all: "${platforms[@]}" \
            --python-version "$version" --implementation cp --target "$WORK/target" --report "$report" \
            "$PROJECT[edge]" 2>"$WORK/stderr"; then
            echo "cp$version $arch: no complete set of wheels: $(grep ERROR "$WORK/stderr" | head -2 | tr '\n' ' ')"
            status=1
            continue
        fi
        "$python" - "$report" "$version" "$arch" <<'PY'
import json, sys
report, version, arch = sys.argv[1:]
for item in json.load(open(report))["install"]:
    name = item["download_info"]["url"].rsplit("/", 1)[-1]
    if item["metadata"]["name"] != "covidxray":  # the project itself: built from the checkout
        print(f"cp{version}\t{arch}\t{name}")
PY
    done
done
exit $status
