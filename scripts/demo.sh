#!/usr/bin/env bash
# Set up (idempotent, see install.sh) and run the whole product on the embedded phantom data set.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${VENV:-.venv}/bin/covidxray" demo "$@"
