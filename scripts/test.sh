#!/usr/bin/env bash
# Set up (idempotent, see install.sh) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${VENV:-.venv}/bin/python" -m pytest -q -rs "$@"
