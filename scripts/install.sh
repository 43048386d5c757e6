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
# debootstrap: the test suite's check of the edge install in a Debian trixie root file system
# (tests/test_trixie_edge.py), and chromium + its WebDriver: the browser the report and serve tests drive, headless;
# so only on x86-64, where the suite and CI run; the boards do without.
[ "$(uname -m)" != x86_64 ] || SYSTEM_PACKAGES+=" debootstrap chromium chromium-driver"

# TensorFlow 2.15 (and so Horovod 0.28.1) has wheels for CPython 3.9 to 3.11 only: refuse another Python now,
# saying what to do, rather than after the apt step and a pip resolution that ends in "no matching distribution".
TRAIN_PYTHON=3.11
if [ -x "$VENV/bin/python" ]; then INTERPRETER=$VENV/bin/python; else INTERPRETER=$PYTHON; fi
python_version=$("$INTERPRETER" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo unknown)
if [ "$python_version" != "$TRAIN_PYTHON" ]; then
    [ "$INTERPRETER" = "$PYTHON" ] || made_with=" (remove $VENV first: it was made with that Python)"
    cat >&2 <<EOF
error: the training install needs Python $TRAIN_PYTHON, and $INTERPRETER is Python $python_version: TensorFlow 2.15
and Horovod 0.28.1 are built for Python 3.9 to 3.11 (Raspberry Pi OS trixie and Debian 13 ship 3.13).
  To classify only (covidxray predict, no TensorFlow), any Python 3.11 to 3.13 does:
      python3 -m venv ~/cx && ~/cx/bin/pip install --only-binary=:all: "$PWD[edge]"
  To train, install a Python $TRAIN_PYTHON beside the system one (e.g. \`uv python install $TRAIN_PYTHON\`), then run
      PYTHON=/path/to/python$TRAIN_PYTHON bash scripts/install.sh${made_with:-}
  docs/cluster.md, section 1.2, has both.
EOF
    exit 2
fi

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
$PIP install -q -e ".[train,dev,serve]"

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
