# Sourced by scripts/arm64_check.sh and scripts/edge_check.sh: a cached Debian root file system made by
# debootstrap, entered with chroot (arm64 ones through qemu-user-static), its mounts always undone.
# Needs root. Callers set -euo pipefail.

MIRROR=${DEBIAN_MIRROR:-${ARM64_MIRROR:-$(sed -n 's/^URIs: *\([^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)}}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
# Raspberry Pi 4 = Cortex-A72 (ARMv8.0): emulating that core, not QEMU's default "max", also checks that the
# wheels use no instruction a Pi lacks.
export QEMU_CPU=${QEMU_CPU:-cortex-a72}

require_tools() {  # require_tools ARCH: root, debootstrap, chroot, and the emulator for a foreign ARCH
    [ "$(id -u)" = 0 ] || { echo "error: run as root (debootstrap, chroot and mounts need it)" >&2; exit 2; }
    local tools=(debootstrap chroot)
    [ "$1" != arm64 ] || tools+=(qemu-aarch64-static update-binfmts)
    for tool in "${tools[@]}"; do
        command -v "$tool" >/dev/null || { echo "error: $tool missing: apt-get install debootstrap${tools[2]:+ qemu-user-static binfmt-support}" >&2; exit 2; }
    done
    [ "$1" != arm64 ] || ensure_binfmt
}

# --- mounts, always undone (also on Ctrl-C / kill) -------------------------------------------------------
MOUNTED=()
unmount_all() {
    local i
    for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do
        umount "${MOUNTED[i]}" 2>/dev/null || umount -l "${MOUNTED[i]}" 2>/dev/null || echo "warning: could not unmount ${MOUNTED[i]}" >&2
    done
    MOUNTED=()
}

mount_in_root() {  # mount_in_root TARGET mount-args...: mount once, remember it for unmount_all
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

ensure_rootfs() {  # ensure_rootfs ROOT ARCH SUITE PACKAGES: debootstrap once; ROOT/.complete marks a finished one
    local root=$1 arch=$2 suite=$3 packages=$4
    if [ -e "$root/.complete" ] || [ -e "$root/.arm64-check-complete" ]; then  # (the second: older arm64 checks)
        echo "reusing root file system $root"
        return
    fi
    echo "debootstrap $arch $suite from $MIRROR into $root"
    # Never rm -rf through a bind mount of the host's /dev or /proc left by a killed run.
    if grep -q " $root/" /proc/mounts; then
        echo "error: something is still mounted under $root (see /proc/mounts): unmount it first" >&2; exit 1
    fi
    rm -rf "$root"
    nice -n "${NICE:-10}" debootstrap --arch="$arch" --variant=minbase --include="$packages" "$suite" "$root" "$MIRROR"
    touch "$root/.complete"
}

mount_root() {  # mount_root ROOT ARCH: what a chroot needs to resolve names, verify TLS, see devices and run pip
    local root=$1 arch=$2
    cp /etc/resolv.conf "$root/etc/resolv.conf"
    # debootstrap's minbase writes no /etc/hosts; Raspberry Pi OS ships one. Without it nothing resolves
    # `localhost`, and horovodrun's ssh check of `-H localhost:2` fails.
    [ -s "$root/etc/hosts" ] || printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t%s\n' \
        "$(hostname)" >"$root/etc/hosts"
    # The host's CA bundle, for networks whose HTTPS proxy has its own CA (pip gets it through PIP_CERT).
    cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/host-ca-certificates.crt"
    mount_in_root "$root/proc" -t proc proc
    mount_in_root "$root/sys" -t sysfs sysfs
    mount_in_root "$root/dev" --bind /dev
    mount_in_root "$root/dev/pts" --bind /dev/pts
    if [ "$arch" = arm64 ]; then
        # QEMU 7.2 passes the host's x86 /proc/cpuinfo through, and LiteRT's Interpreter() crashes parsing it;
        # show the guest what a Raspberry Pi 4 reports instead.
        printf 'processor\t: %s\nBogoMIPS\t: 108.00\nFeatures\t: fp asimd evtstrm crc32 cpuid\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd08\nCPU revision\t: 3\n\n' \
            $(seq 0 $(($(nproc) - 1))) >"$root/../cpuinfo-pi4"
        mount_in_root "$root/proc/cpuinfo" --bind "$root/../cpuinfo-pi4"
    fi
}

copy_checkout() {  # copy_checkout PROJECT DEST: the working tree as a user's clone (uncommitted fixes too), no venvs/builds
    mkdir -p "$2"
    (cd "$1" && { git ls-files -z --cached --others --exclude-standard 2>/dev/null || find . -type f -print0; }) \
        | rsync -a --from0 --files-from=- "$1/" "$2/"
}

set_chroot_command() {  # set_chroot_command ROOT: CHROOT_COMMAND runs what follows inside ROOT, clean environment
    CHROOT_COMMAND=(chroot "$1" /usr/bin/env -i HOME=/root LANG=C.UTF-8
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin QEMU_CPU="$QEMU_CPU"
        PIP_CERT=/etc/ssl/host-ca-certificates.crt SSL_CERT_FILE=/etc/ssl/host-ca-certificates.crt)
}
