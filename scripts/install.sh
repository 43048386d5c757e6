#!/usr/bin/env bash
# One idempotent setup for a fresh Debian / Raspberry Pi OS 64-bit machine:
# system packages, a virtualenv, TensorFlow + covidxray, then Horovod compiled against that TF.
# Re-running skips whatever is already in place.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
HOROVOD_VERSION=0.28.1
# cmake/g++ build Horovod; MPICH gives it the MPI controller besides Gloo;
# openssh/rsync are what horovodrun and the cluster scripts use between boards;
# python3-venv and python3-dev (Python.h for Horovod) are missing from Raspberry Pi OS Lite and Debian minimal.
SYSTEM_PACKAGES="cmake g++ make mpich libmpich-dev openssh-client openssh-server rsync python3-venv python3-dev"

missing_system_packages() {
    for pkg in $SYSTEM_PACKAGES; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || echo "$pkg"
    done
}

if command -v apt-get >/dev/null && [ "${COVIDXRAY_SKIP_APT:-0}" != 1 ]; then
    missing=$(missing_system_packages | tr '\n' ' ')
    if [ -n "${missing// /}" ]; then
        SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
        echo "==> apt-get install $missing"
        $SUDO apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating virtualenv $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade "pip>=24" wheel setuptools

echo "==> installing covidxray and its pinned dependencies"
$PIP install -q -e ".[train,dev]"

if "$VENV/bin/python" -c "import horovod, horovod.tensorflow as h; assert horovod.__version__ == '$HOROVOD_VERSION'" 2>/dev/null; then
    echo "==> horovod $HOROVOD_VERSION already built"
else
    echo "==> building horovod $HOROVOD_VERSION against the installed TensorFlow (a few minutes)"
    HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
        MAKEFLAGS="-j$(nproc)" \
        $PIP install -q --no-build-isolation --no-cache-dir "horovod==$HOROVOD_VERSION"
fi
# Guard against drift: anything that pulled TF >= 2.16, Keras 3 or numpy 2 breaks Horovod and TF 2.15.
TF_CPP_MIN_LOG_LEVEL=2 "$VENV/bin/python" - <<'PY'
import numpy, tensorflow as tf
assert tf.__version__ == "2.15.1", f"tensorflow {tf.__version__} installed, covidxray needs 2.15.1"
assert numpy.__version__.startswith("1."), f"numpy {numpy.__version__} installed, TF 2.15 needs numpy<2"
PY
TF_CPP_MIN_LOG_LEVEL=2 "$VENV/bin/horovodrun" --check-build
echo "==> done: activate with 'source $VENV/bin/activate'"
