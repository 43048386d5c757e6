#!/usr/bin/env bash
# The edge install on Debian 13 trixie (the base of today's Raspberry Pi OS: Python 3.13, numpy 2), for real, in a
# root file system: a wheel built from the checkout, installed with `pip install --only-binary=:all:
# "covidxray-*.whl[edge]"` into a fresh venv of trixie's python3; then `covidxray predict --json` with each MODEL
# on the FILEs, compared with the training install's answers on this host (scripts/same_predictions.py, 1e-5).
# Also checks that a training install on that Python stops at once (exit 2, with what to do): scripts/install.sh
# and `covidxray train`. Prints a table: step, wall time, result.
#
#   sudo scripts/edge_check.sh [--arch amd64|arm64] CACHE_DIR OUT_DIR MODEL.tflite... -- FILE...
#
# CACHE_DIR keeps the root file system (CACHE_DIR/rootfs-ARCH) and, inside it, the edge set's wheels downloaded from
# PyPI (one wheelhouse per pyproject.toml): after the first run only the venv and the predictions are made anew. The training install's answers come from $COVIDXRAY
# (default: the checkout's .venv/bin/covidxray). OUT_DIR gets train-<model>.json, edge-<model>.json (the same
# files in the same order), wheels.txt (every file pip installed) and results.tsv. arm64 runs under
# qemu-user-static (scripts/arm64_check.sh's trixie-edge step); needs debootstrap (and qemu-user-static).
set -euo pipefail

usage() { sed -n '9,15p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
ARCH=amd64
[ "${1:-}" != --arch ] || { ARCH=$2; shift 2; }
[ $# -ge 4 ] || usage
PROJECT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=$(mkdir -p "$1" && cd "$1" && pwd)
OUT=$(mkdir -p "$2" && cd "$2" && pwd)
shift 2
MODELS=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do MODELS+=("$(realpath "$1")"); shift; done
[ "${1:-}" = -- ] && [ $# -ge 2 ] && [ ${#MODELS[@]} -ge 1 ] || usage
shift
FILES=("$@")
COVIDXRAY=${COVIDXRAY:-$PROJECT/.venv/bin/covidxray}
[ -x "$COVIDXRAY" ] || { echo "error: no training install at $COVIDXRAY: set COVIDXRAY=/path/to/venv/bin/covidxray" >&2; exit 2; }

# shellcheck source=scripts/debian_root.sh
source "$PROJECT/scripts/debian_root.sh"
require_tools "$ARCH"
exec 9>"$CACHE/.lock-$ARCH" && flock 9  # two checks at once (two test runs) take turns with the root file system
ROOT=$CACHE/rootfs-$ARCH
CHECK=/opt/edge-check      # inside the root: the checkout, wheel, venv, models and files
VENV=$CHECK/venv
trap unmount_all EXIT

RESULTS=$OUT/results.tsv
printf 'step\twall time\tresult\n' >"$RESULTS"
timed() {  # timed STEP COMMAND...: run, record the wall time; a failure ends the check
    local step=$1 started status=0
    shift
    started=$(date +%s%N)
    "$@" || status=$?
    printf '%s\t%d s\t%s\n' "$step" $((($(date +%s%N) - started + 500000000) / 1000000000)) \
        "$([ $status = 0 ] && echo ok || echo "FAILED (exit $status)")" >>"$RESULTS"
    [ $status = 0 ] || { column -t -s $'\t' "$RESULTS"; exit 1; }
}
in_root() {  # in_root COMMAND: a shell command inside the root file system, pip's cache kept in it
    "${CHROOT_COMMAND[@]}" PIP_CACHE_DIR=/var/cache/covidxray-pip PIP_DISABLE_PIP_VERSION_CHECK=1 /bin/bash -c "$1"
}

# trixie's own python3 (3.13) and venv: what a Raspberry Pi OS trixie Lite board has after `apt install python3-venv`.
timed rootfs ensure_rootfs "$ROOT" "$ARCH" trixie python3,python3-venv,ca-certificates
mount_root "$ROOT" "$ARCH"
set_chroot_command "$ROOT"

rm -rf "${ROOT:?}$CHECK" "$OUT"/edge-*.json "$OUT"/train-*.json
copy_checkout "$PROJECT" "$ROOT$CHECK/covidxray"
mkdir -p "$ROOT$CHECK/models" "$ROOT$CHECK/files"
for model in "${MODELS[@]}"; do cp "$model" "${model%.tflite}.json" "$ROOT$CHECK/models/"; done
IN_ROOT_FILES=""
for i in "${!FILES[@]}"; do  # numbered: two files of one name from different folders stay apart, in order
    name=$(printf '%03d-%s' "$i" "$(basename "${FILES[i]}")")
    cp "${FILES[i]}" "$ROOT$CHECK/files/$name"
    IN_ROOT_FILES+=" $(printf %q "$CHECK/files/$name")"
done

# pip asks the index about every package even when its cache holds the files (minutes behind a slow proxy). So the
# first run downloads the edge set's wheels from PyPI into a wheelhouse kept per pyproject.toml, and every run
# installs from it with the index off: the same files, until a dependency changes in pyproject.toml.
WHEELHOUSE=/var/cache/covidxray-wheels/$(sha256sum "$PROJECT/pyproject.toml" | cut -c1-16)
OFFLINE="--no-index --find-links $WHEELHOUSE"
THE_WHEEL="\"\$(echo $CHECK/dist/covidxray-*.whl)[edge]\""
# A wheel tagged plain linux_<arch> was compiled here from an sdist: on a Pi that is slow, so fail on one.
timed "edge install (python3 -m venv, pip wheel + install --only-binary=:all:)" in_root "
    python3 --version && python3 -m venv $VENV \
    && if [ ! -e $WHEELHOUSE/.complete ]; then
        $VENV/bin/pip download -q --only-binary=:all: -d $WHEELHOUSE 'setuptools>=64' \
        && $VENV/bin/pip wheel -q --no-deps -w $CHECK/dist $CHECK/covidxray \
        && $VENV/bin/pip download -q --only-binary=:all: -d $WHEELHOUSE $THE_WHEEL \
        && rm $WHEELHOUSE/covidxray-* && touch $WHEELHOUSE/.complete; fi \
    && $VENV/bin/pip wheel -q --no-deps $OFFLINE -w $CHECK/dist $CHECK/covidxray \
    && $VENV/bin/pip install -q --only-binary=:all: $OFFLINE --report $CHECK/install-report.json $THE_WHEEL \
    && ! grep -l 'Tag: .*-linux_' $VENV/lib/python3*/site-packages/*.dist-info/WHEEL \
    && ! $VENV/bin/python -c 'import tensorflow' 2>/dev/null"
in_root "$VENV/bin/python -c '
import json, sys
for item in json.load(open(\"$CHECK/install-report.json\"))[\"install\"]:
    print(item[\"download_info\"][\"url\"].rsplit(\"/\", 1)[-1])
'" >"$OUT/wheels.txt"
in_root "$VENV/bin/python -c 'import sys, numpy, cv2, ai_edge_litert; print(\"Python\", sys.version.split()[0], \"numpy\", numpy.__version__, \"opencv\", cv2.__version__)'" \
    >"$OUT/versions.txt"
echo "edge venv $(du -sm "$ROOT$VENV" | cut -f1) MB, $(wc -l <"$OUT/wheels.txt") wheels (no package compiled), no TensorFlow; $(cat "$OUT/versions.txt")" \
    | tee "$OUT/edge-venv.txt"

predict_both() {  # predict_both MODEL: the training install's answers here, then the edge venv's in the root
    local name
    name=$(basename "$1" .tflite)
    "$COVIDXRAY" predict --json -m "$1" "${FILES[@]}" >"$OUT/train-$name.json" || [ $? = 1 ]
    in_root "$VENV/bin/covidxray predict --json -m $CHECK/models/$name.tflite$IN_ROOT_FILES" >"$OUT/edge-$name.json" || [ $? = 1 ]
    python3 "$PROJECT/scripts/same_predictions.py" "$OUT/train-$name.json" "$OUT/edge-$name.json" | tee "$OUT/same-$name.txt"
}
for model in "${MODELS[@]}"; do
    timed "predict $(basename "$model") on ${#FILES[@]} files, both installs, compared" predict_both "$model"
done

# Training needs Python 3.11: on trixie's 3.13 both ways in must stop at once, exit 2, saying what to do.
refuses() {  # refuses COMMAND TEXT: exit status 2, no traceback, and a message that says TEXT
    local status=0
    in_root "$1" >"$OUT/refusal.txt" 2>&1 || status=$?
    [ $status = 2 ] && ! grep -q Traceback "$OUT/refusal.txt" && tr -s ' \n' ' ' <"$OUT/refusal.txt" | grep -qF "$2" \
        || { cat "$OUT/refusal.txt"; return 1; }
}
timed "scripts/install.sh (training install) refuses Python 3.13" \
    refuses "cd $CHECK/covidxray && bash scripts/install.sh" "PYTHON=/path/to/python3.11 bash scripts/install.sh"
for command in "train --data-dir /nonexistent --run-dir /tmp/run" "prepare --source synthetic --data-dir /tmp/data"; do
    timed "covidxray ${command%% *} on the edge install refuses" \
        refuses "$VENV/bin/covidxray $command" "pip install 'covidxray[train]'\` with that Python"
done

printf '\n==> trixie %s edge check (%s)\n' "$ARCH" "$(cat "$OUT/edge-venv.txt")"
column -t -s $'\t' "$RESULTS"
