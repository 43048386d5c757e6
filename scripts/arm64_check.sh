#!/usr/bin/env bash
# Run the Raspberry Pi path for real on an emulated arm64 Debian 12 (the base of Raspberry Pi OS bookworm):
# scripts/install.sh exactly as a Pi owner runs it (Horovod build included), then doctor, the phantom demo,
# a 2-rank Gloo epoch, an int8 export, predict on a PNG and a DICOM, one rank's training step timed per model
# (scripts/bench_step.py in a venv of its own, no Horovod), and the edge-only install
# (`pip install .[edge]`: no TensorFlow) with its size and time. Then the same edge install on an emulated
# arm64 Debian 13 (trixie, the base of today's Raspberry Pi OS: Python 3.13, numpy 2), classifying the same files
# with the same model (scripts/edge_check.sh --arch arm64). Prints a table: step, wall time, result.
#
#   sudo scripts/arm64_check.sh CACHE_DIR [EXTRA.dcm ...]
#
# CACHE_DIR keeps the root file systems (CACHE_DIR/rootfs, CACHE_DIR/trixie/rootfs-arm64) and, inside the first,
# the project's .venv, so a re-run skips debootstrap and install.sh only does what is missing: after a fix,
# re-running costs minutes. ARM64_STEPS picks steps (default: all, in this order); EXTRA.dcm files are also
# classified. The trixie-edge step compares its answers with this host's training install ($COVIDXRAY, default
# the checkout's .venv/bin/covidxray) for the bookworm run's int8 model, or ARM64_MODEL (a .tflite with its
# sidecar), which lets `ARM64_STEPS=trixie-edge` run alone, without the bookworm root file system.
# Needs root, qemu-user-static, binfmt-support and debootstrap (apt-get install them). Not run in CI: a full
# first run takes about 2 hours on 2 x86 cores (see docs/cluster.md, "Checking the Pi path on arm64").
set -euo pipefail

usage() { sed -n '9,19p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 1 ] || usage
PROJECT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/debian_root.sh
source "$PROJECT/scripts/debian_root.sh"
require_tools arm64

CACHE=$(mkdir -p "$1" && cd "$1" && pwd)
shift
EXTRA_DICOMS=("$@")
EXTRA_IN_ROOT=""
for dicom in "${EXTRA_DICOMS[@]}"; do EXTRA_IN_ROOT+=" /opt/arm64-check/$(basename "$dicom")"; done
ROOT=$CACHE/rootfs
IN_ROOT=/opt/covidxray                       # where the project sits inside the root fs
WORK=/opt/arm64-check                        # demo data, runs and the edge venv inside the root fs
STEPS=${ARM64_STEPS:-"install doctor demo horovod export predict-png predict-dicom train-step edge-install edge-predict trixie-edge"}
INSTALL_TIMEOUT=${ARM64_INSTALL_TIMEOUT:-5h} # Horovod alone compiles for about an hour under emulation
STEP_TIMEOUT=${ARM64_STEP_TIMEOUT:-90m}
# nice: the build must not starve the machine's other users.
NICE=${ARM64_NICE:-15}

log() { printf '\n==> %s\n' "$*"; }

# A step runs in the background under `timeout`, which leads its own process group and passes a signal on to
# all of it; the script waits with `wait`, which a signal interrupts (a foreground command would delay the trap).
STEP_PID_FILE=""
on_signal() {
    echo "interrupted: stopping the running step" >&2
    [ -z "$STEP_PID_FILE" ] || [ ! -s "$STEP_PID_FILE" ] || kill -TERM "$(cat "$STEP_PID_FILE")" 2>/dev/null || true
    wait
    exit 130
}
trap unmount_all EXIT
trap on_signal INT TERM HUP

enter_root() {
    mount_root "$ROOT" arm64
    mkdir -p "$ROOT$IN_ROOT" "$ROOT$WORK"
    copy_checkout "$PROJECT" "$ROOT$IN_ROOT"
    for dicom in "${EXTRA_DICOMS[@]}"; do cp "$dicom" "$ROOT$WORK/"; done
    set_chroot_command "$ROOT"
}

in_root() {  # in_root TIMEOUT COMMAND: run a shell command inside the arm64 root fs, from the project folder
    # exec: the caller's subshell becomes `timeout` itself, so its pid is the one to signal. Call in a subshell.
    exec timeout -k 30s "$1" nice -n "$NICE" "${CHROOT_COMMAND[@]}" /bin/bash -c "cd $IN_ROOT && $2"
}

# --- the steps ---------------------------------------------------------------------------------------------
CLI=$IN_ROOT/.venv/bin/covidxray
EDGE=$WORK/edge-venv
STEP_VENV=$WORK/step-venv
step_command() {
    case $1 in
    install) echo "bash scripts/install.sh" ;;
    doctor) echo "$CLI doctor" ;;
    demo) echo "rm -rf $WORK/demo && $CLI demo --workdir $WORK/demo --epochs 1" ;;
    horovod) echo "source .venv/bin/activate && rm -rf $WORK/hvd && horovodrun -np 2 -H localhost:2 --gloo \
        covidxray train --data-dir $WORK/demo/data --run-dir $WORK/hvd --model small_cnn --epochs 1" ;;
    # A one-epoch model's near-uniform outputs make int8/Keras argmax agreement noisy (0.83 on x86 too), so the
    # deployment bar is off here: this step checks that conversion and calibration run on arm64, and prints the figure.
    export) echo "$CLI export --run-dir $WORK/hvd --data-dir $WORK/demo/data --format int8 --set export.int8_min_agreement=0 \
        && $IN_ROOT/.venv/bin/python -c 'import json, sys; r = json.load(open(sys.argv[1]))[\"int8\"]; \
print(\"int8 agrees with Keras on %.0f%% of the test split\" % (100 * r[\"agreement\"]))' $WORK/hvd/export_report.json" ;;
    predict-png) echo "$IN_ROOT/.venv/bin/python scripts/arm64_inputs.py $WORK/demo/data $WORK \
        && $CLI predict -m $WORK/hvd --format int8 $WORK/phantom.png" ;;
    predict-dicom) echo "$CLI predict -m $WORK/hvd --format int8 $WORK/phantom-j2k.dcm$EXTRA_IN_ROOT" ;;
    # --only-binary: a Pi must not compile anything (slow, and no compiler on the board); the report lists the
    # files pip took, and a binary wheel tagged plain linux_aarch64 would have been compiled here from an sdist.
    edge-install) echo "rm -rf $EDGE && python3 -m venv $EDGE && $EDGE/bin/python -m pip install -q --no-cache-dir \
        --only-binary=:all: --report $WORK/edge-install.json '.[edge]' \
        && $EDGE/bin/python -c 'import json, sys; [print(i[\"download_info\"][\"url\"].rsplit(\"/\", 1)[-1]) \
for i in json.load(open(sys.argv[1]))[\"install\"]]' $WORK/edge-install.json \
        && ! grep -l 'Tag: .*-linux_aarch64' $EDGE/lib/python3*/site-packages/*.dist-info/WHEEL \
        && ! $EDGE/bin/python -c 'import tensorflow' 2>/dev/null \
        && echo \"edge venv \$(du -sm $EDGE | cut -f1) MB, all binary wheels prebuilt, no tensorflow\"" ;;
    edge-predict) echo "$EDGE/bin/covidxray predict -m $WORK/hvd/model-int8.tflite $WORK/phantom.png $WORK/phantom-j2k.dcm \
        && { $EDGE/bin/covidxray train --data-dir $WORK/demo/data --run-dir $WORK/edge-run --epochs 1; test \$? = 2; } \
        && echo 'train on the edge install: a clear error, exit 2'" ;;
    # One rank's training step timed on arm64 kernels, without Horovod (scripts/bench_step.py: its table and JSON).
    # Its own venv of the train extra, so install.sh's is not disturbed; (re)installed when pyproject.toml changed.
    # 3 timed steps and only the candidate models: one emulated case of efficientnet_lite0 took over half an hour
    # of wall time here (2 loaded cores), and translated code does not vary much between steps.
    train-step) echo "{ cmp -s pyproject.toml $STEP_VENV/pyproject.toml || { rm -rf $STEP_VENV && python3 -m venv $STEP_VENV \
        && $STEP_VENV/bin/python -m pip install -q -e '.[train]' && cp pyproject.toml $STEP_VENV/; }; } \
        && $STEP_VENV/bin/python scripts/bench_step.py --candidates-only --steps 3 --warmup 1 --workdir $WORK/step-work --out $WORK/bench-step.json \
        && $STEP_VENV/bin/python -c 'import json, sys; r = json.load(open(sys.argv[1]))[\"results\"][\"cases\"].values(); \
print(\"; \".join(\"%s/%d: %.1f s, %.0f MiB\" % (c[\"model\"], c[\"frozen_stages\"], c[\"step_s\"], c[\"peak_rss_mib\"]) for c in r))' $WORK/bench-step.json" ;;
    # Runs on the host: scripts/edge_check.sh makes and enters its own (trixie) root file system.
    trixie-edge) echo "scripts/edge_check.sh --arch arm64 $CACHE/trixie $CACHE/trixie-out ${TRIXIE_MODEL#"$ROOT"} -- ${TRIXIE_FILES[*]#"$ROOT"}" ;;
    *) echo "error: unknown step $1" >&2; exit 2 ;;
    esac
}

# The trixie run classifies what the bookworm run did, with its int8 model, or ARM64_MODEL.
TRIXIE_MODEL=${ARM64_MODEL:-$ROOT$WORK/hvd/model-int8.tflite}
TRIXIE_FILES=()
for file in "$ROOT$WORK/phantom.png" "$ROOT$WORK/phantom-j2k.dcm" "${EXTRA_DICOMS[@]}"; do
    [ ! -e "$file" ] || TRIXIE_FILES+=("$file")
done
trixie_edge() {  # like in_root: exec, in a subshell
    [ ${#TRIXIE_FILES[@]} -gt 0 ] || { echo "error: nothing to classify: run the bookworm steps first, or name files" >&2; exit 2; }
    exec timeout -k 30s "$STEP_TIMEOUT" nice -n "$NICE" bash "$PROJECT/scripts/edge_check.sh" --arch arm64 \
        "$CACHE/trixie" "$CACHE/trixie-out" "$TRIXIE_MODEL" -- "${TRIXIE_FILES[@]}"
}

RESULTS=$CACHE/results-$(date +%Y%m%d-%H%M%S).tsv
printf 'step\twall time\tresult\tlast output line\n' >"$RESULTS"
add_row() {  # add_row STEP SECONDS RESULT LAST-LINE
    printf '%s\t%dm%02ds\t%s\t%s\n' "$1" $(($2 / 60)) $(($2 % 60)) "$3" "$4" >>"$RESULTS"
}

if [ "$(echo $STEPS)" != trixie-edge ]; then  # the bookworm root file system, unless only the trixie run is asked for
    started=$(date +%s)
    # python3-venv: the train-step step makes its own venv, also when the install step (which apt-installs it) is not run
    ensure_rootfs "$ROOT" arm64 bookworm python3,python3-venv,ca-certificates,sudo,procps | tee "$CACHE/rootfs.log"
    add_row rootfs $(($(date +%s) - started)) ok "$(tail -1 "$CACHE/rootfs.log")"
    enter_root
    (in_root 1m "uname -m | grep -qx aarch64") || { echo "error: the chroot does not run arm64 code" >&2; exit 1; }
fi

overall=0
for step in $STEPS; do
    command=$(step_command "$step")
    timeout=$STEP_TIMEOUT; [ "$step" = install ] && timeout=$INSTALL_TIMEOUT
    log "$step: $command"
    started=$(date +%s)
    STEP_PID_FILE=$CACHE/.step.pid
    : >"$STEP_PID_FILE"; rm -f "$CACHE/.step.status"
    set +e
    run_step=(in_root "$timeout" "$command"); [ "$step" != trixie-edge ] || run_step=(trixie_edge)
    ( "${run_step[@]}" 2>&1 & echo $! >"$STEP_PID_FILE"; wait $!; echo $? >"$CACHE/.step.status" ) \
        | tee "$CACHE/$step.log" &
    wait $!
    status=$(cat "$CACHE/.step.status" 2>/dev/null || echo 1)
    set -e
    seconds=$(($(date +%s) - started))
    case $status in 0) result=ok ;; 124) result="TIMEOUT after $timeout" ;; *) result="FAILED (exit $status)" ;; esac
    [ "$status" = 0 ] || overall=1
    last=$(grep -v '^\s*$' "$CACHE/$step.log" | tail -1 | cut -c1-100 | tr '\t' ' ')
    add_row "$step" "$seconds" "$result" "$last"
    [ "$step" != install ] || [ "$status" = 0 ] || break   # nothing else can run without the install
done

log "results under emulation (QEMU_CPU=$QEMU_CPU, $(nproc) host cores; logs in $CACHE/<step>.log)"
column -t -s $'\t' "$RESULTS"
exit $overall
