#!/usr/bin/env bash
# Set up (idempotent, see install.sh), lint, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
"${VENV:-.venv}/bin/ruff" check .  # configured in pyproject.toml; a finding fails the run before the long tests
exec "${VENV:-.venv}/bin/python" -m pytest -q -rs "$@"
