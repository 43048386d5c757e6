#!/usr/bin/env bash
# Run the Raspberry Pi path for real on an emulated arm64 Debian 12 (the base of Raspberry Pi OS bookworm):
# scripts/install.sh exactly as a Pi owner runs it (Horovod build included), then doctor, the phantom demo,
# a 2-rank Gloo epoch, an int8 export, predict on a PNG and a DICOM, and the edge-only install
# (`pip install .[edge]`: no TensorFlow) with its size and time. Prints a table: step, wall time, result.
#
#   sudo scripts/arm64_check.sh CACHE_DIR [EXTRA.dcm ...]
#
# CACHE_DIR keeps the root file system (CACHE_DIR/rootfs) and, inside it, the project's .venv, so a re-run
# skips debootstrap and install.sh only does what is missing: after a fix, re-running costs minutes.
# ARM64_STEPS picks steps (default: all, in this order); EXTRA.dcm files are also classified.
# Needs root, qemu-user-static, binfmt-support and debootstrap (apt-get install them). Not run in CI: a full
# first run takes about 2 hours on 2 x86 cores (see docs/cluster.md, "Checking the Pi path on arm64").
set -euo pipefail

usage() { sed -n '6,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 1 ] || usage
[ "$(id -u)" = 0 ] || { echo "error: run as root (debootstrap, chroot and mounts need it)" >&2; exit 2; }
for tool in debootstrap qemu-aarch64-static update-binfmts; do
    command -v "$tool" >/dev/null || { echo "error: $tool missing: apt-get install qemu-user-static binfmt-support debootstrap" >&2; exit 2; }
done

PROJECT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=$(mkdir -p "$1" && cd "$1" && pwd)
shift
EXTRA_DICOMS=("$@")
EXTRA_IN_ROOT=""
for dicom in "${EXTRA_DICOMS[@]}"; do EXTRA_IN_ROOT+=" /opt/arm64-check/$(basename "$dicom")"; done
ROOT=$CACHE/rootfs
IN_ROOT=/opt/covidxray                       # where the project sits inside the root fs
WORK=/opt/arm64-check                        # demo data, runs and the edge venv inside the root fs
STEPS=${ARM64_STEPS:-"install doctor demo horovod export predict-png predict-dicom edge-install edge-predict"}
INSTALL_TIMEOUT=${ARM64_INSTALL_TIMEOUT:-5h} # Horovod alone compiles for about an hour under emulation
STEP_TIMEOUT=${ARM64_STEP_TIMEOUT:-90m}
# Raspberry Pi 4 = Cortex-A72 (ARMv8.0): emulating that core, not QEMU's default "max", also checks that the
# wheels use no instruction a Pi lacks. nice: the build must not starve the machine's other users.
export QEMU_CPU=${QEMU_CPU:-cortex-a72}
NICE=${ARM64_NICE:-15}
MIRROR=${ARM64_MIRROR:-$(sed -n 's/^URIs: *\([^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}

log() { printf '\n==> %s\n' "$*"; }

# --- mounts, always undone (also on Ctrl-C / kill) -------------------------------------------------------
MOUNTED=()
cleanup() {
    local i
    for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do
        umount "${MOUNTED[i]}" 2>/dev/null || umount -l "${MOUNTED[i]}" 2>/dev/null || echo "warning: could not unmount ${MOUNTED[i]}" >&2
    done
    MOUNTED=()
}
# A step runs in the background under `timeout`, which leads its own process group and passes a signal on to
# all of it; the script waits with `wait`, which a signal interrupts (a foreground command would delay the trap).
STEP_PID_FILE=""
on_signal() {
    echo "interrupted: stopping the running step" >&2
    [ -z "$STEP_PID_FILE" ] || [ ! -s "$STEP_PID_FILE" ] || kill -TERM "$(cat "$STEP_PID_FILE")" 2>/dev/null || true
    wait
    exit 130
}
trap cleanup EXIT
trap on_signal INT TERM HUP

mount_in_root() {  # mount_in_root TARGET mount-args...: mount once, remember it for cleanup
    local target=$1; shift
    mountpoint -q "$target" && return 0
    mount "$@" "$target"
    MOUNTED+=("$target")
}

ensure_binfmt() {
    mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
    # The F flag makes the kernel open the interpreter now, so it need not exist inside the chroot.
    grep -q '^flags:.*F' /proc/sys/fs/binfmt_misc/qemu-aarch64 \
        || { echo "error: qemu-aarch64 binfmt lacks the F (fix-binary) flag; install Debian's qemu-user-static" >&2; exit 1; }
}

ensure_rootfs() {
    if [ -e "$ROOT/.arm64-check-complete" ]; then
        echo "reusing root file system $ROOT"
        return
    fi
    log "debootstrap arm64 bookworm from $MIRROR into $ROOT (15-30 min under emulation)"
    # Never rm -rf through a bind mount of the host's /dev or /proc left by a killed run.
    if grep -q " $ROOT/" /proc/mounts; then
        echo "error: something is still mounted under $ROOT (see /proc/mounts): unmount it first" >&2; exit 1
    fi
    rm -rf "$ROOT"
    # What Raspberry Pi OS Lite has and install.sh relies on: python3, sudo, certificates. Nothing more, so
    # install.sh's own apt step is what gets tested.
    nice -n "$NICE" debootstrap --arch=arm64 --variant=minbase --include=python3,ca-certificates,sudo,procps \
        bookworm "$ROOT" "$MIRROR"
    touch "$ROOT/.arm64-check-complete"
}

enter_root() {
    cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
    # debootstrap's minbase writes no /etc/hosts; Raspberry Pi OS ships one. Without it nothing resolves
    # `localhost`, and horovodrun's ssh check of `-H localhost:2` fails.
    [ -s "$ROOT/etc/hosts" ] || printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t%s\n' \
        "$(hostname)" >"$ROOT/etc/hosts"
    # The host's CA bundle, for networks whose HTTPS proxy has its own CA (pip gets it through PIP_CERT).
    cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/host-ca-certificates.crt"
    mount_in_root "$ROOT/proc" -t proc proc
    mount_in_root "$ROOT/sys" -t sysfs sysfs
    mount_in_root "$ROOT/dev" --bind /dev
    mount_in_root "$ROOT/dev/pts" --bind /dev/pts
    # QEMU 7.2 passes the host's x86 /proc/cpuinfo through, and LiteRT's Interpreter() crashes parsing it;
    # show the guest what a Raspberry Pi 4 reports instead.
    printf 'processor\t: %s\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm crc32 cpuid\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd08\nCPU revision\t: 3\n\n' \
        $(seq 0 $(($(nproc) - 1))) >"$CACHE/cpuinfo-pi4"
    mount_in_root "$ROOT/proc/cpuinfo" --bind "$CACHE/cpuinfo-pi4"
    # The project as a Pi owner's clone: the working tree (uncommitted fixes included), without host venvs/builds.
    mkdir -p "$ROOT$IN_ROOT" "$ROOT$WORK"
    (cd "$PROJECT" && { git ls-files -z --cached --others --exclude-standard 2>/dev/null || find . -type f -print0; }) \
        | rsync -a --from0 --files-from=- "$PROJECT/" "$ROOT$IN_ROOT/"
    for dicom in "${EXTRA_DICOMS[@]}"; do cp "$dicom" "$ROOT$WORK/"; done
}

in_root() {  # in_root TIMEOUT COMMAND: run a shell command inside the arm64 root fs, from the project folder
    # exec: the caller's subshell becomes `timeout` itself, so its pid is the one to signal. Call in a subshell.
    exec timeout -k 30s "$1" nice -n "$NICE" chroot "$ROOT" /usr/bin/env -i HOME=/root LANG=C.UTF-8 \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin QEMU_CPU="$QEMU_CPU" \
        PIP_CERT=/etc/ssl/host-ca-certificates.crt SSL_CERT_FILE=/etc/ssl/host-ca-certificates.crt \
        /bin/bash -c "cd $IN_ROOT && $2"
}

# --- the steps ---------------------------------------------------------------------------------------------
CLI=$IN_ROOT/.venv/bin/covidxray
EDGE=$WORK/edge-venv
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
    # A binary wheel tagged plain linux_aarch64 was compiled here from an sdist: on a Pi that is slow, so fail.
    edge-install) echo "rm -rf $EDGE && python3 -m venv $EDGE && $EDGE/bin/python -m pip install -q --no-cache-dir '.[edge]' \
        && ! grep -l 'Tag: .*-linux_aarch64' $EDGE/lib/python3*/site-packages/*.dist-info/WHEEL \
        && ! $EDGE/bin/python -c 'import tensorflow' 2>/dev/null \
        && echo \"edge venv \$(du -sm $EDGE | cut -f1) MB, all binary wheels prebuilt, no tensorflow\"" ;;
    edge-predict) echo "$EDGE/bin/covidxray predict -m $WORK/hvd/model-int8.tflite $WORK/phantom.png $WORK/phantom-j2k.dcm \
        && { $EDGE/bin/covidxray train --data-dir $WORK/demo/data --run-dir $WORK/edge-run --epochs 1; test \$? = 2; } \
        && echo 'train on the edge install: a clear error, exit 2'" ;;
    *) echo "error: unknown step $1" >&2; exit 2 ;;
    esac
}

RESULTS=$CACHE/results-$(date +%Y%m%d-%H%M%S).tsv
printf 'step\twall time\tresult\tlast output line\n' >"$RESULTS"
add_row() {  # add_row STEP SECONDS RESULT LAST-LINE
    printf '%s\t%dm%02ds\t%s\t%s\n' "$1" $(($2 / 60)) $(($2 % 60)) "$3" "$4" >>"$RESULTS"
}

ensure_binfmt
started=$(date +%s)
ensure_rootfs | tee "$CACHE/rootfs.log"
add_row rootfs $(($(date +%s) - started)) ok "$(tail -1 "$CACHE/rootfs.log")"
enter_root
(in_root 1m "uname -m | grep -qx aarch64") || { echo "error: the chroot does not run arm64 code" >&2; exit 1; }

overall=0
for step in $STEPS; do
    command=$(step_command "$step")
    timeout=$STEP_TIMEOUT; [ "$step" = install ] && timeout=$INSTALL_TIMEOUT
    log "$step: $command"
    started=$(date +%s)
    STEP_PID_FILE=$CACHE/.step.pid
    : >"$STEP_PID_FILE"; rm -f "$CACHE/.step.status"
    set +e
    ( in_root "$timeout" "$command" 2>&1 & echo $! >"$STEP_PID_FILE"; wait $!; echo $? >"$CACHE/.step.status" ) \
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
